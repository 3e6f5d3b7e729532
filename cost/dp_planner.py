"""Data parallelism with ZeRO stages 0-3 on a dp x tp mesh: memory, communication, the planner.

Memory (:func:`memory_split`): bytes per device of parameters, gradients, optimizer state,
activations and buffers, for each ZeRO stage. The formulas are what the runtime
(``runtime/dp.py``) holds; with T trainable and F frozen tp-local elements, N = dp, K fp32
optimizer floats per parameter, p the parameter width and c = 2 the 16-bit compute width:

    fp32            params            grads          optimizer
    stage 0         p(T+F)            4T             4KT
    stage 1         p(T+F)            4T             4KT/N
    stage 2         p(T+F)            4T/N           4KT/N
    stage 3         p(T+F)/N          4T/N           4KT/N

    bf16 / fp16     params            grads          optimizer
    stage 0         c(T+F)            4T             4(K+1)T        (fp32 masters)
    stage 1         c(T+F)            cT + 4T/N      4(K+1)T/N
    stage 2         c(T+F)            4T/N           4(K+1)T/N
    stage 3         4(T+F)/N          4T/N           4KT/N          (the fp32 shards are the
                                                                     masters)

Communication (:func:`dp_comm_time`): the alpha-beta time of the data axis's collectives per
step, bucketed (:func:`bucket_bytes`). Gradients are reduced in fp32; parameters are
gathered in the compute dtype (what ``runtime/dp.py`` does).

Overlap (:func:`exposed_comm`): what of that communication the step waits for.

Planner (:func:`plan_dp`): for every tp degree t (the tensor solver of
:mod:`autopar.cost.tp_solver`, run once per t) and dp = devices / t, and every ZeRO stage,
score step time = compute + tp communication + exposed dp communication, and check memory
against the budget. Objective: the fastest configuration that fits; ties go to the lower ZeRO
stage (less traffic, simpler runtime).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.op_cost import node_seconds
from autopar.cost.tp_solver import Solution, SolverConfig, solve
from autopar.core.errors import AutoparInternalError, ConfigError
from autopar.passes.memory import OPTIMIZER_STATE
from autopar.core.meta import dtype_bytes, evaluate, graph_info, info
from autopar.passes.sharding import is_decision
from autopar.core.placement import Shard

log = logging.getLogger("autopar.dp_planner")

MiB = 1 << 20
BUCKET_MIN, BUCKET_MAX = 4 * MiB, 256 * MiB
COMPUTE_BYTES = 2                   # bf16 / fp16
MIXED = ("bf16", "fp16")
MAX_DEVICES = 4096                  # how far the "smallest device count that fits" search looks


# ------------------------------------------------------------------------------ memory

@dataclass(frozen=True)
class MemorySplit:
    """Bytes per device."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "total": self.total}


def optimizer_floats(optimizer: str) -> int:
    """K: fp32 optimizer-state elements per trainable parameter (``passes.memory.OPTIMIZER_STATE``)."""
    key = str(optimizer).strip().lower().replace("_", "-")
    if key not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}", where="optimizer",
                          expected=", ".join(sorted(OPTIMIZER_STATE)), got=repr(optimizer),
                          fix="pick one of the expected optimizer kinds")
    return OPTIMIZER_STATE[key]


def mixed_dtype(mixed_precision: str | None) -> str | None:
    """None for fp32 training (``None`` or ``"fp32"``), else the 16-bit compute dtype."""
    if mixed_precision is None or str(mixed_precision).lower() in ("fp32", "float32"):
        return None
    key = str(mixed_precision).lower()
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(key, key)
    if key not in MIXED:
        raise ConfigError(f"unknown mixed precision {mixed_precision!r}", where="mixed_precision",
                          expected="None (fp32), 'bf16' or 'fp16'", got=repr(mixed_precision),
                          fix="use bf16 (or fp16) compute with fp32 masters, or None for fp32")
    return key


def _check_stage(zero_stage: int, dp: int) -> None:
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ConfigError("ZeRO stage must be 0, 1, 2 or 3", where="zero_stage", expected="0, 1, 2 or 3",
                          got=repr(zero_stage), fix="pick a ZeRO stage between 0 and 3")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError("the data-parallel degree must be a positive integer", where="dp",
                          expected="an int >= 1", got=repr(dp))


def memory_split(*, trainable_numel: int, frozen_numel: int = 0, dp: int, zero_stage: int,
                 mixed_precision: str | None = None, optimizer: str = "adamw", param_bytes: int = 4,
                 activation_bytes: float = 0.0, buffer_bytes: float = 0.0) -> MemorySplit:
    """Per-device bytes under ZeRO ``zero_stage`` (the tables in the module docstring).

    ``trainable_numel`` / ``frozen_numel`` are per tp rank (already tensor-parallel local).
    """
    _check_stage(zero_stage, dp)
    k = optimizer_floats(optimizer)
    t, f, n, s = float(trainable_numel), float(frozen_numel), dp, zero_stage
    if mixed_dtype(mixed_precision) is None:
        p = float(param_bytes)
        params = p * (t + f) / (n if s == 3 else 1)
        grads = 4 * t / (n if s >= 2 else 1)
        opt = 4 * k * t / (n if s >= 1 else 1)
    else:
        c = COMPUTE_BYTES
        params = 4 * (t + f) / n if s == 3 else c * (t + f)
        grads = {0: 4 * t, 1: c * t + 4 * t / n}.get(s, 4 * t / n)
        opt = {0: 4 * (k + 1) * t, 3: 4 * k * t / n}.get(s, 4 * (k + 1) * t / n)
    return MemorySplit(params=params, grads=grads, optimizer=opt, activations=float(activation_bytes),
                       buffers=float(buffer_bytes))


# ------------------------------------------------------------------------------ communication

def bucket_bytes(cluster: Cluster, mesh_axes: Sequence[tuple[str, int]], axis: str,
                 total_bytes: float) -> int:
    """Gradient bucket size for the data axis ``axis`` when ``total_bytes`` of gradients are
    reduced per step.

    A bucketed collective costs ``alpha + nbytes * per_byte`` (alpha-beta): alpha is the whole
    per-call latency of one all_reduce over the axis (base + ring steps, intra- or inter-node
    as the axis's groups sit) and ``per_byte`` the inverse of its algorithm bandwidth, both
    read off :func:`autopar.cost.comm.collective_time` so hierarchical axes are priced the way
    collectives are. With buckets of B bytes a step pays ``(G / B) * alpha`` in latency, and
    the last bucket, issued when backward ends, is exposed whole: ``B * per_byte``. Their sum
    is smallest at ``B = sqrt(G * alpha / per_byte)``, where the two are equal. Clamped to
    [4 MiB, 256 MiB] and to one bucket for all of ``G``. The floor is for the host work per
    bucket that alpha does not include (flattening, scaling and unflattening the gradients,
    dispatching the collective from Python): measured ~0.2-0.4 ms per bucket with gloo on a
    2-core CPU, where communication shares the cores with compute, so a bucket should move
    a few MiB to keep it under a tenth of its transfer; above 256 MiB the flat buffers' memory
    dominates. (A DGX A100 with dp=8 inside a node and 1 GB of gradients gets ~70 MB.)
    """
    latency = collective_time("all_reduce", 0.0, cluster, mesh_axes, axis)
    probe = float(BUCKET_MAX)
    per_byte = (collective_time("all_reduce", probe, cluster, mesh_axes, axis) - latency) / probe
    if latency <= 0 or per_byte <= 0 or total_bytes <= 0:
        return BUCKET_MIN
    best = math.sqrt(total_bytes * latency / per_byte)
    return int(min(max(best, BUCKET_MIN), BUCKET_MAX, max(total_bytes, BUCKET_MIN)))


def _bucketed(kind: str, total: float, bucket: int, cluster: Cluster, mesh_axes, axis: str) -> float:
    """Seconds to move ``total`` bytes as full buckets plus one remainder, one call each."""
    if total <= 0:
        return 0.0
    full, rest = divmod(float(total), float(bucket))
    out = full * collective_time(kind, bucket, cluster, mesh_axes, axis) if full else 0.0
    return out + (collective_time(kind, rest, cluster, mesh_axes, axis) if rest > 0 else 0.0)


def dp_comm_time(grad_bytes: float, *, dp: int, zero_stage: int, cluster: Cluster,
                 mesh_axes: Sequence[tuple[str, int]], axis: str, bucket: int,
                 gather_bytes: float | None = None) -> dict[str, float]:
    """Per-step seconds of each collective kind on the data axis.

    ``grad_bytes``: the gradients one rank reduces (full tensors, fp32). ``gather_bytes``: the
    parameters one rank gathers (full tensors, compute dtype; default ``grad_bytes``).
    Stage 0: all_reduce of the gradients. Stages 1, 2: reduce_scatter of the gradients and
    all_gather of the updated parameters. Stage 3: all_gather in forward, again in backward,
    and reduce_scatter of the gradients. Each is bucketed (sum over buckets).
    """
    _check_stage(zero_stage, dp)
    sizes = dict(mesh_axes)
    if sizes.get(axis) != dp:
        raise ConfigError(f"mesh axis {axis!r} does not have dp={dp} ranks", where="dp_comm_time",
                          expected=f"{axis}={dp} in the mesh", got=str(tuple(mesh_axes)))
    gather = grad_bytes if gather_bytes is None else gather_bytes

    def timed(kind: str, nbytes: float) -> float:
        return _bucketed(kind, nbytes, bucket, cluster, mesh_axes, axis)

    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if zero_stage == 0:
        out["all_reduce"] = timed("all_reduce", grad_bytes)
    else:
        out["reduce_scatter"] = timed("reduce_scatter", grad_bytes)
        out["all_gather"] = timed("all_gather", gather) * (2 if zero_stage == 3 else 1)
    out["total"] = sum(out.values())
    return out


def exposed_comm(comm: dict[str, float], *, zero_stage: int, fwd_compute_s: float, bwd_compute_s: float,
                 last_reduce_s: float, first_gather_s: float = 0.0) -> float:
    """Seconds of data-axis communication the step waits for.

    - Gradient reductions (stage 0 all_reduce, stages 2/3 reduce_scatter) run bucket by bucket
      under the rest of backward; the last bucket is issued when backward ends, so it is
      always exposed: ``max(0, reduce - last - backward) + last``.
    - Stage 1 reduces and gathers at the optimizer step: all of it is exposed.
    - Stage 2 gathers the updated parameters after the optimizer step: exposed.
    - Stage 3 gathers run one bucket ahead of compute: forward gathers hide under forward
      except the first bucket; backward re-gathers share backward with the reduce_scatter.
    Overlappable compute is compute only (tensor-axis collectives block the compute stream).
    """
    def hidden(comm_s: float, under: float, tail: float) -> float:
        tail = min(tail, comm_s)
        return max(0.0, comm_s - tail - under) + tail

    if zero_stage == 0:
        return hidden(comm["all_reduce"], bwd_compute_s, last_reduce_s)
    if zero_stage == 1:
        return comm["reduce_scatter"] + comm["all_gather"]
    if zero_stage == 2:
        return hidden(comm["reduce_scatter"], bwd_compute_s, last_reduce_s) + comm["all_gather"]
    fwd_gather = comm["all_gather"] / 2
    return (hidden(fwd_gather, fwd_compute_s, first_gather_s)
            + hidden(fwd_gather + comm["reduce_scatter"], bwd_compute_s, last_reduce_s))


# ------------------------------------------------------------------------------ planner results

@dataclass(frozen=True)
class DPChoice:
    """One configuration, scored. ``micro_batch`` is the batch of one dp rank."""

    dp: int
    tp: int
    zero_stage: int
    micro_batch: int
    step_time_s: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    exposed_comm_s: float
    memory: MemorySplit
    fits: bool
    reason: str = ""                 # why it lost / does not fit ("" for the chosen one)
    bucket_bytes: int = 0            # the gradient/gather bucket the prediction assumes

    def as_dict(self) -> dict[str, Any]:
        return {"degrees": {"dp": self.dp, "tp": self.tp}, "zero_stage": self.zero_stage,
                "micro_batch_size": self.micro_batch, "bucket_bytes": self.bucket_bytes,
                "predicted": {"step_time_s": self.step_time_s, "compute_s": self.compute_s,
                              "tp_comm_s": self.tp_comm_s, "dp_comm_s": self.dp_comm_s,
                              "exposed_comm_s": self.exposed_comm_s, "memory_bytes": self.memory.as_dict()},
                "fits": self.fits, "reason": self.reason}


@dataclass(frozen=True)
class DPPlanResult:
    """The fastest configuration that fits (None if none), the others, and what would fit."""

    best: DPChoice | None
    alternatives: list[DPChoice]     # every other configuration: those that fit first, by step time
    devices: int
    memory_budget: float
    smallest_devices: int | None = None     # when nothing fits: the smallest device count that would
    largest_micro_batch: int | None = None  # when nothing fits: the largest per-rank batch that would
                                            # at this device count (0: not even 1)
    largest_micro_batch_degrees: tuple[int, int] | None = None  # the (dp, tp) it fits with


# ------------------------------------------------------------------------------ graph facts

@dataclass(frozen=True)
class _Local:
    """What one tp rank stores under one tensor-axis solution."""

    trainable: float
    frozen: float
    buffer_bytes: float


class _Facts:
    """Everything the planner reads from the analysed graph, evaluated lazily per batch."""

    def __init__(self, gm: fx.GraphModule, sizes: dict[str, int], mixed: str | None, device) -> None:
        ginfo = graph_info(gm)
        self.gm, self.device = gm, device
        self.base_sizes = {**ginfo.example_sizes, **sizes}
        self.symbolic_batch = "batch" in ginfo.symbols
        nodes = list(gm.graph.nodes)
        self.params = [n for n in nodes if n.op == "placeholder" and info(n).kind == "param" and info(n).values]
        self.buffers = [n for n in nodes if n.op == "placeholder" and info(n).kind == "buffer" and info(n).values]
        stored = info(self.params[0]).values[0].dtype if self.params else None
        self.param_bytes = dtype_bytes(stored) if stored is not None else 4
        # The dtype compute runs in: the mixed-precision dtype, else the parameters' own.
        self.dtype = mixed or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(stored, "fp32")
        self.live = sorted({sympy.expand(info(n).live_bytes) for n in nodes}, key=str)
        self.ops = [n for n in nodes if is_decision(n)]
        self._roofline: dict[int, tuple[float, float]] = {}
        self._peak: dict[int, float] = {}

    def sizes(self, micro_batch: int) -> dict[str, int]:
        return {**self.base_sizes, "batch": micro_batch} if self.symbolic_batch else dict(self.base_sizes)

    def activations(self, micro_batch: int) -> float:
        """Peak forward-live activation bytes of one rank (the memory pass's liveness)."""
        if micro_batch not in self._peak:
            at = self.sizes(micro_batch)
            self._peak[micro_batch] = float(max((evaluate(e, at) for e in self.live), default=0))
        return self._peak[micro_batch]

    def roofline(self, micro_batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of the whole graph on one device, nothing split."""
        if micro_batch not in self._roofline:
            at, fwd, bwd = self.sizes(micro_batch), 0.0, 0.0
            for node in self.ops:
                f, b = node_seconds(node, at, self.device, self.dtype)
                fwd += f
                bwd += b
            self._roofline[micro_batch] = (fwd, bwd)
        return self._roofline[micro_batch]

    def local(self, sol: Solution | None, t: int) -> _Local:
        """tp-local storage: a parameter or buffer placed ``S(d)`` keeps numel / t."""
        def numel(node: fx.Node) -> float:
            n = float(evaluate(info(node).values[0].numel, self.base_sizes))
            s = sol.strategies.get(node.name) if sol is not None else None
            return n / t if s is not None and isinstance(s.outputs[0].value, Shard) else n

        trainable = sum(numel(p) for p in self.params if info(p).trainable)
        frozen = sum(numel(p) for p in self.params if not info(p).trainable)
        buffers = sum(numel(b) * dtype_bytes(info(b).values[0].dtype) for b in self.buffers)
        return _Local(trainable=trainable, frozen=frozen, buffer_bytes=buffers)


# ------------------------------------------------------------------------------ the planner

@dataclass(frozen=True, kw_only=True)
class _Setup:
    cluster: Cluster
    devices: int
    batch: int
    budget: float
    stages: tuple[int, ...]
    tp_pool: tuple[int, ...]
    mixed: str | None
    optimizer: str


class _Planner:
    def __init__(self, gm: fx.GraphModule, setup: _Setup, sizes: dict[str, int]) -> None:
        self.s = setup
        self.facts = _Facts(gm, sizes, setup.mixed, setup.cluster.device)
        self.gm = gm
        self._solutions: dict[tuple[int, int], Solution | None] = {}
        self._locals: dict[int, _Local] = {}

    # -- per tp degree --------------------------------------------------------------------
    def solution(self, t: int, micro_batch: int, cluster: Cluster, dp: int) -> Solution | None:
        """The tensor solver's choice at t (None for t == 1: everything replicated)."""
        key = (t, micro_batch)
        if key not in self._solutions:
            sol = None
            if t > 1:
                cfg = SolverConfig(n=t, cluster=cluster, mesh_axes=(("dp", dp), ("tp", t)), axis="tp",
                                   sizes=self.facts.sizes(micro_batch), dtype=self.facts.dtype,
                                   optimizer=self.s.optimizer)
                sol = solve(self.gm, cfg)
            self._solutions[key] = sol
            self._locals.setdefault(t, self.facts.local(sol, t))
        return self._solutions[key]

    def activations(self, micro_batch: int, t: int) -> float:
        # Approximation: tensor parallelism splits activations evenly over the tp ranks (true
        # for the sharded matmuls and attention heads; optimistic for norms and residuals that
        # stay replicated without sequence parallelism). 16-bit compute halves what an
        # fp32-captured graph records.
        scale = COMPUTE_BYTES / self.facts.param_bytes if self.s.mixed and self.facts.param_bytes == 4 else 1.0
        return self.facts.activations(micro_batch) * scale / t

    def memory(self, t: int, dp: int, stage: int, micro_batch: int) -> MemorySplit:
        loc = self._locals[t]
        return memory_split(trainable_numel=loc.trainable, frozen_numel=loc.frozen, dp=dp, zero_stage=stage,
                            mixed_precision=self.s.mixed, optimizer=self.s.optimizer,
                            param_bytes=self.facts.param_bytes, activation_bytes=self.activations(micro_batch, t),
                            buffer_bytes=loc.buffer_bytes)

    # -- scoring --------------------------------------------------------------------------
    def choices_for(self, t: int) -> list[DPChoice]:
        dp, cluster = self.s.devices // t, self.s.cluster
        mb = self.s.batch // dp
        sol = self.solution(t, mb, cluster, dp)
        fwd, bwd = self.facts.roofline(mb)
        compute = sol.compute_s if sol is not None else fwd + bwd
        tp_comm = sol.comm_s if sol is not None else 0.0
        bwd_share = bwd / (fwd + bwd) if fwd + bwd > 0 else 2 / 3
        axes = (("dp", dp), ("tp", t))
        loc = self._locals[t]
        grad_bytes = 4 * loc.trainable
        bucket = bucket_bytes(cluster, axes, "dp", grad_bytes)
        out = []
        for stage in self.s.stages:
            gathered = loc.trainable + (loc.frozen if stage == 3 else 0.0)
            gather_bytes = gathered * (COMPUTE_BYTES if self.s.mixed else self.facts.param_bytes)
            comm = dp_comm_time(grad_bytes, dp=dp, zero_stage=stage, cluster=cluster, mesh_axes=axes, axis="dp",
                                bucket=bucket, gather_bytes=gather_bytes)
            reduce_kind = "all_reduce" if stage == 0 else "reduce_scatter"
            last = collective_time(reduce_kind, min(bucket, grad_bytes), cluster, axes, "dp")
            first = collective_time("all_gather", min(bucket, gather_bytes), cluster, axes, "dp")
            exposed = exposed_comm(comm, zero_stage=stage, fwd_compute_s=compute * (1 - bwd_share),
                                   bwd_compute_s=compute * bwd_share, last_reduce_s=last, first_gather_s=first)
            mem = self.memory(t, dp, stage, mb)
            out.append(DPChoice(dp=dp, tp=t, zero_stage=stage, micro_batch=mb,
                                step_time_s=compute + tp_comm + exposed, compute_s=compute, tp_comm_s=tp_comm,
                                dp_comm_s=comm["total"], exposed_comm_s=exposed, memory=mem,
                                fits=mem.total <= self.s.budget, bucket_bytes=bucket))
        return out

    # -- what would fit -------------------------------------------------------------------
    def lean_options(self, devices: int) -> list[tuple[int, int]]:
        """(tp, dp) pairs on ``devices``, each to be taken at the highest allowed ZeRO stage."""
        per_node = self.s.cluster.devices_per_node
        return [(t, devices // t) for t in self.s.tp_pool if devices % t == 0 and t <= min(devices, per_node)]

    def lean_memory(self, devices: int, t: int, dp: int, micro_batch: int) -> float:
        """Bytes per device at the highest allowed ZeRO stage (memory formulas only)."""
        if t not in self._locals:   # one solve per tp degree gives its parameter layout
            self.solution(t, micro_batch, _cluster_for(self.s.cluster, devices), dp)
        return self.memory(t, dp, max(self.s.stages), micro_batch).total

    def smallest_devices(self) -> int | None:
        """The smallest device count (dp dividing the global batch, whole nodes) where some tp
        degree fits at the highest allowed ZeRO stage."""
        per_node, batch = self.s.cluster.devices_per_node, self.s.batch
        counts = sorted({d * t for t in self.s.tp_pool for d in _divisors(batch)
                         if self.s.devices < d * t <= MAX_DEVICES and (d * t <= per_node or d * t % per_node == 0)})
        for count in counts:
            if any(batch % dp == 0 and self.lean_memory(count, t, dp, batch // dp) <= self.s.budget
                   for t, dp in self.lean_options(count)):
                return count
        return None

    def largest_micro_batch(self) -> tuple[int, tuple[int, int] | None]:
        """The largest per-rank batch that fits on this device count (0: not even one sample)
        and the (dp, tp) it fits with. Memory grows with the batch, so bisect per tp degree."""
        best: tuple[int, tuple[int, int] | None] = (0, None)
        for t, dp in self.lean_options(self.s.devices):
            lo, hi = 0, max(1, self.s.batch // dp)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.lean_memory(self.s.devices, t, dp, mid) <= self.s.budget:
                    lo = mid
                else:
                    hi = mid - 1
            if lo > best[0]:
                best = (lo, (dp, t))
        return best


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt n) steps (a global batch can be 2^31 - 1)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _cluster_for(cluster: Cluster, devices: int) -> Cluster:
    """The cluster of ``devices`` devices made of the same nodes."""
    per_node = cluster.devices_per_node
    if devices == cluster.world_size:
        return cluster
    if devices % per_node == 0:
        return replace(cluster, nodes=devices // per_node)
    if devices < per_node:
        return replace(cluster, nodes=1, devices_per_node=devices)
    raise ConfigError(f"{devices} devices do not fill whole nodes of {per_node}", where="devices",
                      expected=f"fewer than {per_node} or a multiple of {per_node}", got=str(devices),
                      fix=f"use a multiple of {per_node} devices")


def _tp_pool(tp_degrees: Sequence[int] | None, devices: int, per_node: int) -> tuple[int, ...]:
    if tp_degrees is None:
        pool, t = [], 1
        while t <= min(devices, per_node):
            pool.append(t)
            t *= 2
        return tuple(pool)
    bad = [t for t in tp_degrees if not isinstance(t, int) or t < 1 or devices % t or t > per_node]
    if bad or not tp_degrees:
        raise ConfigError("tensor-parallel degrees must divide the device count and fit in a node",
                          where="tp_degrees", expected=f"divisors of {devices} up to {per_node}",
                          got=repr(list(tp_degrees)), fix="pick tp degrees like 1, 2, 4, 8")
    return tuple(sorted(set(tp_degrees)))


def plan_dp(gm: fx.GraphModule, *, cluster: Cluster, devices: int, batch: int, sizes: dict,
            memory_budget: float | None, zero_stages: Sequence[int] = (0, 1, 2, 3),
            tp_degrees: Sequence[int] | None = None, mixed_precision: str | None = None,
            optimizer: str = "adamw") -> DPPlanResult:
    """Pick dp, tp and the ZeRO stage for training ``gm`` on ``devices`` devices at global ``batch``.

    ``gm`` is a captured and analysed graph; ``sizes`` the other sizes to evaluate it at (e.g.
    ``{"seq": 1024}``; its batch is replaced by the per-rank batch). ``memory_budget``: bytes
    per device (default: the device's memory). Every (tp, ZeRO stage) with dp = devices / tp
    dividing the batch is scored; see the module docstring for the objective.
    """
    cluster = _cluster_for(cluster, devices)
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError("the global batch must be a positive integer", where="batch", got=repr(batch))
    stages = tuple(sorted(set(zero_stages)))
    for s in stages:
        _check_stage(s, 1)
    setup = _Setup(cluster=cluster, devices=devices, batch=batch,
                   budget=float(memory_budget if memory_budget is not None else cluster.device.memory_bytes),
                   stages=stages, tp_pool=_tp_pool(tp_degrees, devices, cluster.devices_per_node),
                   mixed=mixed_dtype(mixed_precision), optimizer=optimizer)
    optimizer_floats(optimizer)
    planner = _Planner(gm, setup, {k: v for k, v in dict(sizes).items() if k != "batch"})
    usable = [t for t in setup.tp_pool if batch % (devices // t) == 0]
    if not usable:
        dps = sorted({devices // t for t in setup.tp_pool})
        raise ConfigError(f"global batch {batch} does not split over any data-parallel degree", where="batch",
                          expected=f"a batch divisible by one of dp = {dps}", got=str(batch),
                          fix=f"use a global batch that is a multiple of {min(dps)}")
    choices = [c for t in usable for c in planner.choices_for(t)]
    best, others = _rank(choices, setup.budget)
    smallest = largest = degrees = None
    if best is None:
        smallest, (largest, degrees) = planner.smallest_devices(), planner.largest_micro_batch()
    log.info("dp planner: %d configurations, best %s", len(choices),
             f"dp={best.dp} tp={best.tp} ZeRO-{best.zero_stage}" if best else "none fits")
    return DPPlanResult(best=best, alternatives=others, devices=devices, memory_budget=setup.budget,
                        smallest_devices=smallest, largest_micro_batch=largest,
                        largest_micro_batch_degrees=degrees)


def _rank(choices: list[DPChoice], budget: float) -> tuple[DPChoice | None, list[DPChoice]]:
    """Fastest fitting first (times compared to the nanosecond, then the lower stage)."""
    def key(c: DPChoice) -> tuple:
        return (not c.fits, round(c.step_time_s * 1e9), c.zero_stage, c.tp)

    ranked = sorted(choices, key=key)
    best = ranked[0] if ranked and ranked[0].fits else None
    others = [replace(c, reason=_reason(c, best, budget)) for c in ranked if c is not best]
    return best, others


def _reason(c: DPChoice, best: DPChoice | None, budget: float) -> str:
    if not c.fits:
        return f"does not fit: needs {c.memory.total / 1e9:.1f} GB, budget {budget / 1e9:.1f} GB"
    if best is None:
        raise AutoparInternalError("a configuration fits but no best was chosen")
    if round(c.step_time_s * 1e9) == round(best.step_time_s * 1e9):
        return f"same step time; the lower ZeRO stage ({best.zero_stage}) is preferred"
    deltas = {"compute": (c.compute_s, best.compute_s),
              "tp communication": (c.tp_comm_s, best.tp_comm_s),
              "exposed dp communication": (c.exposed_comm_s, best.exposed_comm_s)}
    what, (mine, theirs) = max(deltas.items(), key=lambda kv: kv[1][0] - kv[1][1])
    pct = (c.step_time_s / best.step_time_s - 1) * 100 if best.step_time_s > 0 else math.inf
    shown = f"{pct:.0f}%" if pct >= 1 else f"{pct:.2f}%"
    return f"slower by {shown} ({what} {seconds(mine)} vs {seconds(theirs)})"


def seconds(x: float) -> str:
    """A duration at a readable scale: ``1.23 s``, ``45.6 ms``, ``789 us``."""
    if x == 0:
        return "0 ms"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1e3:.1f} ms" if x >= 1e-3 else f"{x * 1e6:.0f} us"


__all__ = ["MemorySplit", "memory_split", "bucket_bytes", "dp_comm_time", "exposed_comm", "DPChoice",
           "DPPlanResult", "plan_dp", "seconds", "optimizer_floats", "mixed_dtype"]
