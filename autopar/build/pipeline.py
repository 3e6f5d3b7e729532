"""The pipeline axis's two steps: the schedule step picks the schedule and micro-batches (so the
tensor step captures one micro-batch), the pipeline step cuts the whole rewritten graph into
stages and makes this rank's :class:`~autopar.runtime.pp.StageModule` s. From then on the later
steps (recompute, data) work on those stages. Both do nothing without a ``pp`` axis.

Planning (cut points, schedule, micro-batches) is :mod:`autopar.cost.pp_planner`'s; the split
itself :mod:`autopar.passes.pp_split`'s; execution :mod:`autopar.runtime.pp`'s.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.build.checks import check_runtime_dtypes
from autopar.build.prepare import capture_model, torch_dtype
from autopar.build.state import BuildState
from autopar.core.errors import ConfigError, UnsupportedError
from autopar.core.meta import graph_info, info
from autopar.core.plans import Plan
from autopar.cost.pp_planner import info_symbols, node_time_fn, plan_pipeline
from autopar.core.mesh import stage_device
from autopar.passes.pp_split import OpCosts, op_costs

log = logging.getLogger("autopar.build")

DTYPE = "fp32"     # the pipeline planner prices the ops at fp32


def schedule_step(s: BuildState) -> None:
    """Schedule, micro-batches and virtual stages (given, the plan's, or the simulator's on a
    symbolic capture); the example inputs cut to one micro-batch for the capture."""
    r = s.request
    s.capture_args, s.capture_kwargs, s.capture_dims = r.args, dict(r.kwargs), r.options.tensor.dims
    if not r.pipelined:
        return
    args, kwargs = r.args, {k: v for k, v in r.kwargs.items() if v is not None}
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ConfigError("a pipeline needs a batched tensor input to split into micro-batches", where="parallelize",
                          fix="pass the batch's tensors (dim 0 the batch) in example_inputs / example_kwargs")
    batch = int(first.shape[0])
    cluster = s.cluster()
    if s.microbatches and s.schedule and (s.virtual_stages or s.schedule != "interleaved"):
        s.virtual_stages = s.virtual_stages or (2 if s.schedule in ("interleaved", "dualpipev") else 1)
    else:
        sym = capture_model(r.model, args, None, kwargs)
        symbols = {str(k) for k in info_symbols(sym)}

        def priced(mb: int) -> OpCosts:
            at = {"batch": mb} if "batch" in symbols else {}
            if "seq" in symbols and first.dim() > 1:
                at["seq"] = int(first.shape[1])
            return op_costs(sym, node_time=node_time_fn(cluster.device, DTYPE, at), sizes=at)
        pre = plan_pipeline(priced, devices=s.sizes["pp"], batch=batch, cluster=cluster, axes=s.axes,
                            schedule=s.schedule, microbatches=s.microbatches, virtual=s.virtual_stages,
                            budget=r.memory_budget)
        s.microbatches, s.schedule, s.virtual_stages = pre.microbatches, pre.schedule, pre.virtual
    m = s.microbatches
    if batch % m:
        raise ConfigError(f"the batch of {batch} does not split into {m} micro-batches", where="parallelize",
                          expected=f"a multiple of {m}", got=str(batch), fix="pass a divisible batch")
    s.capture_args = tuple(a.chunk(m)[0] if isinstance(a, torch.Tensor) else a for a in args)
    s.capture_kwargs = {k: a.chunk(m)[0] if isinstance(a, torch.Tensor) else a for k, a in kwargs.items()}
    # fixed sizes, but for the sequence on a context axis: its rewrite follows the dim named seq
    s.capture_dims = _sequence_only(s.capture_args, s.capture_kwargs) if s.sizes.get("cp", 1) > 1 else ()


def _sequence_only(args: tuple, kwargs: dict):
    """Capture labels naming only the sequence (dim 1 of integer inputs of two dims or more)."""
    from autopar.build.prepare import default_dims
    labels = default_dims(args, kwargs)
    keep = lambda d: {i: n for i, n in d.items() if n == "seq"}     # noqa: E731
    if isinstance(labels, dict):
        return {k: keep(v) for k, v in labels.items()}
    return tuple(keep(d) for d in labels)


def pipeline_step(s: BuildState) -> None:
    """Cut the whole graph (the plan's cuts, or the planner's on this graph's priced ops), make
    the plan, and this rank's stages with their parameters."""
    from autopar.passes.autocast import autocast_dtypes
    from autopar.passes.pp_split import shared_params, split_stages
    from autopar.runtime.pp import StageModule, stage_inputs_of

    r = s.request
    if not r.pipelined:
        return
    gm, model = s.gm, r.model
    check_batch_statistics(s)
    s.own_loss = r.options.pipeline.loss_fn is None
    s.loss_fn = r.options.pipeline.loss_fn or own_loss(gm)
    if s.own_loss:     # a token-mean loss: micro-batches weighted by their real tokens (runtime/token_loss.py)
        from autopar.runtime.token_loss import counter
        users = [i for i, (kind, _) in enumerate(graph_info(gm).output_targets) if kind != "BUFFER_MUTATION"]
        at = s.loss_fn.keywords["at"]
        s.token_counter = counter(gm, users[at]) if at < len(users) else None
    # under mixed precision a value crosses between stages in its autocast dtype
    compute = torch_dtype(s.mixed_precision) if s.mixed_precision else None
    s.sent = autocast_dtypes(gm, compute, s.device.type) if compute is not None else {}
    cluster, p, tp_n = s.cluster(), s.sizes["pp"], s.tp
    at = dict(graph_info(gm).example_sizes)       # the sequence of a context axis is a named size
    costs = op_costs(gm, node_time=node_time_fn(cluster.device, DTYPE, at), tp=tp_n, wire=s.sent, sizes=at)
    final = plan_pipeline(lambda mb: costs, devices=p, batch=s.microbatches, cluster=cluster, axes=s.axes,
                          schedule=s.schedule, microbatches=s.microbatches, virtual=s.virtual_stages,
                          budget=r.memory_budget)
    starts = r.plan.stage_starts if r.plan is not None else final.cuts.start_nodes
    if len(starts) != p * s.virtual_stages:
        raise ConfigError(f"the plan has {len(starts)} stages, the mesh and schedule need {p * s.virtual_stages}",
                          where="plan.stage_starts", fix="re-plan for this mesh")
    stages = split_stages(gm, list(starts))
    dp_ep = s.sizes.get("dp", 1) * s.ep
    the_plan = Plan(mesh=dict(s.axes), tp_axis="tp" if tp_n > 1 else None,
                    params=s.placements or {k: "R" for k, _ in model.named_parameters()},
                    nodes=dict(s.nodes), predicted=final.as_dict(),
                    model=type(model).__name__, dp_axis="dp" if "dp" in s.sizes else None, pp_axis="pp",
                    ep_axis="ep" if s.ep > 1 else None,
                    zero_stage=(s.zero_stage or 0) if dp_ep > 1 else 0,
                    stage_starts=tuple(starts), schedule=s.schedule, microbatches=s.microbatches,
                    virtual_stages=s.virtual_stages, mixed_precision=s.mixed_precision,
                    shapes={k: list(q.shape) for k, q in model.named_parameters()})
    s.plan = replace(the_plan, fingerprint=Plan.fingerprint_of(the_plan.shapes))
    check_runtime_dtypes(model, gm, s.plan)
    shared = shared_params(stages)

    # this rank's stages
    _, pp_rank = s.group("pp")
    tp_rank = s.group("tp")[1] if "tp" in s.names else 0
    inputs = stage_inputs_of(gm)
    examples = (*s.capture_args, *s.capture_kwargs.values())
    if len(examples) == len(inputs):       # non-tensor inputs (flags) are fixed in the graph: held back
        s.constant_inputs = {i: v for i, v in enumerate(examples) if not isinstance(v, torch.Tensor)}
    constants = {inputs[i]: v for i, v in s.constant_inputs.items()}
    inputs = [n for i, n in enumerate(inputs) if i not in s.constant_inputs]
    made: dict[str, nn.Parameter] = {}
    placement = "v" if s.schedule == "dualpipev" else "loop"
    for sg in stages:
        if stage_device(sg.index, p, placement) != pp_rank:
            continue
        st = StageModule(sg, s.tensors, s.trainable, s.placements, tp_rank, tp_n,
                         input_names=inputs if sg.index == 0 else (), shared=made,
                         constants=constants if sg.index == 0 else None)
        st.is_last = sg.index == len(stages) - 1
        made.update({k: v for k, v in st.named_parameters(remove_duplicate=False)})
        s.stages.append(st)
    s.stage_graphs, s.pipeline_plan = stages, final
    s.shared_groups = shared_groups(s.mesh, s.names, shared, p, placement)


BATCH_STATISTICS = {torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit_functional.default,
                    torch.ops.aten.native_batch_norm.default}


def check_batch_statistics(s: BuildState) -> None:
    """A training-mode BatchNorm in a pipeline would normalise each micro-batch, on each data
    rank, by that piece's own statistics: refused unless ``PipelineOptions(batchnorm="microbatch")``
    accepts it, or the batch is not split (one micro-batch, no data axis)."""
    pieces = s.microbatches * s.sizes.get("dp", 1) * s.ep
    if pieces == 1 or s.request.options.pipeline.batchnorm == "microbatch":
        return
    norms = [n for n in s.gm.graph.nodes if n.op == "call_function" and n.target in BATCH_STATISTICS]
    if norms:
        where = sorted({info(n).fqn or "<root>" for n in norms})
        raise UnsupportedError(f"BatchNorm in a pipeline: each of the {pieces} pieces of the batch (micro-batches x "
                               "data ranks) would be normalised by its own statistics in training, which one process "
                               "on the whole batch does not do", where=", ".join(where[:4]) + (" ..." if len(where) > 4 else ""),
                               got=f"{len(norms)} batch-norm op(s), {s.microbatches} micro-batches, "
                                   f"dp x ep = {s.sizes.get('dp', 1) * s.ep}",
                               fix="accept micro-batch statistics with options=PipelineOptions(batchnorm='microbatch'), "
                                   "or run one micro-batch with no data axis (microbatches=1), or train without a "
                                   "pp axis (the data axis syncs BatchNorm over the whole batch)")


def shared_groups(mesh, names: list[str], shared: Mapping[str, list[int]], p: int,
                  placement: str = "loop") -> dict[str, Any]:
    """For each parameter several stages hold: the process group of the pipeline ranks holding
    it at this rank's place on the other axes (only where this rank is one of them and they are
    more than one). Every rank creates every group, in the same order."""
    me = dist.get_rank()
    grid = mesh.mesh.reshape(p, -1)            # pp x (the other axes, flattened)
    out: dict[str, Any] = {}
    made: dict[tuple[int, ...], Any] = {}
    for fqn in sorted(shared):
        holders = tuple(sorted({stage_device(s, p, placement) for s in shared[fqn]}))
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
    spec = graph_info(gm).out_spec
    keys = list(spec.context) if spec is not None and isinstance(spec.context, (list, tuple)) else []
    if "loss" not in keys:
        raise ConfigError("a pipelined model needs a loss function", where="parallelize",
                          fix="pass options=PipelineOptions(loss_fn=lambda output, target: ...) (it runs on the last "
                              "stage), or give a transformers model its labels so it returns its own loss")
    at = keys.index("loss")
    return functools.partial(_pick, at=at)


def _pick(output: Any, target: Any, *, at: int) -> torch.Tensor:
    loss = output[at] if isinstance(output, (tuple, list)) else output
    return loss.reshape(())          # the last stage hands its scalars over as [1] (runtime/pp.py)
