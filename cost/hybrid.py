"""The hybrid simulator: one configuration of dp x tp x pp x ep (ZeRO stage, recomputation,
micro-batches, schedule) scored in seconds and bytes. The search over all of them is
:mod:`autopar.cost.plan_search`.

Facts come from the captured graph once (:class:`ModelFacts`): the repeated block class
(transformer layers), what runs before the first block (embeddings) and after the last
(final norm, head), with FLOPs, bytes and saved activations per op as formulas of ``batch``
and ``seq``. For a tensor degree ``t`` and micro-batch ``b`` the tensor-axis solver runs once
on the whole graph (it plans one block and reuses it for every copy); every op is then priced
by the cost model's roofline at the fraction of work its strategy leaves on one rank, and the
solver's placement conversions are priced where they happen. Per micro-batch that gives the
forward and backward seconds of one block, of the part before and of the part after.

A configuration (:func:`simulate`):

- pipeline stages get ``L / (pp*v)`` blocks each, the first also the part before, the last
  the part after; recomputation adds each block's forward again to its backward (``full``),
  or only the attention-score ops (``selective``: softmax / masking / dropout between the two
  attention matmuls); the schedule simulator (:mod:`autopar.cost.pp_sim`) runs the
  ``B / (dp*b)`` micro-batches through them with p2p of one block boundary's activation;
- the data axis, priced on the links the dp axis spans, works as the runtime does, which
  differs with and without a pipeline:

  - ``pp > 1`` (:mod:`autopar.runtime.stage_dp`): once per step, not per micro-batch. ZeRO-3
    gathers the stages' whole parameters before the first micro-batch; after the last backward
    ZeRO-0 all-reduces the gradients and ZeRO-2/3 reduce-scatter them, and ZeRO-1's optimizer
    reduce-scatters them at its step; ZeRO-1/2 all-gather the updated parameters after it. All
    of it is exposed (the gather precedes the first stage's first forward, the reductions follow
    its last backward; nothing overlaps the pipeline's compute);
  - ``pp == 1`` (the lone stage's runtime, :mod:`autopar.runtime.dp`): the reduction
    (all-reduce for ZeRO-0/1, reduce-scatter for 2/3) runs during the last micro-batch's
    backward, which hides what it can; ZeRO-1/2 all-gather the updated parameters once per
    step; ZeRO-3 gathers every bucket for each micro-batch's forward and again for its
    backward, prefetched under compute except the first. (The runtime's ZeRO-1 reduce-scatters
    at the optimizer step instead: the same bytes as the all-reduce priced here, less hidden.)
- the optimizer step reads and writes the stage's state once (memory-bound);
- memory per device: parameters, gradients and optimizer state of the stage's (with ``v``
  virtual stages: the rank's stages') share of parameters, plus the activations of the
  micro-batches the schedule keeps in flight (a block input per block under ``full``, and one
  block's whole activations during its recomputation). Optimizer state is divided by dp for
  ZeRO >= 1 (in 16-bit it includes the fp32 master weights). With ``pp > 1`` the parameters
  and gradients are whole under every ZeRO stage: gradients accumulate over the micro-batches
  into whole tensors and are reduced only after the last backward, and ZeRO-3 keeps the
  gathered whole parameters for the whole step (in 32-bit its flat pieces, the optimizer's
  masters, add 1/dp more); what ZeRO saves inside a pipeline is optimizer state. With
  ``pp == 1`` ZeRO-2/3 hold 1/dp of the gradients and ZeRO-3 1/dp of the parameters.

Hardware FLOP/s count recomputation; model FLOP/s and MFU do not.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.compute import op_time
from autopar.errors import ConfigError
from autopar.passes.meta import evaluate, graph_info, info
from autopar.passes.sharding import is_decision, tensor_inputs
from autopar.placement import REP

log = logging.getLogger("autopar.hybrid")

RECOMPUTE = ("none", "selective", "full")
SCORE_OPS = {"_softmax", "softmax", "_safe_softmax", "masked_fill", "where", "dropout", "native_dropout", "div", "mul"}


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"
    zero_stage: int = 0
    ep: int = 1

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep}


@dataclass(frozen=True)
class Score:
    """What the simulator predicts for one configuration."""

    config: Config
    step_time_s: float
    microbatches: int
    model_flops: float                # per step, whole cluster, without recomputation
    hw_flops: float                   # with recomputation
    tflops_per_device: float
    hw_tflops_per_device: float
    mfu: float
    peak_memory_bytes: float
    memory: dict[str, float]
    bubble_fraction: float
    exposed_comm_s: float
    fits: bool
    parts: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        return {"degrees": c.degrees(), "zero_stage": c.zero_stage, "micro_batch_size": c.micro_batch,
                "microbatches": self.microbatches, "schedule": c.schedule, "virtual_stages": c.virtual,
                "recompute": c.recompute,
                "predicted": {"step_time_s": self.step_time_s, "tflops_per_device": self.tflops_per_device,
                              "hw_tflops_per_device": self.hw_tflops_per_device, "mfu": self.mfu,
                              "peak_memory_bytes": self.peak_memory_bytes, "memory_bytes": dict(self.memory),
                              "bubble_fraction": self.bubble_fraction, "exposed_comm_s": self.exposed_comm_s,
                              "parts_s": {k: v for k, v in self.parts.items() if not isinstance(v, list)}},
                "fits": self.fits, "reason": self.reason}


@dataclass
class _Part:
    fwd: float = 0.0
    bwd: float = 0.0
    score_fwd: float = 0.0            # attention-score ops (selective recompute)
    comm_fwd: float = 0.0
    comm_bwd: float = 0.0
    saved: float = 0.0
    score_saved: float = 0.0
    flops: float = 0.0                # model FLOPs (forward + backward)
    fwd_flops: float = 0.0
    expert_fwd: float = 0.0           # the experts' ops as the tensor layout splits them
    expert_bwd: float = 0.0
    expert_fwd1: float = 0.0          # ... and whole (experts kept whole on tp under ep)
    expert_bwd1: float = 0.0
    a2a_bytes: float = 0.0            # the [E, C, h] token buffers an expert exchange moves


class ModelFacts:
    """What the simulator reads from one captured, analysed graph (module docstring)."""

    def __init__(self, gm: fx.GraphModule, *, seq: int, dtype: str = "bf16", optimizer_floats: int = 2,
                 attention: str = "flash", layers: int | None = None) -> None:
        if attention not in ("flash", "materialized"):
            raise ConfigError(f"unknown attention kernel model {attention!r}", expected="flash or materialized")
        self.attention = attention
        ginfo = graph_info(gm)
        if not ginfo.block_classes:
            raise ConfigError("the model has no repeated block to pipeline", where="planner",
                              fix="the hybrid planner needs a model made of repeated layers")
        self.gm = gm
        self.seq = seq
        self.dtype = dtype
        self.k = optimizer_floats
        cls = max(ginfo.block_classes, key=lambda c: len(c.members) * c.nodes_per_member)
        # ``layers``: how many copies of the block the real model has when ``gm`` was captured
        # with fewer (:func:`autopar.workload.capture_for_planning`); every per-block figure is
        # one copy's, so only the count changes
        self.captured_layers = len(cls.members)
        self.layers = layers or self.captured_layers
        self.members = set(cls.members)
        nodes = list(gm.graph.nodes)
        self.where: dict[fx.Node, str] = {}
        first = next(i for i, n in enumerate(nodes) if info(n).block_member in self.members)
        for i, n in enumerate(nodes):
            m = info(n).block_member
            self.where[n] = "block" if m in self.members else ("pre" if i < first else "post")
        self.params: dict[str, float] = {"pre": 0.0, "block": 0.0, "post": 0.0}
        self._param_nodes = [n for n in nodes if n.op == "placeholder" and info(n).kind == "param"]
        self._cache: dict[tuple[int, int, Any], dict[str, _Part]] = {}
        self._numel: dict[tuple[int, int], dict[str, float]] = {}
        self._solved: dict[tuple[int, str], Mapping[str, Any]] = {}
        self.hidden = 1
        for n in nodes:
            if self.where.get(n) == "block" and info(n).values and len(info(n).values[0].shape) == 3:
                self.hidden = int(evaluate(info(n).values[0].shape[-1], {"batch": 1, "seq": 1}))
                break
        self.symbols = {str(s) for s in ginfo.symbols}
        self.experts = math.gcd(*[r.num_experts for r in ginfo.moe_regions]) if ginfo.moe_regions else 0
        self.expert_params = {f for r in ginfo.moe_regions for f in r.expert_params}
        self._captured_fp32 = any(info(n).values[0].dtype == torch.float32 for n in self._param_nodes[:1])

    def sizes(self, micro_batch: int) -> dict[str, int]:
        return {"batch": micro_batch, "seq": self.seq}

    def param_numel(self, tp: int, strategies: Mapping[str, Any] | None) -> dict[str, float]:
        """Parameters per tp rank of the part before, one block, and the part after."""
        key = (tp, id(strategies))
        if key not in self._numel:
            self._numel[key] = self._param_numel(tp, strategies)
        return self._numel[key]

    def _param_numel(self, tp: int, strategies: Mapping[str, Any] | None) -> dict[str, float]:
        out = {"pre": 0.0, "block": 0.0, "post": 0.0, "expert": 0.0, "expert_whole": 0.0}
        for n in self._param_nodes:
            numel = float(evaluate(info(n).values[0].numel, {}))
            s = (strategies or {}).get(n.name)
            split = s is not None and any(o.value != REP.value for o in s.outputs)
            part = self._reader_part(n)
            out[part] += numel / (tp if split else 1)
            if info(n).target_fqn in self.expert_params:
                out["expert"] += numel / (tp if split else 1)
                out["expert_whole"] += numel
        for k in ("block", "expert", "expert_whole"):
            out[k] /= self.captured_layers
        return out

    def _reader_part(self, param: fx.Node) -> str:
        for u in param.users:
            w = self.where.get(u)
            if w is not None:
                return w
        return "pre"

    def parts(self, tp: int, micro_batch: int, cluster: Cluster, axes: tuple[tuple[str, int], ...]
              ) -> tuple[dict[str, _Part], Mapping[str, Any]]:
        """Per micro-batch: seconds, FLOPs and saved bytes of the part before, one block, after."""
        key = (tp, micro_batch, cluster.name)
        if key in self._cache:
            return self._cache[key]
        if micro_batch > 2:
            # every figure is affine in the micro-batch size (FLOPs and bytes grow with it, a
            # kernel's launch and a collective's latency do not): extend the line through 1 and 2
            (one, strategies), (two, _) = self.parts(tp, 1, cluster, axes), self.parts(tp, 2, cluster, axes)
            parts = {}
            for name in one:
                a, b = one[name], two[name]
                parts[name] = _Part(**{f: getattr(a, f) + (micro_batch - 1) * (getattr(b, f) - getattr(a, f))
                                       for f in a.__dataclass_fields__})
            self._cache[key] = (parts, strategies)
            return self._cache[key]
        from autopar.cost.tp_solver import SolverConfig, _Pricer, solve

        at = self.sizes(micro_batch)
        strategies: Mapping[str, Any] = {}
        pricer = None
        if tp > 1:
            # the tensor solver's choice does not depend on the micro-batch size for the
            # blocks that matter (it is a per-matmul layout); solve once per degree at 1
            skey = (tp, cluster.name)
            if skey not in self._solved:
                t0 = time.perf_counter()
                cfg1 = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=self.sizes(1),
                                    dtype=self.dtype)
                self._solved[skey] = solve(self.gm, cfg1).strategies
                log.info("tensor layout at tp=%d solved in %.2fs", tp, time.perf_counter() - t0)
            strategies = self._solved[skey]
            cfg = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=at, dtype=self.dtype)
            pricer = _Pricer(self.gm, cfg)
        dev = cluster.device
        # a graph captured in fp32 and run in 16-bit moves half the bytes it records
        width = 0.5 if self.dtype in ("bf16", "fp16") and self._captured_fp32 else 1.0
        parts = {"pre": _Part(), "block": _Part(), "post": _Part()}
        buffers: set[fx.Node] = set()
        for n in self.gm.graph.nodes:
            if not is_decision(n):
                continue
            rec = info(n)
            p = parts[self.where[n]]
            s = strategies.get(n.name)
            work = s.work if s is not None else 1.0
            ff, fb = float(evaluate(rec.flops_fwd, at)), float(evaluate(rec.flops_bwd, at))
            bf, bb = float(evaluate(rec.bytes_fwd, at)) * width, float(evaluate(rec.bytes_bwd, at)) * width
            if self.attention == "materialized" and _is_sdpa(n):
                scores = _score_bytes(n, at, self.dtype)
                bf, bb = bf + SCORE_PASSES_FWD * scores, bb + SCORE_PASSES_BWD * scores
            f = op_time(ff * work, bf * work, dev, self.dtype)
            b = op_time(fb * work, bb * work, dev, self.dtype) if rec.requires_grad else 0.0
            saved = float(evaluate(rec.saved_bytes, at)) * work * width
            p.fwd += f
            p.bwd += b
            if rec.moe_role == "expert":
                p.expert_fwd += f
                p.expert_bwd += b
                p.expert_fwd1 += op_time(ff, bf, dev, self.dtype)
                p.expert_bwd1 += op_time(fb, bb, dev, self.dtype) if rec.requires_grad else 0.0
                buf = n.args[0] if n.target is torch.ops.aten.bmm.default else None
                if buf is not None and info(buf).moe_role != "expert" and buf not in buffers:
                    buffers.add(buf)          # the dispatch buffer entering the experts
                    p.a2a_bytes += float(evaluate(info(buf).values[0].nbytes, at)) * width
            p.saved += saved
            p.flops += ff + (fb if rec.requires_grad else 0.0)
            p.fwd_flops += ff
            if _is_score_op(n):
                p.score_fwd += f
                p.score_saved += saved
            if pricer is not None and s is not None:
                for j, arg in enumerate(tensor_inputs(n)):
                    src = strategies.get(arg.name)
                    if src is None or j >= len(s.inputs) or not src.outputs:
                        continue
                    t = pricer.convert(arg, 0, src.outputs[0], s.inputs[j]) * width
                    p.comm_fwd += t / 2
                    p.comm_bwd += t / 2
        blk = parts["block"]
        for name in blk.__dataclass_fields__:
            setattr(blk, name, getattr(blk, name) / self.captured_layers)
        self._cache[key] = (parts, strategies)
        return parts, strategies


# Attention that materialises the [b, heads, s, s] scores (no flash kernel), as Megatron-LM's
# 2021 fused kernels did: forward, the scores GEMM writes them (1 pass), the fused
# scale-mask-softmax reads and writes them (2), dropout reads and writes them (2, plus a
# 1-byte mask, counted as half a pass), the value GEMM reads them (1); backward, the dP GEMM
# writes (1), dropout's backward reads dP and writes (2, mask half), softmax's backward reads
# the probabilities and dP and writes dS (3), the two GEMMs read dS (2) and the probabilities
# (1). Bytes per pass: the score tensor in the compute dtype.
SCORE_PASSES_FWD = 6.5
SCORE_PASSES_BWD = 9.5


def _is_sdpa(node: fx.Node) -> bool:
    return "scaled_dot_product" in getattr(node.target, "__name__", str(node.target))


def _score_bytes(node: fx.Node, at: Mapping[str, int], dtype: str) -> float:
    q = info(node.args[0]).values[0].shape
    k = info(node.args[1]).values[0].shape
    elems = float(evaluate(sympy_prod(q[:-1]) * k[-2], at))
    return elems * (2 if dtype in ("bf16", "fp16") else 4)


def sympy_prod(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def _is_score_op(node: fx.Node) -> bool:
    """Ops between the two attention matmuls (scores): what selective recomputation redoes."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name not in SCORE_OPS:
        return False
    vals = info(node).values
    return bool(vals) and len(vals[0].shape) == 4 and str(vals[0].shape[-1]) == str(vals[0].shape[-2])


def _axes(c: Config, cluster: Cluster) -> tuple[tuple[str, int], ...]:
    # tp innermost (inside a node), then dp, then pp outermost, as Megatron lays ranks out
    return (("pp", c.pp), ("dp", c.dp), ("tp", c.tp))


def simulate(facts: ModelFacts, cluster: Cluster, c: Config, *, batch: int,
             budget: float | None = None, fast: bool = False) -> Score:
    """Score one configuration (module docstring) at global ``batch``. ``fast`` replaces the
    event simulation of the pipeline by its closed form (exact for uniform stages, a close
    estimate otherwise): the search ranks with it and re-scores its finalists exactly."""
    from autopar.cost.pp_sim import StageCosts, make
    from autopar.cost.pp_sim import simulate as run_schedule

    if c.recompute not in RECOMPUTE:
        raise ConfigError(f"unknown recompute {c.recompute!r}", expected=", ".join(RECOMPUTE))
    devices = c.dp * c.tp * c.pp
    if batch % (c.dp * c.micro_batch):
        raise ConfigError(f"batch {batch} does not split into dp={c.dp} x micro-batch {c.micro_batch}",
                          where="config", fix="pick a micro-batch size dividing batch / dp")
    m = batch // (c.dp * c.micro_batch)
    stages = c.pp * c.virtual
    if facts.layers % stages:
        raise ConfigError(f"{facts.layers} layers do not split into {stages} stages", where="config",
                          fix="pick pp * virtual stages dividing the layer count")
    if c.ep > 1 and (not facts.experts or facts.experts % c.ep or c.dp % c.ep):
        raise ConfigError(f"ep={c.ep} must divide the expert count and dp", where="config")
    axes = _axes(c, cluster)
    parts, strategies = facts.parts(c.tp, c.micro_batch, cluster, axes)
    pre, blk, post = parts["pre"], parts["block"], parts["post"]
    if c.ep > 1:
        blk = _with_experts(blk, c, cluster)
    per_stage = facts.layers // stages
    re_blk = {"none": 0.0, "selective": blk.score_fwd, "full": blk.fwd + blk.comm_fwd}[c.recompute]
    fwd, bwd = [], []
    for s in range(stages):
        f = per_stage * (blk.fwd + blk.comm_fwd)
        b = per_stage * (blk.bwd + blk.comm_bwd + re_blk)
        if s == 0:
            f, b = f + pre.fwd + pre.comm_fwd, b + pre.bwd + pre.comm_bwd
        if s == stages - 1:
            f, b = f + post.fwd + post.comm_fwd, b + post.bwd + post.comm_bwd
        fwd.append(f)
        bwd.append(b)
    act_bytes = _boundary_bytes(facts, c)
    p2p = collective_time("send_recv", act_bytes, cluster, axes, "pp") if c.pp > 1 else 0.0
    sched = c.schedule if c.pp > 1 else "gpipe"
    if sched == "interleaved" and (c.virtual < 2 or m % c.pp):
        raise ConfigError("interleaved needs virtual >= 2 and micro-batches a multiple of pp", where="config")
    if fast:
        result = _closed_form(sched, c.pp, c.virtual, m, fwd, bwd, p2p)
    else:
        result = run_schedule(make(sched, c.pp, m, c.virtual),
                              StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), p2p_s=p2p))
    pipe = result.step_time_s
    # data axis and optimizer
    numel = facts.param_numel(c.tp, strategies)
    per_block = numel["block"]
    expert_block = 0.0
    if c.ep > 1:   # experts kept whole on tp, 1/ep of them per rank; the dense rest as before
        expert_block = numel["expert_whole"] / c.ep
        per_block = numel["block"] - numel["expert"] + expert_block
    stage_params = per_stage * c.virtual * per_block + max(numel["pre"], numel["post"])
    width = 2.0 if facts.dtype in ("bf16", "fp16") else 4.0
    grad_bytes = width * stage_params
    expert_bytes = width * per_stage * c.virtual * expert_block
    if c.pp > 1:
        dp_comm, exposed = _pipeline_data_axis(c, cluster, axes, grad_bytes, expert_bytes)
    else:
        dp_comm, exposed = _lone_stage_data_axis(c, cluster, axes, grad_bytes, expert_bytes, m, bwd[-1], pipe)
    state_bytes_per_param = (4 + 4 * facts.k) if facts.dtype in ("bf16", "fp16") else 4 * (2 + facts.k)
    optim = _optimizer_time(stage_params / (c.dp if c.zero_stage >= 1 else 1), state_bytes_per_param, cluster)
    step = pipe + exposed + optim
    # memory
    mem = _memory(facts, c, stage_params, blk, pre, post, result, per_stage, m)
    peak = sum(mem.values())
    fits = budget is None or peak <= budget
    samples = batch / c.micro_batch                # the parts are per micro-batch
    model_flops = (pre.flops + post.flops + facts.layers * blk.flops) * samples
    hw_flops = model_flops + samples * facts.layers * {"none": 0.0, "selective": 0.0,
                                                        "full": blk.fwd_flops}[c.recompute]
    peak_flops = cluster.device.peak(facts.dtype)
    tput = model_flops / step / devices
    return Score(config=c, step_time_s=step, microbatches=m, model_flops=model_flops, hw_flops=hw_flops,
                 tflops_per_device=tput / 1e12, hw_tflops_per_device=hw_flops / step / devices / 1e12,
                 mfu=tput / peak_flops, peak_memory_bytes=peak, memory=mem,
                 bubble_fraction=result.bubble_fraction, exposed_comm_s=exposed + (c.tp > 1) * 0.0, fits=fits,
                 parts={"pipeline_s": pipe, "dp_comm_s": dp_comm, "optimizer_s": optim,
                        "tp_comm_per_block_s": blk.comm_fwd + blk.comm_bwd, "block_fwd_s": blk.fwd,
                        "block_bwd_s": blk.bwd, "stage_fwd_s": fwd, "stage_bwd_s": bwd, "p2p_s": p2p})


def _data_collective(kind: str, nbytes: float, expert_bytes: float, c: Config, cluster: Cluster,
                     axes: tuple[tuple[str, int], ...]) -> float:
    """One collective of ``nbytes`` of a stage's gradients or parameters over the data axis. With
    experts (``ep > 1``) their ``expert_bytes`` go over the ``dp / ep`` ranks holding the same
    experts, the dense rest over the whole data axis."""
    if c.dp == 1:
        return 0.0
    if c.ep == 1:
        return collective_time(kind, nbytes, cluster, axes, "dp")
    ep_axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep), ("tp", c.tp))
    return collective_time(kind, nbytes - expert_bytes, cluster, axes, "dp") + \
        (collective_time(kind, expert_bytes, cluster, ep_axes, "dp") if c.dp > c.ep else 0.0)


def _lone_stage_data_axis(c: Config, cluster: Cluster, axes: tuple[tuple[str, int], ...], grad_bytes: float,
                          expert_bytes: float, m: int, last_bwd: float, pipe: float) -> tuple[float, float]:
    """The data axis without a pipeline (``pp == 1``): seconds in all, and exposed. The reduction
    (all-reduce for ZeRO-0/1, reduce-scatter for 2/3) is issued bucket by bucket during the last
    micro-batch's backward, which hides what it can; ZeRO-1/2 all-gather the updated parameters
    once per step; ZeRO-3 gathers every bucket for each micro-batch's forward and again for its
    backward, prefetched under compute except the first."""
    if c.dp == 1:
        return 0.0, 0.0
    kind = "all_reduce" if c.zero_stage <= 1 else "reduce_scatter"
    dp_comm = _data_collective(kind, grad_bytes, expert_bytes, c, cluster, axes)
    gathers = 0.0
    if c.zero_stage in (1, 2):
        dp_comm += collective_time("all_gather", grad_bytes, cluster, axes, "dp")
    elif c.zero_stage == 3:
        gathers = 2 * m * collective_time("all_gather", grad_bytes, cluster, axes, "dp")
        dp_comm += gathers
    exposed = max(0.0, dp_comm - gathers - last_bwd)
    if gathers:
        exposed += max(gathers - pipe, 0.0) + gathers / (2 * m)
    return dp_comm, exposed


def _pipeline_data_axis(c: Config, cluster: Cluster, axes: tuple[tuple[str, int], ...], grad_bytes: float,
                        expert_bytes: float) -> tuple[float, float]:
    """The data axis of a pipeline rank (``pp > 1``, :mod:`autopar.runtime.stage_dp`): seconds in
    all, and exposed. It works once per step, not per micro-batch: ZeRO-3 gathers the stages'
    whole parameters before the first micro-batch; after the last backward ZeRO-0 all-reduces the
    gradients and ZeRO-2/3 reduce-scatter them, and ZeRO-1's optimizer reduce-scatters them at its
    step; ZeRO-1/2 all-gather the updated parameters after it. All of it is counted exposed: the
    gather precedes the first stage's first forward and the reductions follow its last backward
    (a later pipeline rank could hide its gather under the pipeline's fill, but the step waits
    for the first)."""
    if c.dp == 1:
        return 0.0, 0.0
    z = c.zero_stage
    reduce = _data_collective("all_reduce" if z == 0 else "reduce_scatter", grad_bytes, expert_bytes, c, cluster,
                              axes)
    gather = _data_collective("all_gather", grad_bytes, expert_bytes, c, cluster, axes) if z >= 1 else 0.0
    dp_comm = reduce + gather      # ZeRO-3's gather before the step, ZeRO-1/2's after it
    return dp_comm, dp_comm


@dataclass(frozen=True)
class _Pipe:
    step_time_s: float
    bubble_fraction: float
    peak_inflight: tuple[int, ...]


def _closed_form(sched: str, p: int, v: int, m: int, fwd: list[float], bwd: list[float], p2p: float) -> _Pipe:
    """Pipeline time without the event simulation: the busiest device works ``m`` times its
    share, plus the fill and drain through the other stages (zb hides the weight-gradient half
    of backward in the drain)."""
    dev = [sum(fwd[s] + bwd[s] for s in range(d, p * v, p)) for d in range(p)]
    busy = max(dev)
    chunk = [(f + b) for f, b in zip(fwd, bwd)]
    fill = sum(sorted(chunk)[:-1]) / max(1, v) if p > 1 else 0.0
    if sched == "zb":
        fill = sum(sorted(f + b / 2 for f, b in zip(fwd, bwd))[:-1])
    step = busy * m / 1.0 + fill + 2 * (p - 1) * p2p
    step = max(step, busy * m)
    inflight = tuple(min(m, p - (s % p)) if sched != "gpipe" else m for s in range(p * v))
    return _Pipe(step_time_s=step, bubble_fraction=(step - busy * m) / (busy * m), peak_inflight=inflight)


def _with_experts(blk: _Part, c: Config, cluster: Cluster) -> _Part:
    """One block under expert parallelism: the experts stay whole on the tensor axis (the
    runtime keeps them so), and each MoE layer exchanges its token buffer four times per
    micro-batch (dispatch and combine, forward and backward) over the ep axis."""
    from dataclasses import replace
    axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep), ("tp", c.tp))
    a2a = collective_time("all_to_all", blk.a2a_bytes, cluster, axes, "ep") if blk.a2a_bytes else 0.0
    return replace(blk, fwd=blk.fwd - blk.expert_fwd + blk.expert_fwd1, bwd=blk.bwd - blk.expert_bwd + blk.expert_bwd1,
                   comm_fwd=blk.comm_fwd + 2 * a2a, comm_bwd=blk.comm_bwd + 2 * a2a)


def timeline_of(facts: ModelFacts, cluster: Cluster, c: Config, *, batch: int):
    """The event simulation of ``c``'s pipeline (for the timeline picture)."""
    from autopar.cost.pp_sim import StageCosts, make
    from autopar.cost.pp_sim import simulate as run_schedule
    score = simulate(facts, cluster, c, batch=batch)
    fwd, bwd = score.parts["stage_fwd_s"], score.parts["stage_bwd_s"]
    sched = c.schedule if c.pp > 1 else "gpipe"
    return run_schedule(make(sched, c.pp, score.microbatches, c.virtual),
                        StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), p2p_s=score.parts["p2p_s"]))


def _boundary_bytes(facts: ModelFacts, c: Config) -> float:
    """One micro-batch's activation at a block boundary: batch x seq x hidden in the compute dtype."""
    width = 2 if facts.dtype in ("bf16", "fp16") else 4
    return float(c.micro_batch * facts.seq * facts.hidden * width)


def _optimizer_time(numel: float, state_bytes: float, cluster: Cluster) -> float:
    """An elementwise optimizer reads and writes every state byte once."""
    return op_time(0.0, 2 * numel * state_bytes, cluster.device, "fp32", launch_overhead=False)


def _memory(facts: ModelFacts, c: Config, stage_params: float, blk: _Part, pre: _Part, post: _Part,
            result, per_stage: int, m: int) -> dict[str, float]:
    """Peak bytes per device by term (module docstring). In 16-bit the optimizer state includes
    the fp32 master weights; in 32-bit the masters are the parameters themselves."""
    mixed = facts.dtype in ("bf16", "fp16")
    n, z, k = c.dp, c.zero_stage, facts.k
    width = 2 if mixed else 4
    state = (4 + 4 * k) if mixed else 4 * k
    optim = state * stage_params / (n if z >= 1 else 1)
    if c.pp > 1:
        # runtime/stage_dp.py: every ZeRO stage accumulates whole gradients over the micro-batches
        # and ZeRO-3 holds the whole parameters for the whole step, so the peak (activations in
        # flight) sees both whole; ZeRO-3's flat pieces stay beside them: in 16-bit they are the
        # fp32 masters counted with the optimizer state, in 32-bit one more 1/dp of the parameters
        params = width * stage_params * (1 + (1 / n if z == 3 and not mixed else 0))
        grads = width * stage_params
    else:
        # the lone stage's runtime gathers ZeRO-3 parameters bucket by bucket and reduce-scatters
        # ZeRO-2/3 gradients during backward: only pieces are held
        params = width * stage_params / (n if z == 3 else 1)
        grads = width * stage_params / (n if z >= 2 else 1)
    scale = 1.0                                   # saved bytes are already in the compute dtype
    inflight = max(result.peak_inflight[:c.pp]) if result.peak_inflight else 1
    if c.recompute == "full":
        per_mb = per_stage * c.virtual * _boundary_bytes(facts, c) + blk.saved * scale
    elif c.recompute == "selective":
        per_mb = per_stage * c.virtual * (blk.saved - blk.score_saved) * scale
    else:
        per_mb = per_stage * c.virtual * blk.saved * scale
    per_mb += max(pre.saved, post.saved) * scale
    acts = per_mb * inflight
    return {"params": params, "grads": grads, "optimizer": optim, "activations": acts}


__all__ = ["Config", "Score", "ModelFacts", "simulate", "timeline_of", "RECOMPUTE"]

del asdict
