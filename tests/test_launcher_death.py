"""Killing the launcher ends its ranks.

A child Python process calls ``run_ranks`` (what ``autopar train`` does) on two ranks that
write their pids and sleep. Killing that launcher with SIGTERM (what ``kill`` and job
schedulers send) or SIGKILL (nothing of it runs) must end both ranks within a few seconds:
a rank is a child of the forkserver, and would otherwise run on alone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.runtime.faults import alive

ROOT = Path(__file__).resolve().parents[1]


def sleeper(rank: int, world: int, where: str) -> None:
    Path(where, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_ranks_end_with_their_launcher(tmp_path, sig):
    code = ("from autopar.runtime.launch import run_ranks\n"
            "from tests.test_launcher_death import sleeper\n"
            f"run_ranks(sleeper, 2, {str(tmp_path)!r}, timeout_s=300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.DEVNULL)
    files = [tmp_path / "rank0", tmp_path / "rank1"]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and launcher.poll() is None, "the ranks never started"
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in files]
    launcher.send_signal(sig)
    launcher.wait(30)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher ({sig.name})"
