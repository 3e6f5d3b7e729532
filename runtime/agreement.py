"""Ranks agree before they build: :func:`check_agreement`.

Every rank must call :func:`autopar.parallelize` with the same model structure, mesh and
options. A rank that does not (another model size, another ``zero_stage``) would otherwise
meet the others in mismatched collectives: a broadcast of differently shaped tensors that
silently fills part of a parameter, a gloo abort, or a wait until the group's timeout.

So, before any other collective, each rank all-gathers a short digest of each field (the
model's parameter and buffer names, shapes and dtypes and its train/eval mode; the mesh; each
option) over the default group, and every rank compares every other rank's digests with rank
0's. A disagreement raises the same :class:`~autopar.core.errors.ConfigError` on every rank, naming
the first disagreeing rank and the fields; a rank that does not arrive within ``timeout_s``
raises a :class:`~autopar.core.errors.PeerFailureError` on the ranks that did.
"""
from __future__ import annotations

import datetime
import hashlib
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import ConfigError, PeerFailureError

__all__ = ["check_agreement", "differing", "fingerprint", "rendezvous"]

TIMEOUT_S = 10.0


def collective_device(group: Any = None) -> torch.device:
    """Where a collective's tensor must live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest(value: Any) -> int:
    """A 63-bit digest of ``repr(value)`` (fits an int64 tensor element)."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little") >> 1


def _structure(model: nn.Module) -> tuple:
    """What must be the same on every rank: names, shapes and dtypes of the parameters and
    buffers (not their values: ``sync_params`` takes rank 0's), which are trainable, the mode."""
    params = tuple((k, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for k, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((k, tuple(b.shape), str(b.dtype)) for k, b in model.named_buffers())
    return type(model).__qualname__, params, buffers, model.training


def _plain(value: Any) -> Any:
    """A repr-stable form of an option (a function by its qualified name, a plan by its JSON)."""
    if callable(value) and not isinstance(value, nn.Module):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, Mapping):
        return sorted((str(k), _plain(v)) for k, v in value.items())
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    return value


def fingerprint(model: nn.Module, mesh: Any, options: Mapping[str, Any]) -> dict[str, int]:
    """Field name -> digest, in a fixed order: ``model``, ``mesh``, then the options by name."""
    mesh_form = (tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)) if hasattr(mesh, "mesh_dim_names") \
        else _plain(mesh)
    fields = {"model": _digest(_structure(model)), "mesh": _digest(mesh_form)}
    for name in sorted(options):
        fields[name] = _digest(_plain(options[name]))
    return fields


def check_agreement(model: nn.Module, mesh: Any, options: Mapping[str, Any], *,
                    timeout_s: float = TIMEOUT_S) -> None:
    """Raise on every rank if the ranks' ``parallelize`` calls differ (module docstring)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fields = fingerprint(model, mesh, options)
    names = list(fields)
    world, rank = dist.get_world_size(), dist.get_rank()
    # the field count first travels inside the vector, so ranks with different option sets
    # still exchange equally long vectors
    width = 64
    mine = torch.zeros(width + 1, dtype=torch.int64, device=collective_device())
    mine[0] = len(names)
    mine[1:1 + min(len(names), width)] = torch.tensor([fields[k] for k in names][:width], dtype=torch.int64,
                                                       device=mine.device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:     # gloo raises a RuntimeError on timeout, NCCL a DistBackendError
        raise PeerFailureError(f"not every rank reached autopar.parallelize within {timeout_s:g} s",
                               where=f"parallelize, rank {rank}",
                               got=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                               fix="call autopar.parallelize on every rank of the process group, with the same "
                                   "model and options; look at the other ranks' errors") from None
    gathered = [g.cpu() for g in gathered]
    ref = gathered[0]
    for r in range(1, world):
        other = gathered[r]
        if torch.equal(other, ref):
            continue
        if other[0] != ref[0]:
            differ = ["options (a different set of them)"]
        else:
            differ = [names[i] for i in range(min(len(names), width)) if other[1 + i] != ref[1 + i]]
        raise ConfigError(f"rank {r} called autopar.parallelize differently from rank 0: {', '.join(differ)}",
                          where=f"parallelize (checked on rank {rank})",
                          expected="the same model structure (names, shapes, dtypes, mode), mesh and options "
                                   "on every rank",
                          fix=f"make rank {r} build the same model and pass the same "
                              f"{'/'.join(differ)} as rank 0 (seed differences in weights are fine: rank 0's are "
                              f"broadcast)")


_SMALL = 1 << 16   # bytes: smaller tensors are checksummed together (differing)
_PERIOD = 256     # the checksums read a tensor's 8-byte words as rows of this many


def checksums(t: torch.Tensor) -> torch.Tensor:
    """Two 64-bit sums (wrapping) of ``t``'s bytes read as 64-bit integers in rows of
    :data:`_PERIOD`: word ``(i, j)`` weighted by ``2j+1`` in one and by ``(2i+1)(2j+1)`` in the
    other, both from one pass of per-row weighted sums. Integer sums are exact and
    order-independent, so equal tensors give equal sums on every rank and device; every weight
    is odd, so invertible modulo 2**64, and changing any bits of one word changes both sums;
    swapping two different words changes the first when they are in different columns and the
    second when they are in one column (unless they differ by a multiple of 2**63). 100 MB takes
    about 9 ms on one CPU core (a float sum would let a one-ulp difference vanish)."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    n8 = raw.numel() // 8
    words = (raw if raw.numel() == 8 * n8 else raw[:8 * n8]).view(torch.int64)
    rows_n = n8 // _PERIOD
    odd = _odd(rows_n + 2, raw.device)                  # 1, 3, 5, ...: the rows' weights
    cols = _odd(_PERIOD, raw.device)
    per_row = _row_sums(words[:rows_n * _PERIOD].view(rows_n, _PERIOD), cols)
    by_col = per_row.sum()
    by_both = (per_row * odd[:rows_n]).sum()
    rest = words[rows_n * _PERIOD:]                      # a short last row
    if rest.numel():
        last = (rest * cols[:rest.numel()]).sum()
        by_col += last
        by_both += last * odd[rows_n]
    if raw.numel() > 8 * n8:                             # the bytes after the last whole word: a row of their own
        tail = (raw[8 * n8:].to(torch.int64) * cols[:raw.numel() - 8 * n8]).sum()
        by_col += tail
        by_both += tail * odd[rows_n + 1]
    return torch.stack([by_col, by_both])


def _row_sums(grid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``grid @ weights`` in wrapping 64-bit integers: a matrix-vector product on the CPU (one
    pass, at memory speed), multiply-and-sum elsewhere (CUDA has no integer matmul); the same
    numbers either way."""
    if grid.device.type == "cpu":
        return grid @ weights
    return (grid * weights).sum(1)


_ODD: dict[torch.device, torch.Tensor] = {}


def _odd(n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` odd numbers as int64 on ``device`` (kept, so each checksum makes none)."""
    have = _ODD.get(device)
    if have is None or have.numel() < n:
        have = _ODD[device] = torch.arange(1, 2 * max(n, 4096), 2, dtype=torch.int64, device=device)
    return have[:n]


def differing(tensors: list[torch.Tensor]) -> list[int]:
    """Indices of the tensors whose values differ from rank 0's on some rank (every rank gets
    the same list: each all-gathers the others' :func:`checksums`; tensors under ``_SMALL``
    bytes are checksummed as one group, listed together when any of them differs). Where the
    list is empty the ranks already agree and taking rank 0's values would move nothing."""
    if not tensors:
        return []
    device = collective_device()
    # tensors under _SMALL bytes (biases, norms) are summed as one byte stream per device, so
    # a model's many small tensors cost one checksum; the group differs or agrees as a whole
    groups: dict[Any, list[int]] = {}
    singles: list[int] = []
    for i, t in enumerate(tensors):
        if t.numel() * t.element_size() < _SMALL:
            groups.setdefault(t.device, []).append(i)
        else:
            singles.append(i)
    members = [[i] for i in singles] + list(groups.values())
    sums = [checksums(tensors[i]) for i in singles]
    sums += [checksums(torch.cat([tensors[i].detach().reshape(-1).view(torch.uint8) for i in g]))
             for g in groups.values()]
    mine = torch.stack([c.to(device) for c in sums])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    ref = gathered[0]
    same = torch.stack([(g == ref).all(1) for g in gathered]).all(0).cpu()
    return sorted(i for ok, ids in zip(same.tolist(), members) if not ok for i in ids)


def rendezvous(group_name: str, what: str, timeout_s: float) -> None:
    """Wait at most ``timeout_s`` for every rank of ``group_name`` to reach this point, before a
    collective only some ranks might call (``what`` says which); raise a PeerFailureError naming
    it instead of hanging. After a timeout the group holds an unmatched collective: the process
    must stop."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    flag = torch.ones(1, device=collective_device(group))
    work = dist.all_reduce(flag, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:   # gloo: RuntimeError on timeout; NCCL: DistBackendError
        raise PeerFailureError(f"{what} is collective, and not every rank called it within {timeout_s:g} s",
                               where=what, got=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                               fix=f"call {what} on every rank of the data axis at the same point (e.g. after "
                                   f"opt.step()), or use autopar.save, which every rank calls; this process "
                                   f"group cannot be used after this error") from None
