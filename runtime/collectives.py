"""The collective node the rewrite inserts: ``torch.ops.autopar.redistribute``.

One op converts a tensor between placements on one mesh axis. Forward runs the step
:func:`autopar.core.placement.transition` gives for the value (producer's placement to the
consumer's); backward runs the step it gives for the gradient (the gradient the consumer
emits to the one the producer needs). The communication itself is torch's functional
collectives (``torch.ops._c10d_functional.*`` followed by ``wait_tensor``), called with
autograd off: their own registered backward assumes every gradient is partial, which is
wrong for a replicated value with a replicated gradient (it would multiply by the axis
size), so the backward here is chosen by placement instead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 - registers the c10d functional ops

from autopar.core.placement import Spec, Step, transition

c10d = torch.ops._c10d_functional


def all_gather_start(x: torch.Tensor, n: int, group_name: str, rank: int | None = None) -> torch.Tensor:
    """Start gathering ``x`` from the ``n`` ranks of the group, concatenated along dim 0 in rank
    order (``torch.ops._c10d_functional.all_gather_into_tensor``'s result); wait on it with
    ``c10d.wait_tensor``.

    On CPU tensors (gloo) the gather is an all-reduce (sum) of a zero-filled ``n``-row buffer
    holding this rank's piece in its row: exact (every element is one rank's value plus zeros)
    for ``n`` times the bytes. torch 2.13's gloo all-gather corrupts the process's heap now and
    then when it is in flight beside other collectives (a rank dies with ``malloc(): unaligned
    tcache chunk detected`` or a segfault; reproduced with torch alone: a loop of async
    functional all-gather, reduce-scatter and all-reduce on 2 gloo ranks crashed within minutes,
    and the same loop with the all-gather done this way did not). The all-reduce is the
    out-of-place one, which a compiled graph can trace (a backward's gather, traced by AOT
    autograd); ``rank``: this rank's index in the group where the caller has it (a compiled
    graph's, passed in rather than looked up while tracing)."""
    if x.device.type != "cpu" or n == 1:
        return c10d.all_gather_into_tensor(x, n, group_name)
    piece = x.reshape(1) if x.dim() == 0 else x
    wide = torch.uint8 if piece.dtype == torch.bool else piece.dtype
    buf = piece.new_zeros((n, *piece.shape), dtype=wide)
    buf[group_rank(group_name) if rank is None else rank] = piece
    flat = buf.view(n * piece.shape[0], *piece.shape[1:])
    out = c10d.all_reduce(flat, "sum", group_name)
    return out if wide == piece.dtype else _AsBool(out)


class _AsBool:
    """A pending gathered bool tensor (sent as uint8): ``wait`` gives it back as bool."""

    def __init__(self, pending: torch.Tensor) -> None:
        self.pending = pending


def all_gather_wait(pending) -> torch.Tensor:
    """Wait for :func:`all_gather_start`'s result."""
    if isinstance(pending, _AsBool):
        return c10d.wait_tensor(pending.pending).to(torch.bool)
    return c10d.wait_tensor(pending)


def group_rank(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return dist.get_rank(_resolve_process_group(group_name))


def apply_step(x: torch.Tensor, step: Step, group_name: str, n: int, rank: int | None = None) -> torch.Tensor:
    """Run one conversion step on this rank's piece ``x`` (``rank``: this rank's index in the
    group, looked up when not given)."""
    if step.kind == "none" or n == 1:
        return x if step.kind == "none" else _single_rank(x, step)
    if step.kind in ("chunk", "mask", "pad") and rank is None:
        rank = group_rank(group_name)
    if step.kind == "chunk":
        return x.chunk(n, step.dst_dim)[rank].contiguous()
    if step.kind == "mask":
        return x.clone() if rank == 0 else torch.zeros_like(x)
    if step.kind == "pad":
        return _pad(x, step.src_dim, rank, n)
    if step.kind == "all_reduce":
        return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group_name))
    if step.kind == "all_gather":
        return _all_gather(x, step.src_dim, group_name, n, rank)
    if step.kind == "reduce_scatter":
        d = step.dst_dim
        moved = x.movedim(d, 0).contiguous()
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(moved, "sum", n, group_name))
        return out.movedim(0, d).contiguous()
    if step.kind == "all_to_all":
        pieces = torch.stack(x.chunk(n, step.dst_dim)).contiguous()
        got = c10d.wait_tensor(c10d.all_to_all_single(pieces, [1] * n, [1] * n, group_name))
        return torch.cat(got.unbind(0), dim=step.src_dim).contiguous()
    raise ValueError(f"unknown redistribute step {step.kind!r}")


def _single_rank(x: torch.Tensor, step: Step) -> torch.Tensor:
    return x.clone() if step.kind != "none" else x


def _pad(x: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """Shard ``rank`` of ``n`` along ``dim`` to a partial: zeros of the whole shape with
    ``x`` at its slot, so that the sum over ranks is the whole tensor (no communication)."""
    shape = list(x.shape)
    shape[dim] *= n
    out = x.new_zeros(shape)
    out.narrow(dim, rank * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def _all_gather(x: torch.Tensor, dim: int, group_name: str, n: int, rank: int | None = None) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = all_gather_wait(all_gather_start(moved, n, group_name, rank))
    return out.movedim(0, dim).contiguous()


def _out_shape(shape: list[int], step: Step, n: int) -> list[int]:
    shape = list(shape)
    if step.kind in ("chunk", "reduce_scatter"):
        shape[step.dst_dim] //= n
    elif step.kind in ("all_gather", "pad"):
        shape[step.src_dim] *= n
    elif step.kind == "all_to_all":
        shape[step.src_dim] *= n
        shape[step.dst_dim] //= n
    return shape


@torch.library.custom_op("autopar::redistribute", mutates_args=())
def redistribute(x: torch.Tensor, src: str, dst: str, group_name: str, n: int) -> torch.Tensor:
    """Convert ``x`` from spec ``src`` to spec ``dst`` (strings like ``"R/gP"``, ``"S(1)"``)
    along the axis whose process group is ``group_name`` (``n`` ranks)."""
    return _convert(x, src, dst, group_name, n, None)


@torch.library.custom_op("autopar::redistribute_at", mutates_args=())
def redistribute_at(x: torch.Tensor, src: str, dst: str, group_name: str, n: int, rank: int) -> torch.Tensor:
    """:func:`redistribute` on rank ``rank`` of the group, the rank named in the call: what a
    compiled graph runs (``runtime/compiled.py``). Traced, ``redistribute``'s backward would bake
    the rank it looks up into the backward graph as a constant that no compile-cache key sees,
    so a rank sharing the cache directory could load another rank's backward; with the rank an
    argument, each rank's graph says which rank it is."""
    return _convert(x, src, dst, group_name, n, rank)


def _convert(x: torch.Tensor, src: str, dst: str, group_name: str, n: int, rank: int | None) -> torch.Tensor:
    step = transition(Spec.parse(src).value, Spec.parse(dst).value, x.dim())
    out = apply_step(x, step, group_name, n, rank)
    return out.clone() if _aliases(out, x) else out


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@redistribute.register_fake
def _(x: torch.Tensor, src: str, dst: str, group_name: str, n: int) -> torch.Tensor:
    return _fake(x, src, dst, n)


@redistribute_at.register_fake
def _(x: torch.Tensor, src: str, dst: str, group_name: str, n: int, rank: int) -> torch.Tensor:
    return _fake(x, src, dst, n)


def _fake(x: torch.Tensor, src: str, dst: str, n: int) -> torch.Tensor:
    step = transition(Spec.parse(src).value, Spec.parse(dst).value, x.dim())
    return x.new_empty(_out_shape(list(x.shape), step, n))


def _setup(ctx, inputs, output) -> None:
    _, ctx.src, ctx.dst, ctx.group_name, ctx.n, *rank = inputs
    ctx.rank = rank[0] if rank else None


def _backward(ctx, grad: torch.Tensor):
    """The gradient's step, chosen by placement (module docstring); one None per other input."""
    src, dst = Spec.parse(ctx.src), Spec.parse(ctx.dst)
    step = transition(dst.grad, src.grad, grad.dim())
    out = apply_step(grad.contiguous(), step, ctx.group_name, ctx.n, ctx.rank)
    return (out, None, None, None, None) + ((None,) if ctx.rank is not None else ())


redistribute.register_autograd(_backward, setup_context=_setup)
redistribute_at.register_autograd(_backward, setup_context=_setup)


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, group_name: str) -> torch.Tensor:
    """Look up ``indices`` in this rank's rows ``[r*V/n, (r+1)*V/n)`` of the embedding;
    ids owned by other ranks give zeros. Summed over ranks (a ``Partial`` value) this is
    the whole embedding lookup."""
    return vocab_parallel_embedding_at(weight, indices, group_rank(group_name))


def vocab_parallel_embedding_at(weight: torch.Tensor, indices: torch.Tensor, rank: int | torch.Tensor) -> torch.Tensor:
    """:func:`vocab_parallel_embedding` on the rank ``rank`` of its group (what a compiled graph
    calls, with the rank in a buffer: tracing needs no process-group lookup)."""
    rows = weight.shape[0]
    start = rank * rows
    owned = (indices >= start) & (indices < start + rows)
    local = torch.where(owned, indices - start, torch.zeros_like(indices))
    return torch.nn.functional.embedding(local, weight) * owned.unsqueeze(-1).to(weight.dtype)


LOCAL_OPS = {"vocab_parallel_embedding": vocab_parallel_embedding}
