"""The ``autopar`` command line: ``dump`` an annotated graph, ``plan`` data and tensor
parallelism for a cluster, ``models``, ``calibrate``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from autopar.cli import checks
from autopar.cli.checks import count, parse_mesh
from autopar.cli.hybrid import emit_plan, moe_arguments, plan_command, positive_int, say, simulate_command
from autopar.core.errors import AutoparError, ConfigError, DoesNotFitError, UnsupportedError


def _dump(args: argparse.Namespace) -> int:
    from autopar.cli.dump import render
    from autopar.cli.workload import capture_workload, load_workload, parse_overrides
    mesh = parse_mesh(args.mesh) if args.mesh else None
    checks.output_file(args.out, "--out")
    if args.after and mesh is None:
        raise ConfigError(f"--after {args.after} needs --mesh", where="autopar dump",
                          expected="--mesh AXIS=SIZE with --after", got=f"--after {args.after} without --mesh",
                          fix=f"add e.g. --mesh tp=4 (or drop --after {args.after})")
    sequence = _sequence_parallel(args, mesh or {})
    checks.device(args.device)
    start = time.perf_counter()
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set),
                      device=args.device)
    say(args, f"built {w.name} on {args.device} in {time.perf_counter() - start:.1f}s; capturing …")
    parallel = None
    hardware = _dump_hardware(args) if mesh is not None else None
    if hardware is not None:
        say(args, f"pricing the mesh for {hardware}")
    if mesh is None:
        gm = capture_workload(w)
        say(args, f"captured and analysed {len(gm.graph.nodes)} nodes in {time.perf_counter() - start:.1f}s")
    elif "pp" in mesh:
        gm, parallel = _split_view(args, w, mesh, sequence)
        say(args, f"captured, analysed and split {len(gm.graph.nodes)} nodes into "
                  f"{len(parallel['stages'])} stages in {time.perf_counter() - start:.1f}s")
    else:
        from autopar.build.prepare import planned_graph
        after = args.after or "plan"
        if after == "split":
            raise ConfigError("--after split needs a pp axis in --mesh", where="autopar dump",
                              got=f"--mesh {args.mesh}", fix="e.g. --mesh pp=4 or --mesh pp=2,tp=4")
        # dims=() (not None) keeps a user model without dims a static capture, as plain dump does.
        gm, plan = planned_graph(w.model, mesh, w.args, dims=w.dims if w.dims is not None else (),
                                 sizes=w.sizes, after=after, zero_stage=args.zero, overlap=not args.no_overlap,
                                 bucket_bytes=args.bucket_bytes, hardware=args.hardware,
                                 sequence_parallel=sequence)
        parallel = {"mesh": dict(plan.mesh), "after": after, "predicted": dict(plan.predicted),
                    "zero_stage": plan.zero_stage, "overlap": plan.overlap}
        say(args, f"captured, analysed and planned ({after}) {len(gm.graph.nodes)} nodes on "
                  f"{','.join(f'{k}={v}' for k, v in mesh.items())} in {time.perf_counter() - start:.1f}s")
    if parallel is not None:
        parallel["hardware"] = hardware
    text = render(gm, w.sizes, args.format, model=w.name, nodes=not args.summary, parallel=parallel,
                  fold=not args.unfold)
    if args.out:
        checks.write_text(args.out, text + "\n", "--out")
        say(args, f"wrote {args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _sequence_parallel(args: argparse.Namespace, mesh: dict[str, int]) -> bool | None:
    """``--sequence-parallel`` as ``sequence_parallel=``: None for auto; on or off needs a tp axis
    (checked before anything is built, whatever the mesh: never silently dropped)."""
    choice = getattr(args, "sequence_parallel", "auto")
    if choice == "auto":
        return None
    if mesh.get("tp", 1) < 2:
        raise ConfigError(f"--sequence-parallel {choice} needs a tensor axis", where="autopar dump",
                          got=f"--mesh {args.mesh}" if args.mesh else "no --mesh",
                          fix="add one, e.g. --mesh tp=2, or leave --sequence-parallel out")
    return choice == "on"


def _dump_hardware(args: argparse.Namespace) -> str:
    """What ``dump --mesh`` prices with, for every mesh alike: ``--hardware``, else this machine's
    kind (h100 with a GPU, cpu without). Set on ``args.hardware``; returned as ``SPEC (device)``."""
    import torch

    from autopar.cost.cluster import Cluster
    args.hardware = args.hardware or ("h100" if torch.cuda.is_available() else "cpu")
    device = Cluster.from_spec("1x1", hardware=args.hardware).device.name
    return args.hardware if device == args.hardware else f"{args.hardware} ({device})"


def _split_view(args: argparse.Namespace, w, mesh: dict[str, int], sequence: bool | None):
    """The graph with every op's pipeline stage, and the pipeline summary for the dump."""
    from autopar.build.prepare import planned_graph
    from autopar.core.mesh import pipeline_axes
    from autopar.cost.pp_planner import split_view, stage_table
    from autopar.cli.workload import capture_workload

    if args.after not in (None, "split"):
        raise ConfigError(f"with a pp axis, dump shows the graph after split, not after {args.after}",
                          where="autopar dump", got=f"--after {args.after}", fix="use --after split (or leave it out)")
    pipeline_axes(mesh)
    hardware = args.hardware        # set by _dump_hardware
    if mesh.get("tp", 1) > 1:
        gm, _ = planned_graph(w.model, {"tp": mesh["tp"]}, w.args, dims=w.dims if w.dims is not None else (),
                              sizes=w.sizes, after="rewrite", hardware=hardware,
                              sequence_parallel=sequence)
    else:
        gm = capture_workload(w)
    batch = max(1, args.batch // mesh.get("dp", 1))
    best, costs = split_view(gm, mesh, batch=batch, sizes=w.sizes, hardware=hardware, schedule=args.schedule,
                             microbatches=args.microbatches, virtual=args.virtual_stages)
    parallel = {"mesh": dict(mesh), "after": "split", "predicted": {"step_time_s": best.step_time_s},
                "pipeline": best.as_dict(), "stages": stage_table(best, costs)}
    return gm, parallel


def _microbatches(flag: str):
    return count(flag, high=checks.MAX_EVENT_MICROBATCHES,
                 why="the pipeline's event simulation runs every micro-batch; published pipelines run a few hundred")


def _version() -> str:
    from autopar import __version__
    return __version__


def _plan(args: argparse.Namespace) -> int:
    """Pick dp x tp and the ZeRO stage for a model on a (possibly imaginary) cluster."""
    from autopar.cost.dp_planner import plan_dp
    from autopar.cli.workload import capture_for_planning, capture_workload, load_workload, parse_overrides
    for flag, path in (("--report", args.report), ("--save-plan", args.save_plan), ("--timeline", args.timeline)):
        checks.output_file(path, flag)
    cluster = checks.cluster(args.cluster, args.hardware)
    mixed = None if args.dtype == "fp32" else args.dtype
    stages = (0, 1, 2, 3) if args.zero == "auto" else (int(args.zero),)
    tp = None if args.tp == "auto" else (positive_int(args.tp, "--tp"),)
    pp = None if args.pp == "auto" else positive_int(args.pp, "--pp")
    budget = None if args.memory_budget is None else args.memory_budget * 1e9
    start = time.perf_counter()
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set))
    if args.pp == "auto":   # the joint search reads one block's figures: fewer layers do (workload.py)
        planned = capture_for_planning(w)
        say(args, f"built and captured {w.name} ({planned.describe()}) in {time.perf_counter() - start:.1f}s; "
                        f"planning for {cluster.name} …")
        return plan_command(args, w, planned, cluster, start)
    gm = capture_workload(w)
    say(args, f"built and captured {w.name} ({len(gm.graph.nodes)} nodes) in {time.perf_counter() - start:.1f}s;"
                    f" planning for {cluster.name} …")
    args.pp = pp
    if args.pp > 1:
        return _plan_pipeline(args, w, gm, cluster, tp[0] if tp else 1)
    if args.timeline:
        raise ConfigError("--timeline draws a pipeline schedule", where="autopar plan", got="--pp 1",
                          fix="add --pp N (pipeline stages), e.g. --pp 4")
    t0 = time.perf_counter()
    result = plan_dp(gm, cluster=cluster, devices=cluster.world_size, batch=args.batch, sizes=w.sizes,
                     memory_budget=budget, zero_stages=stages, tp_degrees=tp, mixed_precision=mixed,
                     optimizer=args.optimizer)
    planner_s = time.perf_counter() - t0
    say(args, f"planned {(result.best is not None) + len(result.alternatives)} configurations "
                    f"in {planner_s:.1f}s")
    if result.best is None:
        raise _infeasible(args, cluster, result)
    experts = _expert_choices(gm, cluster, result, w.sizes, args.batch, mixed)
    return emit_plan(args, w.name, cluster, _dp_outcome(args, w, gm, cluster, result, experts, planner_s))


def _model_flops(gm, sizes, batch: int) -> float:
    """Forward + backward FLOPs of one step at global ``batch`` (no recomputation)."""
    from autopar.summary import at, totals
    t = totals(gm)
    return float(at(t.flops_fwd + t.flops_bwd, {**dict(sizes or {}), "batch": batch}))


def _as_score(config, *, step_s: float, microbatches: int, model_flops: float, devices: int, peak_flops: float,
              memory: dict, peak_bytes: float, bubble: float, exposed_s: float, fits: bool, parts: dict,
              reason: str = ""):
    """A planner's choice as the joint search's Score (cost/hybrid.py), for the one output contract."""
    from autopar.cost.hybrid import Score
    tput = model_flops / step_s / devices if step_s > 0 else 0.0
    return Score(config=config, step_time_s=step_s, microbatches=microbatches, model_flops=model_flops,
                 hw_flops=model_flops, tflops_per_device=tput / 1e12, hw_tflops_per_device=tput / 1e12,
                 mfu=tput / peak_flops if peak_flops else 0.0, peak_memory_bytes=peak_bytes, memory=dict(memory),
                 bubble_fraction=bubble, exposed_comm_s=exposed_s, fits=fits, parts=dict(parts), reason=reason)


def _dp_outcome(args: argparse.Namespace, w, gm, cluster, result, experts, planner_s: float):
    """``--pp 1``: the dp x tp x ZeRO planner's choice (cost/dp_planner.py) as a PlanOutcome."""
    from autopar.cli.hybrid import PlanOutcome
    from autopar.cost.dp_planner import seconds as _ms
    from autopar.core.plans import Config
    devices = result.devices
    flops = _model_flops(gm, w.sizes, args.batch)
    peak = cluster.device.peak("fp32" if args.dtype == "fp32" else args.dtype)
    ep = experts[0].ep if experts else 1

    def score(ch, ep: int = 1):
        c = Config(dp=ch.dp, tp=ch.tp, pp=1, micro_batch=ch.micro_batch, schedule="gpipe", virtual=1,
                   recompute="none", zero_stage=ch.zero_stage, ep=ep)
        return _as_score(c, step_s=ch.step_time_s, microbatches=max(1, args.batch // (ch.dp * ch.micro_batch)),
                         model_flops=flops, devices=devices, peak_flops=peak, memory=ch.memory.as_dict(),
                         peak_bytes=ch.memory.total, bubble=0.0, exposed_s=ch.exposed_comm_s, fits=ch.fits,
                         parts={"compute_s": ch.compute_s, "tp_comm_s": ch.tp_comm_s, "dp_comm_s": ch.dp_comm_s},
                         reason=ch.reason)
    b = result.best
    details = [f"step time {_ms(b.step_time_s)} = compute {_ms(b.compute_s)} + tp communication "
               f"{_ms(b.tp_comm_s)} + exposed dp communication {_ms(b.exposed_comm_s)} (of {_ms(b.dp_comm_s)}); "
               f"gradient buckets {b.bucket_bytes / 2**20:.1f} MiB; buffers {b.memory.buffers / 1e9:.2f} GB"]
    notes = ["the dp x tp x ZeRO planner (cost/dp_planner.py): no pipeline, no recomputation, the whole per-rank "
             "batch in one micro-batch; model TFLOP/s and MFU from the captured graph's FLOPs",
             f"alternatives: {min(args.top, len(result.alternatives))} shown of {len(result.alternatives)} other "
             f"dp x tp x ZeRO configurations"]
    if experts:
        notes.append(f"experts: {experts[0].mode} (ep={experts[0].ep}) chosen on top of dp={b.dp} tp={b.tp}; its "
                     f"all-to-all is priced in the experts table, not in the step time above")
    return PlanOutcome(mode="1", search="dp x tp x ZeRO (no pipeline)", best=score(b, ep),
                       others=[score(a) for a in result.alternatives[:args.top]], planner_s=planner_s,
                       scored=(result.best is not None) + len(result.alternatives), budget=result.memory_budget,
                       details=details, detail_data={"bucket_bytes": b.bucket_bytes, "compute_s": b.compute_s,
                                                     "tp_comm_s": b.tp_comm_s, "dp_comm_s": b.dp_comm_s},
                       notes=notes, none_why="no other dp x tp x ZeRO configuration",
                       experts={"chosen": experts[0].as_dict(), "alternatives": [c.as_dict() for c in experts[1:]]}
                       if experts else None, experts_text=_experts_text(experts) if experts else "",
                       block_rows=lambda: _graph_block_rows(gm, b.tp), dp_grad_numel=_trainable_numel(gm) / b.tp)


def _trainable_numel(gm) -> float:
    """The captured graph's parameter entries (the data-axis modes' price divides them by tp:
    a rough share, tensor-replicated parameters counted split)."""
    from autopar.core.meta import evaluate, info
    return sum(float(evaluate(info(n).values[0].numel, {})) for n in gm.graph.nodes
               if n.op == "placeholder" and info(n).kind == "param")


def _graph_block_rows(gm, tp: int) -> list[dict]:
    """The first block's ops, with the placement the graph records (replicated without tp)."""
    from autopar.core.meta import info
    rows, first = [], None
    for n in gm.graph.nodes:
        rec = info(n)
        if n.op != "call_function" or rec.block_member is None:
            continue
        first = first or rec.block_member
        if rec.block_member != first:
            break
        rows.append({"name": n.name, "op": str(getattr(n.target, "__name__", n.target)), "module": rec.fqn,
                     "shape": " ".join(str(tuple(v.shape)) for v in rec.values[:1]),
                     "placement": rec.placement or ("R" if tp == 1 else "-"),
                     "collective": rec.strategy or ""})
    return rows


def _expert_choices(gm, cluster, result, sizes, batch: int, mixed):
    """For a mixture-of-experts model: how to split the experts on top of the chosen dp x tp
    (expert parallelism over a divisor of dp, tp inside the experts, or both). The experts may
    use the memory the chosen plan gives them, in proportion to their share of the parameters."""
    from autopar.cost.ep_planner import plan_experts
    from autopar.core.meta import evaluate, graph_info, info

    regions = graph_info(gm).moe_regions
    if not regions:
        return []
    b = result.best
    at = {**dict(sizes or {}), "batch": b.micro_batch}
    numel = {info(n).target_fqn: float(evaluate(info(n).values[0].numel, at))
             for n in gm.graph.nodes if n.op == "placeholder" and info(n).kind == "param"}
    share = sum(numel.get(f, 0.0) for r in regions for f in r.expert_params) / max(sum(numel.values()), 1.0)
    budget = result.memory_budget - b.memory.total + share * (b.memory.params + b.memory.grads + b.memory.optimizer)
    return plan_experts(gm, cluster=cluster, dp=b.dp, tp=b.tp, sizes=at, budget=budget, zero_stage=b.zero_stage,
                        dtype="fp32" if mixed is None else mixed)


def _experts_text(choices) -> str:
    from autopar.cost.dp_planner import seconds as _ms
    best = choices[0]
    lines = [f"experts: {best.mode} (ep={best.ep}{', tp inside experts' if best.tp_inside else ''}): "
             f"expert compute {_ms(best.compute_s)} + all-to-all {_ms(best.all_to_all_s)} + tp all-reduce "
             f"{_ms(best.tp_comm_s)} + imbalance {_ms(best.imbalance_s)}; expert state "
             f"{best.state_bytes / 1e9:.2f} GB per device",
             f"  {'mode':<10} {'ep':>3} {'time':>10} {'all-to-all':>11} {'state':>9}  why not"]
    for c in choices[1:]:
        lines.append(f"  {c.mode:<10} {c.ep:>3} {_ms(c.time_s):>10} {_ms(c.all_to_all_s):>11} "
                     f"{c.state_bytes / 1e9:>6.2f} GB  {c.reason}")
    return "\n".join(lines)


def _plan_pipeline(args: argparse.Namespace, w, gm, cluster, tp: int) -> int:
    """``autopar plan --pp N``: stages, schedule and micro-batches for N pipeline stages (the
    remaining devices / tp are data-parallel replicas), with the simulated timeline."""
    from autopar.cli.hybrid import PlanOutcome, drawable
    from autopar.cost.comm import collective_time
    from autopar.core.plans import Config
    from autopar.cost.timeline import timeline_svg, write_timeline
    from autopar.cli.dump import human
    from autopar.build.prepare import planned_graph
    from autopar.cost.pp_planner import simulate_plan, split_view, stage_table

    devices = cluster.world_size
    if devices % (args.pp * tp):
        raise ConfigError(f"{devices} devices do not split into pp={args.pp} x tp={tp}", where="autopar plan",
                          got=f"--cluster {args.cluster}", fix="pick --pp and --tp whose product divides the devices")
    dp = devices // (args.pp * tp)
    if args.batch % dp:
        raise ConfigError(f"the global batch {args.batch} does not split over dp={dp}", where="--batch",
                          fix=f"use a batch that is a multiple of {dp}")
    mesh = {"pp": args.pp, **({"dp": dp} if dp > 1 else {}), **({"tp": tp} if tp > 1 else {})}
    flops = _model_flops(gm, w.sizes, args.batch)      # the whole model's, before any tensor-axis rewrite
    t0 = time.perf_counter()
    if tp > 1:
        gm, _ = planned_graph(w.model, {"tp": tp}, w.args, dims=w.dims if w.dims is not None else (), sizes=w.sizes,
                              after="rewrite", hardware=args.hardware)
    budget = None if args.memory_budget is None else args.memory_budget * 1e9
    best, costs = split_view(gm, mesh, batch=args.batch // dp, sizes=w.sizes, hardware=args.hardware,
                             schedule=args.schedule, microbatches=args.microbatches, virtual=args.virtual_stages,
                             budget=budget)
    planner_s = time.perf_counter() - t0
    rows = stage_table(best, costs)
    p2p = lambda b: collective_time("send_recv", b, cluster, tuple(mesh.items()), "pp")  # noqa: E731
    sims = []

    def sim():
        if not sims:
            sims.append(simulate_plan(costs, best.cuts, schedule=best.schedule, devices=best.devices,
                                      virtual=best.virtual, microbatches=best.microbatches, p2p_time=p2p,
                                      zb_overhead=cluster.device.zb_split_overhead))
        return sims[0]
    title = f"{w.name} on {cluster.name}: pp={args.pp} {best.schedule}, {best.microbatches} micro-batches"
    if args.timeline:
        checks.writing("--timeline", args.timeline, lambda: write_timeline(
            sim(), args.timeline, title=f"{title}, bubble {sim().bubble_fraction:.3f}"))
        say(args, f"wrote {args.timeline}")
    # memory per device: its stages' state (fp32 parameters, gradients and two optimizer moments:
    # passes/pp_split.py) and the activations the schedule keeps in flight on it
    state = [sum(r["state_bytes"] for r in rows if r["device"] == d) for d in range(best.devices)]
    acts = list(best.peak_activation_bytes) + [0.0] * best.devices
    mems = [{"params": state[d] / 4, "grads": state[d] / 4, "optimizer": state[d] / 2, "activations": acts[d]}
            for d in range(best.devices)]
    worst = max(range(best.devices), key=lambda d: sum(mems[d].values()))
    peak = sum(mems[worst].values())
    m = best.microbatches
    config = Config(dp=dp, tp=tp, pp=args.pp, micro_batch=args.batch // dp // m, schedule=best.schedule,
                    virtual=best.virtual, recompute="none", zero_stage=0)
    score = _as_score(config, step_s=best.step_time_s, microbatches=m, model_flops=flops, devices=devices,
                      peak_flops=cluster.device.peak("fp32"), memory=mems[worst], peak_bytes=peak,
                      bubble=best.bubble_fraction, exposed_s=0.0, fits=budget is None or peak <= budget,
                      parts={"pipeline_s": best.step_time_s, "stage_time_s": list(best.cuts.stage_time_s)})
    stages = [{**r, "layers": f"from {r['first']} ({r['ops']} ops)", "memory_bytes": sum(mems[r["device"]].values()),
               "detail": f"state {human(r['state_bytes'], 'B')}, activations {human(r['activation_bytes'], 'B')} "
                         f"per micro-batch, sends {human(r['sends_bytes'], 'B')}"} for r in rows]
    notes = [f"the pipeline planner (cost/pp_planner.py) for exactly pp={args.pp}: stage cuts, schedule and micro-batch "
             f"count; dp={dp} and tp={tp} are fixed" + (" (--tp auto means tp=1 with --pp N)" if args.tp == "auto"
                                                       else ""),
             "priced in fp32 with the state of fp32 parameters, gradients and two optimizer moments, no ZeRO, "
             "no recomputation" + (f" (--dtype {args.dtype} and --optimizer {args.optimizer} are not used)"
                                   if args.dtype != "fp32" or args.optimizer != "adamw" else ""),
             "the step time is the pipeline's: the data-axis gradient reduction and the optimizer step are not "
             "priced (exposed communication 0)",
             f"priced on one node of {devices} {cluster.device.name}" + (f" (--cluster {args.cluster} has "
                                                                          f"{cluster.nodes} nodes)"
                                                                          if cluster.nodes > 1 else "")]
    if args.zero not in ("auto", "0"):
        notes.append(f"--zero {args.zero} is not used by --pp N (no ZeRO)")

    def svg() -> str:
        drawable(m, "--report")
        return timeline_svg(sim(), title=title)
    out = PlanOutcome(mode=str(args.pp), search=f"pipeline of {args.pp} stages: cuts, schedule and micro-batches",
                      best=score, others=[], planner_s=planner_s, scored=None,
                      budget=budget if budget is not None else cluster.device.memory_bytes, stages=stages,
                      detail_data={"stage_starts": list(best.cuts.start_nodes),
                                                    "stage_time_s": list(best.cuts.stage_time_s)},
                      notes=notes, none_why="--pp N plans one layout; --pp auto compares layouts",
                      timeline_svg=svg, block_rows=lambda: _graph_block_rows(gm, tp),
                      dp_modes_why="--pp N does not price the data axis (see notes)")
    return emit_plan(args, w.name, cluster, out)


def _infeasible(args: argparse.Namespace, cluster, result) -> DoesNotFitError:
    leanest = min(result.alternatives, key=lambda c: c.memory.total)
    more = (f"{result.smallest_devices} devices would fit global batch {args.batch}"
            if result.smallest_devices else f"no device count up to 4096 fits global batch {args.batch}")
    mb, at = result.largest_micro_batch, result.largest_micro_batch_degrees
    fewer = (f"on {result.devices} devices a per-rank batch of at most {mb} fits (dp={at[0]} tp={at[1]})" if mb
             else f"on {result.devices} devices not even a per-rank batch of 1 fits")
    return DoesNotFitError(f"no dp x tp x ZeRO configuration of {args.model} fits in "
                           f"{checks.gb_text(result.memory_budget)} GB per device on {cluster.name}", where="autopar plan",
                           smallest_devices=result.smallest_devices,
                           expected=f"per-device memory <= {checks.gb_text(result.memory_budget)} GB",
                           got=f"the leanest (dp={leanest.dp} tp={leanest.tp} ZeRO-{leanest.zero_stage}) needs "
                               f"{checks.gb_text(leanest.memory.total)} GB",
                           fix=f"{more}; {fewer}" + ("; or raise --memory-budget" if args.dtype != "fp32"
                                                      else "; or raise --memory-budget, or train with --dtype bf16"))


def _models(args: argparse.Namespace) -> int:
    from autopar import models
    for name in models.list_models():
        cfg = models.get_config(name)
        print(f"{name:<16} {models.param_count(cfg) / 1e9:9.3f}B params  {type(cfg).__name__}")
    try:
        shipped = models.list_hf_configs()
        for name in shipped:
            cfg = models.get_config(name)
            print(f"{name:<24} {models.param_count(cfg) / 1e9:9.3f}B params  {cfg.model_type} (transformers)")
    except UnsupportedError:  # transformers is not installed: no hf: models
        pass
    return 0


_MODEL_HELP = ("zoo name (see `autopar models`), path/to/file.py:factory, or a Hugging Face config built on the "
               "meta device without weights: hf:DIR (a transformers config.json), hf:NAME (one shipped with "
               "autopar, e.g. hf:llama3-405b) or hf:MODEL_TYPE (the library's default, e.g. hf:mixtral)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization for PyTorch training.")
    p.add_argument("--version", action="version", version=f"autopar {_version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="log every pass")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("dump", help="print the annotated graph of a model")
    d.add_argument("--model", required=True, help=_MODEL_HELP)
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    d.add_argument("--batch", type=count("--batch"), default=1, help="global batch size to evaluate at (default 1)")
    d.add_argument("--seq", type=count("--seq"), default=128, help="sequence length to evaluate at (default 128)")
    d.add_argument("--format", choices=["text", "json", "dot"], default="text",
                   help="text (default), json, or dot (Graphviz; each repeated block, e.g. the transformer "
                        "layers, is folded into one node labelled like `layers.0 ×32`: see --unfold)")
    d.add_argument("--unfold", action="store_true",
                   help="with --format dot: one node per op, every copy of every block (large: ~1,900 nodes "
                        "for llama3-8b)")
    d.add_argument("--summary", action="store_true", help="totals and modules only, no per-node lines")
    d.add_argument("--device", default="meta", help="where to build the model (default meta: allocates nothing)")
    d.add_argument("--mesh", metavar="AXIS=SIZE[,AXIS=SIZE]",
                   help="plan on this mesh and show each node's strategy and placement: axes dp and/or tp "
                        "(dp first, e.g. dp=2,tp=4), or a pipeline, pp first (e.g. pp=4 or pp=2,tp=4: each op's "
                        "stage and the stage table)")
    d.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="with a dp axis: this ZeRO stage (default: the lowest that fits the device memory)")
    d.add_argument("--no-overlap", action="store_true",
                   help="with --after schedule: leave every issue next to its wait (no overlap)")
    d.add_argument("--bucket-bytes", type=count("--bucket-bytes", low=0), default=0,
                   help="gradient/gather bucket size in bytes (default: from the cost model)")
    d.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb", "dualpipev"],
                   help="with a pp axis: the pipeline schedule (default: the simulator's choice)")
    d.add_argument("--microbatches", type=_microbatches("--microbatches"),
                   help="with a pp axis: micro-batches per step (default: chosen)")
    d.add_argument("--virtual-stages", type=count("--virtual-stages"),
                   help="with a pp axis: stages per device (interleaved)")
    d.add_argument("--after", choices=["plan", "rewrite", "schedule", "split"],
                   help="with --mesh: show the graph after planning (default), the per-rank graph after "
                        "the rewrite (tensor-axis collectives with their predicted cost), or after the "
                        "schedule pass (data-axis buckets too, with their issue and wait positions); with a "
                        "pp axis, after the pipeline split (each op's stage, and the stage table)")
    d.add_argument("--sequence-parallel", choices=["auto", "on", "off"], default="auto",
                   help="with a tp axis: split activations along the sequence (on), keep them whole along it "
                        "(off), or let the cost model choose value by value (auto, the default)")
    d.add_argument("--hardware",
                   help="with --mesh: price the plan for v100, a10g, l4, l40s, a100, h100, h200, b200, mi300x, cpu "
                        "or a profile from `autopar calibrate` "
                        "(default: this machine's kind, h100 with a GPU and cpu without; the same for every "
                        "mesh, pp included; the output says which it priced with)")
    d.add_argument("--out", help="write to this file instead of stdout")
    d.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines nor warnings on stderr (errors still print)")
    d.set_defaults(fn=_dump)

    pl = sub.add_parser("plan", help="pick dp x tp x pp x ep, ZeRO, recomputation, micro-batches and schedule "
                        "for a cluster (--pp)")
    pl.add_argument("--model", required=True, help=_MODEL_HELP)
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    pl.add_argument("--cluster", required=True, metavar="NODESxGPUS", help="e.g. 1x8 or 4x8")
    pl.add_argument("--hardware", default="h100",
                    help="v100, a10g, l4, l40s, a100, h100, h200, b200, mi300x, cpu "
                         "or a profile from `autopar calibrate`")
    pl.add_argument("--batch", type=count("--batch"), required=True,
                    help="global batch size (split over the data axis)")
    pl.add_argument("--seq", type=count("--seq"), required=True, help="sequence length")
    pl.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16",
                    help="bf16 (default) or fp16 mixed precision (16-bit compute, fp32 master weights), or fp32; "
                         "the same default as simulate")
    pl.add_argument("--memory-budget", type=checks.gigabytes("--memory-budget"), metavar="GB",
                    help="bytes per device in decimal GB (default: the device's memory)")
    moe_arguments(pl)
    pl.add_argument("--zero", choices=["auto", "0", "1", "2", "3"], default="auto",
                    help="ZeRO stage (default auto; --pp N plans without ZeRO)")
    pl.add_argument("--tp", default="auto", help="tensor-parallel degree, exactly (it must divide the devices), "
                    "or auto (default: powers of two within a node; with --pp N, auto means 1)")
    pl.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd-momentum, ...")
    pl.add_argument("--pp", default="auto",
                    help="auto (default): search dp x tp x pp x ep, ZeRO, recomputation, micro-batches and "
                         "schedule jointly; 1: dp x tp x ZeRO only (and the expert split of a MoE model); N: "
                         "exactly N pipeline stages (cuts, schedule, micro-batches; dp = devices / (N x tp), "
                         "priced in fp32 without ZeRO). Every mode prints the same layout and --json keys")
    pl.add_argument("--report", metavar="OUT.html",
                    help="also write the plan as one HTML page (any --pp: planner time, stage map with each "
                         "stage's memory, alternatives, notes)")
    pl.add_argument("--save-plan", metavar="PLAN.json",
                    help="also write the chosen configuration as JSON, for `autopar train --plan` (any --pp)")
    pl.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb", "dualpipev"],
                    help="with --pp N: the pipeline schedule (default: the simulator's choice)")
    pl.add_argument("--microbatches", type=_microbatches("--microbatches"),
                    help="with --pp N: micro-batches per step (default: chosen)")
    pl.add_argument("--virtual-stages", type=count("--virtual-stages"),
                    help="with --pp N: stages per device (interleaved)")
    pl.add_argument("--timeline", metavar="OUT.svg",
                    help="draw the chosen plan's simulated pipeline schedule to this SVG file (--pp auto or N)")
    pl.add_argument("--json", action="store_true",
                    help="print one JSON object (the same keys for every --pp)")
    pl.add_argument("--top", type=count("--top", low=0, high=1000, why="a page of alternatives"), default=5,
                    metavar="K", help="alternatives to show (default 5)")
    pl.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines nor warnings on stderr (errors still print)")
    pl.set_defaults(fn=_plan)

    sm = sub.add_parser("simulate", help="score one fixed configuration with the planner's simulator "
                        "(step terms and memory; --json)")
    sm.add_argument("--model", required=True, help=_MODEL_HELP)
    sm.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    sm.add_argument("--cluster", required=True, metavar="NODESxGPUS")
    sm.add_argument("--hardware", default="h100",
                    help="v100, a10g, l4, l40s, a100, h100, h200, b200, mi300x, cpu "
                         "or a profile from `autopar calibrate`")
    sm.add_argument("--batch", type=count("--batch"), required=True, help="global batch size")
    sm.add_argument("--seq", type=count("--seq"), required=True)
    sm.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16",
                    help="bf16 (default) or fp16 mixed precision, or fp32; the same default as plan")
    sm.add_argument("--optimizer", default="adamw")
    sm.add_argument("--memory-budget", type=checks.gigabytes("--memory-budget"), metavar="GB")
    sm.add_argument("--tp", type=count("--tp", high=checks.MAX_DEVICES), default=1)
    sm.add_argument("--pp", type=count("--pp", high=checks.MAX_DEVICES), default=1)
    sm.add_argument("--dp", type=count("--dp", high=checks.MAX_DEVICES), help="default: devices / (cp * tp * pp)")
    sm.add_argument("--cp", type=count("--cp", high=checks.MAX_DEVICES), default=1,
                    help="context parallelism: ranks splitting each sequence (default 1)")
    sm.add_argument("--cp-kind", choices=["ring", "allgather", "alltoall"],
                    help="how attention crosses the cp ranks (default: the cheapest)")
    sm.add_argument("--ep", type=count("--ep", high=checks.MAX_DEVICES), default=1,
                    help="expert parallelism: ranks of the data axis dealing a MoE model's experts (default 1; divides "
                         "dp and experts; dropless layers fold the tensor axis in where ep x tp divides the experts)")
    sm.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    sm.add_argument("--shard-group", type=count("--shard-group", low=0, high=checks.MAX_DEVICES), default=0,
                    metavar="G", help="hybrid sharding (ZeRO-2/3): data ranks per group of replicated pieces (0: all)")
    sm.add_argument("--micro-batch-size", type=count("--micro-batch-size"), default=1,
                    help="samples per micro-batch (default 1); micro-batches = batch / (dp x this)")
    sm.add_argument("--schedule", choices=["1f1b", "interleaved", "gpipe", "zb", "dualpipev"], default="1f1b")
    sm.add_argument("--virtual-stages", type=count("--virtual-stages"), default=1)
    sm.add_argument("--recompute", default="none", metavar="none|selective|full|layers:K")
    sm.add_argument("--attention", choices=["flash", "materialized"], default="flash", help="flash, or scores written out")
    moe_arguments(sm)
    sm.add_argument("--timeline", metavar="OUT.svg", help="draw the simulated pipeline schedule to this SVG file")
    sm.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    sm.add_argument("-q", "--quiet", action="store_true", help="accepted for symmetry with plan (prints no progress)")
    sm.set_defaults(fn=simulate_command)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(fn=_models)

    sub.add_parser("train", help="train a small model on local CPU ranks under a plan (--plan PLAN.json, "
                   "scaled down) or one planned for them, loss beside the single-process loss (autopar train --help)")
    sub.add_parser("calibrate", help="measure this machine and write a hardware profile "
                   "(autopar calibrate --help)")
    return p


def _run_quietly(args: argparse.Namespace) -> int:
    """-q: autopar's warnings (an op without a sharding or memory rule, ...) stay silent too, not
    only the progress lines; errors still print. The logger's level is restored afterwards."""
    autopar_log = logging.getLogger("autopar")
    level = autopar_log.level
    autopar_log.setLevel(logging.ERROR)
    try:
        return args.fn(args)
    finally:
        autopar_log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own flags, parsed by autopar.cli.train
        from autopar.cli import train
        return train.command(argv[1:])
    if argv[:1] == ["calibrate"]:  # its own flags, parsed by autopar.cli.calibrate
        from autopar.cli import calibrate
        return calibrate.main(argv[1:])
    try:
        args = build_parser().parse_args(argv)     # a flag's type check raises a ConfigError
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="[autopar] %(name)s: %(message)s")
        return _run_quietly(args) if getattr(args, "quiet", False) and not args.verbose else args.fn(args)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
