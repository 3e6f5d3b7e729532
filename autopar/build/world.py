"""The mesh and weights steps: where this rank stands, and that every rank starts from the same
weights.

The mesh step reads the axes (:mod:`autopar.core.mesh`: dp/tp without a pipeline or experts, pp
first with a pipeline, dp/ep/tp with experts), checks them against a plan being applied and takes
the plan's settings, and makes the DeviceMesh over the whole process group. The weights step has
every rank take rank 0's parameters and buffers (only the tensors whose checksums differ travel).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from autopar.build.prepare import device_mesh, model_tensors
from autopar.build.state import BuildState
from autopar.runtime.nodes import node_of_ranks, regular_layout, spanning_groups
from autopar.core.errors import ConfigError, MeshError, PlanFileError
from autopar.core.mesh import dense_axes, expert_axes, named_axes, names as mesh_names, pipeline_axes

log = logging.getLogger(__name__)


def mesh_step(s: BuildState) -> None:
    """Axes, DeviceMesh, device; a plan's settings where one is applied."""
    r = s.request
    plan = r.plan
    s.zero_stage, s.mixed_precision = r.zero_stage, r.mixed_precision
    pipe, experts = r.options.pipeline, r.options.experts
    s.schedule, s.microbatches, s.virtual_stages = pipe.schedule, pipe.microbatches, pipe.virtual_stages
    s.capacity_factor = experts.capacity_factor
    if r.pipelined:
        _need_process_group()
        s.axes = pipeline_axes(r.mesh)
        if plan is not None:
            _check_pipeline_plan(plan, s.axes)
            s.schedule, s.microbatches, s.virtual_stages = plan.schedule, plan.microbatches, plan.virtual_stages
            s.zero_stage, s.mixed_precision = plan.zero_stage, plan.mixed_precision
    elif r.expert_axis:
        _need_process_group()
        s.axes = _checked_plan_axes(plan, r.mesh, r.model) if plan is not None else expert_axes(r.mesh)
        if plan is not None:
            if s.capacity_factor is not None and s.capacity_factor != plan.capacity_factor:
                raise ConfigError("capacity_factor= differs from the plan's", where="parallelize(plan=...)",
                                  expected=repr(plan.capacity_factor), got=repr(s.capacity_factor),
                                  fix="drop capacity_factor= (the plan's is used), or re-plan with the new factor")
            s.capacity_factor, s.mixed_precision = plan.capacity_factor, plan.mixed_precision
            s.zero_stage = plan.zero_stage
    else:
        s.axes = dense_axes(r.mesh) if plan is None or not isinstance(r.mesh, int) else tuple(plan.mesh.items())
        if plan is not None and dict(s.axes) != plan.mesh:
            raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)",
                            expected=str(plan.mesh), got=str(dict(s.axes)),
                            fix="pass the mesh the plan was made for, or re-plan for this mesh")
    s.sizes = dict(s.axes)
    s.mesh = device_mesh(r.mesh, s.axes)
    s.names = list(mesh_names(s.mesh))
    nodes = node_of_ranks()
    s.node_layout = regular_layout(nodes)
    s.spans = {axis: spanning_groups(s.mesh.mesh, i, nodes) for i, axis in enumerate(s.names)
               if axis in ("tp", "ep") and s.mesh.size(i) > 1}
    if s.spans.get("ep", 1) > 1 and dist.get_rank() == 0:
        log.warning("the expert axis (ep=%d) spans %d nodes: each MoE layer's all-to-all crosses the inter-node "
                    "link; keep ep x tp within the %s ranks of a node (ep and tp inside a node, dp and pp across)",
                    s.sizes["ep"], s.spans["ep"], s.node_layout[1] if s.node_layout else "")
    s.device = torch.device(s.mesh.device_type if s.mesh.device_type != "cuda"
                            else f"cuda:{torch.cuda.current_device()}")


def weights_step(s: BuildState) -> None:
    """The model's tensors by state_dict key, every rank with rank 0's values (``sync_params``)."""
    s.tensors = model_tensors(s.request.model, sync=s.request.options.data.sync_params)
    s.trainable = {k: p.requires_grad for k, p in s.request.model.named_parameters()}


def _need_process_group() -> None:
    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")


def _check_pipeline_plan(plan, axes) -> None:
    if plan.pp_axis is None or not plan.stage_starts:
        raise ConfigError("the plan has no pipeline stages", where="parallelize(plan=...)",
                          fix="pass a plan made for a mesh with a pp axis, or leave plan out")
    if dict(axes) != plan.mesh:
        raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)",
                        expected=str(plan.mesh), got=str(dict(axes)),
                        fix="pass the mesh the plan was made for, or re-plan for this mesh")


def _checked_plan_axes(plan, mesh, model) -> tuple[tuple[str, int], ...]:
    """The mesh axes of a saved expert-parallel ``plan``, after checking that ``mesh`` names
    the same axes and sizes, that each placement in the plan is a permutation splitting
    evenly over the expert axis and that each layer it places is a module of ``model``: all
    of it without running anything, so every rank refuses a bad plan before any collective
    (:func:`autopar.build.experts.planned_placements` checks the layers against the captured
    graph later)."""
    got = dict(named_axes(mesh, "e.g. {'dp': 2, 'ep': 2}"))
    if got != plan.mesh:
        raise MeshError("the mesh does not match the plan's", where="parallelize(plan=...)", expected=str(plan.mesh),
                        got=str(got), fix="pass the mesh the plan was made for, or re-plan for this mesh")
    if plan.ep_axis != "ep":
        raise PlanFileError("the plan has no expert axis", where="parallelize(plan=...)",
                            expected="a plan from parallelize on a mesh with an ep axis",
                            got=f"ep_axis={plan.ep_axis!r}",
                            fix="pass the plan of an expert-parallel run (pm.plan), or leave plan out")
    axes = expert_axes(mesh)
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
