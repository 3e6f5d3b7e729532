"""The tensor step: capture the whole model (one micro-batch with a pipeline), solve or apply the
tensor-axis plan and rewrite the graph for this rank's share (:mod:`autopar.passes.tp_rewrite`).

Without a pipeline or experts this plans the whole dense mesh (the data axis's ZeRO stage and
memory included: :func:`autopar.build.prepare.planned_graph`); with them it plans the tensor axis
alone, keeping the experts' side whole (the expert axis owns their leading dim) — the pipeline
and experts steps complete the plan. A graph that runs under autocast loses the capture's dtype
checks.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist

from autopar.build.checks import check_fits, check_runtime_dtypes
from autopar.passes.moe import expert_side, expert_tensor_pin
from autopar.build.prepare import capture_model, planned_graph
from autopar.build.state import BuildState
from autopar.core.errors import UnsupportedError
from autopar.core.meta import graph_info
from autopar.core.plans import Plan
from autopar.passes.autocast import drop_dtype_checks

log = logging.getLogger("autopar.build")


def tensor_step(s: BuildState) -> None:
    r = s.request
    if r.pipelined or r.expert_axis:
        _tensor_axis_alone(s)
    else:
        _dense_mesh(s)
    check_cross_sample(s)


def _dense_mesh(s: BuildState) -> None:
    """No pipeline, no experts: the plan of the dp x tp mesh, found (or given) on the whole graph."""
    r, t, d = s.request, s.request.options.tensor, s.request.options.data
    tp_group = s.group("tp")[0] if "tp" in s.names else None
    s.gm, s.plan = planned_graph(r.model, s.mesh, r.args, example_kwargs=r.kwargs, dims=t.dims, plan=r.plan,
                                 hardware=r.hardware, memory_budget=r.memory_budget, sizes=t.sizes, after="rewrite",
                                 group_name=tp_group.group_name if tp_group is not None else "tp",
                                 zero_stage=r.zero_stage, overlap=d.overlap, bucket_bytes=d.bucket_bytes,
                                 mixed_precision=r.mixed_precision, placements=t.placements, modes=True,
                                 sequence_parallel=t.sequence_parallel, nodes=s.node_layout)
    _warn_tp_across_nodes(s)
    if r.plan is None:
        check_fits(s.gm, s.plan, r.memory_budget, {**graph_info(s.gm).example_sizes, **dict(t.sizes or {})})
    check_runtime_dtypes(r.model, s.gm, s.plan)
    s.placements, s.nodes = dict(s.plan.params), dict(s.plan.nodes)
    if s.plan.tp > 1 and all(p == "R" for p in s.plan.params.values()):   # tp asked for, nothing split
        log.warning("the plan splits no parameter over the tensor axis (tp=%d): every rank holds the whole "
                    "model, because %s", s.plan.tp,
                    "the plan given says so" if r.plan is not None else "placements= forces it" if t.placements else
                    "the cost model found replication cheaper (splitting would communicate more than it saves)"
                    if any(d % s.plan.tp == 0 for p in r.model.parameters() for d in p.shape) else
                    f"no parameter has a dimension divisible by {s.plan.tp}")


def _warn_tp_across_nodes(s: BuildState) -> None:
    """A tensor axis whose groups reach past one node: say so on rank 0, with what the simulator
    prices its communication at on these links and inside one node."""
    spans = s.spans.get("tp", 1)
    if spans <= 1 or dist.get_rank() != 0:
        return
    p = getattr(s.plan, "predicted", None) or {}
    cost = ""
    if "comm_s_one_node" in p:
        here, inside = p["comm_s"], p["comm_s_one_node"]
        cost = (f": the simulator prices its tensor-axis communication at {here * 1e3:.3g} ms per step on "
                f"these links (step {p['step_time_s'] * 1e3:.3g} ms), against {inside * 1e3:.3g} ms "
                f"(step {p['step_time_s_one_node'] * 1e3:.3g} ms) with every group inside one node" + (
                    "" if here > inside else " (this hardware profile's inter-node link is priced like its "
                    "intra-node one; on GPU clusters the inter-node link is several times slower)"))
    per = s.node_layout[1] if s.node_layout else None
    log.warning("tp=%d spans %d nodes (a tensor-parallel group's ranks sit on different nodes)%s. Keep tp within "
                "a node and put the other ranks on dp or pp%s", s.sizes["tp"], spans, cost,
                f", e.g. {{'dp': {s.sizes.get('dp', 1) * s.sizes['tp'] // per}, 'tp': {per}}}" if per and
                s.sizes["tp"] % per == 0 and set(s.sizes) <= {"dp", "tp"} else "")


def _tensor_axis_alone(s: BuildState) -> None:
    """With a pipeline or experts: the tensor axis's plan on the whole graph, experts pinned whole."""
    r = s.request
    # beside an expert axis the fixed-capacity experts may be split off their expert dim (expert
    # tensor parallelism); inside a pipeline, and with no expert axis, the experts' side stays whole
    pinned = expert_tensor_pin if s.ep > 1 and not r.pipelined else expert_side if (s.ep > 1 or not r.pipelined) \
        else None
    if s.tp > 1:
        given = None if r.plan is None else _tensor_part(r.plan, s.tp)
        s.gm, tp_plan = planned_graph(r.model, {"tp": s.tp}, s.capture_args, example_kwargs=s.capture_kwargs,
                                      dims=s.capture_dims, after="rewrite", hardware=r.hardware,
                                      group_name=s.group("tp")[0].group_name, memory_budget=r.memory_budget,
                                      plan=given, pinned=pinned, modes=True)
        s.placements, s.nodes = dict(tp_plan.params), dict(tp_plan.nodes)
        _warn_tp_across_nodes(s)
    else:
        s.gm = capture_model(r.model, s.capture_args, s.capture_dims, s.capture_kwargs, modes=True)
        # a pipeline stores what the plan does not name whole; the expert build names every tensor
        s.placements = {} if r.pipelined else {k: "R" for k in _tensor_keys(r.model)}
        s.nodes = {}
    if s.mixed_precision and not r.pipelined:
        drop_dtype_checks(s.gm)      # the graph runs under autocast (the tensor rewrite drops them too)


def check_cross_sample(s: BuildState) -> None:
    """A model whose ops pair samples of the batch (``passes/batch_coupling.py``) computes other
    values on a split batch: refused when the batch is split into pieces (data ranks, expert
    ranks, micro-batches), unless ``DataOptions(cross_sample="local")`` accepts that each piece
    pairs only its own rows."""
    from autopar.passes.batch_coupling import batch_coupling

    dp = max(s.sizes.get("dp", 1), s.plan.dp if s.plan is not None else 1)
    pieces = dp * s.ep * ((s.microbatches or 1) if s.request.pipelined else 1)
    if pieces == 1 or s.request.options.data.cross_sample == "local":
        return
    found = batch_coupling(s.gm)
    if not found:
        return
    where = sorted({p.fqn or "<root>" for p in found})
    raise UnsupportedError(
        f"the model pairs samples of the batch with each other ({found[0].why}); split into {pieces} pieces "
        "(data ranks x expert ranks x micro-batches), each piece would pair only its own rows, which one "
        "process on the whole batch does not do (a contrastive loss's similarity matrix, a softmax across samples)",
        where=", ".join(where[:4]) + (" ..." if len(where) > 4 else ""),
        got="; ".join(str(p) for p in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else ""),
        fix="accept pairs within each piece with options=DataOptions(cross_sample='local') (what per-device "
            "contrastive training does), or train on a mesh that does not split the batch (tp only, one "
            "micro-batch)")


def _tensor_part(plan: Plan, tp: int) -> Plan:
    """A plan's tensor axis alone (what the tensor rewrite applies; the other steps read the rest)."""
    return replace(plan, mesh={"tp": tp}, dp_axis=None, pp_axis=None, ep_axis=None, stage_starts=(), schedule=None,
                   expert_placement={}, capacity_factor=None)


def _tensor_keys(model) -> list[str]:
    return [*dict(model.named_parameters()), *dict(model.named_buffers())]
