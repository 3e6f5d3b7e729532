"""What the hybrid simulator (:mod:`autopar.cost.hybrid`) reads from one captured, analysed graph.

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
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.op_cost import node_seconds
from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate, graph_info, info
from autopar.core.placement import REP, Shard, transition
from autopar.passes.sharding import is_decision, tensor_inputs

log = logging.getLogger("autopar.hybrid")

SCORE_OPS = {"_softmax", "softmax", "_safe_softmax", "masked_fill", "where", "dropout", "native_dropout", "div", "mul"}


@dataclass
class BlockPart:
    """One part of the model (the part before the blocks, one block, the part after) per
    micro-batch on one rank: seconds, FLOPs, bytes held, and the shares the simulator's
    options need apart (attention scores, experts, other block classes, attention cores)."""

    fwd: float = 0.0
    bwd: float = 0.0
    score_fwd: float = 0.0            # what selective recomputes outside eager cores: score ops, attention kernels
    flash_fwd: float = 0.0            # ... of which fused attention kernels (a context axis's attention: not re-run)
    core_fwd: float = 0.0             # eager attention cores: run again in backward (their layer's, if recomputed)
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
    top_k: int = 0                    # experts per token of the MoE layer (dropless: pairs = tokens x top_k)
    padding_flops: float = 0.0        # the experts' work on capacity padding (hardware, not model, FLOPs)
    layer_fwd: float = 0.0            # layers of another block class (before or after the main one):
    layer_saved: float = 0.0          # what full recomputation redoes and frees
    layer_fwd_flops: float = 0.0
    kept_fwd: float = 0.0             # the matmuls and attention (``pointwise`` recomputation keeps
    kept_saved: float = 0.0           # their outputs and runs the rest again): time, output bytes,
    kept_fwd_flops: float = 0.0       # FLOPs
    layer_kept_fwd: float = 0.0       # ... of the layers of another block class
    layer_kept_saved: float = 0.0
    layers: int = 0
    attn_fwd: float = 0.0             # the attention cores (context parallelism multiplies their work)
    attn_bwd: float = 0.0
    attn_flops: float = 0.0
    attn_fwd_flops: float = 0.0
    attn_more: float = 0.0            # on a context axis: the cores' work per rank is (1 + this) x theirs at seq/cp


def _splits_last(s: Any, n: fx.Node) -> bool:
    """Whether strategy ``s`` leaves ``n``'s output split along its last dimension."""
    v = s.outputs[0].value if s.outputs else None
    nd = len(info(n).values[0].shape) if info(n).values else 0
    return isinstance(v, Shard) and nd > 0 and v.dim % nd == nd - 1


class ModelFacts:
    """What the simulator reads from one captured, analysed graph (module docstring)."""

    def __init__(self, gm: fx.GraphModule, *, seq: int, dtype: str = "bf16", optimizer_floats: int = 2,
                 attention: str = "flash", layers: int | None = None, moe_routing: str = "capacity",
                 moe_node_limit: int | None = None) -> None:
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
        # the model's routing sends a token's experts to at most this many nodes (DeepSeek-V3's
        # group-limited routing with one group per node: 4); None: anywhere. Read by the two-hop
        # exchange's pricing (cost/hybrid.py), which sends a token once per node it reaches
        if moe_node_limit is not None and not (isinstance(moe_node_limit, int) and moe_node_limit >= 1):
            raise ConfigError(f"moe_node_limit must be a node count >= 1, got {moe_node_limit!r}",
                              where="moe_node_limit", fix="e.g. 4 (DeepSeek-V3), or None for unrestricted routing")
        self.moe_node_limit = moe_node_limit
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
        self._cache: dict[tuple[int, int, Any], dict[str, BlockPart]] = {}
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
        from autopar.runtime.recompute import eager_attention_cores
        self._cores = set(eager_attention_cores(gm))     # checkpointed by the runtime (runtime/recompute.py)
        from autopar.passes.fusion import matches
        from autopar.passes.flops import is_view_like
        from autopar.runtime.fused import autopar_norm_linear, autopar_rms_norm
        fused = matches(gm)
        # norm outputs the fused projections recompute in backward (passes/fusion.py): where the
        # tensor axis gathers one for them (sequence parallelism), backward gathers it again
        self._regathered = {m.args[0] for m in fused if m.target is autopar_norm_linear}
        # what a fused norm does not keep (its normalised rows; its output, for projections; the
        # memory pass leaves them out): where a layout splits a norm along its own dimension (the
        # last), the rewrite computes it on slices, the pattern is gone and the runtime runs the
        # norm unfused, keeping them (:meth:`_norm_kept`)
        self._norm_unkept = {u for m in fused if m.target in (autopar_norm_linear, autopar_rms_norm)
                             for u in m.unkept if not is_view_like(u)}
        self.expert_params = {f for r in ginfo.moe_regions for f in r.expert_params}
        self._captured_fp32 = any(info(n).values[0].dtype == torch.float32 for n in self._param_nodes[:1])
        self.logits = logits_node(gm, self.hidden)

    def _norm_kept(self, n: fx.Node, s: Any) -> bool:
        """Whether ``n``, a value a fused norm does not keep, is kept after all under strategy
        ``s``: the layout splits it along its last dimension, so the norm runs unfused."""
        return n in self._norm_unkept and s is not None and _splits_last(s, n)

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
              *, exact: bool = True, seq: int | None = None,
              expert_axis: bool = False) -> tuple[dict[str, BlockPart], Mapping[str, Any]]:
        """Per micro-batch: seconds, FLOPs and saved bytes of the part before, one block, after.
        The tensor layout is the solver's at this micro-batch size; ``exact=False`` prices the
        micro-batch-1 layout instead (one solve per degree: the search ranks with it and
        re-scores its finalists exactly). ``seq``: the tokens of each sequence a rank holds (a
        context axis's share; default the whole sequence). ``expert_axis``: the layout the build
        solves beside an expert axis (:func:`autopar.passes.moe.expert_tensor_pin`: token
        buffers whole, fixed-capacity experts split only off their expert dim, dropless ones
        whole)."""
        seq = seq or self.seq
        pin = expert_axis and tp > 1 and bool(self.experts)
        key = (tp, micro_batch, cluster.name, exact or tp == 1 or micro_batch == 1) + ((seq,) if seq != self.seq else ()) \
            + (("experts",) if pin else ())
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
            skey = (tp, layout_mb, cluster.name, seq, pin)
            if skey not in self._solved:
                t0 = time.perf_counter()
                from autopar.passes.moe import expert_side, expert_tensor_pin
                # the runtime's dropless layer runs its experts whole, a fixed-capacity one may split them
                rule = (expert_side if self.moe_routing == "dropless" else expert_tensor_pin) if pin else None
                cfg = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=self.sizes(layout_mb, seq),
                                   dtype=self.dtype, pinned=rule)
                self._solved[skey] = solve(self.gm, cfg).strategies
                log.info("tensor layout at tp=%d, micro-batch %d solved in %.2fs", tp, layout_mb,
                         time.perf_counter() - t0)
            strategies = self._solved[skey]
            cfg = SolverConfig(n=tp, cluster=cluster, mesh_axes=axes, axis="tp", sizes=at, dtype=self.dtype)
            pricer = Pricer(self.gm, cfg)
        dev = cluster.device
        # a graph captured in fp32 and run in 16-bit moves half the bytes it records
        width = 0.5 if self.dtype in ("bf16", "fp16") and self._captured_fp32 else 1.0
        parts = {"pre": BlockPart(), "block": BlockPart(), "post": BlockPart()}
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
            if self._norm_kept(n, s):
                saved += float(evaluate(rec.fused_bytes, at)) * work * width
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
                    p.top_k = self._regions[rec.moe_region].top_k
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
            if _is_kept(n):
                kept = (float(evaluate(rec.out_bytes, at)) + (_lse_bytes(n, at) if sdpa else 0.0)) * work * width
                if self.where[n] == "block":
                    p.kept_fwd, p.kept_saved, p.kept_fwd_flops = p.kept_fwd + f, p.kept_saved + kept, \
                        p.kept_fwd_flops + ff
                elif rec.block_member is not None:
                    p.layer_kept_fwd, p.layer_kept_saved = p.layer_kept_fwd + f, p.layer_kept_saved + kept
            if self.where[n] != "block" and rec.block_member is not None:
                p.layer_fwd += f
                p.layer_saved += saved
                p.layer_fwd_flops += ff
                members.add(rec.block_member)
                p.layers = len({m for m in members if self.where.get(self._first_node[m]) == self.where[n]})
            if n in self._cores:
                p.core_fwd += f
            if _is_score_op(n) or score_saved:
                # what selective recomputation redoes and frees: the ops between the two
                # attention matmuls, or a materialising attention's whole core
                if n not in self._cores:
                    p.score_fwd += f
                p.score_saved += saved if not score_saved else score_saved
            elif sdpa and n not in self._cores:
                # a flash kernel: selective runs it again too, and frees nothing it keeps (its
                # inputs stay as the region's; its output is the projection's input)
                p.score_fwd += f
                p.flash_fwd += f
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
                    if arg in self._regathered and not _splits_last(src, arg) and \
                            transition(src.outputs[0].value, s.inputs[j].value,
                                       len(info(arg).values[0].shape)).kind == "all_gather":
                        q.comm_bwd += t / 2       # its gather once more, for the recomputed output
        if self.logits is not None:
            self._add_loss(parts["post"], at, dev, strategies, pricer, width)
        blk = parts["block"]
        for name in blk.__dataclass_fields__:
            if name not in ("attn_more", "top_k"):
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

    def _add_loss(self, post: BlockPart, at: Mapping[str, int], dev, strategies: Mapping[str, Any], pricer,
                  width: float) -> None:
        """The training loss the graph leaves out when it returns logits (:func:`logits_node`):
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


def logits_node(gm: fx.GraphModule, hidden: int) -> fx.Node | None:
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


# what ``pointwise`` recomputation keeps: the graph ops that run as matmuls or attention kernels
# (runtime/recompute.KEPT_OPS at dispatch)
_KEPT = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum", "convolution", "conv1d", "conv2d",
         "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}


def _is_kept(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return name in _KEPT or _is_sdpa(node)


def _lse_bytes(node: fx.Node, at: Mapping[str, int]) -> float:
    """The per-row fp32 log-sum-exp a flash kernel returns beside an attention's output."""
    v = info(node).values[0]
    return float(evaluate(v.numel / v.shape[-1], at)) * 4


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


__all__ = ["BlockPart", "ModelFacts", "logits_node", "SCORE_OPS", "SCORE_PASSES_FWD", "SCORE_PASSES_BWD"]
