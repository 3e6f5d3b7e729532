"""Building this rank's parallel model: a plan over every axis, applied by the rewrites in one order.

Every build runs the same steps, in the order ``passes/pipeline.py`` lists as
``REWRITE_PASSES``, each only where its axis exists:

1. capture and analyse the model (``autopar/prepare.py``; at the micro-batch size when there
   is a pipeline);
2. tensor axis: solve and rewrite the whole graph (``passes/tp_rewrite.py``), experts kept whole;
3. expert axis: rewrite each mixture-of-experts layer for the exchange
   (``passes/ep_rewrite.py``) and keep this rank's experts only;
4. pipeline axis: cut the rewritten graph into stages (``passes/pp_split.py``);
5. recomputation regions in each graph (``runtime/recompute.py``);
6. data axes: the dense parameters over ``dp x ep``, the experts over ``dp``, at the plan's
   ZeRO stage — as graph nodes overlapped with backward without a pipeline
   (``passes/dp_rewrite.py`` and ``runtime/dp.py``), per stage and per step inside one
   (``runtime/stage_dp.py``).

The result is one runtime module: :class:`~autopar.runtime.tp_module.ParallelModule` without a
pipeline (``build_dense``, ``build_experts``), :class:`~autopar.runtime.pp.PipelineModule` with
one (``build_pipeline``, which composes every axis). :func:`autopar.parallelize` picks the build
from the mesh's axes; :func:`autopar.optimizer` steps any of them.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.checks import check_fits, check_runtime_dtypes
from autopar.cost.cluster import Cluster
from autopar.core.dp_mode import ALLREDUCE, DataMode
from autopar.core.errors import ConfigError, MeshError, PlanFileError
from autopar.cost.ep_planner import contiguous, ep_axes, place_experts
from autopar.expert_steps import (calibrated_loads, checked_moe_plans, exchange_experts, expert_side,
                                  planned_placements, set_capacity, split_experts)
from autopar.core.meta import graph_info, info
from autopar.passes.autocast import drop_dtype_checks
from autopar.passes.pp_split import OpCosts, op_costs
from autopar.core.plans import Plan
from autopar.cost.pp_planner import info_symbols, named_axes, node_time_fn, pipeline_axes, plan_pipeline
from autopar.runtime.sync_bn import sync_batch_norms
from autopar.prepare import (capture_model, data_rewrite, device_mesh, input_dims, master_dtype,
                             mesh_axes, model_tensors, planned_graph, torch_dtype)

log = logging.getLogger("autopar.build")


def build_dense(model: nn.Module, mesh: Any, args: tuple, kwargs: dict, *, plan: Plan | None, dims: Any,
                hardware: str | None, memory_budget: float | None, sizes: Mapping[str, int] | None,
                sync_params: bool, zero_stage: int | None, overlap: bool, bucket_bytes: int,
                mixed_precision: str | None, recompute: str, placements: Mapping[str, str] | None,
                dp_mode: DataMode = ALLREDUCE, sequence_parallel: bool | None = None):
    """No pipeline, no experts: the tensor rewrite and the data axis's buckets on the whole
    graph, run by one :class:`~autopar.runtime.tp_module.ParallelModule`."""
    from autopar.runtime.dp import DPRuntime
    from autopar.runtime.tp_module import ParallelModule

    axes = mesh_axes(mesh) if plan is None or not isinstance(mesh, int) else tuple(plan.mesh.items())
    if plan is not None and dict(axes) != plan.mesh:
        raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)", expected=str(plan.mesh),
                        got=str(dict(axes)), fix="pass the mesh the plan was made for, or re-plan for this mesh")
    world = math.prod(n for _, n in axes)
    mesh = device_mesh(mesh, axes)
    names = list(mesh.mesh_dim_names or ("tp",))
    tp_group = mesh.get_group(names.index("tp")) if "tp" in names else None
    gm, the_plan = planned_graph(model, mesh, args, example_kwargs=kwargs, dims=dims, plan=plan, hardware=hardware,
                                 memory_budget=memory_budget, sizes=sizes, after="rewrite",
                                 group_name=tp_group.group_name if tp_group is not None else "tp",
                                 zero_stage=zero_stage, overlap=overlap, bucket_bytes=bucket_bytes,
                                 mixed_precision=mixed_precision, placements=placements, modes=True,
                                 sequence_parallel=sequence_parallel)
    if plan is None:
        check_fits(gm, the_plan, memory_budget, {**graph_info(gm).example_sizes, **dict(sizes or {})})
    check_runtime_dtypes(model, gm, the_plan)
    if the_plan.tp > 1 and all(p == "R" for p in the_plan.params.values()):   # tp asked for, nothing split
        log.warning("the plan splits no parameter over the tensor axis (tp=%d): every rank holds the whole "
                    "model, because %s", the_plan.tp,
                    "the plan given says so" if plan is not None else "placements= forces it" if placements else
                    "the cost model found replication cheaper (splitting would communicate more than it saves)"
                    if any(d % the_plan.tp == 0 for p in model.parameters() for d in p.shape) else
                    f"no parameter has a dimension divisible by {the_plan.tp}")
    tensors = model_tensors(model, sync=sync_params)
    trainable = {k: p.requires_grad for k, p in model.named_parameters()}
    rt = None
    device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    master = master_dtype(gm)
    compute = torch_dtype(the_plan.mixed_precision) if the_plan.mixed_precision else master
    if the_plan.dp_axis is not None and the_plan.dp > 1:
        dim = names.index(the_plan.dp_axis)
        rt = DPRuntime(stage=the_plan.zero_stage, n=mesh.size(dim), rank=mesh.get_local_rank(dim),
                       group_name=mesh.get_group(dim).group_name, device=device, master_dtype=master,
                       compute_dtype=compute, prefetch=the_plan.overlap)
        cluster = Cluster.from_spec(f"1x{world}", hardware=hardware or ("h100" if torch.cuda.is_available() else "cpu"))
        for fqns, shapes, flags in data_rewrite(gm, the_plan, cluster, rid=rt.id, trainable=trainable):
            rt.add_bucket(fqns, shapes, flags)
        sync_batch_norms(gm, rt.group_name)     # training statistics over the global batch
        attach_mode(rt, dp_mode)
    elif compute != master:   # mixed precision without a data axis: fp32 masters, nothing to reduce
        rt = DPRuntime(stage=0, n=1, rank=0, group_name="", device=device, master_dtype=master, compute_dtype=compute)
    if rt is None or rt.n == 1:
        unused_mode(dp_mode, the_plan.dp)
    the_plan = replace(the_plan, dp_mode=dp_mode.to_dict() if rt is not None and rt.modes is not None else {})
    used = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn}
    dim_map = input_dims(model, args, dims, kwargs)
    pm = ParallelModule(gm, the_plan.params, {k: v for k, v in tensors.items() if k in used}, trainable, mesh,
                        the_plan, dim_map, dp=rt)
    pm.set_recompute(recompute)   # none | selective (attention cores) | full (every layer), checkpointed
    return pm


def build_pipeline(model: nn.Module, mesh: Any, example_inputs: Any, *, loss_fn: Callable | None,
                   schedule: str | None = None, microbatches: int | None = None,
                   virtual_stages: int | None = None, hardware: str | None = None,
                   memory_budget: float | None = None, sync_params: bool = True,
                   zero_stage: int | None = None, plan: Any = None, recompute: str = "none",
                   example_kwargs: Mapping[str, Any] | None = None, mixed_precision: str | None = None,
                   dp_mode: DataMode = ALLREDUCE):
    """This rank's :class:`~autopar.runtime.pp.PipelineModule` (see :func:`autopar.parallelize`).
    Without ``loss_fn``, a model that computes its own loss (a ``transformers`` model given
    ``labels``) trains on that loss. ``mixed_precision`` (bf16 / fp16, or the plan's): the
    stages compute in 16 bits, gradients accumulate and are reduced in fp32, the optimizer
    steps fp32 masters (``runtime/main_grads.py``)."""

    from autopar.passes.autocast import autocast_dtypes
    from autopar.passes.pp_split import shared_params, split_stages
    from autopar.runtime.main_grads import MainGrads
    from autopar.runtime.pp import PipelineModule, StageModule, stage_inputs_of
    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")
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
        zero_stage, mixed_precision = plan.zero_stage, plan.mixed_precision
    sizes = dict(axes)
    world = math.prod(sizes.values())
    mesh = device_mesh(mesh, axes)
    names = list(mesh.mesh_dim_names)
    device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    p = sizes["pp"]
    pp_group, pp_rank = mesh.get_group(names.index("pp")), mesh.get_local_rank(names.index("pp"))
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
        sym = capture_model(model, args, None, kwargs)
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
        given = None if plan is None else replace(plan, mesh={"tp": tp_n}, dp_axis=None, pp_axis=None, ep_axis=None,
                                                  stage_starts=(), schedule=None, expert_placement={})
        gm, tp_plan = planned_graph(model, {"tp": tp_n}, mb_args, example_kwargs=mb_kwargs, dims=(), after="rewrite",
                                    hardware=hardware, group_name=tp_group.group_name, memory_budget=memory_budget,
                                    plan=given, pinned=expert_side if ep_n > 1 else None, modes=True)
        placements = dict(tp_plan.params)
    else:
        gm, placements = capture_model(model, mb_args, (), mb_kwargs, modes=True), {}
    own = loss_fn is None
    loss_fn = loss_fn or own_loss(gm)
    tensors = model_tensors(model, sync=sync_params)
    experts: dict[str, tuple[str, tuple[int, ...]]] = {}
    if ep_n > 1:   # each MoE layer's experts spread over the ep axis, on the whole graph before the cuts
        experts = split_experts(gm, tensors, group=mesh.get_group(names.index("ep")), n=ep_n,
                                rank=mesh.get_local_rank(names.index("ep")))

    # 3. cuts on this graph (or the plan's); under mixed precision a value crosses in its autocast dtype
    compute = torch_dtype(mixed_precision) if mixed_precision else None
    sent = autocast_dtypes(gm, compute, device.type) if compute is not None else {}
    costs = op_costs(gm, node_time=node_time_fn(cluster.device, dtype), tp=tp_n, wire=sent)
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
                    zero_stage=(zero_stage or 0) if sizes.get("dp", 1) * ep_n > 1 else 0,
                    stage_starts=tuple(starts), schedule=choice_s, microbatches=choice_m,
                    virtual_stages=choice_v, mixed_precision=mixed_precision,
                    shapes={k: list(q.shape) for k, q in model.named_parameters()})
    the_plan = replace(the_plan, fingerprint=Plan.fingerprint_of(the_plan.shapes))
    check_runtime_dtypes(model, gm, the_plan)
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
    # 5. mixed precision: fp32 accumulators for the gradients, then 16-bit stage parameters (after the
    # data axes, so that ZeRO-3 cuts its fp32 pieces, the masters, from the fp32 values)
    grads = MainGrads(1 / choice_m) if compute is not None else None
    data = data_axes(mine, mesh, names, sizes, zero_stage or 0, set(experts), groups, device,
                     compute_dtype=compute, grads=grads)
    for axis in data:
        attach_mode(axis.rt, dp_mode)
    if not data:
        unused_mode(dp_mode, sizes.get("dp", 1))
    master_init: dict[str, torch.Tensor] = {}
    for st in mine if compute is not None else ():
        drop_dtype_checks(st.graph_module)     # they pin the captured fp32 dtypes
        master_init.update(st.to_compute_dtype(compute, device.type, sent))
    if any(axis.rt.modes is not None for axis in data):
        the_plan = replace(the_plan, dp_mode=dp_mode.to_dict())
    pm = PipelineModule(mine, plan=the_plan, schedule=choice_s, microbatches=choice_m, num_stages=final.stages,
                        loss_fn=loss_fn, pp_group=pp_group, pp_rank=pp_rank, pp_size=p, data=data,
                        grads=grads, master_init=master_init,
                        shared=groups, device=device, keyword_names=list(kwargs), own_loss=own,
                        examples=[st.io_examples(tp_n, device, (*mb_args, *mb_kwargs.values()) if st.index == 0 else None)
                                  for st in mine])
    pm.stage_graphs = stages
    pm.expert_storage = {f: how for f, (how, _) in experts.items()}    # fqn -> "rows" | "whole"
    pm.expert_owned = {f: owned for f, (_, owned) in experts.items()}  # fqn -> the experts this rank holds
    pm.pipeline_plan = final       # the simulator's view: stage times, step time, bubble
    pm.mode_source = graph_info(gm).mode_source       # switches the stages between train and eval
    return pm


def build_experts(model: nn.Module, mesh: Any, example_inputs: Any, *, hardware: str | None = None,
                  memory_budget: float | None = None, sync_params: bool = True,
                  calibration: Any = None, placement: str = "balanced", dims: Any = None,
                  capacity_factor: float | None = None, example_kwargs: Any = None, plan: Any = None,
                  zero_stage: int | None = None, recompute: str = "none", mixed_precision: str | None = None):
    """This rank's model with experts spread over the ``ep`` axis (see :func:`autopar.parallelize`).
    ``capacity_factor`` overrides the MoE layers' own (set on the module of each region the
    graph shows, which must have a ``capacity_factor`` attribute; the model is then captured
    again), so tokens drop exactly as the single-device model's at that factor.

    ``plan`` (a :class:`~autopar.core.plans.Plan` this function returned before, e.g. saved and
    loaded) is applied as it is: its mesh (which ``mesh`` must equal), its experts' owners
    (``expert_placement``; ``calibration`` and ``placement`` are not used, so no calibration
    batch is run), its capacity factor and its tensor-axis placements. A plan that does not
    fit the model or the mesh raises a :class:`~autopar.core.errors.PlanFileError` or
    :class:`~autopar.core.errors.MeshError` on every rank at the same point: before any collective
    where the plan and the model's modules show it (mesh, a placement that is not a
    permutation, a layer the model does not have), otherwise right after the capture (split
    MoE layers, or their expert counts, that differ from the plan's). ``mixed_precision`` (or the
    plan's) as without experts: 16-bit compute, fp32 masters and reductions."""
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
        capacity_factor, mixed_precision = plan.capacity_factor, plan.mixed_precision
    sizes = dict(axes)
    mesh = device_mesh(mesh, axes)
    names = list(mesh.mesh_dim_names)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    tensors = model_tensors(model, sync=sync_params)
    if capacity_factor is not None:
        set_capacity(model, capture_model(model, args, (), kwargs), capacity_factor)
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
                                    pinned=expert_side, plan=given, modes=True)
        placements, nodes = dict(tp_plan.params), dict(tp_plan.nodes)
    else:
        gm = capture_model(model, args, dims, kwargs, modes=True)
        placements, nodes = {k: "R" for k in tensors}, {}
    if mixed_precision:
        drop_dtype_checks(gm)      # the graph runs under autocast (the tensor rewrite drops them too)
    plans = checked_moe_plans(gm, tensors)
    regions = [p.region for p in plans if p.kind != "dense"]
    planned = planned_placements(plan, regions, n_ep) if plan is not None else None
    if not regions:   # nothing to split: the expert axis is one more data axis
        dense = {"dp": sizes.get("dp", 1) * n_ep, **({"tp": tp_n} if tp_n > 1 else {})}
        log.warning("no MoE layer's experts can be split: the ep axis runs as data parallelism (mesh %s)", dense)
        return build_dense(model, dense, args, kwargs, plan=None, dims=dims, hardware=hardware,
                           memory_budget=memory_budget, sizes=None, sync_params=False, zero_stage=zero_stage,
                           overlap=True, bucket_bytes=0, mixed_precision=mixed_precision, recompute=recompute,
                           placements=None)
    if planned is not None:
        placed = planned
    else:
        loads = calibrated_loads(model, calibration, tensors) \
            if calibration is not None and placement == "balanced" else {}
        placed = {r.fqn: place_experts(r.num_experts, n_ep, loads.get(r.fqn)) if placement == "balanced" else
                  contiguous(r.num_experts, n_ep, loads.get(r.fqn)) for r in regions}
    group = mesh.get_group(names.index("ep"))
    rts, split = exchange_experts(gm, tensors, plans, {f: pl.perm for f, pl in placed.items()}, group=group,
                                  n=n_ep, rank=ep_rank)
    stored = {f: how for f, (how, _) in split.items()}
    trainable = {k: p.requires_grad for k, p in model.named_parameters()}
    used = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn}
    shapes = {k: list(p.shape) for k, p in model.named_parameters()}   # what Plan.check_model compares
    # a re-applied plan keeps its predictions (the loads behind its imbalance are not in the plan)
    predicted = dict(plan.predicted) if plan is not None else \
        {"imbalance": {f: p.imbalance for f, p in placed.items()}}
    zero = (plan.zero_stage if plan is not None else zero_stage) or 0
    the_plan = Plan(mesh=sizes, tp_axis="tp" if tp_n > 1 else None, params=placements, nodes=nodes,
                    model=type(model).__name__, ep_axis="ep", capacity_factor=capacity_factor,
                    dp_axis="dp" if "dp" in sizes else None, zero_stage=zero if sizes.get("dp", 1) * n_ep > 1 else 0,
                    expert_placement={f: list(p.perm) for f, p in placed.items()}, mixed_precision=mixed_precision,
                    predicted=predicted, shapes=shapes, fingerprint=Plan.fingerprint_of(shapes))
    check_runtime_dtypes(model, gm, the_plan)
    device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
    cluster = Cluster.from_spec(f"1x{math.prod(sizes.values())}",
                                hardware=hardware or ("h100" if torch.cuda.is_available() else "cpu"))
    data = _graph_data_axes(gm, the_plan, cluster, mesh, names, {f: tuple(tensors[f].shape) for f in stored},
                            trainable, device)
    pm = ParallelModule(gm, placements, {k: v for k, v in tensors.items() if k in used}, trainable, mesh,
                        the_plan, input_dims(model, args, dims, kwargs), dp=data)
    if sizes.get("dp", 1) == 1:    # no data axis for the experts: divide where their gradients arrive
        from autopar.runtime.ep import average_over_senders
        average_over_senders([q for f, q in pm.named_parameters() if f in stored], n_ep)
    pm.set_recompute(recompute)
    pm.expert_params = set(stored)
    pm.expert_storage = stored        # fqn -> "rows" (owned rows of stacked experts) | "whole" (an owned module's)
    pm.ep_runtimes = rts
    pm.placements = placed
    return pm


def _graph_data_axes(gm: fx.GraphModule, the_plan: Plan, cluster: Cluster, mesh, names: list[str],
                     experts: Mapping[str, tuple[int, ...]], trainable: Mapping[str, bool],
                     device: torch.device) -> list:
    """The data axes of a graph with experts, as data-axis nodes (``passes/dp_rewrite.py``), one
    runtime each: the dense parameters over dp x ep (every rank of both has its own rows), the
    experts over dp (their owner received every ep rank's rows through the exchange).
    ``experts`` maps each expert parameter to the shape this rank stores."""
    from autopar.passes.dp_rewrite import schedule
    from autopar.runtime.dp import DPRuntime

    sizes = dict(the_plan.mesh)
    ep = sizes.get("ep", 1)
    out = []
    for axes, keep, extra in ((("dp", "ep"), lambda f: f not in experts, 1), (("dp",), lambda f: f in experts, ep)):
        group, n, rank = axes_group(mesh, names, [a for a in axes if sizes.get(a, 1) > 1])
        if n == 1:
            continue
        rt = DPRuntime(stage=the_plan.zero_stage, n=n, rank=rank, group_name=group.group_name, device=device,
                       master_dtype=master_dtype(gm), prefetch=the_plan.overlap, divisor=n * extra,
                       compute_dtype=torch_dtype(the_plan.mixed_precision) if the_plan.mixed_precision else None)
        for fqns, shapes, flags in data_rewrite(gm, the_plan, cluster, rid=rt.id, trainable=trainable,
                                                axis="x".join(a for a in axes if sizes.get(a, 1) > 1), n=n,
                                                include=keep, scheduled=False, stored=experts):
            rt.add_bucket(fqns, shapes, flags)
        out.append(rt)
    schedule(gm, overlap=the_plan.overlap)
    return out


def attach_mode(rt: Any, mode: DataMode) -> None:
    """Run data axis ``rt`` in ``mode`` (nothing to attach for all-reduce or a one-rank axis)."""
    from autopar.runtime.data_modes import ModeState
    if mode.kind != "allreduce" and rt.n > 1:
        rt.modes = ModeState(mode, n=rt.n, rank=rt.rank, group_name=rt.group_name, device=rt.device)


def unused_mode(mode: DataMode, dp: int) -> None:
    """A mode other than all-reduce with no data axis to run on would be dropped silently."""
    if mode.kind != "allreduce":
        raise ConfigError(f"dp_mode {mode.kind!r} needs a data axis of 2 ranks or more", where="parallelize",
                          got=f"dp={dp}", fix="add a dp axis to the mesh (e.g. {'dp': 4}), or drop dp_mode")


def data_axes(mine: list, mesh, names: list[str], sizes: Mapping[str, int], zero_stage: int, experts: set[str],
               shared: Mapping[str, Any], device: torch.device, *, compute_dtype: torch.dtype | None = None,
               grads: Any = None) -> list:
    """The data axes of this rank's stages (runtime/stage_dp.py): each parameter's gradient is
    averaged over the ranks that computed it on other rows of the batch — the dense parameters
    over dp x ep (each ep rank has its own rows), the experts over dp but divided by dp x ep
    (their owner already received every ep rank's rows through the exchange, runtime/ep.py).
    Under mixed precision the whole gradients are the fp32 accumulators ``grads``."""
    from autopar.runtime.ep import average_over_senders
    from autopar.runtime.stage_dp import StageDataAxis

    named = [(st.index, dict(st.named_parameters(remove_duplicate=False))) for st in mine]
    ep = sizes.get("ep", 1)
    if experts and sizes.get("dp", 1) == 1:    # no data axis for the experts: divide where they arrive
        if grads is not None:                  # mixed precision: in fp32, as they are accumulated
            grads.divide(experts, ep)
        else:
            average_over_senders([q for _, ps in named for f, q in ps.items() if f in experts], ep)
    out = []
    for axes, keep, extra in ((("dp", "ep"), lambda f: f not in experts, 1), (("dp",), lambda f: f in experts, ep)):
        group, n, rank = axes_group(mesh, names, [a for a in axes if sizes.get(a, 1) > 1])
        if n == 1:
            continue
        parts = [(i, {f: q for f, q in ps.items() if keep(f)}) for i, ps in named]
        out.append(StageDataAxis(parts, zero_stage=zero_stage, n=n, rank=rank, group_name=group.group_name,
                                 device=device, shared=shared, divisor=n * extra, compute_dtype=compute_dtype,
                                 grads=grads))
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


def own_loss(gm: fx.GraphModule) -> Callable:
    """The loss function of a model that returns its own loss (a ``ModelOutput`` with ``loss``,
    as ``transformers`` models given ``labels`` do): pick it from the last stage's outputs."""
    from autopar.core.meta import graph_info
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


def _checked_plan_axes(plan: Any, mesh: Any, model: nn.Module) -> tuple[tuple[str, int], ...]:
    """The mesh axes of a saved expert-parallel ``plan``, after checking that ``mesh`` names
    the same axes and sizes, that each placement in the plan is a permutation splitting
    evenly over the expert axis and that each layer it places is a module of ``model``: all
    of it without running anything, so every rank refuses a bad plan before any collective
    (:func:`planned_placements` checks the layers against the captured graph later)."""

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


