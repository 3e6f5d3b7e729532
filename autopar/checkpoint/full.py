"""``autopar.full_state_dict(pm)``: the original model's whole state dict on rank 0; and the
whole state dict on every rank, which a pipeline's ``state_dict()`` returns.

Every rank calls them (they are collectives). Each rank's own entries (``pm.state_dict()``, a
pipeline rank's ``pm.local_state_dict()``) are whole per tensor already (tensor-axis DTensors are
assembled, ZeRO-3 pieces and ep experts gathered), except a pipeline stage's tensor-axis shards;
a pipeline rank holds only its stages' entries. Ranks then agree, through one all-gather of
which keys each holds (and their dtypes), who sends what: rank 0 receives every entry it lacks
from the lowest rank holding it, by point-to-point sends (or, for every rank, broadcasts) of
tensors whose shape and dtype both sides already know (nothing is unpickled). A tensor no rank
holds whole is assembled from every rank's boxes of it. A tied second name
(``lm_head.weight`` beside ``embed_tokens.weight``) gets its tensor. The result has exactly the
original model's keys, so ``model.load_state_dict(full, strict=True)`` works; an entry no rank
holds is a :class:`CheckpointError` naming it on every rank, never a silently shorter dict.
``full_state_dict`` gives other ranks ``{}``; everything passes through rank 0's CPU memory:
for a model larger than one host, save a sharded checkpoint with :func:`autopar.save` instead.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.core.errors import CheckpointError

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def full_state_dict(module: Any) -> dict[str, torch.Tensor]:
    """The whole state dict of a model from :func:`autopar.parallelize` on rank 0 (CPU tensors,
    the original model's keys and shapes); ``{}`` on every other rank."""
    out = _gathered(module, everywhere=False)
    return {k: v.cpu().clone() for k, v in out.items()}


def every_rank_state_dict(module: Any, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The whole state dict on every rank (a pipeline's ``state_dict()``): the original model's
    keys in its order; what this rank holds whole is returned as it holds it (detached unless
    ``keep_vars``), the rest is broadcast from the lowest rank holding it, or assembled from
    every rank's tensor-axis boxes. Every rank calls it (a collective)."""
    return _gathered(module, everywhere=True, keep_vars=keep_vars)


def _local_state(module: Any, keep_vars: bool) -> dict[str, torch.Tensor]:
    local = getattr(module, "local_state_dict", None)
    sd = local(keep_vars=keep_vars) if local is not None else module.state_dict(keep_vars=keep_vars)
    out = {}
    for k, v in sd.items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = v if keep_vars else v.detach()
    return out


def _gathered(module: Any, *, everywhere: bool, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """Whole entries of ``module``'s state dict: on rank 0 only, or on every rank."""
    from autopar.runtime.agreement import collective_device
    shapes = getattr(module, "global_shapes", None)
    if shapes is None:
        raise CheckpointError("full_state_dict takes the model autopar.parallelize returned",
                              where="autopar.full_state_dict", got=type(module).__name__,
                              fix="pm = autopar.parallelize(model, mesh, inputs); autopar.full_state_dict(pm)")
    mine = _local_state(module, keep_vars)
    aliases = {a: n for a, n in getattr(module, "param_aliases", {}).items() if a != n}
    keys = list(shapes)
    for alias, name in aliases.items():        # a tied second name: the tensor under its first name
        if alias not in mine and name in mine:
            mine[alias] = mine[name]
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cpu")
    # per key: 0 if this rank does not hold it, else 1 + the index of its dtype
    whole = {k for k, v in mine.items() if k in shapes and tuple(v.shape) == tuple(shapes[k]) and v.dtype in _DTYPES}
    # and the boxes of the keys this rank holds only in part (a pipeline stage's tensor-axis shards)
    parts = _pieces(module, shapes, whole)
    held = torch.tensor([[1 + _DTYPES.index(mine[k].dtype) if k in whole else 0 for k in keys],
                         [1 + _DTYPES.index(parts[k][0].dtype) if k in parts else 0 for k in keys]],
                        dtype=torch.int64)
    if distributed:
        device = collective_device()
        table = [torch.empty_like(held, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(table, held.to(device))
        table = [t.cpu() for t in table]
    else:
        table = [held]
    owner, assembled = {}, {}
    for i, k in enumerate(keys):
        who = next((r for r, t in enumerate(table) if t[0, i] > 0), None)
        if who is not None:
            owner[k] = (who, _DTYPES[int(table[who][0, i]) - 1], all(t[0, i] > 0 for t in table))
            continue
        some = next((r for r, t in enumerate(table) if t[1, i] > 0), None)
        if aliases.get(k) in assembled:          # a tied second name of a tensor assembled above
            assembled[k] = assembled[aliases[k]]
            owner[k] = (0, assembled[k].dtype, True)
        elif some is not None:          # nobody holds it whole: assembled from every rank's boxes
            assembled[k] = _assemble(parts.get(k), tuple(shapes[k]), _DTYPES[int(table[some][1, i]) - 1],
                                     device, distributed)
            owner[k] = (0, assembled[k].dtype, True)
    missing = [k for k in keys if k not in owner]
    if missing:
        raise CheckpointError(f"{len(missing)} entries of the model's state dict are held by no rank",
                              where="autopar.full_state_dict", got=", ".join(missing[:6]) + (" ..." if len(missing) > 6
                                                                                               else ""),
                              fix="save with autopar.save (sharded) and report this model: every entry should "
                                  "live on some rank")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        who, dtype, everyone = owner[k]
        if k in assembled:
            if everywhere or rank == 0:
                out[k] = assembled[k]
        elif everywhere and everyone:
            out[k] = mine[k]
        elif everywhere:                 # from the lowest rank holding it, to every rank
            buf = (mine[k].detach().contiguous().to(device) if rank == who
                   else torch.empty(shapes[k], dtype=dtype, device=device))
            dist.broadcast(buf, src=who)
            out[k] = mine[k] if rank == who else buf
        elif who == 0:
            if rank == 0:
                out[k] = mine[k]
        elif rank == who:
            dist.send(mine[k].detach().contiguous().to(device), dst=0)
        elif rank == 0:
            buf = torch.empty(shapes[k], dtype=dtype, device=device)
            dist.recv(buf, src=who)
            out[k] = buf
    return out if everywhere or rank == 0 else {}


def load_whole_state_dict(module: Any, state_dict: Any, strict: bool = True) -> Any:
    """Load the whole model's state dict (the original model's keys and shapes) into a parallel
    module whose ranks each hold part of it (a pipeline): every rank copies its own boxes of each
    entry into what it holds. ``strict`` as in torch: missing or unexpected keys raise; a shape
    that is not the model's always does. Returns torch's ``(missing_keys, unexpected_keys)``."""
    from torch.nn.modules.module import _IncompatibleKeys

    from autopar.checkpoint.layout import model_entries
    shapes = module.global_shapes
    aliases = {a: n for a, n in getattr(module, "param_aliases", {}).items() if a != n}
    missing = [k for k in shapes if k not in state_dict]        # as torch counts them: tied names too
    unexpected = [k for k in state_dict if k not in shapes]
    wrong = [f"{k}: {tuple(v.shape)} for {tuple(shapes[k])}" for k, v in state_dict.items()
             if k in shapes and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(shapes[k])]
    where = f"{type(module).__name__}.load_state_dict"
    if wrong:
        raise CheckpointError(f"{len(wrong)} entries do not have the model's shapes", where=where,
                              got="; ".join(wrong[:4]) + (" ..." if len(wrong) > 4 else ""),
                              fix="load the state dict of this model (pm.state_dict(), autopar.full_state_dict "
                                  "or the original model's state_dict())")
    if strict and (missing or unexpected):
        raise CheckpointError("the state dict does not have the model's keys", where=where,
                              got=f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                                  f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}",
                              fix="load a state dict of this model, or pass strict=False to load the keys it has")
    with torch.no_grad():
        for key, lay, t in model_entries(module):
            value = state_dict.get(key)
            if value is None:
                value = next((state_dict[a] for a, n in aliases.items() if n == key and a in state_dict), None)
            if value is None:
                continue
            value = value.full_tensor() if isinstance(value, DTensor) else value
            for offsets, sizes, view in lay.pieces(t.detach()):
                view.copy_(value[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    return _IncompatibleKeys(missing, unexpected)


def _pieces(module: Any, shapes: dict, whole: set) -> dict[str, tuple[torch.Tensor, list]]:
    """key -> (a local tensor, its boxes ``(whole offsets, sizes, view)``) for the entries this
    rank holds but not whole, from the checkpoint layout (:func:`autopar.checkpoint.layout.model_entries`)."""
    from autopar.checkpoint.layout import model_entries
    out = {}
    for key, lay, t in model_entries(module):
        if key in shapes and key not in whole and t.dtype in _DTYPES:
            out[key] = (t, lay.pieces(t.detach()))
    return out


def _assemble(mine: tuple | None, shape: tuple, dtype: torch.dtype, device: torch.device,
              distributed: bool) -> torch.Tensor:
    """The whole tensor from every rank's boxes of it: each rank fills what it holds into a
    tensor of the lowest value its dtype has, and an all-reduce takes the maximum (replicas hold
    equal values, so the result is exact, with no arithmetic on them). Every rank calls it."""
    work = torch.uint8 if dtype == torch.bool else dtype
    lowest = -torch.inf if work.is_floating_point or work.is_complex else torch.iinfo(work).min
    buf = torch.full(shape, lowest, dtype=work, device=device)
    if mine is not None:
        for offsets, sizes, view in mine[1]:
            buf[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = view.to(device=device, dtype=work)
    if distributed:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.to(dtype)


__all__ = ["every_rank_state_dict", "full_state_dict", "load_whole_state_dict"]
