"""Data parallelism on one mesh axis: gradient buckets, ZeRO sharding, and the graph nodes
the data-parallel rewrite inserts.

Every parameter communicated over the data axis belongs to one :class:`Bucket` (the
parameters first used close together in forward). Sharded stages split each parameter
flat: rank ``r`` of ``n`` owns elements ``[r*c, (r+1)*c)`` of the flattened tensor, with
``c = ceil(numel / n)`` (the last owner's piece is padded with zeros on the wire). A
bucket's wire layout is ``(n, C)``, row ``r`` holding rank ``r``'s pieces of every
parameter, so one ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` moves a whole
bucket.

The graph nodes come in issue/wait pairs so the scheduling pass can move each half:

- ``grad_reduce_wait`` (placed at the top of forward) and ``grad_reduce_issue`` (placed
  just before the bucket's first use) are identities in forward. In backward the issue
  node runs once every gradient of its bucket is complete and starts the reduction
  (all_reduce for ZeRO-0, reduce_scatter for ZeRO-2); the wait node runs at the end of
  backward and waits for it, so the reduction overlaps the rest of backward.
- ``param_gather_issue`` starts the all_gather of a bucket's shards (ZeRO-3) and
  ``param_gather_wait`` waits and unpacks the whole parameters; placing the issue one
  bucket ahead prefetches. In backward the wait node starts the reduce_scatter of the
  bucket's gradients and the issue node waits for it (gradients reach the shards).

ZeRO-3 frees whole parameters after their last use in forward: tensors autograd would
save for backward are replaced by tokens (``saved_tensors_hooks``) and re-gathered when
backward unpacks them, prefetching the next bucket in backward order. Checkpointed regions
(``runtime.recompute``) take whole parameters as tokens the same way.
The communication is torch's functional collectives followed by ``wait_tensor``.

Hybrid sharding (ZeRO-2/3 with ``DataOptions(shard_group=g)``): the pieces are cut over a group
of ``g`` data ranks (``n = g`` here) and every one of the ``replicas`` groups holds the same
pieces. Gathers stay inside the group; a gradient is reduce-scattered inside it and the piece
then all-reduced with the ranks holding the same piece in the other groups
(:meth:`DPRuntime.across_replicas`), so the mean still covers the whole data axis. Rows and
token counts are summed over the whole axis (``data_n``, ``data_group``).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the c10d functional ops

from autopar.runtime.collectives import all_gather_start, all_gather_wait
from autopar.runtime.health import peer_errors

_c10d = torch.ops._c10d_functional
_RUNTIMES: "weakref.WeakValueDictionary[int, DPRuntime]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def shard_range(numel: int, n: int, rank: int) -> tuple[int, int]:
    """The flat elements ``[lo, hi)`` of a ``numel``-element tensor that ``rank`` of ``n`` owns."""
    c = math.ceil(numel / n)
    lo = min(rank * c, numel)
    return lo, min(lo + c, numel)


class Bucket:
    """One group of parameters communicated together over the data axis."""

    def __init__(self, rt: "DPRuntime", index: int, fqns: list[str], shapes: list[tuple[int, ...]],
                 trainable: list[bool]) -> None:
        self.rt, self.index, self.fqns, self.shapes, self.trainable = rt, index, fqns, shapes, trainable
        n = rt.n
        self.numels = [math.prod(s) for s in shapes]
        self.chunks = [math.ceil(m / n) for m in self.numels]
        self.offsets = [0, *itertools.accumulate(self.chunks)]          # in one rank's row of the wire layout
        self.flat_offsets = [0, *itertools.accumulate(self.numels)]     # in the whole flat bucket
        self.width = self.offsets[-1]
        self._pending: torch.Tensor | None = None      # reduction in flight
        self._gathered: torch.Tensor | None = None     # forward all_gather in flight (ZeRO-3)
        self._bwd_pending: torch.Tensor | None = None  # backward re-gather in flight (ZeRO-3)
        self._bwd_full: list[torch.Tensor] | None = None
        self.saved = 0                                  # tokens saved in forward, not yet unpacked

    @property
    def name(self) -> str:
        return f"dp.b{self.index}"

    # -- wire layout -------------------------------------------------------------------
    def to_rows(self, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """Whole tensors (None: zeros) laid out as ``(n, C)``: row r holds rank r's pieces."""
        n = self.rt.n
        buf = torch.empty(n, self.width, dtype=dtype, device=self.rt.device)
        for i, t in enumerate(tensors):
            m, c, off = self.numels[i], self.chunks[i], self.offsets[i]
            if t is None:
                buf[:, off:off + c].zero_()
                continue
            flat = t.detach().reshape(-1).to(dtype)
            full_rows, rest = divmod(m, c)
            if full_rows:
                buf[:full_rows, off:off + c] = flat[:full_rows * c].view(full_rows, c)
            if rest:
                buf[full_rows, off:off + rest] = flat[full_rows * c:]
                buf[full_rows, off + rest:off + c].zero_()   # padding
                full_rows += 1
            if full_rows < n:
                buf[full_rows:, off:off + c].zero_()   # padding rows
        return buf

    def from_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`to_rows`: whole (contiguous) tensors out of an ``(n, C)`` buffer."""
        out = []
        for i, shape in enumerate(self.shapes):
            m, c, off = self.numels[i], self.chunks[i], self.offsets[i]
            out.append(rows[:, off:off + c].reshape(-1)[:m].reshape(shape).contiguous())
        return out

    def row_pieces(self, row: torch.Tensor) -> list[torch.Tensor]:
        """This rank's padded piece (``c`` elements) of every parameter, as views of ``row``."""
        return [row[self.offsets[i]:self.offsets[i + 1]] for i in range(len(self.fqns))]

    # -- gradient reduction (ZeRO-0 and ZeRO-2) -----------------------------------------------
    def issue_reduce(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        rt = self.rt
        if rt.stage == 0:
            if all(g is not None for g in grads):
                buf = torch.cat([g.reshape(-1).to(rt.reduce_dtype) for g in grads])
            else:
                buf = torch.zeros(self.flat_offsets[-1], dtype=rt.reduce_dtype, device=rt.device)
                for i, g in enumerate(grads):
                    if g is not None:
                        buf[self.flat_offsets[i]:self.flat_offsets[i + 1]] = g.reshape(-1)
            if rt.modes is None:
                self._pending = _c10d.all_reduce_(buf.div_(rt.divisor), "sum", rt.group_name)
            else:          # another data-axis mode: runtime/data_modes.py (a local step keeps the mean)
                self._pending = rt.modes.issue(self.index, buf, 1 if rt.modes.local_step() else rt.divisor)
        else:
            rows = self.to_rows(list(grads), rt.reduce_dtype).div_(rt.divisor)
            self._pending = _c10d.reduce_scatter_tensor(rows.view(-1), "sum", rt.n, rt.group_name)

    def finish_reduce(self) -> tuple[torch.Tensor | None, ...]:
        """Wait for the reduction; return the gradients autograd should accumulate (or Nones
        when they went to a sink the optimizer reads)."""
        rt = self.rt
        if self._pending is None:
            return (None,) * len(self.fqns)
        if rt.modes is None:
            got = _c10d.wait_tensor(self._pending)
        elif rt.modes.mode.kind == "async" and self._pending[0] == "allreduce":
            rt.modes.defer(self.index, self._pending)     # applied staleness steps later
            self._pending = None
            return (None,) * len(self.fqns)
        else:
            got = rt.modes.finish(self._pending)
        self._pending = None
        if rt.stage == 0:
            grads = [got[self.flat_offsets[i]:self.flat_offsets[i + 1]].view(s) for i, s in enumerate(self.shapes)]
            if not rt.mixed:     # ZeRO-0 in full precision: autograd accumulates into param.grad
                return tuple(g if ok else None for g, ok in zip(grads, self.trainable))
            for fqn, g, ok in zip(self.fqns, grads, self.trainable):
                if ok:
                    rt.accumulate(fqn, g)
            return (None,) * len(self.fqns)
        got = rt.across_replicas(got)
        for fqn, piece, ok in zip(self.fqns, self.row_pieces(got), self.trainable):
            if ok:
                rt.accumulate(fqn, piece)
        return (None,) * len(self.fqns)

    # -- parameter gathering (ZeRO-3) -------------------------------------------------------
    def _start_gather(self, shards: tuple[torch.Tensor, ...]) -> torch.Tensor:
        rt = self.rt
        row = torch.cat([s.detach().reshape(-1).to(rt.compute_dtype) for s in shards])
        return all_gather_start(row, rt.n, rt.group_name)

    def issue_gather(self, shards: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.forget_backward()
        return self._start_gather(shards)

    def finish_gather(self, handle: torch.Tensor) -> list[torch.Tensor]:
        rows = all_gather_wait(handle).view(self.rt.n, self.width)
        return self.from_rows(rows)

    def issue_grad_scatter(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.forget_backward()     # every node that reads these parameters has run its backward
        rt = self.rt
        rows = self.to_rows(list(grads), rt.reduce_dtype).div_(rt.divisor)
        self._pending = _c10d.reduce_scatter_tensor(rows.view(-1), "sum", rt.n, rt.group_name)

    def finish_grad_scatter(self) -> tuple[torch.Tensor | None, ...]:
        if self._pending is None:
            return (None,) * len(self.fqns)
        got = self.rt.across_replicas(_c10d.wait_tensor(self._pending))
        self._pending = None
        dtype = self.rt.param_dtype
        return tuple(p.to(dtype) if ok else None for p, ok in zip(self.row_pieces(got), self.trainable))

    def prefetch_backward(self) -> None:
        if self._bwd_full is None and self._bwd_pending is None and self.saved > 0:
            self._bwd_pending = self._start_gather(self.rt.shards_of(self))

    def forget_backward(self) -> None:
        """Drop what is left of the backward re-gather: tokens never unpacked (their nodes did not
        run backward) must not keep the whole parameters, nor leave a prefetched gather, which
        would hold this step's values, for the next step's backward."""
        if self._bwd_pending is not None:
            _c10d.wait_tensor(self._bwd_pending)
        self.saved, self._bwd_full, self._bwd_pending = 0, None, None

    def full_for_backward(self, i: int) -> torch.Tensor:
        if self._bwd_full is None:
            if self._bwd_pending is None:    # not prefetched: gather now
                self._bwd_pending = self._start_gather(self.rt.shards_of(self))
            self._bwd_full = self.finish_gather(self._bwd_pending)
            self._bwd_pending = None
            if self.rt.prefetch and self.index > 0:
                self.rt.buckets[self.index - 1].prefetch_backward()
        full = self._bwd_full[i]
        self.saved -= 1
        if self.saved <= 0:
            self._bwd_full = None       # the unpacked views keep it alive until their backward ran
        return full


@dataclass(frozen=True)
class _Token:
    """Stands in, between forward and backward, for a saved (view of a) whole ZeRO-3 parameter:
    which parameter, and the view's size, stride and storage offset relative to the parameter's."""

    bucket: int
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def row_count_issue(rows: int, rt: "DPRuntime") -> torch.Tensor:
    """Start summing the ranks' row counts (for :func:`row_weight`): issued before forward
    runs, it travels while forward computes."""
    counts = torch.tensor([float(rows)], dtype=torch.float64, device=rt.device)
    return _c10d.all_reduce_(counts, "sum", rt.data_group)


def row_weight(rows: int, rt: "DPRuntime", pending: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weight of a rank holding ``rows`` of the batch among ``rt``'s ranks: ``rows * n /
    total rows``, so that averaging gradients over the ranks gives the global batch's mean
    when each rank's loss is the mean over its rows (one small all-reduce, ``pending`` when
    :func:`row_count_issue` started it). None when every rank holds as many rows (known
    without waiting on a CPU group; on GPUs the weight stays a device tensor, 1.0 when even)."""
    counts = _c10d.wait_tensor(pending if pending is not None else row_count_issue(rows, rt))
    weight = (counts.reciprocal() * (rows * rt.data_n)).reshape(())
    if weight.device.type == "cpu" and weight.item() == 1.0:
        return None
    return weight


class DPRuntime:
    """Per-model data-parallel state: buckets, where reduced gradients go, ZeRO-3 bookkeeping."""

    def __init__(self, *, stage: int, n: int, rank: int, group_name: str, device: torch.device,
                 master_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None,
                 prefetch: bool = True, divisor: int | None = None, replicas: int = 1,
                 replica_group: str = "", data_group: str = "") -> None:
        self.id = next(_ids)
        _RUNTIMES[self.id] = self
        # ``n``, ``rank``, ``group_name``: the ranks sharing the ZeRO pieces (the whole data axis,
        # or under hybrid sharding one shard group of it); ``replicas`` such groups hold the same
        # pieces, and ``replica_group`` joins this rank with its counterparts in the others
        self.stage, self.n, self.rank, self.group_name, self.device = stage, n, rank, group_name, device
        self.replicas, self.replica_group = replicas, replica_group
        # the whole data axis (what rows are counted over): n x replicas ranks
        self.data_n, self.data_group = n * replicas, data_group or group_name
        # how many ranks' rows a summed gradient covers: the data axis, or dp x ep for experts
        # reduced over dp (their owner already summed every ep rank's rows through the exchange)
        self.divisor = divisor or n * replicas
        self.master_dtype = master_dtype                       # what the optimizer steps
        self.compute_dtype = compute_dtype or master_dtype     # what forward and backward run in
        self.mixed = self.compute_dtype != master_dtype
        # The module holds compute-dtype parameters, except under ZeRO-3 where its flat
        # pieces are the (master-dtype) masters themselves and gathers cast them.
        self.param_dtype = master_dtype if stage == 3 else self.compute_dtype
        self.reduce_dtype = torch.float32 if self.mixed else master_dtype
        self.prefetch = prefetch
        self.buckets: list[Bucket] = []
        self.where: dict[str, tuple[int, int]] = {}          # fqn -> (bucket, index in bucket)
        self.sinks: dict[str, torch.Tensor] = {}              # fqn -> accumulated fp32 gradient (or shard)
        self.shard_params: dict[str, torch.Tensor] = {}       # ZeRO-3: fqn -> this rank's flat shard
        self._live: dict[int, tuple[weakref.ref, int, int]] = {}   # storage -> (whole param, bucket, index)
        self.modes = None        # a data-axis mode other than all-reduce (runtime/data_modes.py), ZeRO-0 only

    def across_replicas(self, piece: torch.Tensor) -> torch.Tensor:
        """Hybrid sharding: ``piece``, reduced over this rank's shard group, summed over the
        groups holding the same piece (one all-reduce of 1/n of the bucket); as it is otherwise."""
        if self.replicas == 1:
            return piece
        return _c10d.wait_tensor(_c10d.all_reduce_(piece, "sum", self.replica_group))

    def add_bucket(self, fqns: list[str], shapes: list[tuple[int, ...]], trainable: list[bool]) -> Bucket:
        b = Bucket(self, len(self.buckets), fqns, shapes, trainable)
        self.buckets.append(b)
        for i, fqn in enumerate(fqns):
            self.where[fqn] = (b.index, i)
        return b

    def accumulate(self, fqn: str, g: torch.Tensor) -> None:
        have = self.sinks.get(fqn)
        dtype = torch.promote_types(torch.float32, self.reduce_dtype)    # fp32, or fp64 for a float64 model
        self.sinks[fqn] = g.to(dtype).clone() if have is None else have.add_(g)

    def grads_of(self, b: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``b``'s trainable parameters' pieces of a flat (ZeRO-0 layout) bucket gradient."""
        return {f: flat[b.flat_offsets[i]:b.flat_offsets[i + 1]].view(b.shapes[i])
                for i, f in enumerate(b.fqns) if b.trainable[i]}

    def shards_of(self, b: Bucket) -> tuple[torch.Tensor, ...]:
        return tuple(self.shard_params[f] for f in b.fqns)

    # -- ZeRO-3: saved whole parameters become tokens -------------------------------------------
    def register_full(self, b: Bucket, fulls: list[torch.Tensor]) -> None:
        """Note the whole parameters a forward gather made, by storage: a gathered parameter is
        itself a view (of its unpacked piece of the wire buffer), so views of it have that piece,
        not the parameter, as ``_base``; only the storage tells them apart. Empty ones have none
        and are never saved."""
        for i, t in enumerate(fulls):
            if t.numel():
                self._live[t.untyped_storage().data_ptr()] = (weakref.ref(t), b.index, i)

    def token_for(self, t: torch.Tensor) -> _Token | None:
        """A token for ``t`` if it is (a view of) a whole parameter this forward gathered, else
        None. The token is counted as saved: backward must hand it to :meth:`whole_for_backward`
        exactly once, which re-gathers the bucket (once for all its tokens)."""
        ptr = t.untyped_storage().data_ptr()
        hit = self._live.get(ptr)
        full = hit[0]() if hit is not None else None
        if full is None or full.untyped_storage().data_ptr() != ptr:
            return None
        self.buckets[hit[1]].saved += 1
        return _Token(hit[1], hit[2], tuple(t.size()), tuple(t.stride()), t.storage_offset() - full.storage_offset())

    def whole_for_backward(self, token: _Token) -> torch.Tensor:
        """The (view of the) whole parameter ``token`` stands for, gathered again for backward."""
        full = self.buckets[token.bucket].full_for_backward(token.index)
        return full.as_strided(token.size, token.stride, full.storage_offset() + token.offset)

    def _pack(self, t: torch.Tensor):
        token = self.token_for(t)
        return t if token is None else token

    def _unpack(self, x):
        return self.whole_for_backward(x) if isinstance(x, _Token) else x

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Run a forward under this (ZeRO-3) runtime: saved whole parameters become tokens."""
        if self.stage != 3:
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._live.clear()


# --------------------------------------------------------------------------------------------
# Graph-node callables (what dp_rewrite inserts). ``rid`` names the runtime, ``b`` the bucket.
# Their backwards wait on collectives: another rank's failure there is a PeerFailureError
# (health.peer_errors), which autograd hands to the caller of backward as it is.

class _GradWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rid: int, b: int, *params: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.rid, ctx.b = rid, b
        return params

    @staticmethod
    @peer_errors()
    def backward(ctx, *grads):
        return (None, None) + _RUNTIMES[ctx.rid].buckets[ctx.b].finish_reduce()


class _GradIssue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rid: int, b: int, *params: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.rid, ctx.b = rid, b
        return params

    @staticmethod
    @peer_errors()
    def backward(ctx, *grads):
        _RUNTIMES[ctx.rid].buckets[ctx.b].issue_reduce(grads)
        return (None, None) + (None,) * len(grads)


class _GatherIssue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rid: int, b: int, *shards: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.rid, ctx.b = rid, b
        return _RUNTIMES[rid].buckets[b].issue_gather(shards)

    @staticmethod
    @peer_errors()
    def backward(ctx, handle_grad):
        return (None, None) + _RUNTIMES[ctx.rid].buckets[ctx.b].finish_grad_scatter()


class _GatherWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rid: int, b: int, handle: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.rid, ctx.b = rid, b
        rt = _RUNTIMES[rid]
        fulls = rt.buckets[b].finish_gather(handle)
        rt.register_full(rt.buckets[b], fulls)
        return tuple(fulls)

    @staticmethod
    @peer_errors()
    def backward(ctx, *grads):
        _RUNTIMES[ctx.rid].buckets[ctx.b].issue_grad_scatter(grads)
        return None, None, None


def grad_reduce_wait(rid: int, b: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward: identity. Backward: wait for bucket ``b``'s gradient reduction."""
    return _GradWait.apply(rid, b, *params)


def grad_reduce_issue(rid: int, b: int, params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Forward: identity on the tuple :func:`grad_reduce_wait` returned (taken whole, so the
    graph needs no node per parameter between them). Backward: start bucket ``b``'s gradient
    reduction."""
    return _GradIssue.apply(rid, b, *params)


def param_gather_issue(rid: int, b: int, *shards: torch.Tensor) -> torch.Tensor:
    """Forward: start gathering bucket ``b``'s parameter shards. Backward: wait for its
    gradients' reduce_scatter and hand each shard its piece."""
    return _GatherIssue.apply(rid, b, *shards)


def param_gather_wait(rid: int, b: int, handle: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward: wait for the gather, return the whole parameters. Backward: start the
    reduce_scatter of their gradients."""
    return _GatherWait.apply(rid, b, handle)


DP_OPS = (grad_reduce_wait, grad_reduce_issue, param_gather_issue, param_gather_wait)
ISSUE_OPS = (grad_reduce_issue, param_gather_issue)
WAIT_OPS = (grad_reduce_wait, param_gather_wait)
