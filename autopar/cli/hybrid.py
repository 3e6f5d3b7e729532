"""``autopar plan``'s joint search over every parallelism and ``autopar simulate``: the
command-line side of cost/hybrid.py and cost/plan_search.py (text, JSON, report, timeline),
and the plan file ``--save-plan`` writes for ``autopar train --plan``
(:class:`autopar.core.saved_plan.SavedPlan`, made by :func:`saved_plan_of`)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from autopar.core.saved_plan import SavedPlan
from autopar.core.errors import ConfigError, DoesNotFitError
from autopar.cli.checks import gb_text


_HYBRID_HELP = "the simulator's figures (cost/hybrid.py)"


def _hybrid_facts(args: argparse.Namespace, planned):
    """The simulator's facts of a :class:`~autopar.cli.workload.PlanningCapture` (fewer layers than
    the model's where it could: ``layers=`` gives the real count)."""
    from autopar.cost.hybrid import ModelFacts
    from autopar.cost.dp_planner import optimizer_floats
    dtype = "fp32" if args.dtype == "fp32" else args.dtype
    return ModelFacts(planned.gm, seq=args.seq, dtype=dtype, optimizer_floats=optimizer_floats(args.optimizer),
                      attention=getattr(args, "attention", "flash"), layers=planned.block_copies,
                      moe_routing=getattr(args, "moe_routing", "capacity"),
                      moe_node_limit=getattr(args, "moe_node_limit", None))


def moe_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model's mixture-of-experts layers route (plan and simulate)."""
    parser.add_argument("--moe-routing", choices=["capacity", "dropless"], default="capacity",
                        help="MoE layers as captured (capacity buffers, padding computed and sent) or dropless "
                             "(routed tokens only)")
    parser.add_argument("--moe-node-limit", type=lambda t: positive_int(t, "--moe-node-limit"), default=None, metavar="M",
                        help="the model's routing puts a token's experts on at most M nodes (DeepSeek-V3: 4); "
                             "the two-hop exchange sends a token once to each node it reaches")


def _budget(args: argparse.Namespace, cluster) -> float:
    return args.memory_budget * 1e9 if args.memory_budget is not None else cluster.device.memory_bytes


# ---------------------------------------------------------------------------------------------
# One output contract for ``autopar plan``, whatever ``--pp``: each mode's planner (the joint
# search, the dp x tp x ZeRO planner, the pipeline planner) gives its choice as a hybrid
# :class:`~autopar.cost.hybrid.Score` in a :class:`PlanOutcome`; the text, ``--json``,
# ``--report`` and ``--save-plan`` are written from it alike.

ALTERNATIVE_COLUMNS = ("dp", "cp", "tp", "pp", "ep", "ZeRO", "mb", "sched", "v", "recompute", "step", "memory",
                       "why not")


@dataclass
class PlanOutcome:
    """What one ``autopar plan`` mode chose, in the shape every mode prints."""

    mode: str                          # "auto", "1" or the pipeline degree (--pp)
    search: str                        # what was searched, in words
    best: Any                          # cost.hybrid.Score
    others: list                       # Scores, each with its reason
    planner_s: float                   # the planner's measured time
    scored: int | None                 # configurations scored (None: the planner does not count them)
    budget: float                      # bytes per device
    stages: list = field(default_factory=list)      # per pipeline stage: stage, device, layers, time_s, memory_bytes
    details: list = field(default_factory=list)     # mode-specific text lines (indented)
    detail_data: dict = field(default_factory=dict)  # ... and their JSON
    notes: list = field(default_factory=list)       # caveats: printed, in the JSON and in the report
    experts: dict | None = None        # mixture of experts (--pp 1): the expert split chosen, with alternatives
    experts_text: str = ""
    none_why: str = ""                 # when there are no alternatives: why
    timeline_svg: Any = None           # () -> SVG of the simulated schedule (None: no pipeline to draw)
    block_rows: Any = None             # () -> rows of one block's ops with their layout
    dp_grad_numel: float | None = None  # gradient entries one data-axis rank reduces (None: modes not priced)
    dp_modes_why: str = ""             # when dp_grad_numel is None: why the data-axis modes are not priced


def emit_plan(args: argparse.Namespace, name: str, cluster, out: PlanOutcome) -> int:
    """Write ``out`` as ``--report``, ``--save-plan``, then ``--json`` or the text."""
    if getattr(args, "report", None):
        _write_report(args, name, cluster, out)
    if getattr(args, "save_plan", None):
        saved_plan_of(args, cluster, out.best).save(args.save_plan)
        say(args, f"wrote {args.save_plan}")
    if args.json:
        sys.stdout.write(json.dumps(plan_json(args, name, cluster, out), indent=1) + "\n")
    else:
        sys.stdout.write(plan_text(args, name, cluster, out) + "\n")
    return 0


def plan_json(args: argparse.Namespace, name: str, cluster, out: PlanOutcome) -> dict:
    """The one JSON schema of ``autopar plan --json`` (the same top-level keys for every --pp)."""
    return {"model": name, "cluster": cluster.name, "devices": cluster.world_size, "batch": args.batch,
            "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer, "pp_mode": out.mode,
            "search": out.search, **out.best.as_dict(), "planner_time_s": out.planner_s,
            "configurations_scored": out.scored, "memory_budget_bytes": out.budget,
            "alternatives": [o.as_dict() for o in out.others], "stages": list(out.stages), "experts": out.experts,
            "dp_mode_alternatives": dp_mode_alternatives(args, cluster, out),
            "details": dict(out.detail_data), "notes": list(out.notes)}


def plan_text(args: argparse.Namespace, name: str, cluster, out: PlanOutcome) -> str:
    """The one text layout of ``autopar plan``: the plan line, the chosen configuration, the
    predicted step (TFLOP/s, MFU), memory, mode details, the alternatives table, notes."""
    from autopar.cli.dump import seconds
    best = out.best
    mem = best.memory
    gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
    scored = f"{out.scored} configurations scored" if out.scored is not None else "planned"
    lines = [f"autopar plan: {name} on {cluster.name} ({cluster.world_size} devices), global batch {args.batch}, "
             f"seq {args.seq}, {args.dtype}, {args.optimizer}; --pp {out.mode}: {out.search}; {scored} in "
             f"{out.planner_s:.2f}s",
             f"chosen: {config_line(best.config, best.microbatches)}",
             f"  predicted step time {seconds(best.step_time_s)}: {best.tflops_per_device:.1f} model TFLOP/s per "
             f"device ({best.hw_tflops_per_device:.1f} with recomputation), MFU {100 * best.mfu:.1f}%, "
             f"bubble {best.bubble_fraction:.3f}, exposed communication {seconds(best.exposed_comm_s)}",
             f"  memory per device (GB): params {gb(mem.get('params', 0.0))}  grads {gb(mem.get('grads', 0.0))}  "
             f"optimizer {gb(mem.get('optimizer', 0.0))}  activations {gb(mem.get('activations', 0.0))}  "
             f"reserve {gb(mem.get('reserve', 0.0))}  total "
             f"{gb(best.peak_memory_bytes)} (budget {gb(out.budget)})"]
    lines += [f"  {d}" for d in out.details]
    for r in out.stages:
        lines.append(f"  stage {r['stage']:<3} device {r['device']:<3} layers {r['layers']:<24} "
                     f"{seconds(r['time_s']):>8} per micro-batch  memory {gb(r['memory_bytes'])} GB"
                     + (f"; {r['detail']}" if r.get("detail") else ""))
    if getattr(args, "save_plan", None):
        lines.append(f"  saved to {args.save_plan}: `autopar train --plan {args.save_plan}` trains this structure, "
                     f"scaled down, on local CPU ranks")
    lines.append(f"alternatives (top {len(out.others)}):")
    lines.append(f"  {'dp':>4} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} {'ZeRO':>4} {'mb':>3} {'sched':>11} {'v':>2} "
                 f"{'recompute':>9} {'step':>9} {'memory':>9}  why not")
    for o in out.others:
        k = o.config
        cp = f"{k.cp}{(k.cp_kind or '?')[0]}" if k.cp > 1 else "1"       # r(ing), a(llgather), a(lltoall)
        cp = {"ring": f"{k.cp}r", "allgather": f"{k.cp}g", "alltoall": f"{k.cp}u"}.get(k.cp_kind, cp)
        zero = f"{k.zero_stage}/{k.shard_group}" if k.shard_group else str(k.zero_stage)    # hybrid: stage/group
        lines.append(f"  {k.dp:>4} {cp:>3} {k.tp:>3} {k.pp:>3} {k.ep:>3} {zero:>4} {k.micro_batch:>3} "
                     f"{k.schedule if k.pp > 1 else '-':>11} {k.virtual:>2} {k.recompute:>9} {seconds(o.step_time_s):>9} "
                     f"{o.peak_memory_bytes / 1e9:>6.2f} GB  {o.reason}")
    if not out.others:
        lines.append(f"  (none{': ' + out.none_why if out.none_why else ''})")
    if out.experts_text:
        lines.append(out.experts_text)
    lines += dp_mode_text(dp_mode_alternatives(args, cluster, out))
    if out.notes:
        lines.append("notes:")
        lines += [f"  - {n}" for n in out.notes]
    return "\n".join(lines)


DP_MODE_THRESHOLD = 0.10     # a data-axis mode is shown when it shortens the step by more than this share


def dp_mode_alternatives(args: argparse.Namespace, cluster, out: PlanOutcome) -> dict:
    """The data-axis modes (``autopar/core/dp_mode.py``) priced for the chosen plan's data axis by
    ``cost/dp_modes.py``: ``shown`` those that would shorten its step by more than
    :data:`DP_MODE_THRESHOLD`, ``priced`` every one that composes with it. They are offered,
    never chosen: each changes the optimisation, so the plan (and ``--save-plan``) keeps all-reduce."""
    from autopar.cost.dp_modes import price_modes, worth_showing
    from autopar.core.dp_mode import check_composes
    best, c = out.best, out.best.config
    data = {"dp": c.dp, "threshold": DP_MODE_THRESHOLD, "step_time_s": best.step_time_s, "grad_numel": None,
            "plan_zero_stage": c.zero_stage, "shown": [], "priced": [], "none_why": ""}
    why = ("no data axis (dp=1)" if c.dp == 1 else "only all-reduce composes with experts (ep > 1)" if c.ep > 1
           else out.dp_modes_why or "not priced by this planner" if out.dp_grad_numel is None else "")
    if why:
        return data | {"none_why": why}
    prices = price_modes(int(out.dp_grad_numel), c.dp, cluster, inner=c.tp,
                         step_compute_s=max(0.0, best.step_time_s - best.exposed_comm_s),
                         allreduce_exposed_s=best.exposed_comm_s,
                         exchanges_per_step=best.microbatches if c.pp == 1 else 1)
    usable = []
    for p in prices[1:]:
        try:
            check_composes(p.mode, zero_stage=0, pipeline=c.pp > 1, mixed_precision=args.dtype)
        except ConfigError:
            continue
        usable.append(p)
    shown = sorted((p for p in usable if worth_showing(p, best.step_time_s, DP_MODE_THRESHOLD)),
                   key=lambda p: -p.saving_s)
    data.update(grad_numel=out.dp_grad_numel, allreduce=prices[0].as_dict(), priced=[p.as_dict() for p in usable],
                shown=[p.as_dict() | {"step_saving_fraction": p.saving_s / best.step_time_s} for p in shown])
    if not shown:
        top = max(usable, key=lambda p: p.saving_s, default=None)
        data["none_why"] = (f"none would shorten the step by more than {100 * DP_MODE_THRESHOLD:.0f} %"
                            + (f" (best: {_mode_line(top.as_dict(), best.step_time_s, prices[0].exposed_s)})"
                               if top is not None else ""))
    return data


def _mode_line(p: dict, step_s: float, allreduce_s: float) -> str:
    from autopar.cli.dump import seconds
    return (f"{p['label']}: data-axis communication {seconds(allreduce_s)} -> {seconds(p['exposed_s'])} per step "
            f"({'-' if p['saving_s'] >= 0 else '+'}{seconds(abs(p['saving_s']))}, "
            f"{-100 * p['saving_s'] / step_s:+.0f} % step)")


def dp_mode_text(data: dict) -> list[str]:
    """The ``data-axis modes`` section of ``autopar plan``'s text."""
    head = "data-axis modes (offered, never chosen: each changes the optimisation; the plan keeps all-reduce"
    from autopar.cli.dump import seconds
    shown = {p["label"] for p in data["shown"]}
    rest = [p for p in data.get("priced", []) if p["label"] not in shown]
    under = ("  the others, per step (- saves, + costs): " + ", ".join(
        f"{p['label']} {'-' if p['saving_s'] >= 0 else '+'}{seconds(abs(p['saving_s']))}" for p in rest)) if rest else ""
    if data["none_why"]:
        return [f"{head}): {data['none_why']}"] + ([under] if under else [])
    ar = data["allreduce"]["exposed_s"]
    zero = data["plan_zero_stage"]
    lines = [head + (f"; each needs ZeRO-0, the plan has ZeRO-{zero}: memory not re-checked" if zero else "") + "):"]
    lines += [f"  {_mode_line(p, data['step_time_s'], ar)}; {p['note']}" for p in data["shown"]]
    return lines + ([under] if under else [])


def _write_report(args: argparse.Namespace, name: str, cluster, out: PlanOutcome) -> None:
    """--report: the plan as one HTML page, with the planner's measured time, each stage's
    memory, the alternatives (ep column included) and every note the text prints."""
    from autopar.cli.checks import writing
    from autopar.cli.report import write_report
    svg = out.timeline_svg() if out.timeline_svg is not None else \
        "<p>no pipeline: one stage runs its micro-batches in turn</p>"
    rows = out.block_rows() if out.block_rows is not None else []
    plan = plan_json(args, name, cluster, out)
    notes = list(out.notes) + [d.strip() for d in out.details]
    if out.experts_text:
        notes.append(out.experts_text.splitlines()[0])
    writing("--report", args.report, lambda: write_report(
        args.report, title=f"autopar plan: {name} on {cluster.name}", plan=plan,
        alternatives=[o.as_dict() | {"reason": o.reason} for o in out.others], timeline_svg=svg, block_rows=rows,
        stages=list(out.stages), notes=notes))
    say(args, f"wrote {args.report}")


def _hybrid_stages(best) -> list[dict]:
    """The joint search's pipeline stages: layers, time per micro-batch and the memory of the
    device holding each (its own figure, not the worst device's)."""
    c = best.config
    if c.pp == 1:
        return []
    counts = best.parts.get("stage_layers") or []
    mems = best.parts.get("device_memory_bytes") or []
    fwd, bwd = best.parts.get("stage_fwd_s") or [], best.parts.get("stage_bwd_s") or []
    rows, first = [], 0
    for s, n in enumerate(counts):
        d = s % c.pp
        rows.append({"stage": s, "device": d, "layers": f"{first}-{first + n - 1}" if n else "-",
                     "time_s": fwd[s] + bwd[s],
                     "memory_bytes": sum(mems[d].values()) if d < len(mems) else best.peak_memory_bytes})
        first += n
    return rows


def plan_command(args: argparse.Namespace, w, planned, cluster, start: float) -> int:
    """``autopar plan`` (default): the joint search over every parallelism (cost/hybrid.py), on
    ``planned``, the workload's :func:`~autopar.cli.workload.capture_for_planning`."""
    from autopar.core.plans import RECOMPUTE
    from autopar.cost.plan_search import leanest, search, smallest_cluster

    facts = _hybrid_facts(args, planned)
    space = {}
    if args.tp != "auto":      # exactly this degree (as with --pp 1 and --pp N)
        space["tp_exact"] = positive_int(args.tp, "--tp")
    if args.zero != "auto":
        space["zero_stages"] = (int(args.zero),)
    _check_layouts(args, facts, cluster, space.get("tp_exact"))
    t0 = time.perf_counter()
    say(args, f"searching dp x tp x pp x ZeRO x recompute x micro-batch x schedule for {cluster.world_size} "
                    f"devices …")
    best, others, scored = search(facts, cluster, batch=args.batch, budget=_budget(args, cluster),
                                  top=args.top, recomputes=RECOMPUTE, **space)
    planner_s = time.perf_counter() - t0
    say(args, f"scored {scored} configurations in {planner_s:.1f}s")
    if best is None:
        smallest = smallest_cluster(facts, cluster, batch=args.batch, budget=_budget(args, cluster))
        lean = leanest(facts, cluster, batch=args.batch, **space)
        raise DoesNotFitError(f"no configuration of {w.name} fits in {gb_text(_budget(args, cluster))} GB per "
                              f"device on {cluster.name}", where="autopar plan", smallest_devices=smallest,
                              expected=f"per-device memory <= {gb_text(_budget(args, cluster))} GB",
                              got=f"the leanest, {config_line(lean.config, lean.microbatches)}, needs "
                                  f"{gb_text(lean.peak_memory_bytes)} GB"
                              if lean is not None else "no configuration divides the batch and layers",
                              fix=(f"{smallest} devices (whole nodes of {cluster.devices_per_node}) would fit"
                                   if smallest else "no cluster up to 65536 devices fits")
                              + "; or raise --memory-budget")
    if args.timeline:
        drawable(best.microbatches, "--timeline")
        from autopar.cli.checks import writing
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import write_timeline
        sim = timeline_of(facts, cluster, best.config, batch=args.batch)
        c = best.config
        title = f"{facts.layers} layers, dp={c.dp} tp={c.tp} pp={c.pp}, {c.schedule}, {best.microbatches} micro-batches"
        writing("--timeline", args.timeline, lambda: write_timeline(sim, args.timeline, title=title))
        say(args, f"wrote {args.timeline}")

    def svg() -> str:
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import timeline_svg
        drawable(best.microbatches, "--report")
        return timeline_svg(timeline_of(facts, cluster, best.config, batch=args.batch),
                            title="simulated pipeline schedule")
    notes = [f"{_HYBRID_HELP}; attention priced as {facts.attention}",
             "alternatives are the best variant of each other layout"]
    details = []
    if best.config.cp > 1:
        details = _context_explained(facts, cluster, best, args, space)
        notes.append("cp column: degree and kind (r ring, g all-gather, u all-to-all over heads); a rank keeps at "
                     "least 4096 tokens of each sequence")
    if planned.block_copies:
        notes.append(f"planned on a capture of {planned.describe()}; the figures are the real {facts.layers} layers'")
    out = PlanOutcome(mode="auto", search="joint search of dp x tp x pp x ep, ZeRO, recompute, micro-batch and "
                      "schedule", best=best, others=list(others), planner_s=planner_s, scored=scored,
                      budget=_budget(args, cluster), stages=_hybrid_stages(best), notes=notes, details=details,
                      timeline_svg=svg, block_rows=lambda: _block_rows(facts, cluster, best.config),
                      dp_grad_numel=_dp_grad_numel(facts, cluster, best))
    return emit_plan(args, w.name, cluster, out)


def _context_explained(facts, cluster, best, args: argparse.Namespace, space: dict) -> list[str]:
    """Why the plan splits the sequence: what each rank holds, each kind's exchange per block, and
    the best plan without a context axis (slower, or too big)."""
    from autopar.cost.cp_planner import block_costs
    from autopar.cost.hybrid import mesh_axes
    from autopar.cost.plan_search import leanest, search
    c = best.config
    _, _, _, totals = block_costs(facts, c, cluster, mesh_axes(c))
    kinds = ", ".join(f"{k} {v * 1e3:.3g} ms" if v != float("inf") else f"{k} impossible" for k, v in totals.items())
    lines = [f"context parallelism: cp={c.cp} ({c.cp_kind}): each device holds {facts.seq // c.cp} of the "
             f"{facts.seq} tokens of every sequence, activations {best.memory.get('activations', 0.0) / 1e9:.1f} GB "
             f"per device; exposed exchange per block and micro-batch: {kinds}"]
    alone, _, _ = search(facts, cluster, batch=args.batch, budget=_budget(args, cluster), top=0,
                         **{**space, "cps": (1,)})
    if alone is None:
        lean = leanest(facts, cluster, batch=args.batch, **{**space, "cps": (1,)})
        lines.append("  without a context axis nothing fits: " + (
            f"the leanest layout ({config_line(lean.config, lean.microbatches)}) needs "
            f"{lean.peak_memory_bytes / 1e9:.1f} GB per device (activations "
            f"{lean.memory.get('activations', 0.0) / 1e9:.1f} GB), budget {_budget(args, cluster) / 1e9:.1f} GB"
            if lean is not None else "no layout divides the batch and the devices"))
    else:
        lines.append(f"  without it the best layout ({config_line(alone.config, alone.microbatches)}) takes "
                     f"{alone.step_time_s:.3g}s per step ({100 * (alone.step_time_s / best.step_time_s - 1):+.1f}%), "
                     f"{alone.tflops_per_device:.1f} TFLOP/s per device, activations "
                     f"{alone.memory.get('activations', 0.0) / 1e9:.1f} GB")
    return lines


def _dp_grad_numel(facts, cluster, best) -> float:
    """The gradient entries the busiest data-axis rank of ``best`` reduces: its pipeline
    device's stages' parameters per tensor rank, as :func:`autopar.cost.hybrid.simulate` counts
    them (without experts: no data-axis mode but all-reduce composes with them)."""
    c = best.config
    _, strategies = facts.parts(c.tp, c.micro_batch, cluster, (("pp", c.pp), ("dp", c.dp), ("tp", c.tp)))
    numel = facts.param_numel(c.tp, strategies)
    counts = best.parts.get("stage_layers") or [facts.layers]
    last = len(counts) - 1
    return max(sum(counts[s] * numel["block"] + (numel["pre"] if s == 0 else 0.0)
                   + (numel["post"] if s == last else 0.0) for s in range(d, len(counts), c.pp)) for d in range(c.pp))


def _check_layouts(args: argparse.Namespace, facts, cluster, tp: int | None) -> None:
    """Refuse, before searching, a cluster and batch no layout can use: devices = dp x tp x pp
    with tp a power of two within a node (or ``--tp`` exactly), pp up to the layer count, and
    dp dividing the global batch (every data replica gets whole samples)."""
    from autopar.cost.plan_search import configurations
    devices, per_node, layers = cluster.world_size, cluster.devices_per_node, facts.layers
    if tp is not None and devices % tp:
        raise ConfigError(f"--tp {tp} does not divide the {devices} devices of --cluster {args.cluster}",
                          where="--tp", expected=f"--tp is the exact tensor-parallel degree: a divisor of {devices}",
                          got=f"--tp {tp}", fix="pick a tp dividing the device count, or --tp auto")
    if next(iter(configurations(facts, devices=devices, batch=args.batch, per_node=per_node,
                                tp_exact=tp)), None) is not None:
        return
    tps = [tp] if tp is not None else [t for t in (1, 2, 4, 8, 16) if t <= per_node and devices % t == 0]
    dp = min(devices // (t * p) for t in tps for p in range(1, layers + 1) if devices % (t * p) == 0)
    most = max(t for t in tps) * layers * args.batch
    raise ConfigError(f"no layout uses all {devices} devices for a global batch of {args.batch}",
                      where="autopar plan", expected=f"devices = dp x tp x pp with tp in {tps}, pp at most the "
                      f"model's {layers} layers, and dp dividing the batch (whole samples per data replica)",
                      got=f"--cluster {args.cluster}: dp would be at least {dp}, --batch {args.batch}",
                      fix=f"use a global batch that is a multiple of {dp} (e.g. --batch {dp * max(1, args.batch // dp)})"
                          f", or a cluster of at most {most} devices that the batch divides")


def drawable(microbatches: int, flag: str) -> None:
    """Refuse to draw a schedule of more micro-batches than the event simulation runs."""
    from autopar.cli.checks import MAX_EVENT_MICROBATCHES
    if microbatches > MAX_EVENT_MICROBATCHES:
        raise ConfigError(f"{flag} draws every micro-batch; this plan has {microbatches} per step", where=flag,
                          expected=f"at most {MAX_EVENT_MICROBATCHES} micro-batches to draw",
                          got=f"{microbatches} micro-batches", fix=f"drop {flag}, or plan a smaller --batch")


def _block_rows(facts, cluster, c) -> list[dict]:
    """The first layer's ops with the tensor layout the plan gives them."""
    from autopar.core.meta import info
    axes = (("pp", c.pp), ("dp", c.dp), ("tp", c.tp))
    _, strategies = facts.parts(c.tp, c.micro_batch, cluster, axes)
    first = None
    rows = []
    for n in facts.gm.graph.nodes:
        rec = info(n)
        if facts.where.get(n) != "block" or n.op != "call_function":
            continue
        first = first or rec.block_member
        if rec.block_member != first:
            break
        s = strategies.get(n.name)
        rows.append({"name": n.name, "op": str(getattr(n.target, "__name__", n.target)), "module": rec.fqn,
                     "shape": " ".join(str(tuple(v.shape)) for v in rec.values[:1]),
                     "placement": ",".join(str(o) for o in s.outputs) if s else "R",
                     "collective": s.name if s is not None and s.work < 1 else ""})
    return rows


def simulate_command(args: argparse.Namespace) -> int:
    """``autopar simulate``: score one fixed configuration with the planner's simulator."""
    from autopar.cli import checks as cli_checks
    from autopar.core.plans import Config
    from autopar.cost.hybrid import simulate
    from autopar.cli.workload import capture_for_planning, load_workload, parse_overrides

    cli_checks.output_file(args.timeline, "--timeline")
    cluster = cli_checks.cluster(args.cluster, args.hardware)
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set))
    facts = _hybrid_facts(args, capture_for_planning(w))
    tp, pp, cp, ep = args.tp, args.pp, args.cp, args.ep
    dp = args.dp or cluster.world_size // (cp * tp * pp)
    if dp * cp * tp * pp != cluster.world_size:
        raise ConfigError(f"dp x cp x tp x pp = {dp * cp * tp * pp} is not the cluster's {cluster.world_size} devices",
                          where="autopar simulate", fix="pick degrees whose product is the device count")
    if args.cp_kind is not None and cp == 1:
        raise ConfigError("--cp-kind needs a context axis", where="autopar simulate", got=f"--cp {cp}",
                          fix="add --cp N (N >= 2), or drop --cp-kind")
    c = Config(dp=dp, tp=tp, pp=pp, micro_batch=args.micro_batch_size, schedule=args.schedule,
               virtual=2 if args.schedule == "dualpipev" else args.virtual_stages, recompute=args.recompute,
               zero_stage=args.zero, cp=cp, cp_kind=args.cp_kind, ep=ep, shard_group=args.shard_group)
    t0 = time.perf_counter()
    score = simulate(facts, cluster, c, batch=args.batch, budget=_budget(args, cluster))
    data = {"model": w.name, "cluster": cluster.name, "devices": cluster.world_size, "batch": args.batch,
            "seq": args.seq, "dtype": args.dtype, **score.as_dict(), "planner_time_s": time.perf_counter() - t0,
            "alternatives": []}
    if args.timeline:
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import write_timeline
        drawable(score.microbatches, "--timeline")
        sim = timeline_of(facts, cluster, c, batch=args.batch)
        cli_checks.writing("--timeline", args.timeline, lambda: write_timeline(sim, args.timeline))
    if args.json:
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        sys.stdout.write("\n".join(simulate_text(w.name, cluster, args, score, _budget(args, cluster))) + "\n")
    return 0


def simulate_text(model: str, cluster, args: argparse.Namespace, score, budget: float) -> list[str]:
    """``autopar simulate``'s text: the configuration, what it reaches, and the step's terms as
    the simulator adds them up (``cost/hybrid.py``), then the memory a device holds."""
    from autopar.cli.dump import seconds
    p = score.parts
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    lines = [f"autopar simulate: {model} on {cluster.name} ({cluster.world_size} devices), global batch "
             f"{args.batch}, seq {args.seq}, {args.dtype}",
             f"configuration: {config_line(score.config, score.microbatches)}",
             f"  predicted step time {seconds(score.step_time_s)}: {score.tflops_per_device:.1f} model TFLOP/s per "
             f"device ({score.hw_tflops_per_device:.1f} with recomputation), MFU {100 * score.mfu:.1f}%",
             "  step terms:",
             f"    pipeline (compute, tensor and context exchanges, bubble {score.bubble_fraction:.3f})  "
             f"{seconds(p['pipeline_s'])}",
             f"    data axis: {seconds(p['dp_comm_s'])} in all, exposed  {seconds(score.exposed_comm_s)}",
             f"    contention of hidden collectives  {seconds(p.get('contention_s', 0.0))}",
             f"    optimizer step  {seconds(p['optimizer_s'])}",
             f"  per block and micro-batch: forward {seconds(p['block_fwd_s'])}, backward {seconds(p['block_bwd_s'])}, "
             f"tensor exchanges {seconds(p['tp_comm_per_block_s'])}"
             + (f", context exchanges {seconds(p['cp_comm_per_block_s'])}" if "cp_comm_per_block_s" in p else "")
             + (f", expert all-to-all {seconds(p['ep_comm_per_block_s'])}" if "ep_comm_per_block_s" in p else "")
             + (f"; p2p {seconds(p['p2p_s'])}" if score.config.pp > 1 else "")]
    mem = score.memory
    lines.append("  memory per device (GB): " + "  ".join(f"{k} {gb(v)}" for k, v in mem.items())
                 + f"  total {gb(score.peak_memory_bytes)} (budget {gb(budget)}"
                 + ("" if score.fits else ": DOES NOT FIT") + ")")
    if score.config.pp > 1:
        lines.append(f"  layers per stage: {p['stage_layers']}")
    return lines


def positive_int(text: str, flag: str) -> int:
    """``--tp`` / ``--pp`` of ``autopar plan``: a positive integer (``auto`` is handled before)."""
    from autopar.cli.checks import MAX_DEVICES, bounded_int
    if not text.strip().isdigit():
        raise ConfigError(f"{flag} takes 'auto' or a positive integer", where=flag, got=repr(text)[:60],
                          fix=f"e.g. {flag} 4")
    return bounded_int(text, flag, high=MAX_DEVICES, why="a degree of at most the largest --cluster")


def say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)


def saved_plan_of(args: argparse.Namespace, cluster, best) -> SavedPlan:
    """The plan ``autopar plan`` chose (``best``, a Score) for its command line ``args``."""
    from autopar.cli.workload import parse_overrides
    return SavedPlan(model=args.model, overrides=parse_overrides(args.set), cluster=args.cluster,
                     hardware=args.hardware, devices=cluster.world_size, batch=args.batch, seq=args.seq,
                     dtype=args.dtype, config=best.config, microbatches=best.microbatches,
                     predicted={"step_time_s": best.step_time_s, "mfu": best.mfu,
                                "tflops_per_device": best.tflops_per_device,
                                "peak_memory_bytes": best.peak_memory_bytes})


def config_line(c, microbatches: int) -> str:
    """One configuration as ``autopar plan`` and ``autopar train`` print it."""
    cp = f" cp={c.cp} ({c.cp_kind})" if getattr(c, "cp", 1) > 1 else ""
    hybrid = f" (shard groups of {c.shard_group})" if getattr(c, "shard_group", 0) else ""
    return (f"dp={c.dp}{cp} tp={c.tp} pp={c.pp}" + (f" ep={c.ep}" if c.ep > 1 else "") + f" ZeRO-{c.zero_stage}{hybrid}, "
            f"micro-batch {c.micro_batch} x {microbatches}, "
            + (f"{c.schedule} schedule" + (f" (v={c.virtual})" if c.virtual > 1 else "") if c.pp > 1 else "no pipeline")
            + f", recompute {c.recompute}")
