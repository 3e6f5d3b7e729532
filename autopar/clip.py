"""Gradient clipping by the norm of the whole model's gradient, when every rank holds only
pieces of it.

``torch.nn.utils.clip_grad_norm_`` on one rank's parameters sees that rank's pieces: under
tensor parallelism a split weight's other columns are missing, under ZeRO the other data
ranks' pieces, in a pipeline the other stages; and a replicated parameter (a norm's weight
on every tensor rank, a dense weight on every data rank under ZeRO-0) would be counted once
per copy. :func:`clip_grad_norm_` instead finds, once, which boxes of which whole parameter
each rank's stepped tensors hold (the checkpoint's layouts, :mod:`autopar.checkpoint`),
lets the lowest rank holding a box count it, and sums the squares over the process group in
one all-reduce: the norm is the single-process model's, whatever the layout. Every
gradient is then scaled by ``max_norm / (norm + 1e-6)`` when that is below 1, as torch does.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError, OptimizerError

_EPS = 1e-6      # as torch.nn.utils.clip_grad_norm_


def _entries(module: Any, optimizer: Any) -> list[tuple[str, Any, torch.Tensor]]:
    from autopar.checkpoint.layout import optimizer_entries
    from autopar.core.errors import CheckpointError
    try:
        return optimizer_entries(module, optimizer)[1]
    except CheckpointError as exc:
        raise OptimizerError("clip_grad_norm_ takes the parallel model and the optimizer that steps it",
                             where="autopar.clip_grad_norm_", got=type(optimizer).__name__,
                             fix="pass pm and the optimizer autopar.optimizer(pm, ...) returned") from exc


def _owned(entries: list, optimizer: Any) -> list[list[bool]]:
    """For each entry, for each box it holds: does this rank count it (the lowest rank that
    holds the same box of the same parameter)? One all_gather_object, cached on the optimizer."""
    keys = [[f"{key}@{off}+{size}" for off, size, _ in lay.pieces(t)] for key, lay, t in entries]
    cached = getattr(optimizer, "_autopar_clip_owned", None)
    if cached is not None and cached[0] == keys:
        return cached[1]
    mine = sorted({k for ks in keys for k in ks})
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    first: dict[str, int] = {}
    for r, ks in enumerate(every):
        for k in ks:
            first.setdefault(k, r)
    me = dist.get_rank() if dist.is_initialized() else 0
    owned = [[first[k] == me for k in ks] for ks in keys]
    try:
        optimizer._autopar_clip_owned = (keys, owned)
    except AttributeError:
        pass
    return owned


@torch.no_grad()
def clip_grad_norm_(module: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients ``optimizer`` is about to step so their whole-model norm is at most
    ``max_norm``; return that norm (before clipping), the same on every rank. Call it on
    every rank after backward and before ``optimizer.step()``. ``norm_type`` is 2 (or any
    p > 0) or ``inf``. Under fp16 loss scaling the gradients are unscaled first; when some
    rank has an inf or nan the step will be skipped, nothing is clipped and ``inf`` is
    returned."""
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0
            and math.isfinite(max_norm)):
        raise ConfigError("max_norm must be a positive finite number", where="autopar.clip_grad_norm_",
                          got=repr(max_norm), fix="e.g. autopar.clip_grad_norm_(pm, opt, 1.0)")
    p = float(norm_type)
    if not (p > 0):
        raise ConfigError("norm_type must be positive or inf", where="autopar.clip_grad_norm_",
                          got=repr(norm_type), fix="use 2.0 (the default) or float('inf')")
    from autopar.runtime.optim import ShardedOptimizer
    if isinstance(optimizer, ShardedOptimizer) and not optimizer.prepare_grads():
        return torch.tensor(float("inf"))
    entries = _entries(module, optimizer)
    owned = _owned(entries, optimizer)
    device = next((t.device for _, _, t in entries), torch.device("cpu"))
    if dist.is_initialized() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (key, lay, t), mine in zip(entries, owned):
        if t.grad is None or not any(mine):
            continue
        for (_, _, box), counts in zip(lay.pieces(t.grad), mine):
            if counts and box.numel():
                g = box.detach().to(torch.float64)
                total = torch.maximum(total, g.abs().max()) if p == math.inf else total + g.abs().pow(p).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM)
    norm = total if p == math.inf else total.pow(1.0 / p)
    coef = (max_norm / (norm + _EPS)).clamp(max=1.0)
    if coef.item() < 1.0:
        for _, _, t in entries:
            if t.grad is not None:
                t.grad.mul_(coef.to(t.grad.dtype))
    dtype = next((t.grad.dtype for _, _, t in entries if t.grad is not None), torch.float32)
    return norm.to(dtype)
