"""The ``autopar`` command line: ``dump`` an annotated graph, ``plan`` data and tensor
parallelism for a cluster, ``models``, ``calibrate``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from autopar import cli_checks as checks
from autopar.cli_checks import count
from autopar.cli_hybrid import _plan_hybrid, _positive_int, _progress, _simulate
from autopar.errors import AutoparError, ConfigError, DoesNotFitError, UnsupportedError


def _dump(args: argparse.Namespace) -> int:
    from autopar.dump import render
    from autopar.workload import capture_workload, load_workload, parse_overrides
    mesh = parse_mesh(args.mesh) if args.mesh else None
    checks.output_file(args.out, "--out")
    if args.after and mesh is None:
        raise ConfigError(f"--after {args.after} needs --mesh", where="autopar dump",
                          expected="--mesh AXIS=SIZE with --after", got=f"--after {args.after} without --mesh",
                          fix=f"add e.g. --mesh tp=4 (or drop --after {args.after})")
    start = time.perf_counter()
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set),
                      device=args.device)
    _progress(args, f"built {w.name} on {args.device} in {time.perf_counter() - start:.1f}s; capturing …")
    parallel = None
    if mesh is None:
        gm = capture_workload(w)
        _progress(args, f"captured and analysed {len(gm.graph.nodes)} nodes in {time.perf_counter() - start:.1f}s")
    elif "pp" in mesh:
        gm, parallel = _split_view(args, w, mesh)
        _progress(args, f"captured, analysed and split {len(gm.graph.nodes)} nodes into "
                  f"{len(parallel['stages'])} stages in {time.perf_counter() - start:.1f}s")
    else:
        from autopar.prepare import planned_graph
        after = args.after or "plan"
        if after == "split":
            raise ConfigError("--after split needs a pp axis in --mesh", where="autopar dump",
                              got=f"--mesh {args.mesh}", fix="e.g. --mesh pp=4 or --mesh pp=2,tp=4")
        # dims=() (not None) keeps a user model without dims a static capture, as plain dump does.
        gm, plan = planned_graph(w.model, mesh, w.args, dims=w.dims if w.dims is not None else (),
                                 sizes=w.sizes, after=after, zero_stage=args.zero, overlap=not args.no_overlap,
                                 bucket_bytes=args.bucket_bytes, hardware=args.hardware)
        parallel = {"mesh": dict(plan.mesh), "after": after, "predicted": dict(plan.predicted),
                    "zero_stage": plan.zero_stage, "overlap": plan.overlap}
        _progress(args, f"captured, analysed and planned ({after}) {len(gm.graph.nodes)} nodes on "
                  f"{','.join(f'{k}={v}' for k, v in mesh.items())} in {time.perf_counter() - start:.1f}s")
    text = render(gm, w.sizes, args.format, model=w.name, nodes=not args.summary, parallel=parallel)
    if args.out:
        checks.write_text(args.out, text + "\n", "--out")
        _progress(args, f"wrote {args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _split_view(args: argparse.Namespace, w, mesh: dict[str, int]):
    """The graph with every op's pipeline stage, and the pipeline summary for the dump."""
    from autopar.prepare import planned_graph
    from autopar.pp import pipeline_axes, split_view, stage_table
    from autopar.workload import capture_workload

    if args.after not in (None, "split"):
        raise ConfigError(f"with a pp axis, dump shows the graph after split, not after {args.after}",
                          where="autopar dump", got=f"--after {args.after}", fix="use --after split (or leave it out)")
    pipeline_axes(mesh)
    hardware = args.hardware or "h100"
    if mesh.get("tp", 1) > 1:
        gm, _ = planned_graph(w.model, {"tp": mesh["tp"]}, w.args, dims=w.dims if w.dims is not None else (),
                              sizes=w.sizes, after="rewrite", hardware=hardware)
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


def parse_mesh(spec: str) -> dict[str, int]:
    """``"tp=4"`` or ``"name=size[,name=size]"`` -> ``{"tp": 4}`` (the API checks what is supported)."""
    mesh: dict[str, int] = {}
    for item in spec.split(","):
        name, eq, size = item.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name or not size.isdigit():
            raise ConfigError(f"--mesh takes name=size[,name=size], got {spec!r}", where="--mesh", got=spec,
                              fix="e.g. --mesh tp=4")
        if name in mesh:
            raise ConfigError(f"--mesh names axis {name!r} twice", where="--mesh", got=spec,
                              fix="name each mesh axis once, e.g. --mesh tp=4")
        mesh[name] = int(size)
    return mesh


def _version() -> str:
    from autopar import __version__
    return __version__


def _plan(args: argparse.Namespace) -> int:
    """Pick dp x tp and the ZeRO stage for a model on a (possibly imaginary) cluster."""
    import json

    from autopar.cost.dp_planner import plan_dp
    from autopar.workload import capture_for_planning, capture_workload, load_workload, parse_overrides
    for flag, given in (("--save-plan", args.save_plan), ("--report", args.report)):
        if given and args.pp != "auto":     # refused, not silently ignored
            raise ConfigError(f"{flag} writes the joint search's plan", where="autopar plan",
                              got=f"--pp {args.pp}", fix="drop --pp (the default, auto, searches every parallelism)")
    for flag, path in (("--report", args.report), ("--save-plan", args.save_plan), ("--timeline", args.timeline)):
        checks.output_file(path, flag)
    cluster = checks.cluster(args.cluster, args.hardware)
    mixed = None if args.dtype == "fp32" else args.dtype
    stages = (0, 1, 2, 3) if args.zero == "auto" else (int(args.zero),)
    tp = None if args.tp == "auto" else (_positive_int(args.tp, "--tp"),)
    pp = None if args.pp == "auto" else _positive_int(args.pp, "--pp")
    budget = None if args.memory_budget is None else args.memory_budget * 1e9
    start = time.perf_counter()
    w = load_workload(args.model, batch=args.batch, seq=args.seq, overrides=parse_overrides(args.set))
    if args.pp == "auto":   # the joint search reads one block's figures: fewer layers do (workload.py)
        planned = capture_for_planning(w)
        _progress(args, f"built and captured {w.name} ({planned.describe()}) in {time.perf_counter() - start:.1f}s; "
                        f"planning for {cluster.name} …")
        return _plan_hybrid(args, w, planned, cluster, start)
    gm = capture_workload(w)
    _progress(args, f"built and captured {w.name} ({len(gm.graph.nodes)} nodes) in {time.perf_counter() - start:.1f}s;"
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
    _progress(args, f"planned {(result.best is not None) + len(result.alternatives)} configurations "
                    f"in {planner_s:.1f}s")
    if result.best is None:
        raise _infeasible(args, cluster, result)
    experts = _expert_choices(gm, cluster, result, w.sizes, args.batch, mixed)
    if args.json:
        data = {"model": w.name, "cluster": cluster.name, "devices": result.devices, "batch": args.batch,
                "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer, **result.best.as_dict(),
                "memory_budget_bytes": result.memory_budget, "planner_time_s": planner_s,
                "alternatives": [a.as_dict() for a in result.alternatives[:args.top]]}
        if experts:
            data["experts"] = {"chosen": experts[0].as_dict(), "alternatives": [c.as_dict() for c in experts[1:]]}
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        sys.stdout.write(_plan_text(args, w.name, cluster, result) + "\n")
        if experts:
            sys.stdout.write(_experts_text(experts) + "\n")
    return 0


def _expert_choices(gm, cluster, result, sizes, batch: int, mixed):
    """For a mixture-of-experts model: how to split the experts on top of the chosen dp x tp
    (expert parallelism over a divisor of dp, tp inside the experts, or both). The experts may
    use the memory the chosen plan gives them, in proportion to their share of the parameters."""
    from autopar.ep import plan_experts
    from autopar.passes.meta import evaluate, graph_info, info

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
    import json

    from autopar.prepare import planned_graph
    from autopar.cost.timeline import write_timeline
    from autopar.dump import human, seconds
    from autopar.pp import simulate_plan, split_view, stage_table

    devices = cluster.world_size
    if devices % (args.pp * tp):
        raise ConfigError(f"{devices} devices do not split into pp={args.pp} x tp={tp}", where="autopar plan",
                          got=f"--cluster {args.cluster}", fix="pick --pp and --tp whose product divides the devices")
    dp = devices // (args.pp * tp)
    if args.batch % dp:
        raise ConfigError(f"the global batch {args.batch} does not split over dp={dp}", where="--batch",
                          fix=f"use a batch that is a multiple of {dp}")
    mesh = {"pp": args.pp, **({"dp": dp} if dp > 1 else {}), **({"tp": tp} if tp > 1 else {})}
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
    if args.timeline:
        from autopar.cost.comm import collective_time
        sim = simulate_plan(costs, best.cuts, schedule=best.schedule, devices=best.devices, virtual=best.virtual,
                            microbatches=best.microbatches,
                            p2p_time=lambda b: collective_time("send_recv", b, cluster, tuple(mesh.items()), "pp"))
        title = (f"{w.name} on {cluster.name}: pp={args.pp} {best.schedule}, {best.microbatches} micro-batches, "
                 f"bubble {sim.bubble_fraction:.3f}")
        checks.writing("--timeline", args.timeline, lambda: write_timeline(sim, args.timeline, title=title))
        _progress(args, f"wrote {args.timeline}")
    if args.json:
        data = {"model": w.name, "cluster": cluster.name, "devices": devices, "batch": args.batch, "seq": args.seq,
                "degrees": {"dp": dp, "tp": tp, "pp": args.pp}, **best.as_dict(), "stages": rows,
                "planner_time_s": planner_s}
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
        return 0
    lines = [f"autopar plan: {w.name} on {cluster.name} ({devices} devices), global batch {args.batch}, seq {args.seq}",
             f"chosen: pp={args.pp} dp={dp} tp={tp}, {best.schedule} schedule, {best.microbatches} micro-batches of "
             f"{args.batch // dp // best.microbatches}, {best.virtual} stage(s) per device",
             f"  predicted step time {seconds(best.step_time_s)}, bubble {best.bubble_fraction:.3f} "
             f"(planned in {planner_s:.2f}s)"]
    for r in rows:
        lines.append(f"  stage {r['stage']:<3} device {r['device']:<3} {r['ops']:>5} ops  {seconds(r['time_s']):>8} "
                     f"per micro-batch  state {human(r['state_bytes'], 'B'):>8}  activations "
                     f"{human(r['activation_bytes'], 'B'):>8}  sends {human(r['sends_bytes'], 'B'):>8}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _infeasible(args: argparse.Namespace, cluster, result) -> DoesNotFitError:
    leanest = min(result.alternatives, key=lambda c: c.memory.total)
    more = (f"{result.smallest_devices} devices would fit global batch {args.batch}"
            if result.smallest_devices else f"no device count up to 4096 fits global batch {args.batch}")
    mb, at = result.largest_micro_batch, result.largest_micro_batch_degrees
    fewer = (f"on {result.devices} devices a per-rank batch of at most {mb} fits (dp={at[0]} tp={at[1]})" if mb
             else f"on {result.devices} devices not even a per-rank batch of 1 fits")
    return DoesNotFitError(f"no dp x tp x ZeRO configuration of {args.model} fits in "
                           f"{result.memory_budget / 1e9:.1f} GB per device on {cluster.name}", where="autopar plan",
                           smallest_devices=result.smallest_devices,
                           expected=f"per-device memory <= {result.memory_budget / 1e9:.1f} GB",
                           got=f"the leanest (dp={leanest.dp} tp={leanest.tp} ZeRO-{leanest.zero_stage}) needs "
                               f"{leanest.memory.total / 1e9:.1f} GB",
                           fix=f"{more}; {fewer}" + ("; or raise --memory-budget" if args.dtype != "fp32"
                                                      else "; or raise --memory-budget, or train with --dtype bf16"))


def _plan_text(args: argparse.Namespace, name: str, cluster, result) -> str:
    from autopar.cost.dp_planner import seconds as _ms
    b = result.best
    m = b.memory
    gb = lambda x: f"{x / 1e9:.2f}"  # noqa: E731
    lines = [f"autopar plan: {name} on {cluster.name} ({result.devices} devices), global batch {args.batch}, "
             f"seq {args.seq}, {args.dtype}, {args.optimizer}",
             f"chosen: dp={b.dp} tp={b.tp} ZeRO-{b.zero_stage}, micro-batch {b.micro_batch} per dp rank, "
             f"gradient buckets {b.bucket_bytes / 2**20:.1f} MiB",
             f"  predicted step time {_ms(b.step_time_s)} = compute {_ms(b.compute_s)} + tp communication "
             f"{_ms(b.tp_comm_s)} + exposed dp communication {_ms(b.exposed_comm_s)} (of {_ms(b.dp_comm_s)})",
             f"  memory per device (GB): params {gb(m.params)}  grads {gb(m.grads)}  optimizer {gb(m.optimizer)}  "
             f"activations {gb(m.activations)}  buffers {gb(m.buffers)}  total {gb(m.total)}  "
             f"(budget {gb(result.memory_budget)})"]
    shown = result.alternatives[:args.top]
    if shown:
        lines.append(f"alternatives (top {len(shown)} of {len(result.alternatives)}):")
        lines.append(f"  {'dp':>4} {'tp':>3} {'ZeRO':>4} {'mb':>4} {'step':>10} {'exposed':>10} {'memory':>9}  why not")
        for c in shown:
            lines.append(f"  {c.dp:>4} {c.tp:>3} {c.zero_stage:>4} {c.micro_batch:>4} {_ms(c.step_time_s):>10} "
                         f"{_ms(c.exposed_comm_s):>10} {c.memory.total / 1e9:>6.2f} GB  {c.reason}")
    return "\n".join(lines)


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
    d.add_argument("--format", choices=["text", "json", "dot"], default="text")
    d.add_argument("--summary", action="store_true", help="totals and modules only, no per-node lines")
    d.add_argument("--device", default="meta", help="where to build the model (default meta: allocates nothing)")
    d.add_argument("--mesh", metavar="AXIS=SIZE[,AXIS=SIZE]",
                   help="plan on this mesh (axes dp and/or tp, dp first, e.g. dp=2,tp=4) and show "
                        "each node's strategy and placement")
    d.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="with a dp axis: this ZeRO stage (default: the lowest that fits the device memory)")
    d.add_argument("--no-overlap", action="store_true",
                   help="with --after schedule: leave every issue next to its wait (no overlap)")
    d.add_argument("--bucket-bytes", type=count("--bucket-bytes", low=0), default=0,
                   help="gradient/gather bucket size in bytes (default: from the cost model)")
    d.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"],
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
    d.add_argument("--hardware",
                   help="with --mesh: price the plan for a100, h100, cpu or a profile from `autopar calibrate` "
                        "(default: this machine's kind, h100 with a GPU and cpu without)")
    d.add_argument("--out", help="write to this file instead of stdout")
    d.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines nor warnings on stderr (errors still print)")
    d.set_defaults(fn=_dump)

    pl = sub.add_parser("plan", help="pick data/tensor parallel degrees and the ZeRO stage for a cluster")
    pl.add_argument("--model", required=True, help=_MODEL_HELP)
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    pl.add_argument("--cluster", required=True, metavar="NODESxGPUS", help="e.g. 1x8 or 4x8")
    pl.add_argument("--hardware", default="h100", help="a100, h100, cpu or a profile from `autopar calibrate`")
    pl.add_argument("--batch", type=count("--batch"), required=True,
                    help="global batch size (split over the data axis)")
    pl.add_argument("--seq", type=count("--seq"), required=True, help="sequence length")
    pl.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="fp32, or bf16/fp16 mixed precision (16-bit compute, fp32 master weights)")
    pl.add_argument("--memory-budget", type=checks.gigabytes("--memory-budget"), metavar="GB",
                    help="bytes per device in decimal GB (default: the device's memory)")
    pl.add_argument("--zero", choices=["auto", "0", "1", "2", "3"], default="auto", help="ZeRO stage (default auto)")
    pl.add_argument("--tp", default="auto", help="tensor-parallel degree, exactly (it must divide the devices), "
                    "or auto (default: powers of two within a node)")
    pl.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, sgd-momentum, ...")
    pl.add_argument("--pp", default="auto",
                    help="auto (default): search dp x tp x pp, ZeRO, recomputation, micro-batches and schedule "
                         "jointly; 1: data and tensor parallelism only; N: this many pipeline stages")
    pl.add_argument("--report", metavar="OUT.html", help="with --pp auto: write the plan as one HTML page")
    pl.add_argument("--save-plan", metavar="PLAN.json",
                    help="with --pp auto: write the chosen configuration as JSON, for `autopar train --plan`")
    pl.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb"],
                    help="with --pp: the pipeline schedule (default: the simulator's choice)")
    pl.add_argument("--microbatches", type=_microbatches("--microbatches"),
                    help="with --pp: micro-batches per step (default: chosen)")
    pl.add_argument("--virtual-stages", type=count("--virtual-stages"), help="with --pp: stages per device (interleaved)")
    pl.add_argument("--timeline", metavar="OUT.svg", help="with --pp: draw the simulated schedule to this SVG file")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.add_argument("--top", type=count("--top", low=0, high=1000, why="a page of alternatives"), default=5,
                    metavar="K", help="alternatives to show (default 5)")
    pl.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines nor warnings on stderr (errors still print)")
    pl.set_defaults(fn=_plan)

    sm = sub.add_parser("simulate", help="score one fixed configuration with the planner's simulator (JSON)")
    sm.add_argument("--model", required=True, help=_MODEL_HELP)
    sm.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    sm.add_argument("--cluster", required=True, metavar="NODESxGPUS")
    sm.add_argument("--hardware", default="h100")
    sm.add_argument("--batch", type=count("--batch"), required=True, help="global batch size")
    sm.add_argument("--seq", type=count("--seq"), required=True)
    sm.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    sm.add_argument("--optimizer", default="adamw")
    sm.add_argument("--memory-budget", type=checks.gigabytes("--memory-budget"), metavar="GB")
    sm.add_argument("--tp", type=count("--tp", high=checks.MAX_DEVICES), default=1)
    sm.add_argument("--pp", type=count("--pp", high=checks.MAX_DEVICES), default=1)
    sm.add_argument("--dp", type=count("--dp", high=checks.MAX_DEVICES), help="default: devices / (tp * pp)")
    sm.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    sm.add_argument("--micro-batch-size", type=count("--micro-batch-size"), default=1)
    sm.add_argument("--schedule", choices=["1f1b", "interleaved", "gpipe", "zb"], default="1f1b")
    sm.add_argument("--virtual-stages", type=count("--virtual-stages"), default=1)
    sm.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    sm.add_argument("--attention", choices=["flash", "materialized"], default="flash",
                    help="price attention as a flash kernel, or with the [s, s] scores written out")
    sm.add_argument("--timeline", metavar="OUT.svg")
    sm.add_argument("-q", "--quiet", action="store_true")
    sm.set_defaults(fn=_simulate)

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
    if argv[:1] == ["train"]:  # its own flags, parsed by autopar.train
        from autopar import train
        try:
            return train.main(argv[1:])
        except AutoparError as exc:   # a bad plan file or flag: the message, not a traceback
            print(f"autopar: error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["calibrate"]:  # its own flags, parsed by autopar.cost.calibrate
        from autopar.cost import calibrate
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
