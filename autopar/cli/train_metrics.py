"""What ``autopar train`` measures beside what the simulator predicts: each step's time,
tokens/s, model TFLOP/s per rank and MFU, peak memory per rank, the ratios to the prediction,
the table and its notes, and the ``--log-jsonl`` records.

Local ranks share this machine's cores, so each is priced (in the prediction, and as the
peak its MFU is measured against) as its share of the ``cpu`` profile: :func:`rank_device`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import torch


def rank_share(world: int) -> float:
    """The fraction of this machine's ``cpu`` profile one of ``world`` local ranks gets: they
    share its cores (1 when there are at least as many cores as ranks)."""
    return min(1.0, (os.cpu_count() or 1) / world)


def rank_device(world: int):
    """The ``cpu`` profile as one of ``world`` local ranks sees it: peak FLOP/s and memory
    bandwidth times :func:`rank_share`."""
    from autopar.cost.hardware import load_hardware
    cpu, share = load_hardware("cpu"), rank_share(world)
    if share == 1.0:
        return cpu
    return dataclasses.replace(cpu, name=f"cpu x {share:.3g}",
                               peak_flops={k: v * share for k, v in cpu.peak_flops.items()},
                               memory_bandwidth=cpu.memory_bandwidth * share)


def peak_memory_bytes(device: str = "cpu") -> int:
    """This process's peak memory: on CUDA the caching allocator's largest allocation
    (``torch.cuda.max_memory_allocated``), else the process's max resident set size
    (``ru_maxrss``: kilobytes on Linux, bytes on macOS; 0 where there is no ``resource``)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    try:
        import resource
    except ImportError:         # Windows
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def log_context(score, cfg: dict, batch: int, seq: int, every: int) -> dict:
    """What each logged record needs (picklable, for the ranks): tokens and model FLOPs per
    step, the ranks, the ``cpu`` profile's peak FLOP/s for the compute dtype, and the
    prediction (None without one)."""
    dtype = cfg.get("precision") or "fp32"
    world = cfg["dp"] * cfg["tp"] * cfg["pp"]
    return {"every": every, "world": world, "tokens": batch * seq, "dtype": dtype,
            "model_flops": score.model_flops if score is not None else None,
            "peak_flops": rank_device(world).peak(dtype), "share": rank_share(world),
            "predicted_step_s": score.step_time_s if score is not None else None,
            "predicted_peak_memory_bytes": score.peak_memory_bytes if score is not None else None}


def step_record(step: int, rows: list[tuple], ctx: dict) -> dict:
    """One logged record from the ``rows`` since the record before (the last is ``step``'s):
    its losses, the mean step time over them and the figures that follow from it."""
    loss, want = rows[-1][0], rows[-1][1]
    step_s = sum(r[2] for r in rows) / len(rows)
    peak = max(r[3] for r in rows)
    flops = ctx["model_flops"]
    tflops = flops / step_s / ctx["world"] / 1e12 if flops is not None and step_s > 0 else None
    pred_s, pred_mem = ctx["predicted_step_s"], ctx["predicted_peak_memory_bytes"]
    return {"step": step, "loss": loss, "reference_loss": want, "difference": loss - want,
            "steps_averaged": len(rows), "step_s": step_s,
            "tokens_per_s": ctx["tokens"] / step_s if step_s > 0 else None,
            "tflops_per_rank": tflops, "mfu": tflops * 1e12 / ctx["peak_flops"] if tflops is not None else None,
            "peak_memory_bytes": peak, "predicted_step_s": pred_s, "predicted_peak_memory_bytes": pred_mem,
            "step_vs_predicted": step_s / pred_s if pred_s else None,
            "memory_vs_predicted": peak / pred_mem if pred_mem else None}


def json_line(obj: dict) -> str:
    """One JSON line; a non-finite number (a diverged loss) is written as null."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v
    return json.dumps(clean(obj), allow_nan=False) + "\n"


COLUMNS = (("step", 4), ("parallel loss", 14), ("single-process", 15), ("difference", 11), ("step ms", 9),
           ("pred ms", 8), ("x pred", 7), ("tokens/s", 9), ("TFLOP/s/rank", 12), ("MFU", 7), ("peak MB", 8),
           ("pred MB", 8), ("x pred", 7))


def step_table(records: list[dict]) -> str:
    """The per-step table: losses, then measured beside predicted ('-' where there is no figure)."""
    def num(v, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return "-" if v is None or not math.isfinite(v) else f"{v * scale:{fmt}}{unit}"
    lines = [" ".join(f"{h:>{w}}" for h, w in COLUMNS)]
    for r in records:
        cells = (str(r["step"]), num(r["loss"], ".6f"), num(r["reference_loss"], ".6f"), num(r["difference"], ".2e"),
                 num(r["step_s"], ".1f", 1e3), num(r["predicted_step_s"], ".1f", 1e3),
                 num(r["step_vs_predicted"], ".3g", unit="x"), num(r["tokens_per_s"], ".0f"),
                 num(r["tflops_per_rank"], ".3g"), num(r["mfu"], ".3g", 100, "%"),
                 num(r["peak_memory_bytes"], ".0f", 1e-6), num(r["predicted_peak_memory_bytes"], ".3g", 1e-6),
                 num(r["memory_vs_predicted"], ".3g", unit="x"))
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS)))
    return "\n".join(lines)


def table_notes(log: dict, world: int, every: int) -> str:
    """What the table's measured and predicted columns are, wrapped under it."""
    import textwrap

    cores, flops, ranks = os.cpu_count() or 1, log["model_flops"], f"{world} rank{'s' * (world > 1)}"
    notes = ["measured: step ms is the parallel step alone (forward, backward, optimizer"
             + ("; the ranks start it together and the slowest counts" if world > 1 else "")
             + "), the single-process reference left out"
             + (f"; each row the mean since the row before (--log-every {every})" if every > 1 else "")
             + "; peak MB is the largest max RSS over the ranks: the whole process (Python, torch and the "
             "reference model too), so far above the prediction"]
    if flops is not None:
        notes.append(f"MFU: model FLOPs per step ({flops / 1e9:.3g} GFLOP, from the analysis passes, recomputation "
                     f"excluded) / step time / {ranks}, against each rank's peak: "
                     f"{log['peak_flops'] / 1e9:.3g} GFLOP/s {log['dtype']}, the cpu hardware profile's "
                     f"(cost/hardware.py)" + (f" times {log['share']:.3g}, as the {ranks} share this CPU's {cores} "
                                              f"core{'s' * (cores > 1)}" if log.get("share", 1.0) < 1 else ""))
    else:
        notes.append("MFU: - (no model FLOPs: the simulator could not read this model)")
    if log["predicted_step_s"] is not None:
        notes.append(f"predicted: the simulator (cost/hybrid.py) for this configuration on 1x{world} cpu"
                     + (f" (each rank {log['share']:.3g} of the profile)" if log.get("share", 1.0) < 1 else "")
                     + ": step "
                     f"{log['predicted_step_s'] * 1e3:.1f} ms, peak memory "
                     f"{log['predicted_peak_memory_bytes'] / 1e6:.3g} MB per rank (model state and activations)")
    return "\n".join(textwrap.fill(n, width=118, subsequent_indent="  ") for n in notes)


def write_first(path: str, line: str) -> None:
    with open(path, "w") as f:
        f.write(line)
