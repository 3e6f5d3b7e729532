"""``autopar.full_state_dict(pm)``: the original model's whole state dict on rank 0.

Every rank calls it (it is a collective). Each rank's ``pm.state_dict()`` is whole per tensor
already (tensor-axis DTensors are assembled, ZeRO-3 pieces and ep experts gathered); a pipeline
rank holds only its stages' entries. Ranks then agree, through one all-gather of which keys each
holds (and their dtypes), who sends what: rank 0 receives every entry it lacks from the lowest
rank holding it, by point-to-point sends of tensors whose shape and dtype both sides already
know (nothing is unpickled). A tied second name (``lm_head.weight`` beside
``embed_tokens.weight``) gets its tensor. The result has exactly the original model's keys, so
``model.load_state_dict(full, strict=True)`` works; an entry no rank holds is a
:class:`CheckpointError` naming it on every rank, never a silently shorter dict. Other ranks get
``{}``. Everything passes through rank 0's CPU memory: for a model larger than one host, save a
sharded checkpoint with :func:`autopar.save` instead.
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
    from autopar.runtime.agreement import collective_device
    shapes = getattr(module, "global_shapes", None)
    if shapes is None:
        raise CheckpointError("full_state_dict takes the model autopar.parallelize returned",
                              where="autopar.full_state_dict", got=type(module).__name__,
                              fix="pm = autopar.parallelize(model, mesh, inputs); autopar.full_state_dict(pm)")
    mine = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in module.state_dict().items()}
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
            owner[k] = (who, _DTYPES[int(table[who][0, i]) - 1])
            continue
        some = next((r for r, t in enumerate(table) if t[1, i] > 0), None)
        if aliases.get(k) in assembled:          # a tied second name of a tensor assembled above
            assembled[k] = assembled[aliases[k]]
            owner[k] = (0, assembled[k].dtype)
        elif some is not None:          # nobody holds it whole: assembled from every rank's boxes
            assembled[k] = _assemble(parts.get(k), tuple(shapes[k]), _DTYPES[int(table[some][1, i]) - 1],
                                     device, distributed)
            owner[k] = (0, assembled[k].dtype)
    missing = [k for k in keys if k not in owner]
    if missing:
        raise CheckpointError(f"{len(missing)} entries of the model's state dict are held by no rank",
                              where="autopar.full_state_dict", got=", ".join(missing[:6]) + (" ..." if len(missing) > 6
                                                                                               else ""),
                              fix="save with autopar.save (sharded) and report this model: every entry should "
                                  "live on some rank")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        who, dtype = owner[k]
        if k in assembled:
            if rank == 0:
                out[k] = assembled[k].cpu().clone()
            continue
        if who == 0:
            if rank == 0:
                out[k] = mine[k].cpu().clone()
            continue
        if rank == who:
            dist.send(mine[k].contiguous().to(device), dst=0)
        elif rank == 0:
            buf = torch.empty(shapes[k], dtype=dtype, device=device)
            dist.recv(buf, src=who)
            out[k] = buf.cpu()
    return out if rank == 0 else {}


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


__all__ = ["full_state_dict"]
