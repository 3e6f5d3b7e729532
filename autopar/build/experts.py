"""The expert axis's two steps. The capacity step sets an MoE capacity override on the modules
(before the tensor step captures them); the experts step finds which mixture-of-experts layers
can be split (:func:`checked_moe_plans`), places their experts (the plan's placement, a
calibration batch's balanced one, or in order; always in order inside a pipeline), rewrites
each for the exchange and keeps this rank's experts' rows (:func:`exchange_experts`).

Without a pipeline the experts step also completes the plan (the pipeline step does it with one).
Where no layer can be split the step does not apply: the ``ep`` axis is then one more data axis
for every parameter (the data step averages over dp x ep), and says so. Both steps do nothing
without an expert axis.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.build.checks import check_runtime_dtypes
from autopar.build.prepare import capture_model
from autopar.build.state import BuildState
from autopar.core.errors import ConfigError, PlanFileError
from autopar.core.meta import MoERegion, graph_info, info
from autopar.core.options import DISPATCH_CHUNKS
from autopar.core.plans import Plan
from autopar.cost.ep_planner import Placement, contiguous, expert_loads, place_experts
from autopar.runtime.agreement import collective_device

log = logging.getLogger("autopar.build")


def capacity_step(s: BuildState) -> None:
    """``capacity_factor`` (given, or the plan's) set on each MoE layer the graph shows (the
    model is captured once for that, then again by the tensor step)."""
    r = s.request
    if r.pipelined or not r.expert_axis or s.capacity_factor is None:
        return
    set_capacity(r.model, capture_model(r.model, r.args, (), r.kwargs), s.capacity_factor)


def experts_step(s: BuildState) -> None:
    """Split every MoE layer that can be split over the ``ep`` axis and keep this rank's experts."""
    r = s.request
    if r.pipelined and s.ep == 1 or not r.pipelined and not r.expert_axis:
        return
    n_ep = s.ep
    group, rank = s.group("ep")
    plans = checked_moe_plans(s.gm, s.tensors)
    regions = [p.region for p in plans if p.kind != "dense"]
    fold = folded_tensor_axis(s, plans)
    if fold > 1:           # the experts dealt over ep x tp, each tensor rank computing its share of the tokens
        from autopar.build.data import axes_group
        group, _, rank = axes_group(s.mesh, s.names, ["ep", "tp"])
    n = n_ep * fold
    if r.pipelined:        # inside a pipeline the experts are placed in order
        placed = {q.fqn: contiguous(q.num_experts, n) for q in regions}
    elif r.plan is not None:
        placed = planned_placements(r.plan, regions, n)
    else:
        how = r.options.experts
        loads = calibrated_loads(r.model, how.calibration, s.tensors) \
            if how.calibration is not None and how.placement == "balanced" and regions else {}
        placed = {q.fqn: place_experts(q.num_experts, n, loads.get(q.fqn)) if how.placement == "balanced" else
                  contiguous(q.num_experts, n, loads.get(q.fqn)) for q in regions}
    if not regions and not r.pipelined:
        log.warning("no MoE layer's experts can be split: the ep axis runs as data parallelism (mesh %s)",
                    {"dp": s.sizes.get("dp", 1) * n_ep, **({"tp": s.tp} if s.tp > 1 else {})})
    hops = two_hop_groups(s, r.options.experts.dispatch) \
        if fold == 1 and any(p.kind == "dropless" for p in plans) else None
    tensor_axis = (fold, *s.group("tp")) if fold > 1 else None
    s.expert_runtimes, s.experts = exchange_experts(s.gm, s.tensors, plans, {f: p.perm for f, p in placed.items()},
                                                    group=group, n=n, rank=rank,
                                                    chunks=r.options.experts.dispatch_chunks, hops=hops,
                                                    fold=tensor_axis)
    s.expert_placements = placed
    if s.schedule == "dualpipev":       # overlapped pairs: a paired forward's exchanges on second groups
        second_lanes(s, group, n_ep, hops)
    if not r.pipelined:
        s.plan = _expert_plan(s, placed)
        check_runtime_dtypes(r.model, s.gm, s.plan)


def second_lanes(s: BuildState, group: Any, n_ep: int, hops: tuple[int, Any, Any] | None) -> None:
    """The second group of each process group the expert exchange uses, for the forward half of
    DualPipeV's overlapped pairs (:mod:`autopar.runtime.pp_overlap`). Every rank creates every
    group, in one order."""
    from autopar.build.data import hybrid_groups
    from autopar.runtime.pp_overlap import pair_lanes
    pairs = [(group, hybrid_groups(s.mesh, s.names, ["ep"], n_ep)[0])]
    if hops is not None and hops[0]:
        pairs += list(zip(hops[1:], hybrid_groups(s.mesh, s.names, ["ep"], hops[0])))
    pair_lanes(pairs)


def _expert_plan(s: BuildState, placed: Mapping[str, Placement]) -> Plan:
    """The plan of an expert-parallel build without a pipeline: the tensor axis's placements, the
    experts' owners, and (found, not re-applied) each layer's load imbalance."""
    r = s.request
    shapes = {k: list(p.shape) for k, p in r.model.named_parameters()}   # what Plan.check_model compares
    # a re-applied plan keeps its predictions (the loads behind its imbalance are not in the plan)
    predicted = dict(r.plan.predicted) if r.plan is not None else \
        {"imbalance": {f: p.imbalance for f, p in placed.items()}}
    zero = s.zero_stage or 0
    return Plan(mesh=s.sizes, tp_axis="tp" if s.tp > 1 else None, params=s.placements, nodes=s.nodes,
                model=type(r.model).__name__, ep_axis="ep", capacity_factor=s.capacity_factor,
                dp_axis="dp" if "dp" in s.sizes else None,
                zero_stage=zero if s.sizes.get("dp", 1) * s.sizes.get("cp", 1) * s.ep > 1 else 0,
                expert_placement={f: list(p.perm) for f, p in placed.items()}, mixed_precision=s.mixed_precision,
                predicted=predicted, shapes=shapes, fingerprint=Plan.fingerprint_of(shapes))


def two_hop_groups(s: BuildState, dispatch: str) -> tuple[int, Any, Any] | None:
    """``(ep ranks per node, this rank's node group, its rail group)`` for a two-hop dropless
    exchange (:class:`autopar.runtime.ep.DroplessMoE`), or None for one hop: ``dispatch="auto"``
    takes two hops when each expert group is cut into blocks of consecutive ranks, one block
    per node, of more than one rank and more than one block. Every rank decides alike (the
    nodes are agreed) and creates every group in one order."""
    from autopar.build.data import hybrid_groups
    from autopar.runtime.nodes import node_of_ranks

    if dispatch == "direct":
        return None
    d = s.names.index("ep")
    n = s.mesh.size(d)
    g = node_blocks(s.mesh.mesh.movedim(d, -1).reshape(-1, n).tolist(), node_of_ranks())
    if not 1 < g < n:
        if dispatch == "two_hop":
            raise ConfigError("dispatch='two_hop' needs an expert axis over several nodes with several of its "
                              "ranks on each, in blocks of consecutive ranks", where="ExpertOptions.dispatch",
                              got=f"ep={n}, {g or 'uneven'} ep ranks per node",
                              fix="use dispatch='auto' or 'direct', or order the mesh so ep runs inside and across nodes")
        return None
    intra, rail = hybrid_groups(s.mesh, s.names, ["ep"], g)
    return g, intra, rail


def node_blocks(rows: Sequence[Sequence[int]], nodes: Sequence[int]) -> int:
    """The ranks per node of every row of ranks (each row cut into runs of one node each, every
    run the same length and no node in two runs of a row); 0 when they are not so."""
    sizes = set()
    for row in rows:
        runs: list[list[int]] = []
        for r in row:
            if runs and nodes[runs[-1][-1]] == nodes[r]:
                runs[-1].append(r)
            else:
                runs.append([r])
        if len({nodes[run[0]] for run in runs}) != len(runs):
            return 0
        sizes |= {len(run) for run in runs}
    return sizes.pop() if len(sizes) == 1 else 0


def folded_tensor_axis(s: BuildState, plans: list) -> int:
    """How many tensor ranks the experts' axis folds in (``ExpertOptions.fold``): the tensor
    axis's size when it is there and every split layer is dropless with experts that ep x tp
    divides, else 1. ``dispatch="two_hop"`` asked for beside a folded axis is refused."""
    how = s.request.options.experts
    split = [p for p in plans if p.kind != "dense"]
    if s.tp == 1 or how.fold == "off" or not split or any(p.kind != "dropless" for p in split) \
            or any(p.region.num_experts % (s.ep * s.tp) for p in split):
        return 1
    if how.dispatch == "two_hop":
        raise ConfigError("the two-hop exchange runs over the ep axis alone; with a tensor axis beside it the "
                          "experts are folded over ep x tp", where="ExpertOptions(dispatch='two_hop')",
                          got=f"ep={s.ep}, tp={s.tp}",
                          fix="use dispatch='auto', or ExpertOptions(fold='off') to keep the ep axis alone")
    return s.tp


def exchange_experts(gm: fx.GraphModule, tensors: dict[str, torch.Tensor], plans: list, perms: Mapping[str, Any], *,
                     group: Any, n: int, rank: int, chunks: int = DISPATCH_CHUNKS,
                     hops: tuple[int, Any, Any] | None = None,
                     fold: tuple[int, Any, int] | None = None) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """Rewrite the MoE layers ``plans`` split for the expert exchange over ``group`` (experts in
    the owner order ``perms[layer]``), keep this rank's experts' rows in ``tensors``, and
    return the exchange runtimes by layer and, per expert parameter, how it is stored
    (``rows`` of a stacked tensor, or ``whole`` owned modules) with the experts this rank owns.
    ``chunks``: how many token chunks a dropless layer's exchanges overlap in, ``hops``: the
    two-hop exchange's groups (:func:`two_hop_groups`; :class:`autopar.runtime.ep.DroplessMoE`),
    ``fold``: (tensor ranks folded in, the tensor axis's group, this rank's place on it)."""
    from autopar.passes.ep_rewrite import ep_rewrite
    from autopar.runtime.ep import EPRuntime

    g, intra, rail = hops or (0, None, None)
    t, t_group, t_rank = fold or (1, None, 0)
    rts = {f: EPRuntime(n=n, rank=rank, group=group, perm=tuple(perm), chunks=chunks, node_ranks=g, intra=intra,
                        rail=rail, fold=t, fold_group=t_group, fold_rank=t_rank) for f, perm in perms.items()}
    stored = ep_rewrite(gm, plans, rts)
    region_of = {f: q.region.fqn for q in plans if q.kind != "dense" for f in q.region.expert_params}
    for fqn, how in stored.items():
        if how == "rows":
            owned = torch.tensor(rts[region_of[fqn]].owned(), device=tensors[fqn].device)
            tensors[fqn] = tensors[fqn].detach().index_select(0, owned).clone()
    return rts, {fqn: (how, tuple(rts[region_of[fqn]].owned())) for fqn, how in stored.items()}


def checked_moe_plans(gm: fx.GraphModule, tensors: Mapping[str, torch.Tensor]) -> list:
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


def planned_placements(plan: Any, regions: Sequence[MoERegion], n_ep: int) -> dict[str, Placement]:
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


def calibrated_loads(model: nn.Module, calibration: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """Tokens per expert of each region on the calibration batch, summed over every rank's
    batch so that every rank places the experts alike."""

    cal = tuple(calibration) if isinstance(calibration, (tuple, list)) else (calibration,)
    loads = expert_loads(capture_model(model, cal, ()), cal, tensors)
    for f in sorted(loads):
        t = torch.tensor(loads[f], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t)
        loads[f] = t.tolist()
    return loads


def set_capacity(model: nn.Module, gm: fx.GraphModule, factor: float) -> None:
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


__all__ = ["capacity_step", "experts_step", "exchange_experts", "checked_moe_plans", "planned_placements",
           "calibrated_loads", "set_capacity"]
