"""The runtime of the data-axis modes other than all-reduce (``autopar/core/dp_mode.py`` says what
each one computes).

A :class:`ModeState` hangs on the data axis's :class:`~autopar.runtime.dp.DPRuntime`. The
graph's gradient nodes stay where the data rewrite put them (``grad_reduce_issue`` as each
bucket's gradients are ready in backward, ``grad_reduce_wait`` where they are needed); what
they do is asked of the mode:

- :meth:`ModeState.issue` starts a bucket's exchange: a plain all-reduce, a compressed
  exchange (all-gather of top-k values and indices packed as bytes, all-reduce of the rand-k
  entries every rank drew alike or of integer levels at scales every rank shares), or nothing when the rank steps on its own gradient;
- :meth:`ModeState.finish` waits for it and returns the bucket's averaged (or local) flat
  gradient, or, under ``async``, queues the pending all-reduce for a later step and returns None;
- the optimizer (``runtime/optim.py``) takes ``async``'s delayed gradients with
  :meth:`ModeState.take_delayed` and, after each step, calls :meth:`ModeState.after_step`,
  which averages the stepped parameters (``local_sgd`` every ``sync_every`` steps,
  ``gossip`` with the neighbours every step).

Compressors are plain functions of a flat tensor, tested against their definitions.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.dp_mode import DataMode
from autopar.runtime.collectives import all_gather_start, all_gather_wait

c10d = torch.ops._c10d_functional
log = logging.getLogger("autopar.data_modes")


# -- compressors ------------------------------------------------------------------------------

def keep_count(numel: int, ratio: float) -> int:
    """How many entries top-k / rand-k send of ``numel``: ``ceil(ratio x numel)``, at least 1."""
    return max(1, min(numel, math.ceil(ratio * numel - 1e-9)))


SAMPLE = 4096        # entries a top-k's threshold is estimated from


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of flat ``x`` with the largest magnitude: (values, int64 indices).

    Exact, but without a selection over all of ``x`` where it can: a threshold below the k-th
    largest magnitude is estimated from a sample at fixed random places, the entries at or
    above it are the candidates, and the top ``k`` of those are the top ``k`` of ``x`` whenever
    there are at least ``k`` of them (else, or when they are too many to save time, the
    selection runs over all of ``x``). Random places, not a stride: a weight gradient's
    magnitude follows its columns (a ReLU's zeros), which a stride dividing the row length
    would sample two of."""
    a = x.abs()
    n = a.numel()
    if n > 8 * SAMPLE and k * 8 <= n:
        sample = a[_sample_places(n, a.device)]
        # the sample's entry at rank 2k/n of it: about twice k entries of x lie above it
        rank = min(len(sample), max(1, (2 * k * len(sample)) // n + 1))
        cut = torch.topk(sample, rank, sorted=True).values[-1]
        cand = torch.nonzero(a >= cut).view(-1)
        if k <= len(cand) <= 8 * k:
            idx = cand[torch.topk(a[cand], k, sorted=False).indices]
            return x[idx], idx
    idx = torch.topk(a, k, sorted=False).indices
    return x[idx], idx


_PLACES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _sample_places(n: int, device: torch.device) -> torch.Tensor:
    """:data:`SAMPLE` places of ``n``, drawn once per size (the same on every rank)."""
    key = (n, device)
    if key not in _PLACES:
        _PLACES[key] = torch.randint(n, (SAMPLE,), generator=torch.Generator().manual_seed(n)).to(device)
    return _PLACES[key]


def randk_indices(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices of ``numel``, drawn from ``generator`` (alike on every rank that
    seeds it alike), sorted. Draws a few more than ``k`` with replacement and keeps ``k`` of the
    distinct ones at random (O(k log k), not a permutation of the whole bucket); falls back to a
    permutation when too few were distinct."""
    if 4 * k < numel:
        drawn = torch.randint(numel, (k + k // 8 + 8,), generator=generator).unique()
        if len(drawn) >= k:
            return drawn[torch.randperm(len(drawn), generator=generator)[:k]].sort().values
    return torch.randperm(numel, generator=generator)[:k].sort().values


QUANT_CHUNK = 512     # entries per scale: a scale per chunk keeps the rounding's variance small


def level_dtype(n: int, levels: int) -> torch.dtype:
    """The narrowest integer type that holds the sum over ``n`` ranks of levels in
    ``[-levels, levels]``: what the quantized all-reduce sums in."""
    top = n * levels
    return torch.int8 if top <= 127 else torch.int16 if top <= 32767 else torch.int32


# Buckets of at least this many entries run quantize's per-entry work as kernels that
# ``torch.compile`` fuses: one pass over the bucket for the scales, one for rounding and the
# residual, one for decoding (eager torch makes about ten, each a full read and write). Smaller
# buckets, and every bucket once compiling has failed, run the same functions eagerly. Eager and
# compiled arithmetic can differ in the last bit (a fused multiply-add), so an entry within a
# rounding step of a level boundary may round the other way: both are the same random rounding.
FUSE_MIN = 1 << 18

_KERNELS: dict[Any, Any] = {}


def _kernel(fn, numel: int):
    """``fn`` compiled (shapes dynamic) for a bucket of ``numel`` entries from :data:`FUSE_MIN`
    on, else ``fn`` itself."""
    if numel < FUSE_MIN or _KERNELS.get(fn) is False:
        return fn
    if fn not in _KERNELS:
        log.info("autopar: compiling the quantize kernel %s (once per process)", fn.__name__)
        _KERNELS[fn] = torch.compile(fn, dynamic=True)
    compiled = _KERNELS[fn]

    def run(*args):
        try:
            return compiled(*args)
        except Exception as e:       # no C++ compiler or Triton: the same function runs eagerly
            warnings.warn(f"autopar: compiling the quantize kernels failed ({type(e).__name__}: {e}); "
                          "they run eagerly (same results, slower)", RuntimeWarning, stacklevel=2)
            _KERNELS[fn] = False
            return fn(*args)
    return run


def _rows(x: torch.Tensor) -> list[torch.Tensor]:
    """Flat ``x`` as its whole :data:`QUANT_CHUNK`-entry chunks (a ``[full, chunk]`` view) and,
    when the last chunk is partial, that chunk as a ``[1, rest]`` view."""
    c = QUANT_CHUNK
    v, full = x.reshape(-1), x.numel() // c
    out = [v[:full * c].view(full, c)]
    if x.numel() > full * c:
        out.append(v[full * c:].view(1, -1))
    return out


def _row_maxima(v: torch.Tensor, add: torch.Tensor | None, divide: float) -> torch.Tensor:
    v = v if divide == 1 else v / divide
    return (v if add is None else v + add).abs().amax(1).float()


def chunk_maxima(x: torch.Tensor, add: torch.Tensor | None = None, divide: float = 1) -> torch.Tensor:
    """The largest magnitude of each :data:`QUANT_CHUNK`-entry chunk of flat ``x / divide +
    add`` (float32; the last chunk may be partial)."""
    xs, adds = _rows(x), [None, None] if add is None else _rows(add)
    out = [_kernel(_row_maxima, x.numel())(xs[0], adds[0], divide)]
    out += [_row_maxima(v, a, divide) for v, a in zip(xs[1:], adds[1:])]
    return out[0] if len(out) == 1 else torch.cat(out)


def _round_rows(v: torch.Tensor, add: torch.Tensor | None, divide: float, maxima: torch.Tensor,
                shift: torch.Tensor, d: torch.Tensor, levels: int, q_out: torch.Tensor,
                r_out: torch.Tensor | None) -> None:
    """:func:`quantize` of the chunks ``v / divide + add`` (``[rows, width]``, scales ``maxima`` and
    draws ``shift`` per row, offsets ``d`` per place) into ``q_out``, and what the levels leave
    out into ``r_out`` when given."""
    work = shift.dtype
    v = v if divide == 1 else v / divide
    if add is not None:
        v = v + add
    scale = torch.where(maxima > 0, levels / maxima, torch.zeros_like(maxima)).to(work)
    # frac(u + d) + levels + b >= 0, so truncation is floor
    b = (d + shift[:, None]).frac_().add_(levels).addcmul_(v, scale[:, None])
    wide = torch.int8 if 2 * levels < 127 else torch.int16 if 2 * levels < 32767 else torch.int32
    # u + levels rounds to levels + 1 for u within a rounding step of 1: keep the top level
    q = b.to(wide).sub_(levels).clamp_(-levels, levels)
    q_out.copy_(q)
    if r_out is not None:
        r_out.copy_(v - q.to(work).mul_((maxima.to(work) / levels)[:, None]).to(v.dtype))


def quantize(x: torch.Tensor, maxima: torch.Tensor, levels: int, generator: torch.Generator,
             dtype: torch.dtype = torch.int8, residual: bool = False, add: torch.Tensor | None = None,
             divide: float = 1):
    """Random rounding of flat ``x`` to ``levels`` levels of a scale per chunk: the entry ``b =
    x / maxima[chunk] x levels`` (in ``[-levels, levels]`` when ``maxima`` bound the chunks'
    magnitudes, as :func:`chunk_maxima` of ``x`` or its maximum over the ranks do) becomes
    ``floor(b) + 1`` with probability ``b - floor(b)``, else ``floor(b)``, so :func:`dequantize`
    is unbiased: its expectation is ``x``. Ranks that share ``maxima`` share the scale, so their
    levels add up: the sum over ranks travels as one all-reduce of ``dtype``
    (:func:`level_dtype`). With ``divide`` and ``add``, rounds ``x / divide + add`` (in the
    same pass). With ``residual``, returns the levels and what they leave out (that value less
    :func:`dequantize` of the levels: error feedback's memory) from the same pass.

    The uniform number each entry is rounded with is ``frac(u + d_i)``: ``u`` drawn from
    ``generator`` once per chunk, ``d_i`` the fractional part of ``i`` times the golden ratio for
    the entry's place ``i`` in its chunk. For every entry it is uniform on ``[0, 1)`` as a draw of
    its own would be (so the rounding has the same probabilities, and variance), at one draw per
    chunk instead of one per entry (the draws were most of the cost); within a chunk the
    roundings are spread evenly rather than independently.

    Buckets from :data:`FUSE_MIN` entries on round in one compiled pass (reading ``x`` and
    ``add``, writing the levels and the residual)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32    # levels + u exact enough
    n, c = x.numel(), QUANT_CHUNK
    shift = torch.rand(-(-n // c), generator=generator, dtype=work).to(x.device)
    d, maxima = _golden(work, x.device), maxima.to(x.device)
    q = torch.empty(n, dtype=dtype, device=x.device)
    r = torch.empty(n, dtype=x.dtype, device=x.device) if residual else None
    xs, adds, qs = _rows(x), [None, None] if add is None else _rows(add), _rows(q)
    rs = [None, None] if r is None else _rows(r)
    for i in range(len(xs)):
        rows = slice(0, xs[0].shape[0]) if i == 0 else slice(n // c, n // c + 1)
        fn = _kernel(_round_rows, n) if i == 0 else _round_rows
        fn(xs[i], adds[i], divide, maxima[rows], shift[rows], d[:xs[i].shape[1]], levels, qs[i], rs[i])
    return (q, r) if residual else q


_GOLDEN: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _golden(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``frac(i x golden ratio)`` for the places ``i`` of a chunk: evenly spread offsets."""
    key = (dtype, device)
    if key not in _GOLDEN:
        i = torch.arange(QUANT_CHUNK, dtype=torch.float64)
        _GOLDEN[key] = torch.frac(i * ((5 ** 0.5 - 1) / 2)).to(dtype=dtype, device=device)
    return _GOLDEN[key]


def _decode_rows(q: torch.Tensor, maxima: torch.Tensor, levels: int, out: torch.Tensor) -> None:
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    if out.dtype == work:
        out.copy_(q).mul_((maxima.to(work) / levels)[:, None])
    else:
        out.copy_(q.to(work) * (maxima.to(work) / levels)[:, None])


def dequantize(q: torch.Tensor, maxima: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """The values levels ``q`` (one rank's, or their sum over ranks) stand for at the chunks'
    shared ``maxima``."""
    n, c = q.numel(), QUANT_CHUNK
    out = torch.empty(n, dtype=dtype, device=q.device)
    for i, (qv, ov) in enumerate(zip(_rows(q), _rows(out))):
        rows = slice(0, qv.shape[0]) if i == 0 else slice(n // c, n // c + 1)
        (_kernel(_decode_rows, n) if i == 0 else _decode_rows)(qv, maxima[rows], levels, ov)
    return out


# -- gossip topologies -----------------------------------------------------------------------

def grid_shape(n: int) -> tuple[int, int]:
    """Rows x columns of the 2-D torus over ``n`` ranks: the most square factorisation."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


def neighbours(topology: str, n: int, rank: int) -> list[int]:
    """The other ranks ``rank`` averages with (sorted, without itself). Every topology is
    undirected and regular, so uniform weights ``1 / (degree + 1)`` make the mixing matrix
    symmetric and doubly stochastic: gossip keeps the average of the parameters."""
    if topology == "full":
        peers = set(range(n))
    elif topology == "ring":
        peers = {(rank - 1) % n, (rank + 1) % n}
    elif topology == "exponential":
        peers = set()
        hop = 1
        while hop < n:
            peers |= {(rank + hop) % n, (rank - hop) % n}
            hop *= 2
    elif topology == "grid":
        rows, cols = grid_shape(n)
        r, c = divmod(rank, cols)
        peers = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                 r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
    else:
        raise ValueError(topology)
    peers.discard(rank)
    return sorted(peers)


def mixing_matrix(topology: str, n: int) -> torch.Tensor:
    """The ``n x n`` gossip weights (row ``i``: what rank ``i`` averages)."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        group = [i, *neighbours(topology, n, i)]
        w[i, group] = 1.0 / len(group)
    return w


# -- wire accounting (bytes each rank sends; also what cost/dp_modes.py prices) ----------------

def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def allgather_bytes(local_nbytes: float, n: int) -> float:
    return (n - 1) * local_nbytes if n > 1 else 0.0


# -- the per-axis state ------------------------------------------------------------------------

class _Quantized:
    """One bucket's quantized exchange: its gradient (``buf``, to be divided by ``divide``) and
    error feedback's residual (``have``, added to it), its chunks' scales (the max all-reduce in flight, then its result) and, once
    rounded, its levels' all-reduce."""

    __slots__ = ("bucket", "buf", "divide", "have", "maxima", "gen", "levels")

    def __init__(self, bucket: int, buf: torch.Tensor, divide: float, have: torch.Tensor | None,
                 maxima: torch.Tensor, gen: torch.Generator) -> None:
        self.bucket, self.buf, self.divide, self.have = bucket, buf, divide, have
        self.maxima, self.gen = maxima, gen
        self.levels: torch.Tensor | None = None


class ModeState:
    """One data axis's mode: step count, error-feedback memory, queued async reductions and the
    bytes this rank sent (``sent_bytes``, cumulative: benchmarks read it)."""

    def __init__(self, mode: DataMode, *, n: int, rank: int, group_name: str,
                 device: torch.device = torch.device("cpu")) -> None:
        self.mode, self.n, self.rank, self.group_name, self.device = mode, n, rank, group_name, device
        self.steps = 0                                     # optimizer steps taken
        self.memory: dict[int, torch.Tensor] = {}          # bucket -> error-feedback residual
        self.issued: dict[int, int] = {}                   # bucket -> exchanges so far (seeds draws)
        self.queued: list[tuple[int, int, Any]] = []       # async: (step, bucket, pending all-reduce)
        self.unsent: list[_Quantized] = []                 # quantize: buckets whose scales are in flight
        self.sent_bytes = 0.0

    # -- in the graph ---------------------------------------------------------------------
    def local_step(self) -> bool:
        """Whether this step's gradients stay on the rank (parameters are averaged after it)."""
        m = self.mode
        return m.kind == "gossip" or (m.kind == "local_sgd" and self.steps >= m.warmup)

    def issue(self, bucket: int, buf: torch.Tensor, divide: float = 1) -> Any:
        """Start the exchange of one bucket's flat gradient ``buf / divide`` (``divide`` is
        the axis size unless :meth:`local_step`; quantize divides in its own passes, the others
        divide ``buf`` in place); a handle for :meth:`finish`."""
        m = self.mode
        if divide != 1 and not (m.kind == "compressed" and m.compressor == "quantize"):
            buf = buf.div_(divide)
        if self.local_step():
            return ("local", buf)
        if m.kind != "compressed":
            self.sent_bytes += ring_allreduce_bytes(buf.numel() * buf.element_size(), self.n)
            return ("allreduce", c10d.all_reduce_(buf, "sum", self.group_name))
        count = self.issued.get(bucket, 0)
        self.issued[bucket] = count + 1
        gen = torch.Generator().manual_seed((m.seed * 1_000_003 + bucket) * 1_000_003 + count)
        have = self.memory.get(bucket) if m.error_feedback else None
        if m.compressor == "quantize":
            # a scale per chunk shared by every rank (the largest magnitude over the ranks), so the
            # ranks' levels are summed by one integer all-reduce. The scales' all-reduce is only
            # started here; the bucket is rounded and its levels sent when the next bucket comes
            # (or its result is wanted), so backward does not wait for the other ranks to reach
            # this bucket. Earlier buckets' levels go first: every rank issues in one order.
            self._send_quantized()
            # error feedback: the residual is added in the scales' pass and in the rounding's
            maxima = chunk_maxima(buf, have, divide)
            job = _Quantized(bucket, buf, divide, have, c10d.all_reduce_(maxima, "max", self.group_name), gen)
            self.unsent.append(job)
            return ("quantize", job)
        p = buf if have is None else have.add_(buf)      # the residual's buffer takes the sum
        k = keep_count(p.numel(), m.ratio)
        if m.compressor == "randk":
            idx = randk_indices(p.numel(), k, gen).to(p.device)
            vals = p[idx]
            if m.error_feedback:         # what is not sent stays: p with the sent entries zeroed
                self.memory[bucket] = (buf.clone() if p is buf else p).index_fill_(0, idx, 0)
            self.sent_bytes += ring_allreduce_bytes(vals.numel() * vals.element_size(), self.n)
            return ("randk", c10d.all_reduce_(vals.contiguous(), "sum", self.group_name), idx, p.numel())
        vals, idx = topk(p, k)
        if m.error_feedback:
            self.memory[bucket] = (buf.clone() if p is buf else p).index_fill_(0, idx, 0)
        self.sent_bytes += allgather_bytes(k * (vals.element_size() + 4), self.n)   # int32 indices on the wire
        # values and int32 indices travel as one byte string: one gather, not two
        packed = torch.cat([vals.reshape(-1).view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])
        return ("topk", all_gather_start(packed, self.n, self.group_name), p.numel(), vals.dtype, k)

    def finish(self, handle: Any) -> torch.Tensor:
        """The bucket's flat gradient once ``handle``'s exchange is done: the sum over the axis
        of the (pre-divided) gradients, or this rank's own one."""
        kind = handle[0]
        if kind in ("local", "done"):       # a local gradient; an async one a checkpoint waited for
            return handle[1]
        if kind == "allreduce":
            return c10d.wait_tensor(handle[1])
        if kind == "randk":
            _, pending, idx, numel = handle
            vals = c10d.wait_tensor(pending)
            return torch.zeros(numel, dtype=vals.dtype, device=vals.device).index_copy_(0, idx, vals)
        if kind == "topk":
            _, pending, numel, dtype, k = handle
            rows = all_gather_wait(pending).view(self.n, -1)
            width = k * torch.empty((), dtype=dtype).element_size()
            vals = rows[:, :width].contiguous().view(dtype).reshape(-1)
            idx = rows[:, width:].contiguous().view(torch.int32).reshape(-1)
            return torch.zeros(numel, dtype=dtype, device=vals.device).index_add_(0, idx.long(), vals)
        job = handle[1]
        if job.levels is None:
            self._send_quantized(job)
        return dequantize(c10d.wait_tensor(job.levels), job.maxima, self.mode.levels, job.buf.dtype)

    def _send_quantized(self, upto: "_Quantized | None" = None) -> None:
        """Round the buckets whose scales are in flight (in the order they came, up to ``upto``)
        and start the all-reduces of their levels."""
        m = self.mode
        wide = level_dtype(self.n, m.levels)
        while self.unsent:
            job = self.unsent.pop(0)
            job.maxima = maxima = c10d.wait_tensor(job.maxima)
            if m.error_feedback:         # what was not sent stays
                q, self.memory[job.bucket] = quantize(job.buf, maxima, m.levels, job.gen, wide,
                                                      residual=True, add=job.have, divide=job.divide)
            else:
                q = quantize(job.buf, maxima, m.levels, job.gen, wide, divide=job.divide)
            self.sent_bytes += (ring_allreduce_bytes(q.numel() * q.element_size(), self.n)
                                + ring_allreduce_bytes(maxima.numel() * 4, self.n))
            job.levels = c10d.all_reduce_(q, "sum", self.group_name)
            if job is upto:
                return

    # -- async --------------------------------------------------------------------------------
    def defer(self, bucket: int, handle: Any) -> None:
        """Queue an issued all-reduce for the step ``staleness`` steps on."""
        self.queued.append((self.steps, bucket, handle))

    def take_delayed(self) -> dict[int, torch.Tensor] | None:
        """``async``: bucket -> the averaged flat gradient of step ``steps - staleness`` (summed
        over that step's backwards), waited for now; None while no step is old enough."""
        due = self.steps - self.mode.staleness
        ready = [q for q in self.queued if q[0] <= due]
        self.queued = [q for q in self.queued if q[0] > due]
        if not ready:
            return None
        out: dict[int, torch.Tensor] = {}
        for _, bucket, handle in ready:
            g = self.finish(handle)
            out[bucket] = g if bucket not in out else out[bucket] + g
        return out

    # -- after the optimizer's step -----------------------------------------------------------
    @torch.no_grad()
    def after_step(self, params: list[torch.Tensor]) -> None:
        """Average the stepped ``params`` as the mode says, then count the step."""
        m = self.mode
        self.steps += 1
        if not params or self.n == 1:
            return
        if m.kind == "local_sgd" and self.steps > m.warmup and (self.steps - m.warmup) % m.sync_every == 0:
            self._average(params)
        elif m.kind == "gossip":
            if m.global_every and self.steps % m.global_every == 0:
                self._average(params)
            else:
                self._gossip(params)

    def _flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    def _write(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        at = 0
        for p in params:
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()

    def _average(self, params: list[torch.Tensor]) -> None:
        flat = self._flat(params)
        self.sent_bytes += ring_allreduce_bytes(flat.numel() * flat.element_size(), self.n)
        summed = c10d.wait_tensor(c10d.all_reduce_(flat, "sum", self.group_name))
        self._write(params, summed.div_(self.n))

    def _gossip(self, params: list[torch.Tensor]) -> None:
        from torch.distributed.distributed_c10d import _resolve_process_group
        group = _resolve_process_group(self.group_name)
        peers = neighbours(self.mode.topology, self.n, self.rank)
        flat = self._flat(params)
        got = {p: torch.empty_like(flat) for p in peers}
        ops = [dist.P2POp(dist.isend, flat, group=group, group_peer=p) for p in peers]
        ops += [dist.P2POp(dist.irecv, got[p], group=group, group_peer=p) for p in peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.sent_bytes += len(peers) * flat.numel() * flat.element_size()
        total = flat.clone()
        for p in peers:        # in rank order, so ranks with the same neighbourhood sum alike
            total += got[p]
        self._write(params, total.div_(len(peers) + 1))
