"""Pipeline parallelism: plan the stages and schedule, and build this rank's pipeline.

:func:`plan_pipeline` prices the captured graph op by op (the cost model), chooses the
schedule and micro-batch count with the schedule simulator (:mod:`autopar.cost.pp_sim`)
when they are not given, and cuts the graph into ``p * v`` stages with
:func:`autopar.passes.pp_split.plan_cuts`. :func:`parallelize_pipeline` (reached through
:func:`autopar.parallelize` with a ``pp`` axis in the mesh) applies it: a tensor axis is
solved and rewritten on the whole graph first, the rewritten graph is split, and this
rank's stages run under a ``torch.distributed.pipelining`` schedule
(:class:`autopar.runtime.pp.PipelineModule`).
"""
from __future__ import annotations

import functools

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.compute import op_time
from autopar.errors import ConfigError, DoesNotFitError, MeshError
from autopar.passes.meta import evaluate, info
from autopar.passes.pp_split import CutPlan, OpCosts, op_costs, plan_cuts

log = logging.getLogger("autopar.pp")

AXES = ("pp", "dp", "ep", "tp")      # the order a pipeline mesh lists them in (pp outermost)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
# torch's zero-bubble schedules run autograd twice per micro-batch (input gradients, then
# weight gradients from the saved graph); on this project's 2-core CPU that backward costs
# ~35 % more than one whole backward (bench/pp.py: 135 ms vs 101 ms per 1F1B-sized step).
ZB_SPLIT_OVERHEAD = 0.35


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


def named_axes(mesh: Any, example: str) -> tuple[tuple[str, int], ...]:
    """``[(axis, size)]`` of a ``{axis: size}`` mapping or a DeviceMesh with named axes."""
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "size"):
        return tuple((n, mesh.size(i)) for i, n in enumerate(mesh.mesh_dim_names or ()))
    if isinstance(mesh, Mapping):
        return tuple((str(k), int(v)) for k, v in mesh.items())
    raise MeshError("the mesh must be a {axis: size} mapping or a DeviceMesh with named axes", where="mesh",
                    got=type(mesh).__name__, fix=example)


def pipeline_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    """``[(axis, size)]`` of a pipeline mesh: ``pp`` first, then ``dp`` and/or ``tp``."""
    axes = named_axes(mesh, "e.g. {'pp': 2, 'tp': 2}")
    names = [a for a, _ in axes]
    order = [a for a in AXES if a in names]
    if names != order or len(set(names)) != len(names) or any(n < 1 for _, n in axes):
        raise MeshError("pipeline mesh axes must be pp, then dp, ep and/or tp, each of size >= 1", where="mesh",
                        expected="e.g. {'pp': 2}, {'pp': 2, 'dp': 2}, {'pp': 2, 'ep': 2} or {'pp': 2, 'tp': 2}",
                        got=str(dict(axes)), fix="list the axes in the order pp, dp, ep, tp")
    return axes


def node_time_fn(device, dtype: str, sizes: Mapping[str, int] | None = None) -> Callable[[fx.Node], float]:
    """Forward + backward seconds of one op at ``sizes`` (collectives the tensor-axis rewrite
    inserted count their predicted time)."""
    at = dict(sizes or {})

    def time(node: fx.Node) -> float:
        rec = info(node)
        if rec.collective is not None:
            return rec.collective.time_fwd_s + rec.collective.time_bwd_s
        t = op_time(float(evaluate(rec.flops_fwd, at)), float(evaluate(rec.bytes_fwd, at)), device, dtype)
        if rec.requires_grad:
            t += op_time(float(evaluate(rec.flops_bwd, at)), float(evaluate(rec.bytes_bwd, at)), device, dtype)
        return t
    return time


def inflight(schedule: str, stages: int, devices: int, microbatches: int) -> list[int]:
    """Micro-batches whose activations each stage holds at once (the schedule's peak)."""
    if schedule == "gpipe":
        return [microbatches] * stages
    return [min(microbatches, max(1, devices - (s % devices)) * (1 if stages == devices else 2))
            for s in range(stages)]


def simulate_plan(costs: OpCosts, cuts: CutPlan, *, schedule: str, devices: int, virtual: int,
                  microbatches: int, p2p_time: Callable[[float], float]):
    """The simulator's result for these cuts under ``schedule``."""
    from autopar.cost.pp_sim import StageCosts, make, simulate

    k = len(costs.ops)
    ends = list(cuts.starts[1:]) + [k]
    fwd, bwd, wgt = [], [], []
    split = 1.0 + ZB_SPLIT_OVERHEAD if schedule == "zb" else 1.0
    for a, b in zip(cuts.starts, ends):
        f = sum(costs.time_s[a:b]) / 3.0          # the op times are forward + backward (~1 : 2)
        fwd.append(f)
        bwd.append(2 * f * split)
        wgt.append(f * split)
    sc = StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), weight_grad_s=tuple(wgt),
                    p2p_s=tuple(p2p_time(b) for b in cuts.crossing_bytes),
                    activation_bytes=tuple(cuts.stage_saved_bytes))
    return simulate(make(schedule, devices, microbatches, virtual), sc)


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
    names = [schedule] if schedule else list(SCHEDULES)
    p2p = (lambda b: collective_time("send_recv", b, cluster, axes, "pp")) if p > 1 else (lambda b: 0.0)
    best: PipelinePlan | None = None
    for m in counts:
        costs = costs_at(batch // m)
        for name in names:
            vs = [virtual] if virtual else ([2] if name == "interleaved" else [1])
            for v in vs:
                if name == "interleaved" and (v < 2 or m % p):
                    if schedule:
                        raise ConfigError("the interleaved schedule needs virtual_stages >= 2 and micro-batches "
                                          "a multiple of the pipeline size", where="pipeline",
                                          got=f"virtual_stages={v}, microbatches={m}, pp={p}",
                                          fix=f"pass virtual_stages=2 and microbatches a multiple of {p}")
                    continue
                if name != "interleaved" and name != "zb" and v != 1:
                    continue
                stages = p * v
                try:
                    cuts = plan_cuts(costs, stages, p2p_time=p2p, inflight=inflight(name, stages, p, m),
                                     budget=budget)
                except ConfigError:
                    if schedule and microbatches:
                        raise
                    continue
                sim = simulate_plan(costs, cuts, schedule=name, devices=p, virtual=v, microbatches=m, p2p_time=p2p)
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


def parallelize_pipeline(model: nn.Module, mesh: Any, example_inputs: Any, *, loss_fn: Callable | None,
                         schedule: str | None = None, microbatches: int | None = None,
                         virtual_stages: int | None = None, hardware: str | None = None,
                         memory_budget: float | None = None, sync_params: bool = True,
                         zero_stage: int | None = None, plan: Any = None, recompute: str = "none",
                         example_kwargs: Mapping[str, Any] | None = None):
    """This rank's :class:`~autopar.runtime.pp.PipelineModule` (see :func:`autopar.parallelize`).
    Without ``loss_fn``, a model that computes its own loss (a ``transformers`` model given
    ``labels``) trains on that loss."""

    from autopar.api import _capture, default_dims, device_mesh, model_tensors, planned_graph
    from autopar.passes.pp_split import shared_params, split_stages
    from autopar.runtime.pp import PipelineModule, StageModule, stage_inputs_of

    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")
    from dataclasses import replace

    from autopar.plans import Plan

    axes = pipeline_axes(mesh)
    if plan is not None:
        if plan.pp_axis is None or not plan.stage_starts:
            raise ConfigError("the plan has no pipeline stages", where="parallelize(plan=...)",
                              fix="pass a plan made for a mesh with a pp axis, or leave plan out")
        if dict(axes) != plan.mesh:
            raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)",
                            expected=str(plan.mesh), got=str(dict(axes)),
                            fix="pass the mesh the plan was made for, or re-plan for this mesh")
        schedule, microbatches, virtual_stages = plan.schedule, plan.microbatches, plan.virtual_stages
        zero_stage = plan.zero_stage
    sizes = dict(axes)
    world = math.prod(sizes.values())
    mesh = device_mesh(mesh, axes)
    names = list(mesh.mesh_dim_names)
    device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    p = sizes["pp"]
    pp_group, pp_rank = mesh.get_group(names.index("pp")), mesh.get_local_rank(names.index("pp"))
    dp_group = mesh.get_group(names.index("dp")) if "dp" in names else None
    tp_n = sizes.get("tp", 1)
    ep_n = sizes.get("ep", 1)
    tp_group = mesh.get_group(names.index("tp")) if "tp" in names else None
    tp_rank = mesh.get_local_rank(names.index("tp")) if "tp" in names else 0
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = {k: v for k, v in (example_kwargs or {}).items() if v is not None}
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ConfigError("a pipeline needs a batched tensor input to split into micro-batches", where="parallelize",
                          fix="pass the batch's tensors (dim 0 the batch) in example_inputs / example_kwargs")
    batch = int(first.shape[0])
    cluster = Cluster.from_spec(f"1x{world}", hardware=hardware or ("h100" if torch.cuda.is_available() else "cpu"))
    dtype = "fp32"
    budget = memory_budget

    # 1. schedule and micro-batches from the simulator, pricing a symbolic capture
    if microbatches and schedule and (virtual_stages or schedule != "interleaved"):
        choice_m, choice_s, choice_v = microbatches, schedule, virtual_stages or (2 if schedule == "interleaved" else 1)
    else:
        sym = _capture(model, args, None, kwargs)
        symbols = {str(k) for k in info_symbols(sym)}

        def priced(mb: int) -> OpCosts:
            at = {"batch": mb} if "batch" in symbols else {}
            if "seq" in symbols and first.dim() > 1:
                at["seq"] = int(first.shape[1])
            return op_costs(sym, node_time=node_time_fn(cluster.device, dtype, at), sizes=at)
        pre = plan_pipeline(priced, devices=p, batch=batch, cluster=cluster, axes=axes, schedule=schedule,
                            microbatches=microbatches, virtual=virtual_stages, budget=budget)
        choice_m, choice_s, choice_v = pre.microbatches, pre.schedule, pre.virtual
    if batch % choice_m:
        raise ConfigError(f"the batch of {batch} does not split into {choice_m} micro-batches", where="parallelize",
                          expected=f"a multiple of {choice_m}", got=str(batch), fix="pass a divisible batch")
    mb_args = tuple(a.chunk(choice_m)[0] if isinstance(a, torch.Tensor) else a for a in args)
    mb_kwargs = {k: a.chunk(choice_m)[0] if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}

    # 2. the graph at the micro-batch size (static), rewritten for the tensor axis
    tp_plan = None
    if tp_n > 1:
        given = None if plan is None else replace(plan, mesh={"tp": tp_n}, dp_axis=None, pp_axis=None,
                                                  stage_starts=(), schedule=None)
        gm, tp_plan = planned_graph(model, {"tp": tp_n}, mb_args, example_kwargs=mb_kwargs, dims=(), after="rewrite",
                                    hardware=hardware, group_name=tp_group.group_name, memory_budget=memory_budget,
                                    plan=given, pinned=in_experts if ep_n > 1 else None)
        placements = dict(tp_plan.params)
    else:
        gm, placements = _capture(model, mb_args, (), mb_kwargs), {}
    own = loss_fn is None
    loss_fn = loss_fn or own_loss(gm)
    del default_dims
    tensors = model_tensors(model, sync=sync_params)
    experts: dict[str, str] = {}
    if ep_n > 1:   # each MoE layer's experts spread over the ep axis, on the whole graph before the cuts
        experts = split_experts(gm, tensors, group=mesh.get_group(names.index("ep")), n=ep_n,
                                rank=mesh.get_local_rank(names.index("ep")))

    # 3. cuts on this graph (or the plan's)
    costs = op_costs(gm, node_time=node_time_fn(cluster.device, dtype), tp=tp_n)
    final = plan_pipeline(lambda mb: costs, devices=p, batch=choice_m, cluster=cluster, axes=axes,
                          schedule=choice_s, microbatches=choice_m, virtual=choice_v, budget=budget)
    starts = plan.stage_starts if plan is not None else final.cuts.start_nodes
    if len(starts) != p * choice_v:
        raise ConfigError(f"the plan has {len(starts)} stages, the mesh and schedule need {p * choice_v}",
                          where="plan.stage_starts", fix="re-plan for this mesh")
    stages = split_stages(gm, list(starts))
    the_plan = Plan(mesh=dict(axes), tp_axis="tp" if tp_n > 1 else None,
                    params=placements or {k: "R" for k, _ in model.named_parameters()},
                    nodes=dict(tp_plan.nodes) if tp_plan is not None else {}, predicted=final.as_dict(),
                    model=type(model).__name__, dp_axis="dp" if "dp" in sizes else None, pp_axis="pp",
                    ep_axis="ep" if ep_n > 1 else None,
                    zero_stage=(zero_stage or 0) if sizes.get("dp", 1) > 1 else 0,
                    stage_starts=tuple(starts), schedule=choice_s, microbatches=choice_m,
                    virtual_stages=choice_v, shapes={k: list(q.shape) for k, q in model.named_parameters()})
    the_plan = replace(the_plan, fingerprint=Plan.fingerprint_of(the_plan.shapes))
    shared = shared_params(stages)

    # 4. this rank's stages
    trainable = {k: q.requires_grad for k, q in model.named_parameters()}
    inputs = stage_inputs_of(gm)
    mine: list[StageModule] = []
    made: dict[str, nn.Parameter] = {}
    for sg in stages:
        if sg.index % p != pp_rank:
            continue
        st = StageModule(sg, tensors, trainable, placements, tp_rank, tp_n,
                         input_names=inputs if sg.index == 0 else (), shared=made)
        st.is_last = sg.index == len(stages) - 1
        made.update({k: v for k, v in st.named_parameters(remove_duplicate=False)})
        mine.append(st)
    if recompute != "none":
        from autopar.runtime.recompute import layer_members
        layers = layer_members(gm) if recompute == "full" else ()
        for st in mine:
            st.set_recompute(recompute, layers)
    groups = _shared_groups(mesh, names, shared, p)
    data = _data_axes(mine, mesh, names, sizes, zero_stage or 0, set(experts), groups, device)
    pm = PipelineModule(mine, plan=the_plan, schedule=choice_s, microbatches=choice_m, num_stages=final.stages,
                        loss_fn=loss_fn, pp_group=pp_group, pp_rank=pp_rank, pp_size=p, data=data,
                        shared=groups, device=device, keyword_names=list(kwargs), own_loss=own,
                        examples=[st.io_examples(tp_n, device, (*mb_args, *mb_kwargs.values()) if st.index == 0 else None)
                                  for st in mine])
    pm.stage_graphs = stages
    pm.expert_storage = {f: how for f, (how, _) in experts.items()}    # fqn -> "rows" | "whole"
    pm.expert_owned = {f: owned for f, (_, owned) in experts.items()}  # fqn -> the experts this rank holds
    pm.pipeline_plan = final       # the simulator's view: stage times, step time, bubble
    return pm


def in_experts(node: fx.Node) -> bool:
    from autopar.ep import _in_experts
    return _in_experts(node)


def split_experts(gm: fx.GraphModule, tensors: dict[str, torch.Tensor], *, group: Any, n: int,
                  rank: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Rewrite every MoE layer of ``gm`` for the expert exchange over ``group`` (experts in
    order, ``E/n`` per rank), keep this rank's experts' rows in ``tensors``, and return how
    each expert parameter is stored (``rows`` of a stacked tensor, or ``whole`` owned modules)
    with the experts this rank owns."""
    from autopar.ep import _checked_plans, contiguous
    from autopar.passes.ep_rewrite import ep_rewrite
    from autopar.runtime.ep import EPRuntime

    plans = _checked_plans(gm, tensors)
    regions = [q.region for q in plans if q.kind != "dense"]
    rts = {r.fqn: EPRuntime(n=n, rank=rank, group=group, perm=contiguous(r.num_experts, n).perm) for r in regions}
    stored = ep_rewrite(gm, plans, rts)
    region_of = {f: r.fqn for r in regions for f in r.expert_params}
    for fqn, how in stored.items():
        if how == "rows":
            owned = torch.tensor(rts[region_of[fqn]].owned())
            tensors[fqn] = tensors[fqn].detach().index_select(0, owned).clone()
    return {fqn: (how, tuple(rts[region_of[fqn]].owned())) for fqn, how in stored.items()}


def _data_axes(mine: list, mesh, names: list[str], sizes: Mapping[str, int], zero_stage: int, experts: set[str],
               shared: Mapping[str, Any], device: torch.device) -> list:
    """The data axes of this rank's stages (runtime/stage_dp.py): each parameter's gradient is
    averaged over the ranks that computed it on other rows of the batch — the dense parameters
    over dp x ep (each ep rank has its own rows), the experts over dp (their owner already
    received every ep rank's rows through the exchange, runtime/ep.py)."""
    from autopar.runtime.ep import average_over_senders
    from autopar.runtime.stage_dp import StageDataAxis

    named = [(st.index, dict(st.named_parameters(remove_duplicate=False))) for st in mine]
    if experts:
        average_over_senders([q for _, ps in named for f, q in ps.items() if f in experts], sizes["ep"])
    out = []
    for axes, keep in ((("dp", "ep"), lambda f: f not in experts), (("dp",), lambda f: f in experts)):
        group, n, rank = axes_group(mesh, names, [a for a in axes if sizes.get(a, 1) > 1])
        if n == 1:
            continue
        parts = [(i, {f: q for f, q in ps.items() if keep(f)}) for i, ps in named]
        out.append(StageDataAxis(parts, zero_stage=zero_stage, n=n, rank=rank, group_name=group.group_name,
                                 device=device, shared=shared))
    return out


def axes_group(mesh, names: list[str], axes: list[str]) -> tuple[Any, int, int]:
    """(process group, size, this rank's index) of the mesh axes ``axes`` taken together at
    this rank's place on the others. Every rank creates every such group, in one order."""
    if not axes:
        return None, 1, 0
    if len(axes) == 1:
        d = names.index(axes[0])
        return mesh.get_group(d), mesh.size(d), mesh.get_local_rank(d)
    dims = [names.index(a) for a in axes]
    rest = [d for d in range(len(names)) if d not in dims]
    grid = mesh.mesh.permute(*rest, *dims).reshape(-1, math.prod(mesh.size(d) for d in dims))
    me, mine = dist.get_rank(), None
    for row in grid.tolist():
        g = dist.new_group(row)
        if me in row:
            mine = (g, len(row), row.index(me))
    return mine


def own_loss(gm: fx.GraphModule) -> Callable:
    """The loss function of a model that returns its own loss (a ``ModelOutput`` with ``loss``,
    as ``transformers`` models given ``labels`` do): pick it from the last stage's outputs."""
    from autopar.passes.meta import graph_info
    spec = graph_info(gm).out_spec
    keys = list(spec.context) if spec is not None and isinstance(spec.context, (list, tuple)) else []
    if "loss" not in keys:
        raise ConfigError("a pipelined model needs a loss function", where="parallelize",
                          fix="pass loss_fn=lambda output, target: ... (it runs on the last stage), or give a "
                              "transformers model its labels so it returns its own loss")
    at = keys.index("loss")
    return functools.partial(_pick, at=at)


def _pick(output: Any, target: Any, *, at: int) -> torch.Tensor:
    loss = output[at] if isinstance(output, (tuple, list)) else output
    return loss.reshape(())          # the last stage hands its scalars over as [1] (runtime/pp.py)


def _shared_groups(mesh, names: list[str], shared: Mapping[str, list[int]], p: int) -> dict[str, Any]:
    """For each parameter several stages hold: the process group of the pipeline ranks holding
    it at this rank's place on the other axes (only where this rank is one of them and they are
    more than one). Every rank creates every group, in the same order."""
    me = dist.get_rank()
    grid = mesh.mesh.reshape(p, -1)            # pp x (the other axes, flattened)
    out: dict[str, Any] = {}
    made: dict[tuple[int, ...], Any] = {}
    for fqn in sorted(shared):
        holders = tuple(sorted({s % p for s in shared[fqn]}))
        if len(holders) < 2:
            continue                          # one rank holds every copy: one Parameter
        for col in range(grid.shape[1]):
            ranks = tuple(int(grid[h, col]) for h in holders)
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                out[fqn] = made[ranks]
    return out


def info_symbols(gm: fx.GraphModule):
    from autopar.passes.meta import graph_info
    return graph_info(gm).symbols


__all__ = ["PipelinePlan", "pipeline_axes", "plan_pipeline", "parallelize_pipeline", "simulate_plan", "inflight",
           "node_time_fn", "SCHEDULES"]
