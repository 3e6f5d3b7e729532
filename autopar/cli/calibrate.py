"""``autopar calibrate``: measure this machine for the cost model (:func:`autopar.cost.calibrate.calibrate`)
and write the profile the planner reads with ``--hardware``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from autopar.cli.checks import output_file
from autopar.core.errors import ConfigError
from autopar.cost.calibrate import calibrate


def main(argv: list[str] | None = None) -> int:
    """``autopar calibrate [--device D] [--quick] [--out FILE]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="autopar calibrate",
                                     description="Measure this machine for the cost model.")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--quick", action="store_true", help="small sizes, done in seconds")
    parser.add_argument("--out", default=None,
                        help="write the JSON profile here (default: print it to stdout)")
    args = parser.parse_args(argv)
    try:
        output_file(args.out, "--out")      # in an existing directory, checked before the minutes of measuring
        try:
            profile = calibrate(args.device, out=args.out, quick=args.quick)
        except OSError as exc:              # writing --out (a full disk, no permission): the user's to fix
            if args.out is None or exc.filename is None or Path(exc.filename) != Path(args.out):
                raise
            raise ConfigError(f"cannot write --out: {exc.strerror}", where="--out", got=args.out,
                              fix="pass a path in a writable directory") from exc
    except ConfigError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        print(json.dumps(profile, indent=2, sort_keys=True))
    return 0
