"""The hybrid simulator: one configuration of dp x tp x pp x ep (ZeRO stage, recomputation,
micro-batches, schedule) scored in seconds and bytes. The search over all of them is
:mod:`autopar.cost.plan_search`.

Facts come from the captured graph once (:class:`ModelFacts`): the repeated block class
(transformer layers), what runs before the first block (embeddings, and layers of another
class) and after the last (final norm, head), with FLOPs, bytes and saved activations per op
as formulas of ``batch`` and ``seq``; a graph captured with fewer copies of the block
(:func:`autopar.cli.workload.capture_for_planning`) gives the same figures with ``layers=``. For
a tensor degree ``t`` and micro-batch ``b`` the tensor-axis solver lays the graph out at that
micro-batch size (it plans one block and reuses it for every copy); every op is then priced by
:func:`autopar.cost.op_cost.node_seconds` (the roofline at the bytes its placement leaves on a
rank, GEMMs and attention at their shape's efficiency) and the solver's placement conversions
where they happen. Per micro-batch that gives the forward and backward seconds of one block,
of the part before and of the part after.

A configuration (:func:`simulate`):

- pipeline stages get the block counts that minimise the slowest stage, the first also holding
  the part before and the last the part after (:func:`autopar.cost.step_terms.stage_layers`);
  recomputation adds each layer's forward again to its backward (``full``: every layer, of
  every block class), or only the attention cores (``selective``); zero-bubble's split backward
  costs the device profile's ``zb_split_overhead`` more; the schedule simulator (:mod:`autopar.cost.pp_sim`) runs the
  ``B / (dp*b)`` micro-batches through them with p2p of one block boundary's activation at the
  tensor layout's share; without a pipeline the one stage runs the micro-batches in turn;
- the data axis, the optimizer step and the memory a device holds are priced as the runtime
  spends them (:mod:`autopar.cost.step_terms`: gradients reduced in fp32, parameters gathered
  in the compute dtype; once per step inside a pipeline, per micro-batch without one; ZeRO-1
  at the optimizer step); memory is each pipeline rank's, from its own stages, with the
  activations the schedule keeps in flight on it.

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
from autopar.cost.op_cost import node_seconds
from autopar.cost.step_terms import (DataBytes, device_memory, lone_stage_data_axis, optimizer_bytes, optimizer_time,
                                     pipeline_data_axis, stage_layers)
from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate, graph_info, info
from autopar.passes.sharding import is_decision, tensor_inputs
from autopar.core.plans import RECOMPUTE, Config
from autopar.core.placement import REP, Shard

log = logging.getLogger("autopar.hybrid")

SCORE_OPS = {"_softmax", "softmax", "_safe_softmax", "masked_fill", "where", "dropout", "native_dropout", "div", "mul"}


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
        return {"degrees": c.degrees(), **({"cp_kind": c.cp_kind} if c.cp > 1 else {}),
                "zero_stage": c.zero_stage, **({"shard_group": c.shard_group} if c.shard_group else {}),
                "micro_batch_size": c.micro_batch,
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
    padding_flops: float = 0.0        # the experts' work on capacity padding (hardware, not model, FLOPs)
    layer_fwd: float = 0.0            # layers of another block class (before or after the main one):
    layer_saved: float = 0.0          # what full recomputation redoes and frees
    layer_fwd_flops: float = 0.0
    layers: int = 0
    attn_fwd: float = 0.0             # the attention cores (context parallelism multiplies their work)
    attn_bwd: float = 0.0
    attn_flops: float = 0.0
    attn_fwd_flops: float = 0.0
    attn_more: float = 0.0            # on a context axis: the cores' work per rank is (1 + this) x theirs at seq/cp


class ModelFacts:
    """What the simulator reads from one captured, analysed graph (module docstring)."""

    def __init__(self, gm: fx.GraphModule, *, seq: int, dtype: str = "bf16", optimizer_floats: int = 2,
                 attention: str = "flash", layers: int | None = None, moe_routing: str = "capacity") -> None:
        if attention not in ("flash", "materialized"):
            raise ConfigError(f"unknown attention kernel model {attention!r}", expected="flash or materialized")
        if moe_routing not in ("capacity", "dropless"):
            raise ConfigError(f"unknown MoE routing {moe_routing!r}", expected="capacity or dropless",
                              fix="capacity: experts on fixed-capacity buffers as captured; dropless: every "
                                  "routed token and nothing else (runtime/ep.py DroplessMoE)")
        self.attention = attention
        # ``capacity``: the experts run on [E, C] slots and the exchange moves those buffers, as the
        # graph captured them; ``dropless``: the runtime's dropless layer (runtime/ep.py) computes and
        # sends each routed (token, expert) pair and nothing else
        self.moe_routing = moe_routing
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
        # with fewer (:func:`autopar.cli.workload.capture_for_planning`); every per-block figure is
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
        # values of the part before read by exactly one block (the first): their conversions
        self._entry = {n for n in nodes if self.where[n] == "pre" and n.op == "call_function"
                       and len({info(u).block_member for u in n.users if self.where.get(u) == "block"}) == 1}
        self.params: dict[str, float] = {"pre": 0.0, "block": 0.0, "post": 0.0}
        self._param_nodes = [n for n in nodes if n.op == "placeholder" and info(n).kind == "param"]
        self._cache: dict[tuple[int, int, Any], dict[str, _Part]] = {}
        self._numel: dict[tuple[int, int], dict[str, float]] = {}
        self._solved: dict[tuple[int, str], Mapping[str, Any]] = {}
        self._share: dict[tuple[int, int], float] = {}
        self._first: dict[str, int] = {}
        self._first_node: dict[str, fx.Node] = {}
        for i, n in enumerate(nodes):
            self._first.setdefault(info(n).block_member, i)
            self._first_node.setdefault(info(n).block_member, n)
        self.hidden = 1
        for n in nodes:
            if self.where.get(n) == "block" and info(n).values and len(info(n).values[0].shape) == 3:
                self.hidden = int(evaluate(info(n).values[0].shape[-1], {"batch": 1, "seq": 1}))
                break
        self.symbols = {str(s) for s in ginfo.symbols}
        # one block's attention cores: (query shape, key shape, causal), sizes as formulas
        first_member = min(self.members, key=lambda m: self._first.get(m, 0))
        from autopar.passes.cp_rewrite import attention_ops
        self.attention_ops = [(q, k, causal) for _, q, k, causal in
                              attention_ops(gm, lambda n: info(n).block_member == first_member)]
        self.experts = math.gcd(*[r.num_experts for r in ginfo.moe_regions]) if ginfo.moe_regions else 0
        self._regions = {r.fqn: r for r in ginfo.moe_regions}
        self.expert_params = {f for r in ginfo.moe_regions for f in r.expert_params}
        self._captured_fp32 = any(info(n).values[0].dtype == torch.float32 for n in self._param_nodes[:1])
        self.logits = _logits(gm, self.hidden)

    def sizes(self, micro_batch: int, seq: int | None = None) -> dict[str, int]:
        return {"batch": micro_batch, "seq": seq or self.seq}

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

    def boundary_share(self, tp: int, strategies: Mapping[str, Any]) -> float:
        """The fraction of a block-boundary activation one tensor rank holds (and sends to the next
        pipeline stage, and keeps as a recomputed block's input): ``1/tp`` when the tensor layout
        leaves the residual stream sharded between blocks (sequence parallel), else 1."""
        if tp == 1 or not strategies:
            return 1.0
        key = (tp, id(strategies))
        if key not in self._share:
            self._share[key] = 1.0
            members = sorted(self.members, key=lambda m: self._first.get(m, 0))
            second = members[1] if len(members) > 1 else None
            for n in self.gm.graph.nodes:
                if info(n).block_member != second or not is_decision(n):
                    continue
                for arg in tensor_inputs(n):
                    src = strategies.get(arg.name)
                    if info(arg).block_member != second and src is not None and src.outputs:
                        self._share[key] = 1.0 / tp if isinstance(src.outputs[0].value, Shard) else 1.0
                        return self._share[key]
        return self._share[key]

    def _reader_part(self, param: fx.Node) -> str:
        for u in param.users:
            w = self.where.get(u)
            if w is not None:
                return w
        return "pre"

    def parts(self, tp: int, micro_batch: int, cluster: Cluster, axes: tuple[tuple[str, int], ...],
              *, exact: bool = True, seq: int | None = None) -> tuple[dict[str, _Part], Mapping[str, Any]]:
        """Per micro-batch: seconds, FLOPs and saved bytes of the part before, one block, after.
        The tensor layout is the solver's at this micro-batch size; ``exact=False`` prices the
        micro-batch-1 layout instead (one solve per degree: the search ranks with it and
        re-scores its finalists exactly). ``seq``: the tokens of each sequence a rank holds (a
        context axis's share; default the whole sequence)."""
        seq = seq or self.seq
        key = (tp, micro_batch, cluster.name, exact or tp == 1 or micro_batch == 1) + ((seq,) if seq != self.seq else ())
        if key in self._cache:
            return self._cache[key]
        layout_mb = micro_batch if exact else 1
        from autopar.cost.tp_solver import SolverConfig, Pricer, solve

        at = self.sizes(micro_batch, seq)
        strategies: Mapping[str, Any] = {}
        pricer = None
        if tp > 1:
            # the solver's layout changes with the token count (a collective's latency weighs
            # less against more tokens): solved at this micro-batch size
            skey = (tp, layout_mb, cluster.name, seq)
            if skey not in self._solved:
                t0 = time.perf_counter()
                cfg = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=self.sizes(layout_mb, seq),
                                   dtype=self.dtype)
                self._solved[skey] = solve(self.gm, cfg).strategies
                log.info("tensor layout at tp=%d, micro-batch %d solved in %.2fs", tp, layout_mb,
                         time.perf_counter() - t0)
            strategies = self._solved[skey]
            cfg = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=at, dtype=self.dtype)
            pricer = Pricer(self.gm, cfg)
        dev = cluster.device
        # a graph captured in fp32 and run in 16-bit moves half the bytes it records
        width = 0.5 if self.dtype in ("bf16", "fp16") and self._captured_fp32 else 1.0
        parts = {"pre": _Part(), "block": _Part(), "post": _Part()}
        buffers: set[fx.Node] = set()
        members: set[str] = set()
        converted: set[tuple[fx.Node, Any]] = set()
        for n in self.gm.graph.nodes:
            if not is_decision(n):
                continue
            rec = info(n)
            p = parts[self.where[n]]
            s = strategies.get(n.name)
            work = s.work if s is not None else 1.0
            ff = float(evaluate(rec.flops_fwd, at))
            fb = float(evaluate(rec.flops_bwd, at)) if rec.requires_grad else 0.0
            extra = (0.0, 0.0)
            score_saved = 0.0
            sdpa = _is_sdpa(n)
            square = 1.0
            if self.attention == "materialized" and sdpa:
                # the two GEMMs compute every query-key pair, masked or not: the whole square
                if _causal(n):
                    sq = float(evaluate(info(n.args[0]).values[0].shape[-2], at))
                    square = 2 * sq / (sq + 1)
                    ff, fb = ff * square, fb * square
                scores = _score_bytes(n, at, self.dtype) * work
                extra = (SCORE_PASSES_FWD * scores, SCORE_PASSES_BWD * scores)
                # held for backward: the probabilities and the dropout output in the compute
                # dtype and the 1-byte dropout mask (Korthikanti et al. 2022, section 4.1)
                score_saved = 2 * scores + scores / (2 if self.dtype in ("bf16", "fp16") else 4)
            f, b = node_seconds(n, at, dev, self.dtype, strategy=s, n=tp, width=width, extra_bytes=extra,
                                attention=self.attention, flops_scale=square)
            saved = float(evaluate(rec.saved_bytes, at)) * work * width + score_saved
            # the experts run on [E, C] slots, of which tokens x top_k are routed tokens: the rest
            # is padding (capacity), hardware work but not model FLOPs; dropless, the routed
            # pairs alone are computed, held and sent
            share = self._routed_share(rec.moe_region, at) if rec.moe_role == "expert" else 1.0
            routed = share if self.moe_routing == "dropless" else 1.0
            f, b, ff, fb, saved = f * routed, b * routed, ff * routed, fb * routed, saved * routed
            p.fwd += f
            p.bwd += b
            if rec.moe_role == "expert":
                if routed == 1.0:
                    p.padding_flops += (ff + fb) * (1 - share)
                p.expert_fwd += f
                p.expert_bwd += b
                f1, b1 = node_seconds(n, at, dev, self.dtype, width=width)
                p.expert_fwd1 += f1 * routed
                p.expert_bwd1 += b1 * routed
                buf = n.args[0] if n.target is torch.ops.aten.bmm.default else None
                if buf is not None and info(buf).moe_role != "expert" and buf not in buffers:
                    buffers.add(buf)          # the dispatch buffer entering the experts (dropless: its routed rows)
                    p.a2a_bytes += float(evaluate(info(buf).values[0].nbytes, at)) * width * routed
            p.saved += saved
            p.flops += ff + fb
            p.fwd_flops += ff
            if sdpa:
                # a context axis of cp = S / t ranks: each rank's t queries see all S keys, i.e.
                # cp x the local core's pairs, or under a causal mask (S + 1) / (t + 1) x them
                # (the S (S + 1) / 2 pairs below the diagonal, dealt evenly by the load-balanced layout)
                t_, s_ = float(seq), float(self.seq)
                p.attn_more = ((s_ + 1) / (t_ + 1) if _causal(n) else s_ / t_) - 1
                p.attn_fwd += f
                p.attn_bwd += b
                p.attn_flops += ff + fb
                p.attn_fwd_flops += ff
            if self.where[n] != "block" and rec.block_member is not None:
                p.layer_fwd += f
                p.layer_saved += saved
                p.layer_fwd_flops += ff
                members.add(rec.block_member)
                p.layers = len({m for m in members if self.where.get(self._first_node[m]) == self.where[n]})
            if _is_score_op(n) or score_saved:
                # what selective recomputation redoes and frees: the ops between the two
                # attention matmuls, or a materialising attention's whole core
                p.score_fwd += f
                p.score_saved += saved if not score_saved else score_saved
            if pricer is not None and s is not None:
                for j, arg in enumerate(tensor_inputs(n)):
                    src = strategies.get(arg.name)
                    if src is None or j >= len(s.inputs) or not src.outputs or (arg, s.inputs[j]) in converted:
                        continue
                    # the runtime converts a value once per placement its readers need
                    # (passes/tp_rewrite.py): q, k and v share the gather of their normed input
                    converted.add((arg, s.inputs[j]))
                    t = pricer.convert(arg, 0, src.outputs[0], s.inputs[j]) * width
                    # a value of the part before is converted once, on the first stage, however
                    # many blocks read it: charged to the part before (not to every counted copy)
                    q = parts["pre"] if arg in self._entry or self.where.get(arg) == "pre" else p
                    q.comm_fwd += t / 2
                    q.comm_bwd += t / 2
        if self.logits is not None:
            self._add_loss(parts["post"], at, dev, strategies, pricer, width)
        blk = parts["block"]
        for name in blk.__dataclass_fields__:
            if name != "attn_more":
                setattr(blk, name, getattr(blk, name) / self.captured_layers)
        self._cache[key] = (parts, strategies)
        return parts, strategies


    def _routed_share(self, region: str | None, at: Mapping[str, int]) -> float:
        """Of an MoE region's expert slots (experts x capacity), the share routed tokens fill
        (tokens x top_k of them; 1 without a fixed capacity)."""
        r = self._regions.get(region or "")
        if r is None or r.capacity is None:
            return 1.0
        slots = float(evaluate(r.capacity, at)) * r.num_experts
        return min(1.0, at["batch"] * at["seq"] * r.top_k / slots) if slots > 0 else 1.0

    def _add_loss(self, post: _Part, at: Mapping[str, int], dev, strategies: Mapping[str, Any], pricer,
                  width: float) -> None:
        """The training loss the graph leaves out when it returns logits (:func:`_logits`):
        cross-entropy computed as training loops and ``transformers`` compute it, in fp32 on every
        rank's whole logits (the tensor rewrite returns graph outputs replicated, so a split head
        is first gathered). Per logit: forward, the fp32 copy (read w, write 4 bytes) and the
        log-softmax (two reads and a write of 4); backward, its gradient (read the saved output
        and write, 8, plus the incoming 4) and the cast back (read 4, write w). Held from forward
        to backward: the logits (w) and the log-softmax output (4). In an fp32 run the casts are
        no-ops."""
        from autopar.cost.compute import op_time
        elems = float(evaluate(info(self.logits).values[0].numel, at))
        w = 2.0 if self.dtype in ("bf16", "fp16") else 4.0
        cast = (w + 4.0) if w < 4 else 0.0
        f = op_time(0.0, (cast + 12.0) * elems, dev, "fp32") + (dev.kernel_overhead_s if cast else 0.0)
        b = op_time(0.0, (12.0 + cast) * elems, dev, "fp32") + (dev.kernel_overhead_s if cast else 0.0)
        post.fwd += f
        post.bwd += b
        post.saved += (w + 4.0) * elems
        src = strategies.get(self.logits.name)
        if pricer is not None and src is not None and src.outputs and isinstance(src.outputs[0].value, Shard):
            t = pricer.convert(self.logits, 0, src.outputs[0], REP) * width
            post.comm_fwd += t / 2
            post.comm_bwd += t / 2


def _logits(gm: fx.GraphModule, hidden: int) -> fx.Node | None:
    """The graph output a loss is computed from when the graph computes none: its largest
    floating-point output of three dims whose last (the vocabulary) is wider than the hidden
    size; None when the graph returns a scalar (its own loss) or no such output."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values: list[fx.Node] = []
    fx.node.map_arg(out.args, values.append)
    best = None
    for v in values:
        vals = info(v).values
        if not vals or not vals[0].dtype.is_floating_point:
            continue
        shape = vals[0].shape
        if len(shape) == 0:
            return None                    # the model returns its loss: it is in the graph
        if len(shape) == 3 and int(evaluate(shape[-1], {"batch": 1, "seq": 1})) > hidden and \
                (best is None or int(evaluate(shape[-1], {"batch": 1, "seq": 1})) >
                 int(evaluate(info(best).values[0].shape[-1], {"batch": 1, "seq": 1}))):
            best = v
    return best


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


def _causal(node: fx.Node) -> bool:
    return bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))


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


def mesh_axes(c: Config, cluster: Cluster | None = None) -> tuple[tuple[str, int], ...]:
    # tp innermost (inside a node), then cp, then dp, then pp outermost, as Megatron lays ranks out
    return (("pp", c.pp), ("dp", c.dp), ("cp", c.cp), ("tp", c.tp)) if c.cp > 1 else \
        (("pp", c.pp), ("dp", c.dp), ("tp", c.tp))


def _data_view(c: Config) -> tuple[Config, tuple[tuple[str, int], ...]]:
    """The data axis as the runtime runs it: gradients averaged (and ZeRO sharded) over dp x cp."""
    if c.cp == 1:
        return c, mesh_axes(c)
    from dataclasses import replace
    return replace(c, dp=c.dp * c.cp, cp=1), (("pp", c.pp), ("dp", c.dp * c.cp), ("tp", c.tp))


def simulate(facts: ModelFacts, cluster: Cluster, c: Config, *, batch: int,
             budget: float | None = None, fast: bool = False) -> Score:
    """Score one configuration (module docstring) at global ``batch``. ``fast`` replaces the
    event simulation of the pipeline by its closed form (exact for uniform stages, a close
    estimate otherwise) and prices the micro-batch-1 tensor layout: the search ranks with it
    and re-scores its finalists exactly."""
    from autopar.cost.pp_sim import StageCosts
    from autopar.cost.pp_steady import run as run_schedule

    if c.recompute not in RECOMPUTE:
        raise ConfigError(f"unknown recompute {c.recompute!r}", expected=", ".join(RECOMPUTE))
    devices = c.dp * c.cp * c.tp * c.pp
    if c.cp > 1 and (facts.seq % (2 * c.cp) or not facts.attention_ops):
        raise ConfigError(f"cp={c.cp} needs attention and a sequence of a multiple of {2 * c.cp} tokens",
                          where="config", got=f"seq {facts.seq}")
    if batch % (c.dp * c.micro_batch):
        raise ConfigError(f"batch {batch} does not split into dp={c.dp} x micro-batch {c.micro_batch}",
                          where="config", fix="pick a micro-batch size dividing batch / dp")
    m = batch // (c.dp * c.micro_batch)
    stages = c.pp * c.virtual
    if facts.layers < stages:
        raise ConfigError(f"{facts.layers} layers cannot fill {stages} pipeline stages", where="config",
                          fix="pick pp * virtual stages of at most the layer count")
    if c.shard_group and (c.pp > 1 or c.ep > 1 or c.zero_stage < 2 or (c.dp * c.cp) % c.shard_group):
        raise ConfigError(f"hybrid sharding (shard_group={c.shard_group}) needs ZeRO-2/3, no pipeline and no "
                          f"expert axis, and a group dividing dp x cp = {c.dp * c.cp}", where="config",
                          got=f"zero {c.zero_stage}, pp {c.pp}, ep {c.ep}",
                          fix="drop the shard group, or pick ZeRO-3 without pp and ep")
    if c.ep > 1 and (not facts.experts or facts.experts % c.ep or c.dp % c.ep):
        raise ConfigError(f"ep={c.ep} must divide the expert count and dp", where="config")
    # without a pipeline the runtime runs each micro-batch's forward and backward in turn
    sched = c.schedule if c.pp > 1 else "1f1b"
    if sched == "interleaved" and (c.virtual < 2 or m % c.pp):
        raise ConfigError("interleaved needs virtual >= 2 and micro-batches a multiple of pp", where="config")
    axes = mesh_axes(c, cluster)
    parts, strategies = facts.parts(c.tp, c.micro_batch, cluster, axes, exact=not fast, seq=facts.seq // c.cp)
    pre, blk, post = parts["pre"], parts["block"], parts["post"]
    ep_comm = 0.0
    if c.ep > 1:
        tp_only = blk.comm_fwd + blk.comm_bwd
        blk = _with_experts(blk, c, cluster)
        ep_comm = blk.comm_fwd + blk.comm_bwd - tp_only
    if c.cp > 1:
        from autopar.cost.cp_planner import block_costs
        kind, cp_fwd, cp_bwd, _ = block_costs(facts, c, cluster, axes, c.cp_kind)
        blk = _with_context(blk, c.cp, cp_fwd, cp_bwd)
        from dataclasses import replace as _replace
        c = _replace(c, cp_kind=kind)
    re_blk = {"none": 0.0, "selective": blk.score_fwd, "full": blk.fwd + blk.comm_fwd}[c.recompute]
    dev = cluster.device
    split = 1.0 + dev.zb_split_overhead if sched == "zb" else 1.0     # torch's split backward, both planners
    blk_f, blk_b = blk.fwd + blk.comm_fwd, (blk.bwd + blk.comm_bwd) * split + re_blk
    full = c.recompute == "full"          # every layer, of the main block class or another one
    pre_f, pre_b = pre.fwd + pre.comm_fwd, (pre.bwd + pre.comm_bwd) * split + full * pre.layer_fwd
    post_f, post_b = post.fwd + post.comm_fwd, (post.bwd + post.comm_bwd) * split + full * post.layer_fwd
    counts = stage_layers(facts.layers, stages, blk_f + blk_b, pre_f + pre_b, post_f + post_b)
    fwd = [counts[s] * blk_f + (pre_f if s == 0 else 0.0) + (post_f if s == stages - 1 else 0.0)
           for s in range(stages)]
    bwd = [counts[s] * blk_b + (pre_b if s == 0 else 0.0) + (post_b if s == stages - 1 else 0.0)
           for s in range(stages)]
    share = facts.boundary_share(c.tp, strategies)
    acts = _stage_activations(facts, c, counts, blk, pre, post, share)
    act_bytes = _boundary_bytes(facts, c) * share
    p2p = collective_time("send_recv", act_bytes, cluster, axes, "pp") if c.pp > 1 else 0.0
    if fast:
        result = _closed_form(sched, c.pp, c.virtual, m, fwd, bwd, p2p, acts)
    else:
        result = run_schedule(sched, c.pp, m, c.virtual,   # event-simulated, or extended past 256 micro-batches
                              StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), p2p_s=p2p,
                                         activation_bytes=tuple(acts)))
    pipe = result.step_time_s
    # parameters per device: its stages' blocks, and the parts before and after where it holds them
    numel = facts.param_numel(c.tp, strategies)
    per_block = numel["block"]
    expert_block = 0.0
    if c.ep > 1:   # experts kept whole on tp, 1/ep of them per rank; the dense rest as before
        expert_block = numel["expert_whole"] / c.ep
        per_block = numel["block"] - numel["expert"] + expert_block
    held = [sum(counts[s] * per_block + (numel["pre"] if s == 0 else 0.0)
                + (numel["post"] if s == stages - 1 else 0.0) for s in range(d, stages, c.pp))
            for d in range(c.pp)]
    experts = [sum(counts[s] for s in range(d, stages, c.pp)) * expert_block for d in range(c.pp)]
    working = blk.saved if c.recompute == "full" else 0.0     # one block's, while it is recomputed
    data_c, data_axes = _data_view(c)
    mems = [_with_reserve(device_memory(facts, data_c, held[d], result.peak_activation_bytes[d] + working,
                                        per_block, numel), c, dev)
            for d in range(c.pp)]
    worst = max(range(c.pp), key=lambda d: sum(mems[d].values()))
    mem = mems[worst]
    # the data axis and the optimizer: the slowest device's (the one holding the most parameters)
    d_big = max(range(c.pp), key=lambda d: held[d])
    stage_params = held[d_big]
    bytes_ = DataBytes.of(facts, stage_params, experts[d_big])
    if c.pp > 1:
        chunk_bwd = tuple(bwd[s] for s in range(d_big, stages, c.pp)) if sched == "interleaved" else ()
        dp_comm, exposed = pipeline_data_axis(data_c, cluster, data_axes, bytes_, chunk_bwd, min(c.pp, m))
    else:
        dp_comm, exposed = lone_stage_data_axis(data_c, cluster, data_axes, bytes_, m, fwd[0], bwd[0])
    pieces = (c.shard_group if 0 < c.shard_group < data_c.dp and c.zero_stage >= 2 else data_c.dp) \
        if c.zero_stage >= 1 else 1
    optim = optimizer_time(stage_params / pieces, optimizer_bytes(facts.dtype, facts.k), cluster)
    # a hidden collective still slows the compute beside it (its kernels hold SMs and HBM bandwidth)
    contention = dev.comm_contention * max(0.0, dp_comm - exposed)
    step = pipe + exposed + optim + contention
    peak = sum(mem.values())
    fits = budget is None or peak <= budget
    samples = batch / c.micro_batch * c.cp         # the parts are per micro-batch, per cp rank's share
    # model FLOPs count the routed tokens' expert work, hardware FLOPs the capacity padding too
    padding = (pre.padding_flops + post.padding_flops + facts.layers * blk.padding_flops) * samples
    model_flops = (pre.flops + post.flops + facts.layers * blk.flops) * samples - padding
    hw_flops = model_flops + padding + samples * (facts.layers * blk.fwd_flops + pre.layer_fwd_flops
                                                  + post.layer_fwd_flops) * (c.recompute == "full")
    peak_flops = cluster.device.peak(facts.dtype)
    tput = model_flops / step / devices
    return Score(config=c, step_time_s=step, microbatches=m, model_flops=model_flops, hw_flops=hw_flops,
                 tflops_per_device=tput / 1e12, hw_tflops_per_device=hw_flops / step / devices / 1e12,
                 mfu=tput / peak_flops, peak_memory_bytes=peak, memory=mem,
                 bubble_fraction=result.bubble_fraction, exposed_comm_s=exposed, fits=fits,
                 parts={"pipeline_s": pipe, "dp_comm_s": dp_comm, "dp_exposed_s": exposed, "optimizer_s": optim,
                        "contention_s": contention,
                        **({"cp_comm_per_block_s": cp_fwd + cp_bwd} if c.cp > 1 else {}),
                        **({"ep_comm_per_block_s": ep_comm} if c.ep > 1 else {}),
                        "tp_comm_per_block_s": blk.comm_fwd + blk.comm_bwd - ep_comm
                        - (cp_fwd + cp_bwd if c.cp > 1 else 0.0), "block_fwd_s": blk.fwd,
                        "block_bwd_s": blk.bwd, "stage_fwd_s": fwd, "stage_bwd_s": bwd, "p2p_s": p2p,
                        "stage_layers": list(counts), "device_memory_bytes": mems})


@dataclass(frozen=True)
class _Pipe:
    step_time_s: float
    bubble_fraction: float
    peak_activation_bytes: tuple[float, ...]


def _closed_form(sched: str, p: int, v: int, m: int, fwd: list[float], bwd: list[float], p2p: float,
                 acts: list[float]) -> _Pipe:
    """Pipeline time without the event simulation: the busiest device works ``m`` times its
    share, plus the fill and drain through the other stages (zb hides the weight-gradient half
    of backward in the drain). Activations: each stage holds as many micro-batches as the
    schedule keeps in flight on it (all ``m`` under GPipe and under interleaved 1F1B with
    ``m == p``, ``p - device`` under 1F1B, ``p`` on every device under zero-bubble)."""
    dev = [sum(fwd[s] + bwd[s] for s in range(d, p * v, p)) for d in range(p)]
    busy = max(dev)
    chunk = [(f + b) for f, b in zip(fwd, bwd)]
    fill = sum(sorted(chunk)[:-1]) / max(1, v) if p > 1 else 0.0
    if sched == "zb":
        fill = sum(sorted(f + b / 2 for f, b in zip(fwd, bwd))[:-1])
    step = busy * m / 1.0 + fill + 2 * (p - 1) * p2p
    step = max(step, busy * m)
    # interleaved with m == p warms up with every forward (Megatron's rule, cost/pp_sim.py)
    everything = sched == "gpipe" or (sched == "interleaved" and m == p)
    # zero-bubble (ZB-H1) holds back d weight-gradients on device d: min(p, m) on every device
    inflight = [m if everything else min(m, p) if sched == "zb" else min(m, (p - s % p) * (1 if v == 1 else 2))
                for s in range(p * v)]
    peak = tuple(sum(inflight[s] * acts[s] for s in range(d, p * v, p)) for d in range(p))
    return _Pipe(step_time_s=step, bubble_fraction=(step - busy * m) / (busy * m), peak_activation_bytes=peak)


def _with_reserve(mem: dict[str, float], c: Config, dev) -> dict[str, float]:
    """``mem`` with what the process holds beside its tensors (the device profile's figures,
    :data:`autopar.cost.hardware.RUNTIME_NOTES`): the CUDA context and library workspaces, the
    buffers of each communicator the rank is in (one per mesh axis of more than one rank, and
    the data axis's dp x cp group under context parallelism), and the caching allocator's slack
    on what it hands out."""
    groups = sum(d > 1 for d in (c.pp, c.dp, c.cp, c.tp, c.ep)) + (c.cp > 1 and c.dp > 1)
    held = sum(mem.values())
    return {**mem, "reserve": dev.reserve_bytes + groups * dev.comm_buffer_bytes + dev.fragmentation * held}


def _with_experts(blk: _Part, c: Config, cluster: Cluster) -> _Part:
    """One block under expert parallelism: the experts stay whole on the tensor axis (the
    runtime keeps them so), and each MoE layer exchanges its token buffer four times per
    micro-batch (dispatch and combine, forward and backward) over the ep axis."""
    from dataclasses import replace
    axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep), ("tp", c.tp))
    a2a = collective_time("all_to_all", blk.a2a_bytes, cluster, axes, "ep") if blk.a2a_bytes else 0.0
    return replace(blk, fwd=blk.fwd - blk.expert_fwd + blk.expert_fwd1, bwd=blk.bwd - blk.expert_bwd + blk.expert_bwd1,
                   comm_fwd=blk.comm_fwd + 2 * a2a, comm_bwd=blk.comm_bwd + 2 * a2a)


def _with_context(blk: _Part, cp: int, comm_fwd: float, comm_bwd: float) -> _Part:
    """One block's share on a context axis of ``cp``: the parts were priced at ``seq / cp``
    tokens, so everything token-wise is this rank's; attention has each local query see the
    whole sequence's keys (``cp`` times the local cores' work, ``(S + 1) / (S / cp + 1)`` times
    under a causal mask: :attr:`_Part.attn_more`), and its exchanges add
    ``comm_fwd`` / ``comm_bwd`` (the kind's exposed seconds, ``cost/cp_planner.py``)."""
    from dataclasses import replace
    more = blk.attn_more
    return replace(blk, fwd=blk.fwd + more * blk.attn_fwd, bwd=blk.bwd + more * blk.attn_bwd,
                   flops=blk.flops + more * blk.attn_flops, fwd_flops=blk.fwd_flops + more * blk.attn_fwd_flops,
                   comm_fwd=blk.comm_fwd + comm_fwd, comm_bwd=blk.comm_bwd + comm_bwd)


def timeline_of(facts: ModelFacts, cluster: Cluster, c: Config, *, batch: int):
    """The event simulation of ``c``'s pipeline (for the timeline picture)."""
    from autopar.cost.pp_sim import StageCosts, make
    from autopar.cost.pp_sim import simulate as run_schedule
    score = simulate(facts, cluster, c, batch=batch)
    fwd, bwd = score.parts["stage_fwd_s"], score.parts["stage_bwd_s"]
    sched = c.schedule if c.pp > 1 else "1f1b"
    return run_schedule(make(sched, c.pp, score.microbatches, c.virtual),
                        StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), p2p_s=score.parts["p2p_s"]))


def _boundary_bytes(facts: ModelFacts, c: Config) -> float:
    """One micro-batch's activation at a block boundary: batch x seq x hidden in the compute dtype
    (this rank's ``seq / cp`` tokens on a context axis)."""
    width = 2 if facts.dtype in ("bf16", "fp16") else 4
    return float(c.micro_batch * (facts.seq // c.cp) * facts.hidden * width)


def _stage_activations(facts: ModelFacts, c: Config, counts: list[int], blk: _Part, pre: _Part,
                       post: _Part, share: float) -> list[float]:
    """Bytes one micro-batch leaves held on each stage from its forward to its backward: every
    block's saved activations (``none``), less the attention scores (``selective``), or only
    each block's input (``full``); the first stage also holds what the part before saves and
    the last what the part after saves (the logits). Without a pipeline the one stage runs one
    micro-batch at a time (gradient accumulation), so this is its whole activation memory."""
    stages = len(counts)
    boundary = _boundary_bytes(facts, c) * share
    per_block = {"none": blk.saved, "selective": blk.saved - blk.score_saved, "full": boundary}[c.recompute]

    def outer(p: _Part) -> float:      # the part before or after, its other layers recomputed under full
        return p.saved - p.layer_saved + p.layers * boundary if c.recompute == "full" else p.saved
    return [counts[s] * per_block + (outer(pre) if s == 0 else 0.0) + (outer(post) if s == stages - 1 else 0.0)
            for s in range(stages)]


__all__ = ["Config", "Score", "ModelFacts", "mesh_axes", "simulate", "timeline_of", "RECOMPUTE"]

del asdict
