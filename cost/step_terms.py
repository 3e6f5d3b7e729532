"""The terms of a training step beside the pipeline's compute, as the runtime spends them: how
the layers are dealt to pipeline stages (:func:`stage_layers`), what the data axis moves and
hides (:func:`lone_stage_data_axis` without a pipeline, :func:`pipeline_data_axis` inside
one), the optimizer step (:func:`optimizer_time`) and what a device holds
(:func:`device_memory`). :mod:`autopar.cost.hybrid` puts them together."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.compute import op_time

if TYPE_CHECKING:
    from autopar.core.plans import Config
    from autopar.cost.hybrid import ModelFacts


def stage_layers(layers: int, stages: int, block: float, pre: float = 0.0, post: float = 0.0) -> list[int]:
    """Blocks per pipeline stage, contiguous and at least one each, that minimise the slowest
    stage's time: each block costs ``block``, the first stage also ``pre`` (embeddings) and the
    last ``post`` (final norm, head). The runtime's cut search (:func:`autopar.passes.pp_split.
    plan_cuts`) minimises the same bottleneck over the captured ops; restricted to block
    boundaries it is this. Llama 3 405B's 126 layers on 16 stages come out as Meta laid them
    (first and last stage one layer lighter) once the head and embedding weigh about a layer."""
    if stages == 1:
        return [layers]
    extra = [pre] + [0.0] * (stages - 2) + [post]
    block = max(block, 1e-30)

    def capacity(limit: float) -> list[int]:
        return [max(0, int((limit - e) / block * (1 + 1e-12))) for e in extra]

    # the bottleneck is k blocks plus one stage's extra, for some k: search the smallest that fits
    candidates = sorted({k * block + e for e in set(extra) for k in range(1, layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        caps = capacity(candidates[mid])
        if min(caps) >= 1 and sum(caps) >= layers:
            hi = mid
        else:
            lo = mid + 1
    counts = capacity(candidates[lo])
    if min(counts) < 1 or sum(counts) < layers:
        counts = [1] * stages
        counts[stages // 2] += layers - stages
        return counts
    # give back the surplus from the slowest stages, keeping the middle ones the fullest
    surplus = sum(counts) - layers
    order = sorted(range(stages), key=lambda s: (-(counts[s] * block + extra[s]), abs(s - (stages - 1) / 2)))
    while surplus:
        for s in order:
            if surplus and counts[s] > 1:
                counts[s] -= 1
                surplus -= 1
        order = sorted(range(stages), key=lambda s: (-(counts[s] * block + extra[s]), abs(s - (stages - 1) / 2)))
    return counts


@dataclass(frozen=True)
class DataBytes:
    """What one rank's data axis moves: gradients are reduced in fp32 (a mixed-precision run
    keeps and reduces them in fp32, ``runtime/dp.py``), parameters gathered in the compute
    dtype."""

    grads: float
    params: float
    expert_grads: float
    expert_params: float

    @staticmethod
    def of(facts: "ModelFacts", numel: float, expert_numel: float) -> "DataBytes":
        cw = 2.0 if facts.dtype in ("bf16", "fp16") else 4.0
        return DataBytes(grads=4.0 * numel, params=cw * numel, expert_grads=4.0 * expert_numel,
                          expert_params=cw * expert_numel)


def bucket_count(cluster: Cluster, axes: tuple[tuple[str, int], ...], b: DataBytes) -> int:
    """How many buckets the runtime cuts a rank's parameters into (:func:`autopar.build.prepare.
    add_data_axis`: :func:`autopar.cost.dp_planner.bucket_bytes` of the fp32 bytes it reduces,
    the parameters grouped in order until a bucket holds that much): each bucket is one
    collective call, with its own latency, per kind and per exchange."""
    from autopar.cost.dp_planner import bucket_bytes
    if b.grads <= 0:
        return 1
    return max(1, math.ceil(b.grads / bucket_bytes(cluster, axes, "dp", b.grads)))


def data_collective(kind: str, nbytes: float, expert_bytes: float, c: Config, cluster: Cluster,
                     axes: tuple[tuple[str, int], ...], calls: int = 1) -> float:
    """``calls`` collectives (buckets) moving ``nbytes`` in all of a stage's gradients or
    parameters over the data axis, each paying its own latency. With experts (``ep > 1``) their
    ``expert_bytes`` go over the ``dp / ep`` ranks holding the same experts, the dense rest over
    the whole data axis."""
    if c.dp == 1:
        return 0.0

    def timed(nb: float, ax) -> float:
        return calls * collective_time(kind, nb / calls, cluster, ax, "dp")
    if c.ep == 1:
        return timed(nbytes, axes)
    ep_axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep), ("tp", c.tp))
    return timed(nbytes - expert_bytes, axes) + (timed(expert_bytes, ep_axes) if c.dp > c.ep else 0.0)


def lone_stage_data_axis(c: Config, cluster: Cluster, axes: tuple[tuple[str, int], ...], b: DataBytes,
                          m: int, fwd: float, bwd: float) -> tuple[float, float]:
    """The data axis without a pipeline (``pp == 1``, :mod:`autopar.runtime.dp`), as the runtime
    runs it for ``m`` micro-batches of ``fwd`` + ``bwd`` seconds each: seconds in all, and
    exposed. The runtime reduces every backward (there is no skipped synchronisation between
    micro-batches):

    - ZeRO-0 all-reduces each micro-batch's gradients during its backward;
    - ZeRO-1 accumulates whole gradients and reduce-scatters them at ``opt.step()``, then
      all-gathers the updated parameters: both after the last backward, both exposed;
    - ZeRO-2 reduce-scatters each micro-batch's gradients during its backward and all-gathers
      the updated parameters after the step (exposed);
    - ZeRO-3 gathers every bucket for each micro-batch's forward and again for its backward and
      reduce-scatters during backward, prefetched under compute.

    Every kind runs as one call per bucket (:func:`bucket_count`), each paying the axis's
    latency. What overlaps a micro-batch's compute is hidden up to that compute; the last
    bucket's collective (the first bucket's gather) is exposed whatever the overlap.

    Hybrid sharding (``c.shard_group = g < dp``, ZeRO-2/3): gathers and reduce-scatters run over
    the ``g`` consecutive data ranks of a shard group, and each bucket's reduced piece (1/g of
    its gradients) is all-reduced over the ``dp / g`` groups, under the same backward."""
    if c.dp == 1:
        return 0.0, 0.0
    calls = bucket_count(cluster, axes, b)
    g = c.shard_group if 0 < c.shard_group < c.dp and c.zero_stage >= 2 else 0
    replica = 0.0
    if g:
        from dataclasses import replace as _replace
        outer = [(n, d) for n, d in axes if n not in ("dp", "tp")]
        tp = dict(axes).get("tp", 1)
        axes = (*outer, ("dpr", c.dp // g), ("dp", g), ("tp", tp))
        rep_axes = (*outer, ("dp", c.dp // g), ("dps", g), ("tp", tp))
        replica = calls * collective_time("all_reduce", b.grads / g / calls, cluster, rep_axes, "dp")
        c = _replace(c, dp=g)

    def coll(kind: str, nbytes: float, expert: float, n: int = calls) -> float:
        return data_collective(kind, nbytes, expert, c, cluster, axes, n)

    def overlapped(total: float, tail: float, compute: float) -> float:
        return max(total - compute, tail)

    z = c.zero_stage
    rs = coll("reduce_scatter", b.grads, b.expert_grads)
    ag = coll("all_gather", b.params, b.expert_params)
    if z == 0:
        ar = coll("all_reduce", b.grads, b.expert_grads)
        tail = coll("all_reduce", b.grads / calls, 0.0, 1)
        return m * ar, m * overlapped(ar, tail, bwd)
    if z == 1:
        return rs + ag, rs + ag
    rs_tail = coll("reduce_scatter", b.grads / calls, 0.0, 1) + replica / calls
    rs += replica
    if z == 2:
        return m * rs + ag, m * overlapped(rs, rs_tail, bwd) + ag
    tail_ag = coll("all_gather", b.params / calls, 0.0, 1)
    total = m * (2 * ag + rs)
    exposed = m * (overlapped(ag, tail_ag, fwd) + overlapped(ag + rs, tail_ag + rs_tail, bwd))
    return total, exposed


def pipeline_data_axis(c: Config, cluster: Cluster, axes: tuple[tuple[str, int], ...], b: DataBytes,
                        chunk_bwd: tuple[float, ...] = (), group: int = 1) -> tuple[float, float]:
    """The data axis of a pipeline rank (``pp > 1``, :mod:`autopar.runtime.stage_dp`): seconds in
    all, and exposed. It works once per step, not per micro-batch: ZeRO-3 gathers the stages'
    whole parameters before the first micro-batch (exposed: the first forward waits for it);
    ZeRO-1's optimizer reduce-scatters the whole gradients at its step and ZeRO-1/2 all-gather
    the updated parameters after it (exposed). ZeRO-0/2/3 reduce each stage's gradients as one
    bucket the moment the schedule finishes that stage's last backward, so with several stages
    per device (``chunk_bwd``: one micro-batch's backward seconds of each of this device's
    stages, first stage first) a stage's reduction travels under the backwards still to come:
    the interleaved schedule's cool-down runs the stages' last backwards in groups of ``group``
    micro-batches (the pipeline degree), last stage first, so stage ``j``'s reduction has the
    ``group`` backwards of each lower stage to hide under. The reductions go one after another
    on the link; what runs past the last backward is exposed."""
    if c.dp == 1:
        return 0.0, 0.0
    z = c.zero_stage
    reduce = data_collective("all_reduce" if z == 0 else "reduce_scatter", b.grads, b.expert_grads, c, cluster,
                              axes)
    gather = data_collective("all_gather", b.params, b.expert_params, c, cluster, axes) if z >= 1 else 0.0
    if z == 1 or len(chunk_bwd) < 2:
        return reduce + gather, reduce + gather
    v = len(chunk_bwd)
    # one bucket per stage, each a call of its own
    each = data_collective("all_reduce" if z == 0 else "reduce_scatter", b.grads / v, b.expert_grads / v, c,
                           cluster, axes)
    reduce = v * each
    done = -math.inf       # when the link is free, from the last backward's end (negative: before it)
    for j in reversed(range(v)):
        done = max(done, -group * sum(chunk_bwd[:j])) + each
    return reduce + gather, max(0.0, done) + gather


def optimizer_bytes(dtype: str, k: int) -> float:
    """Bytes an elementwise optimizer step (Adam: ``k = 2`` fp32 moments) moves per parameter,
    as a mixed-precision run's is laid out (:mod:`autopar.runtime.optim`, ``runtime/main_grads.py``):
    it reads the fp32 gradient (4), reads and writes the fp32 master (8) and each moment (8 k),
    and writes the 16-bit compute copy of the parameter (2): 30 bytes for Adam. In fp32 the
    master is the parameter: 4 + 8 + 8 k = 28. (Gradients are dropped, not zeroed, after the
    step: no write.)"""
    mixed = dtype in ("bf16", "fp16")
    return 4.0 + 8.0 + 8.0 * k + (2.0 if mixed else 0.0)


def optimizer_time(numel: float, bytes_per_param: float, cluster: Cluster) -> float:
    """An elementwise optimizer over ``numel`` parameters moving ``bytes_per_param`` each
    (:func:`optimizer_bytes`), at the device's memory bandwidth."""
    return op_time(0.0, numel * bytes_per_param, cluster.device, "fp32", launch_overhead=False)


def device_memory(facts: ModelFacts, c: Config, held: float, acts: float, per_block: float,
            numel: Mapping[str, float]) -> dict[str, float]:
    """Peak bytes on one device holding ``held`` parameters and ``acts`` bytes of activations at
    the schedule's peak, by term, as the runtime holds them (``w`` the compute width, ``n`` the
    data axis, ``k`` the optimizer's fp32 moments per parameter):

    ============  ======================================  =======================================
    term          without a pipeline (runtime/dp.py)       inside a pipeline (runtime/stage_dp.py)
    ============  ======================================  =======================================
    params        w, whole; ZeRO-3: two gathered buckets   w, whole (ZeRO-3 keeps them gathered
                  (+ 4/n pieces in fp32)                   for the step; + 4/n pieces in fp32)
    grads         ZeRO-0: 4 (fp32 sums); ZeRO-1: w whole   4, whole (fp32 sums over the
                  (4/n pieces only inside the step);       micro-batches)
                  ZeRO-2/3: 4/n
    optimizer     (4 masters in 16-bit + 4k), /n for ZeRO >= 1 (in 32-bit the masters are the
                  parameters or their pieces)
    activations   ``acts``, plus under full recomputation one block's whole activations while
                  it is recomputed
    ============  ======================================  =======================================
    """
    mixed = facts.dtype in ("bf16", "fp16")
    n, z, k = c.dp, c.zero_stage, facts.k
    if 0 < c.shard_group < c.dp and z >= 2:      # hybrid sharding: pieces of 1/g, replicated across groups
        n = c.shard_group
    w = 2.0 if mixed else 4.0
    optim = ((4 + 4 * k) if mixed else 4 * k) * held / (n if z >= 1 else 1)
    pieces = 0.0 if mixed or z < 3 else 4 * held / n          # fp32 ZeRO-3: the pieces beside the whole
    if c.pp > 1:
        params = w * held + pieces
        grads = 4.0 * held
    else:
        bucket = max(per_block, numel["pre"], numel["post"])
        params = (w * min(held, 2 * bucket) + pieces) if z == 3 else w * held
        # ZeRO-1's fp32 pieces exist only inside the optimizer step, after activations are freed
        grads = {0: 4.0 * held, 1: w * held}.get(z, 4.0 * held / n)
    return {"params": params, "grads": grads, "optimizer": optim, "activations": acts}


__all__ = ["stage_layers", "DataBytes", "bucket_count", "data_collective", "lone_stage_data_axis", "pipeline_data_axis",
           "optimizer_bytes", "optimizer_time", "device_memory"]
