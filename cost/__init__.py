"""autopar.cost."""
