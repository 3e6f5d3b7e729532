"""The data step: every parameter's gradient averaged over the ranks that computed it on other
rows of the batch, at the plan's ZeRO stage, and mixed precision's fp32 masters.

- One graph (no pipeline): the data axes become nodes of the graph (:mod:`autopar.passes.dp_rewrite`,
  run by :class:`~autopar.runtime.dp.DPRuntime`) — the dense parameters over ``dp x ep``, the
  experts over ``dp`` (their owner already received every ep rank's rows through the exchange);
  the overlap step then schedules those nodes. Training-mode BatchNorm takes its statistics over
  the dense data axis (:mod:`autopar.runtime.sync_bn`).
- Stages (a pipeline): the same split of the parameters, each data axis working per step
  between the stages' passes (:mod:`autopar.runtime.stage_dp`); under mixed precision each
  micro-batch's gradients accumulate in fp32 (:mod:`autopar.runtime.main_grads`) and the stages
  then hold 16-bit parameters (after the data axes, so ZeRO-3 cuts its fp32 pieces, the masters,
  from the fp32 values).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.distributed as dist

from autopar.build.prepare import data_rewrite, master_dtype, torch_dtype
from autopar.build.state import BuildState
from autopar.core.dp_mode import DataMode
from autopar.core.errors import ConfigError
from autopar.passes.autocast import drop_dtype_checks
from autopar.runtime.sync_bn import sync_batch_norms


def data_step(s: BuildState) -> None:
    if s.request.pipelined:
        _stage_data_axes(s)
    elif s.request.expert_axis:
        _graph_data_axes(s)
    else:
        _dense_data_axis(s)


def _dense_data_axis(s: BuildState) -> None:
    """dp (x tp): one data axis of in-graph buckets (or, with mixed precision and no data axis,
    a one-rank runtime holding the fp32 masters)."""
    from autopar.runtime.dp import DPRuntime

    plan, mode = s.plan, s.request.dp_mode
    master = master_dtype(s.gm)
    compute = torch_dtype(plan.mixed_precision) if plan.mixed_precision else master
    rt = None
    # the ranks that computed each gradient on other tokens: dp (rows of the batch) x cp (positions)
    axes = [a for a in ("dp", "cp") if a in s.names and s.sizes.get(a, 1) > 1]
    if axes:
        group, n, rank = axes_group(s.mesh, s.names, axes)
        g = checked_shard_group(s.request.options.data.shard_group, n, plan.zero_stage, mode)
        if g < n:          # hybrid sharding: pieces over groups of g, replicated across the groups
            shard, replica = hybrid_groups(s.mesh, s.names, axes, g)
            rt = DPRuntime(stage=plan.zero_stage, n=g, rank=rank % g, group_name=shard.group_name, device=s.device,
                           master_dtype=master, compute_dtype=compute, prefetch=plan.overlap, replicas=n // g,
                           replica_group=replica.group_name, data_group=group.group_name)
        else:
            rt = DPRuntime(stage=plan.zero_stage, n=n, rank=rank, group_name=group.group_name, device=s.device,
                           master_dtype=master, compute_dtype=compute, prefetch=plan.overlap)
        for fqns, shapes, flags in data_rewrite(s.gm, plan, s.cluster(), rid=rt.id, trainable=s.trainable,
                                                axis="x".join(axes), n=rt.n, scheduled=False):
            rt.add_bucket(fqns, shapes, flags)
        s.data_nodes = True
        sync_batch_norms(s.gm, rt.data_group)     # training statistics over the global batch
        attach_mode(rt, mode)
    elif compute != master:   # mixed precision without a data axis: fp32 masters, nothing to reduce
        rt = DPRuntime(stage=0, n=1, rank=0, group_name="", device=s.device, master_dtype=master,
                       compute_dtype=compute)
    if rt is None or rt.n == 1:
        unused_mode(mode, plan.dp * plan.cp)
    s.plan = replace(plan, dp_mode=mode.to_dict() if rt is not None and rt.modes is not None else {})
    s.data = [rt] if rt is not None else []


def _graph_data_axes(s: BuildState) -> None:
    """With experts: in-graph buckets of the dense parameters over dp x cp x ep and of this rank's
    experts over dp x cp (``experts`` maps each expert parameter to the shape this rank stores)."""
    from autopar.runtime.dp import DPRuntime

    plan, gm = s.plan, s.gm
    experts = {f: tuple(s.tensors[f].shape) for f in s.experts}
    params = [f for f in s.trainable]
    sizes = dict(plan.mesh)
    ep = sizes.get("ep", 1)
    out = []
    for axes, keep, extra in ((("dp", "cp", "ep"), lambda f: f not in experts, 1),
                              (("dp", "cp"), lambda f: f in experts, ep)):
        group, n, rank = axes_group(s.mesh, s.names, [a for a in axes if sizes.get(a, 1) > 1])
        if n == 1 or not any(keep(f) for f in params):
            continue
        rt = DPRuntime(stage=plan.zero_stage, n=n, rank=rank, group_name=group.group_name, device=s.device,
                       master_dtype=master_dtype(gm), prefetch=plan.overlap, divisor=n * extra,
                       compute_dtype=torch_dtype(plan.mixed_precision) if plan.mixed_precision else None)
        for fqns, shapes, flags in data_rewrite(gm, plan, s.cluster(), rid=rt.id, trainable=s.trainable,
                                                axis="x".join(a for a in axes if sizes.get(a, 1) > 1), n=n,
                                                include=keep, scheduled=False, stored=experts):
            rt.add_bucket(fqns, shapes, flags)
        if not out:
            sync_batch_norms(gm, rt.group_name)   # every rank of dp x ep has its own rows
        out.append(rt)
    s.data, s.data_nodes = out, True


def _stage_data_axes(s: BuildState) -> None:
    """A pipeline's data axes over this rank's stages, then mixed precision's fp32 accumulators
    and 16-bit stage parameters."""
    from autopar.runtime.main_grads import MainGrads

    mode = s.request.dp_mode
    compute = torch_dtype(s.mixed_precision) if s.mixed_precision else None
    s.grads = MainGrads(1 / s.microbatches) if compute is not None else None
    s.data = data_axes(s.stages, s.mesh, s.names, s.sizes, s.zero_stage or 0, set(s.experts), s.shared_groups,
                       s.device, compute_dtype=compute, grads=s.grads)
    for axis in s.data:
        attach_mode(axis.rt, mode)
    if not s.data:
        unused_mode(mode, s.sizes.get("dp", 1))
    for st in s.stages if compute is not None else ():
        drop_dtype_checks(st.graph_module)     # they pin the captured fp32 dtypes
        s.master_init.update(st.to_compute_dtype(compute, s.device.type, s.sent))
    if any(axis.rt.modes is not None for axis in s.data):
        s.plan = replace(s.plan, dp_mode=mode.to_dict())


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
    if experts and sizes.get("dp", 1) * sizes.get("cp", 1) == 1:   # no data axis for the experts: divide there
        if grads is not None:                  # mixed precision: in fp32, as they are accumulated
            grads.divide(experts, ep)
        else:
            average_over_senders([q for _, ps in named for f, q in ps.items() if f in experts], ep)
    out = []
    for axes, keep, extra in ((("dp", "cp", "ep"), lambda f: f not in experts, 1),
                              (("dp", "cp"), lambda f: f in experts, ep)):
        group, n, rank = axes_group(mesh, names, [a for a in axes if sizes.get(a, 1) > 1])
        if n == 1:
            continue
        parts = [(i, {f: q for f, q in ps.items() if keep(f)}) for i, ps in named]
        out.append(StageDataAxis(parts, zero_stage=zero_stage, n=n, rank=rank, group_name=group.group_name,
                                 device=device, shared=shared, divisor=n * extra, compute_dtype=compute_dtype,
                                 grads=grads))
    return out


def checked_shard_group(g: int, n: int, zero_stage: int, mode: DataMode) -> int:
    """The ZeRO shard group size for a data axis of ``n`` ranks: ``g`` (hybrid sharding), or ``n``
    when ``g`` is 0 or ``n``. Refused where it would mean nothing or could not be exact."""
    if g in (0, n):
        return n
    where = "DataOptions(shard_group=...)"
    if n % g or g < 1:
        raise ConfigError(f"shard_group={g} does not divide the data axis of {n} ranks", where=where,
                          got=str(g), fix=f"pick a divisor of {n} (0: shard over the whole data axis)")
    if zero_stage not in (2, 3):
        raise ConfigError("hybrid sharding splits ZeRO-2/3 pieces over a group; this plan has "
                          f"ZeRO-{zero_stage}", where=where, got=f"zero_stage={zero_stage}",
                          fix="pass zero_stage=3 (or 2), or drop shard_group")
    if mode.kind != "allreduce":
        raise ConfigError(f"hybrid sharding reduces by all-reduce; the data axis mode is {mode.kind!r}",
                          where=where, fix="drop shard_group or dp_mode")
    return g


def hybrid_groups(mesh, names: list[str], axes: list[str], g: int) -> tuple[Any, Any]:
    """This rank's (shard group, replica group) under hybrid sharding: every data-axis row of the
    mesh (the ranks of ``axes`` at one place on the others, in axis order) is cut into groups of
    ``g`` consecutive ranks (the shard groups) and ranks at the same place in those groups form
    the replica groups. Every rank creates every group, in one order."""
    dims = [names.index(a) for a in axes]
    rest = [d for d in range(len(names)) if d not in dims]
    grid = mesh.mesh.permute(*rest, *dims).reshape(-1, math.prod(mesh.size(d) for d in dims))
    me, shard, replica = dist.get_rank(), None, None
    for row in grid.tolist():
        for lo in range(0, len(row), g):
            grp = dist.new_group(row[lo:lo + g])
            shard = grp if me in row[lo:lo + g] else shard
        for at in range(g):
            members = row[at::g]
            grp = dist.new_group(members)
            replica = grp if me in members else replica
    return shard, replica


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
