"""Benchmark: autopar pipeline parallelism vs a hand-split torch.distributed.pipelining peer.

Command:  python bench/pp.py [--world 2 4] [--steps 20] [--warmup 2] [--model gpt|llama]
                             [--set k=v ...] [--batch 16] [--seq 64] [--microbatches 8]
                             [--schedules gpipe,1f1b,interleaved,zb]
Same model, same weights, same batch and targets, gloo on this machine's CPU, one thread per
rank, one pipeline rank per process (``{"pp": world}``). For each world size and schedule it
times, in the same processes, a full training step (the pipeline's forward and backward of
``--microbatches`` micro-batches, loss ``cross_entropy(logits, target)`` per micro-batch, AdamW
step, zero_grad) of

  ap-S      ``autopar.parallelize(model, {"pp": world}, args, options=PipelineOptions(loss_fn=...,
            schedule=S, microbatches=M))`` + ``autopar.optimizer(pm, AdamW)``; a step is ``pm.step``;
  torch-S   the hand split a user would write: one plain ``nn.Module`` per stage built from
            copies of the zoo model's own submodules, equal numbers of blocks per stage
            (stage 0 also has the embeddings, the last stage the final norm and head), each
            wrapped in ``PipelineStage`` and run by the same schedule class
            (ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B with 2 stages per rank /
            ScheduleInterleavedZeroBubble with one), same micro-batches and loss.

GPT's head is tied to ``wte``. The peer's last stage holds its own copy of the weight and,
after each schedule step, sums the two gradients (``all_reduce`` over a group of the first and
last stages' ranks), so both copies get the gradient of the tied weight and stay equal: what
autopar does, which all-reduces tied gradients over the whole pipeline group. autopar's
``pm.step`` also broadcasts the loss to every rank; the peer reads it on the last rank only.

The order of the variants rotates every step so machine noise hits all alike; a step's time is
the slowest rank's (ranks are aligned by a barrier first). The ratio is autopar / torch of the
median step time, per world size and schedule (goal <= 1.05). Per variant it also prints the
medians of the pipeline step (``pipe``: ``pm.step`` / the peer's step, optimizer excluded), its
torch schedule's share (``sched``: ``schedule.step``; autopar's is timed by wrapping
``pm._schedule.step``), the rest (``post``: tied-gradient sum, and autopar's loss broadcast),
the optimizer (``opt``), and the one-off setup (``parallelize`` / building the stages).

Bubble. After the timed steps each stage is timed alone, one rank at a time (the others wait
idle), without communication: forward on the input the stage really received for micro-batch 0
(captured by a forward pre-hook during a step; stage 0: the micro-batch of token ids), then
backward with a ones-like output gradient (last stage: forward includes the loss, backward
starts from it); median of ``--reps``, the variants interleaved. With these per-stage f and b:

  closed form  ``(p-1)/m`` (interleaved ``(p-1)/(v*m)``), for reference;
  sim (model)  ``simulate(make(schedule, p, m, v), StageCosts(f, b)).bubble_fraction`` with
               autopar's predicted ``cuts.stage_time_s`` (``pm.pipeline_plan``) split 1:2;
  sim (meas)   the same with the measured f and b; ``+p2p`` also with ``p2p_s`` the one-way
               time of one activation from rank 0 to rank 1 (ping-pong, other ranks idle);
  measured     ``(T - busy) / busy`` (Megatron's definition): T the median of the slowest
               rank's pipeline step, busy the largest over ranks of ``m * sum(f + b)`` over the
               rank's stages;
  -runq        the same with T counting, per rank, only the time its main thread was not
               sitting runnable while other processes held the cores (Linux schedstat
               ``run_delay``): on a shared machine the rest of ``measured`` is mostly that.

``cpu`` is the slowest rank's main-thread CPU time over the pipeline step, to compare with
busy. With more ranks than cores the ranks time-share the cores, which the simulator
does not model. The same stage times for the peer show how balanced each split is. The losses
of each autopar variant are compared with its peer's (first step and every step; both train
the same model on the same data) and the first with the unsplit model's loss.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # after the filter above

import _common as common  # noqa: E402 - bench/ is the script directory
import torch.nn.functional as F
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
           "zb": "ScheduleInterleavedZeroBubble"}
MULTI = ("interleaved", "zb")                 # schedule classes that take a list of stages
GOAL = 1.05


def _virtual(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


# -- model, data --------------------------------------------------------------------------------

def _build(name: str, overrides: dict) -> nn.Module:
    import autopar.models
    torch.manual_seed(0)
    return autopar.models.build(name, overrides, device="cpu")


def _data(model: nn.Module, batch: int, seq: int) -> tuple[tuple, torch.Tensor]:
    """The same token ids and targets on every rank."""
    import autopar.models
    torch.manual_seed(1)
    args, _ = autopar.models.example_inputs(model, batch, seq, device="cpu")
    return args, torch.randint(0, model.config.vocab, (batch, seq))


class StageNet(nn.Module):
    """One stage of the hand split: blocks ``[lo, hi)`` of a GPT or LLaMA, plus the embeddings
    on the first stage and the final norm and head on the last (copies of the model's own)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.config, first, last
        self.gpt = hasattr(model, "wte")
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in range(lo, hi))
        if first:
            self.embed = copy.deepcopy(model.wte if self.gpt else model.embed)
            if self.gpt:
                self.wpe = copy.deepcopy(model.wpe)
        if last:
            self.norm = copy.deepcopy(model.ln_f if self.gpt else model.norm)
            head = model.wte.weight if self.gpt else model.lm_head.weight
            self.head = nn.Parameter(head.detach().clone())   # GPT: the untied copy of wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        if self.first:
            x = self.embed(x)
            if self.gpt:
                x = x + self.wpe(torch.arange(seq, device=x.device))
        if self.gpt:
            for layer in self.layers:
                x = layer(x)
        else:
            from autopar.models.llama import rope_cos_sin
            cos, sin = rope_cos_sin(seq, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
            for layer in self.layers:
                x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.head) if self.last else x


class TorchPipeline:
    """The peer: this rank's StageNets under a torch.distributed.pipelining schedule."""

    def __init__(self, model: nn.Module, schedule: str, micro: int, tied_group) -> None:
        import torch.distributed as dist
        from torch.distributed import pipelining

        world, rank = dist.get_world_size(), dist.get_rank()
        n, layers = world * _virtual(schedule), len(model.layers)
        if layers % n:
            raise ValueError(f"the hand split needs layers ({layers}) divisible by the stage count ({n})")
        k = layers // n
        self.indices = [rank + j * world for j in range(_virtual(schedule))]
        self.modules = [StageNet(model, s * k, (s + 1) * k, s == 0, s == n - 1) for s in self.indices]
        stages = [pipelining.PipelineStage(m, s, n, torch.device("cpu")) for m, s in zip(self.modules, self.indices)]
        cls = getattr(pipelining, CLASSES[schedule])
        self.schedule = cls(stages if schedule in MULTI else stages[0], n_microbatches=micro, loss_fn=loss_fn)
        self.first, self.last = 0 in self.indices, n - 1 in self.indices
        self.tied = tied_group if hasattr(model, "wte") and (self.first or self.last) else None
        self.opt = torch.optim.AdamW([p for m in self.modules for p in m.parameters()], lr=1e-3)

    def step(self, args: tuple, target: torch.Tensor) -> float:
        import torch.distributed as dist
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        self.schedule.step(*(args if self.first else ()), target=target if self.last else None, losses=losses)
        self.schedule_s = time.perf_counter() - t0
        if self.tied is not None:             # sum the tied embedding / head gradient
            for m in self.modules:
                for p in ((m.embed.weight,) if m.first else ()) + ((m.head,) if m.last else ()):
                    dist.all_reduce(p.grad, group=self.tied)
        return float(torch.stack([x.detach() for x in losses]).mean()) if losses else float("nan")


class AutoparPipeline:
    """autopar's pipeline and its optimizer, behind the same two calls as the peer."""

    def __init__(self, model: nn.Module, schedule: str, micro: int, args: tuple) -> None:
        import torch.distributed as dist

        import autopar
        self.pm = autopar.parallelize(model, {"pp": dist.get_world_size()}, args, options=autopar.PipelineOptions(
            loss_fn=loss_fn, schedule=schedule, microbatches=micro,
            virtual_stages=2 if schedule == "interleaved" else None))
        self.modules = self.pm.stages
        self.indices = [s.index for s in self.modules]
        self.opt = autopar.optimizer(self.pm, torch.optim.AdamW, lr=1e-3)
        self.schedule_s = 0.0
        schedule_step = self.pm._schedule.step

        def timed(*a, **k):                    # the torch schedule's share of pm.step
            t0 = time.perf_counter()
            out = schedule_step(*a, **k)
            self.schedule_s = time.perf_counter() - t0
            return out
        self.pm._schedule.step = timed

    def step(self, args: tuple, target: torch.Tensor) -> float:
        return float(self.pm.step(*args, target=target))


# -- timing ---------------------------------------------------------------------------------------

def _schedstat() -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a core) of the calling thread so far
    (Linux schedstat; zeros where the kernel does not keep it)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu_ns, wait_ns = f.read().split()[:2]
        return int(cpu_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _step(var, args: tuple, target: torch.Tensor) -> tuple[list[float], float]:
    """One training step: ([schedule, rest of the pipeline step, optimizer, the pipeline step's
    CPU, its run-queue wait] seconds, loss). Ranks are aligned by a barrier first."""
    import torch.distributed as dist
    dist.barrier()
    c0, w0 = _schedstat()
    t0 = time.perf_counter()
    loss = var.step(args, target)
    t1 = time.perf_counter()
    c1, w1 = _schedstat()
    var.opt.step()
    var.opt.zero_grad(set_to_none=True)
    return [var.schedule_s, t1 - t0 - var.schedule_s, time.perf_counter() - t1, c1 - c0, w1 - w0], loss


def _capture_inputs(var, args: tuple, target: torch.Tensor) -> dict[int, tuple]:
    """Each of this rank's stages' inputs for micro-batch 0, from one real step."""
    seen: dict[int, tuple] = {}
    hooks = []
    for idx, mod in zip(var.indices, var.modules):
        def pre(module, inputs, idx=idx):
            if idx not in seen:
                seen[idx] = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
        hooks.append(mod.register_forward_pre_hook(pre))
    try:
        _step(var, args, target)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _time_stage(mod, inputs: tuple, tgt: torch.Tensor | None) -> tuple[float, float]:
    """(forward s, backward s) of one micro-batch through one stage alone."""
    xs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
    t0 = time.perf_counter()
    y = mod(*xs)
    ys = y if isinstance(y, (tuple, list)) else (y,)
    if tgt is not None:                       # the last stage: the loss is part of its work
        roots, grads = [loss_fn(ys[0], tgt)], None
    else:
        roots = [t for t in ys if t.requires_grad]
        grads = [torch.ones_like(t) for t in roots]
    t1 = time.perf_counter()
    torch.autograd.backward(roots, grads)
    t2 = time.perf_counter()
    mod.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _stage_times(built: dict, inputs: dict, tgt: torch.Tensor, world: int, reps: int) -> dict:
    """{variant: {stage: [forward s, backward s]}} per micro-batch, each stage alone, the median
    of ``reps`` (after one warm-up), the variants interleaved rep by rep as the steps are."""
    raw: dict[str, dict[int, list]] = {v: {i: [] for i in var.indices} for v, var in built.items()}
    for rep in range(reps + 1):
        for v, var in built.items():
            last = world * _virtual(v.split("-", 1)[1]) - 1
            for idx, mod in zip(var.indices, var.modules):
                fb = _time_stage(mod, inputs[v][idx], tgt if idx == last else None)
                if rep:
                    raw[v][idx].append(fb)
    return {v: {i: [statistics.median(x[0] for x in fbs), statistics.median(x[1] for x in fbs)]
                for i, fbs in stages.items()} for v, stages in raw.items()}


def _p2p_time(shape: tuple[int, ...], reps: int) -> float | None:
    """One-way seconds of sending one activation ``shape`` (fp32) from rank 0 to rank 1 and back
    (half the median round trip; the other ranks idle). Returned on rank 0."""
    import torch.distributed as dist
    rank, buf, trips = dist.get_rank(), torch.zeros(shape), []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append(time.perf_counter() - t0)
    return statistics.median(trips[2:]) / 2 if rank == 0 else None


# -- one rank -------------------------------------------------------------------------------------

def _make(kind: str, schedule: str, name: str, overrides: dict, micro: int, args: tuple, tied):
    model = _build(name, overrides)
    if kind == "ap":
        return AutoparPipeline(model, schedule, micro, args)
    return TorchPipeline(model, schedule, micro, tied)


def _build_all(variants: list[str], name: str, overrides: dict, micro: int, args: tuple, tied):
    """Every variant that builds on every rank, the errors of the others, setup seconds."""
    import torch.distributed as dist
    built, errors, setup = {}, {}, {}
    for v in variants:
        kind, schedule = v.split("-", 1)
        t0 = time.perf_counter()
        try:
            built[v] = _make(kind, schedule, name, overrides, micro, args, tied)
        except Exception as e:                # noqa: BLE001 - reported, the other variants go on
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        setup[v] = time.perf_counter() - t0
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, errors.get(v))
        failed = next((e for e in everyone if e), None)
        if failed:
            built.pop(v, None)
            errors[v] = failed
    return built, errors, setup


def _plan_info(var) -> dict | None:
    """autopar's predicted stage times and cuts (None for the peer, or if autopar's plan changed shape)."""
    if not isinstance(var, AutoparPipeline):
        return None
    # the simulator's view of the cuts: ``pm.pipeline_plan`` (``pm.plan`` before it held the JSON Plan)
    plan = next((p for p in (getattr(var.pm, "pipeline_plan", None), var.pm.plan) if hasattr(p, "cuts")), None)
    if plan is None:
        return None
    return {"stage_time_s": list(plan.cuts.stage_time_s), "starts": list(plan.cuts.start_nodes),
            "step_time_s": plan.step_time_s, "bubble_fraction": plan.bubble_fraction}


def rank_work(rank: int, world: int, name: str, overrides: dict, batch: int, seq: int, micro: int,
              schedules: tuple[str, ...], warmup: int, steps: int, reps: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    ref = _build(name, overrides)
    args, target = _data(ref, batch, seq)
    ref_loss = float(loss_fn(ref(*args), target).detach()) if rank == 0 else None
    tied = dist.new_group(sorted({0, world - 1}))
    variants = [f"{k}-{s}" for s in schedules for k in ("ap", "torch")]
    built, errors, setup = _build_all(variants, name, overrides, micro, args, tied)
    live = [v for v in variants if v in built]
    times: dict[str, list] = {v: [] for v in live}
    losses: dict[str, list] = {v: [] for v in live}
    for i in range(warmup + steps):
        k = i % max(1, len(live))
        for v in live[k:] + live[:k]:
            try:
                phases, loss = _step(built[v], args, target)
            except Exception as e:
                raise RuntimeError(f"[variant {v}] step {i} failed: {type(e).__name__}: {e}") from e
            losses[v].append(loss)
            if i >= warmup:
                times[v].append(phases)
    inputs = {}
    for v in live:
        try:
            inputs[v] = _capture_inputs(built[v], args, target)
        except Exception as e:
            raise RuntimeError(f"[variant {v}] input capture failed: {type(e).__name__}: {e}") from e
    stage_s = {}
    for r in range(world):                    # one rank at a time: the others wait, idle
        dist.barrier()
        if r == rank:
            stage_s = _stage_times({v: built[v] for v in live}, inputs, target.chunk(micro)[0], world, reps)
    dist.barrier()
    shape = (batch // micro, seq, int(ref.config.hidden))
    return {"times": times, "losses": losses, "stage_s": stage_s, "errors": errors, "setup_s": setup,
            "ref_loss": ref_loss, "plans": {v: _plan_info(built[v]) for v in live},
            "p2p_s": _p2p_time(shape, 4 * reps)}


# -- report ---------------------------------------------------------------------------------------

def _variant_summary(res: list[dict], v: str, steps: int) -> dict:
    per_step = [max((r["times"][v][i] for r in res), key=lambda p: sum(p[:3])) for i in range(steps)]
    totals = [sum(p[:3]) for p in per_step]
    pipe = [max(r["times"][v][i][0] + r["times"][v][i][1] for r in res) for i in range(steps)]
    # the pipeline step less the time a rank sat runnable while other processes had the cores
    unstarved = [max(r["times"][v][i][0] + r["times"][v][i][1] - r["times"][v][i][4] for r in res)
                 for i in range(steps)]
    stage_s: dict[int, list[float]] = {}
    rank_busy = []
    for r in res:
        stage_s.update({int(s): fb for s, fb in r["stage_s"][v].items()})
        rank_busy.append(sum(f + b for f, b in r["stage_s"][v].values()))
    losses = [r["losses"][v] for r in res if r["losses"][v] and r["losses"][v][0] == r["losses"][v][0]]
    return {"median_ms": statistics.median(totals) * 1e3, "min_ms": min(totals) * 1e3,
            "pipe_ms": statistics.median(pipe) * 1e3, "unstarved_ms": statistics.median(unstarved) * 1e3,
            "cpu_ms": statistics.median(max(r["times"][v][i][3] for r in res) for i in range(steps)) * 1e3,
            "runq_ms": statistics.median(max(r["times"][v][i][4] for r in res) for i in range(steps)) * 1e3,
            "sched_ms": statistics.median(p[0] for p in per_step) * 1e3,
            "post_ms": statistics.median(p[1] for p in per_step) * 1e3,
            "opt_ms": statistics.median(p[2] for p in per_step) * 1e3,
            "step_ms": [round(t * 1e3, 2) for t in totals],
            "stage_fb_ms": [[x * 1e3 for x in stage_s[s]] for s in sorted(stage_s)],
            "rank_busy_ms": [b * 1e3 for b in rank_busy], "losses": losses[-1] if losses else [],
            "setup_s": max(r["setup_s"][v] for r in res), "plan": res[0]["plans"][v]}


def _bubble(s: dict, schedule: str, world: int, micro: int, p2p_s: float) -> dict:
    """Measured and simulated bubble of one variant (module docstring)."""
    from autopar.cost.pp_sim import StageCosts, make, simulate

    sched = make(schedule, world, micro, _virtual(schedule))
    f = tuple(x[0] / 1e3 for x in s["stage_fb_ms"])
    b = tuple(x[1] / 1e3 for x in s["stage_fb_ms"])
    sim = simulate(sched, StageCosts(forward_s=f, backward_s=b))
    with_p2p = simulate(sched, StageCosts(forward_s=f, backward_s=b, p2p_s=p2p_s))
    busy = micro * max(s["rank_busy_ms"])
    out = {"closed": (world - 1) / (_virtual(schedule) * micro), "sim_meas": sim.bubble_fraction,
           "sim_p2p": with_p2p.bubble_fraction, "sim_step_ms": sim.step_time_s * 1e3,
           "sim_p2p_step_ms": with_p2p.step_time_s * 1e3, "measured": (s["pipe_ms"] - busy) / busy,
           "unstarved": (s["unstarved_ms"] - busy) / busy, "busy_ms": busy}
    if s["plan"] is not None:
        pred = s["plan"]["stage_time_s"]
        model = simulate(sched, StageCosts(forward_s=tuple(t / 3 for t in pred), backward_s=tuple(2 * t / 3 for t in pred)))
        out["sim_model"] = model.bubble_fraction
    return out


def _summarise(res: list[dict], schedules, world: int, micro: int, steps: int) -> dict:
    errors = {}
    for r in res:
        errors.update(r["errors"])
    variants = {v: _variant_summary(res, v, steps) for v in res[0]["times"]}
    rows = []
    for sch in schedules:
        a, t = variants.get(f"ap-{sch}"), variants.get(f"torch-{sch}")
        row = {"schedule": sch}
        if a and t:
            row.update(ratio=a["median_ms"] / t["median_ms"], ms=(a["median_ms"], t["median_ms"]))
            row["ok"] = row["ratio"] <= GOAL
            if a["losses"] and t["losses"]:
                row["loss0_diff"] = abs(a["losses"][0] - t["losses"][0])
                row["loss_max_diff"] = max(abs(x - y) for x, y in zip(a["losses"], t["losses"]))
                row["loss0_vs_ref"] = abs(a["losses"][0] - res[0]["ref_loss"])
        for s in (a, t):
            if s:
                s["bubble"] = _bubble(s, sch, world, micro, res[0]["p2p_s"])
        rows.append(row)
    return {"world": world, "variants": variants, "ratios": rows, "errors": errors, "ref_loss": res[0]["ref_loss"],
            "p2p_ms": res[0]["p2p_s"] * 1e3}


def _print_world(w: dict) -> None:
    for v, e in w["errors"].items():
        print(f"FAILED {v}: {e}")
    print(f"{'variant':<18}{'median ms':>10}{'min ms':>8}{'pipe':>7}{'sched':>7}{'post':>6}{'opt':>6}{'setup s':>8}"
          f"  stage: forward / backward ms per micro-batch, alone")
    for v, s in w["variants"].items():
        fb = "  ".join(f"{i}: {f:.1f}/{b:.1f}" for i, (f, b) in enumerate(s["stage_fb_ms"]))
        print(f"{v:<18}{s['median_ms']:>10.1f}{s['min_ms']:>8.1f}{s['pipe_ms']:>7.1f}{s['sched_ms']:>7.1f}"
              f"{s['post_ms']:>6.1f}{s['opt_ms']:>6.1f}"
              f"{s['setup_s']:>8.1f}  {fb}")
        if s["plan"]:
            pred = " ".join(f"{t * 1e3:.1f}" for t in s["plan"]["stage_time_s"])
            print(f"{'':<18}autopar cuts before {', '.join(s['plan']['starts'][1:])}; predicted f+b ms {pred}")
    print(f"(p2p rank 0 -> 1, one activation: {w['p2p_ms']:.2f} ms one way; unsplit model's loss "
          f"{w['ref_loss']:.6f}; ranks ran {w['run_s']:.1f} s)", flush=True)


def _print_final(worlds: list[dict], command: str, machine: str, wall: float) -> None:
    print(f"\ncommand: {command}\nmachine: {machine}\ndate: {datetime.date.today().isoformat()}")
    print(f"{'world':>5} {'schedule':<12}{'ratio':>7}{'goal':>9}  {'ms (autopar / torch)':<22}"
          f"{'loss0 diff':>11}{'vs unsplit':>11}{'max diff':>10}")
    for w in worlds:
        for r in w["ratios"]:
            if "ratio" not in r:
                print(f"{w['world']:>5} {r['schedule']:<12}{'-':>7}{'<= 1.05':>9}  failed (see above)")
                continue
            ms = f"{r['ms'][0]:.1f} / {r['ms'][1]:.1f}"
            loss = "".join(f"{r[k]:>{n}.1e}" if k in r else f"{'-':>{n}}"
                           for k, n in (("loss0_diff", 11), ("loss0_vs_ref", 11), ("loss_max_diff", 10)))
            print(f"{w['world']:>5} {r['schedule']:<12}{r['ratio']:>7.3f}{'<= 1.05':>9}  {ms:<22}{loss}"
                  f"  {'ok' if r['ok'] else 'MISSED'}")
    print("\nbubble = (pipeline step - busy) / busy; busy = m * sum(f + b) over the busiest rank's stages,"
          "\ntimed alone; pipe = median pipeline step (optimizer excluded); runq = time the slowest rank"
          "\nsat runnable while other processes had the cores; -runq: the bubble with that time taken out")
    print(f"{'world':>5} {'variant':<18}{'closed':>7}{'sim(model)':>11}{'sim(meas)':>10}{'+p2p':>7}"
          f"{'measured':>9}{'-runq':>7}{'busy ms':>9}{'pipe ms':>8}{'runq ms':>8}{'cpu ms':>7}")
    for w in worlds:
        for v, s in w["variants"].items():
            b = s["bubble"]
            model = f"{b['sim_model']:>11.3f}" if "sim_model" in b else f"{'-':>11}"
            print(f"{w['world']:>5} {v:<18}{b['closed']:>7.3f}{model}{b['sim_meas']:>10.3f}{b['sim_p2p']:>7.3f}"
                  f"{b['measured']:>9.3f}{b['unstarved']:>7.3f}{b['busy_ms']:>9.1f}{s['pipe_ms']:>8.1f}"
                  f"{s['runq_ms']:>8.1f}{s['cpu_ms']:>7.1f}")
    if any(w["world"] > (os.cpu_count() or 1) for w in worlds):
        print(f"(worlds above {os.cpu_count()} ranks share the cores: their measured bubble includes the "
              f"time-sharing, which the simulator does not model)")
    print(f"total wall {wall:.1f} s")


# -- driver ---------------------------------------------------------------------------------------

def _overrides(a: argparse.Namespace) -> dict:
    return common.overrides(a.set, {"max_seq": a.seq, "layers": 2 * max(a.world), "hidden": 128, "heads": 4, "vocab": 512})


def _args() -> argparse.Namespace:
    ap = common.base_parser(__doc__, "world sizes, each >= 2 (default 2 4)")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--set", action="extend", nargs="+", metavar="K=V",
                    help="model config overrides (defaults: hidden=128 heads=4 vocab=512 layers=2*max(world))")
    ap.add_argument("--batch", type=int, default=16, help="rows per step, split into micro-batches (default 16)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    ap.add_argument("--reps", type=int, default=10, help="repetitions of each stage-alone timing (default 10)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-world timeout of run_ranks, s")
    a = ap.parse_args()
    a.schedules = tuple(s for s in a.schedules.split(",") if s)
    if any(s not in SCHEDULES for s in a.schedules) or not a.schedules:
        ap.error(f"--schedules takes names from {SCHEDULES}")
    if min(a.world) < 2:
        ap.error("--world sizes must be >= 2")
    if a.batch % a.microbatches:
        ap.error("--batch must be a multiple of --microbatches")
    return a


def _run_world(world: int, a: argparse.Namespace, overrides: dict) -> tuple[list[dict], tuple[str, ...], dict]:
    """run_ranks, dropping a schedule whose step fails on some rank (which can leave the others
    waiting in a collective: the run is repeated without it)."""
    from autopar.runtime.launch import run_ranks

    from autopar.core.errors import AutoparError

    schedules, dropped = a.schedules, {}
    while schedules:
        try:
            return run_ranks(rank_work, world, a.model, overrides, a.batch, a.seq, a.microbatches, schedules,
                             a.warmup, a.steps, a.reps, timeout_s=a.timeout), schedules, dropped
        except AutoparError as e:
            found = re.search(r"\[variant (\w+)-(\w+)\] (.*)", str(e))
            if not found:
                raise
            print(f"FAILED {found[1]}-{found[2]}: {found[3][:300]} (re-running world {world} without {found[2]})")
            dropped[f"{found[1]}-{found[2]}"] = found[3]
            schedules = tuple(s for s in schedules if s != found[2])
    return [], schedules, dropped


def main() -> int:
    import autopar.models

    a = _args()
    overrides = _overrides(a)
    n_params = autopar.models.param_count(autopar.models.get_config(a.model, overrides))
    t_all = time.perf_counter()
    command = "python bench/pp.py " + " ".join(sys.argv[1:])
    machine = common.machine_line()
    print(f"machine: {machine}")
    print(f"model: {a.model} {overrides} ({n_params:,} params), batch {a.batch} in {a.microbatches} micro-batches, "
          f"seq {a.seq}; loss cross_entropy; AdamW lr 1e-3; {a.warmup} warm-up + {a.steps} timed steps per "
          f"variant, order rotating; schedules {','.join(a.schedules)}")
    worlds = []
    for world in a.world:
        print(f"\n== world {world} ==", flush=True)
        t0 = time.perf_counter()
        res, schedules, dropped = _run_world(world, a, overrides)
        run_s = time.perf_counter() - t0
        if not res:
            worlds.append({"world": world, "variants": {}, "ratios": [], "errors": dropped, "run_s": run_s})
            continue
        w = _summarise(res, schedules, world, a.microbatches, a.steps)
        w["errors"].update(dropped)
        w["ratios"] += [{"schedule": s} for s in a.schedules if s not in schedules]
        w["run_s"] = run_s
        _print_world(w)
        worlds.append(w)
    wall = time.perf_counter() - t_all
    _print_final(worlds, command, machine, wall)
    print(json.dumps({"bench": "pp", "model": a.model, "overrides": overrides, "batch": a.batch, "seq": a.seq,
                      "microbatches": a.microbatches, "steps": a.steps, "warmup": a.warmup,
                      "schedules": list(a.schedules), "cores": os.cpu_count(), "torch": torch.__version__,
                      "wall_s": wall, "worlds": worlds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
