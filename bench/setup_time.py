"""Benchmark: set-up time (``autopar.parallelize`` wall and time to first step) against depth,
with an empty capture cache (cold) and a filled one (warm), beside DDP's wrap.

Command:  python bench/setup_time.py [--layers 2 8 32] [--world 1 2] [--repeats 3]
                                     [--hidden 256] [--heads 4] [--vocab 1024] [--batch 4] [--seq 128]
                                     [--plan-layers 32] [--plan-hidden 2048] [--plan-ffn 5632]
          (--plan-layers 0: no planning line)
          python bench/setup_time.py --matrix [--modes dp tp pp] [--arch llama,mamba] [--repeats 1]

``--matrix`` times ``parallelize`` for every architecture of the model matrix
(``tests/matrix_models.py``: tiny random-init ``transformers`` models, float32) at world 2, each
mesh of ``--modes`` with the matrix's own options (``tests/matrix_run.MODES``), cold and warm, in
fresh processes as below; the goal is every architecture under 5 s cold.

Every measurement is a fresh Python process (``python bench/setup_time.py --child ...``), so
nothing is reused in memory: *cold* gets a new, empty ``AUTOPAR_CACHE_DIR``; *warm* reuses
the directory the cold run filled (what the second run of a training script sees). A GPT
(``autopar.models.build("gpt", ...)``, float32) is built first (not counted), then timed:
``parallelize(model, {"dp": world}, (tokens,))`` wall, and the first forward, backward and
SGD step after it (time to first step = both), from a barrier after every rank has built its
model (so a rank's wait for another's model initialisation is not counted). At world 2 the
figure is the slower rank's.
The peer is ``DistributedDataParallel(model)`` plus its first step, in the same process kind.
Medians of ``--repeats`` processes; the depths take turns within each repeat. The issue's goals: 4-layer GPT under 1 s warm and 2 s cold;
set-up growing with block classes, not layers (32 vs 2 layers within 1.5x).

The last line plans a 1B-class model on the meta device (``autopar.plan``; zoo ``llama``,
``--plan-layers`` x ``--plan-hidden``, SwiGLU width ``--plan-ffn``, vocabulary 32000: 1.8 B
parameters by default; batch 8 x seq 1024, mesh dp=2 x tp=4, nothing allocated), cold and warm.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _rank(rank: int, world: int, cfg: dict, system: str) -> dict:
    import torch
    import autopar
    from autopar import models
    torch.manual_seed(0)
    model = models.build("gpt", {k: cfg[k] for k in ("hidden", "heads", "layers", "vocab")}, device="cpu")
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    torch.distributed.barrier()      # every rank has built its model: no rank's wait for the others' init is counted
    t0 = time.perf_counter()
    if system == "autopar":
        module = autopar.parallelize(model, {"dp": world}, (tokens,))
    else:
        module = torch.nn.parallel.DistributedDataParallel(model)
    t1 = time.perf_counter()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    module(tokens).logsumexp(-1).mean().backward()
    opt.step()
    t2 = time.perf_counter()
    return {"setup": t1 - t0, "first_step": t2 - t0}


def _matrix_rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import autopar
    from tests.matrix_models import architectures
    from tests.matrix_run import MODES, SHARES, _share
    e = architectures()[cfg["arch"]]
    mesh, kw = MODES[cfg["mode"]]
    model = e.build(torch.float32, 0)
    batch = e.batch(4, 1)
    mine = _share(batch, rank) if cfg["mode"] in SHARES else batch
    torch.distributed.barrier()
    t0 = time.perf_counter()
    autopar.parallelize(model, mesh, example_kwargs=mine, **kw)
    return {"setup": time.perf_counter() - t0, "first_step": float("nan")}


def _child(a: argparse.Namespace) -> None:
    cfg = json.loads(a.child)
    if cfg.get("arch"):
        sys.path.insert(0, os.path.dirname(HERE))
        from autopar.runtime.launch import run_ranks
        out = run_ranks(_matrix_rank, 2, cfg, timeout_s=600)
        print(json.dumps({"setup": max(r["setup"] for r in out)}))
        return
    if cfg.get("plan"):
        import autopar
        from autopar import models
        t0 = time.perf_counter()
        m = models.build("llama", {"hidden": cfg["hidden"], "layers": cfg["layers"], "heads": cfg["hidden"] // 128,
                                   "ffn": cfg["ffn"], "vocab": 32000}, device="meta")
        args, dims = models.example_inputs(m, 8, 1024, device="meta")
        t1 = time.perf_counter()
        autopar.plan(m, {"dp": 2, "tp": 4}, args, dims=dims)
        print(json.dumps({"setup": time.perf_counter() - t1, "build": t1 - t0,
                          "params": sum(p.numel() for p in m.parameters())}))
        return
    from autopar.runtime.launch import run_ranks
    out = run_ranks(_rank, cfg["world"], cfg, cfg["system"], timeout_s=600)
    print(json.dumps({k: max(r[k] for r in out) for k in ("setup", "first_step")}))


def _measure(cfg: dict, cache_dir: str) -> dict:
    env = {**os.environ, "AUTOPAR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({cfg}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cold_warm(cfg: dict, repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="autopar-bench-cache-") as d:
            runs["cold"].append(_measure(cfg, d))
            runs["warm"].append(_measure(cfg, d))
    return runs


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    for k, v in (("hidden", 256), ("heads", 4), ("vocab", 1024), ("batch", 4), ("seq", 128)):
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--plan-layers", type=int, default=32)
    ap.add_argument("--plan-hidden", type=int, default=2048)
    ap.add_argument("--plan-ffn", type=int, default=5632)
    ap.add_argument("--matrix", action="store_true", help="time every architecture of the model matrix")
    ap.add_argument("--modes", nargs="+", default=["dp"], help="--matrix: meshes of tests/matrix_run.MODES")
    ap.add_argument("--arch", help="--matrix: comma-separated architectures (default all)")
    a = ap.parse_args()
    if a.child:
        _child(a)
        return
    if a.matrix:
        _matrix(a)
        return
    import _common as common
    print(common.machine_line(), f"| load {os.getloadavg()[0]:.2f}")
    print(f"GPT hidden {a.hidden}, heads {a.heads}, vocab {a.vocab}, batch {a.batch} x seq {a.seq}; "
          f"medians of {a.repeats} fresh processes; seconds\n")
    print("| world | layers | autopar cold: setup / first step | warm: setup / first step | DDP: setup / first step |")
    print("|---|---|---|---|---|")
    table: dict[tuple[int, int], dict] = {}
    with tempfile.TemporaryDirectory() as d:   # untimed: fills the OS file cache (torch, autopar) for all rows
        _measure({"hidden": a.hidden, "heads": a.heads, "layers": min(a.layers), "vocab": a.vocab, "batch": a.batch,
                  "seq": a.seq, "world": max(a.world), "system": "autopar"}, d)
    for world in a.world:
        cfgs = {layers: {"hidden": a.hidden, "heads": a.heads, "layers": layers, "vocab": a.vocab, "batch": a.batch,
                         "seq": a.seq, "world": world, "system": "autopar"} for layers in a.layers}
        runs = {layers: {"cold": [], "warm": []} for layers in a.layers}
        ddp: dict[int, list[dict]] = {layers: [] for layers in a.layers}
        for _ in range(a.repeats):    # the depths take turns, so a drift in the machine's speed reaches each alike
            for layers, cfg in cfgs.items():
                got = _cold_warm(cfg, 1)
                runs[layers]["cold"] += got["cold"]
                runs[layers]["warm"] += got["warm"]
                with tempfile.TemporaryDirectory() as d:
                    ddp[layers].append(_measure({**cfg, "system": "ddp"}, d))
        for layers in a.layers:
            r = table[world, layers] = runs[layers]
            print(f"| {world} | {layers} | {_med(r['cold'], 'setup'):.2f} / {_med(r['cold'], 'first_step'):.2f} "
                  f"| {_med(r['warm'], 'setup'):.2f} / {_med(r['warm'], 'first_step'):.2f} "
                  f"| {_med(ddp[layers], 'setup'):.3f} / {_med(ddp[layers], 'first_step'):.2f} |", flush=True)
    lo, hi = min(a.layers), max(a.layers)
    for world in a.world:
        for kind in ("cold", "warm"):
            r = _med(table[world, hi][kind], "setup") / _med(table[world, lo][kind], "setup")
            print(f"world {world}, {kind}: setup at {hi} layers / {lo} layers = {r:.2f} (goal <= 1.5)")
    if not a.plan_layers:
        print(f"load after: {os.getloadavg()[0]:.2f}")
        return
    plan = {"plan": True, "layers": a.plan_layers, "hidden": a.plan_hidden, "ffn": a.plan_ffn}
    runs = _cold_warm(plan, a.repeats)
    params = runs["cold"][0]["params"]
    print(f"\nautopar.plan of a {params / 1e9:.2f} B-parameter llama ({a.plan_layers} layers, hidden {a.plan_hidden}) "
          f"on the meta device, dp=2 x tp=4: cold {_med(runs['cold'], 'setup'):.2f} s, "
          f"warm {_med(runs['warm'], 'setup'):.2f} s (goal: cold < 10 s)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


def _matrix(a: argparse.Namespace) -> None:
    import _common as common
    sys.path.insert(0, os.path.dirname(HERE))
    from tests.matrix_models import architectures
    names = a.arch.split(",") if a.arch else list(architectures())
    print(common.machine_line(), f"| load {os.getloadavg()[0]:.2f}")
    print(f"model matrix, world 2, float32; medians of {a.repeats} fresh processes a cell; seconds of parallelize\n")
    print("| architecture | " + " | ".join(f"{m} cold / warm" for m in a.modes) + " |")
    print("|---|" + "---|" * len(a.modes))
    slowest = (0.0, "")
    for name in names:
        cells = []
        for mode in a.modes:
            if mode == "ep" and not architectures()[name].moe:
                cells.append("-")
                continue
            try:
                runs = _cold_warm({"arch": name, "mode": mode}, a.repeats)
            except SystemExit as exc:          # a typed refusal (the matrix records it too)
                why = [ln for ln in str(exc).splitlines() if "autopar.core.errors." in ln]
                cells.append("refused (" + (why[-1].split("errors.")[1].split(":")[0] if why else "child failed") + ")")
                continue
            cold, warm = _med(runs["cold"], "setup"), _med(runs["warm"], "setup")
            slowest = max(slowest, (cold, f"{name} {mode}"))
            cells.append(f"{cold:.2f} / {warm:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nslowest cold: {slowest[1]} {slowest[0]:.2f} s (goal < 5 s)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
