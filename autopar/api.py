"""The Python API, a thin front door: ``autopar.plan`` finds a plan, ``autopar.parallelize``
applies one (checking the call, then handing it to the build for the mesh's axes in
``autopar/build/``: one step list for every mesh), ``autopar.optimizer`` steps the result."""
from __future__ import annotations

import logging
import os
import dataclasses
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.agreement import check_agreement
from autopar.build import BuildRequest, build
from autopar.build.checks import check_devices, check_fits, memory_bytes
from autopar.runtime.compiled import backend_of, check_compile
from autopar.runtime.optim import refuse_replaced_parameters
from autopar.core.dp_mode import DataMode, check_composes, data_mode
from autopar.core.errors import ConfigError, InputMismatchError, OptimizerError
from autopar.core.meta import graph_info
from autopar.passes.meta import paused_gc
from autopar.core.plans import Plan, recompute_layers
from autopar.core.mesh import dense_axes, has_axis
from autopar.core.options import AxisOptions, collect
from autopar.build.prepare import (as_args, capture_model, plan_of, solve_tensor_axis,
                             with_memory)
from autopar.scaled_plan import is_saved_plan_file, merge_options, scale_plan

log = logging.getLogger("autopar")


def plan(model: nn.Module, mesh: Any, example_inputs: Any = (), *, example_kwargs: Mapping[str, Any] | None = None,
         dims: Any = None, hardware: str | None = None,
         memory_budget: float | str | None = None, sizes: Mapping[str, int] | None = None,
         dtype: str | None = None, zero_stage: int | None = None, overlap: bool = True,
         mixed_precision: str | None = None, bucket_bytes: int = 0,
         placements: Mapping[str, str] | None = None, sequence_parallel: bool | None = None) -> Plan:
    """Find a plan for ``model`` on ``mesh`` without building anything (the model may live on
    the meta device). ``sizes`` overrides the planning sizes (e.g. ``{"batch": 8, "seq": 2048}``);
    ``memory_budget`` bounds per-device bytes (a number of bytes, or a size: ``"40GB"``, ``"40 GiB"``;
    :class:`DoesNotFitError`, with the smallest
    device count that would fit, when nothing meets it); ``zero_stage=None`` lets the planner
    choose the ZeRO stage on a data axis (the lowest one that fits the budget);
    ``placements`` forces how parameters are stored on the tensor axis, e.g.
    ``{"fc1.weight": "S(0)", "fc2.weight": "R"}`` (:class:`ShardingError` if a split dim does
    not divide by the axis). ``sequence_parallel`` decides whether activations between the
    tensor-parallel regions are split along the sequence (Megatron's sequence parallelism):
    ``None`` lets the cost model choose per value, ``False`` keeps every activation whole along
    its sequence dim (fewer, larger collectives: one all-reduce where a split needs an
    all-gather and a reduce-scatter), ``True`` leaves no activation with a sequence dim whole
    on every rank. The sequence dim is the one named ``"seq"`` in ``dims``."""
    memory_budget = memory_bytes(memory_budget)
    axes = dense_axes(mesh)
    gm = capture_model(model, example_inputs, dims, example_kwargs)
    sol, cluster = solve_tensor_axis(gm, axes, hardware=hardware, memory_budget=memory_budget, sizes=sizes, dtype=dtype,
                          placements=placements, sequence_parallel=sequence_parallel)
    the_plan = plan_of(gm, sol, axes, type(model).__name__, zero_stage=zero_stage or 0, overlap=overlap,
                        mixed_precision=mixed_precision, bucket_bytes=bucket_bytes)
    the_plan = with_memory(gm, the_plan, cluster, memory_budget, choose_stage=zero_stage is None)
    check_fits(gm, the_plan, memory_budget, {**graph_info(gm).example_sizes, **dict(sizes or {})})
    return the_plan


def _records_model(fn):
    """Let the parallel module remember the original model's whole shapes and tied names
    (what checkpoints are keyed by, whatever the plan), and have a torch optimizer refuse to
    step the original model's parameters the parallel module does not use
    (:func:`autopar.runtime.optim.refuse_replaced_parameters`). Set-up runs without cyclic garbage
    collection: the graphs, records and modules it makes all live on, so scanning them again and
    again is wasted (on a 32-layer GPT the collections took 50 ms of 0.5 s; the one after set-up
    takes 20-30 ms)."""
    import functools

    @functools.wraps(fn)
    def wrapped(model: nn.Module, *args: Any, **kwargs: Any):
        if not isinstance(model, nn.Module):
            return fn(model, *args, **kwargs)      # refused inside, with an InputMismatchError
        shapes = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.Tensor)}
        first: dict[int, str] = {}
        aliases = {name: first.setdefault(id(p), name)
                   for name, p in model.named_parameters(remove_duplicate=False)}
        with paused_gc():
            pm = fn(model, *args, **kwargs)
        refuse_replaced_parameters(model, (pm, *getattr(pm, "stages", ())))
        pm.global_shapes, pm.param_aliases = shapes, aliases
        if hasattr(pm, "whole_state"):     # a pipeline: state_dict() is the whole model's on every rank
            from autopar.checkpoint.full import every_rank_state_dict, load_whole_state_dict
            pm.whole_state = (every_rank_state_dict, load_whole_state_dict)
        config = getattr(model, "config", None)       # a transformers model: what save_pretrained writes
        pm.pretrained_source = ((config, getattr(model, "generation_config", None))
                                if hasattr(config, "save_pretrained") else None)
        for top in (pm, *getattr(pm, "stages", ())):   # the graphs run in the mode they were captured in
            for m in top.modules():
                m.training = model.training
        return pm
    return wrapped


def _accepts_old_keywords(fn):
    """Let ``parallelize`` take the keywords it took before its options were grouped by axis
    (``schedule=``, ``overlap=``, ...), each folded into its options object with one
    ``DeprecationWarning`` per call that names the new spelling. They are not part of the
    signature (``inspect.signature`` shows the grouped one)."""
    import functools
    import warnings

    from autopar.core.options import OLD_KEYWORDS, with_old_keywords

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any):
        old = {k: kwargs.pop(k) for k in list(kwargs) if k in OLD_KEYWORDS}
        if old:
            kwargs["options"], message = with_old_keywords(kwargs.get("options"), old)
            warnings.warn(message, DeprecationWarning, stacklevel=3)
        return fn(*args, **kwargs)
    return wrapped


@_records_model
@_accepts_old_keywords
def parallelize(model: nn.Module, mesh: Any = None, example_inputs: Any = (), *,
                example_kwargs: Mapping[str, Any] | None = None, plan: Plan | str | None = None,
                hardware: str | None = None, zero_stage: int | None = None, recompute: str = "none",
                mixed_precision: str | None = None, memory_budget: float | str | None = None, compile: Any = False,
                options: AxisOptions | Sequence[AxisOptions] | None = None):
    """Split ``model`` over ``mesh`` and return this rank's parallel module (built by the step
    list of :mod:`autopar.build`: a :class:`ParallelModule`, or a ``PipelineModule`` with a pp axis).

    Call on every rank after ``torch.distributed.init_process_group`` with the same model
    and example inputs (one rank's call: under data parallelism, its share of the batch):
    positional ones in ``example_inputs``, keyword ones in ``example_kwargs`` (e.g. a
    ``transformers`` batch ``{"input_ids": ..., "labels": ...}``). The parallel module is
    called the same way (``pm(**batch)``) and returns what the model returns (a
    ``ModelOutput`` whose ``loss`` backward runs on, when ``labels`` are given).
    ``mesh`` is a DeviceMesh with axes ``dp`` and/or ``tp``, a ``{"dp": 2, "tp": 2}``
    mapping, or an int (a tensor axis of that size); ``plan`` a Plan or a path to one, or the
    path of a cluster plan ``autopar plan ... --save-plan FILE`` wrote: that one is scaled to
    this process group (:func:`autopar.scaled_plan.scale_plan`: the mesh, ZeRO stage,
    recomputation, schedule, micro-batches and precision come from it, the mesh may be left
    out, and what was scaled is logged). Otherwise a plan is found by cost (priced on
    ``hardware``, default h100 with CUDA, else cpu), with ``zero_stage`` (None: the lowest that
    fits ``memory_budget``, bytes or a size such as ``"40GB"``) and ``mixed_precision``
    (``"bf16"``/``"fp16"`` compute with fp32 master weights, gradient reductions and optimizer
    state). Without a pipeline, what this rank keeps whole shares the model's storage, as under
    DDP: training the parallel module updates those parameters and buffers of ``model`` in
    place; split ones (and pipeline stages') are copies. Step it with the optimizer from
    :func:`autopar.optimizer`: a torch optimizer built on ``model.parameters()`` raises an
    :class:`~autopar.core.errors.OptimizerError` at its first ``step()``.

    ``recompute``: ``"none"`` (only an attention the model writes out eagerly re-runs in
    backward, its scores never kept), ``"selective"`` (attention cores re-run in backward),
    ``"full"`` (every layer re-run in backward; forward keeps only each layer's inputs) or
    ``"layers:K"`` (the first K layers of every pipeline stage, of the model without a pipeline,
    re-run so; the others keep their activations).
    ``compile=True`` runs each rank's rewritten graph (each pipeline stage's) through
    ``torch.compile`` with inductor (``"aot_eager"`` or ``"eager"`` name another backend): the
    tensor axis's collectives stay in the compiled graph, the data axis's run eagerly between
    compiled pieces (``runtime/compiled.py``); not with ``recompute``.

    ``options`` takes the per-axis options, one object or a list (:mod:`autopar.core.options`):

    - :class:`~autopar.TensorOptions` (``placements``, ``sequence_parallel``, ``dims``, ``sizes``)
      forces how parameters are stored on the tensor axis, whether activations are split along
      the sequence, which input dims are symbolic and the sizes the plan is priced at, as in
      :func:`plan` (dp/tp meshes);
    - :class:`~autopar.DataOptions` (``overlap``, ``bucket_bytes``, ``dp_mode``, ``sync_params``):
      bucket overlap and size; how the data axis communicates — ``"allreduce"`` (default),
      ``"local_sgd"``, ``"compressed"``, ``"gossip"`` or ``"async"``, a name, a dict with options or an
      :class:`autopar.DataMode`, with ZeRO-0 on ``dp`` and ``dp x tp`` meshes (``local_sgd`` also with a
      pipeline); and whether every rank first takes rank 0's parameters (only tensors whose
      checksums differ from rank 0's are sent);
    - :class:`~autopar.PipelineOptions` (``schedule``, ``microbatches``, ``virtual_stages``,
      ``loss_fn``): with a ``pp`` axis (axes in the order pp, dp, ep, tp: ``{"pp": 2}``,
      ``{"pp": 2, "dp": 2, "tp": 2}``, ``{"pp": 2, "dp": 2, "ep": 2}``) the model is cut into
      pipeline stages and a :class:`~autopar.runtime.pp.PipelineModule` comes back, trained with
      ``loss = pm.step(inputs, target=targets)``; ``loss_fn(output, target)`` runs on the last stage;
      the schedule (gpipe, 1f1b, interleaved, zb), micro-batches and virtual stages are chosen by
      the simulator unless given. Any ZeRO stage, recomputation and mixed precision compose with
      it (``runtime/stage_dp.py``, ``runtime/main_grads.py``);
    - :class:`~autopar.ExpertOptions` (``calibration``, ``placement``, ``capacity_factor``): with an
      ``ep`` axis (``{"ep": 2}``, ``{"dp": 2, "ep": 2}``, ``{"ep": 2, "tp": 2}``, or inside a pipeline)
      each mixture-of-experts layer's experts are spread over it (each ep rank passes its own share
      of the batch; the dense parameters are averaged over dp x ep, the experts over dp);
      ``calibration`` (inputs) measures each expert's load so ``placement="balanced"`` can even it
      out (``"contiguous"``: in order; inside a pipeline experts are placed in order);
      ``capacity_factor`` overrides the MoE layers' own (tokens over capacity drop).

    The keywords these replace (``schedule=``, ``overlap=``, ...) still work, each with a
    ``DeprecationWarning`` naming its new spelling. Bad input raises an
    :class:`~autopar.core.errors.AutoparError` subclass before any collective: MeshError,
    PlanFileError, ShardingError, DoesNotFitError, UnsupportedError."""

    memory_budget = memory_bytes(memory_budget)
    o = collect(options)
    if is_saved_plan_file(plan):       # a cluster plan: its structure, scaled to these ranks
        scaled = scale_plan(plan) if dist.is_initialized() else None
        if scaled is not None:
            pipe = o.pipeline
            mesh, opts = merge_options(scaled, mesh, dict(
                zero_stage=zero_stage, recompute=recompute, mixed_precision=mixed_precision, schedule=pipe.schedule,
                microbatches=pipe.microbatches, virtual_stages=pipe.virtual_stages, cp_kind=o.context.kind,
                shard_group=o.data.shard_group))
            zero_stage, recompute, mixed_precision = opts["zero_stage"], opts["recompute"], opts.get("mixed_precision")
            if opts.get("cp_kind"):
                o = dataclasses.replace(o, context=dataclasses.replace(o.context, kind=opts["cp_kind"]))
            if opts.get("shard_group"):
                o = dataclasses.replace(o, data=dataclasses.replace(o.data, shard_group=opts["shard_group"]))
            o = dataclasses.replace(o, pipeline=dataclasses.replace(
                pipe, schedule=opts.get("schedule", pipe.schedule), microbatches=opts.get("microbatches", pipe.microbatches),
                virtual_stages=opts.get("virtual_stages", pipe.virtual_stages)))
            plan = None
            if dist.get_rank() == 0:      # scaled: said (a warning prints without logging set up)
                (log.warning if scaled.notes else log.info)("%s", scaled.describe())
    if not isinstance(model, nn.Module):
        raise InputMismatchError("parallelize needs an nn.Module", where="parallelize", got=type(model).__name__,
                                 fix="pass the model object itself, e.g. autopar.parallelize(MyModel(), mesh, (x,))")
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if plan is not None:
        plan.check_model(model)    # a plan for another model stops here, before any collective
    t, d = o.tensor, o.data
    if plan is not None and t.placements:
        raise ConfigError("placements= and plan= are both given", where="parallelize", got=str(dict(t.placements)),
                          fix="put the placements in the plan (autopar.plan(..., placements=...)), or drop plan=")
    if plan is not None and t.sequence_parallel is not None:
        raise ConfigError("sequence_parallel= and plan= are both given", where="parallelize",
                          got=f"sequence_parallel={t.sequence_parallel!r}",
                          fix="plan with it (autopar.plan(..., sequence_parallel=...)), or drop plan=")
    mesh = mesh if plan is None or not isinstance(mesh, int) else plan.mesh     # an int with a plan: the plan's
    if mesh is None:
        if plan is None:
            raise ConfigError("parallelize needs a mesh or a plan", where="parallelize",
                              fix='pass a mesh, e.g. autopar.parallelize(model, {"dp": 2, "tp": 2}, ...), '
                                  'or plan="plan.json" from `autopar plan ... --save-plan plan.json`')
        mesh = plan.mesh
    pipelined = has_axis(mesh, "pp") or (plan is not None and plan.pp_axis is not None)
    experts = has_axis(mesh, "ep") or (plan is not None and plan.ep_axis is not None)
    e = o.experts
    _refuse_unused(("a pipeline", pipelined, dict(calibration=e.calibration, placements=t.placements, sizes=t.sizes,
                                                 bucket_bytes=d.bucket_bytes, sequence_parallel=t.sequence_parallel,
                                                 shard_group=d.shard_group)),
                   ("expert parallelism", experts, dict(placements=t.placements, sizes=t.sizes,
                                                        bucket_bytes=d.bucket_bytes,
                                                        sequence_parallel=t.sequence_parallel,
                                                        shard_group=d.shard_group)),
                   ("no pipeline", not pipelined, dict(batchnorm=o.pipeline.batchnorm)),
                   ("no context axis", not has_axis(mesh, "cp") and (plan is None or plan.cp_axis is None),
                    dict(cp_kind=o.context.kind)))
    _check_mixed_precision(mixed_precision, plan)
    recompute_layers(recompute)            # an unknown mode stops here, before any collective
    backend = backend_of(compile)
    check_compile(backend, recompute)
    mode = _data_mode(d.dp_mode, plan)
    check_composes(mode, zero_stage=plan.zero_stage if plan is not None else zero_stage, pipeline=pipelined,
                   experts=experts, mixed_precision=mixed_precision or (plan.mixed_precision if plan else None))
    if mode.kind != "allreduce" and zero_stage is None and plan is None:
        zero_stage = 0            # the other modes step whole parameters
    args = as_args(example_inputs)
    kwargs = {k: v for k, v in (example_kwargs or {}).items() if v is not None}
    check_devices(model, (*args, *kwargs.values()), None)
    if not dist.is_initialized():
        raise ConfigError("parallelize needs an initialised process group", where="parallelize",
                          fix="call torch.distributed.init_process_group (torchrun sets the environment) first")
    check_devices(model, (*args, *kwargs.values()),
                  "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    pipe = o.pipeline
    # before any other collective: every rank called with the same model, mesh and options
    check_agreement(model, mesh, dict(plan=plan, dims=t.dims, hardware=hardware, memory_budget=memory_budget,
                                      sizes=t.sizes, sync_params=d.sync_params, cross_sample=d.cross_sample,
                                      zero_stage=zero_stage, overlap=d.overlap, bucket_bytes=d.bucket_bytes,
                                      shard_group=d.shard_group,
                                      mixed_precision=mixed_precision,
                                      loss_fn=pipe.loss_fn, schedule=pipe.schedule, microbatches=pipe.microbatches,
                                      virtual_stages=pipe.virtual_stages, batchnorm=pipe.batchnorm, expert_placement=e.placement,
                                      capacity_factor=e.capacity_factor, recompute=recompute,
                                      placements=t.placements, dp_mode=mode.to_dict(), compile=backend,
                                      sequence_parallel=t.sequence_parallel, cp_kind=o.context.kind,
                                      inputs=[(k, _input_form(v)) for k, v in
                                              [*enumerate(args), *sorted(kwargs.items())]]))
    pm = build(BuildRequest(model=model, mesh=mesh, args=args, kwargs=kwargs, plan=plan, hardware=hardware,
                            memory_budget=memory_budget, zero_stage=zero_stage, recompute=recompute,
                            mixed_precision=mixed_precision, options=o, dp_mode=mode))
    return _compiled(pm, backend)


def _compiled(pm: Any, backend: str | None) -> Any:
    """The built module with its graphs (a pipeline's stage graphs) compiled with ``backend``."""
    if backend is not None:
        for part in getattr(pm, "stages", None) or [pm]:
            part.set_compile(backend)
    return pm


def _data_mode(dp_mode: Any, plan: Plan | None) -> DataMode:
    """The data-axis mode: ``dp_mode`` as given, else the plan's; both given must agree."""
    mode = data_mode(dp_mode)
    if plan is not None and plan.dp_mode:
        planned = data_mode(plan.dp_mode, where="plan dp_mode")
        if dp_mode is not None and mode != planned:
            raise ConfigError("dp_mode= differs from the plan's", where="parallelize(plan=..., dp_mode=...)",
                              expected=planned.describe(), got=mode.describe(),
                              fix="drop dp_mode= (the plan's is applied), or re-plan with it")
        return planned
    return mode


def _input_form(value: Any) -> Any:
    """What must agree about one example input across ranks: its kind, dtype and every dim but
    the first (each data-axis rank passes its own share of the batch)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape[1:]))
    return type(value).__name__


def _refuse_unused(*cases: tuple[str, bool, dict[str, Any]]) -> None:
    """Options a build does not use must keep their defaults: a given one would be silently dropped."""
    for what, applies, options in cases:
        given = sorted(k for k, v in options.items()
                       if v is not None and (isinstance(v, bool) or not (isinstance(v, (int, float, Mapping)) and not v)))
        if applies and given:
            raise ConfigError(f"{', '.join(given)} cannot be used with {what}", where="parallelize",
                              got=", ".join(f"{k}={options[k]!r}" for k in given),
                              fix=f"drop {', '.join(given)}; with {what} these are not applied "
                                  "(experts inside a pipeline are placed in order)")


def _check_mixed_precision(mixed_precision: Any, plan: Plan | None) -> None:
    """``mixed_precision`` is bf16, fp16 or None, and, with a plan, the plan's (checked before any
    collective: a build applies the plan's)."""
    if mixed_precision not in (None, "bf16", "fp16"):
        raise ConfigError("mixed_precision must be None, 'bf16' or 'fp16'", where="parallelize(mixed_precision=...)",
                          got=repr(mixed_precision), fix="use 'bf16' (or 'fp16') compute, or None for fp32")
    if plan is not None and mixed_precision is not None and mixed_precision != plan.mixed_precision:
        raise ConfigError("mixed_precision= differs from the plan's",
                          where="parallelize(plan=..., mixed_precision=...)", expected=repr(plan.mixed_precision),
                          got=repr(mixed_precision), fix="drop mixed_precision= (the plan's is applied), or re-plan with it")


def optimizer(module: Any, optimizer_cls: type, params: Any = None, *, loss_scale: Any = None, **kwargs: Any):
    """The optimizer for a model from :func:`parallelize`: ``optimizer_cls`` (any elementwise
    ``torch.optim`` optimizer) over this rank's share of the parameters, as the model's
    ZeRO stage says. ``params`` optionally gives parameter groups of ``module``'s parameters.
    Under ``mixed_precision="fp16"`` it scales the loss dynamically (skipping, on every rank, a
    step with an inf/nan gradient); ``loss_scale`` (a :class:`~autopar.runtime.loss_scale.LossScale`)
    tunes that, and is refused for other precisions (``runtime/loss_scale.py``)."""
    from autopar.runtime.loss_scale import refuse_loss_scale
    from autopar.runtime.optim import ShardedOptimizer, check_optimizer_class, check_params
    from autopar.runtime.pp import PipelineModule
    from autopar.runtime.tp_module import ParallelModule
    if not isinstance(module, (ParallelModule, PipelineModule)):
        raise OptimizerError("autopar.optimizer takes the model autopar.parallelize returned",
                             where="autopar.optimizer", expected="a ParallelModule or PipelineModule",
                             got=type(module).__name__,
                             fix="pm = autopar.parallelize(model, mesh, inputs); autopar.optimizer(pm, ...)")
    check_optimizer_class(optimizer_cls)
    holds_any = next(iter(module.parameters()), None) is not None      # a pipeline rank may hold none
    if isinstance(module, PipelineModule) and not module.dp_runtimes and not module.mixed and holds_any:
        params = check_params(module, params)
        refuse_loss_scale(loss_scale)      # fp32 stages: nothing to scale
        return optimizer_cls(params if params is not None else module.parameters(), **kwargs)
    return ShardedOptimizer(module, optimizer_cls, params, loss_scale=loss_scale, **kwargs)
