"""Expert parallelism: where experts live, what the exchange costs, and this rank's model.

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

:func:`parallelize_experts` (reached through :func:`autopar.parallelize` with an ``ep``
axis) captures the model, rewrites each MoE region for the exchange
(:mod:`autopar.passes.ep_rewrite`: a fixed-capacity buffer exchange, or for dropless layers an
all-to-all with variable splits, each dropless layer first checked against its own graph on
random routing; a layer it cannot split runs dense with a one-line warning, and when none can
be split the ep axis is one more data axis), stores each rank's experts only, and returns a
:class:`~autopar.runtime.tp_module.ParallelModule`; :func:`autopar.optimizer` then averages
gradients over the ranks that share them (the dense parts over ``dp x ep``, the experts over
``dp``) before stepping.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.errors import ConfigError, MeshError, PlanFileError
from autopar.passes.meta import MoERegion, evaluate, graph_info, info

log = logging.getLogger("autopar.ep")

AXES = ("dp", "ep", "tp")


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
    (and of the expert count) with the experts whole on the tensor axis, or tp inside the
    experts without ep; fastest that fits first.

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
        # ep together with tp inside the experts is priced by nothing here: the runtime keeps
        # experts whole on the tensor axis when there is an expert axis, so only what runs is offered
        for inside in ([False, True] if tp > 1 and ep == 1 else [False]):
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

def ep_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    from autopar.pp import named_axes
    axes = named_axes(mesh, "e.g. {'ep': 2} or {'dp': 2, 'ep': 2}")
    names = [a for a, _ in axes]
    if names != [a for a in AXES if a in names] or "ep" not in names or any(s < 1 for _, s in axes):
        raise MeshError("expert-parallel mesh axes must be dp, ep, tp in that order (ep required)", where="mesh",
                        expected="e.g. {'ep': 2}, {'dp': 2, 'ep': 2}, {'ep': 2, 'tp': 2}", got=str(dict(axes)),
                        fix="list the axes in the order dp, ep, tp (pp is not supported with ep)")
    return axes


def parallelize_experts(model: nn.Module, mesh: Any, example_inputs: Any, *, hardware: str | None = None,
                        memory_budget: float | None = None, sync_params: bool = True,
                        calibration: Any = None, placement: str = "balanced", dims: Any = None,
                        capacity_factor: float | None = None, example_kwargs: Any = None, plan: Any = None):
    """This rank's model with experts spread over the ``ep`` axis (see :func:`autopar.parallelize`).
    ``capacity_factor`` overrides the MoE layers' own (set on the module of each region the
    graph shows, which must have a ``capacity_factor`` attribute; the model is then captured
    again), so tokens drop exactly as the single-device model's at that factor.

    ``plan`` (a :class:`~autopar.plans.Plan` this function returned before, e.g. saved and
    loaded) is applied as it is: its mesh (which ``mesh`` must equal), its experts' owners
    (``expert_placement``; ``calibration`` and ``placement`` are not used, so no calibration
    batch is run), its capacity factor and its tensor-axis placements. A plan that does not
    fit the model or the mesh raises a :class:`~autopar.errors.PlanFileError` or
    :class:`~autopar.errors.MeshError` on every rank at the same point: before any collective
    where the plan and the model's modules show it (mesh, a placement that is not a
    permutation, a layer the model does not have), otherwise right after the capture (split
    MoE layers, or their expert counts, that differ from the plan's)."""

    from autopar.api import _capture, device_mesh, model_tensors, planned_graph
    from autopar.passes.ep_rewrite import ep_rewrite
    from autopar.plans import Plan
    from autopar.runtime.ep import EPRuntime
    from autopar.runtime.tp_module import ParallelModule

    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")
    axes = _checked_plan_axes(plan, mesh, model) if plan is not None else ep_axes(mesh)
    if plan is not None:
        if capacity_factor is not None and capacity_factor != plan.capacity_factor:
            raise ConfigError("capacity_factor= differs from the plan's", where="parallelize(plan=...)",
                              expected=repr(plan.capacity_factor), got=repr(capacity_factor),
                              fix="drop capacity_factor= (the plan's is used), or re-plan with the new factor")
        capacity_factor = plan.capacity_factor
    sizes = dict(axes)
    mesh = device_mesh(mesh, axes)
    names = list(mesh.mesh_dim_names)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    tensors = model_tensors(model, sync=sync_params)
    if capacity_factor is not None:
        _set_capacity(model, _capture(model, args, (), kwargs), capacity_factor)
    n_ep = sizes["ep"]
    ep_rank = mesh.get_local_rank(names.index("ep"))
    tp_n = sizes.get("tp", 1)
    if tp_n > 1:
        tp_group = mesh.get_group(names.index("tp"))
        # the experts stay whole on the tensor axis: the expert axis owns their leading dim
        given = None if plan is None else replace(plan, mesh={"tp": tp_n}, dp_axis=None, ep_axis=None,
                                                  expert_placement={}, capacity_factor=None)
        gm, tp_plan = planned_graph(model, {"tp": tp_n}, args, example_kwargs=kwargs, dims=dims, after="rewrite",
                                    hardware=hardware,
                                    group_name=tp_group.group_name, memory_budget=memory_budget,
                                    pinned=_in_experts, plan=given)
        placements, nodes = dict(tp_plan.params), dict(tp_plan.nodes)
    else:
        gm = _capture(model, args, dims, kwargs)
        placements, nodes = {k: "R" for k in tensors}, {}
    plans = _checked_plans(gm, tensors)
    regions = [p.region for p in plans if p.kind != "dense"]
    planned = _planned_placements(plan, regions, n_ep) if plan is not None else None
    if not regions:   # nothing to split: the expert axis is one more data axis
        from autopar.api import parallelize
        dense = {"dp": sizes.get("dp", 1) * n_ep, **({"tp": tp_n} if tp_n > 1 else {})}
        log.warning("no MoE layer's experts can be split: the ep axis runs as data parallelism (mesh %s)", dense)
        return parallelize(model, dense, args, example_kwargs=kwargs, dims=dims, hardware=hardware,
                           memory_budget=memory_budget, sync_params=False)
    if planned is not None:
        placed = planned
    else:
        loads = _calibrated_loads(model, calibration, tensors) \
            if calibration is not None and placement == "balanced" else {}
        placed = {r.fqn: place_experts(r.num_experts, n_ep, loads.get(r.fqn)) if placement == "balanced" else
                  contiguous(r.num_experts, n_ep, loads.get(r.fqn)) for r in regions}
    group = mesh.get_group(names.index("ep"))
    rts = {f: EPRuntime(n=n_ep, rank=ep_rank, group=group, perm=pl.perm) for f, pl in placed.items()}
    stored = ep_rewrite(gm, plans, rts)
    region_of = {p: r.fqn for r in regions for p in r.expert_params}
    for fqn, how in stored.items():
        if how == "rows":
            owned = torch.tensor(rts[region_of[fqn]].owned())
            tensors[fqn] = tensors[fqn].detach().index_select(0, owned).clone()
    trainable = {k: p.requires_grad for k, p in model.named_parameters()}
    used = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn}
    shapes = {k: list(p.shape) for k, p in model.named_parameters()}   # what Plan.check_model compares
    # a re-applied plan keeps its predictions (the loads behind its imbalance are not in the plan)
    predicted = dict(plan.predicted) if plan is not None else \
        {"imbalance": {f: p.imbalance for f, p in placed.items()}}
    the_plan = Plan(mesh=sizes, tp_axis="tp" if tp_n > 1 else None, params=placements, nodes=nodes,
                    model=type(model).__name__, ep_axis="ep", capacity_factor=capacity_factor,
                    expert_placement={f: list(p.perm) for f, p in placed.items()},
                    predicted=predicted, shapes=shapes, fingerprint=Plan.fingerprint_of(shapes))
    from autopar.api import input_dims
    pm = ParallelModule(gm, placements, {k: v for k, v in tensors.items() if k in used}, trainable, mesh,
                        the_plan, input_dims(model, args, dims, kwargs))
    pm.expert_params = set(stored)
    pm.expert_storage = stored        # fqn -> "rows" (owned rows of stacked experts) | "whole" (an owned module's)
    pm.ep_runtimes = rts
    pm.placements = placed
    pm.ep_group = group
    pm.ep_dp_group = mesh.get_group(names.index("dp")) if "dp" in names else None
    return pm


def _checked_plan_axes(plan: Any, mesh: Any, model: nn.Module) -> tuple[tuple[str, int], ...]:
    """The mesh axes of a saved expert-parallel ``plan``, after checking that ``mesh`` names
    the same axes and sizes, that each placement in the plan is a permutation splitting
    evenly over the expert axis and that each layer it places is a module of ``model``: all
    of it without running anything, so every rank refuses a bad plan before any collective
    (:func:`_planned_placements` checks the layers against the captured graph later)."""
    from autopar.pp import named_axes

    got = dict(named_axes(mesh, "e.g. {'dp': 2, 'ep': 2}"))
    if got != plan.mesh:
        raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)", expected=str(plan.mesh),
                        got=str(got), fix="pass the mesh the plan was made for, or re-plan for this mesh")
    if plan.ep_axis != "ep":
        raise PlanFileError("the plan has no expert axis", where="parallelize(plan=...)",
                            expected="a plan from parallelize on a mesh with an ep axis",
                            got=f"ep_axis={plan.ep_axis!r}",
                            fix="pass the plan of an expert-parallel run (pm.plan), or leave plan out")
    axes = ep_axes(mesh)
    n_ep = dict(axes)["ep"]
    for fqn, perm in plan.expert_placement.items():
        ids = isinstance(perm, (list, tuple)) and all(isinstance(e, int) and not isinstance(e, bool) for e in perm)
        if not ids or sorted(perm) != list(range(len(perm))) or len(perm) % n_ep:
            raise PlanFileError(f"the plan's placement of the experts of {fqn or '<root>'} is not a permutation "
                                f"of its experts splitting evenly over ep={n_ep}",
                                where=f"plan.expert_placement[{fqn!r}]",
                                expected=f"each expert id 0..E-1 exactly once, E a multiple of {n_ep}",
                                got=str(perm), fix="pass a plan written by Plan.save, or re-plan")
        try:
            model.get_submodule(fqn)
        except AttributeError:
            raise PlanFileError("the plan's mixture-of-experts layers are not this model's",
                                where=f"plan.expert_placement[{fqn!r}]", expected=f"a module of {type(model).__name__}",
                                got=f"no module {fqn!r}",
                                fix="re-plan for this model: parallelize without plan=, then save pm.plan") from None
    return axes


def _planned_placements(plan: Any, regions: Sequence[MoERegion], n_ep: int) -> dict[str, Placement]:
    """The plan's placement of each MoE layer whose experts are split, after checking that
    those layers (and their expert counts) are the plan's. Loads are not in a plan: uniform."""
    want = {r.fqn: r.num_experts for r in regions}
    have = {f: len(p) for f, p in plan.expert_placement.items()}
    if want != have:
        raise PlanFileError("the plan's mixture-of-experts layers are not this model's", where="plan.expert_placement",
                            expected=f"experts per split layer {want}", got=f"the plan places {have}",
                            fix="re-plan for this model: parallelize without plan=, then save pm.plan")
    return {f: Placement(perm=tuple(int(e) for e in plan.expert_placement[f]), ranks=n_ep, loads=(1.0,) * n)
            for f, n in want.items()}


def _calibrated_loads(model: nn.Module, calibration: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """Tokens per expert of each region on the calibration batch, summed over every rank's
    batch so that every rank places the experts alike."""
    from autopar.api import _capture

    cal = tuple(calibration) if isinstance(calibration, (tuple, list)) else (calibration,)
    loads = expert_loads(_capture(model, cal, ()), cal, tensors)
    for f in sorted(loads):
        t = torch.tensor(loads[f], dtype=torch.float64)
        dist.all_reduce(t)
        loads[f] = t.tolist()
    return loads


def _checked_plans(gm: fx.GraphModule, tensors: Mapping[str, torch.Tensor]) -> list:
    """How each MoE region is split (:func:`autopar.passes.ep_rewrite.plan_regions`), each
    dropless one first checked against its own graph on random routing; a region that is
    not split runs dense, with a one-line warning saying why."""
    from autopar.passes.ep_dropless import Unsupported, check_dropless
    from autopar.passes.ep_rewrite import plan_regions

    plans = plan_regions(gm)
    for p in plans:
        if p.kind == "dropless":
            tol = _tolerance(info(p.layer.x).values[0].dtype)
            try:
                err = check_dropless(gm, p.layer, tensors)
            except (Unsupported, RuntimeError, IndexError, KeyError, TypeError, ValueError) as exc:
                p.kind, p.reason = "dense", f"its experts could not be run alone ({type(exc).__name__}: {exc})"
                continue
            if not err <= tol:
                p.kind, p.reason = "dense", (f"its graph does not compute sum_j w[t,j] * expert_ids[t,j](x[t]) "
                                             f"(relative error {err:.1e} on random routing)")
        if p.kind == "dense":
            log.warning("MoE layer %s runs dense on every ep rank (its experts are not split): %s",
                        p.region.fqn or "<root>", p.reason)
    return plans


def _tolerance(dtype: torch.dtype) -> float:
    """How far a dropless layer may differ from its own graph on random routing (rounding
    only: a misread layer is off by O(1))."""
    return min(0.1, 100 * torch.finfo(dtype).eps ** 0.5) if dtype.is_floating_point else 0.1


def _set_capacity(model: nn.Module, gm: fx.GraphModule, factor: float) -> None:
    if not factor > 0:
        raise ConfigError("capacity_factor must be positive", where="capacity_factor", got=repr(factor),
                          fix="e.g. capacity_factor=1.25 (1.0: each expert takes its fair share of rows)")
    regions = graph_info(gm).moe_regions
    if not regions:
        raise ConfigError("capacity_factor was given but the model has no mixture-of-experts layer",
                          where="capacity_factor", fix="drop capacity_factor")
    for r in regions:
        mod = model.get_submodule(r.fqn) if r.fqn else model
        if not hasattr(mod, "capacity_factor"):
            raise ConfigError(f"the MoE layer {r.fqn or '<root>'} has no capacity_factor attribute to set",
                              where=r.fqn or "<root>", expected="a module attribute capacity_factor",
                              got=type(mod).__name__, fix="set the capacity in the model itself")
        mod.capacity_factor = float(factor)


def _in_experts(node: fx.Node) -> bool:
    """Expert-side nodes of an MoE region (dispatch, experts, combine) and the expert weights."""
    rec = info(node)
    if rec.moe_role in ("dispatch", "expert", "combine"):
        return True
    return rec.kind == "param" and any(rec.target_fqn in r.expert_params
                                       for r in graph_info(node.graph.owning_module).moe_regions)


class EPOptimizer:
    """Averages gradients over the ranks that share them, then steps ``optimizer_cls``: the
    dense parameters over ``dp x ep`` (each rank saw its own tokens), the experts over
    ``dp`` (their owner already got every rank's tokens' gradients through the exchange)."""

    def __init__(self, module: nn.Module, optimizer_cls: type, params: Any = None, **kwargs: Any) -> None:
        self.module = module
        self.optimizer = optimizer_cls(params if params is not None else module.parameters(), **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _reduce(self) -> None:
        m = self.module
        n_ep = dist.get_world_size(m.ep_group)
        n_dp = dist.get_world_size(m.ep_dp_group) if m.ep_dp_group is not None else 1
        dense, expert = [], []
        for fqn, p in m.named_parameters():
            if p.grad is not None:
                (expert if fqn in m.expert_params else dense).append(p.grad)
        for grads, groups in ((dense, [m.ep_group, m.ep_dp_group]), (expert, [m.ep_dp_group])):
            if not grads:
                continue
            if not any(g is not None and dist.get_world_size(g) > 1 for g in groups):
                for g in grads:               # nothing to sum: scale in place
                    g.div_(n_ep * n_dp)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            for g in groups:
                if g is not None and dist.get_world_size(g) > 1:
                    dist.all_reduce(flat, group=g)
            flat.div_(n_ep * n_dp)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()

    def step(self, closure: Any = None) -> Any:
        self._reduce()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


__all__ = ["Placement", "contiguous", "place_experts", "expert_loads", "EPCost", "ep_costs", "ep_axes",
           "ExpertChoice", "plan_experts",
           "parallelize_experts", "EPOptimizer"]
