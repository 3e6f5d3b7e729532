"""``autopar plan``'s joint search over every parallelism and ``autopar simulate``: the
command-line side of cost/hybrid.py and cost/plan_search.py (text, JSON, report, timeline)."""
from __future__ import annotations

import argparse
import sys
import time

from autopar.errors import ConfigError, DoesNotFitError


_HYBRID_HELP = "the simulator's figures (cost/hybrid.py)"


def _hybrid_facts(args: argparse.Namespace, gm):
    from autopar.cost.hybrid import ModelFacts
    from autopar.cost.dp_planner import optimizer_floats
    dtype = "fp32" if args.dtype == "fp32" else args.dtype
    return ModelFacts(gm, seq=args.seq, dtype=dtype, optimizer_floats=optimizer_floats(args.optimizer),
                      attention=getattr(args, "attention", "flash"))


def _hybrid_json(w, cluster, args, best, others, planner_s: float, scored: int) -> dict:
    from autopar.train import runtime_gaps
    data = {"model": w.name, "cluster": cluster.name, "devices": cluster.world_size, "batch": args.batch,
            "seq": args.seq, "dtype": args.dtype, **best.as_dict(), "planner_time_s": planner_s,
            "configurations_scored": scored, "memory_budget_bytes": _budget(args, cluster),
            "runtime_gaps": runtime_gaps(best.config), "alternatives": [o.as_dict() for o in others]}
    return data


def _budget(args: argparse.Namespace, cluster) -> float:
    return args.memory_budget * 1e9 if args.memory_budget is not None else cluster.device.memory_bytes


def _plan_hybrid(args: argparse.Namespace, w, gm, cluster, start: float) -> int:
    """``autopar plan`` (default): the joint search over every parallelism (cost/hybrid.py)."""
    import json

    from autopar.cost.hybrid import RECOMPUTE
    from autopar.cost.plan_search import search, smallest_cluster

    facts = _hybrid_facts(args, gm)
    space = {}
    if args.tp != "auto":
        space["tp_max"] = _positive_int(args.tp, "--tp")
    if args.zero != "auto":
        space["zero_stages"] = (int(args.zero),)
    t0 = time.perf_counter()
    _progress(args, f"searching dp x tp x pp x ZeRO x recompute x micro-batch x schedule for {cluster.world_size} "
                    f"devices …")
    best, others, scored = search(facts, cluster, batch=args.batch, budget=_budget(args, cluster),
                                  top=args.top, recomputes=RECOMPUTE, **space)
    planner_s = time.perf_counter() - t0
    _progress(args, f"scored {scored} configurations in {planner_s:.1f}s")
    if best is None:
        smallest = smallest_cluster(facts, cluster, batch=args.batch, budget=_budget(args, cluster))
        raise DoesNotFitError(f"no configuration of {w.name} fits in {_budget(args, cluster) / 1e9:.1f} GB per "
                              f"device on {cluster.name}", where="autopar plan", smallest_devices=smallest,
                              expected=f"per-device memory <= {_budget(args, cluster) / 1e9:.1f} GB",
                              got=f"the leanest needs {min(o.peak_memory_bytes for o in others) / 1e9:.1f} GB"
                              if others else "no configuration divides the batch and layers",
                              fix=(f"{smallest} devices (whole nodes of {cluster.devices_per_node}) would fit"
                                   if smallest else "no cluster up to 65536 devices fits")
                              + "; or raise --memory-budget")
    if args.timeline or args.report:
        _hybrid_extras(args, facts, cluster, best, others)
    if args.json:
        sys.stdout.write(json.dumps(_hybrid_json(w, cluster, args, best, others, planner_s, scored), indent=1) + "\n")
        return 0
    sys.stdout.write(_hybrid_text(args, w.name, cluster, best, others, planner_s, scored) + "\n")
    return 0


def _hybrid_text(args, name: str, cluster, best, others, planner_s: float, scored: int) -> str:
    from autopar.dump import seconds
    from autopar.train import runtime_gaps
    c = best.config
    mem = best.memory
    gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
    lines = [f"autopar plan: {name} on {cluster.name} ({cluster.world_size} devices), global batch {args.batch}, "
             f"seq {args.seq}, {args.dtype}; {scored} configurations scored in {planner_s:.2f}s",
             f"chosen: dp={c.dp} tp={c.tp} pp={c.pp} ZeRO-{c.zero_stage}, micro-batch {c.micro_batch} x "
             f"{best.microbatches}, {c.schedule} schedule" + (f" (v={c.virtual})" if c.virtual > 1 else "")
             + f", recompute {c.recompute}",
             f"  predicted step time {seconds(best.step_time_s)}: {best.tflops_per_device:.1f} model TFLOP/s per "
             f"device ({best.hw_tflops_per_device:.1f} with recomputation), MFU {100 * best.mfu:.1f}%, "
             f"bubble {best.bubble_fraction:.3f}, exposed communication {seconds(best.exposed_comm_s)}",
             f"  memory per device (GB): params {gb(mem['params'])}  grads {gb(mem['grads'])}  optimizer "
             f"{gb(mem['optimizer'])}  activations {gb(mem['activations'])}  total {gb(best.peak_memory_bytes)} "
             f"(budget {gb(_budget(args, cluster))})"]
    gaps = runtime_gaps(c)
    lines.append("  runtime: autopar builds this plan" if not gaps else
                 "  runtime: a prediction only; autopar's runtime does not yet build " + ", ".join(gaps))
    if others:
        lines.append(f"alternatives (top {len(others)}):")
        lines.append(f"  {'dp':>4} {'tp':>3} {'pp':>3} {'ZeRO':>4} {'mb':>3} {'sched':>11} {'recompute':>9} "
                     f"{'step':>9} {'memory':>9}  why not")
        for o in others:
            k = o.config
            lines.append(f"  {k.dp:>4} {k.tp:>3} {k.pp:>3} {k.zero_stage:>4} {k.micro_batch:>3} {k.schedule:>11} "
                         f"{k.recompute:>9} {seconds(o.step_time_s):>9} {o.peak_memory_bytes / 1e9:>6.1f} GB  "
                         f"{o.reason}")
    return "\n".join(lines)


def _hybrid_extras(args, facts, cluster, best, others) -> None:
    """--timeline: the chosen plan's simulated schedule as SVG."""
    if args.timeline:
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import write_timeline
        sim = timeline_of(facts, cluster, best.config, batch=args.batch)
        c = best.config
        write_timeline(sim, args.timeline, title=f"{facts.layers} layers, dp={c.dp} tp={c.tp} pp={c.pp}, "
                                                 f"{c.schedule}, {best.microbatches} micro-batches")
        _progress(args, f"wrote {args.timeline}")
    if args.report:
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import timeline_svg
        from autopar.report import write_report
        c = best.config
        svg = timeline_svg(timeline_of(facts, cluster, c, batch=args.batch), title="simulated pipeline schedule")
        per = facts.layers // (c.pp * c.virtual)
        stages = [{"stage": s, "device": s % c.pp, "layers": f"{s * per}-{(s + 1) * per - 1}",
                   "time_s": best.parts["stage_fwd_s"][s] + best.parts["stage_bwd_s"][s],
                   "memory_bytes": best.peak_memory_bytes} for s in range(c.pp * c.virtual)] if c.pp > 1 else []
        plan = {"model": facts.gm.__class__.__name__, **_hybrid_json(_Named(args.model), cluster, args, best, others,
                                                                    0.0, 0)}
        write_report(args.report, title=f"autopar plan: {args.model} on {cluster.name}", plan=plan,
                     alternatives=[o.as_dict() | {"reason": o.reason} for o in others], timeline_svg=svg,
                     block_rows=_block_rows(facts, cluster, c), stages=stages,
                     notes=[f"{_HYBRID_HELP}; attention priced as {facts.attention}",
                            "alternatives are the best variant of each other layout"])
        _progress(args, f"wrote {args.report}")


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


def _block_rows(facts, cluster, c) -> list[dict]:
    """The first layer's ops with the tensor layout the plan gives them."""
    from autopar.passes.meta import info
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


def _simulate(args: argparse.Namespace) -> int:
    """``autopar simulate``: score one fixed configuration with the planner's simulator."""
    import json

    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import Config, simulate
    from autopar.workload import capture_workload, load_workload, parse_overrides

    cluster = Cluster.from_spec(args.cluster, hardware=args.hardware)
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set))
    gm = capture_workload(w)
    facts = _hybrid_facts(args, gm)
    tp, pp = args.tp, args.pp
    dp = args.dp or cluster.world_size // (tp * pp)
    if dp * tp * pp != cluster.world_size:
        raise ConfigError(f"dp x tp x pp = {dp * tp * pp} is not the cluster's {cluster.world_size} devices",
                          where="autopar simulate", fix="pick degrees whose product is the device count")
    c = Config(dp=dp, tp=tp, pp=pp, micro_batch=args.micro_batch_size, schedule=args.schedule,
               virtual=args.virtual_stages, recompute=args.recompute, zero_stage=args.zero)
    t0 = time.perf_counter()
    score = simulate(facts, cluster, c, batch=args.batch, budget=_budget(args, cluster))
    data = {"model": w.name, "cluster": cluster.name, "devices": cluster.world_size, "batch": args.batch,
            "seq": args.seq, "dtype": args.dtype, **score.as_dict(), "planner_time_s": time.perf_counter() - t0,
            "alternatives": []}
    if args.timeline:
        from autopar.cost.hybrid import timeline_of
        from autopar.cost.timeline import write_timeline
        write_timeline(timeline_of(facts, cluster, c, batch=args.batch), args.timeline)
    sys.stdout.write(json.dumps(data, indent=1) + "\n")
    return 0


def _positive_int(text: str, flag: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{flag} takes 'auto' or a positive integer", where=flag, got=text,
                          fix=f"e.g. {flag} 4")
    return int(text)


def _progress(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)
