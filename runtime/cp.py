"""Context parallelism's attention: the sequence split over ``cp`` ranks, attention exact.

Layout: the sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, in that order (the load balance Llama 3 and torchtitan use: under a causal
mask an early chunk's queries see few keys and a late one's many, so every rank gets one of
each and the same work). :func:`positions` gives the global positions of a rank's tokens;
:func:`shard` and :func:`unshard` move a tensor between the whole sequence and this layout.

:func:`allgather_attention` is the all-gather kind of context-parallel attention (Llama 3's
choice; cheap with grouped-query attention, whose keys and values are few heads): every rank
gathers the keys and values of the whole sequence (as they are, before any repetition to the
query heads), puts them in global order, and attends its own queries to them under the mask
written in global positions: causal, a sliding window, and the block-diagonal mask of packed
documents (a document id per position). Each query row sees the same keys in the same order as
on one process, so the rows are one process's rows. Backward: the gradients of the gathered
keys and values are summed over the ranks and each rank keeps its own positions' (a
reduce-scatter), which is their gradient on one process.

:func:`alltoall_attention` is the all-to-all kind (Ulysses): one all-to-all trades the sequence
split for a head split, each rank attends ``heads / cp`` heads over the whole sequence as one
process does, and a second all-to-all returns the rows. Its backward is the same exchanges
reversed. It needs ``cp`` to divide the query heads (key heads too few to split are repeated
first).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError
from autopar.runtime.collectives import c10d

__all__ = ["allgather_attention", "alltoall_attention", "attention_mask", "positions", "shard", "unshard"]


def positions(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions of the tokens ``rank`` holds, in the order it holds them."""
    if seq % (2 * cp):
        raise ConfigError(f"a sequence of {seq} tokens does not cut into 2 x {cp} equal chunks",
                          where="context parallelism", expected=f"a multiple of {2 * cp}", got=str(seq),
                          fix=f"pad the sequence to a multiple of {2 * cp} (or use a cp degree that divides it)")
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, last])


def shard(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (sequence along ``dim``)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, x.device))


def unshard(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's tokens (``pieces[r]`` is rank ``r``'s)."""
    cp = len(pieces)
    seq = sum(p.shape[dim] for p in pieces)
    order = torch.cat([positions(seq, cp, r, pieces[0].device) for r in range(cp)])
    out = torch.empty_like(torch.cat(pieces, dim))
    return out.index_copy_(dim, order, torch.cat(pieces, dim))


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim -2 of ``[batch, heads, seq, dim]``) into global order;
    backward sums the gradient over the ranks and keeps this rank's positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, cp: int, rank: int) -> torch.Tensor:
        ctx.group_name, ctx.cp, ctx.rank = group_name, cp, rank
        rows = x.movedim(-2, 0).contiguous()                      # [s_local, ...]
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(rows, cp, group_name))  # [cp * s_local, ...]
        seq = gathered.shape[0]
        order = torch.cat([positions(seq, cp, r, x.device) for r in range(cp)])
        ctx.order = order
        whole = torch.empty_like(gathered).index_copy_(0, order, gathered)
        return whole.movedim(0, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.movedim(-2, 0).index_select(0, ctx.order).contiguous()   # back to rank-major order
        mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(rows, "sum", ctx.cp, ctx.group_name))
        return mine.movedim(0, -2), None, None, None


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None,
          q_doc: torch.Tensor | None, k_doc: torch.Tensor | None) -> torch.Tensor | None:
    """Which keys each query sees (True: attends), in global positions; None: all of them."""
    allowed = None

    def both(a, b):
        return b if a is None else a & b
    if causal:
        allowed = both(allowed, q_pos[:, None] >= k_pos[None, :])
    if window is not None:
        allowed = both(allowed, (q_pos[:, None] - k_pos[None, :]) < window)
    if q_doc is not None:
        allowed = both(allowed, q_doc[..., :, None] == k_doc[..., None, :])
    return allowed


def _group(group: dist.ProcessGroup | str) -> tuple[str, int, int]:
    from torch.distributed.distributed_c10d import _resolve_process_group
    name = group if isinstance(group, str) else group.group_name
    pg = _resolve_process_group(name)
    return name, pg.size(), pg.rank()


def _order(seq: int, cp: int, device: torch.device) -> torch.Tensor:
    """The global position of each token of the ranks' shares laid end to end (rank-major)."""
    return torch.cat([positions(seq, cp, r, device) for r in range(cp)])


def _whole_ids(ids: torch.Tensor, group_name: str, cp: int) -> torch.Tensor:
    """``[batch, seq]`` document ids of the whole sequence from every rank's ``[batch, s_local]``."""
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(ids.t().contiguous(), cp, group_name))
    return torch.empty_like(gathered).index_copy_(0, _order(gathered.shape[0], cp, ids.device), gathered).t()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str) -> None:
    if k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        raise ConfigError("queries, keys and values must hold the same tokens", where=where,
                          got=f"{q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]} positions")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"{k.shape[1]} key heads do not divide {q.shape[1]} query heads", where=where,
                          fix="pass keys and values with a divisor of the query heads")


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | str,
                       causal: bool = True, window: int | None = None, doc_ids: torch.Tensor | None = None,
                       scale: float | None = None) -> torch.Tensor:
    """The all-to-all kind (Ulysses): heads for sequence. One all-to-all gives each rank the whole
    sequence of ``heads / cp`` of the query heads (and of the key heads, repeated first when
    ``cp`` does not divide them), which it attends exactly as one process does; a second
    all-to-all returns the rows to the ranks that hold their tokens. Arguments and result as
    :func:`allgather_attention`; ``cp`` must divide the query heads."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    group_name, cp, rank = _group(group)
    _check(q, k, v, "alltoall_attention")
    heads = q.shape[1]
    if heads % cp:
        raise ConfigError(f"all-to-all context parallelism splits the heads: {heads} query heads over cp={cp}",
                          where="alltoall_attention", fix="use a cp degree that divides the heads, or the "
                                                          "all-gather or ring kind")
    if k.shape[1] % cp:                        # too few key heads to split: give each query head its own
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s_local = q.shape[-2]
    seq = s_local * cp
    order = _order(seq, cp, q.device)
    back = torch.argsort(order)

    def to_heads(x: torch.Tensor) -> torch.Tensor:            # [B, h, s_local, D] -> [B, h/cp, seq, D]
        b, h, s, d = x.shape
        parts = x.permute(1, 0, 2, 3).reshape(cp, h // cp, b, s, d).contiguous()
        got = all_to_all_single_autograd(parts, None, None, group_name)       # [src rank, h/cp, B, s, D]
        rows = got.permute(2, 1, 0, 3, 4).reshape(b, h // cp, cp * s, d)     # rank-major tokens
        return rows.index_select(2, back)                                    # global order

    def to_tokens(x: torch.Tensor) -> torch.Tensor:           # [B, h/cp, seq, D] -> [B, h, s_local, D]
        b, hh, _, d = x.shape
        rows = x.index_select(2, order).reshape(b, hh, cp, s_local, d)
        parts = rows.permute(2, 1, 0, 3, 4).contiguous()                     # [dst rank, h/cp, B, s, D]
        got = all_to_all_single_autograd(parts, None, None, group_name)       # [head group, h/cp, B, s, D]
        return got.reshape(hh * cp, b, s_local, d).permute(1, 0, 2, 3)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    rep = qh.shape[1] // kh.shape[1]
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    pos = torch.arange(seq, device=q.device)
    ids = _whole_ids(doc_ids, group_name, cp)[:, None] if doc_ids is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=attention_mask(pos, pos, causal, window, ids, ids), scale=scale)
    return to_tokens(out)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | str,
                        causal: bool = True, window: int | None = None, doc_ids: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries to the whole sequence's keys and values.

    ``q``: ``[batch, heads, s_local, dim]``, ``k`` and ``v``: ``[batch, kv_heads, s_local, dim]``
    (``kv_heads`` divides ``heads``: grouped-query attention, repeated after the gather), in this
    rank's layout (:func:`shard`). ``window``: a query at position ``i`` sees keys ``j`` with
    ``i - j < window`` (with ``causal``, Mistral's sliding window). ``doc_ids``: ``[batch,
    s_local]``, this rank's tokens' document ids (packed documents attend within their own).
    Returns ``[batch, heads, s_local, dim]``, this rank's rows of the whole attention."""
    group_name, cp, rank = _group(group)
    _check(q, k, v, "allgather_attention")
    seq = q.shape[-2] * cp
    q_pos = positions(seq, cp, rank, q.device)
    k_pos = torch.arange(seq, device=q.device)
    k_all = _GatherSeq.apply(k, group_name, cp, rank)
    v_all = _GatherSeq.apply(v, group_name, cp, rank)
    q_doc = k_doc = None
    if doc_ids is not None:
        q_doc, k_doc = doc_ids[:, None], _whole_ids(doc_ids, group_name, cp)[:, None]   # broadcast over heads
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    mask = attention_mask(q_pos, k_pos, causal, window, q_doc, k_doc)
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
