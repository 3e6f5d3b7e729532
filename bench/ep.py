"""Benchmark: autopar expert parallelism vs a hand-written expert-parallel layer, and the
all-to-all it is built on, measured vs autopar's cost model.

Command:  python bench/ep.py [--world 2 4] [--steps 20] [--warmup 2] [--set k=v ...]
                             [--batch 4] [--seq 64] [--profile auto|none|PATH] [--variants ...]
Model: the zoo's Mixtral-style ``moe`` (default 2 layers, hidden 128, 8 experts, top-2, capacity
factor 1.25; ``--set`` overrides), same weights and inputs everywhere, gloo on this machine's
CPU, one thread per rank. Each rank gets ``--batch`` rows of a ``batch * world`` global batch.
Per world size, in the same processes:

1. All-to-all, measured vs predicted. The buffer of one MoE layer at the rank's tokens,
   ``[E, C, h]`` fp32 with ``C = expert_capacity(batch * seq, E, top_k, capacity_factor)``, and
   the same at 0.25x and 4x the capacity. Per size, interleaved rep by rep (order as below):
   ``a2a``  ``dist.all_to_all_single`` of the buffer into a fresh ``empty_like``;
   ``hand`` the hand-written layer's dispatch (the all-to-all, then the owner's transpose);
   ``ap``   autopar's exchange ``EPRuntime.to_owners`` (adds the expert-order index_select).
   A rep's time is the slowest rank's after a barrier; the table shows medians. Predictions:
   ``collective_time("all_to_all", bytes, Cluster.from_spec("1xN", hardware=...), (("ep", N),),
   "ep")`` with the built-in ``cpu`` links and with a profile from ``autopar calibrate --quick``
   (which prices every collective with its all_reduce fit), and the calibration's own
   all_to_all fit (alpha, bandwidth at world 2) through the same ring formula. It also prints
   ``autopar.cost.ep_planner.ep_costs`` of the captured graph (per call and per step).
2. Step time. A full training step (forward, loss ``out.logsumexp(-1).mean()``, backward,
   optimizer step with gradient averaging, zero_grad) of

     nocomm  ``hand`` with both exchanges replaced by the identity (and no gradient all_reduce):
             the same shapes, copies, parameters and FLOPs, no communication (and not the
             model's maths): the floor, so ``X - nocomm`` is what variant X pays to communicate;
     hand    the same model with every MoELayer replaced (same weights) by :class:`HandEPLayer`,
             written directly on torch.distributed (below), AdamW on the rank's parameters
             (its own experts only), dense gradients averaged by one flat all_reduce;
     ap      ``autopar.parallelize(model, {"ep": N}, local_args, options=ExpertOptions(placement="contiguous"))``
             + ``autopar.optimizer`` (the apples-to-apples peer of ``hand``);
     ap-bal  autopar's default ``expert_placement="balanced"``, with the global batch as
             ``calibration`` (so the placement follows the measured expert loads),

   changing the order every step: the rows of a Williams Latin square in turn, so each variant
   takes every slot and follows every other equally often (with plain rotation a variant always
   runs right after the same one, and what ran just before shows in a step's time). A step's
   time is the slowest rank's (ranks aligned by a barrier first). Ratio: median step time
   ap / hand (goal <= 1.05). Losses: every variant's step-0 loss vs the plain single-process
   model's on the rank's tokens (``local``: same tokens, same weights, same capacity) and
   every step vs ``hand``. The measured excess over ``nocomm`` is printed next to
   ``ep_costs``' predicted all-to-all seconds per step.

The hand-written layer routes exactly as ``MoELayer.forward`` (softmax router, top-k,
choice-major capacity positions, index_put into ``[E, C, h]``), sends the buffer to the expert
owners with one ``all_to_all_single`` (rank r owns experts r*E/n ..), runs its E/n experts with
bmm on ``[E/n, n*C, h]``, sends the results back with a second ``all_to_all_single`` and
combines; the exchange is an autograd.Function whose backward is the same exchange of the
gradient. Expert gradients are divided by n locally (the owner already summed every rank's
contribution), which is the average the single-process model over all shares would give.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

# torch warns at import when NumPy is absent; the bench never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # after the filter above

import _common as common  # noqa: E402 - bench/ is the script directory
from torch import nn

VARIANTS = ("nocomm", "hand", "ap", "ap-bal")
SCALES = (0.25, 1.0, 4.0)
MODEL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 512, "experts": 8, "top_k": 2,
         "capacity_factor": 1.25}
# (name, numerator, denominator, goal)
RATIOS = (("ap / hand", "ap", "hand", 1.05), ("ap-bal / hand", "ap-bal", "hand", 1.05))


# -- the hand-written expert-parallel layer ---------------------------------------------------

from ep_peer import HandEPLayer, HandOptimizer, hand_model  # noqa: E402 - bench/ is the script directory


def _build(overrides: dict) -> nn.Module:
    import autopar.models
    torch.manual_seed(0)
    return autopar.models.build("moe", overrides, device="cpu")


def _global_args(model: nn.Module, batch: int, seq: int, world: int) -> tuple:
    import autopar.models
    torch.manual_seed(1)
    args, _ = autopar.models.example_inputs(model, batch * world, seq, device="cpu")
    return tuple(args)


def _make(variant: str, overrides: dict, args: tuple, glob: tuple, rank: int, world: int):
    """(module, optimizer) of one variant, built from the same seed."""
    import autopar
    model = _build(overrides)
    if variant in ("hand", "nocomm"):
        model = hand_model(model, rank, world, comm=variant == "hand")
        return model, HandOptimizer(model, world, comm=variant == "hand", lr=1e-3)
    if variant == "ap":
        pm = autopar.parallelize(model, {"ep": world}, args, options=autopar.ExpertOptions(placement="contiguous"))
    else:
        pm = autopar.parallelize(model, {"ep": world}, args,
                                 options=autopar.ExpertOptions(placement="balanced", calibration=glob))
    return pm, autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)


def _order(i: int, names: list[str]) -> list[str]:
    """Round ``i``'s order: the rows of a Williams Latin square in turn, so that every name
    takes every slot and follows every other name equally often (plain rotation would put
    each variant always after the same one, and what runs just before a step shows in it)."""
    n = len(names)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    rows += [row[::-1] for row in rows] if n % 2 else []
    return [names[j] for j in rows[i % len(rows)]] if n else []


def _agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so a failed variant is dropped everywhere)."""
    import torch.distributed as dist
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


# -- all-to-all -------------------------------------------------------------------------------

def _time_a2a(methods: dict, shapes: list[tuple[int, int, int]], reps: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per rep of each exchange in ``methods`` at each [E, C, h] shape, after a barrier,
    the methods' order changing rep by rep (:func:`_order`)."""
    import torch.distributed as dist
    names = list(methods)
    out = {str(s): {m: [] for m in names} for s in shapes}
    for shape in shapes:
        x = torch.randn(shape)
        with torch.no_grad():
            for i in range(reps + 2):
                for m in _order(i, names):
                    dist.barrier()
                    t0 = time.perf_counter()
                    methods[m](x)
                    if i >= 2:
                        out[str(shape)][m].append(time.perf_counter() - t0)
    return out


def _a2a_methods(built: dict) -> dict:
    import torch.distributed as dist

    def raw(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)
        return y
    methods = {"a2a": raw}
    if "hand" in built:
        layer = next(m for m in built["hand"][0].modules() if isinstance(m, HandEPLayer))
        methods["hand"] = layer.to_owners
    ap = built.get("ap") or built.get("ap-bal")
    if ap is not None:
        methods["ap"] = next(iter(ap[0].ep_runtimes.values())).to_owners
    return methods


def _ep_costs(pm, world: int, batch: int, seq: int, profile: str | None) -> dict:
    """autopar.cost.ep_planner.ep_costs of the captured graph, built-in cpu links and the profile's."""
    import autopar.cost.ep_planner
    from autopar.cost.cluster import Cluster
    out = {}
    for label, hw in (("cpu", "cpu"), ("calibrated", profile)):
        if hw is None:
            continue
        c = autopar.cost.ep_planner.ep_costs(pm.graph_module, cluster=Cluster.from_spec(f"1x{world}", hardware=hw),
                                axes=(("ep", world),), sizes={"batch": batch, "seq": seq})
        out[label] = {"per_call_s": c.per_call_s, "buffer_bytes": c.buffer_bytes, "calls": c.calls,
                      "all_to_all_s": c.all_to_all_s}
    return out


def _headline(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# -- one rank ---------------------------------------------------------------------------------

def _build_variants(variants: tuple[str, ...], overrides: dict, args: tuple, glob: tuple, rank: int,
                    world: int) -> tuple[dict, dict, dict]:
    """(built, setup seconds, errors) per variant; one that fails on any rank is dropped on all."""
    built, setup_s, errors = {}, {}, {}
    for v in variants:
        t0 = time.perf_counter()
        try:
            built[v] = _make(v, overrides, args, glob, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            errors[v] = _headline(exc)
        if not _agree(v not in errors):
            built.pop(v, None)
            errors.setdefault(v, "failed on another rank")
        setup_s[v] = time.perf_counter() - t0
    return built, setup_s, errors


def _run_steps(built: dict, args: tuple, warmup: int, steps: int, errors: dict) -> tuple[dict, dict]:
    """(phase times of the timed steps, losses of every step) per variant, order by :func:`_order`."""
    live = list(built)
    times: dict[str, list] = {v: [] for v in live}
    losses: dict[str, list] = {v: [] for v in live}
    for i in range(warmup + steps):
        for v in _order(i, live):
            if v in errors:
                continue
            try:
                phases, loss = common.timed_step(*built[v], args)
            except Exception as exc:  # noqa: BLE001 - reported per variant
                errors[v] = _headline(exc)
            if not _agree(v not in errors):
                errors.setdefault(v, "failed on another rank")
                continue
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(phases)
    return ({v: t for v, t in times.items() if v not in errors},
            {v: x for v, x in losses.items() if v not in errors})


def rank_work(rank: int, world: int, overrides: dict, batch: int, seq: int, warmup: int, steps: int,
              variants: tuple[str, ...], reps: int, profile: str | None) -> dict:
    import torch.distributed as dist

    from autopar.models.moe import expert_capacity

    torch.set_num_threads(1)
    plain = _build(overrides)
    glob = _global_args(plain, batch, seq, world)
    args = tuple(a.chunk(world)[rank] for a in glob)
    with torch.no_grad():
        local_loss = float(plain(*args).logsumexp(-1).mean())     # the single-process model's
    built, setup_s, errors = _build_variants(variants, overrides, args, glob, rank, world)
    layer = plain.layers[0].mlp
    cap = int(expert_capacity(batch * seq, layer.experts, layer.top_k, layer.capacity_factor))
    shapes = [(layer.experts, max(1, round(cap * f)), plain.config.hidden) for f in SCALES]
    a2a = _time_a2a(_a2a_methods(built), shapes, reps)
    times, losses = _run_steps(built, args, warmup, steps, errors)
    ap = built.get("ap") or built.get("ap-bal")
    costs = _ep_costs(ap[0], world, batch, seq, profile) if ap is not None and rank == 0 else {}
    owned = {v: {f: list(rt.owned()) for f, rt in built[v][0].ep_runtimes.items()}
             for v in ("ap", "ap-bal") if v in built}
    dist.barrier()
    return {"times": times, "losses": losses, "setup_s": setup_s, "errors": errors, "local_loss": local_loss,
            "a2a": a2a, "shapes": shapes, "capacity": cap, "costs": costs, "owned": owned}


# -- predictions ------------------------------------------------------------------------------

def _predict(nbytes: float, world: int, profile: str | None) -> dict[str, float]:
    """Seconds for one all-to-all of ``nbytes`` (send buffer per rank) by each model."""
    from autopar.cost.cluster import Cluster
    from autopar.cost.comm import collective_time, ring_coefficients
    axes = (("ep", world),)
    out = {"cpu": collective_time("all_to_all", nbytes, Cluster.from_spec(f"1x{world}", hardware="cpu"), axes, "ep")}
    if profile:
        out["calibrated"] = collective_time("all_to_all", nbytes, Cluster.from_spec(f"1x{world}", hardware=profile),
                                            axes, "ep")
        with open(profile) as f:
            fit = json.load(f)["links"]["gloo"]["collectives"]["all_to_all"]
        steps, volume = ring_coefficients("all_to_all", world)
        out["a2a-fit"] = steps * fit["alpha_s"] + volume * nbytes / fit["bandwidth"]
    return out


def _calibrate(choice: str, tmp: str) -> str | None:
    """The hardware profile to compare with: none, a given path, or a fresh quick calibration."""
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    path = os.path.join(tmp, "cpu.json")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--quick", "--out", path],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(path):
        print(f"calibration failed (exit {proc.returncode}); predicting with the built-in cpu links only")
        return None
    with open(path) as f:
        gloo = json.load(f)["links"]["gloo"]
    a2a = gloo["collectives"]["all_to_all"]
    print(f"calibrated ({time.perf_counter() - t0:.1f} s, autopar calibrate --quick, gloo world 2): "
          f"link (all_reduce fit) alpha {gloo['alpha_s'] * 1e6:.1f} us, bw {gloo['bandwidth'] / 1e9:.2f} GB/s; "
          f"all_to_all fit alpha {a2a['alpha_s'] * 1e6:.1f} us, bw {a2a['bandwidth'] / 1e9:.2f} GB/s")
    return path


# -- report -----------------------------------------------------------------------------------

def _slowest(res: list[dict], get) -> list:
    """Per step / rep, the slowest rank's entry (``get(rank_result)`` gives a list)."""
    lists = [get(r) for r in res]
    return [max(col, key=lambda p: sum(p) if isinstance(p, list) else p) for col in zip(*lists)]


def _summarise_steps(res: list[dict]) -> dict:
    out = {}
    variants = [v for v in VARIANTS if v in res[0]["times"]]
    for v in variants:
        per_step = _slowest(res, lambda r: r["times"][v])
        totals = [sum(p) for p in per_step]
        out[v] = {"median_ms": statistics.median(totals) * 1e3, "min_ms": min(totals) * 1e3,
                  "phases_ms": [statistics.median(p[j] for p in per_step) * 1e3 for j in range(3)],
                  "step_ms": [round(t * 1e3, 2) for t in totals], "setup_s": max(r["setup_s"][v] for r in res)}
        if v == "nocomm":                                   # not the model's maths: no loss checks
            continue
        out[v]["loss0_vs_local"] = max(abs(r["losses"][v][0] - r["local_loss"]) for r in res)
        if "hand" in res[0]["losses"]:
            out[v]["loss_vs_hand"] = max(abs(a - b) for r in res for a, b in zip(r["losses"][v], r["losses"]["hand"]))
    return out


def _summarise_a2a(res: list[dict], world: int, profile: str | None) -> list[dict]:
    rows = []
    for scale, shape in zip(SCALES, res[0]["shapes"]):
        key = str(tuple(shape))
        nbytes = 4 * shape[0] * shape[1] * shape[2]
        reps = {m: _slowest(res, lambda r: r["a2a"][key][m]) for m in res[0]["a2a"][key]}
        rows.append({"scale": scale, "shape": list(shape), "bytes": nbytes,
                     "measured_s": {m: statistics.median(t) for m, t in reps.items()},
                     "measured_min_s": {m: min(t) for m, t in reps.items()},
                     "predicted_s": _predict(nbytes, world, profile)})
    return rows


def _print_world(s: dict, a2a: list[dict], res: list[dict], run_s: float) -> list[dict]:
    floor = s["nocomm"]["median_ms"] if "nocomm" in s else None
    print(f"{'variant':<8}{'median':>9}{'min':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}{'vs nocomm':>10}"
          f"{'loss0-local':>13}{'loss-hand':>11}  setup s")
    for v, r in s.items():
        f, b, o = r["phases_ms"]
        over = f"{r['median_ms'] - floor:+.1f}" if floor is not None else "-"
        l0 = f"{r['loss0_vs_local']:.1e}" if "loss0_vs_local" in r else "-"
        lh = f"{r['loss_vs_hand']:.1e}" if "loss_vs_hand" in r else "-"
        print(f"{v:<8}{r['median_ms']:>9.1f}{r['min_ms']:>8.1f}{f:>7.1f}{b:>7.1f}{o:>7.1f}{over:>10}{l0:>13}{lh:>11}"
              f"  {r['setup_s']:.1f}")
    for v, e in res[0]["errors"].items():
        print(f"{v:<8} ERROR: {e}")
    for v, owned in res[0]["owned"].items():
        print(f"{v} placement (rank 0's experts): {owned}")
    _print_a2a([{"world": len(res), "a2a": a2a}])
    costs = res[0]["costs"]
    for label, c in costs.items():
        print(f"ep_costs ({label}): per call {c['per_call_s'] * 1e3:.3f} ms, moved {c['buffer_bytes']:,.0f} B/call, "
              f"{c['calls']} calls/step -> {c['all_to_all_s'] * 1e3:.2f} ms/step")
    if floor is not None:
        excess = ", ".join(f"{v} {s[v]['median_ms'] - floor:+.2f}" for v in s if v != "nocomm")
        print(f"measured step time over nocomm (ms): {excess}")
    rows = [_ratio(s, *spec) for spec in RATIOS if spec[1] in s and spec[2] in s]
    for r in rows:
        print(f"{r['ratio']:<16} time {r['time']:6.3f} (goal <= {r['goal']}: {'ok' if r['ok'] else 'MISSED'})  "
              f"{r['ms'][0]:.1f} / {r['ms'][1]:.1f} ms")
    print(f"(ranks ran {run_s:.1f} s)", flush=True)
    return rows


def _print_a2a(worlds: list[dict]) -> None:
    """The all-to-all table: measured medians (slowest rank; the raw all-to-all's fastest rep
    too) next to each prediction, ms."""
    print(f"{'world':>5}{'scale':>6}{'[E, C, h]':>15}{'bytes':>11}{'a2a':>8}{'(min)':>8}{'hand':>8}{'ap':>8}"
          f"{'pred cpu':>10}{'pred cal':>10}{'pred fit':>10}{'a2a/cpu':>9}{'a2a/cal':>9}{'a2a/fit':>9}{'ap/a2a':>8}")

    def cell(d: dict, k: str, n: int = 8) -> str:
        return f"{d[k] * 1e3:>{n}.3f}" if k in d else f"{'-':>{n}}"
    for w in worlds:
        for r in w.get("a2a", []):
            m, p = r["measured_s"], r["predicted_s"]
            rat = "".join(f"{m['a2a'] / p[k]:>9.2f}" if k in p else f"{'-':>9}"
                          for k in ("cpu", "calibrated", "a2a-fit"))
            over = f"{m['ap'] / m['a2a']:>8.2f}" if "ap" in m else f"{'-':>8}"
            low = r.get("measured_min_s", {})
            print(f"{w['world']:>5}{r['scale']:>6}{str(tuple(r['shape'])):>15}{r['bytes']:>11,}{cell(m, 'a2a')}"
                  f"{cell(low, 'a2a')}"
                  f"{cell(m, 'hand')}{cell(m, 'ap')}{cell(p, 'cpu', 10)}{cell(p, 'calibrated', 10)}"
                  f"{cell(p, 'a2a-fit', 10)}{rat}{over}")


def _ratio(s: dict, label: str, a: str, b: str, goal: float) -> dict:
    t = s[a]["median_ms"] / s[b]["median_ms"]
    return {"ratio": label, "a": a, "b": b, "goal": goal, "time": t, "ok": t <= goal,
            "ms": (s[a]["median_ms"], s[b]["median_ms"])}


def _print_final(worlds: list[dict], command: str, machine: str, wall: float) -> None:
    print(f"\ncommand: {command}\nmachine: {machine}\ndate: {datetime.date.today().isoformat()}")
    print("all-to-all of one MoE layer's [E, C, h] fp32 buffer (1x: the benchmark's capacity), ms")
    _print_a2a(worlds)
    print(f"\n{'world':>5}  {'ratio':<16}{'time':>7}{'goal':>9}  ms (autopar / hand)")
    for w in worlds:
        if "error" in w:
            print(f"{w['world']:>5}  ERROR: {w['error']}")
        for r in w.get("ratios", []):
            print(f"{w['world']:>5}  {r['ratio']:<16}{r['time']:>7.3f}{'<= ' + str(r['goal']):>9}"
                  f"  {r['ms'][0]:.1f} / {r['ms'][1]:.1f}  {'ok' if r['ok'] else 'MISSED'}")
    print(f"total wall {wall:.1f} s")


def _overrides(a: argparse.Namespace) -> dict:
    return common.overrides(a.set, {**MODEL, "max_seq": a.seq})


def _args() -> argparse.Namespace:
    ap = common.base_parser(__doc__)
    ap.add_argument("--set", action="extend", nargs="+", metavar="K=V",
                    help="model config overrides, e.g. --set hidden=256 experts=4")
    ap.add_argument("--batch", type=int, default=4, help="rows per rank (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--reps", type=int, default=30, help="timed all-to-alls per size and method (default 30)")
    ap.add_argument("--profile", default="auto",
                    help="hardware profile for the calibrated prediction: auto (run autopar calibrate --quick), "
                         "none, or a path")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=600.0, help="per-world timeout of run_ranks, s")
    a = ap.parse_args()
    names = [v for v in a.variants.split(",") if v]
    if any(v not in VARIANTS for v in names):
        ap.error(f"--variants takes names from {VARIANTS}")
    a.variants = tuple(v for v in VARIANTS if v in names)
    return a


def _run_world(a: argparse.Namespace, world: int, overrides: dict, profile: str | None) -> dict:
    from autopar.runtime.launch import run_ranks
    print(f"\n== world {world} ==", flush=True)
    t0 = time.perf_counter()
    try:
        res = run_ranks(rank_work, world, overrides, a.batch, a.seq, a.warmup, a.steps, a.variants, a.reps,
                        profile, timeout_s=a.timeout)
    except Exception as exc:  # noqa: BLE001 - one world's failure does not stop the others
        print(f"ERROR: {str(exc).splitlines()[0]}")
        return {"world": world, "error": str(exc).splitlines()[0]}
    run_s = time.perf_counter() - t0
    s = _summarise_steps(res)
    a2a = _summarise_a2a(res, world, profile)
    print(f"capacity C = {res[0]['capacity']} rows per expert at {a.batch * a.seq} tokens per rank")
    rows = _print_world(s, a2a, res, run_s)
    return {"world": world, "capacity": res[0]["capacity"], "variants": s, "a2a": a2a, "ep_costs": res[0]["costs"],
            "placement": res[0]["owned"], "errors": res[0]["errors"], "ratios": rows, "run_s": run_s}


def main() -> int:
    import autopar.models

    a = _args()
    overrides = _overrides(a)
    n_params = autopar.models.param_count(autopar.models.get_config("moe", overrides))
    t_all = time.perf_counter()
    command = "python bench/ep.py " + " ".join(sys.argv[1:])
    machine = common.machine_line()
    print(f"machine: {machine}")
    print(f"model: moe {overrides} ({n_params:,} params, {n_params * 4 / 2**20:.1f} MiB fp32), "
          f"{a.batch} rows/rank, seq {a.seq}; loss logsumexp(-1).mean(); AdamW lr 1e-3; "
          f"{a.warmup} warm-up + {a.steps} timed steps per variant, order by Williams square; "
          f"{a.reps} reps per all-to-all")
    with tempfile.TemporaryDirectory(prefix="bench_ep_") as tmp:
        profile = _calibrate(a.profile, tmp)
        worlds = [_run_world(a, world, overrides, profile) for world in a.world]
    wall = time.perf_counter() - t_all
    _print_final(worlds, command, machine, wall)
    print(json.dumps({"bench": "ep", "model": "moe", "overrides": overrides, "batch_per_rank": a.batch,
                      "seq": a.seq, "steps": a.steps, "warmup": a.warmup, "reps": a.reps,
                      "profile": a.profile, "cores": os.cpu_count(), "torch": torch.__version__,
                      "machine": machine, "wall_s": wall, "worlds": worlds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
