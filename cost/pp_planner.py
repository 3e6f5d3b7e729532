"""Pipeline parallelism's planner: the stages, the schedule and the micro-batches.

:func:`plan_pipeline` prices the captured graph op by op (the cost model), chooses the
schedule and micro-batch count with the schedule simulator (:mod:`autopar.cost.pp_sim`)
when they are not given, and cuts the graph into ``p * v`` stages with
:func:`autopar.passes.pp_split.plan_cuts`. The build's schedule and pipeline steps
(``autopar/build/pipeline.py``, reached through :func:`autopar.parallelize` with a ``pp`` axis
in the mesh) apply it: a tensor axis is solved and rewritten on the whole graph first, the
rewritten graph is split, and this rank's stages run under a ``torch.distributed.pipelining``
schedule (:class:`autopar.runtime.pp.PipelineModule`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.op_cost import node_seconds
from autopar.cost.pp_sim import ZB_SPLIT_OVERHEAD
from autopar.core.errors import ConfigError, DoesNotFitError
from autopar.core.mesh import pipeline_axes
from autopar.core.meta import info
from autopar.passes.pp_split import CutPlan, OpCosts, op_costs, plan_cuts

log = logging.getLogger("autopar.cost.pp_planner")

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
# searched when no schedule is given; DualPipeV runs only when asked for (its forward and backward
# pairs run concurrently in two threads: runtime/pp_overlap.py)
AUTO_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class PipelinePlan:
    """Stage cuts, schedule and micro-batches, with the simulator's prediction."""

    stages: int                       # p * v
    devices: int                      # p
    virtual: int                      # v
    schedule: str
    microbatches: int
    cuts: CutPlan
    step_time_s: float
    bubble_fraction: float
    peak_activation_bytes: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"pp": self.devices, "virtual_stages": self.virtual, "schedule": self.schedule,
                "microbatches": self.microbatches, "stage_starts": list(self.cuts.start_nodes),
                "stage_time_s": list(self.cuts.stage_time_s), "step_time_s": self.step_time_s,
                "bubble_fraction": self.bubble_fraction}


def node_time_fn(device, dtype: str, sizes: Mapping[str, int] | None = None) -> Callable[[fx.Node], float]:
    """Forward + backward seconds of one op at ``sizes`` (collectives the tensor-axis rewrite
    inserted count their predicted time)."""
    at = dict(sizes or {})

    def time(node: fx.Node) -> float:
        rec = info(node)
        if rec.collective is not None:
            return rec.collective.time_fwd_s + rec.collective.time_bwd_s
        f, b = node_seconds(node, at, device, dtype)
        return f + b
    return time


def inflight(schedule: str, stages: int, devices: int, microbatches: int) -> list[int]:
    """Micro-batches whose activations each stage holds at once (the schedule's peak)."""
    if schedule == "gpipe":
        return [microbatches] * stages
    if schedule == "dualpipev":        # V placement: stage s holds 2p - s (torch's order, cost/pp_dualpipe.dualpipe_v)
        return [min(microbatches, 2 * devices - s) for s in range(stages)]
    return [min(microbatches, max(1, devices - (s % devices)) * (1 if stages == devices else 2))
            for s in range(stages)]


def simulate_plan(costs: OpCosts, cuts: CutPlan, *, schedule: str, devices: int, virtual: int,
                  microbatches: int, p2p_time: Callable[[float], float], zb_overhead: float = ZB_SPLIT_OVERHEAD):
    """The simulator's result for these cuts under ``schedule`` (``zb_overhead``: the device's
    split-backward overhead, :attr:`autopar.cost.hardware.DeviceSpec.zb_split_overhead`)."""
    from autopar.cost.pp_sim import StageCosts, make, simulate

    k = len(costs.ops)
    ends = list(cuts.starts[1:]) + [k]
    fwd, bwd, wgt = [], [], []
    split = 1.0 + zb_overhead if schedule == "zb" else 1.0
    for a, b in zip(cuts.starts, ends):
        f = sum(costs.time_s[a:b]) / 3.0          # the op times are forward + backward (~1 : 2)
        fwd.append(f)
        bwd.append(2 * f * split)
        wgt.append(f * split)
    sc = StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), weight_grad_s=tuple(wgt),
                    p2p_s=tuple(p2p_time(b) for b in cuts.crossing_bytes),
                    activation_bytes=tuple(cuts.stage_saved_bytes))
    return simulate(make(schedule, devices, microbatches, virtual), sc)


def _unfit(name: str, v: int, m: int, p: int) -> tuple[str, str] | None:
    """Why schedule ``name`` cannot run ``v`` stages a device and ``m`` micro-batches on ``p``
    devices (and the fix), or None."""
    if name == "dualpipev" and (v != 2 or m < 2 * p):
        return ("DualPipeV needs two stages per device and at least as many micro-batches as stages",
                f"pass virtual_stages=2 and microbatches >= {2 * p}")
    if name == "interleaved" and (v < 2 or m % p):
        return ("the interleaved schedule needs virtual_stages >= 2 and micro-batches a multiple of the pipeline size",
                f"pass virtual_stages=2 and microbatches a multiple of {p}")
    return None


def plan_pipeline(costs_at: Callable[[int], OpCosts], *, devices: int, batch: int, cluster: Cluster,
                  axes: tuple[tuple[str, int], ...], schedule: str | None = None, microbatches: int | None = None,
                  virtual: int | None = None, budget: float | None = None) -> PipelinePlan:
    """Choose schedule, micro-batches and cuts. ``costs_at(micro_batch)`` prices the graph at a
    micro-batch size; the fastest simulated (schedule, micro-batch count, virtual stages) that
    fits ``budget`` wins (ties: fewer micro-batches)."""
    p = devices
    if schedule is not None and schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}", where="schedule", expected=", ".join(SCHEDULES),
                          fix=f"pick one of {', '.join(SCHEDULES)}")
    counts = [microbatches] if microbatches else [m for m in range(p, min(batch, 8 * p) + 1) if batch % m == 0]
    if not counts or any(batch % m for m in counts):
        raise ConfigError(f"the batch of {batch} does not split into micro-batches for {p} stages", where="pipeline",
                          expected=f"a batch divisible by a micro-batch count >= {p}", got=str(batch),
                          fix=f"use a batch that is a multiple of {p}, or pass microbatches=")
    names = [schedule] if schedule else list(AUTO_SCHEDULES)
    p2p = (lambda b: collective_time("send_recv", b, cluster, axes, "pp")) if p > 1 else (lambda b: 0.0)
    best: PipelinePlan | None = None
    for m in counts:
        costs = costs_at(batch // m)
        for name in names:
            vs = [virtual] if virtual else ([2] if name in ("interleaved", "dualpipev") else [1])
            for v in vs:
                unfit = _unfit(name, v, m, p)
                if unfit is not None:
                    if schedule:
                        raise ConfigError(unfit[0], where="pipeline", got=f"virtual_stages={v}, microbatches={m}, pp={p}",
                                          fix=unfit[1])
                    continue
                if name not in ("interleaved", "zb", "dualpipev") and v != 1:
                    continue
                stages = p * v
                try:
                    cuts = plan_cuts(costs, stages, p2p_time=p2p, inflight=inflight(name, stages, p, m),
                                     budget=budget)
                except ConfigError:
                    if schedule and microbatches:
                        raise
                    continue
                sim = simulate_plan(costs, cuts, schedule=name, devices=p, virtual=v, microbatches=m, p2p_time=p2p,
                                    zb_overhead=cluster.device.zb_split_overhead)
                cand = PipelinePlan(stages=stages, devices=p, virtual=v, schedule=name, microbatches=m, cuts=cuts,
                                    step_time_s=sim.step_time_s, bubble_fraction=sim.bubble_fraction,
                                    peak_activation_bytes=tuple(sim.peak_activation_bytes))
                if best is None or cand.step_time_s < best.step_time_s * (1 - 1e-9):
                    best = cand
    if best is None:
        raise DoesNotFitError(f"no pipeline of {p} stages fits", where="pipeline",
                              fix="use more devices, fewer virtual stages, or a smaller micro-batch")
    log.info("pipeline: %s, %d micro-batches, %d stages, predicted %.3g s (bubble %.2f)", best.schedule,
             best.microbatches, best.stages, best.step_time_s, best.bubble_fraction)
    return best


def split_view(gm: fx.GraphModule, mesh: Mapping[str, int], *, batch: int, sizes: Mapping[str, int] | None = None,
               hardware: str = "h100", schedule: str | None = None, microbatches: int | None = None,
               virtual: int | None = None, budget: float | None = None) -> tuple[PipelinePlan, OpCosts]:
    """Plan the pipeline for ``gm`` (the whole graph, rewritten for a tensor axis if any) on
    ``mesh`` and mark every op's stage in its record (``autopar dump --after split``).
    ``batch`` is the batch one pipeline replica runs per step (global batch / dp)."""
    axes = pipeline_axes(mesh)
    world = math.prod(n for _, n in axes)
    cluster = Cluster.from_spec(f"1x{world}", hardware=hardware)
    symbols = {str(k) for k in info_symbols(gm)}
    base = dict(sizes or {})

    def priced(mb: int) -> OpCosts:
        at = {**base, "batch": mb} if "batch" in symbols else dict(base)
        return op_costs(gm, node_time=node_time_fn(cluster.device, "fp32", at), sizes=at, tp=dict(axes).get("tp", 1))
    best = plan_pipeline(priced, devices=dict(axes)["pp"], batch=batch, cluster=cluster, axes=axes,
                         schedule=schedule, microbatches=microbatches, virtual=virtual, budget=budget)
    costs = priced(batch // best.microbatches)
    ends = list(best.cuts.starts[1:]) + [len(costs.ops)]
    for s, (a, b) in enumerate(zip(best.cuts.starts, ends)):
        for node in costs.ops[a:b]:
            info(node).stage = s
    return best, costs


def stage_table(best: PipelinePlan, costs: OpCosts) -> list[dict[str, Any]]:
    """One row per stage: where it starts, its ops, predicted time, memory and what it sends."""
    rows = []
    ends = list(best.cuts.starts[1:]) + [len(costs.ops)]
    for s, (a, b) in enumerate(zip(best.cuts.starts, ends)):
        rows.append({"stage": s, "device": s % best.devices, "first": costs.ops[a].name, "ops": b - a,
                     "time_s": best.cuts.stage_time_s[s], "state_bytes": best.cuts.stage_state_bytes[s],
                     "activation_bytes": best.cuts.stage_saved_bytes[s],
                     "sends_bytes": best.cuts.crossing_bytes[s] if s < len(best.cuts.crossing_bytes) else 0.0})
    return rows


def info_symbols(gm: fx.GraphModule):
    from autopar.core.meta import graph_info
    return graph_info(gm).symbols


__all__ = ["PipelinePlan", "plan_pipeline", "simulate_plan", "inflight",
           "node_time_fn", "SCHEDULES"]
