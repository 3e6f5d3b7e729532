"""The ``autopar`` command line: ``dump`` an annotated graph, ``models``, ``calibrate``."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from autopar.errors import AutoparError, ConfigError


def _dump(args: argparse.Namespace) -> int:
    from autopar.dump import render
    from autopar.workload import capture_workload, load_workload, parse_overrides
    mesh = parse_mesh(args.mesh) if args.mesh else None
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
    else:
        from autopar.api import planned_graph
        after = args.after or "plan"
        # dims=() (not None) keeps a user model without dims a static capture, as plain dump does.
        gm, plan = planned_graph(w.model, mesh, w.args, dims=w.dims if w.dims is not None else (),
                                 sizes=w.sizes, rewrite=after == "rewrite")
        parallel = {"mesh": dict(plan.mesh), "after": after, "predicted": dict(plan.predicted)}
        _progress(args, f"captured, analysed and planned ({after}) {len(gm.graph.nodes)} nodes on "
                  f"{','.join(f'{k}={v}' for k, v in mesh.items())} in {time.perf_counter() - start:.1f}s")
    text = render(gm, w.sizes, args.format, model=w.name, nodes=not args.summary, parallel=parallel)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        _progress(args, f"wrote {args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


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


def _models(args: argparse.Namespace) -> int:
    from autopar import models
    for name in models.list_models():
        cfg = models.get_config(name)
        print(f"{name:<16} {models.param_count(cfg) / 1e9:9.3f}B params  {type(cfg).__name__}")
    return 0


def _progress(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization for PyTorch training.")
    p.add_argument("-v", "--verbose", action="store_true", help="log every pass")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("dump", help="print the annotated graph of a model")
    d.add_argument("--model", required=True, help="zoo name (see `autopar models`) or path/to/file.py:factory")
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    d.add_argument("--batch", type=int, default=1, help="global batch size to evaluate at (default 1)")
    d.add_argument("--seq", type=int, default=128, help="sequence length to evaluate at (default 128)")
    d.add_argument("--format", choices=["text", "json", "dot"], default="text")
    d.add_argument("--summary", action="store_true", help="totals and modules only, no per-node lines")
    d.add_argument("--device", default="meta", help="where to build the model (default meta: allocates nothing)")
    d.add_argument("--mesh", metavar="AXIS=SIZE[,AXIS=SIZE]",
                   help="plan tensor parallelism on this mesh (one axis for now, e.g. tp=4) and show "
                        "each node's strategy and placement")
    d.add_argument("--after", choices=["plan", "rewrite"],
                   help="with --mesh: show the graph after planning (default) or the per-rank graph after "
                        "the rewrite, with the inserted collectives and their predicted cost")
    d.add_argument("--out", help="write to this file instead of stdout")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    d.set_defaults(fn=_dump)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(fn=_models)

    sub.add_parser("calibrate", help="measure this machine and write a hardware profile "
                   "(autopar calibrate --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:  # its own flags, parsed by autopar.cost.calibrate
        from autopar.cost import calibrate
        return calibrate.main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="[autopar] %(name)s: %(message)s")
    try:
        return args.fn(args)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
