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
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError
from autopar.runtime.collectives import c10d

__all__ = ["allgather_attention", "attention_mask", "positions", "shard", "unshard"]


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
    group_name = group if isinstance(group, str) else group.group_name
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    cp, rank = pg.size(), pg.rank()
    s_local = q.shape[-2]
    if k.shape[-2] != s_local or v.shape[-2] != s_local:
        raise ConfigError("queries, keys and values must hold the same tokens", where="allgather_attention",
                          got=f"{q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]} positions")
    if q.shape[1] % k.shape[1]:
        raise ConfigError(f"{k.shape[1]} key heads do not divide {q.shape[1]} query heads",
                          where="allgather_attention", fix="pass keys and values with a divisor of the query heads")
    seq = s_local * cp
    q_pos = positions(seq, cp, rank, q.device)
    k_pos = torch.arange(seq, device=q.device)
    k_all = _GatherSeq.apply(k, group_name, cp, rank)
    v_all = _GatherSeq.apply(v, group_name, cp, rank)
    q_doc = k_doc = None
    if doc_ids is not None:
        q_doc = doc_ids
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(doc_ids.t().contiguous(), cp, group_name))
        k_doc = torch.empty_like(gathered).index_copy_(0, torch.cat([positions(seq, cp, r, q.device)
                                                                      for r in range(cp)]), gathered).t()
        q_doc, k_doc = q_doc[:, None], k_doc[:, None]          # broadcast over heads
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    mask = attention_mask(q_pos, k_pos, causal, window, q_doc, k_doc)
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
