"""Start-up time of the command line and of ``import autopar``, against ``import torch``.

Each of the three commands runs ``--repeats`` times in a fresh interpreter, interleaved (so a
busy machine slows all three alike), and the table gives each one's median wall time and its
excess over ``import torch``'s median. The goals: ``autopar --help`` within 0.5 s of
``import torch``, ``import autopar`` within 1 s of it.

    python bench/cli_startup.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import autopar": [sys.executable, "-c", "import autopar"],
    "autopar --help": ([shutil.which("autopar")] if shutil.which("autopar") else [sys.executable, "-m", "autopar"])
    + ["--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["import torch"])
    print(f"{'command':<16} {'median s':>9} {'over torch s':>13} {'min s':>7} {'max s':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16} {med:9.2f} {med - base:13.2f} {min(ts):7.2f} {max(ts):7.2f}")
    help_over = statistics.median(times["autopar --help"]) - base
    import_over = statistics.median(times["import autopar"]) - base
    print(f"goals: --help within 0.5 s of import torch: {'met' if help_over <= 0.5 else 'MISSED'} "
          f"({help_over:+.2f} s); import autopar within 1 s: {'met' if import_over <= 1.0 else 'MISSED'} "
          f"({import_over:+.2f} s)")


if __name__ == "__main__":
    main()
