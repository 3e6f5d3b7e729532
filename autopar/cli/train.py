"""``autopar train``: train a small model on local CPU ranks under a plan, and check every step.

Two ways to get the plan. ``--plan PLAN.json`` reads what ``autopar plan ... --save-plan``
chose for a real cluster (:class:`~autopar.core.saved_plan.SavedPlan`) and builds that structure
scaled down to the local ranks (:func:`scale_down`): every axis the plan splits gets degree
2, in the order pp, dp, tp, while ranks last, and the ZeRO stage, schedule, virtual stages,
recomputation and micro-batches per step stay the plan's; the model is the plan's zoo model
made small (:func:`small_overrides`). Without ``--plan`` the planner (``cost/hybrid.py``)
searches dp x tp x pp x ep, ZeRO, recomputation, micro-batches and schedule for ``--ranks``
gloo ranks on this machine (the ``cpu`` hardware) and keeps the fastest configuration.

The ranks then train the model, and each step's loss is printed beside the loss of the same
model trained in one process on the whole batch. A model whose mixture-of-experts layers
have a token capacity (tokens over it are dropped) routes each call's tokens against that
call's capacity, so the whole batch in one call is another computation than the same batch
in micro-batches: there the single process runs the ranks' micro-batches one after another,
as the ranks do. ``--save DIR`` checkpoints the parallel run and the reference after the
steps; ``--resume DIR`` starts from such a checkpoint under whatever plan this run uses
(another rank count gives another plan), so re-planning a run is checked step by step too.

Each logged step also shows what was measured beside what the simulator predicts for the same
scaled configuration on this machine (the ``cpu`` hardware profile, ``1xN`` ranks): the step
time (the parallel step alone: the ranks start it together and the slowest rank's time counts;
the single-process reference is left out), tokens per second, achieved TFLOP/s per rank and MFU
(the model's FLOPs per step from the analysis passes, recomputation excluded, against the
``cpu`` profile's peak), and the peak memory per rank (on CPU the largest max RSS over the
ranks: the whole process, the reference model included). ``--log-jsonl FILE`` writes the same
figures as JSON lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import tempfile
import threading
import time

import torch

from autopar.core.errors import AutoparError, ConfigError, DoesNotFitError
from autopar.core.progress import STAGE_WORDS, on_setup_stage
from autopar.cli.train_metrics import (json_line, log_context, table_notes, step_record, step_table,
                                   write_first, peak_memory_bytes, rank_device, rank_share)

SCALE_ORDER = ("pp", "dp", "cp", "tp")  # the axes scale_down gives ranks to, first to last
# Argument limits: ``autopar train`` checks a plan on this machine's CPU, beside a single-process copy.
MAX_RANKS, MAX_STEPS, MAX_BATCH, MAX_SEQ = 64, 100_000, 4096, 4096
SMALL = {"hidden": 64, "heads": 4, "vocab": 256, "kv_heads": 2, "ffn": 256}   # the small model's sizes


def scale_down(c, ranks: int) -> tuple:
    """The plan ``c`` (a :class:`~autopar.cost.hybrid.Config`) scaled down to ``ranks`` local
    ranks, and one note per axis saying how it was scaled.

    Each axis of :data:`SCALE_ORDER` the plan splits gets degree 2 while the ranks last; the
    rest get 1 (said so). ``ep`` is a sub-axis of dp in the planner: a plan with ``ep > 1`` keeps
    ``ep = 2`` across the two data replicas. ZeRO stage, recomputation, micro-batch size,
    schedule and virtual stages are the plan's, but for what needs a dropped axis (ZeRO without
    a data axis, dp x cp; the schedule without a pipeline). The degrees' product is at most ``ranks``."""
    if type(ranks) is not int or ranks < 1:
        raise ConfigError("the rank count must be a positive integer", where="--ranks", got=repr(ranks),
                          fix="e.g. --ranks 8")
    degree, used, notes = {"pp": 1, "dp": 1, "cp": 1, "tp": 1}, 1, []
    for axis in SCALE_ORDER:
        planned = getattr(c, axis)
        if planned == 1:
            continue
        if used * 2 <= ranks:
            degree[axis], used = 2, used * 2
            notes.append(f"{axis} {planned} -> 2")
        else:
            notes.append(f"{axis} {planned} -> 1 (no ranks left)")
    ep = 2 if c.ep > 1 and degree["dp"] == 2 else 1
    if c.ep > 1:
        notes.append(f"ep {c.ep} -> {ep}" + (" (no data axis to hold it)" if ep == 1 else
                                              " (over both data replicas)" if c.dp > c.ep else ""))
    zero = c.zero_stage if degree["dp"] * degree["cp"] > 1 else 0
    if zero != c.zero_stage:
        notes.append(f"ZeRO-{c.zero_stage} -> ZeRO-0 (no data axis to shard over)")
    pipelined = degree["pp"] > 1
    notes += [f"the {c.schedule} schedule goes with the pipeline"] if c.pp > 1 and not pipelined else []
    notes += [f"shard groups of {c.shard_group} -> the whole data axis"] if c.shard_group else []
    scaled = dataclasses.replace(c, dp=degree["dp"], tp=degree["tp"], pp=degree["pp"], ep=ep, zero_stage=zero,
                                 cp=degree["cp"], cp_kind=c.cp_kind if degree["cp"] > 1 else None, shard_group=0,
                                 schedule=c.schedule if pipelined else "gpipe", virtual=c.virtual if pipelined else 1)
    return scaled, notes


def small_overrides(name: str, plan_overrides: dict, *, stages: int, seq: int) -> dict:
    """The overrides that make the zoo model ``name`` (with the plan's own) small: hidden 64, 4
    heads, vocab 256 (2 key/value heads, an FFN of 256 where the family has them), ``max_seq`` =
    ``seq``, layers the smallest multiple of ``stages`` (pp x virtual) that is at least 4. Expert
    counts, top-k and capacity stay the family's."""
    from autopar import models

    if name not in models.list_models():
        raise ConfigError(f"autopar train builds zoo models; {name!r} is not one", where="--model, or the plan file's model",
                          expected=f"one of {', '.join(models.list_models())}", got=repr(name),
                          fix="plan a zoo model of the same family, e.g. autopar plan --model gpt3-175b ... "
                              "--save-plan plan.json")
    have = {f.name for f in dataclasses.fields(models.get_config(name, plan_overrides))}
    if "vocab" not in have:
        raise ConfigError(f"autopar train trains token models; {name!r} takes no tokens", where="autopar train",
                          got=name, fix="plan a gpt, llama or moe family model")
    layers = stages * math.ceil(4 / stages)
    return {**plan_overrides, "layers": layers, **{k: v for k, v in SMALL.items() if k in have}, "max_seq": seq}


def _facts(name: str, overrides: dict, batch: int, seq: int, dtype: str):
    """The simulator's view (:class:`~autopar.cost.hybrid.ModelFacts`) of the small model."""
    from autopar.cost.hybrid import ModelFacts
    from autopar.cli.workload import capture_for_planning, load_workload

    w = load_workload(name, batch=batch, seq=seq, overrides={k: str(v) for k, v in overrides.items()})
    planned = capture_for_planning(w)
    return ModelFacts(planned.gm, seq=seq, dtype=dtype, layers=planned.block_copies)


def choose(name: str, overrides: dict, ranks: int, batch: int, seq: int):
    """The fastest configuration by the simulator, and how many were scored."""
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import simulate
    from autopar.cost.plan_search import configurations
    from autopar.core.progress import progress

    facts = _facts(name, overrides, batch, seq, "fp32")
    cluster = Cluster.from_spec(f"1x{ranks}", hardware="cpu")
    best, scored = None, 0
    for c in progress(configurations(facts, devices=ranks, batch=batch, per_node=ranks, recomputes=("none", "full"),
                                     schedules=("1f1b", "gpipe", "interleaved")),
                      what=f"planning for {ranks} CPU ranks: configurations"):
        if c.pp > 1 and batch // c.dp // c.micro_batch < c.pp:
            continue
        try:
            s = simulate(facts, cluster, c, batch=batch)
        except ConfigError:
            continue
        scored += 1
        if s.fits and (best is None or s.step_time_s < best.step_time_s):
            best = s
    if best is None:
        raise DoesNotFitError("no configuration fits", where="autopar train",
                              fix="use fewer ranks or a larger batch")
    return best, scored


def predict(name: str, overrides: dict, cfg: dict, batch: int, seq: int):
    """What the simulator predicts for ``cfg`` (a :func:`_cfg` dict) here: one node of its ranks,
    each its share of the ``cpu`` profile (:func:`rank_device`); None where it cannot score it."""
    from autopar.cost.cluster import Cluster
    from autopar.core.plans import Config
    from autopar.cost.hybrid import simulate

    world = cfg["dp"] * cfg.get("cp", 1) * cfg["tp"] * cfg["pp"]
    c = Config(**{k: cfg[k] for k in ("dp", "tp", "pp", "ep", "cp", "cp_kind", "zero_stage", "recompute", "micro_batch",
                                      "schedule", "virtual") if k in cfg})
    try:
        facts = _facts(name, overrides, batch, seq, cfg.get("precision") or "fp32")
        return simulate(facts, Cluster.from_spec(f"1x{world}", hardware=rank_device(world)), c, batch=batch)
    except ConfigError as exc:
        from autopar.core.progress import quiet
        if not quiet():
            print(f"[autopar] no prediction for this configuration: {exc}", file=sys.stderr, flush=True)
        return None


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _rank(rank: int, world: int, name: str, overrides: dict, cfg: dict, batch: int, seq: int, steps: int,
          save: str | None = None, resume: str | None = None, log: dict | None = None,
          save_every: int | None = None) -> dict:
    """One rank of ``autopar train``: the model parallelized under ``cfg`` (a :func:`_cfg` dict)
    and the same model in one process on the whole batch, ``steps`` AdamW steps of both; each
    step's (parallel loss, single-process loss, seconds, peak memory bytes: the largest over the
    ranks) and, from rank 0, the logged records (:func:`step_record`; ``log``: a
    :func:`log_context` dict: rank 0 appends each record to its ``jsonl`` and a byte per step to its ``tick``)."""
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
    mesh = runtime_mesh(cfg)
    # this rank's rows (dp counts every data replica, ep ranks included) and, on a cp axis, its tokens
    local, local_t = autopar.data.shard(tuple(args), mesh, rank), autopar.data.shard(target, mesh, rank)
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters()) if tp > 1 else None  # make tp split
    options = ([autopar.PipelineOptions(
        loss_fn=_loss, schedule=cfg["schedule"], microbatches=batch // dp // cfg["micro_batch"],
        virtual_stages=cfg["virtual"] if cfg["schedule"] == "interleaved" else None)] if pp > 1 else []) + (
        [autopar.ContextOptions(kind=cfg.get("cp_kind"))] if cfg.get("cp", 1) > 1 else [])
    log = log or {}
    said = _stage_sayer(rank, log)
    with on_setup_stage(said):
        pm = autopar.parallelize(model, mesh, local, zero_stage=cfg["zero_stage"], recompute=cfg["recompute"],
                                 mixed_precision=cfg.get("precision"), compile=cfg.get("compile", False),
                                 memory_budget=budget, options=options or None)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    first, resumed = 0, None
    if resume:   # whatever plan wrote it: the parallel model's state, and the reference's beside it
        resumed = autopar.load(pm, opt, os.path.join(resume, "parallel"))
        autopar.load(ref, ref_opt, os.path.join(resume, "reference"))
        first = int(resumed["step"] or 0)
    rows, records, since, board = [], [], 0, None
    for k in range(steps):
        dist.barrier()         # every rank starts the parallel step together: the reference's time stays out
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
        if k == 0:
            said(STAGE_WORDS["first step"], seconds)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world          # tp ranks hold the same value: this is the mean over the dp shares
        want = sum(_loss(ref(*(a.chunk(calls)[i] for a in args)), target.chunk(calls)[i])
                   for i in range(calls)) / calls
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = torch.tensor([seconds, float(peak_memory_bytes("cpu"))], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)      # the slowest rank's step, the largest process
        rows.append((loss.item(), want.item(), worst[0].item(), int(worst[1].item())))
        since += 1
        if rank == 0 and log and (since == log["every"] or k == steps - 1):
            records.append(step_record(first + k, rows[-since:], log))
            since = 0
            if log.get("jsonl"):
                with open(log["jsonl"], "a") as f:
                    f.write(json_line({"kind": "step", **records[-1]}))
                    f.flush()
            if log.get("tensorboard"):
                board = board or _board(log["tensorboard"])
                for key, value in records[-1].items():
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        board.add_scalar(f"train/{key}", value, records[-1]["step"])
                board.flush()
        if rank == 0 and log.get("tick"):
            with open(log["tick"], "ab") as f:
                f.write(b".")
        if save and save_every and (k + 1) % save_every == 0 and k + 1 < steps:
            autopar.save(pm, opt, os.path.join(save, "parallel"), step=first + k + 1, extra={"plan": cfg})
            autopar.save(ref, ref_opt, os.path.join(save, "reference"), step=first + k + 1)
    if save:
        autopar.save(pm, opt, os.path.join(save, "parallel"), step=first + steps, extra={"plan": cfg})
        autopar.save(ref, ref_opt, os.path.join(save, "reference"), step=first + steps)
    if board is not None:
        board.close()
    return {"rows": rows, "records": records, "first": first,
            "saved_plan": (resumed or {}).get("extra", {}) or {}}


def _board(directory: str):
    """A TensorBoard event writer into ``directory`` (torch's, which needs ``tensorboard``)."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=directory)


def _check_tensorboard(directory: str | None) -> None:
    if directory is None:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package", where="--tensorboard", got=directory,
                          fix="pip install 'autopar[tensorboard]' (or pip install tensorboard), or use --log-jsonl "
                              "FILE, which needs nothing") from None


def _capacity_routed(model: torch.nn.Module) -> bool:
    """Does an MoE layer drop tokens over a capacity computed from each call's tokens?"""
    return any(hasattr(m, "capacity_factor") for m in model.modules())


def main(argv: list[str] | None = None) -> int:
    from autopar.cli.checks import count, output_file

    ap = argparse.ArgumentParser(prog="autopar train", description=__doc__.splitlines()[0],
                                 epilog="Each logged step prints the parallel and single-process losses, then "
                                 "measured beside predicted: the step time (the parallel step alone, the slowest "
                                 "rank's; the reference is left out) against the simulator's for this scaled "
                                 "configuration on the cpu hardware profile, tokens/s, achieved TFLOP/s per rank "
                                 "and MFU (model FLOPs from the analysis passes, recomputation excluded, against "
                                 "the cpu profile's peak), and the peak memory per rank (on CPU the largest max "
                                 "RSS over the ranks, the whole process) against the predicted peak.")
    ap.add_argument("--plan", metavar="PLAN.json", help="train under this plan (from `autopar plan ... --save-plan`), "
                    "scaled down to --ranks: each axis it splits gets degree 2 in the order pp, dp, tp, with its "
                    "ZeRO stage, schedule, virtual stages, recomputation and micro-batches per step; the model is "
                    "the plan's, made small (hidden 64, heads 4, vocab 256)")
    ap.add_argument("--model", help="without --plan: zoo name (default gpt)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                    help="model overrides, applied last (default layers=4 hidden=64 heads=4 vocab=256 max_seq=SEQ, and "
                         "kv_heads=2 ffn=256 where the family has them)")
    ap.add_argument("--ranks", type=count("--ranks", high=MAX_RANKS, why="one local CPU process per rank"), default=4,
                    help="local CPU ranks (default 4; with --plan, at most this many)")
    ap.add_argument("--steps", type=count("--steps", high=MAX_STEPS, why="a check run, not a training job"), default=5,
                    help="training steps (default 5)")
    ap.add_argument("--batch", type=count("--batch", high=MAX_BATCH, why="one CPU process trains the whole batch"),
                    help="without --plan: global batch (default 8; with --plan it is the "
                    "data replicas x micro-batch x micro-batches per step)")
    ap.add_argument("--seq", type=count("--seq", high=MAX_SEQ, why="the CPU run's attention holds seq x seq scores"),
                    default=32, help="sequence length (default 32)")
    ap.add_argument("--save", metavar="DIR", help="checkpoint the model, optimizer and reference after the steps")
    ap.add_argument("--save-every", type=count("--save-every", high=MAX_STEPS), metavar="N",
                    help="with --save: also checkpoint every N steps (a killed run resumes from the last one)")
    ap.add_argument("--resume", metavar="DIR", help="start from the checkpoint in DIR, whatever plan and rank "
                    "count wrote it")
    ap.add_argument("--log-every", type=count("--log-every", high=MAX_STEPS), default=1, metavar="N",
                    help="print (and log) every N-th step and the last one (default 1: every step); a row's "
                    "step time and what follows from it are the mean over the steps since the row before, its "
                    "losses the row's step's")
    ap.add_argument("--log-jsonl", metavar="FILE", help="also write one JSON object per logged step (step, loss, "
                    "reference_loss, step_s, tokens_per_s, tflops_per_rank, mfu, peak_memory_bytes, "
                    "predicted_step_s, predicted_peak_memory_bytes, ...), after a first line "
                    '{"kind": "config", ...} with the configuration; each line is flushed as its step ends')
    ap.add_argument("--tensorboard", metavar="DIR", help="also write the logged steps' figures (those "
                    "--log-jsonl writes) as TensorBoard scalars train/<name> into DIR (needs the tensorboard "
                    "package: the autopar[tensorboard] extra)")
    ap.add_argument("--compile", action="store_true", help="run each rank's graph through torch.compile "
                    "(inductor); the first step then includes the compilation")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar nor progress lines, and no warnings, on stderr (errors still print; the "
                    "bar is only drawn when stderr is a terminal)")
    args = ap.parse_args(argv)
    output_file(args.log_jsonl, "--log-jsonl")
    _check_tensorboard(args.tensorboard)
    if not args.quiet:
        return _train(args)
    autopar_log = logging.getLogger("autopar")       # -q as the other commands have it (cli._run_quietly)
    level = autopar_log.level
    autopar_log.setLevel(logging.ERROR)
    try:
        return _train(args)
    finally:
        autopar_log.setLevel(level)


def _train(args: argparse.Namespace) -> int:
    from autopar.cli.checks import writing
    from autopar.runtime.launch import run_ranks

    name, over, cfg, batch, score = _from_plan(args) if args.plan else _from_search(args)
    if args.compile:
        if cfg["recompute"] != "none":
            raise ConfigError("--compile does not compose with the plan's recomputation", where="autopar train --compile",
                              got=f"recompute={cfg['recompute']}", fix="drop --compile, or use a plan without "
                              "recomputation (autopar plan ... --recompute none --save-plan)")
        cfg["compile"] = True        # the first step includes inductor's compilation
    world = cfg["dp"] * cfg.get("cp", 1) * cfg["tp"] * cfg["pp"]
    if args.save_every and not args.save:
        raise ConfigError("--save-every needs --save", where="--save-every", got=f"--save-every {args.save_every}",
                          fix="add --save DIR (where the checkpoints go), or drop --save-every")
    save = os.path.abspath(args.save) if args.save else None
    resume = os.path.abspath(args.resume) if args.resume else None
    log = log_context(score, cfg, batch, args.seq, args.log_every)
    if args.tensorboard:
        log["tensorboard"] = os.path.abspath(args.tensorboard)
    if args.log_jsonl:
        log["jsonl"] = os.path.abspath(args.log_jsonl)
        head = {"kind": "config", "model": name, "overrides": {k: str(v) for k, v in over.items()},
                "plan": os.path.abspath(args.plan) if args.plan else None, "config": cfg, "world": world,
                "batch": batch, "seq": args.seq, "steps": args.steps, "log_every": args.log_every,
                "tokens_per_step": batch * args.seq, "model_flops_per_step": log["model_flops"],
                "hardware": "cpu", "dtype": log["dtype"], "peak_flops_per_rank": log["peak_flops"],
                "cpu_count": os.cpu_count(),
                "predicted": None if score is None else {
                    "step_s": score.step_time_s, "peak_memory_bytes": score.peak_memory_bytes,
                    "tflops_per_rank": score.tflops_per_device, "mfu": score.mfu},
                "measured": {"step_s": "the parallel step, the slowest rank's, the ranks starting together",
                             "peak_memory_bytes": "the largest max RSS over the ranks (ru_maxrss)"}}
        writing("--log-jsonl", args.log_jsonl, lambda: write_first(log["jsonl"], json_line(head)))
    res = _with_progress(args.steps, lambda tick, stages: run_ranks(
        _rank, world, name, over, cfg, batch, args.seq, args.steps, save, resume,
        {**log, "tick": tick, "stages": stages, "quiet": args.quiet}, args.save_every, timeout_s=600))
    if resume:
        was = res[0]["saved_plan"].get("plan", {})
        print(f"resumed from {resume} at step {res[0]['first']}" + (
            f" (saved under dp={was.get('dp')} tp={was.get('tp')} pp={was.get('pp')} ZeRO-{was.get('zero_stage')})"
            if was else ""))
    print(step_table(res[0]["records"]))
    print(table_notes(log, world, args.log_every))
    worst = 0.0
    for got, want, *_ in res[0]["rows"]:
        worst = max(worst, abs(got - want) / abs(want))
    # a 16-bit plan computes in 16 bits beside a float32 reference: its rounding, not a mismatch
    tol = 5e-2 if cfg.get("precision") else 1e-5
    print(f"largest relative difference {worst:.1e}" + ("" if worst < tol else f"  (above {tol:g})")
          + (f" ({cfg['precision']} compute with fp32 masters against a float32 reference)" if cfg.get("precision")
             else ""))
    return 0 if worst < tol else 1


def _stage_sayer(rank: int, log: dict):
    """Rank 0 appends each set-up stage, as it ends, to the file ``log["stages"]``, which the
    launcher reads (:func:`_with_progress`)."""
    def said(words: str, seconds: float) -> None:
        if rank == 0 and log.get("stages"):
            with open(log["stages"], "a") as f:
                f.write(f"{words}\t{seconds:.2f}\n")
    return said


def _with_progress(steps: int, call):
    """``call(tick, stages)`` with the set-up stages and then a progress bar of the training
    steps on stderr (:mod:`autopar.core.progress`). Rank 0 appends a line per set-up stage to the
    file ``stages`` and, when a bar shows, a byte per step to the file ``tick``; a thread here
    polls them. With a bar, the bar says the stage reached until the first step is done; without
    one (stderr not a terminal), each stage is a line ``[autopar] set-up: <stage> <seconds>s``
    (those under 0.05 s left out, except capture, plan and the first step). Under ``-q``:
    neither file, no thread, nothing said."""
    from autopar.core.progress import progress, quiet, shows

    if quiet():
        return call(None, None)
    bar_shows = shows()
    fd, stages = tempfile.mkstemp(prefix="autopar-train-", suffix=".stages")
    os.close(fd)
    tick = None
    if bar_shows:
        fd, tick = tempfile.mkstemp(prefix="autopar-train-", suffix=".steps")
        os.close(fd)
    training = f"training {steps} step{'s' * (steps > 1)}"
    bar = progress(steps, what="set-up: capture and analysis") if bar_shows else None
    stop, seen = threading.Event(), [0]
    always = (STAGE_WORDS["capture"], STAGE_WORDS["plan"], STAGE_WORDS["first step"])

    def new_stages() -> list[tuple[str, float]]:
        try:
            with open(stages) as f:
                lines = f.read().splitlines()
        except OSError:
            return []
        fresh = [line.split("\t") for line in lines[seen[0]:]]
        seen[0] = len(lines)
        return [(words, float(secs)) for words, secs in fresh]

    def done() -> int:
        try:
            return min(os.path.getsize(tick), steps)
        except (OSError, TypeError):
            return 0

    def poll() -> None:
        last = ""
        while True:
            stopping = stop.wait(0.2)
            for words, secs in new_stages():
                last = words
                if bar is None and (secs >= 0.05 or words in always):
                    print(f"[autopar] set-up: {words} {secs:.2f}s", file=sys.stderr, flush=True)
            if bar is not None:
                n = done()
                bar.what = training if n or last == STAGE_WORDS["first step"] else (
                    f"set-up: {last} done" if last else "set-up: capture and analysis")
                bar.set(n)
            if stopping:
                return
    watcher = threading.Thread(target=poll, name="autopar-train-progress", daemon=True)
    if bar is not None:
        bar.set(0)
    watcher.start()
    try:
        return call(tick, stages)
    finally:
        stop.set()
        watcher.join()
        if bar is not None:
            bar.what = training
            bar.set(done())
            bar.close()
            os.unlink(tick)
        os.unlink(stages)


def runtime_mesh(cfg: dict) -> dict[str, int]:
    """The mesh ``autopar.parallelize`` gets for a configuration: axes pp, dp, ep, tp, those of
    size 1 left out. The planner's ``dp`` counts every data replica with ``ep`` a sub-axis of
    it, while the runtime's ep ranks each take their own share of the batch, so its data axis
    is ``dp / ep``."""
    ep = cfg.get("ep", 1)
    axes = (("pp", cfg["pp"]), ("dp", cfg["dp"] // ep), ("cp", cfg.get("cp", 1)), ("ep", ep), ("tp", cfg["tp"]))
    return {k: v for k, v in axes if v > 1} or {"dp": 1}


def _cfg(c) -> dict:
    """A Config as the plain dict the ranks get (and a checkpoint records)."""
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "zero_stage": c.zero_stage, "recompute": c.recompute,
            "micro_batch": c.micro_batch, "schedule": c.schedule, "virtual": c.virtual,
            **({"cp": c.cp, "cp_kind": c.cp_kind} if getattr(c, "cp", 1) > 1 else {})}


def _from_search(args: argparse.Namespace) -> tuple:
    """Without --plan: the fastest configuration the simulator finds for --ranks CPU ranks."""
    from autopar.cli.hybrid import config_line
    from autopar.cli.workload import parse_overrides

    name, batch = args.model or "gpt", args.batch or 8
    over = small_overrides(name, {}, stages=1, seq=args.seq)     # a zoo token model, made small
    over.update(parse_overrides(args.set))
    start = time.perf_counter()
    best, scored = choose(name, over, args.ranks, batch, args.seq)
    if not args.quiet:
        print(f"[autopar] planned {name} {over} for {args.ranks} CPU ranks: {scored} configurations "
              f"scored in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    print(f"plan: {config_line(best.config, best.microbatches)}; predicted step {best.step_time_s * 1e3:.1f} ms "
          f"on the built-in cpu estimate")
    return name, over, _cfg(best.config), batch, best


def _from_plan(args: argparse.Namespace) -> tuple:
    """With --plan: the saved plan's structure scaled down to --ranks (:func:`scale_down`), on
    the plan's model made small (:func:`small_overrides`), at the plan's micro-batches per step."""
    from autopar.cli.hybrid import config_line
    from autopar.core.saved_plan import SavedPlan
    from autopar.cli.workload import parse_overrides

    for flag, given in (("--model", args.model), ("--batch", args.batch)):
        if given is not None:
            raise ConfigError(f"{flag} comes from the plan file with --plan", where=f"autopar train {flag}",
                              got=f"{flag} {given}", fix=f"drop {flag} (or --plan, to plan for the local ranks)")
    saved = SavedPlan.load(args.plan)
    c, m = saved.config, saved.microbatches
    scaled, notes = scale_down(c, args.ranks)
    if scaled.pp > 1 and scaled.schedule == "interleaved" and m % scaled.pp:
        raise ConfigError(f"the interleaved schedule needs micro-batches a multiple of pp={scaled.pp}",
                          where=f"plan file {args.plan}", got=f"{m} micro-batches per step",
                          fix="re-plan with an even pipeline degree, or with another schedule (--schedule)")
    over = small_overrides(saved.model, saved.overrides, stages=scaled.pp * scaled.virtual, seq=args.seq)
    over.update(parse_overrides(args.set))
    if str(over["layers"]).isdigit() and int(over["layers"]) % (scaled.pp * scaled.virtual):
        raise ConfigError(f"layers={over['layers']} do not split into {scaled.pp * scaled.virtual} equal stages",
                          where="autopar train --set layers", fix=f"use a multiple of {scaled.pp * scaled.virtual}")
    world = scaled.dp * scaled.cp * scaled.tp * scaled.pp
    batch = scaled.dp * scaled.micro_batch * m
    precision = saved.dtype if saved.dtype in ("bf16", "fp16") else None
    step = saved.predicted.get("step_time_s")
    mfu = saved.predicted.get("mfu")
    print(f"plan:   {config_line(c, m)}: {saved.model} on {saved.cluster} {saved.hardware} ({saved.devices} devices)"
          + (f", predicted step {step:.3g} s" if step is not None else "")
          + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
    mesh = " x ".join(f"{a}={n}" for a, n in runtime_mesh(_cfg(scaled)).items())
    print(f"scaled: {config_line(scaled, m)} on {world} CPU rank{'s' * (world > 1)} (mesh {mesh})")
    print(f"  how: each axis the plan splits gets degree 2, in the order {', '.join(SCALE_ORDER)}, while the "
          f"{args.ranks} ranks last ({'; '.join(notes) or 'the plan splits no axis'}); the rest as planned"
          + (f" ({args.ranks - world} of the {args.ranks} ranks stay idle)" if world < args.ranks else ""))
    print(f"  model: {saved.model} made small ({', '.join(f'{k}={v}' for k, v in over.items())}); global batch "
          f"{batch} = {scaled.dp} data replica{'s' * (scaled.dp > 1)} x {m} micro-batches x {scaled.micro_batch}, "
          f"seq {args.seq}")
    if precision:
        print(f"  precision: {precision} compute with fp32 master weights, as planned")
    cfg = {**_cfg(scaled), "precision": precision}
    score = predict(saved.model, over, cfg, batch, args.seq)
    if score is not None:
        print(f"  predicted here: step {score.step_time_s * 1e3:.1f} ms, peak memory "
              f"{score.peak_memory_bytes / 1e6:.3g} MB per rank, MFU {100 * score.mfu:.1f}% (the simulator on "
              f"1x{world} cpu, the built-in cpu estimate"
              + (f", each rank {rank_share(world):.3g} of it: {world} ranks share {os.cpu_count()} cores"
                 if rank_share(world) < 1 else "") + ")")
    sys.stdout.flush()
    return saved.model, over, cfg, batch, score


def command(argv: list[str]) -> int:
    """``autopar train ...``: :func:`main`, with a bad plan file or flag printed as its message
    (no traceback) and exit status 2."""
    try:
        return main(argv)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":      # python -m autopar.cli.train: as `autopar train` (typed errors, exit 2)
    sys.exit(command(sys.argv[1:]))
