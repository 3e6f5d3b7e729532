"""Expert parallelism, planned: where experts live and what the exchange costs.

Placement (:func:`place_experts`): ``E`` experts onto ``n`` ranks, ``E/n`` each. With a
load per expert (tokens routed to it, measured on a calibration batch by
:func:`expert_loads`, or uniform) the heaviest expert goes to the least-loaded rank that
still has room, which keeps the most-loaded rank close to the mean. ``imbalance`` is the
most-loaded rank's load over the mean rank load (1.0 is perfect).

Cost (:func:`ep_costs`): per MoE layer and micro-batch, two all-to-alls forward (dispatch,
combine) and two backward, each moving the ``[E, C, h]`` buffer (a dropless layer: one row per
token and choice) less this rank's own share, priced by the links the ep axis spans; the
experts' compute on the most-loaded rank grows with the imbalance when tokens are not capped
(with a fixed capacity every rank computes ``E/n * n * C`` rows, and the imbalance shows up as
dropped tokens instead).

The build's experts step (``autopar/build/experts.py``, reached through :func:`autopar.parallelize`
with an ``ep`` axis and no pipeline) captures the model, rewrites each MoE region for the exchange
(:mod:`autopar.passes.ep_rewrite`: a fixed-capacity buffer exchange, or for dropless layers an
all-to-all with variable splits, each dropless layer first checked against its own graph on
random routing; a layer it cannot split runs dense with a one-line warning, and when none can
be split the ep axis is one more data axis), stores each rank's experts only, and returns a
:class:`~autopar.runtime.tp_module.ParallelModule` whose backward averages gradients over the
ranks that share them (the dense parts over ``dp x ep``, the experts over ``dp``) at the plan's
ZeRO stage, like any data axis.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.core.errors import ConfigError
from autopar.core.meta import MoERegion, evaluate, graph_info, info

log = logging.getLogger("autopar.cost.ep_planner")



@dataclass(frozen=True)
class Placement:
    """Experts in owner order: rank ``r`` owns ``perm[r*E/n:(r+1)*E/n]``."""

    perm: tuple[int, ...]
    ranks: int
    loads: tuple[float, ...]          # per expert

    def owned(self, rank: int) -> tuple[int, ...]:
        per = len(self.perm) // self.ranks
        return self.perm[rank * per:(rank + 1) * per]

    def rank_loads(self) -> list[float]:
        return [sum(self.loads[e] for e in self.owned(r)) for r in range(self.ranks)]

    @property
    def imbalance(self) -> float:
        loads = self.rank_loads()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0


def contiguous(experts: int, ranks: int, loads: Sequence[float] | None = None) -> Placement:
    """Rank r owns experts r*E/n .. (r+1)*E/n - 1."""
    _check_divisible(experts, ranks)
    return Placement(perm=tuple(range(experts)), ranks=ranks, loads=tuple(loads or [1.0] * experts))


def place_experts(experts: int, ranks: int, loads: Sequence[float] | None = None) -> Placement:
    """Balanced placement (module docstring). Uniform loads give the contiguous placement."""
    _check_divisible(experts, ranks)
    loads = tuple(float(x) for x in (loads or [1.0] * experts))
    if len(loads) != experts:
        raise ConfigError("one load per expert", expected=str(experts), got=str(len(loads)))
    if len(set(loads)) <= 1:
        return contiguous(experts, ranks, loads)
    per = experts // ranks
    bins: list[list[int]] = [[] for _ in range(ranks)]
    total = [0.0] * ranks
    for e in sorted(range(experts), key=lambda i: (-loads[i], i)):
        r = min((r for r in range(ranks) if len(bins[r]) < per), key=lambda r: (total[r], r))
        bins[r].append(e)
        total[r] += loads[e]
    placed = Placement(perm=tuple(e for b in bins for e in sorted(b)), ranks=ranks, loads=loads)
    naive = contiguous(experts, ranks, loads)
    return placed if placed.imbalance <= naive.imbalance else naive


def _check_divisible(experts: int, ranks: int) -> None:
    if ranks < 1 or experts % ranks:
        raise ConfigError(f"{experts} experts do not split evenly over an expert axis of {ranks}", where="mesh axis ep",
                          expected=f"an ep size dividing {experts}", got=str(ranks),
                          fix=f"use ep in {[d for d in range(1, experts + 1) if experts % d == 0]}")


def expert_loads(gm: fx.GraphModule, inputs: Sequence[Any], params: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """Tokens routed to each expert of each MoE region (region fqn -> counts), from running
    the captured graph on ``inputs`` (a calibration batch) and reading each router's top-k."""
    from autopar.passes.moe import routing_topk

    regions = {r.fqn: r for r in graph_info(gm).moe_regions}
    topks = {t: f for f, r in regions.items() if (t := routing_topk(gm, r)) is not None}
    counts: dict[str, list[float]] = {f: [0.0] * r.num_experts for f, r in regions.items()}

    class _Watch(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n in topks and topks[n] in counts:
                idx = out[1].reshape(-1)
                got = torch.bincount(idx, minlength=regions[topks[n]].num_experts)
                counts[topks[n]] = [a + float(b) for a, b in zip(counts[topks[n]], got.tolist())]
            return out
    call = []
    args = iter(inputs)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        call.append(params[info(n).target_fqn] if info(n).kind in ("param", "buffer") else next(args))
    with torch.no_grad():
        _Watch(gm).run(*call)
    return counts


@dataclass(frozen=True)
class EPCost:
    """Seconds per step of the expert exchange, and what the placement costs."""

    all_to_all_s: float               # forward + backward, all MoE layers
    per_call_s: float                 # one all-to-all of one layer's buffer
    buffer_bytes: float               # that buffer ([E, C, h]); (n-1)/n of it leaves the rank
    imbalance: float
    calls: int


def ep_costs(gm: fx.GraphModule, *, cluster: Cluster, axes: Sequence[tuple[str, int]], sizes: Mapping[str, int],
             placement_imbalance: float = 1.0) -> EPCost:
    """The exchange's predicted time (module docstring) at ``sizes``."""
    n = dict(axes).get("ep", 1)
    regions = graph_info(gm).moe_regions
    per_call, nbytes, calls = 0.0, 0.0, 0
    for r in regions:
        buf = _buffer_bytes(gm, r, sizes)
        t = collective_time("all_to_all", buf, cluster, tuple(axes), "ep") if n > 1 else 0.0
        per_call, nbytes = max(per_call, t), max(nbytes, buf)
        calls += 4                       # dispatch + combine, forward and backward
    total = per_call * calls
    return EPCost(all_to_all_s=total, per_call_s=per_call, buffer_bytes=nbytes, imbalance=placement_imbalance,
                  calls=calls)


def _buffer_bytes(gm: fx.GraphModule, region: MoERegion, sizes: Mapping[str, int]) -> float:
    """Bytes one exchange moves: the ``[E, C, h]`` buffer, or for a dropless layer one row
    of ``h`` per (token, choice) pair (``h``: the router weight's input dim)."""
    for n in gm.graph.nodes if region.capacity is not None else ():
        if info(n).moe_region == region.fqn and info(n).moe_role == "expert" and \
                n.target is torch.ops.aten.bmm.default:
            v = info(n.args[0]).values[0]
            return float(evaluate(v.nbytes, dict(sizes)))
    from autopar.passes.moe import routing_topk, topk_indices
    topk = routing_topk(gm, region)
    router = next((n for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn == region.router_weight),
                  None)
    if topk is None or router is None or not topk_indices(topk):
        return 0.0
    pairs = info(topk_indices(topk)[0]).values[0].numel
    w = info(router).values[0]
    return float(evaluate(pairs * w.shape[-1] * (w.nbytes / w.numel), dict(sizes)))


@dataclass(frozen=True)
class ExpertChoice:
    """How the experts are split on top of a dp x tp plan, and what that costs per step."""

    ep: int                           # expert-parallel degree (a sub-axis of dp)
    tp_inside: bool                   # experts also split over the tensor axis
    compute_s: float                  # the experts' forward + backward on one device
    all_to_all_s: float               # the ep exchanges (4 per layer: dispatch, combine, both ways)
    tp_comm_s: float                  # tp inside experts: the all-reduce of the expert output, both ways
    imbalance_s: float                # the most-loaded rank's extra expert work (dropless view)
    state_bytes: float                # expert parameters + gradients + optimizer state per device
    fits: bool = True
    reason: str = ""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.all_to_all_s + self.tp_comm_s + self.imbalance_s

    @property
    def mode(self) -> str:
        return {(True, True): "ep+tp", (True, False): "ep", (False, True): "tp"}.get(
            (self.ep > 1, self.tp_inside), "replicated")

    def as_dict(self) -> dict[str, Any]:
        return {"ep": self.ep, "mode": self.mode, "tp_inside_experts": self.tp_inside, "time_s": self.time_s,
                "compute_s": self.compute_s, "all_to_all_s": self.all_to_all_s, "tp_comm_s": self.tp_comm_s,
                "imbalance_s": self.imbalance_s, "state_bytes": self.state_bytes, "fits": self.fits,
                "reason": self.reason}


def plan_experts(gm: fx.GraphModule, *, cluster: Cluster, dp: int, tp: int, sizes: Mapping[str, int],
                 zero_stage: int = 0, budget: float | None = None,
                 imbalance: float = 1.0, dtype: str = "fp32") -> list[ExpertChoice]:
    """Every way the runtime can split the experts of a dp x tp plan: ep over a divisor of dp
    (and of the expert count) with the experts whole on the tensor axis or, for fixed-capacity
    layers, split over it too (expert tensor parallelism), or tp inside the experts without ep;
    fastest that fits first.

    Expert compute per device does not shrink with ep (a rank runs E/ep experts on the rows of
    ep ranks); it shrinks with tp inside the experts. ep costs all-to-alls and saves expert
    state (1/ep per device); tp inside costs an all-reduce of the expert output forward and
    backward. ``imbalance`` (from a calibration batch) charges the most-loaded rank's extra
    work. ``budget``: bytes per device the experts' state may take. The state is fp32 AdamW
    (16 bytes per parameter) sharded over the ``dp / ep`` replicas of each expert as
    ``zero_stage`` says."""
    from autopar.cost.compute import op_time

    regions = graph_info(gm).moe_regions
    if not regions:
        return []
    experts = math.gcd(*[r.num_experts for r in regions])
    at = dict(sizes)
    params = {info(n).target_fqn: n for n in gm.graph.nodes if n.op == "placeholder"}
    expert_numel = sum(float(evaluate(info(params[f]).values[0].numel, at))
                       for r in regions for f in r.expert_params if f in params)
    flops = bytes_ = 0.0
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.moe_role == "expert" and n.op == "call_function":
            flops += float(evaluate(rec.flops_fwd + rec.flops_bwd, at))
            bytes_ += float(evaluate(rec.bytes_fwd + rec.bytes_bwd, at))
    compute = op_time(flops, bytes_, cluster.device, dtype, launch_overhead=False)
    buf = max((_buffer_bytes(gm, r, at) for r in regions), default=0.0)
    out = []
    for ep in [d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0]:
        axes = (("dp", dp // ep), ("ep", ep), ("tp", tp))
        # ep together with tp inside the experts (expert tensor parallelism) runs for fixed-capacity
        # layers (passes/moe.expert_tensor_pin); a dropless layer's experts stay whole beside ep
        etp = all(r.capacity is not None for r in regions)
        for inside in ([False, True] if tp > 1 and (ep == 1 or etp) else [False]):
            a2a = 4 * len(regions) * collective_time("all_to_all", buf, cluster, axes, "ep") if ep > 1 else 0.0
            tpc = 2 * len(regions) * collective_time("all_reduce", buf, cluster, axes, "tp") if inside else 0.0
            share = ep * (tp if inside else 1)
            c = compute / (tp if inside else 1)
            r = dp // ep                 # replicas of each expert on the data axis
            per_param = {0: 16.0, 1: 8.0 + 8.0 / r, 2: 4.0 + 12.0 / r, 3: 16.0 / r}[zero_stage]
            state = expert_numel * per_param / share
            out.append(ExpertChoice(ep=ep, tp_inside=inside, compute_s=c, all_to_all_s=a2a, tp_comm_s=tpc,
                                    imbalance_s=c * (imbalance - 1.0) if ep > 1 else 0.0, state_bytes=state,
                                    fits=budget is None or state <= budget))
    out.sort(key=lambda c: (not c.fits, c.time_s, -c.ep))
    best = out[0]
    ranked = [best]
    for c in out[1:]:
        if not c.fits:
            why = f"expert state {c.state_bytes / 1e9:.2f} GB over the {budget / 1e9:.2f} GB left for experts"
        elif c.time_s > best.time_s:
            parts = {"all-to-all": c.all_to_all_s - best.all_to_all_s, "tp all-reduce": c.tp_comm_s - best.tp_comm_s,
                     "compute": c.compute_s - best.compute_s, "imbalance": c.imbalance_s - best.imbalance_s}
            worst = max(parts, key=lambda k: parts[k])
            why = f"slower by {(c.time_s - best.time_s) * 1e3:.2f} ms ({worst} +{parts[worst] * 1e3:.2f} ms)"
        else:
            why = "as fast; holds more expert state per device" if c.state_bytes > best.state_bytes else "tie"
        ranked.append(ExpertChoice(**{**c.__dict__, "reason": why}))
    return ranked


# ------------------------------------------------------------------------------ runtime

__all__ = ["Placement", "contiguous", "place_experts", "expert_loads", "EPCost", "ep_costs",
           "ExpertChoice", "plan_experts"]
