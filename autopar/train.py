"""``autopar train``: plan a small model for local CPU ranks, train it, and check every step.

The planner (``cost/hybrid.py``) searches dp x tp x pp, ZeRO, recomputation, micro-batches
and schedule for ``--ranks`` gloo ranks on this machine (the ``cpu`` hardware) and keeps the
fastest configuration the runtime can run (:func:`runtime_gaps`). The ranks then train the
model with it, and each step's loss is printed beside the loss of the same model trained in
one process on the whole batch. A model whose mixture-of-experts layers have a token capacity
(tokens over it are dropped) routes each call's tokens against that call's capacity, so the
whole batch in one call is another computation than the same batch in micro-batches: there the
single process runs the ranks' micro-batches one after another, as the ranks do. ``--save DIR``
checkpoints the parallel run and the reference after the steps; ``--resume DIR`` starts from
such a checkpoint under whatever plan this run chooses (another rank count gives another plan),
so re-planning a run is checked step by step too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from autopar.errors import ConfigError, DoesNotFitError


def runtime_gaps(c) -> list[str]:
    """What autopar's runtime cannot build yet for configuration ``c`` (empty: it can)."""
    gaps = []
    if c.pp > 1:
        if c.zero_stage:
            gaps.append(f"ZeRO-{c.zero_stage} inside a pipeline")
        if c.recompute != "none" and c.schedule == "zb":
            gaps.append(f"{c.recompute} recomputation with the zero-bubble schedule")
        if getattr(c, "ep", 1) > 1:
            gaps.append("expert parallelism inside a pipeline")
    elif c.zero_stage == 3 and c.recompute != "none":
        gaps.append("recomputation under ZeRO-3")
    return gaps


def runnable(c) -> bool:
    """Can the runtime build this configuration today?"""
    return not runtime_gaps(c)


def choose(name: str, overrides: dict, ranks: int, batch: int, seq: int):
    """The fastest runnable configuration by the simulator, and how many were scored."""
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import ModelFacts, simulate
    from autopar.cost.plan_search import configurations
    from autopar.workload import capture_workload, load_workload

    w = load_workload(name, batch=batch, seq=seq, overrides={k: str(v) for k, v in overrides.items()})
    facts = ModelFacts(capture_workload(w), seq=seq, dtype="fp32")
    cluster = Cluster.from_spec(f"1x{ranks}", hardware="cpu")
    best, scored = None, 0
    for c in configurations(facts, devices=ranks, batch=batch, per_node=ranks, recomputes=("none", "full"),
                            schedules=("1f1b", "gpipe", "interleaved")):
        if not runnable(c) or (c.pp > 1 and batch // c.dp // c.micro_batch < c.pp):
            continue
        try:
            s = simulate(facts, cluster, c, batch=batch)
        except ConfigError:
            continue
        scored += 1
        if s.fits and (best is None or s.step_time_s < best.step_time_s):
            best = s
    if best is None:
        raise DoesNotFitError("no configuration the runtime can run fits", where="autopar train",
                              fix="use fewer ranks or a larger batch")
    return best, scored


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _rank(rank: int, world: int, name: str, overrides: dict, cfg: dict, batch: int, seq: int, steps: int,
          save: str | None = None, resume: str | None = None) -> dict:
    import copy

    import torch.distributed as dist

    import autopar
    from autopar import models

    torch.manual_seed(0)
    model = models.build(name, overrides, device="cpu")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch, seq, device="cpu")
    target = torch.randint(0, model.config.vocab, (batch, seq))
    dp, tp, pp = cfg["dp"], cfg["tp"], cfg["pp"]
    calls = batch // cfg["micro_batch"] if _capacity_routed(model) else 1   # the reference's calls per step
    share = (rank // tp) % dp
    local, local_t = tuple(a.chunk(dp)[share] for a in args), target.chunk(dp)[share]
    mesh = {k: v for k, v in (("pp", pp), ("dp", dp), ("tp", tp)) if v > 1} or {"dp": 1}
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters()) if tp > 1 else None  # make tp split
    if pp > 1:
        pm = autopar.parallelize(model, mesh, local, loss_fn=_loss, schedule=cfg["schedule"],
                                 microbatches=batch // dp // cfg["micro_batch"],
                                 virtual_stages=cfg["virtual"] if cfg["schedule"] == "interleaved" else None,
                                 memory_budget=budget, recompute=cfg["recompute"])
    else:
        pm = autopar.parallelize(model, mesh, local, zero_stage=cfg["zero_stage"], recompute=cfg["recompute"],
                                 memory_budget=budget)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    first, resumed = 0, None
    if resume:   # whatever plan wrote it: the parallel model's state, and the reference's beside it
        resumed = autopar.load(pm, opt, os.path.join(resume, "parallel"))
        autopar.load(ref, ref_opt, os.path.join(resume, "reference"))
        first = int(resumed["step"] or 0)
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if pp > 1:
            loss = pm.step(*local, target=local_t)
        else:
            micro = cfg["micro_batch"]
            n = local[0].shape[0] // micro
            loss = torch.zeros(())
            for i in range(n):
                piece = tuple(a.chunk(n)[i] for a in local)
                part = _loss(pm(*piece), local_t.chunk(n)[i]) / n
                part.backward()
                loss += part.detach()
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world          # tp ranks hold the same value: this is the mean over the dp shares
        want = sum(_loss(ref(*(a.chunk(calls)[i] for a in args)), target.chunk(calls)[i])
                   for i in range(calls)) / calls
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rows.append((loss.item(), want.item(), seconds))
    if save:
        autopar.save(pm, opt, os.path.join(save, "parallel"), step=first + steps, extra={"plan": cfg})
        autopar.save(ref, ref_opt, os.path.join(save, "reference"), step=first + steps)
    return {"rows": rows, "first": first, "saved_plan": (resumed or {}).get("extra", {}) or {}}


def _capacity_routed(model: torch.nn.Module) -> bool:
    """Does an MoE layer drop tokens over a capacity computed from each call's tokens?"""
    return any(hasattr(m, "capacity_factor") for m in model.modules())


def main(argv: list[str] | None = None) -> int:
    from autopar.workload import parse_overrides
    from autopar.runtime.launch import run_ranks

    ap = argparse.ArgumentParser(prog="autopar train", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", help="zoo name (default gpt)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                    help="model overrides (default layers=4 hidden=64 heads=4 vocab=256 max_seq=32)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--save", metavar="DIR", help="checkpoint the model, optimizer and reference after the steps")
    ap.add_argument("--resume", metavar="DIR", help="start from the checkpoint in DIR, whatever plan and rank "
                    "count wrote it")
    args = ap.parse_args(argv)
    over = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "max_seq": args.seq}
    over.update(parse_overrides(args.set))
    start = time.perf_counter()
    best, scored = choose(args.model, over, args.ranks, args.batch, args.seq)
    c = best.config
    print(f"[autopar] planned {args.model} {over} for {args.ranks} CPU ranks: {scored} runnable configurations "
          f"scored in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    print(f"plan: dp={c.dp} tp={c.tp} pp={c.pp} ZeRO-{c.zero_stage}, micro-batch {c.micro_batch} x "
          f"{best.microbatches}, {c.schedule if c.pp > 1 else 'no pipeline'}, recompute {c.recompute}; "
          f"predicted step {best.step_time_s * 1e3:.1f} ms on the built-in cpu estimate")
    cfg = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "zero_stage": c.zero_stage, "recompute": c.recompute,
           "micro_batch": c.micro_batch, "schedule": c.schedule, "virtual": c.virtual}
    save = os.path.abspath(args.save) if args.save else None
    resume = os.path.abspath(args.resume) if args.resume else None
    res = run_ranks(_rank, args.ranks, args.model, over, cfg, args.batch, args.seq, args.steps, save, resume,
                    timeout_s=600)
    if resume:
        was = res[0]["saved_plan"].get("plan", {})
        print(f"resumed from {resume} at step {res[0]['first']}" + (
            f" (saved under dp={was.get('dp')} tp={was.get('tp')} pp={was.get('pp')} ZeRO-{was.get('zero_stage')})"
            if was else ""))
    print(f"{'step':>4} {'parallel loss':>14} {'single-process':>15} {'difference':>11} {'step ms':>8}")
    worst = 0.0
    for i, (got, want, seconds) in enumerate(res[0]["rows"], start=res[0]["first"]):
        worst = max(worst, abs(got - want) / abs(want))
        print(f"{i:>4} {got:>14.6f} {want:>15.6f} {got - want:>11.2e} {seconds * 1e3:>8.1f}")
    print(f"largest relative difference {worst:.1e}" + ("" if worst < 1e-5 else "  (above 1e-5)"))
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
