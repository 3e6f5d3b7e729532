"""Soak: training that is killed, stalled and broken at random, and resumes from its checkpoints.

Command:  python bench/soak.py [--minutes 5] [--steps 40] [--seed 0] [--json]   (not in CI)

A driver starts training runs, one after another, for ``--minutes``; each runs an MLP (float64,
ZeRO-1, SGD with momentum) on gloo ranks. Each segment starts ``world`` ranks (4, 2 or 1, drawn at
random: the rank count may change between segments; 4 ranks are dp=4 or dp=2 x tp=2, so a fault
also hits ranks that share no group with the faulty one), resumes from the checkpoint directory's ``LATEST`` if there is one, and trains,
saving every ``--every`` steps. Unless the segment is the last one the driver also draws a
fault: one rank, at one step, raises, is killed (SIGKILL) or stalls (the others' collective
timeout stops it). The driver waits for the segment's ranks to end, counts the fault it
injected and how the ranks reported it, and starts the next segment. Steps computed after the
last checkpoint before a fault are lost (computed again).

The batch of step ``s`` is the same whatever the rank count (a generator seeded with ``s``;
each rank takes its rows), so the final parameters must equal those of one uninterrupted
process on the same batches: the driver checks that (relative difference; float64 leaves
only the data axis's summation order) and that every fault was reported with the rank that
caused it, and that no survivor of a fault exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

WIDTH, ROWS, LR = 32, 16, 0.05
TIMEOUT_S = 3.0             # every collective's timeout: how long a stall takes to be noticed


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH)).double()


def _segment(rank: int, world: int, ckpt: str, steps: int, every: int, fault: tuple | None,
             mesh: dict | None = None) -> dict:
    """One run of ``world`` ranks on ``mesh`` (default: all data-parallel): resume, train to
    ``steps`` (or the fault), save every ``every``."""
    import autopar
    from autopar.checkpoint import latest

    model = _model()
    mesh = mesh or {"dp": world}
    tp = mesh.get("tp", 1)
    rows, share = ROWS // (world // tp), rank // tp          # tp ranks of one data share hold the same rows
    pm = autopar.parallelize(model, mesh, (_batch(0)[:rows],), zero_stage=1,
                             memory_budget=1 if tp > 1 else None)       # a tensor axis that splits weights
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=0.9)
    start = 0
    try:
        latest(ckpt)
        start = autopar.load(pm, opt, ckpt)["step"]
    except autopar.CheckpointError:
        pass                      # no checkpoint yet: from the start
    for step in range(start + 1, steps + 1):
        x = _batch(step)[share * rows:(share + 1) * rows]
        loss = pm(x).pow(2).mean()
        if fault is not None and fault[1] == rank and fault[2] == step:
            if fault[0] == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            if fault[0] == "kill":
                os.kill(os.getpid(), 9)
            time.sleep(120)       # stall: the others time out waiting in the backward's reduction
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % every == 0 or step == steps:
            autopar.save(pm, opt, ckpt, step=step)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in pm.state_dict().items()}
    return {"start": start, "end": steps, "state": state if rank == 0 else None}


def _reference(steps: int) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(1, steps + 1):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _run(args, rng: random.Random, deadline: float, ckpt: str) -> dict:
    """One training run of ``args.steps`` steps, broken at random while time remains, to the end."""
    from autopar.runtime.launch import run_ranks_outcomes

    out = {"injected": {"raise": 0, "kill": 0, "stall": 0}, "reported": 0, "lost": 0, "worlds": [], "events": [],
           "finished": 0}
    saved = 0                  # the step LATEST names
    while True:
        faulty = time.monotonic() < deadline and saved < args.steps - 1
        world = rng.choice([4, 2] if faulty else [4, 2, 1])
        mesh = rng.choice([{"dp": 4}, {"dp": 2, "tp": 2}]) if world == 4 else {"dp": world}
        fault = None
        if faulty:
            fault = (rng.choice(["raise", "kill", "stall"]), rng.randrange(world), rng.randint(saved + 1, args.steps))
        outs = run_ranks_outcomes(_segment, world, ckpt, args.steps, args.every, fault, mesh, timeout_s=180,
                                  collective_timeout_s=TIMEOUT_S)
        out["worlds"].append("x".join(f"{k}{v}" for k, v in mesh.items()))
        if all(o.kind == "ok" for o in outs):
            ref = _reference(args.steps)
            final = outs[0].result["state"]
            out["diff"] = max(((final[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item()
                              for k in ref)
            return out
        if fault is None:
            raise SystemExit(f"a segment without a fault failed: {[o.message for o in outs]}")
        kind, bad, at = fault
        out["injected"][kind] += 1
        # every other rank names the faulty one (a stall: the others time out and stop it)
        blamed = all(o.rank == bad or f"rank {bad}" in o.message for o in outs)
        out["reported"] += blamed
        out["finished"] += sum(o.rank != bad and o.exitcode == 0 for o in outs)   # a survivor that exited 0
        now = max(saved, (at - 1) // args.every * args.every)     # steps before the fault completed
        out["lost"] += (at - 1) - now
        out["events"].append(f"{kind} r{bad}@{at}{'' if blamed else ' NOT NAMED'}")
        if not blamed:         # what the survivors said instead, for the record
            for o in outs:
                if o.rank != bad and f"rank {bad}" not in o.message:
                    print(f"  {kind} r{bad}@{at} on {out['worlds'][-1]}: rank {o.rank} ended {o.kind} "
                          f"(exit {o.exitcode}): {(o.message.strip().splitlines() or [''])[-1][:300]}", flush=True)
        saved = now


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="start runs and inject faults for this long")
    ap.add_argument("--steps", type=int, default=40, help="training steps of one run")
    ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    runs = []
    print("| run | faults (kind, rank, step) | segments' meshes | steps lost | survivors exiting 0 | "
          "final params vs uninterrupted |\n|---|---|---|---|---|---|", flush=True)
    while not runs or time.monotonic() < deadline:
        with tempfile.TemporaryDirectory(prefix="autopar-soak-") as tmp:
            r = _run(args, rng, deadline, str(Path(tmp) / "ckpt"))
        runs.append(r)
        print(f"| {len(runs)} | {', '.join(r['events']) or 'none'} | {', '.join(r['worlds'])} | {r['lost']} | "
              f"{r['finished']} | {r['diff']:.1e} |", flush=True)
    injected = {k: sum(r["injected"][k] for r in runs) for k in ("raise", "kill", "stall")}
    total, reported = sum(injected.values()), sum(r["reported"] for r in runs)
    finished = sum(r["finished"] for r in runs)
    diff, wall = max(r["diff"] for r in runs), time.monotonic() - t0
    print(f"\n{len(runs)} runs of {args.steps} steps; faults injected: {total} "
          f"({', '.join(f'{k} {v}' for k, v in injected.items())}); named by every survivor: {reported}/{total}; "
          f"survivors that exited 0: {finished}; "
          f"recoveries: {total}; steps lost: {sum(r['lost'] for r in runs)}; final parameters vs one uninterrupted "
          f"process: max relative difference {diff:.2e}; wall {wall:.0f} s")
    if args.json:
        print(json.dumps({"bench": "soak", "runs": len(runs), "injected": injected, "reported": reported,
                          "survivors_exited_0": finished,
                          "steps_lost": sum(r["lost"] for r in runs), "max_rel_diff": diff, "wall_s": wall}))
    return 0 if diff < 1e-9 and reported == total and finished == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
