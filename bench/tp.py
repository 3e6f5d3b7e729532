"""Benchmark: autopar tensor-parallel training step vs torch's own DTensor tensor parallel.

Command:  python bench/tp.py [--worlds 2,4] [--steps 20] [--layers 2 --hidden 256 --heads 8
                              --vocab 512 --batch 4 --seq 128]
Same GPT model, same weights, same inputs and targets, gloo on this machine's CPU. For each
world size, in the same processes, it times a full training step (forward, cross-entropy,
backward, AdamW step, zero_grad) of
  autopar: ``autopar.parallelize(model, world, args, plan=plan)``, the plan found by
           ``autopar.plan`` at the benchmark's sizes (printed below), and
  torch:   ``parallelize_module`` with the hand-written Megatron plan: ColwiseParallel for
           attn q/k/v and mlp fc, RowwiseParallel for attn o_proj and mlp proj; embeddings,
           norms and the tied head stay replicated plain tensors,
alternating A/B step by step (2 warm-up steps each) and reports the ratio of median step
times (goal <= 1.05) and of per-rank parameter bytes (goal 1.00). A step's time is the
slowest rank's. The losses of both variants (and of the unsplit model at step 0) are
compared as a sanity check.

torch's TP needs the attention to reshape with the *local* head count. GPTAttention views
with ``self.heads`` (set to heads // world on every attention module, as torchtitan does)
but reshapes its output with the input's full width ``h``; the torch copy therefore runs a
bench-local forward with identical maths that reshapes to ``(b, s, -1)``. The autopar copy
runs the model unmodified.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

# torch warns at import when NumPy is absent; the bench never needs NumPy.
import warnings
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import _common as common  # noqa: E402 - bench/ is the script directory


def _config(a: argparse.Namespace) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab, "max_seq": a.seq}


def _build(cfg: dict, device: str = "cpu"):
    from autopar import models
    torch.manual_seed(0)
    return models.build("gpt2-small", cfg, device=device)


def _data(model, batch: int, seq: int, vocab: int, device: str = "cpu"):
    from autopar import models
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch, seq, device=device)
    torch.manual_seed(2)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    return args, targets


def _torch_tp(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
        })
        block.attn.heads = model.config.heads // world
        block.attn.forward = types.MethodType(common.local_attn_forward, block.attn)
    return model


def _param_bytes(module) -> dict[str, int]:
    """Bytes of this rank's local tensor of every parameter, by name."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in module.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out[name] = t.numel() * t.element_size()
    return out


def _step(model, opt, args, targets) -> tuple[float, float]:
    """One training step; (seconds, loss). Ranks are aligned by a barrier before the clock starts."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    logits = model(*args)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, float(loss.detach())


def rank_work(rank: int, world: int, cfg: dict, batch: int, seq: int, plan, warmup: int, steps: int) -> dict:
    import autopar
    import torch.distributed as dist

    torch.set_num_threads(1)
    ref_model = _build(cfg)
    args, targets = _data(ref_model, batch, seq, cfg["vocab"])
    with torch.no_grad():
        ref_logits = ref_model(*args)
        ref_loss = float(F.cross_entropy(ref_logits.reshape(-1, cfg["vocab"]), targets.reshape(-1)))
    del ref_model, ref_logits

    pm = autopar.parallelize(_build(cfg), world, args, plan=plan)
    tm = _torch_tp(_build(cfg), world)
    variants = {"autopar": (pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)),
                "torch": (tm, torch.optim.AdamW(tm.parameters(), lr=1e-3))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + steps):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]  # ABBA...: neither always goes first
        for name in order:
            model, opt = variants[name]
            dt, loss = _step(model, opt, args, targets)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt)
    dist.barrier()
    pa, pt = _param_bytes(pm), _param_bytes(tm)
    return {"times": times, "losses": losses, "ref_loss": ref_loss,
            "param_bytes": {"autopar": sum(pa.values()), "torch": sum(pt.values())},
            "param_bytes_differ": {k: (pa.get(k, 0), pt.get(k, 0)) for k in sorted(set(pa) | set(pt))
                                   if pa.get(k, 0) != pt.get(k, 0)},
            "n_params": {"autopar": sum(1 for _ in pm.parameters()), "torch": sum(1 for _ in tm.parameters())}}


def _plan(cfg: dict, world: int, batch: int, seq: int, force: bool):
    import autopar
    model = _build(cfg, device="meta")
    args, _ = _data(model, batch, seq, cfg["vocab"], device="meta")
    sizes = {"batch": batch, "seq": seq}
    if not force:
        plan = autopar.plan(model, world, args, sizes=sizes)
        if any(v != "R" for v in plan.params.values()):
            return plan, "cost (default)"
    return autopar.plan(model, world, args, sizes=sizes, memory_budget=1), "memory_budget=1 (forced sharding)"


def _fmt_plan(plan) -> str:
    by: dict[str, list[str]] = {}
    for key, p in plan.params.items():
        parts = key.split(".")
        short = ".".join(parts[2:]) if parts[0] == "layers" else key  # layers.<i>.attn.q_proj.weight -> attn.q_proj.weight
        if short not in by.get(p, []):
            by.setdefault(p, []).append(short)
    s = plan.summary()
    lines = [f"  sharded {s['sharded_params']} / {len(plan.params)} params; predicted step "
             f"{s['step_time_s'] * 1e3:.1f} ms (compute {s['compute_s'] * 1e3:.1f}, comm {s['comm_s'] * 1e3:.1f})"]
    for p in sorted(by):
        lines.append(f"  {p:>5}: {', '.join(by[p])}")
    return "\n".join(lines)


def main() -> int:
    from autopar.runtime.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant (default 2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--force-shard", action="store_true", help="plan with memory_budget=1 even if the cost "
                    "model already shards")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-world timeout of run_ranks, s")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",") if w.strip()]
    cfg = _config(a)
    for w in worlds:
        if a.heads % w or a.hidden % w or (4 * a.hidden) % w or a.vocab % w:
            ap.error(f"heads, hidden, 4*hidden and vocab must divide by world {w}")

    t_all = time.perf_counter()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"gloo, 1 thread per rank")
    print(f"model: gpt2-small {cfg}, batch {a.batch}, seq {a.seq}; AdamW lr 1e-3; "
          f"{a.warmup} warm-up + {a.steps} timed steps per variant, alternating")
    rows = []
    for world in worlds:
        t0 = time.perf_counter()
        plan, mode = _plan(cfg, world, a.batch, a.seq, a.force_shard)
        t_plan = time.perf_counter() - t0
        print(f"\n== world {world} ==\nautopar plan ({mode}, planned in {t_plan:.1f} s):\n{_fmt_plan(plan)}",
              flush=True)
        t0 = time.perf_counter()
        res = run_ranks(rank_work, world, cfg, a.batch, a.seq, plan, a.warmup, a.steps, timeout_s=a.timeout)
        t_run = time.perf_counter() - t0
        med, per_step = {}, {}
        for name in ("autopar", "torch"):
            per_step[name] = [max(r["times"][name][i] for r in res) for i in range(a.steps)]  # slowest rank
            med[name] = statistics.median(per_step[name])
        pbytes = {name: max(r["param_bytes"][name] for r in res) for name in ("autopar", "torch")}
        la, lt = res[0]["losses"]["autopar"], res[0]["losses"]["torch"]
        loss_rank_spread = max(abs(r["losses"][n][i] - res[0]["losses"][n][i])
                               for r in res for n in ("autopar", "torch") for i in range(len(la)))
        row = {"world": world, "plan_mode": mode, "sharded_params": plan.summary()["sharded_params"],
               "total_params": len(plan.params),
               "median_ms": {k: v * 1e3 for k, v in med.items()},
               "min_ms": {k: min(v) * 1e3 for k, v in per_step.items()},
               "step_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in per_step.items()},
               "time_ratio": med["autopar"] / med["torch"],
               "param_bytes_per_rank": pbytes, "param_ratio": pbytes["autopar"] / pbytes["torch"],
               "loss0": {"autopar": la[0], "torch": lt[0], "unsplit": res[0]["ref_loss"]},
               "loss0_absdiff": abs(la[0] - lt[0]),
               "loss0_absdiff_vs_unsplit": max(abs(la[0] - res[0]["ref_loss"]), abs(lt[0] - res[0]["ref_loss"])),
               "loss_max_absdiff_all_steps": max(abs(x - y) for x, y in zip(la, lt)),
               "loss_max_rank_spread": loss_rank_spread,
               "run_s": t_run, "plan_s": t_plan}
        rows.append(row)
        print(f"{'':<10}{'median ms':>10}{'min ms':>9}{'param B/rank':>14}")
        for name in ("autopar", "torch"):
            print(f"{name:<10}{row['median_ms'][name]:>10.1f}{row['min_ms'][name]:>9.1f}{pbytes[name]:>14,}")
        t_ok = "ok" if row["time_ratio"] <= 1.05 else "MISSED"
        p_ok = "ok" if abs(row["param_ratio"] - 1.0) < 0.005 else "MISSED"
        print(f"{'ratio':<10}{row['time_ratio']:>10.3f}{'':>9}{row['param_ratio']:>14.3f}   "
              f"time goal <=1.05: {t_ok}; param goal 1.00: {p_ok}")
        print(f"loss step 0: autopar {la[0]:.6f}  torch {lt[0]:.6f}  unsplit {res[0]['ref_loss']:.6f};  "
              f"max |autopar - torch| step 0: {row['loss0_absdiff']:.2e}, over all {len(la)} steps: "
              f"{row['loss_max_absdiff_all_steps']:.2e}; max spread across ranks {loss_rank_spread:.2e}")
        differ = res[0]["param_bytes_differ"]
        if differ:
            print("param bytes that differ on rank 0 (autopar vs torch): " +
                  ", ".join(f"{k} {x:,} vs {y:,}" for k, (x, y) in differ.items()))
        row["param_bytes_differ_rank0"] = differ
        row["losses"] = {"autopar": la, "torch": lt}
        print(f"(ranks ran {t_run:.1f} s)", flush=True)

    wall = time.perf_counter() - t_all
    print(f"\n{'world':>5} {'autopar ms':>11} {'torch ms':>9} {'t ratio':>8} {'autopar B':>11} {'torch B':>11} "
          f"{'B ratio':>8}  plan")
    for r in rows:
        print(f"{r['world']:>5} {r['median_ms']['autopar']:>11.1f} {r['median_ms']['torch']:>9.1f} "
              f"{r['time_ratio']:>8.3f} {r['param_bytes_per_rank']['autopar']:>11,} "
              f"{r['param_bytes_per_rank']['torch']:>11,} {r['param_ratio']:>8.3f}  "
              f"{r['sharded_params']}/{r['total_params']} sharded, {r['plan_mode']}")
    print(f"total wall {wall:.1f} s")
    print(json.dumps({"bench": "tp", "config": cfg, "batch": a.batch, "seq": a.seq, "steps": a.steps,
                      "warmup": a.warmup, "cores": os.cpu_count(), "torch": torch.__version__,
                      "wall_s": wall, "worlds": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
