"""Preparing a model's graph for a mesh: the steps every entry point shares.

``capture_model`` captures and analyses the model (``passes/``); ``solve_tensor_axis`` asks the
tensor-axis solver (``cost/tp_solver.py``) how to split each op; ``planned_graph`` annotates
every node with its placement and, on request, rewrites the graph for the tensor axis
(``passes/tp_rewrite.py``) and inserts the data axis's buckets (``passes/dp_rewrite.py``):
what ``autopar plan``, ``autopar dump`` and the build's tensor step (``autopar/build/tensor.py``) start from.
The helpers below them turn a mesh argument into axes and a DeviceMesh, copy the model's
tensors (rank 0's, on every rank) and find the inputs' named sizes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.build.checks import check_options, check_plan_placements, check_sequence_option, forced_placements
from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.plan_sizes import dtype_of, local_numels, local_shape, param_bytes
from autopar.cost.tp_solver import Solution, SolverConfig, solve
from autopar.core.mesh import dense_axes
from autopar.core.errors import CaptureError, MeshError, PlanFileError
from autopar.passes.capture import capture
from autopar.core.meta import graph_info, info
from autopar.passes.pipeline import analyze
from autopar.passes.sharding import replication_reason
from autopar.passes.tp_rewrite import tp_rewrite
from autopar.core.plans import NodeStrategy, Plan
from autopar.core.progress import setup_stage

log = logging.getLogger("autopar")


def default_dims(example_inputs: tuple, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Dim 0 of every tensor input is the batch; dim 1 of an integer (token) tensor the sequence.
    Per positional input (a tuple), or by position and name when there are keyword inputs."""
    def labels(x: Any) -> dict[int, str]:
        d: dict[int, str] = {}
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] >= 2:
            d[0] = "batch"
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point() and x.shape[1] >= 2:
            d[1] = "seq"
        return d
    positional = tuple(labels(x) for x in example_inputs)
    if not kwargs:
        return positional
    return {**dict(enumerate(positional)), **{k: labels(v) for k, v in kwargs.items()}}


def as_args(example_inputs: Any) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def tp_axes(axes: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    return tuple(a for a in axes if a[0] == "tp")


def capture_model(model: nn.Module, example_inputs: Any, dims: Any,
             kwargs: Mapping[str, Any] | None = None, *, modes: bool = False, tp: int = 1) -> fx.GraphModule:
    """Capture and analyse ``model``; with ``modes`` also record what differs in its other
    train/eval mode (:mod:`autopar.build.modes`), for a build whose module can be switched.
    ``tp``: the tensor axis it is for (grouped-query keys stay repeated where it does not divide
    their heads: :func:`autopar.passes.attention.unrepeat_kv`)."""
    if modes:
        from autopar.build.modes import mode_dependent
        modes = mode_dependent(model)       # a model whose code never looks at its mode: one capture
    if modes and not model.training and not any(m.training for m in model.modules()):
        # an eval-mode model is captured in train mode (its graph then has what training adds,
        # e.g. BatchNorm's counters) and switched to eval: both modes stay available
        from autopar.build.modes import modes_of
        with modes_of(model, True):
            gm = capture_model(model, example_inputs, dims, kwargs, modes=True, tp=tp)
        graph_info(gm).mode_source.switch([gm], False, "autopar.parallelize")
        return gm
    start = time.perf_counter()
    args = as_args(example_inputs)
    labels = dims
    if dims is None:
        try:
            labels = default_dims(args, kwargs)
            gm = analyze(capture(model, args, kwargs=kwargs, dims=labels), kv_divisor=tp)
        except CaptureError as exc:
            log.info("capture with symbolic batch/seq failed (%s); capturing with fixed sizes", exc)
            labels = None
            gm = analyze(capture(model, args, kwargs=kwargs), kv_divisor=tp)
    else:
        labels = dims or None
        gm = analyze(capture(model, args, kwargs=kwargs, dims=labels), kv_divisor=tp)
    if modes:
        from autopar.build.modes import ModeSource
        graph_info(gm).mode_source = ModeSource(gm, model, args, kwargs, labels)
    setup_stage("capture", time.perf_counter() - start)
    return gm


def solve_tensor_axis(gm: fx.GraphModule, axes: tuple[tuple[str, int], ...], *, hardware: str | None,
           memory_budget: float | None, sizes: Mapping[str, int] | None, dtype: str | None,
           pinned: Any = None, placements: Mapping[str, str] | None = None,
           sequence_parallel: bool | None = None, nodes: tuple[int, int] | None = None) -> tuple[Solution, Cluster]:
    """Tensor-axis strategies for ``axes`` (an empty solution when there is no tensor axis),
    with the parameters in ``placements`` stored as forced and activations split along the
    sequence or not as ``sequence_parallel`` says (None: as the cost says)."""
    check_options(sizes, memory_budget)
    check_sequence_option(gm, sequence_parallel, tp_axes(axes))
    forced = forced_placements(gm, placements, axes) if placements else {}
    world = 1
    for _, size in axes:
        world *= size
    count, per = nodes if nodes is not None and nodes[0] * nodes[1] == world else (1, world)
    cluster = Cluster.from_spec(f"{count}x{per}", hardware=hardware or ("h100" if torch.cuda.is_available() else "cpu"))
    tp = tp_axes(axes)
    if not tp or tp[0][1] == 1:
        return Solution(strategies={}, compute_s=0.0, comm_s=0.0, state_bytes=0.0, conversions=[]), cluster
    (axis, n), = tp
    ginfo = graph_info(gm)
    plan_sizes = {**ginfo.example_sizes, **dict(sizes or {})}
    cfg = SolverConfig(n=n, cluster=cluster, mesh_axes=axes, axis=axis, sizes=plan_sizes,
                       dtype=dtype or dtype_of(gm), memory_budget=memory_budget, pinned=pinned, forced=forced,
                       sequence=sequence_parallel)
    return solve(gm, cfg), cluster


def tp_spans_nodes(axes: tuple[tuple[str, int], ...], nodes: tuple[int, int]) -> bool:
    """Does a tensor-axis group of ``axes`` (the innermost axis: consecutive ranks) reach past
    one node of ``nodes = (count, ranks per node)``?"""
    tp = dict(axes).get("tp", 1)
    return tp > 1 and nodes[0] > 1 and (tp > nodes[1] or nodes[1] % tp != 0)


def master_dtype(gm: fx.GraphModule) -> torch.dtype:
    """The dtype the optimizer steps: the first floating-point parameter's."""
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.kind == "param" and rec.values and rec.values[0].dtype.is_floating_point:
            return rec.values[0].dtype
    return torch.float32


def plan_of(gm: fx.GraphModule, sol: Solution, axes: tuple[tuple[str, int], ...], name: str, *,
             zero_stage: int = 0, bucket_bytes: int = 0, overlap: bool = True,
             mixed_precision: str | None = None) -> Plan:
    params = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and info(node).kind in ("param", "buffer"):
            s = sol.strategies.get(node.name)
            params[info(node).target_fqn] = str(s.outputs[0].value) if s else "R"
    nodes = {k: NodeStrategy.of(v) for k, v in sol.strategies.items()}
    predicted = {"compute_s": sol.compute_s, "comm_s": sol.comm_s, "step_time_s": sol.time_s,
                 "state_bytes_per_rank": sol.state_bytes}
    tp = tp_axes(axes)
    dp_axis = "dp" if any(a == "dp" for a, _ in axes) else None
    shapes = param_shapes(gm)
    return Plan(mesh=dict(axes), tp_axis=tp[0][0] if tp else None, params=params, nodes=nodes, predicted=predicted,
                model=name, dp_axis=dp_axis, zero_stage=zero_stage if dp_axis or dict(axes).get("cp", 1) > 1 else 0,
                bucket_bytes=bucket_bytes,
                overlap=overlap, mixed_precision=mixed_precision, shapes=shapes,
                fingerprint=Plan.fingerprint_of(shapes))


def param_shapes(gm: fx.GraphModule) -> dict[str, list[int]]:
    return {info(n).target_fqn: [int(d) for d in info(n).values[0].shape] for n in gm.graph.nodes
            if n.op == "placeholder" and info(n).kind == "param" and info(n).values}


def with_memory(gm: fx.GraphModule, the_plan: Plan, cluster: Cluster, memory_budget: float | None, *,
                 choose_stage: bool) -> Plan:
    """Fill in the predicted per-device memory split (and choose the ZeRO stage if asked)."""
    from dataclasses import replace

    from autopar.cost.dp_planner import memory_split

    trainable, frozen, buffers = local_numels(gm, the_plan)
    budget = memory_budget or cluster.device.memory_bytes

    def split(stage: int):
        return memory_split(trainable_numel=trainable, frozen_numel=frozen, dp=the_plan.dp, zero_stage=stage,
                            mixed_precision=the_plan.mixed_precision, buffer_bytes=buffers,
                            param_bytes=param_bytes(gm))
    stage = the_plan.zero_stage
    if choose_stage and the_plan.dp > 1:
        stage = next((k for k in range(4) if split(k).total <= budget), 3)
    mem = split(stage)
    predicted = {**the_plan.predicted, "memory_bytes": mem.as_dict()}
    return replace(the_plan, zero_stage=stage, predicted=predicted)


def planned_graph(model: nn.Module, mesh: Any, example_inputs: Any = (), *,
                  example_kwargs: Mapping[str, Any] | None = None, dims: Any = None, plan: Plan | None = None,
                  hardware: str | None = None, memory_budget: float | None = None,
                  sizes: Mapping[str, int] | None = None, rewrite: bool = False, after: str | None = None,
                  group_name: str = "tp", zero_stage: int | None = None, overlap: bool = True,
                  bucket_bytes: int = 0, mixed_precision: str | None = None,
                  pinned: Any = None, placements: Mapping[str, str] | None = None,
                  modes: bool = False, sequence_parallel: bool | None = None,
                  nodes: tuple[int, int] | None = None) -> tuple[fx.GraphModule, Plan]:
    """Capture, plan (or take ``plan``) and annotate every node with its placement; ``after``
    = ``"rewrite"`` (or ``rewrite=True``) also produces the per-rank graph and ``"schedule"``
    additionally inserts the data-axis collectives and schedules them (what ``autopar dump
    --after`` shows). ``nodes``: ``(node count, ranks per node)`` of the ranks, so the tensor
    axis is priced on the links its groups really use (default: all on one node)."""
    after = after or ("rewrite" if rewrite else "plan")
    axes = dense_axes(mesh)
    gm = capture_model(model, example_inputs, dims, example_kwargs, modes=modes, tp=dict(axes).get("tp", 1))
    start = time.perf_counter()
    solve_kw = dict(hardware=hardware, memory_budget=memory_budget, sizes=sizes, dtype=None, pinned=pinned,
                    placements=placements, sequence_parallel=sequence_parallel)
    sol, cluster = solve_tensor_axis(gm, axes if plan is None else (), nodes=nodes, **solve_kw)
    if plan is None:
        the_plan = plan_of(gm, sol, axes, type(model).__name__, zero_stage=zero_stage or 0, overlap=overlap,
                            bucket_bytes=bucket_bytes, mixed_precision=mixed_precision)
        if nodes is not None and tp_spans_nodes(axes, nodes):     # what the tensor axis would cost inside a node
            inside, _ = solve_tensor_axis(gm, axes, nodes=None, **solve_kw)
            the_plan = replace(the_plan, predicted={**the_plan.predicted, "comm_s_one_node": inside.comm_s,
                                                    "step_time_s_one_node": inside.time_s})
        the_plan = with_memory(gm, the_plan, cluster, memory_budget, choose_stage=zero_stage is None)
    else:
        the_plan = plan
        cluster = Cluster.from_spec(f"1x{math.prod(n for _, n in axes)}", hardware=hardware or "cpu")
    strategies = checked_strategies(gm, the_plan)
    setup_stage("plan", time.perf_counter() - start)
    if after == "plan":
        for node in gm.graph.nodes:
            s = strategies.get(node.name)
            if s is not None:
                why = replication_reason(node) if s.name == "replicate" else None
                info(node).strategy = str(s) + (f"  (replicated: {why})" if why else "")
                info(node).placement = ",".join(str(x) for x in s.outputs)
        return gm, the_plan
    tensor_rewrite(gm, the_plan, strategies, cluster, sizes, group_name)
    if after == "schedule":
        data_rewrite(gm, the_plan, cluster, rid=-1, trainable=None)
    return gm, the_plan


def tensor_rewrite(gm: fx.GraphModule, the_plan: Plan, strategies: dict, cluster: Cluster,
             sizes: Mapping[str, int] | None, group_name: str) -> None:
    axes = tuple(the_plan.mesh.items())
    plan_sizes = {**graph_info(gm).example_sizes, **dict(sizes or {})}
    axis = the_plan.tp_axis or "tp"
    tp_rewrite(gm, strategies, n=the_plan.tp, axis=axis, group_name=group_name, sizes=plan_sizes,
               comm_time=lambda kind, nbytes: collective_time(kind, nbytes, cluster, axes, axis))


def data_rewrite(gm: fx.GraphModule, the_plan: Plan, cluster: Cluster, *, rid: int,
                 trainable: Mapping[str, bool] | None, axis: str | None = None, n: int | None = None,
                 include: Callable[[str], bool] | None = None, scheduled: bool = True,
                 stored: Mapping[str, tuple[int, ...]] | None = None
                 ) -> list[tuple[list[str], list[tuple[int, ...]], list[bool]]]:
    """Bucket the parameters, insert the data-axis nodes and (``scheduled``) schedule them.
    Returns the buckets as (state_dict keys, tensor-axis-local shapes, trainable flags). The
    axis is the plan's data axis unless ``axis``/``n`` name another (with experts: the dense
    parameters on ``dp x ep``, the experts on ``dp``), ``include`` limits the parameters and
    ``stored`` gives the shapes of parameters a rank holds other than the graph says (this
    rank's experts' rows)."""
    from autopar.cost.dp_planner import bucket_bytes as default_bucket_bytes
    from autopar.passes.dp_rewrite import bucket_params, dp_rewrite, param_placeholders, schedule

    axis = axis or the_plan.dp_axis
    n = n or the_plan.dp
    if axis is None or n == 1:
        return []
    axes = tuple(the_plan.mesh.items())
    priced = axis if axis in the_plan.mesh else the_plan.dp_axis or next(iter(the_plan.mesh))
    phs = param_placeholders(gm)
    shapes = {f: tuple((stored or {}).get(f) or local_shape(info(n).values[0].shape, the_plan.params.get(f, "R"),
                                                            the_plan.tp))
              for f, n in phs.items()}
    nbytes = {f: math.prod(shape) * info(phs[f]).values[0].dtype.itemsize for f, shape in shapes.items()}
    grad = dict(trainable) if trainable is not None else {f: info(n).requires_grad for f, n in phs.items()}
    mine = include or (lambda f: True)
    stage = the_plan.zero_stage
    reduced = sum(b for f, b in nbytes.items() if mine(f) and (grad.get(f, False) or stage == 3))
    size = the_plan.bucket_bytes or default_bucket_bytes(cluster, axes, priced, reduced)
    buckets = bucket_params(gm, nbytes=nbytes, bucket_bytes=size,
                            include=lambda f: mine(f) and (stage == 3 or grad.get(f, False)))
    dp_rewrite(gm, rid=rid, stage=stage, buckets=buckets, axis=axis, n=n, nbytes=nbytes,
               comm_time=lambda kind, b: collective_time(kind, b, cluster, axes, priced))
    if scheduled:
        schedule(gm, overlap=the_plan.overlap)
    return [(fqns, [shapes[f] for f in fqns], [grad.get(f, False) for f in fqns]) for fqns in buckets]


def checked_strategies(gm: fx.GraphModule, plan: Plan) -> dict:
    names = {n.name for n in gm.graph.nodes}
    missing = sorted(set(plan.nodes) - names)
    if missing:
        raise PlanFileError("the plan names graph nodes this model does not have", where="plan",
                            expected="a plan made for this model", got=f"unknown nodes {missing[:5]}",
                            fix="re-plan for this model with autopar.plan(model, mesh, example_inputs)")
    fqns = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder"}
    unknown = sorted(set(plan.params) - fqns)
    if unknown:
        raise PlanFileError("the plan names parameters this model does not have", where="plan",
                            expected="a plan made for this model", got=str(unknown[:5]), fix="re-plan for this model")
    check_plan_placements(gm, plan)
    return plan.strategies()


def model_tensors(model: nn.Module, *, sync: bool) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by ``state_dict`` key; with ``sync``, every rank
    takes rank 0's values first (so ranks that built the model apart agree). Only the tensors
    whose checksums differ from rank 0's on some rank are broadcast
    (:func:`autopar.runtime.agreement.differing`): ranks that seeded alike send nothing."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    if sync and dist.get_world_size() > 1:
        from autopar.runtime.agreement import differing
        values = list(tensors.values())
        with torch.no_grad():
            apart = differing(values)
            for i in apart:
                dist.broadcast(values[i].data, src=0)
        if apart:
            log.info("took rank 0's values for %d of %d parameters and buffers", len(apart), len(values))
    return tensors


def device_mesh(mesh: Any, axes: tuple[tuple[str, int], ...]):
    """``mesh`` as a DeviceMesh over the whole process group (made from ``axes`` when it is a
    mapping or an int), after checking that the axes cover every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    world = math.prod(n for _, n in axes)
    if world != dist.get_world_size():
        raise MeshError("the mesh does not cover the process group", where="parallelize",
                        expected=f"{world} ranks ({dict(axes)})", got=f"world size {dist.get_world_size()}",
                        fix="launch as many ranks as the mesh has devices, or pass a mesh of that size")
    if hasattr(mesh, "get_group"):
        return mesh
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, tuple(n for _, n in axes), mesh_dim_names=tuple(a for a, _ in axes))


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)


def input_dims(model: nn.Module, example_inputs: Any, dims: Any,
               kwargs: Mapping[str, Any] | None = None) -> dict[str, tuple[int, int]]:
    """Named size -> (user input index in call order, dim) of its first appearance."""
    from autopar.passes.capture import flat_labels
    args = as_args(example_inputs)
    kwargs = dict(kwargs or {})
    labels = flat_labels(model, args, kwargs, dims if dims is not None else default_dims(args, kwargs))
    out: dict[str, tuple[int, int]] = {}
    for i, d in enumerate(labels):
        for dim, name in d.items():
            out.setdefault(name, (i, dim))
    return out

