"""Benchmark: autopar eager and compiled vs DDP / FSDP2 / DTensor TP, each eager and under torch.compile.

Command:  python bench/compile.py [--steps 30] [--warmup 3] [--groups dp zero3 tp] [--layers 2]
                                  [--hidden 256] [--heads 4] [--vocab 1024] [--batch 4] [--seq 64] [--quick]
A GPT (``autopar.models.build("gpt", ...)``, float32, tied head), 2 gloo ranks, one thread per
rank, loss ``out.logsumexp(-1).mean()``, AdamW lr 1e-3. Three groups, one after the other in
the same 2-rank world, each with four variants built from the same seed:

  dp     ap0 / ap0-c   ``autopar.parallelize(model, {"dp": 2}, args, zero_stage=0[, compile=True])``
         ddp / ddp-c   ``DistributedDataParallel(model)``; compiled: ``torch.compile(ddp)``
                       (dynamo's DDPOptimizer, ``optimize_ddp`` left at its default)
  zero3  ap3 / ap3-c   ``zero_stage=3``
         fsdp / fsdp-c FSDP2 (``fully_shard`` on every block, then the root); compiled:
                       ``torch.compile`` of the sharded root module
  tp     aptp / aptp-c ``autopar.parallelize(model, {"tp": 2}, args[, compile=True])``
         dtp / dtp-c   ``parallelize_module`` with ColwiseParallel on q/k/v and mlp.fc,
                       RowwiseParallel on o_proj and mlp.proj (heads // 2 per rank, the
                       bench-local attention forward of bench/tp.py); compiled: ``torch.compile``

In dp and zero3 each rank trains on its ``--batch`` rows of a ``2 * batch`` batch; in tp both
ranks see the whole ``2 * batch`` rows. ``-c`` variants use inductor (C++/OpenMP kernels on CPU).

Time to first step: per variant, wrap (parallelize / DDP / fully_shard / parallelize_module and
torch.compile) + optimizer + the first forward, backward, opt.step and zero_grad; for compiled
variants it includes dynamo tracing and inductor compilation. Building the plain model is not
counted. Every variant gets a fresh, empty inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``
set to a new temporary directory in the rank before it is wrapped) and inductor's in-memory code
caches are cleared (``torch._inductor.utils.clear_caches``), so no variant reuses another's
kernels. One-time costs of the process (importing inductor, starting its compile workers) are
paid before any variant by a throwaway compile of a tiny function, shown as ``inductor warm-up``.
The figure is the slowest rank's.

Step time: after every variant's first step, ``--warmup`` more steps and ``--steps`` timed
steps, the four variants of a group rotating order every step; a step's time is the slowest
rank's (ranks are aligned by a barrier first); medians. Ratios: compiled / eager per system,
autopar / peer eager and compiled (goal for compiled: <= 1.05). A variant that fails to build
or to take its first step is reported with the head of its error instead of a number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402 - after the filter above

import _common as common  # noqa: E402 - bench/ is the script directory

GROUPS = {"dp": ("ap0", "ap0-c", "ddp", "ddp-c"),
          "zero3": ("ap3", "ap3-c", "fsdp", "fsdp-c"),
          "tp": ("aptp", "aptp-c", "dtp", "dtp-c")}
# group -> (autopar system, peer system) as table labels
SYSTEMS = {"dp": (("autopar dp (ZeRO-0)", "ap0"), ("torch DDP", "ddp")),
           "zero3": (("autopar ZeRO-3", "ap3"), ("torch FSDP2", "fsdp")),
           "tp": (("autopar tp", "aptp"), ("torch DTensor TP", "dtp"))}
WORLD = 2
LR = 1e-3


# -- model, data, variants ----------------------------------------------------------------------

def _build(cfg: dict):
    from autopar import models
    torch.manual_seed(0)
    return models.build("gpt", cfg, device="cpu")


def _args(cfg: dict, batch: int, seq: int, rank: int, shared: bool) -> tuple:
    from autopar import models
    torch.manual_seed(1)
    args, _ = models.example_inputs(_build(cfg), batch * WORLD, seq, device="cpu")
    return args if shared else tuple(a.chunk(WORLD)[rank].contiguous() for a in args)


def _wrap(variant: str, model, args: tuple):
    """(module, optimizer) of ``variant`` around the freshly built ``model``."""
    base, compiled = variant.removesuffix("-c"), variant.endswith("-c")
    if base.startswith("ap"):
        import autopar
        mesh, opts = {"ap0": ({"dp": WORLD}, {"zero_stage": 0}), "ap3": ({"dp": WORLD}, {"zero_stage": 3}),
                      "aptp": ({"tp": WORLD}, {})}[base]
        pm = autopar.parallelize(model, mesh, args, compile=compiled, **opts)
        return pm, autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    if base == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
        return (torch.compile(ddp) if compiled else ddp), opt
    from torch.distributed.device_mesh import init_device_mesh
    if base == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif base == "dtp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        for block in model.layers:
            parallelize_module(block, mesh, {
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
            block.attn.heads = model.config.heads // WORLD
            block.attn.forward = types.MethodType(common.local_attn_forward, block.attn)
    else:
        raise ValueError(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return (torch.compile(model) if compiled else model), opt


def _fresh_cache(root: str, variant: str, rank: int) -> None:
    """An empty inductor cache directory for what compiles next, and no in-memory kernels."""
    path = tempfile.mkdtemp(prefix=f"{variant}-r{rank}-", dir=root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    from torch._inductor.utils import clear_caches
    clear_caches()


def _inductor_warmup(root: str, rank: int) -> float:
    """Pay the process's one-time inductor costs (imports, compile workers) on a tiny function."""
    _fresh_cache(root, "warmup", rank)
    t0 = time.perf_counter()
    fn = torch.compile(lambda x: (x.sin() * 2 + 1).sum())
    fn(torch.randn(16))
    return time.perf_counter() - t0


def _error_head(exc: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


# -- one rank -----------------------------------------------------------------------------------

def _group(rank: int, world: int, group: str, root: str, cfg: dict, batch: int, seq: int, warmup: int,
           steps: int) -> dict:
    """Build the group's four variants (timing each to its first step), then time their steps."""
    import torch.distributed as dist

    args = _args(cfg, batch, seq, rank, shared=(group == "tp"))
    built, first_s, failed, loss0 = {}, {}, {}, {}
    for v in GROUPS[group]:
        _fresh_cache(root, v, rank)
        model = _build(cfg)
        dist.barrier()
        t0 = time.perf_counter()
        err = None
        try:
            module, opt = _wrap(v, model, args)
            _, loss0[v] = common.timed_step(module, opt, args)
            built[v] = (module, opt)
        except Exception as exc:                   # a peer that does not compile here: reported
            err = _error_head(exc)
        first_s[v] = time.perf_counter() - t0
        errs = [None] * world
        dist.all_gather_object(errs, err)
        if any(errs):
            failed[v] = next(e for e in errs if e)
            built.pop(v, None)
    live = [v for v in GROUPS[group] if v in built]
    times: dict[str, list[float]] = {v: [] for v in live}
    for i in range(warmup + steps):
        k = i % len(live) if live else 0
        for v in live[k:] + live[:k]:
            phases, _ = common.timed_step(*built[v], args)
            if i >= warmup:
                times[v].append(sum(phases[:3]))
    dist.barrier()
    return {"times": times, "first_s": first_s, "failed": failed, "loss0": loss0}


def rank_work(rank: int, world: int, groups: list[str], cfg: dict, batch: int, seq: int, warmup: int,
              steps: int) -> dict:
    """Every group in turn, in the same processes (one inductor warm-up for all)."""
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="autopar-bench-compile-")
    try:
        out = {"warm_s": _inductor_warmup(root, rank)}
        for g in groups:
            t0 = time.perf_counter()
            out[g] = _group(rank, world, g, root, cfg, batch, seq, warmup, steps)
            out[g]["wall_s"] = time.perf_counter() - t0
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- report -------------------------------------------------------------------------------------

def summarise(res: list[dict], group: str, steps: int) -> dict:
    out = {"wall_s": max(r["wall_s"] for r in res), "variants": {}}
    for v in GROUPS[group]:
        failed = res[0]["failed"].get(v)
        row = {"first_s": max(r["first_s"][v] for r in res)}
        if failed:
            row["failed"] = failed
        else:
            slowest = [max(r["times"][v][i] for r in res) for i in range(steps)]
            row.update(ms=statistics.median(slowest) * 1e3, lo=min(slowest) * 1e3, loss0=res[0]["loss0"][v])
        out["variants"][v] = row
    return out


def _ms(row: dict) -> str:
    return f"{row['ms']:.1f}" if "ms" in row else f"FAILED: {row['failed']}"


def _ratio(a: dict, b: dict, goal: float | None = None) -> str:
    if "ms" not in a or "ms" not in b:
        return "-"
    r = a["ms"] / b["ms"]
    return f"{r:.3f}" + ("" if goal is None or r <= goal else " MISSED")


def table(groups: dict) -> list[str]:
    lines = ["| system | eager step ms | compiled step ms | compiled / eager | eager first step s "
             "| compiled first step s | autopar / peer eager | autopar / peer compiled (goal <= 1.05) |",
             "|---|---|---|---|---|---|---|---|"]
    for g, s in groups.items():
        vs = s["variants"]
        (ap_label, ap), (peer_label, peer) = SYSTEMS[g]
        for label, name in ((ap_label, ap), (peer_label, peer)):
            e, c = vs[name], vs[name + "-c"]
            if name == ap:
                pe, pc = _ratio(e, vs[peer]), _ratio(c, vs[peer + "-c"], 1.05)
            else:
                pe = pc = ""
            lines.append(f"| {label} | {_ms(e)} | {_ms(c)} | {_ratio(c, e)} | {e['first_s']:.1f} | "
                         f"{c['first_s']:.1f} | {pe} | {pc} |")
    return lines


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps after the first (default 3)")
    ap.add_argument("--groups", nargs="+", choices=tuple(GROUPS), default=list(GROUPS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="rows per rank in dp / zero3 (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--timeout", type=float, default=900.0, help="timeout of run_ranks, s (default 900)")
    ap.add_argument("--quick", action="store_true", help="1 layer, 6 timed steps, 1 warm-up: a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.steps, a.warmup = 1, 6, 1
    return a


def main() -> int:
    from autopar.runtime.launch import run_ranks

    a = _parse()
    cfg = {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab, "max_seq": max(a.seq, 8)}
    command = "python bench/compile.py " + " ".join(sys.argv[1:])
    machine = common.machine_line()
    n_params = sum(p.numel() for p in _build(cfg).parameters())
    load0 = _loadavg()
    print(f"machine: {machine}\nloadavg before: {load0}")
    print(f"model: gpt {cfg} ({n_params:,} params), world {WORLD}, {a.batch} rows/rank (tp: {a.batch * WORLD} "
          f"shared), seq {a.seq}; AdamW; {a.warmup} warm-up + {a.steps} timed steps", flush=True)
    t_all = time.perf_counter()
    res = run_ranks(rank_work, WORLD, a.groups, cfg, a.batch, a.seq, a.warmup, a.steps, timeout_s=a.timeout)
    warm_s = max(r["warm_s"] for r in res)
    print(f"\ninductor warm-up (throwaway compile, once per rank before any variant): {warm_s:.1f} s")
    groups = {}
    for g in a.groups:
        groups[g] = summarise([r[g] for r in res], g, a.steps)
        s = groups[g]
        print(f"\n== {g} ({s['wall_s']:.1f} s) ==")
        for v, row in s["variants"].items():
            extra = (f"median {row['ms']:.1f} ms (min {row['lo']:.1f}), loss0 {row['loss0']:.6f}"
                     if "ms" in row else f"FAILED: {row['failed']}")
            print(f"  {v:<8} first step {row['first_s']:6.1f} s   {extra}", flush=True)
    wall = time.perf_counter() - t_all
    load1 = _loadavg()
    print(f"\ncommand: {command}\nmachine: {machine}\ndate: {datetime.date.today().isoformat()}")
    print(f"loadavg before: {load0}\nloadavg after:  {load1}\ntotal wall {wall:.1f} s\n")
    print("\n".join(table(groups)))
    print(json.dumps({"bench": "compile", "cfg": cfg, "batch_per_rank": a.batch, "seq": a.seq, "steps": a.steps,
                      "warmup": a.warmup, "torch": torch.__version__, "wall_s": wall, "loadavg": [load0, load1],
                      "inductor_warmup_s": warm_s, "groups": groups}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
