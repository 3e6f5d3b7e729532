"""The Python API: ``autopar.plan`` finds a plan, ``autopar.parallelize`` applies one."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.tp_solver import Solution, SolverConfig, solve
from autopar.errors import CaptureError, ConfigError
from autopar.passes.capture import capture
from autopar.passes.meta import graph_info, info
from autopar.passes.pipeline import analyze
from autopar.passes.tp_rewrite import tp_rewrite
from autopar.plans import NodeStrategy, Plan

log = logging.getLogger("autopar")
_FIXED_ROLES = ("dp", "pp", "ep")


def default_dims(example_inputs: tuple) -> tuple[dict[int, str], ...]:
    """Dim 0 of every tensor input is the batch; dim 1 of an integer (token) tensor the sequence."""
    dims = []
    for x in example_inputs:
        d: dict[int, str] = {}
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] >= 2:
            d[0] = "batch"
            if x.dim() >= 2 and not x.is_floating_point() and x.shape[1] >= 2:
                d[1] = "seq"
        dims.append(d)
    return tuple(dims)


def mesh_axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    """``[(axis name, size)]`` of a DeviceMesh, an int (one ``tp`` axis) or a ``{name: size}``."""
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        axes = (("tp", mesh),)
    elif isinstance(mesh, Mapping):
        axes = tuple((str(k), int(v)) for k, v in mesh.items())
    elif hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "size"):
        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        axes = tuple((names[i], mesh.size(i)) for i in range(mesh.ndim))
    else:
        raise ConfigError("mesh must be a DeviceMesh, an int or a {axis: size} mapping", got=type(mesh).__name__,
                          fix="pass e.g. init_device_mesh('cpu', (4,), mesh_dim_names=('tp',)) or 4")
    if len(axes) != 1 or axes[0][0] in _FIXED_ROLES or axes[0][1] < 1:
        raise ConfigError("this version parallelizes over one tensor-parallel mesh axis", where="mesh",
                          expected="a 1-d mesh whose axis is named tp (or unnamed)", got=str(axes),
                          fix="pass a 1-d mesh; data, pipeline and expert axes are not supported yet")
    return axes


def _capture(model: nn.Module, example_inputs: Any, dims: Any) -> fx.GraphModule:
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if dims is None:
        try:
            return analyze(capture(model, args, dims=default_dims(args)))
        except CaptureError as exc:
            log.info("capture with symbolic batch/seq failed (%s); capturing with fixed sizes", exc)
            return analyze(capture(model, args))
    return analyze(capture(model, args, dims=dims or None))


def _solve(gm: fx.GraphModule, axes: tuple[tuple[str, int], ...], *, hardware: str | None,
           memory_budget: float | None, sizes: Mapping[str, int] | None, dtype: str | None) -> tuple[Solution, Cluster]:
    (axis, n), = axes
    cluster = Cluster.from_spec(f"1x{n}", hardware=hardware or ("h100" if torch.cuda.is_available() else "cpu"))
    ginfo = graph_info(gm)
    plan_sizes = {**ginfo.example_sizes, **dict(sizes or {})}
    cfg = SolverConfig(n=n, cluster=cluster, mesh_axes=axes, axis=axis, sizes=plan_sizes,
                       dtype=dtype or _dtype_of(gm), memory_budget=memory_budget)
    return solve(gm, cfg), cluster


def _dtype_of(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.kind == "param" and rec.values:
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(rec.values[0].dtype, "fp32")
    return "fp32"


def _plan_of(gm: fx.GraphModule, sol: Solution, axes: tuple[tuple[str, int], ...], name: str) -> Plan:
    params = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and info(node).kind in ("param", "buffer"):
            s = sol.strategies.get(node.name)
            params[info(node).target_fqn] = str(s.outputs[0].value) if s else "R"
    nodes = {k: NodeStrategy.of(v) for k, v in sol.strategies.items()}
    predicted = {"compute_s": sol.compute_s, "comm_s": sol.comm_s, "step_time_s": sol.time_s,
                 "state_bytes_per_rank": sol.state_bytes}
    return Plan(mesh=dict(axes), tp_axis=axes[0][0], params=params, nodes=nodes, predicted=predicted, model=name)


def plan(model: nn.Module, mesh: Any, example_inputs: Any, *, dims: Any = None, hardware: str | None = None,
         memory_budget: float | None = None, sizes: Mapping[str, int] | None = None,
         dtype: str | None = None) -> Plan:
    """Find a plan for ``model`` on ``mesh`` without building anything (the model may live on
    the meta device). ``sizes`` overrides the planning sizes (e.g. ``{"batch": 8, "seq": 2048}``);
    ``memory_budget`` bounds per-rank parameter+gradient+optimizer bytes."""
    axes = mesh_axes(mesh)
    gm = _capture(model, example_inputs, dims)
    sol, _ = _solve(gm, axes, hardware=hardware, memory_budget=memory_budget, sizes=sizes, dtype=dtype)
    return _plan_of(gm, sol, axes, type(model).__name__)


def planned_graph(model: nn.Module, mesh: Any, example_inputs: Any, *, dims: Any = None, plan: Plan | None = None,
                  hardware: str | None = None, memory_budget: float | None = None,
                  sizes: Mapping[str, int] | None = None, rewrite: bool = False,
                  group_name: str = "tp") -> tuple[fx.GraphModule, Plan]:
    """Capture, plan (or take ``plan``) and annotate every node with its placement; with
    ``rewrite`` also produce the per-rank graph (what ``autopar dump --after`` shows)."""
    axes = mesh_axes(mesh)
    gm = _capture(model, example_inputs, dims)
    sol, cluster = _solve(gm, axes, hardware=hardware, memory_budget=memory_budget, sizes=sizes, dtype=None) \
        if plan is None else (None, Cluster.from_spec(f"1x{axes[0][1]}", hardware=hardware or "cpu"))
    the_plan = plan or _plan_of(gm, sol, axes, type(model).__name__)
    strategies = _checked(gm, the_plan)
    (axis, n), = axes
    ginfo = graph_info(gm)
    plan_sizes = {**ginfo.example_sizes, **dict(sizes or {})}
    if rewrite:
        tp_rewrite(gm, strategies, n=n, axis=axis, group_name=group_name, sizes=plan_sizes,
                   comm_time=lambda kind, nbytes: collective_time(kind, nbytes, cluster, axes, axis))
    else:
        for node in gm.graph.nodes:
            s = strategies.get(node.name)
            if s is not None:
                info(node).strategy = str(s)
                info(node).placement = ",".join(str(x) for x in s.outputs)
    return gm, the_plan


def _checked(gm: fx.GraphModule, plan: Plan) -> dict:
    names = {n.name for n in gm.graph.nodes}
    missing = sorted(set(plan.nodes) - names)
    if missing:
        raise ConfigError("the plan names graph nodes this model does not have", where="plan",
                          expected="a plan made for this model", got=f"unknown nodes {missing[:5]}",
                          fix="re-plan for this model with autopar.plan(model, mesh, example_inputs)")
    fqns = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder"}
    unknown = sorted(set(plan.params) - fqns)
    if unknown:
        raise ConfigError("the plan names parameters this model does not have", where="plan",
                          got=str(unknown[:5]), fix="re-plan for this model")
    return plan.strategies()


def parallelize(model: nn.Module, mesh: Any, example_inputs: Any, *, plan: Plan | str | None = None,
                dims: Any = None, hardware: str | None = None, memory_budget: float | None = None,
                sizes: Mapping[str, int] | None = None, sync_params: bool = True):
    """Split ``model`` over ``mesh`` and return this rank's :class:`ParallelModule`.

    Call on every rank after ``torch.distributed.init_process_group`` with the same model
    and example inputs. ``mesh`` is a 1-d DeviceMesh or its size; ``plan`` a Plan or a
    path to one (otherwise one is found by cost). With ``sync_params`` every rank first
    takes rank 0's parameters, so differently seeded ranks cannot silently disagree."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.tp_module import ParallelModule

    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")
    axes = mesh_axes(mesh)
    if not hasattr(mesh, "get_group"):
        device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (axes[0][1],), mesh_dim_names=(axes[0][0],))
    if isinstance(plan, str):
        plan = Plan.load(plan)
    group = mesh.get_group(0)
    gm, the_plan = planned_graph(model, mesh, example_inputs, dims=dims, plan=plan, hardware=hardware,
                                 memory_budget=memory_budget, sizes=sizes, rewrite=True,
                                 group_name=group.group_name)
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    if sync_params and dist.get_world_size() > 1:
        with torch.no_grad():
            for t in tensors.values():
                dist.broadcast(t.data, src=0)
    trainable = {k: p.requires_grad for k, p in model.named_parameters()}
    used = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn}
    dim_map = _dim_map(example_inputs, dims)
    return ParallelModule(gm, the_plan.params, {k: v for k, v in tensors.items() if k in used}, trainable, mesh,
                          the_plan, dim_map)


def _dim_map(example_inputs: Any, dims: Any) -> dict[str, tuple[int, int]]:
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    labels = dims if dims is not None else default_dims(args)
    out: dict[str, tuple[int, int]] = {}
    for i, d in enumerate(labels or ()):
        for dim, name in (d or {}).items():
            out.setdefault(name, (i, dim))
    return out
