"""Published training configurations, simulated as published and re-planned by autopar.

Command:  python bench/published_configs.py [--only NAME,...] [--terms] [--json]

For each configuration below (the layout a team published for a model and cluster), the
simulator (`cost/hybrid.py`, default settings: flash attention, the built-in hardware
profiles) scores that exact layout; what the publication leaves open (micro-batch size,
schedule, virtual stages, ZeRO stage where unspecified, recomputation where unspecified) is
set to the simulator's best, as the publishers tuned theirs. Printed: its predicted TFLOP/s
per GPU next to the published figure where one is published (the publication's own FLOP
count: model FLOPs for Meta's figures, hardware FLOPs with recomputation for Megatron-LM's).
Then the planner (`cost/plan_search.py`) searches the same model, cluster, batch and memory
budget, and its plan's step time is compared with the published layout's: ``ratio`` is the
published layout's predicted step time over the planner's (>= 1: the planner's is at least
as fast). The last line gives the highest A100 MFU any printed configuration reaches.

The configurations and their sources:

- **Llama 3 405B** (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783,
  2024, Table 4): 126 layers, sequence 8192, 16M tokens per step (2048 sequences), BF16 on
  H100: TP8 CP1 PP16 DP64 on 8,192 GPUs (430 TFLOP/s per GPU, 43 % MFU) and DP128 on 16,384
  GPUs (400, 41 %). The paper removes one layer from the first and the last stage, and
  (section 3.3.2) trains at 8K tokens without activation checkpointing, so the layout is
  simulated without recomputation; as this model's runtime would need more than 80 GB for it,
  the fitting completion may recompute.
- **Mixtral 8x22B** on 128 H100 (16 nodes): TP4 PP4 EP8, the layout Megatron-Core's MoE
  guide gives for it; sequence 4096, batch 256 sequences (ours). No throughput is published.
  Two readings of EP8 beside TP4: eight ranks of the data axis each holding one expert, whole on
  its tensor ranks (autopar's ep 8), or, as Megatron-Core's MoE parallel folding deals them,
  eight experts over the tensor ranks of two data ranks (autopar's ep 2 folded with tp 4,
  ``ExpertOptions(fold="auto")``); both rows are scored.
- **DeepSeek-V3** (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024,
  section 3.2): PP16 EP64 TP1 with ZeRO-1 data parallelism on 2,048 H800 GPUs (simulated on
  the H100 profile: same compute, the H800's NVLink is slower), sequence 4096, batch 15,360
  sequences (the report's final batch). No per-GPU throughput is published; the report's
  figures (2.788M H800 GPU hours for 14.8T tokens) give 14.8e12 / 2.788e6 / 3600 = 1,475
  tokens per GPU-second, so a step of 15,360 x 4,096 tokens on 2,048 GPUs takes about
  62.9M / (2,048 x 1,475) = 20.8 s (20.1 s from the pre-training share alone, 2.664M GPU
  hours) with FP8 and DualPipe; autopar runs no FP8, so bf16 is simulated, and DualPipeV (the
  single-copy DualPipe) is among the completions of the layout. Its routing sends
  a token's experts to at most 4 nodes (section 2.1.2, node-limited routing), so the two-hop
  exchange sends a token across at most 4 times (``moe_node_limit=4``).
  Both MoE rows are priced dropless (each routed token computed and sent once), as Megatron-Core
  and DeepSeek route; the zoo and ``hf:`` captures hold fixed-capacity buffers.
- **Gemma 2 27B** (Gemma Team, arXiv:2408.00118, 2024: trained with ZeRO-3-like sharding
  and model parallelism, on TPUs): ZeRO-3 with TP2 on 256 H100 (ours), sequence 8192,
  batch 1024. No GPU throughput is published.
- **Megatron-LM GPT** (Narayanan et al., SC'21, Table 1; `bench/anchors/`): all ten rows,
  fp16 on A100, full recomputation, ZeRO-0, the row's tp and pp.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

warnings.filterwarnings("ignore")
logging.getLogger("autopar").setLevel(logging.ERROR)

from autopar.cost.cluster import Cluster  # noqa: E402
from autopar.cost.hybrid import RECOMPUTE, Config, ModelFacts, simulate  # noqa: E402
from autopar.cost.plan_search import fewest_recomputed, search  # noqa: E402
from autopar.core.errors import ConfigError  # noqa: E402
from autopar.cli.workload import capture_for_planning, load_workload  # noqa: E402

ANCHORS = Path(__file__).resolve().parent / "anchors" / "megatron_weak_scaling.csv"
BUDGET = 80e9


@dataclass
class Row:
    name: str
    model: str
    hardware: str
    nodes: int
    seq: int
    batch: int
    dtype: str
    layout: dict                       # fixed degrees and settings of the published layout
    published: float | None = None     # TFLOP/s per GPU
    counts: str = "model"              # which FLOPs the publication counts: model or hardware
    overrides: dict = field(default_factory=dict)
    # settings the publication states but its system met in less memory than this model's
    # runtime holds: the fitting completion may change them (the as-published one keeps them)
    relaxed: tuple = ()
    routing: str = "capacity"           # MoE layers: dropless where the publication's system routes so
    node_limit: int | None = None       # MoE routing: a token's experts on at most this many nodes


def rows() -> list[Row]:
    out = [
        Row("Llama 3 405B, 8K GPUs", "llama3-405b", "h100", 1024, 8192, 2048, "bf16",
            {"tp": 8, "pp": 16, "recompute": "none"}, published=430, relaxed=("recompute",)),
        Row("Llama 3 405B, 16K GPUs", "llama3-405b", "h100", 2048, 8192, 2048, "bf16",
            {"tp": 8, "pp": 16, "recompute": "none"}, published=400, relaxed=("recompute",)),
        Row("Mixtral 8x22B", "mixtral-8x22b", "h100", 16, 4096, 256, "bf16", {"tp": 4, "pp": 4, "ep": 8},
            routing="dropless"),
        Row("Mixtral 8x22B folded", "mixtral-8x22b", "h100", 16, 4096, 256, "bf16", {"tp": 4, "pp": 4, "ep": 2},
            routing="dropless"),
        Row("DeepSeek-V3", "hf:deepseek-v3", "h100", 256, 4096, 15360, "bf16",
            {"tp": 1, "pp": 16, "ep": 64, "zero_stage": 1}, routing="dropless", node_limit=4),
        Row("Gemma 2 27B", "hf:gemma2-27b", "h100", 32, 8192, 1024, "bf16", {"tp": 2, "pp": 1, "zero_stage": 3}),
    ]
    for r in csv.DictReader(open(ANCHORS)):
        out.append(Row(f"Megatron GPT {float(r['params_b']):g}B", "gpt", "a100", int(r["gpus"]) // 8, 2048,
                       int(r["global_batch"]), "fp16",
                       {"tp": int(r["tp"]), "pp": int(r["pp"]), "zero_stage": 0, "recompute": "full"},
                       published=float(r["tflops_per_gpu"]), counts="hardware",
                       overrides={"hidden": r["hidden"], "layers": r["layers"], "heads": r["heads"],
                                  "vocab": "51200", "max_seq": "2048"}))
    return out


def published_layout(facts: ModelFacts, cluster: Cluster, row: Row):
    """The fastest completion of the published layout (what the publication leaves open) that
    fits the memory budget, and the fastest one whatever its memory (the publication ran, so
    where the two differ for a layout with a published figure, the simulator's memory model is
    stricter than the publishers' system). The fitting completion may also change the row's
    ``relaxed`` settings; the fastest keeps every stated one."""
    stated = row.layout
    lay = {k: v for k, v in stated.items() if k not in row.relaxed}
    tp, pp = lay["tp"], lay["pp"]
    dp = cluster.world_size // (tp * pp)
    fits, fastest, errors, kept_fits = [], None, set(), True
    for mb in (1, 2, 4, 8):
        for sched, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb", 1), ("dualpipev", 2)):
            if pp == 1 and sched != "1f1b":
                continue
            for z in ([lay["zero_stage"]] if "zero_stage" in lay else [0, 1, 2, 3]):
                for rc in ([lay["recompute"]] if "recompute" in lay else list(RECOMPUTE)):
                    c = Config(dp=dp, tp=tp, pp=pp, micro_batch=mb, schedule=sched, virtual=v, recompute=rc,
                               zero_stage=z, ep=lay.get("ep", 1))
                    try:
                        s = simulate(facts, cluster, c, batch=row.batch, budget=BUDGET, fast=True)
                    except ConfigError as exc:
                        errors.add(str(exc).splitlines()[0])
                        continue
                    if s.fits:
                        fits.append(s)
                    if rc == "none":
                        kept_fits = s.fits
                    elif rc == "full" and s.fits and not kept_fits:   # the fewest layers per stage that fit
                        part, _ = fewest_recomputed(facts, cluster, s, batch=row.batch, budget=BUDGET)
                        fits += [part] if part is not None else []
                    as_stated = all(getattr(c, k) == v for k, v in stated.items())
                    if as_stated and (fastest is None or s.step_time_s < fastest.step_time_s):
                        fastest = s
    # exactly (the event simulation): the fastest whose exact memory fits too
    best = None
    for s in sorted(fits, key=lambda s: s.step_time_s)[:32]:
        e = simulate(facts, cluster, s.config, batch=row.batch, budget=BUDGET)
        if e.fits:
            best = e
            break
    exact = simulate(facts, cluster, fastest.config, batch=row.batch, budget=BUDGET) if fastest else None
    return best, exact, errors


def tflops(score, counts: str) -> float:
    return score.hw_tflops_per_device if counts == "hardware" else score.tflops_per_device


def describe(c) -> str:
    return (f"dp={c.dp}" + (f" cp={c.cp}{(c.cp_kind or '?')[0]}" if c.cp > 1 else "") + f" tp={c.tp} pp={c.pp}"
            + (f" ep={c.ep}" if c.ep > 1 else "") + f" Z{c.zero_stage} "
            f"mb={c.micro_batch} {c.schedule if c.pp > 1 else '-'}" + (f"/v{c.virtual}" if c.virtual > 1 else "")
            + f" {c.recompute}")


def _line(label: str, score, counts: str) -> str:
    return (f"  {label:<10} {describe(score.config):<46} {tflops(score, counts):>6.1f} TFLOP/s, MFU "
            f"{100 * score.mfu:>4.1f}%, {score.peak_memory_bytes / 1e9:>5.1f} GB, step {score.step_time_s:>7.2f} s")


def terms(score) -> str:
    """The step's terms as the simulator adds them up: the pipeline (compute, tensor and context
    exchanges inside it, bubble), the data axis's exposed part, contention, the optimizer."""
    p = score.parts
    cp = f", cp {1e3 * p['cp_comm_per_block_s']:.2f} ms" if "cp_comm_per_block_s" in p else ""
    cp += f", ep all-to-all {1e3 * p['ep_comm_per_block_s']:.2f} ms" if "ep_comm_per_block_s" in p else ""
    return (f"             terms: pipeline {p['pipeline_s']:.2f} s (bubble {score.bubble_fraction:.3f}; per block "
            f"and micro-batch: compute {1e3 * (p['block_fwd_s'] + p['block_bwd_s']):.1f} ms, tp "
            f"{1e3 * p['tp_comm_per_block_s']:.2f} ms{cp}; p2p {1e3 * p['p2p_s']:.2f} ms), data axis exposed "
            f"{p['dp_exposed_s']:.2f} of {p['dp_comm_s']:.2f} s, contention {p['contention_s']:.2f} s, "
            f"optimizer {p['optimizer_s']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="published_configs", description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated substrings of row names")
    ap.add_argument("--json", action="store_true", help="also print one JSON line with every figure")
    ap.add_argument("--terms", action="store_true", help="print each score's step terms under it")
    args = ap.parse_args(argv)
    picked = [r for r in rows() if not args.only or any(k.lower() in r.name.lower() for k in args.only.split(","))]
    start, out, a100_mfu = time.perf_counter(), [], 0.0
    for row in picked:
        t0 = time.perf_counter()
        w = load_workload(row.model, batch=1, seq=row.seq, overrides=row.overrides)
        cap = capture_for_planning(w)
        facts = ModelFacts(cap.gm, seq=row.seq, dtype=row.dtype, layers=cap.block_copies, moe_routing=row.routing,
                           moe_node_limit=row.node_limit)
        cluster = Cluster.from_spec(f"{row.nodes}x8", hardware=row.hardware)
        fitting, fastest, errors = published_layout(facts, cluster, row)
        if row.published is None or fastest is None:
            fastest = fitting          # nothing ran to say the publishers' system held more
        t1 = time.perf_counter()
        best, _, scored = search(facts, cluster, batch=row.batch, budget=BUDGET, top=0)
        search_s = time.perf_counter() - t1
        print(f"{row.name} ({cluster.world_size} x {cluster.device.name}, batch {row.batch} x {row.seq}, "
              f"{row.dtype}; captured {cap.describe()})", flush=True)
        rec = {"name": row.name, "published_tflops": row.published, "counts": row.counts, "errors": sorted(errors),
               "as_published": fastest.as_dict() if fastest else None,
               "published_fitting": fitting.as_dict() if fitting else None,
               "planner": best.as_dict() if best else None, "configurations_scored": scored, "search_s": search_s}
        if fastest is None:
            print(f"  DOES NOT SIMULATE: {'; '.join(sorted(errors))}", flush=True)
            out.append(rec)
            continue
        pred = tflops(fastest, row.counts)
        err = pred / row.published - 1 if row.published else None
        vs = f"  vs {row.published:g} published ({100 * err:+.1f}%)" if row.published else "  (no figure published)"
        over = "" if fastest.fits else "  [over the budget in this model]"
        print(_line("published", fastest, row.counts) + vs + over, flush=True)
        if args.terms:
            print(terms(fastest), flush=True)
        if fitting is not None and fitting.config != fastest.config:
            print(_line("fitting", fitting, row.counts), flush=True)
            if args.terms:
                print(terms(fitting), flush=True)
        ratio = fitting.step_time_s / best.step_time_s if fitting and best else None
        if best is not None:
            print(_line("planner", best, row.counts) + (f"  x{ratio:.3f} the fitting published layout's speed"
                                                        if ratio else "") + f"; searched {scored} in {search_s:.1f} s"
                  + ("" if ratio is None or ratio >= 1 - 1e-9 else "  SLOWER"), flush=True)
            if args.terms:
                print(terms(best), flush=True)
        else:
            print("  planner    nothing fits", flush=True)
        if row.hardware == "a100":
            a100_mfu = max([a100_mfu] + [s.mfu for s in (fastest, fitting, best) if s is not None])
        rec.update(predicted_tflops=pred, error=err, ratio=ratio, row_s=time.perf_counter() - t0)
        out.append(rec)
    done = [o for o in out if o.get("as_published") is not None]
    compared = [o for o in done if o.get("ratio") is not None]
    print(f"\n{len(done)} of {len(out)} published configurations simulate; the planner's plan fits and is at least "
          f"as fast as the fitting published layout on {sum(o['ratio'] >= 1 - 1e-9 for o in compared)} of "
          f"{len(compared)}; highest A100 MFU {100 * a100_mfu:.1f}%; wall {time.perf_counter() - start:.0f} s")
    if args.json:
        print(json.dumps({"bench": "published_configs", "rows": out, "a100_max_mfu": a100_mfu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
