"""autopar.passes."""
