"""autopar.runtime: execution of rewritten per-rank graphs on torch.distributed."""
