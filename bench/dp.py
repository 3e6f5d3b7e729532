"""Benchmark: autopar data parallelism (ZeRO-0, ZeRO-3, overlap on/off) vs torch DDP and FSDP2.

Command:  python bench/dp.py [--world 2 4] [--steps 20] [--warmup 2] [--model gpt|llama|mlp]
                             [--set k=v ...] [--batch 4] [--seq 64] [--bucket-mb 0] [--variants ...]
Same model, same weights, same inputs, gloo on this machine's CPU, one thread per rank. For
each world size, in the same processes, it times a full training step (forward, loss
``out.logsumexp(-1).mean()``, backward, AdamW step, zero_grad) of

  local     the plain model on this rank's share of the batch, no communication: the floor;
  ddp       ``DistributedDataParallel(model)`` (defaults: 25 MB buckets, overlapped all_reduce);
  ap0       ``autopar.parallelize(model, {"dp": world}, args, zero_stage=0)`` + ``autopar.optimizer``;
  ap0-nov   the same with ``overlap=False``;
  fsdp      FSDP2: ``fully_shard`` on every block of ``model.layers``, then on the root;
  ap3       ``zero_stage=3``;
  ap3-nov   ``zero_stage=3, overlap=False``,

rotating the order every step so machine noise hits all variants alike. A step's time is the
slowest rank's (ranks are aligned by a barrier first). Each rank gets ``--batch`` rows (the
global batch is ``batch * world``, chunked by rank). It reports ratios of median step time
(goal <= 1.05 vs each torch peer, overlap on / off < 1) and of per-rank memory (goal <= 1.0).

Per-rank memory counts the bytes of the tensors the rank holds after ``opt.step()`` (before
zero_grad): parameters, their ``.grad``, the optimizer's state, and for autopar the data-axis
runtime's gradient sinks and the optimizer's masters; DTensors (FSDP2) count their local
shard; every storage is counted once, whole (views into a bucket count the bucket). DDP's
C++ reducer also keeps flat bucket buffers the size of all gradients
(``gradient_as_bucket_view=False``), which no Python tensor exposes: they are not in the
total but shown as ``hidden`` (sizes from DDP's logging data) and in a second ratio.
The secondary figure ``step RSS`` is the growth of the resident set during one step (VmHWM
after the step minus VmRSS before it, with the peak reset and free heap trimmed first):
activations, gathered parameters, gradients and communication buffers.

Per variant it also prints the medians of forward, backward and optimizer (step + zero_grad)
wall time, the rank's CPU time over the step (all its threads, gloo's included), the excess
over ``local``, and how the gradients are bucketed. ``--bucket-mb`` overrides autopar's
bucket size (0: autopar's own choice from its cost model); ``--variants`` runs a subset.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import sys
import time
import warnings

# torch warns at import when NumPy is absent; the bench never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # after the filter above

import _common as common  # noqa: E402 - bench/ is the script directory

VARIANTS = ("local", "ddp", "ap0", "ap0-nov", "fsdp", "ap3", "ap3-nov")
# (name, numerator, denominator, time goal as text, memory compared?)
RATIOS = (("ZeRO-0 / DDP", "ap0", "ddp", "<= 1.05", True),
          ("ZeRO-3 / FSDP2", "ap3", "fsdp", "<= 1.05", True),
          ("ZeRO-0 overlap on / off", "ap0", "ap0-nov", "< 1", False),
          ("ZeRO-3 overlap on / off", "ap3", "ap3-nov", "< 1", False))
_AUTOPAR = {"ap0": (0, True), "ap0-nov": (0, False), "ap3": (3, True), "ap3-nov": (3, False)}


# -- model, data, variants --------------------------------------------------------------------

def _build(name: str, overrides: dict):
    import autopar.models
    torch.manual_seed(0)
    return autopar.models.build(name, overrides, device="cpu")


def _local_args(model, batch: int, seq: int, world: int, rank: int) -> tuple:
    """This rank's share of a global batch of ``batch * world`` rows (the same on every rank)."""
    import autopar.models
    torch.manual_seed(1)
    args, _ = autopar.models.example_inputs(model, batch * world, seq, device="cpu")
    return tuple(a.chunk(world)[rank] for a in args)


def _make(variant: str, name: str, overrides: dict, args: tuple, world: int, bucket_bytes: int = 0):
    """(module, optimizer) of one variant, built from the same seed."""
    model = _build(name, overrides)
    if variant == "local":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    if variant == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    import autopar
    stage, overlap = _AUTOPAR[variant]
    pm = autopar.parallelize(model, {"dp": world}, args, zero_stage=stage,
                             options=autopar.DataOptions(overlap=overlap, bucket_bytes=bucket_bytes))
    del model                                     # pm holds the tensors it keeps (shared or pieces)
    return pm, autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)


# -- memory -----------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _held_bytes(module, opt) -> dict[str, int]:
    """Bytes of the tensors this rank holds, by kind; each storage counted once (first kind wins)."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optim": 0, "extra": 0}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = _local(t).untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            return
        seen.add(st.data_ptr())
        out[kind] += st.nbytes()

    params = list(module.parameters())
    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
    for state in opt.state.values():
        for v in state.values():
            add("optim", v)
    rt = getattr(module, "dp_runtime", None)
    if rt is not None:
        for t in rt.sinks.values():
            add("extra", t)
    for m in getattr(opt, "masters", {}).values():
        add("extra", m)
        add("extra", m.grad)
    out["total"] = sum(out.values())
    out["reducer"] = _ddp_reducer_bytes(module)
    return out


def _ddp_reducer_bytes(module) -> int:
    """Bytes of DDP's flat bucket buffers (held by its C++ reducer, no Python tensor shows
    them); they hold gradients apart from ``.grad`` unless ``gradient_as_bucket_view``."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(module, DistributedDataParallel):
        return 0
    log = module._get_ddp_logging_data()
    if log.get("gradient_as_bucket_view"):
        return 0
    return sum(int(x) for x in str(log.get("bucket_sizes", "")).split(",") if x.strip())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _step_rss(module, opt, args: tuple) -> int:
    """Bytes the resident set grows by during one step (peak reset and free heap trimmed first)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                          # reset VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return -1
    before = _status_kb("VmRSS")
    common.timed_step(module, opt, args)
    return (_status_kb("VmHWM") - before) * 1024


# -- one rank ---------------------------------------------------------------------------------

def _bucket_summary(module) -> str:
    """How the variant groups its data-axis communication (autopar and DDP)."""
    from torch.nn.parallel import DistributedDataParallel
    rt = getattr(module, "dp_runtime", None)
    if rt is not None:
        sizes = [b.flat_offsets[-1] * rt.param_dtype.itemsize for b in rt.buckets]
    elif isinstance(module, DistributedDataParallel):
        sizes = [int(x) for x in str(module._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if x]
    else:
        return ""
    return f"{len(sizes)} buckets, {min(sizes) / 2**20:.2f}-{max(sizes) / 2**20:.2f} MiB"


def rank_work(rank: int, world: int, name: str, overrides: dict, batch: int, seq: int, warmup: int,
              steps: int, variants: tuple[str, ...], bucket_bytes: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    args = _local_args(_build(name, overrides), batch, seq, world, rank)
    built, setup_s = {}, {}
    for v in variants:
        t0 = time.perf_counter()
        built[v] = _make(v, name, overrides, args, world, bucket_bytes)
        setup_s[v] = time.perf_counter() - t0
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        k = i % len(variants)                     # rotate: every variant takes every slot
        for v in variants[k:] + variants[:k]:
            phases, loss = common.timed_step(*built[v], args)
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(phases)
    held, rss = {}, {}
    for v in variants:
        common.timed_step(*built[v], args, measure=lambda m, o, v=v: held.__setitem__(v, _held_bytes(m, o)))
        rss[v] = _step_rss(*built[v], args)
    dist.barrier()
    return {"times": times, "losses": losses, "held": held, "rss": rss, "setup_s": setup_s,
            "buckets": {v: _bucket_summary(built[v][0]) for v in variants}}


# -- report -----------------------------------------------------------------------------------

def _summarise(res: list[dict], variants: tuple[str, ...], steps: int) -> dict:
    """Per variant: median of the slowest rank's step and its phases, memory (max over ranks)."""
    out = {}
    for v in variants:
        per_step = [max((r["times"][v][i] for r in res), key=lambda p: sum(p[:3])) for i in range(steps)]
        totals = [sum(p[:3]) for p in per_step]
        out[v] = {"median_ms": statistics.median(totals) * 1e3, "min_ms": min(totals) * 1e3,
                  "phases_ms": [statistics.median(p[j] for p in per_step) * 1e3 for j in range(4)],
                  "step_ms": [round(t * 1e3, 2) for t in totals],
                  "held": max((r["held"][v] for r in res), key=lambda h: h["total"]),
                  "step_rss": max(r["rss"][v] for r in res),
                  "setup_s": max(r["setup_s"][v] for r in res),
                  "buckets": res[0]["buckets"][v]}
    ref = res[0]["losses"]["ddp"] if "ddp" in variants else None
    for v in variants:
        la = res[0]["losses"][v]
        out[v]["loss0"] = la[0]
        n = 1 if v == "local" else len(la)          # local never averages: same loss at step 0 only
        out[v]["loss_vs_ddp"] = max(abs(x - y) for x, y in zip(la[:n], ref[:n])) if ref else None
    return out


def _print_world(s: dict, variants: tuple[str, ...], run_s: float) -> list[dict]:
    """The per-variant table of one world size, then its ratios (returned as rows)."""
    floor = s["local"]["median_ms"] if "local" in s else None
    print(f"{'variant':<9}{'median ms':>10}{'min ms':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}{'cpu':>7}{'over local':>11}"
          f"{'params B':>11}{'grads B':>11}{'optim B':>11}{'extra B':>9}{'total B':>12}{'hidden B':>12}"
          f"{'step RSS':>10}{'loss vs ddp':>12}  buckets")
    for v in variants:
        r, h = s[v], s[v]["held"]
        f, b, o, c = r["phases_ms"]
        lv = f"{r['loss_vs_ddp']:.1e}" if r["loss_vs_ddp"] is not None else "-"
        over = f"{r['median_ms'] - floor:+.1f}" if floor is not None else "-"
        print(f"{v:<9}{r['median_ms']:>10.1f}{r['min_ms']:>8.1f}{f:>7.1f}{b:>7.1f}{o:>7.1f}{c:>7.1f}"
              f"{over:>11}{h['params']:>11,}{h['grads']:>11,}{h['optim']:>11,}"
              f"{h['extra']:>9,}{h['total']:>12,}{h['reducer']:>12,}{r['step_rss'] / 2**20:>9.1f}M{lv:>12}"
              f"  {r['buckets']}")
    rows = [_ratio(s, *spec) for spec in RATIOS if spec[1] in s and spec[2] in s]
    for r in rows:
        line = f"{r['ratio']:<24} time {r['time']:6.3f} (goal {r['goal']}: {'ok' if r['time_ok'] else 'MISSED'})"
        if "memory" in r:
            line += f"   memory {r['memory']:6.3f} (goal <= 1.0: {'ok' if r['memory_ok'] else 'MISSED'})"
            if r["memory_with_hidden"] != r["memory"]:
                line += f" [{r['memory_with_hidden']:.3f} counting {r['b']}'s hidden buffers]"
            line += f"   step RSS {r['step_rss']:6.3f}"
        print(line)
    setup = ", ".join(f"{v} {s[v]['setup_s']:.1f}" for v in variants)
    print(f"(setup s: {setup}; ranks ran {run_s:.1f} s)", flush=True)
    return rows


def _ratio(s: dict, label: str, a: str, b: str, goal: str, mem: bool) -> dict:
    t = s[a]["median_ms"] / s[b]["median_ms"]
    row = {"ratio": label, "a": a, "b": b, "goal": goal, "time": t, "time_ok": t < 1.0 if goal == "< 1" else t <= 1.05,
           "ms": (s[a]["median_ms"], s[b]["median_ms"])}
    if mem:
        ha, hb = s[a]["held"], s[b]["held"]
        row.update(memory=ha["total"] / hb["total"], memory_ok=ha["total"] <= hb["total"],
                   memory_with_hidden=(ha["total"] + ha["reducer"]) / (hb["total"] + hb["reducer"]),
                   step_rss=s[a]["step_rss"] / s[b]["step_rss"] if s[b]["step_rss"] > 0 else float("nan"))
    return row


def _print_final(worlds: list[dict], command: str, machine: str, wall: float) -> None:
    print(f"\ncommand: {command}\nmachine: {machine}\ndate: {datetime.date.today().isoformat()}")
    print(f"{'world':>5}  {'ratio':<24}{'time':>7}{'goal':>9}{'memory':>8}{'+hidden':>8}{'step RSS':>9}"
          f"  ms (autopar / peer)")
    for w in worlds:
        for r in w["ratios"]:
            mem = "".join(f"{r[k]:>{n}.3f}" if k in r else f"{'-':>{n}}"
                          for k, n in (("memory", 8), ("memory_with_hidden", 8), ("step_rss", 9)))
            ok = "" if r["time_ok"] and r.get("memory_ok", True) else "  MISSED"
            print(f"{w['world']:>5}  {r['ratio']:<24}{r['time']:>7.3f}{r['goal']:>9}{mem}"
                  f"  {r['ms'][0]:.1f} / {r['ms'][1]:.1f}{ok}")
    print(f"total wall {wall:.1f} s")


def _overrides(a: argparse.Namespace) -> dict:
    return common.overrides(a.set, {"max_seq": a.seq} if a.model != "mlp" else {})


def _args() -> argparse.Namespace:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", choices=("gpt", "llama", "mlp"), default="gpt")
    ap.add_argument("--set", action="extend", nargs="+", metavar="K=V",
                    help="model config overrides, e.g. --set hidden=512 layers=2")
    ap.add_argument("--batch", type=int, default=4, help="rows per rank (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64; ignored by mlp)")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="autopar bucket size in MiB (default 0: autopar's own choice)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=600.0, help="per-world timeout of run_ranks, s")
    a = ap.parse_args()
    a.variants = tuple(v for v in a.variants.split(",") if v)
    if any(v not in VARIANTS for v in a.variants):
        ap.error(f"--variants takes names from {VARIANTS}")
    return a


def main() -> int:
    from autopar.runtime.launch import run_ranks

    import autopar.models

    a = _args()
    overrides = _overrides(a)
    n_params = autopar.models.param_count(autopar.models.get_config(a.model, overrides))
    t_all = time.perf_counter()
    command = "python bench/dp.py " + " ".join(sys.argv[1:])
    machine = common.machine_line()
    print(f"machine: {machine}")
    print(f"model: {a.model} {overrides} ({n_params:,} params, {n_params * 4 / 2**20:.1f} MiB fp32), "
          f"{a.batch} rows/rank, seq {a.seq}; loss logsumexp(-1).mean(); AdamW lr 1e-3; "
          f"{a.warmup} warm-up + {a.steps} timed steps per variant, order rotating")
    worlds = []
    for world in a.world:
        print(f"\n== world {world} ==", flush=True)
        t0 = time.perf_counter()
        res = run_ranks(rank_work, world, a.model, overrides, a.batch, a.seq, a.warmup, a.steps, a.variants,
                        int(a.bucket_mb * 2**20), timeout_s=a.timeout)
        run_s = time.perf_counter() - t0
        s = _summarise(res, a.variants, a.steps)
        worlds.append({"world": world, "variants": s, "ratios": _print_world(s, a.variants, run_s), "run_s": run_s})
    wall = time.perf_counter() - t_all
    _print_final(worlds, command, machine, wall)
    print(json.dumps({"bench": "dp", "model": a.model, "overrides": overrides, "batch_per_rank": a.batch,
                      "seq": a.seq, "steps": a.steps, "warmup": a.warmup, "bucket_mb": a.bucket_mb,
                      "cores": os.cpu_count(), "torch": torch.__version__, "wall_s": wall, "worlds": worlds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
