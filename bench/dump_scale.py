"""Benchmark: `autopar dump` of published-scale models on the meta device.

Command:  python bench/dump_scale.py [--models gpt3-175b llama3-70b mixtral-8x7b] [--repeat 3]
Reports, per model, the whole-process wall time and peak RSS of
`autopar dump --model M --batch 1 --seq 2048 --format json`, and beside it the peer: a
bare `torch.export.export` of the same meta model with the same dynamic dims, in its
own process. The ratio of medians is what autopar's analysis adds on top of capture.
Goal (issue 2): under 30 s and under 4 GB for the whole dump process.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

PEER = """
import sys, torch
from torch.export import Dim
from autopar import models
m = models.build(sys.argv[1], device="meta")
args, dims = models.example_inputs(m, 2, 8)
named = {}
spec = tuple({d: named.setdefault(n, Dim(n, min=2, max=m.config.max_seq if n == "seq" else 1 << 20))
              for d, n in ds.items()} for ds in dims)
torch.export.export(m, args, dynamic_shapes=spec, strict=False)
"""


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt3-175b", "llama3-70b", "mixtral-8x7b"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"{'model':<14} {'dump s':>7} {'dump GiB':>9} {'export s':>9} {'ratio':>6}  goal <30 s, <4 GiB")
    for model in args.models:
        dump = [run([sys.executable, "-m", "autopar", "dump", "--model", model, "--batch", "1", "--seq", "2048",
                     "--format", "json", "-q", "--out", os.devnull]) for _ in range(args.repeat)]
        peer = [run([sys.executable, "-c", PEER, model]) for _ in range(args.repeat)]
        d_wall = statistics.median(w for w, _ in dump)
        d_rss = max(r for _, r in dump)
        p_wall = statistics.median(w for w, _ in peer)
        ok = "ok" if d_wall < 30 and d_rss < 4 else "MISSED"
        print(f"{model:<14} {d_wall:7.1f} {d_rss:9.2f} {p_wall:9.1f} {d_wall / p_wall:6.2f}  {ok}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
