"""The joint search over the hybrid simulator's configurations (:mod:`autopar.cost.hybrid`).

:func:`configurations` enumerates dp x cp x tp x pp (tp within a node, cp a power of two leaving
each rank at least ``CP_MIN_TOKENS`` of every sequence, pp up to the layer count, dp the rest
dividing the batch) x ep (a sub-axis of dp for mixture-of-experts models) x ZeRO stage (with
hybrid-sharded groups, :func:`shard_groups`, for ZeRO-2/3 without a pipeline) x
recomputation x micro-batch x schedule; the context axis's kind is the cheapest for each
configuration (:func:`autopar.cost.cp_planner.block_costs`). :func:`search` skips a configuration whose
compute alone already loses, ranks the rest with the pipeline's closed form, re-scores the
finalists with the event simulation, and explains why each other layout lost.
:func:`smallest_cluster` finds the smallest cluster on which anything fits.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any, Iterable, Sequence

from autopar.cost.cluster import Cluster
from autopar.core.plans import RECOMPUTE, Config, recompute_rank
from autopar.cost.hybrid import ModelFacts, Score, simulate
from autopar.core.errors import ConfigError
from autopar.core.progress import progress

log = logging.getLogger("autopar.hybrid")

# The fewest tokens of each sequence a context-parallel rank keeps (two chunks of half that):
# below it the attention blocks are too short to hide a ring step and the sequence split saves
# little next to the tensor and pipeline axes (Llama 3's 128K stage keeps 8K per rank with CP16;
# Megatron-Core turns context parallelism on from 8K-token sequences).
CP_MIN_TOKENS = 4096
CP_DEGREES = (1, 2, 4, 8, 16, 32, 64)


def configurations(facts: ModelFacts, *, devices: int, batch: int, per_node: int,
                   schedules: Sequence[str] = ("1f1b", "interleaved", "gpipe", "zb", "dualpipev"),
                   recomputes: Sequence[str] = RECOMPUTE, zero_stages: Sequence[int] = (0, 1, 2, 3),
                   micro_batches: Sequence[int] = (1, 2, 4, 8), tp_max: int | None = None,
                   tp_exact: int | None = None, cps: Sequence[int] | None = None) -> Iterable[Config]:
    """Every configuration the search considers: tp a power of two within a node (``tp_exact``:
    that degree only), cp (``cps``, default every power of two leaving ``CP_MIN_TOKENS`` per rank
    on a model with attention), pp up to the layer count, dp the rest dividing the batch."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= (tp_max or per_node) and devices % t == 0] if tp_exact is None \
        else [tp_exact] if devices % tp_exact == 0 else []
    if cps is None:
        cps = [c for c in CP_DEGREES if c == 1 or (facts.attention_ops and facts.seq // c >= CP_MIN_TOKENS)]
    cps = [c for c in cps if c == 1 or facts.seq % (2 * c) == 0]

    def eps(dp: int) -> list[int]:   # expert parallelism: a sub-axis of dp dividing the experts
        if not facts.experts:
            return [1]
        return [e for e in range(1, dp + 1) if dp % e == 0 and facts.experts % e == 0]
    for tp, cp in [(t, c) for t in tps for c in cps if devices % (t * c) == 0]:
        # any pipeline degree up to the layer count: stages need not hold equal numbers of
        # layers (cost/hybrid.py: stage_layers)
        for pp in [p for p in range(1, facts.layers + 1) if (devices // (tp * cp)) % p == 0]:
            dp = devices // (tp * pp * cp)
            if batch % dp:
                continue
            for mb in [b for b in micro_batches if (batch // dp) % b == 0]:
                for sched in (schedules if pp > 1 else ("gpipe",)):
                    vs = [2, 4] if sched == "interleaved" else [2] if sched == "dualpipev" else [1]
                    # DualPipeV: no tensor or context axis, no ZeRO-3 (runtime/pp_overlap.py), m >= 2 pp
                    paired = sched == "dualpipev"
                    if paired and (tp > 1 or cp > 1 or batch // dp // mb < 2 * pp):
                        continue
                    for v in vs:
                        if facts.layers < pp * v or (sched == "interleaved" and (batch // dp // mb) % pp):
                            continue
                        for rc in recomputes:
                            for z in (zero_stages if dp * cp > 1 else (0,)):
                                if paired and z >= 3:
                                    continue
                                for ep in eps(dp):
                                    yield Config(dp=dp, tp=tp, pp=pp, micro_batch=mb, schedule=sched, virtual=v,
                                                 recompute=rc, zero_stage=z, ep=ep, cp=cp)
                                    if z >= 2 and pp == 1 and ep == 1:
                                        for g in shard_groups(dp * cp, per_node // tp):
                                            yield Config(dp=dp, tp=tp, pp=pp, micro_batch=mb, schedule=sched,
                                                         virtual=v, recompute=rc, zero_stage=z, ep=ep, cp=cp,
                                                         shard_group=g)


def shard_groups(data: int, in_node: int) -> list[int]:
    """Hybrid-sharding groups worth scoring on a data axis of ``data`` ranks, ``in_node`` of them
    on a node: the ranks of one node (gathers on the node's links), and eight nodes' worth (a
    group 8x larger: 1/8 the pieces' memory for a few inter-node hops), where they divide the
    axis and leave more than one group."""
    return [g for g in (in_node, 8 * in_node) if 1 < g < data and data % g == 0]


def search(facts: ModelFacts, cluster: Cluster, *, batch: int, budget: float | None = None,
           top: int = 5, **space: Any) -> tuple[Score | None, list[Score], int]:
    """The fastest configuration that fits, the next ``top`` with why each lost, and how many
    were scored. Configurations whose compute alone (a lower bound) already exceeds the best
    found are skipped."""
    budget = budget if budget is not None else cluster.device.memory_bytes
    scored: list[Score] = []
    best: Score | None = None
    count = 0
    kept_fits: dict[Config, bool] = {}        # without recomputation, by the rest of the configuration
    for c in progress(configurations(facts, devices=cluster.world_size, batch=batch,
                                     per_node=cluster.devices_per_node, **space), what="search: configurations"):
        if best is not None and _lower_bound(facts, cluster, c, batch) >= best.step_time_s:
            continue
        try:
            s = simulate(facts, cluster, c, batch=batch, budget=budget, fast=True)
        except ConfigError:
            continue
        count += 1
        found = [s]
        if c.recompute == "none":
            kept_fits[replace(c, recompute="full")] = s.fits
        elif c.recompute == "full" and s.fits and kept_fits.get(c) is False:
            part = fewest_recomputed(facts, cluster, s, batch=batch, budget=budget)
            count += part[1]
            found += [part[0]] if part[0] is not None else []
        for s in found:
            scored.append(s)
            if s.fits and (best is None or s.step_time_s < best.step_time_s):
                best = s
    log.info("search: %d configurations scored with the closed-form pipeline", count)
    # the finalists, scored exactly by the event simulation
    t0 = time.perf_counter()
    ranked = sorted(scored, key=_rank_key)
    n = max(8, 2 * top)
    final = [simulate(facts, cluster, s.config, batch=batch, budget=budget) for s in ranked[:n]]
    # the closed form can misjudge a pipeline's memory: go on down the ranking until one fits
    while not any(s.fits for s in final) and n < len(ranked) and ranked[n].fits:
        final += [simulate(facts, cluster, s.config, batch=batch, budget=budget) for s in ranked[n:2 * n]]
        n *= 2
    final.sort(key=_rank_key)
    best = final[0] if final and final[0].fits else None
    log.info("search: %d finalists event-simulated in %.2fs", len(final), time.perf_counter() - t0)
    seen = {s.config for s in final}
    others = final[1:] + [s for s in ranked if s.config not in seen]
    out, layouts = [], {_layout(best.config)} if best is not None else set()
    for s in others:              # the best variant of each other layout
        if len(out) >= top:
            break
        if _layout(s.config) in layouts:
            continue
        layouts.add(_layout(s.config))
        out.append(_with_reason(s, best, budget))
    return best, out, count


def fewest_recomputed(facts: ModelFacts, cluster: Cluster, full: Score, *, batch: int,
                      budget: float) -> tuple[Score | None, int]:
    """Where a configuration fits with full recomputation and not without: the score of
    ``layers:K`` with the fewest layers per stage K that still fits (memory falls as K grows, so
    a bisection), or None when only every layer does; and how many scores it took."""
    per_stage = max(full.parts["stage_layers"])
    lo, hi, best, tried = 1, per_stage, None, 0
    while lo < hi:
        k = (lo + hi) // 2
        s = simulate(facts, cluster, replace(full.config, recompute=f"layers:{k}"), batch=batch, budget=budget,
                     fast=True)
        tried += 1
        if s.fits:
            hi, best = k, s
        else:
            lo = k + 1
    return best, tried


def _layout(c: Config) -> tuple:
    return (c.dp, c.cp, c.tp, c.pp, c.ep, c.micro_batch, c.schedule, c.virtual, c.shard_group)


def _rank_key(s: Score) -> tuple:
    """Fits first, then time (to 0.1 %), then the simpler configuration: lower ZeRO stage,
    less recomputation, fewer pipeline stages, smaller tp."""
    return (not s.fits, round(s.step_time_s * 1000 / max(s.step_time_s, 1e-12)) if False else
            round(math.log(max(s.step_time_s, 1e-12)) / math.log(1.001)),
            s.config.zero_stage, recompute_rank(s.config.recompute), s.config.pp, s.config.tp)


def _lower_bound(facts: ModelFacts, cluster: Cluster, c: Config, batch: int) -> float:
    """Compute alone, perfectly split over tp and pp (no bubble, no communication): from this
    degree's figures when known, else from the unsplit model's divided by tp (no tensor
    solve needed to rule a configuration out)."""
    parts, _ = facts._cache.get((c.tp, c.micro_batch, cluster.name, c.micro_batch == 1), (None, None))
    scale = 1.0
    if parts is None:
        parts, _ = facts._cache.get((1, c.micro_batch, cluster.name, True), (None, None))
        scale = 1.0 / c.tp
    if parts is None:
        return 0.0
    blk = parts["block"]
    # on a context axis a rank does 1/cp of the whole sequence's work (attention included)
    per_mb = facts.layers * (blk.fwd + blk.bwd) * scale / c.pp / c.cp
    return per_mb * batch / (c.dp * c.micro_batch)


def _with_reason(s: Score, best: Score | None, budget: float) -> Score:
    if not s.fits:
        why = f"does not fit: needs {s.peak_memory_bytes / 1e9:.1f} GB, budget {budget / 1e9:.1f} GB"
    elif best is None:
        why = ""
    else:
        diffs = {"pipeline bubble and compute": s.parts["pipeline_s"] - best.parts["pipeline_s"],
                 "exposed dp communication": s.exposed_comm_s - best.exposed_comm_s,
                 "optimizer step": s.parts["optimizer_s"] - best.parts["optimizer_s"]}
        worst = max(diffs, key=lambda k: diffs[k])
        slower = s.step_time_s / best.step_time_s - 1
        if slower < 1e-3:
            why = (f"as fast (within 0.1%), but holds {s.peak_memory_bytes / 1e9:.1f} GB against "
                   f"{best.peak_memory_bytes / 1e9:.1f} GB" if s.peak_memory_bytes > best.peak_memory_bytes
                   else "as fast (within 0.1%); the chosen one is the simpler configuration")
        else:
            why = f"slower by {100 * slower:.1f}% ({worst} +{diffs[worst] * 1e3:.1f} ms)"
    return Score(**{**{k: getattr(s, k) for k in s.__dataclass_fields__}, "reason": why})


def leanest(facts: ModelFacts, cluster: Cluster, *, batch: int, **space: Any) -> Score | None:
    """The configuration that holds the least memory per device on ``cluster`` (whether or not
    it fits): every layout at ZeRO-3 (where there is a data axis), full recomputation and
    micro-batch 1, the settings that each lower memory."""
    lean = None
    space = {**space, "recomputes": ("full",), "micro_batches": (1,), "schedules": ("1f1b",)}
    for c in configurations(facts, devices=cluster.world_size, batch=batch, per_node=cluster.devices_per_node,
                            **space):
        if c.dp > 1 and c.zero_stage != 3 and 3 in space.get("zero_stages", (3,)):
            continue
        try:
            s = simulate(facts, cluster, c, batch=batch, fast=True)
        except ConfigError:
            continue
        if lean is None or s.peak_memory_bytes < lean.peak_memory_bytes:
            lean = s
    return simulate(facts, cluster, lean.config, batch=batch) if lean is not None else None


def smallest_cluster(facts: ModelFacts, cluster: Cluster, *, batch: int, budget: float | None = None,
                     limit: int = 1 << 16) -> int | None:
    """The smallest device count (whole nodes) on which some configuration fits."""
    from autopar.cost.cluster import Cluster as C

    per = cluster.devices_per_node
    nodes = max(1, cluster.world_size // per)
    while nodes * per <= limit:
        nodes *= 2
        bigger = C(nodes=nodes, devices_per_node=per, device=cluster.device, intra=cluster.intra,
                   inter=cluster.inter, intra_peak_bandwidth=cluster.intra_peak_bandwidth,
                   name=f"{nodes}x{per} {cluster.device.name}")
        best, _, _ = search(facts, bigger, batch=batch, budget=budget, top=0, recomputes=("full",),
                            schedules=("1f1b",), micro_batches=(1,))
        if best is not None:
            return nodes * per
    return None


__all__ = ["configurations", "shard_groups", "search", "leanest", "smallest_cluster"]
