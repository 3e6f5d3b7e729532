"""The hybrid simulator: one configuration of dp x tp x pp x ep (ZeRO stage, recomputation,
micro-batches, schedule) scored in seconds and bytes. The search over all of them is
:mod:`autopar.cost.plan_search`.

Facts come from the captured graph once (:class:`autopar.cost.model_facts.ModelFacts`, read
per tensor degree and micro-batch size into :class:`~autopar.cost.model_facts.BlockPart` s).

A configuration (:func:`simulate`):

- pipeline stages get the block counts that minimise the slowest stage, the first also holding
  the part before and the last the part after (:func:`autopar.cost.step_terms.stage_layers`);
  recomputation adds each layer's forward again to its backward (``full``: every layer, of
  every block class), or only the attention cores (``selective``); zero-bubble's split backward
  costs the device profile's ``zb_split_overhead`` more; the schedule simulator
  (:mod:`autopar.cost.pp_sim`) runs the ``B / (dp*b)`` micro-batches through them with p2p of one block boundary's activation at the
  tensor layout's share; without a pipeline the one stage runs the micro-batches in turn;
- the data axis, the optimizer step and the memory a device holds are priced as the runtime
  spends them (:mod:`autopar.cost.step_terms`: gradients reduced in fp32, parameters gathered
  in the compute dtype, one call per bucket; once per step inside a pipeline, per micro-batch
  without one; ZeRO-1 at the optimizer step; hybrid sharding's groups); a hidden collective
  still costs the device's contention share of its time; memory is each pipeline rank's, from
  its own stages, with the activations the schedule keeps in flight on it and the device's
  reserve (context, communicator buffers, allocator slack).

Hardware FLOP/s count recomputation; model FLOP/s and MFU do not.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time, flat_time
from autopar.cost.model_facts import BlockPart, ModelFacts
from autopar.cost.step_terms import (DataBytes, device_memory, lone_stage_data_axis, optimizer_bytes, optimizer_time,
                                     pipeline_data_axis, stage_layers)
from autopar.core.errors import ConfigError
from autopar.core.mesh import stage_device
from autopar.core.options import DISPATCH_CHUNKS
from autopar.core.plans import RECOMPUTE, Config, recompute_layers

log = logging.getLogger("autopar.hybrid")


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

    first_k = recompute_layers(c.recompute)        # validates; K of "layers:K"
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
    if sched == "dualpipev" and (c.virtual != 2 or m < 2 * c.pp or c.tp > 1 or c.cp > 1 or c.zero_stage >= 3):
        raise ConfigError("dualpipev needs virtual 2, at least 2 x pp micro-batches, and no tensor or context axis "
                          "or ZeRO-3 (its paired halves run on two threads: runtime/pp_overlap.py)", where="config",
                          got=f"virtual {c.virtual}, {m} micro-batches, tp {c.tp}, cp {c.cp}, ZeRO-{c.zero_stage}")
    placement = "v" if sched == "dualpipev" else "loop"
    mine = [[s for s in range(c.pp * c.virtual) if stage_device(s, c.pp, placement) == d] for d in range(c.pp)]
    axes = mesh_axes(c, cluster)
    parts, strategies = facts.parts(c.tp, c.micro_batch, cluster, axes, exact=not fast, seq=facts.seq // c.cp,
                                    expert_axis=c.ep > 1 and c.pp == 1)
    pre, blk, post = parts["pre"], parts["block"], parts["post"]
    ep_comm = ep_fwd = 0.0
    if c.ep > 1:
        tp_only, tp_fwd = blk.comm_fwd + blk.comm_bwd, blk.comm_fwd
        blk = _with_experts(blk, c, cluster, facts.moe_routing, facts.moe_node_limit, expert_fold(facts, c))
        ep_comm, ep_fwd = blk.comm_fwd + blk.comm_bwd - tp_only, blk.comm_fwd - tp_fwd
    if c.cp > 1:
        from autopar.cost.cp_planner import block_costs
        kind, cp_fwd, cp_bwd, _ = block_costs(facts, c, cluster, axes, c.cp_kind)
        blk = _with_context(blk, c.cp, cp_fwd, cp_bwd)
        from dataclasses import replace as _replace
        c = _replace(c, cp_kind=kind)
    dev = cluster.device
    split = 1.0 + dev.zb_split_overhead if sched == "zb" else 1.0     # torch's split backward, both planners
    blk_f = blk.fwd + blk.comm_fwd
    pointwise = c.recompute == "pointwise"     # every layer's ops but its matmuls and attention again
    # an eager attention core runs again in backward outside whole-layer recomputation (a
    # recomputed layer's forward includes it: see ``redo`` below)
    cores = c.recompute not in ("full", "pointwise")
    # a context axis's attention (what a fused kernel became) is no core selective re-runs
    selective = blk.score_fwd - (blk.flash_fwd if c.cp > 1 else 0.0) if c.recompute == "selective" else 0.0
    blk_b = (blk.bwd + blk.comm_bwd) * split + selective + pointwise * (blk_f - blk.kept_fwd) + cores * blk.core_fwd
    pre_f, pre_b = pre.fwd + pre.comm_fwd, (pre.bwd + pre.comm_bwd) * split \
        + pointwise * (pre.layer_fwd - pre.layer_kept_fwd) + cores * pre.core_fwd
    post_f, post_b = post.fwd + post.comm_fwd, (post.bwd + post.comm_bwd) * split \
        + pointwise * (post.layer_fwd - post.layer_kept_fwd) + cores * post.core_fwd
    full = c.recompute == "full"
    counts = stage_layers(facts.layers, stages, blk_f + blk_b + full * blk_f, pre_f + pre_b + full * pre.layer_fwd,
                          post_f + post_b + full * post.layer_fwd)
    redo = recomputed(counts, pre.layers, post.layers,
                      math.inf if full else first_k or 0)   # (before, blocks, after) per stage

    def again(p: BlockPart, k: int) -> float:    # the part's k recomputed layers of another class
        # (their cores, charged in the part's backward above, run in the layers' forward instead)
        return (p.layer_fwd - cores * p.core_fwd) * k / p.layers if k else 0.0
    fwd = [counts[s] * blk_f + (pre_f if s == 0 else 0.0) + (post_f if s == stages - 1 else 0.0)
           for s in range(stages)]
    bwd = [counts[s] * blk_b + redo[s][1] * (blk_f - cores * blk.core_fwd) + (pre_b + again(pre, redo[s][0]) if s == 0 else 0.0)
           + (post_b + again(post, redo[s][2]) if s == stages - 1 else 0.0) for s in range(stages)]
    share = facts.boundary_share(c.tp, strategies)
    acts = _stage_activations(facts, c, counts, redo, blk, pre, post, share)
    act_bytes = _boundary_bytes(facts, c) * share
    p2p = collective_time("send_recv", act_bytes, cluster, axes, "pp") if c.pp > 1 else 0.0
    # DualPipeV's pairs: each half's expert exchanges (a B's: its own and its recomputation's)
    # travel under the other half's compute, which they still slow by comm_contention
    # (per action, the mean of an F's and a B's: a pair holds one of each)
    hide = [(counts[s] * ep_comm + redo[s][1] * ep_fwd) / 2 * (1 - dev.comm_contention)
            for s in range(stages)] if sched == "dualpipev" else 0.0
    if fast and sched != "dualpipev":
        result = _closed_form(sched, c.pp, c.virtual, m, fwd, bwd, p2p, acts)
    else:
        result = run_schedule(sched, c.pp, m, c.virtual,   # event-simulated, or extended past 256 micro-batches
                              StageCosts(forward_s=tuple(fwd), backward_s=tuple(bwd), p2p_s=p2p,
                                         activation_bytes=tuple(acts), overlap_s=hide))
    pipe = result.step_time_s
    # parameters per device: its stages' blocks, and the parts before and after where it holds them
    numel = facts.param_numel(c.tp, strategies)
    per_block = numel["block"]
    expert_block = 0.0
    if c.ep > 1:   # 1/ep of the experts per rank, as the layout splits them on tp (whole inside a pipeline;
        # dropless layers: whole, 1/(ep x tp) of them where the tensor axis is folded in)
        expert_block = (numel["expert_whole"] if c.pp > 1 else numel["expert"]) / (c.ep * expert_fold(facts, c))
        per_block = numel["block"] - numel["expert"] + expert_block
    held = [sum(counts[s] * per_block + (numel["pre"] if s == 0 else 0.0)
                + (numel["post"] if s == stages - 1 else 0.0) for s in mine[d]) for d in range(c.pp)]
    experts = [sum(counts[s] for s in mine[d]) * expert_block for d in range(c.pp)]
    working = blk.saved if pointwise or any(sum(r) for r in redo) else 0.0   # one block's, while it is recomputed
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
        chunk_bwd = tuple(bwd[s] for s in mine[d_big]) if sched == "interleaved" else ()
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
    hw_flops = model_flops + padding + samples * pointwise * facts.layers * (blk.fwd_flops - blk.kept_fwd_flops) \
        + samples * (sum(r[1] for r in redo) * blk.fwd_flops
                                                  + sum(pre.layer_fwd_flops * r[0] / max(1, pre.layers)
                                                        + post.layer_fwd_flops * r[2] / max(1, post.layers)
                                                        for r in redo))
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
    schedule keeps in flight on it (all ``m`` under GPipe, ``p - device`` under 1F1B, ``p`` on
    every device under zero-bubble, interleaved 1F1B's warm-up and one more)."""
    dev = [sum(fwd[s] + bwd[s] for s in range(d, p * v, p)) for d in range(p)]
    busy = max(dev)
    chunk = [(f + b) for f, b in zip(fwd, bwd)]
    fill = sum(sorted(chunk)[:-1]) / max(1, v) if p > 1 else 0.0
    if sched == "zb":
        fill = sum(sorted(f + b / 2 for f, b in zip(fwd, bwd))[:-1])
    step = busy * m / 1.0 + fill + 2 * (p - 1) * p2p
    step = max(step, busy * m)
    # zero-bubble (ZB-H1) holds back d weight-gradients on device d: min(p, m) on every device
    inflight = [m if sched == "gpipe" else min(m, p) if sched == "zb" else min(m, p - s % p) for s in range(p * v)]
    if sched == "interleaved":
        # device d's peak: its warm-up forwards and the first steady one, in rounds of p
        # micro-batches per chunk (cost/pp_sim.interleaved_1f1b, torch's order)
        inflight = [0] * (p * v)
        for d in range(p):
            for k in range(min(2 * (p - 1 - d) + (v - 1) * p + 1, m * v)):
                inflight[((k // p) % v) * p + d] += 1
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


def expert_fold(facts: ModelFacts, c: Config) -> int:
    """The tensor ranks a configuration's expert exchange folds in (the runtime's
    ``ExpertOptions.fold="auto"``, autopar/build/experts.py): tp where an expert axis sits beside
    it, the layers are dropless and ep x tp divides the experts; else 1."""
    ok = facts.moe_routing == "dropless" and c.ep > 1 and c.tp > 1 and facts.experts % (c.ep * c.tp) == 0
    return c.tp if ok else 1


def _with_experts(blk: BlockPart, c: Config, cluster: Cluster, routing: str = "capacity",
                  node_limit: int | None = None, fold: int = 1) -> BlockPart:
    """One block under expert parallelism: each MoE layer exchanges its tokens four times per
    micro-batch (dispatch and combine, forward and backward) over the ep axis. Without a
    pipeline the experts are as the tensor layout beside an expert axis splits them (expert
    tensor parallelism for fixed-capacity layers: ``ModelFacts.parts(expert_axis=True)``); inside
    a pipeline the runtime keeps them whole on the tensor axis.

    A fixed-capacity layer's exchanges are graph nodes around its experts: exposed. A dropless
    layer's run in :data:`DISPATCH_CHUNKS` token chunks that overlap the experts' compute
    (:class:`autopar.runtime.ep.DroplessMoE`; :func:`overlapped_exchange`), and what is hidden
    still costs ``comm_contention`` of its time. Where the ep axis spans nodes with several of
    its ranks on each, the runtime takes two hops (``ExpertOptions.dispatch="auto"``): a token
    crosses once to each node its experts are on (:func:`nodes_reached`, ``node_limit`` the
    model's routing limit) on the rail of ranks at its place, overlapped so; on the node its
    pairs go to their owners and back synchronously (exposed). ``fold``: the tensor ranks folded
    into the exchange (:func:`expert_fold`)."""
    from dataclasses import replace
    axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep), ("tp", c.tp))
    if c.pp > 1:
        blk = replace(blk, fwd=blk.fwd - blk.expert_fwd + blk.expert_fwd1, bwd=blk.bwd - blk.expert_bwd + blk.expert_bwd1,
                      expert_fwd=blk.expert_fwd1, expert_bwd=blk.expert_bwd1)
    if not blk.a2a_bytes:
        return blk
    t = fold
    if t > 1:
        # folded over the tensor axis (ExpertOptions.fold): each tensor rank computes and sends its
        # share of the tokens to experts dealt over ep x tp, then gathers every share's outputs
        # (and in backward the tokens' gradients) over the tensor axis, exposed
        gather = collective_time("all_gather", blk.a2a_bytes / max(1, blk.top_k), cluster, axes, "tp")
        blk = replace(blk, fwd=blk.fwd - blk.expert_fwd * (1 - 1 / t), bwd=blk.bwd - blk.expert_bwd * (1 - 1 / t),
                      expert_fwd=blk.expert_fwd / t, expert_bwd=blk.expert_bwd / t, a2a_bytes=blk.a2a_bytes / t,
                      comm_fwd=blk.comm_fwd + gather, comm_bwd=blk.comm_bwd + gather)
        axes = (("pp", c.pp), ("dp", c.dp // c.ep), ("ep", c.ep * t))
    if routing != "dropless":
        a2a = collective_time("all_to_all", blk.a2a_bytes, cluster, axes, "ep")
        return replace(blk, comm_fwd=blk.comm_fwd + 2 * a2a, comm_bwd=blk.comm_bwd + 2 * a2a)
    k = DISPATCH_CHUNKS
    links = cluster.axis_links(axes, "ep")
    g, m = links.members_per_node, links.nodes_spanned
    contention = cluster.device.comm_contention
    if t == 1 and links.regular and 1 < g < c.ep and m > 1 and blk.top_k:   # two hops (not folded)
        reached = nodes_reached(blk.top_k, m, node_limit)
        piece = flat_time("all_to_all", blk.a2a_bytes / blk.top_k * reached / k, m, cluster.inter)
        # per chunk: row counts, expert places and routing weights on the rail (latency: their
        # top_k x 12 bytes a row are under 1 % of a 7,168-wide bf16 row), then the node's counts
        meta = k * (3 * flat_time("all_to_all", 8.0 * m, m, cluster.inter)
                    + flat_time("all_to_all", 8.0 * g, g, cluster.intra))
        on_node = 2 * k * flat_time("all_to_all", blk.a2a_bytes / k, g, cluster.intra)
    else:
        piece = collective_time("all_to_all", blk.a2a_bytes / k, cluster, axes, "ep")
        meta = collective_time("all_to_all", 8.0 * c.ep * t * k, cluster, axes, "ep")   # the layer's row counts
        on_node = 0.0

    def exposed(work: float) -> float:
        shown = overlapped_exchange(piece, work + on_node, k)
        return meta + on_node + shown + contention * max(0.0, 2 * k * piece - shown)
    return replace(blk, comm_fwd=blk.comm_fwd + exposed(blk.expert_fwd), comm_bwd=blk.comm_bwd + exposed(blk.expert_bwd))


def nodes_reached(top_k: int, nodes: int, limit: int | None = None) -> float:
    """Expected nodes a token's ``top_k`` experts lie on, experts spread evenly over the nodes
    it may reach (``limit`` of them, or all ``nodes``): L (1 - (1 - 1/L)^k)."""
    reach = min(nodes, limit) if limit else nodes
    return reach * (1.0 - (1.0 - 1.0 / reach) ** top_k)


def overlapped_exchange(piece_s: float, work_s: float, chunks: int) -> float:
    """Seconds a chunked dispatch-experts-combine adds to the experts' own ``work_s``: every
    chunk's dispatch (``piece_s`` each) is issued first, in order on the link; a chunk's experts
    start when its rows are in and the previous chunk's are done; its combine follows its
    experts and the link's earlier exchanges (collectives on one communicator run in issue
    order). One chunk: both exchanges exposed."""
    x = work_s / chunks
    link = computed = 0.0
    arrived = []
    for _ in range(chunks):
        link += piece_s
        arrived.append(link)
    for i in range(chunks):
        computed = max(computed, arrived[i]) + x
        link = max(link, computed) + piece_s
    return link - work_s


def _with_context(blk: BlockPart, cp: int, comm_fwd: float, comm_bwd: float) -> BlockPart:
    """One block's share on a context axis of ``cp``: the parts were priced at ``seq / cp``
    tokens, so everything token-wise is this rank's; attention has each local query see the
    whole sequence's keys (``cp`` times the local cores' work, ``(S + 1) / (S / cp + 1)`` times
    under a causal mask: :attr:`BlockPart.attn_more`), and its exchanges add
    ``comm_fwd`` / ``comm_bwd`` (the kind's exposed seconds, ``cost/cp_planner.py``)."""
    from dataclasses import replace
    more = blk.attn_more
    # the attention kernels' outputs are kept under ``pointwise`` at every pair count: the extra
    # pairs' work is kept too (its exchanges run again, as the layer's other collectives do)
    return replace(blk, fwd=blk.fwd + more * blk.attn_fwd, bwd=blk.bwd + more * blk.attn_bwd,
                   kept_fwd=blk.kept_fwd + more * blk.attn_fwd, kept_fwd_flops=blk.kept_fwd_flops + more * blk.attn_fwd_flops,
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


def recomputed(counts: list[int], before: int, after: int, first: float) -> list[tuple[int, int, int]]:
    """Per stage, how many layers of the part before, of the blocks and of the part after are
    re-run in backward when each stage recomputes its ``first`` layers in graph order
    (``layers:K``; ``math.inf``: all, ``full``; 0: none): the part before's layers lead the first
    stage, the part after's close the last (runtime/recompute.regions)."""
    stages, out = len(counts), []
    for s in range(stages):
        left = first
        pre = int(min(left, before)) if s == 0 else 0
        left -= pre
        blocks = int(min(left, counts[s]))
        left -= blocks
        post = int(min(left, after)) if s == stages - 1 else 0
        out.append((pre, blocks, post))
    return out


def _stage_activations(facts: ModelFacts, c: Config, counts: list[int], redo: list[tuple[int, int, int]],
                       blk: BlockPart, pre: BlockPart, post: BlockPart, share: float) -> list[float]:
    """Bytes one micro-batch leaves held on each stage from its forward to its backward: every
    block's saved activations (``none``), less the attention scores (``selective``), or only
    the input of each block it recomputes (``redo``: :func:`recomputed`); the first stage also
    holds what the part before saves and the last what the part after saves (the logits), less
    their recomputed layers'. Without a pipeline the one stage runs one micro-batch at a time
    (gradient accumulation), so this is its whole activation memory."""
    stages = len(counts)
    boundary = _boundary_bytes(facts, c) * share
    kept = blk.saved - (blk.score_saved if c.recompute == "selective" else 0.0)
    pointwise = c.recompute == "pointwise"        # each layer holds its input and its matmuls' outputs
    if pointwise:
        kept = boundary + blk.kept_saved

    def outer(p: BlockPart, k: int) -> float:      # the part before or after, k of its layers recomputed
        if pointwise:
            return p.saved - p.layer_saved + p.layers * boundary + p.layer_kept_saved
        return p.saved - (p.layer_saved / p.layers - boundary) * k if k else p.saved
    return [(counts[s] - redo[s][1]) * kept + redo[s][1] * boundary
            + (outer(pre, redo[s][0]) if s == 0 else 0.0) + (outer(post, redo[s][2]) if s == stages - 1 else 0.0)
            for s in range(stages)]


__all__ = ["Config", "Score", "ModelFacts", "BlockPart", "mesh_axes", "simulate", "timeline_of", "RECOMPUTE"]

del asdict
