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

:func:`ring_attention` is the ring kind: keys and values travel round the ranks, the next block
in flight while this one is computed, and each block's attention is merged into the running
result by log-sum-exp (a rank holds at most two blocks of keys); backward sends keys, values and
their gradient sums round again, ending at their owners. Exact up to rounding: the softmax is
summed block by block (float64: within 1e-12 of one process).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError
from autopar.runtime.collectives import all_gather_start, all_gather_wait, c10d
from autopar.runtime.attention import is_causal_mask

__all__ = ["KINDS", "sent_bytes", "allgather_attention", "alltoall_attention", "attention_mask", "gather_sequence", "graph_attention",
           "local_positions", "local_rows", "positions", "ring_attention", "shard", "unshard"]


_SENT = [0]      # bytes this process sent for context-parallel attention (see sent_bytes)


def sent_bytes(reset: bool = True) -> int:
    """Bytes this process has sent to other ranks for context-parallel exchanges (gathers,
    reduce-scatters, all-to-alls and ring steps, forward and backward, counted as the payload a
    ring algorithm moves: ``(cp - 1)`` pieces per gather) since the last reset."""
    got = _SENT[0]
    if reset:
        _SENT[0] = 0
    return got


def _count(nbytes: int) -> None:
    _SENT[0] += int(nbytes)


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
    """All-gather along the sequence dim ``dim`` into global order; backward sums the gradient
    over the ranks and keeps this rank's positions (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, cp: int, rank: int, dim: int = -2) -> torch.Tensor:
        ctx.group_name, ctx.cp, ctx.rank, ctx.dim = group_name, cp, rank, dim
        rows = x.movedim(dim, 0).contiguous()                     # [s_local, ...]
        _count(rows.nbytes * (cp - 1))
        gathered = all_gather_wait(all_gather_start(rows, cp, group_name))  # [cp * s_local, ...]
        seq = gathered.shape[0]
        order = _order(seq, cp, x.device)
        ctx.order = order
        whole = torch.empty_like(gathered).index_copy_(0, order, gathered)
        return whole.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows = grad.movedim(ctx.dim, 0).index_select(0, ctx.order).contiguous()   # back to rank-major order
        _count(rows.nbytes * (ctx.cp - 1) // ctx.cp)
        mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(rows, "sum", ctx.cp, ctx.group_name))
        return mine.movedim(0, ctx.dim).contiguous(), None, None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """The whole sequence of ``x`` (this rank's tokens along ``dim``), in global order, on every
    rank of the context-parallel group; its gradient reaches each rank's own tokens."""
    _, cp, rank = _group(group_name)
    if x.requires_grad and x.is_floating_point():
        return _GatherSeq.apply(x, group_name, cp, rank, dim)
    with torch.no_grad():
        return _GatherSeq.apply(x, group_name, cp, rank, dim)


def local_positions(s_local: int, group_name: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of this rank's ``s_local`` tokens (what ``arange(seq)`` is on one
    process, at this rank's positions)."""
    _, cp, rank = _group(group_name)
    pos = positions(s_local * cp, cp, rank, device if device is not None else "cpu")
    return pos if dtype is None else pos.to(dtype)


def local_rows(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's tokens of a whole-sequence value (sequence along ``dim``)."""
    _, cp, rank = _group(group_name)
    return x.index_select(dim, positions(x.shape[dim], cp, rank, x.device))


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


def _combine(allowed: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor | None:
    """The model's own mask ``extra`` (bool: True attends; float: added to the scores) with
    ``allowed`` (bool) on top: bool when both are, else additive (-inf where not allowed)."""
    if extra is None:
        return allowed
    if allowed is None:
        return extra
    if extra.dtype == torch.bool:
        return extra & allowed
    return extra.masked_fill(~allowed, -torch.inf)


def _rows(mask: torch.Tensor | None, q_pos: torch.Tensor) -> torch.Tensor | None:
    """This rank's query rows of a whole-sequence mask (keys stay in global order)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask.index_select(mask.dim() - 2, q_pos)


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
    gathered = all_gather_wait(all_gather_start(ids.t().contiguous(), cp, group_name))
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
                       scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
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
        got = _Counted.apply(all_to_all_single_autograd(parts, None, None, group_name), cp)   # [src rank, h/cp, B, s, D]
        rows = got.permute(2, 1, 0, 3, 4).reshape(b, h // cp, cp * s, d)     # rank-major tokens
        return rows.index_select(2, back)                                    # global order

    def to_tokens(x: torch.Tensor) -> torch.Tensor:           # [B, h/cp, seq, D] -> [B, h, s_local, D]
        b, hh, _, d = x.shape
        rows = x.index_select(2, order).reshape(b, hh, cp, s_local, d)
        parts = rows.permute(2, 1, 0, 3, 4).contiguous()                     # [dst rank, h/cp, B, s, D]
        got = _Counted.apply(all_to_all_single_autograd(parts, None, None, group_name), cp)   # [head group, ...]
        return got.reshape(hh * cp, b, s_local, d).permute(1, 0, 2, 3)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    rep = qh.shape[1] // kh.shape[1]
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    pos = torch.arange(seq, device=q.device)
    ids = _whole_ids(doc_ids, group_name, cp)[:, None] if doc_ids is not None else None
    if mask is not None and mask.dim() == 4 and mask.shape[1] > 1:     # a mask per head: this rank's heads
        mask = mask.narrow(1, rank * (heads // cp), heads // cp)
    if causal and window is None and ids is None and mask is None:      # the whole sequence in order: plain causal
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=_combine(attention_mask(pos, pos, causal, window, ids, ids), mask), scale=scale)
    return to_tokens(out)


class _Counted(torch.autograd.Function):
    """Identity that counts an all-to-all's payload, forward and (its gradient) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: int) -> torch.Tensor:
        ctx.cp = cp
        _count(x.nbytes * (cp - 1) // cp)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _count(grad.nbytes * (ctx.cp - 1) // ctx.cp)
        return grad, None


def _shift(tensors: list[torch.Tensor], group_name: str, cp: int, rank: int):
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's (started,
    not waited): (works, received)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(group_name)
    nxt, prv = (rank + 1) % cp, (rank - 1) % cp
    got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=pg, group_peer=nxt) for t in tensors]
    _count(sum(t.nbytes for t in tensors))
    ops += [dist.P2POp(dist.irecv, r, group=pg, group_peer=prv) for r in got]
    return dist.batch_isend_irecv(ops), got


def _wait(works) -> None:
    for w in works:
        w.wait()


class _Ring(torch.autograd.Function):
    """Ring attention: keys and values go round the ranks; each block's partial result is merged
    by log-sum-exp; backward sends keys, values and their gradient sums round again."""

    @staticmethod
    def forward(ctx, q, k, v, group_name: str, cp: int, rank: int, causal: bool, window, ids, scale: float, rows):
        seq = q.shape[-2] * cp
        q_pos = positions(seq, cp, rank, q.device)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -torch.inf, dtype=q.dtype, device=q.device)
        kv = [k, v]
        for t in range(cp):
            owner = (rank - t) % cp
            pending = _shift(kv, group_name, cp, rank) if t < cp - 1 else None   # the next block travels meanwhile
            probs, blk_lse = _block(q, kv[0], q_pos, owner, seq, cp, causal, window, ids, scale, rows)
            new = torch.logaddexp(lse, blk_lse)
            keep = torch.where(torch.isneginf(new), 0.0, torch.exp(lse - new))
            take = torch.where(torch.isneginf(new), 0.0, torch.exp(blk_lse - new))
            out = out * keep[..., None] + (probs @ _rep(kv[1], q)) * take[..., None]
            lse = new
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group_name, cp, rank, causal, window, ids, scale, rows)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group_name, cp, rank, causal, window, ids, scale, rows = ctx.args
        seq = q.shape[-2] * cp
        q_pos = positions(seq, cp, rank, q.device)
        delta = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        held = [k, v, torch.zeros_like(k), torch.zeros_like(v)]     # a block and its gradient sums so far
        for t in range(cp):
            owner = (rank - t) % cp
            kb, vb, dk, dv = held
            scores = _scores(q, kb, q_pos, owner, seq, cp, causal, window, ids, scale, rows)
            probs = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(scores - lse[..., None]))
            dv = dv + _unrep(probs.transpose(-1, -2) @ d_out, kb)
            ds = probs * (d_out @ _rep(vb, q).transpose(-1, -2) - delta)
            dq = dq + (ds @ _rep(kb, q)) * scale
            dk = dk + _unrep(ds.transpose(-1, -2) @ q, kb) * scale
            # the block moves on; after the last step only its sums, which reach its owner
            works, got = _shift([kb, vb, dk, dv] if t < cp - 1 else [dk, dv], group_name, cp, rank)
            _wait(works)
            held = got if t < cp - 1 else [None, None, *got]
        return dq, held[2], held[3], None, None, None, None, None, None, None, None


def _rep(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // kv.shape[1]
    return kv.repeat_interleave(rep, dim=1) if rep > 1 else kv


def _unrep(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of the repeated heads summed back onto the key heads."""
    rep = grad.shape[1] // kv.shape[1]
    return grad.reshape(grad.shape[0], kv.shape[1], rep, *grad.shape[2:]).sum(2) if rep > 1 else grad


def _scores(q, kb, q_pos, owner, seq, cp, causal, window, ids, scale, rows) -> torch.Tensor:
    """Scaled scores of this rank's queries against ``owner``'s keys, -inf where masked
    (``rows``: this rank's rows of the model's own whole-sequence mask, or None)."""
    k_pos = positions(seq, cp, owner, q.device)
    scores = (q @ _rep(kb, q).transpose(-1, -2)) * scale
    q_doc = ids[:, q_pos][:, None] if ids is not None else None      # [batch, 1, s]: broadcast over heads
    k_doc = ids[:, k_pos][:, None] if ids is not None else None
    extra = rows if rows is None or rows.shape[-1] == 1 else rows.index_select(rows.dim() - 1, k_pos)
    mask = _combine(attention_mask(q_pos, k_pos, causal, window, q_doc, k_doc), extra)
    if mask is None:
        return scores
    return scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask


def _block(q, kb, q_pos, owner, seq, cp, causal, window, ids, scale, rows):
    """Softmax probabilities of one block (rows normalised within it) and its log-sum-exp."""
    scores = _scores(q, kb, q_pos, owner, seq, cp, causal, window, ids, scale, rows)
    blk_lse = torch.logsumexp(scores, -1)
    probs = torch.where(torch.isneginf(blk_lse)[..., None], 0.0, torch.exp(scores - blk_lse[..., None]))
    return probs, blk_lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | str,
                   causal: bool = True, window: int | None = None, doc_ids: torch.Tensor | None = None,
                   scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The ring kind: each rank's keys and values go round the ring (the next block is in flight
    while this one is computed); each block's attention is merged into the running result by
    log-sum-exp, so no rank ever holds more than two blocks of keys. Backward goes round again with
    the keys' and values' gradient sums, which end at their owners. Arguments and result as
    :func:`allgather_attention`. Exact up to rounding (the softmax is summed block by block)."""
    group_name, cp, rank = _group(group)
    _check(q, k, v, "ring_attention")
    ids = _whole_ids(doc_ids, group_name, cp) if doc_ids is not None else None
    rows = _rows(mask, positions(q.shape[-2] * cp, cp, rank, q.device))
    return _Ring.apply(q, k, v, group_name, cp, rank, causal, window, ids,
                       scale if scale is not None else q.shape[-1] ** -0.5, rows)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup | str,
                        causal: bool = True, window: int | None = None, doc_ids: torch.Tensor | None = None,
                        scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries to the whole sequence's keys and values.

    ``q``: ``[batch, heads, s_local, dim]``, ``k`` and ``v``: ``[batch, kv_heads, s_local, dim]``
    (``kv_heads`` divides ``heads``: grouped-query attention, repeated after the gather), in this
    rank's layout (:func:`shard`). ``window``: a query at position ``i`` sees keys ``j`` with
    ``i - j < window`` (with ``causal``, Mistral's sliding window). ``doc_ids``: ``[batch,
    s_local]``, this rank's tokens' document ids (packed documents attend within their own).
    ``mask``: the model's own mask over the whole sequence (broadcastable to ``[batch, heads,
    seq, seq]``, global positions; bool, True attends, or float, added to the scores), on top of
    the others. Returns ``[batch, heads, s_local, dim]``, this rank's rows of the whole attention."""
    group_name, cp, rank = _group(group)
    _check(q, k, v, "allgather_attention")
    seq = q.shape[-2] * cp
    q_pos = positions(seq, cp, rank, q.device)
    k_pos = torch.arange(seq, device=q.device)
    k_all = _GatherSeq.apply(k, group_name, cp, rank, -2)
    v_all = _GatherSeq.apply(v, group_name, cp, rank, -2)
    q_doc = k_doc = None
    if doc_ids is not None:
        q_doc, k_doc = doc_ids[:, None], _whole_ids(doc_ids, group_name, cp)[:, None]   # broadcast over heads
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    allowed = _combine(attention_mask(q_pos, k_pos, causal, window, q_doc, k_doc), _rows(mask, q_pos))
    return torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed, scale=scale)


KINDS = ("ring", "allgather", "alltoall")


def graph_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                    scale: float | None, kind: str, group_name: str) -> torch.Tensor:
    """What an attention op of a captured graph runs under context parallelism
    (``passes/cp_rewrite.py``): ``scaled_dot_product_attention(q, k, v, attn_mask=mask,
    is_causal=is_causal, scale=scale)`` on one process, here this rank's rows of it by ``kind``;
    ``mask`` is the whole sequence's (the rewrite computes the model's mask on global positions)."""
    fn = {"ring": ring_attention, "allgather": allgather_attention, "alltoall": alltoall_attention}[kind]
    if mask is not None and not is_causal and is_causal_mask(mask):
        mask, is_causal = None, True        # built from positions where needed: no seq x seq mask kept
    return fn(q, k, v, group=group_name, causal=bool(is_causal), scale=scale, mask=mask)
