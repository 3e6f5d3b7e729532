"""Benchmark: autopar's data-axis modes vs all-reduce and vs their torch peers, on gloo ranks.

Command:  python bench/dp_modes.py [--world 4] [--steps 24] [--warmup 4] [--repeats 3]
                                   [--width 1024] [--layers 4] [--rows 16] [--sync-every 4]
                                   [--topk-ratio 0.001] [--randk-ratio 0.004] [--variants ...] [--quick]
An MLP (``--layers`` Linear ``width x width`` + ReLU, float32; 4.2 M parameters by default),
the same weights and inputs everywhere, ``--rows`` rows per rank, loss
``out.logsumexp(-1).mean()``, SGD lr 0.01 momentum 0.9, one thread per rank. In the same
processes it times a full training step (forward, backward, ``opt.step()``, zero_grad) of

  ap-allreduce   ``autopar.parallelize(model, {"dp": n}, (x,), zero_stage=0)`` + ``autopar.optimizer``
  ap-local       dp_mode ``{"kind": "local_sgd", "sync_every": H}``
  ap-quantize    ``{"kind": "compressed", "compressor": "quantize", "levels": 5}``
  ap-topk        ``{"kind": "compressed", "compressor": "topk", "ratio": R}`` (``--topk-ratio``, 0.001)
  ap-randk       ``{"kind": "compressed", "compressor": "randk", "ratio": R}`` (``--randk-ratio``, 0.004)
  ap-gossip-ring ``{"kind": "gossip", "topology": "ring"}``
  ap-gossip-exp  ``{"kind": "gossip", "topology": "exponential"}``
  ap-async       ``{"kind": "async", "staleness": 1}``
  ddp            ``DistributedDataParallel(model)`` (defaults)
  ddp-local      DDP + ``post_localSGD_hook`` (``PostLocalSGDState(start_localSGD_iter=0,
                 post_local_gradient_allreduce=False)``: no gradient all-reduce) +
                 ``PostLocalSGDOptimizer(SGD, PeriodicModelAverager(period=H, warmup_steps=0))``
  ddp-powersgd   DDP + ``powerSGD_hook`` (``PowerSGDState(matrix_approximation_rank=2,
                 start_powerSGD_iter=2, warm_start=True)``, error feedback on)
  ddp-fp16       DDP + ``fp16_compress_hook``

rotating the order every step so machine noise hits all variants alike. A step's time is the
slowest rank's (ranks are aligned by a barrier first). Because local SGD communicates once
every H steps, every variant's figure is the median over blocks of H consecutive timed steps
of the block's mean step time (warm-up and timed steps are multiples of H, so each block holds
exactly one parameter average of ap-local and of ddp-local); the table shows the median over
``--repeats`` independent worlds of that figure, and the range over the repeats.

Bytes sent per step per rank are nominal ring figures: autopar's from ``ModeState.sent_bytes``
(the runtime counts all-reduces as ``2(n-1)/n x payload``, all-gathers as ``(n-1) x payload``,
gossip as ``peers x parameters``), ap-allreduce and ddp as ``2(n-1)/n x gradient bytes``; the
hooks and the averager of the other torch peers call ``torch.distributed.all_reduce``, which the
bench wraps to add up the payloads, counted as ``2(n-1)/n x payload``. gloo's own algorithm
may move a different number of bytes; the figures compare what each variant asks to send.

At the end it prints the simulator's prediction of ResNet-50-sized gradients (25.5 M fp32
parameters) on 256 GPUs of a DGX-like cluster, ring all-reduce vs gossip, next to the published
278 ms vs 150 ms, when ``autopar.cost.dp_modes.resnet50_prediction`` exists.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402 - after the filter above
from torch import nn  # noqa: E402

import _common as common  # noqa: E402 - bench/ is the script directory

LR, MOMENTUM = 0.01, 0.9
VARIANTS = ("ap-allreduce", "ap-local", "ap-quantize", "ap-topk", "ap-randk", "ap-gossip-ring",
            "ap-gossip-exp", "ap-async", "ddp", "ddp-local", "ddp-powersgd", "ddp-fp16")
# autopar variant -> its torch peer (None: torch has none)
PEERS = {"ap-allreduce": "ddp", "ap-local": "ddp-local", "ap-quantize": "ddp-fp16", "ap-topk": "ddp-powersgd",
         "ap-randk": "ddp-powersgd", "ap-gossip-ring": None, "ap-gossip-exp": None, "ap-async": None}
COMPRESSION_PEERS = ("ddp-powersgd", "ddp-fp16")
PUBLISHED_MS = {"allreduce": 278.0, "gossip": 150.0}


def dp_mode_of(variant: str, knobs: dict):
    return {"ap-allreduce": None,
            "ap-local": {"kind": "local_sgd", "sync_every": knobs["sync_every"]},
            "ap-quantize": {"kind": "compressed", "compressor": "quantize", "levels": 5},
            "ap-topk": {"kind": "compressed", "compressor": "topk", "ratio": knobs["topk_ratio"]},
            "ap-randk": {"kind": "compressed", "compressor": "randk", "ratio": knobs["randk_ratio"]},
            "ap-gossip-ring": {"kind": "gossip", "topology": "ring"},
            "ap-gossip-exp": {"kind": "gossip", "topology": "exponential"},
            "ap-async": {"kind": "async", "staleness": 1}}[variant]


# -- model, counting, variants ------------------------------------------------------------------

def build_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def ring(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


class Counter:
    """Adds up the payload bytes of every ``torch.distributed.all_reduce`` call (what DDP's
    Python hooks and the model averager send); the C++ reducer's own all-reduce is not seen."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.payload = 0
        self._orig = dist.all_reduce

        def counted(tensor, *a, **k):
            self.payload += tensor.numel() * tensor.element_size()
            return self._orig(tensor, *a, **k)

        dist.all_reduce = counted


def make(variant: str, width: int, layers: int, x: torch.Tensor, world: int, knobs: dict):
    """(module, optimizer) of one variant, from the same seed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_model(width, layers)
    if variant.startswith("ap-"):
        import autopar
        pm = autopar.parallelize(model, {"dp": world}, (x,), zero_stage=0,
                                 options=autopar.DataOptions(dp_mode=dp_mode_of(variant, knobs)))
        return pm, autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    # powerSGD_hook with more than one bucket deadlocks on gloo here (its second all-reduce is
    # issued from a future's callback, so two buckets' collectives can interleave differently
    # on different ranks): an explicit cap above the model size keeps one bucket.
    ddp = DDP(model, bucket_cap_mb=max(25.0, grad_mb + 1)) if variant == "ddp-powersgd" else DDP(model)
    if variant == "ddp-local":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                                                 post_local_gradient_allreduce=False), post_localSGD_hook)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM),
                                    PeriodicModelAverager(period=knobs["sync_every"], warmup_steps=0))
        return ddp, opt
    if variant == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        ddp.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                  start_powerSGD_iter=2, warm_start=True), psgd.powerSGD_hook)
    elif variant == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        ddp.register_comm_hook(dist.group.WORLD, fp16_compress_hook)
    elif variant != "ddp":
        raise ValueError(variant)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)


def sent_so_far(variant: str, module, counter: Counter, steps_done: int, grad_bytes: int, world: int) -> float:
    """Bytes this rank has sent for ``variant`` (cumulative; a nominal ring figure)."""
    if variant.startswith("ap-"):
        modes = module.dp_runtime.modes
        return modes.sent_bytes if modes is not None else steps_done * ring(grad_bytes, world)
    if variant == "ddp":
        return steps_done * ring(grad_bytes, world)
    return ring(counter.payload, world)      # the hooks' and the averager's all_reduce payloads


# -- one rank -----------------------------------------------------------------------------------

def rank_work(rank: int, world: int, width: int, layers: int, rows: int, warmup: int, steps: int,
              variants: tuple[str, ...], knobs: dict) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = torch.randn(rows * world, width).chunk(world)[rank].contiguous()
    grad_bytes = sum(p.numel() * p.element_size() for p in build_model(width, layers).parameters())
    counters = {}
    built, setup_s = {}, {}
    for v in variants:
        t0 = time.perf_counter()
        built[v] = make(v, width, layers, x, world, knobs)
        setup_s[v] = time.perf_counter() - t0
    times: dict[str, list[float]] = {v: [] for v in variants}
    sent: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    counter = Counter()
    for i in range(warmup + steps):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            module, opt = built[v]
            counter.payload = counters.get(v, 0)
            before = sent_so_far(v, module, counter, i, grad_bytes, world)
            phases, loss = common.timed_step(module, opt, (x,))
            counters[v] = counter.payload
            after = sent_so_far(v, module, counter, i + 1, grad_bytes, world)
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(sum(phases[:3]))
                sent[v].append(after - before)
    dist.barrier()
    return {"times": times, "sent": sent, "losses": losses, "setup_s": setup_s, "grad_bytes": grad_bytes}


# -- report -------------------------------------------------------------------------------------

def summarise(res: list[dict], variants: tuple[str, ...], steps: int, block: int) -> dict:
    out = {}
    for v in variants:
        slowest = [max(r["times"][v][i] for r in res) for i in range(steps)]
        blocks = [statistics.fmean(slowest[j:j + block]) for j in range(0, steps, block)]
        out[v] = {"ms": statistics.median(blocks) * 1e3,
                  "bytes": statistics.fmean(statistics.fmean(r["sent"][v]) for r in res),
                  "loss_last": statistics.fmean(r["losses"][v][-1] for r in res),
                  "setup_s": max(r["setup_s"][v] for r in res)}
    return out


def combine(repeats: list[dict], variants: tuple[str, ...]) -> dict:
    out = {}
    for v in variants:
        ms = [r[v]["ms"] for r in repeats]
        out[v] = {"ms": statistics.median(ms), "lo": min(ms), "hi": max(ms),
                  "bytes": statistics.median(r[v]["bytes"] for r in repeats),
                  "loss_last": repeats[-1][v]["loss_last"], "setup_s": max(r[v]["setup_s"] for r in repeats)}
    return out


def _fmt_ratio(x: float | None, goal: float | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + ("" if goal is None or x <= goal else " MISSED")


def table(s: dict, variants: tuple[str, ...]) -> list[str]:
    base = s.get("ap-allreduce")
    lines = ["| variant | torch peer | step ms (median) | range over repeats | vs ap-allreduce | vs peer (goal <= 1.05) "
             "| MB sent / step / rank | bytes vs allreduce | peer's MB | bytes vs peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        r = s[v]
        peer = PEERS.get(v)
        p = s.get(peer) if peer else None
        vs_base = r["ms"] / base["ms"] if base else None
        vs_peer = r["ms"] / p["ms"] if p else None
        b_base = r["bytes"] / base["bytes"] if base and base["bytes"] else None
        lines.append(f"| {v} | {peer or '-'} | {r['ms']:.1f} | {r['lo']:.1f}-{r['hi']:.1f} | {_fmt_ratio(vs_base)} | "
                     f"{_fmt_ratio(vs_peer, 1.05)} | {r['bytes'] / 1e6:.3f} | {_fmt_ratio(b_base)} | "
                     f"{p['bytes'] / 1e6:.3f} | {_fmt_ratio(r['bytes'] / p['bytes'] if p and p['bytes'] else None)} |"
                     if p else
                     f"| {v} | {peer or '-'} | {r['ms']:.1f} | {r['lo']:.1f}-{r['hi']:.1f} | {_fmt_ratio(vs_base)} | "
                     f"- | {r['bytes'] / 1e6:.3f} | {_fmt_ratio(b_base)} | - | - |")
    return lines


def compression_table(s: dict) -> list[str]:
    aps = [v for v in ("ap-quantize", "ap-topk", "ap-randk") if v in s]
    peers = [p for p in COMPRESSION_PEERS if p in s]
    if not aps or not peers:
        return []
    head = "| autopar mode | " + " | ".join(f"time vs {p} | bytes vs {p}" for p in peers) + " |"
    lines = [head, "|---|" + "---|---|" * len(peers)]
    for v in aps:
        cells = []
        for p in peers:
            cells += [f"{s[v]['ms'] / s[p]['ms']:.3f}", f"{s[v]['bytes'] / s[p]['bytes']:.3f}" if s[p]["bytes"] else "-"]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines


def resnet50_row() -> list[str]:
    """The simulator's ResNet-50 prediction (256 GPUs, 25.5 M fp32 parameters), if the cost
    model provides it."""
    try:
        mod = importlib.import_module("autopar.cost.dp_modes")
    except ImportError as e:
        return [f"simulator: autopar.cost.dp_modes is not importable ({e}); ResNet-50 row left out"]
    fn = getattr(mod, "resnet50_prediction", None)
    if fn is None:
        return ["simulator: autopar.cost.dp_modes.resnet50_prediction does not exist; ResNet-50 row left out"]
    got = fn()
    if isinstance(got, dict):
        pred = {k: float(v) for k, v in got.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    else:
        pred = {"allreduce": float(got[0]), "gossip": float(got[1])}
    ar = next((v for k, v in pred.items() if "allreduce" in k), None)
    gossips = [(k, v) for k, v in pred.items() if "gossip" in k]
    lines = ["| ResNet-50 gradients, 256 GPUs, per iteration | all-reduce ms | gossip ms | all-reduce / gossip |",
             "|---|---|---|---|",
             f"| published | {PUBLISHED_MS['allreduce']:.0f} | {PUBLISHED_MS['gossip']:.0f} | "
             f"{PUBLISHED_MS['allreduce'] / PUBLISHED_MS['gossip']:.2f} |"]
    for k, go in gossips:
        if ar is not None and go:
            lines.append(f"| simulator, {k} | {ar * 1e3:.1f} | {go * 1e3:.1f} | {ar / go:.2f} |")
    lines.append(f"(resnet50_prediction() returned {got!r})")
    return lines


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per variant and repeat (default 24)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up steps per variant and repeat (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="independent worlds (default 3)")
    ap.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    ap.add_argument("--layers", type=int, default=4, help="MLP Linear layers (default 4)")
    ap.add_argument("--rows", type=int, default=16, help="rows per rank (default 16)")
    ap.add_argument("--sync-every", type=int, default=4, help="local SGD period H (default 4)")
    ap.add_argument("--topk-ratio", type=float, default=0.001,
                    help="top-k's share of entries (default 0.001: at or under PowerSGD's bytes here)")
    ap.add_argument("--randk-ratio", type=float, default=0.004,
                    help="rand-k's share of entries (default 0.004: at or under PowerSGD's bytes here)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=600.0, help="per-world timeout of run_ranks, s")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: width 512, 3 layers, 4 warm-up + 8 timed steps, 1 repeat")
    a = ap.parse_args()
    if a.quick:
        a.width, a.layers, a.warmup, a.steps, a.repeats = 512, 3, 4, 8, 1
    h = a.sync_every
    a.steps = max(h, -(-a.steps // h) * h)          # whole blocks of H steps
    a.warmup = -(-a.warmup // h) * h
    a.variants = tuple(v for v in a.variants.split(",") if v)
    if any(v not in VARIANTS for v in a.variants):
        ap.error(f"--variants takes names from {VARIANTS}")
    return a


def main() -> int:
    from autopar.runtime.launch import run_ranks
    a = args()
    t_all = time.perf_counter()
    command = "python bench/dp_modes.py " + " ".join(sys.argv[1:])
    n_params = sum(p.numel() for p in build_model(a.width, a.layers).parameters())
    load_before = open("/proc/loadavg").read().strip()
    print(f"machine: {common.machine_line()}\nload before: {load_before}")
    print(f"model: MLP {a.layers} x Linear({a.width}, {a.width}) ({n_params:,} params, {n_params * 4 / 1e6:.1f} MB "
          f"fp32), {a.rows} rows/rank, world {a.world}; SGD lr {LR} momentum {MOMENTUM}; H = {a.sync_every}; "
          f"{a.warmup} warm-up + {a.steps} timed steps per variant, {a.repeats} repeat(s); top-k {a.topk_ratio:g}, "
          f"rand-k {a.randk_ratio:g} of the entries", flush=True)
    repeats = []
    for rep in range(a.repeats):
        t0 = time.perf_counter()
        res = run_ranks(rank_work, a.world, a.width, a.layers, a.rows, a.warmup, a.steps, a.variants,
                        {"sync_every": a.sync_every, "topk_ratio": a.topk_ratio, "randk_ratio": a.randk_ratio},
                        timeout_s=a.timeout)
        s = summarise(res, a.variants, a.steps, a.sync_every)
        repeats.append(s)
        print(f"repeat {rep + 1}: {time.perf_counter() - t0:.1f} s; "
              + ", ".join(f"{v} {s[v]['ms']:.1f}" for v in a.variants), flush=True)
    s = combine(repeats, a.variants)
    load_after = open("/proc/loadavg").read().strip()
    wall = time.perf_counter() - t_all
    print(f"\ncommand: {command}\nmachine: {common.machine_line()}\ndate: {datetime.date.today().isoformat()}")
    print(f"load before: {load_before}\nload after:  {load_after}\n")
    print("\n".join(table(s, a.variants)))
    comp = compression_table(s)
    if comp:
        print("\ncompressed modes vs both compression peers (ratios autopar / torch):\n" + "\n".join(comp))
    print("\nlast-step loss (mean over ranks, last repeat): "
          + ", ".join(f"{v} {s[v]['loss_last']:.4f}" for v in a.variants))
    print("setup s (max over ranks and repeats): " + ", ".join(f"{v} {s[v]['setup_s']:.1f}" for v in a.variants))
    print("\n" + "\n".join(resnet50_row()))
    print(f"\ntotal wall {wall:.1f} s")
    print(json.dumps({"bench": "dp_modes", "world": a.world, "width": a.width, "layers": a.layers, "rows": a.rows,
                      "params": n_params, "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats,
                      "sync_every": a.sync_every, "cores": os.cpu_count(), "torch": torch.__version__,
                      "load_before": load_before, "load_after": load_after, "wall_s": wall,
                      "variants": s, "per_repeat": repeats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
