"""The module step: what :func:`autopar.parallelize` returns, over what the steps before made — a
:class:`~autopar.runtime.tp_module.ParallelModule` running the whole rewritten graph, or a
:class:`~autopar.runtime.pp.PipelineModule` running this rank's stages on the schedule.
"""
from __future__ import annotations

import re

import torch

from autopar.build.prepare import input_dims
from autopar.build.state import BuildState
from autopar.core.meta import graph_info, info


def module_step(s: BuildState) -> None:
    if s.cp_kind is not None and s.plan is not None and s.plan.cp_kind is None:
        from dataclasses import replace
        s.plan = replace(s.plan, cp_axis="cp", cp_kind=s.cp_kind)
    from autopar.passes.fusion import fuse
    from autopar.runtime.attention import fuse_attention
    for gm in [st.graph_module for st in s.stages] if s.request.pipelined else [s.gm]:
        fuse_attention(gm)       # a model's causal mask run as causal attention (runtime/attention.py)
        fuse(gm)                 # SwiGLU, RMSNorm, GELU keeping fewer activations (passes/fusion.py)
    if s.request.pipelined:
        _pipeline_module(s)
    else:
        _graph_module(s)


def _graph_module(s: BuildState) -> None:
    from autopar.runtime.tp_module import ParallelModule

    r, gm = s.request, s.gm
    used = {info(n).target_fqn for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn}
    pm = ParallelModule(gm, s.placements, {k: v for k, v in s.tensors.items() if k in used}, s.trainable, s.mesh,
                        s.plan, input_dims(r.model, r.args, r.options.tensor.dims, r.kwargs), dp=s.data)
    if r.expert_axis:
        stored = {f: how for f, (how, _) in s.experts.items()}
        if s.sizes.get("dp", 1) * s.sizes.get("cp", 1) == 1:   # no data axis for the experts: divide where they arrive
            from autopar.runtime.ep import average_over_senders
            average_over_senders([q for f, q in pm.named_parameters() if f in stored], s.ep)
        pm.expert_params = set(stored)
        pm.expert_storage = stored        # fqn -> "rows" (owned rows of stacked experts) | "whole" (an owned module's)
        pm.ep_runtimes = s.expert_runtimes
        runtime_of = {f: s.expert_runtimes[region.fqn] for region in graph_info(gm).moe_regions
                      if region.fqn in s.expert_runtimes for f in region.expert_params}
        pm.expert_rows = {f: runtime_of[f] for f, how in stored.items() if how == "rows" and f in runtime_of}
        members: dict[str, set[str]] = {}
        for f, how in stored.items():         # "<list>.<expert>.<parameter>" of a ModuleList of experts
            m = re.match(r"^(.*)\.(\d+)\.(.+)$", f)
            if how == "whole" and m is not None and f in runtime_of:
                members.setdefault(m[1], set()).add(m[3])
                runtime_of[m[1]] = runtime_of[f]
        pm.expert_modules = {name: (runtime_of[name], tuple(sorted(sfx))) for name, sfx in members.items()}
        pm.placements = s.expert_placements
    pm.set_recompute(r.recompute, s.regions)   # none | selective (attention cores) | full (every layer)
    s.module = pm


RANDOM_OPS = {"native_dropout", "dropout", "bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like",
              "randint", "randperm", "multinomial", "normal", "uniform_", "normal_", "feature_dropout"}


def check_overlapped_pairs(s: BuildState) -> None:
    """DualPipeV runs a forward and a backward at once on two threads (runtime/pp_overlap.py):
    refused where a stage would issue collectives that have no second group (tensor and context
    axes, ZeRO-3 gathers) or draw random numbers (one generator, drawn from in an order that
    varies between runs)."""
    from autopar.core.errors import UnsupportedError
    why = []
    if s.tp > 1 or s.sizes.get("cp", 1) > 1:
        why.append(f"its tensor or context axis (tp={s.tp}, cp={s.sizes.get('cp', 1)}) exchanges inside a stage")
    if (s.zero_stage or 0) >= 3 and s.sizes.get("dp", 1) * s.ep > 1:
        why.append("ZeRO-3 gathers parameters inside a stage's forward")
    drawn = sorted({info(n).fqn or "<root>" for st in s.stages for n in st.graph_module.graph.nodes if _draws(n)})
    if drawn and s.request.model.training:
        why.append(f"random ops in training ({', '.join(drawn[:3])}) would draw in an order that varies between runs")
    if why:
        raise UnsupportedError("the dualpipev schedule runs one micro-batch's forward and another's backward at "
                               "once, on two threads; " + "; ".join(why), where="PipelineOptions(schedule='dualpipev')",
                               fix="use schedule='zb' or '1f1b' (or drop the axis, ZeRO-3 or dropout named)")


def _draws(n) -> bool:
    """Does node ``n`` draw random numbers (a dropout only with p > 0 in training)?"""
    name = getattr(n.target, "__name__", "").split(".")[0] if n.op == "call_function" else ""
    if name not in RANDOM_OPS:
        return False
    if "dropout" in name:
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        return bool(train) and not (isinstance(p, (int, float)) and p == 0)
    return True


def _pipeline_module(s: BuildState) -> None:
    from autopar.runtime.pp import PipelineModule

    if s.schedule == "dualpipev":
        check_overlapped_pairs(s)
    mb_inputs = tuple(v for i, v in enumerate((*s.capture_args, *s.capture_kwargs.values()))
                      if i not in s.constant_inputs)
    pm = PipelineModule(s.stages, plan=s.plan, schedule=s.schedule, microbatches=s.microbatches,
                        num_stages=s.pipeline_plan.stages, loss_fn=s.loss_fn, pp_group=s.group("pp")[0],
                        pp_rank=s.group("pp")[1], pp_size=s.sizes["pp"], data=s.data, grads=s.grads,
                        master_init=s.master_init, shared=s.shared_groups, device=s.device,
                        keyword_names=list(s.capture_kwargs), own_loss=s.own_loss, token_counter=s.token_counter,
                        constant_inputs=s.constant_inputs, loss_dtype=_loss_dtype(s.request.model),
                        examples=[st.io_examples(s.tp, s.device, mb_inputs if st.index == 0 else None)
                                  for st in s.stages])
    pm.stage_graphs = s.stage_graphs
    pm.expert_storage = {f: how for f, (how, _) in s.experts.items()}    # fqn -> "rows" | "whole"
    pm.expert_owned = {f: owned for f, (_, owned) in s.experts.items()}  # fqn -> the experts this rank holds
    pm.pipeline_plan = s.pipeline_plan       # the simulator's view: stage times, step time, bubble
    pm.mode_source = graph_info(s.gm).mode_source       # switches the stages between train and eval
    s.module = pm


def _loss_dtype(model) -> torch.dtype:
    """The dtype every pipeline rank hands the loss around in: fp32, or the model's wider one."""
    floats = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    return torch.promote_types(torch.float32, floats[0] if floats else torch.float32)
