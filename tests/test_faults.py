"""Faults mid-step on real gloo ranks, and the rules that blame a rank (runtime/health.py).

A rank of a data-parallel training loop raises, is killed (SIGKILL) or stalls between the
forward and the backward of step 3: the other ranks must end with exit code 3 and a
PeerFailureError naming that rank and step, within the collective timeout (a short one
here), and a stalled rank must be stopped (exit code 4) with its stack. One test goes
through real torchrun. The blame rules themselves are tested on hand-written records.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError
from autopar.runtime import health
from autopar.runtime.faults import Diagnosis, judge, looks_like_peer_failure
from autopar.runtime.launch import run_ranks, run_ranks_outcomes

TIMEOUT_S = 3.0      # every collective's timeout in these tests
STEP = 3             # the faulty rank's failing step


# --- rank workers (module level so they pickle) -------------------------------------------

def _train(rank: int, world: int, fault: str, bad: int) -> int:
    """Five data-parallel steps of a small MLP; rank `bad` faults after step 3's forward."""
    import autopar
    from autopar import models

    torch.manual_seed(0)
    model = models.build("mlp", {"width": 16, "depth": 2}, device="cpu")
    x = torch.randn(4 * world, 16)
    pm = autopar.parallelize(model, {"dp": world}, (x.chunk(world)[rank],))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    for step in range(1, 6):
        loss = pm(x.chunk(world)[rank]).pow(2).mean()
        if rank == bad and step == STEP:
            if fault == "raise":
                raise RuntimeError("boom")
            if fault == "kill":
                os.kill(os.getpid(), 9)
            if fault == "stall":
                time.sleep(60)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _subgroup_timeout(rank: int, world: int) -> float:
    group = dist.new_group(list(range(world)))     # made after the monitor set the timeout
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _faults(fault: str, bad: int, world: int) -> list:
    return run_ranks_outcomes(_train, world, fault, bad, timeout_s=60, collective_timeout_s=TIMEOUT_S)


def _survivors_named(outcomes: list, bad: int, what: str, within_s: float) -> None:
    for o in outcomes:
        if o.rank == bad:
            continue
        assert o.kind == "peer" and o.exitcode == health.EXIT_PEER_FAILED, o
        assert o.message.startswith(f"rank {bad} {what}"), o.message
        assert f"rank {o.rank} stops" in o.message
        assert o.elapsed_s - outcomes[bad].elapsed_s < within_s, (o.elapsed_s, outcomes[bad].elapsed_s)


# --- real processes -----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1, 0])   # rank 0 also hosts the store the others read
def test_a_raising_rank_is_named_with_its_step(bad: int) -> None:
    outcomes = _faults("raise", bad, 2)
    failed = outcomes[bad]
    assert failed.kind == "raised" and failed.exitcode == 1
    assert "RuntimeError: boom" in failed.message
    assert f"rank {bad} raised at step {STEP}" in failed.message
    _survivors_named(outcomes, bad, f"failed at step {STEP} (RuntimeError: boom)", TIMEOUT_S)


def test_a_killed_rank_is_named_with_its_step() -> None:
    outcomes = _faults("kill", 1, 3)
    assert outcomes[1].kind == "died" and outcomes[1].exitcode == -9
    _survivors_named(outcomes, 1, f"died at step {STEP}", TIMEOUT_S)
    assert "its process" in outcomes[0].message and "is gone" in outcomes[0].message


def test_a_killed_store_host_is_named() -> None:
    outcomes = _faults("kill", 0, 2)
    assert outcomes[0].kind == "died" and outcomes[0].exitcode == -9
    _survivors_named(outcomes, 0, "died", TIMEOUT_S)
    assert "store" in outcomes[1].message


def test_a_stalled_rank_is_named_and_stopped() -> None:
    outcomes = _faults("stall", 1, 2)
    survivor, stalled = outcomes
    # the survivor times out after TIMEOUT_S, gives the others 3 beats, then names rank 1
    _survivors_named(outcomes, 1, f"stalled at step {STEP}", 2.0)
    assert f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms" in survivor.message
    assert survivor.elapsed_s < 30            # not the 60 s the rank sleeps
    assert stalled.kind == "stalled" and stalled.exitcode == health.EXIT_STALLED
    assert "time.sleep(60)" in stalled.message    # its stack, at the line it stalled on


def test_groups_made_later_get_the_timeout() -> None:
    assert run_ranks(_subgroup_timeout, 2, collective_timeout_s=7.0) == [7.0, 7.0]


_SCRIPT = """
    import torch
    import autopar
    from autopar import models
    from autopar.runtime import health

    health.init_distributed(timeout_s={timeout})
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = models.build("mlp", {{"width": 16, "depth": 2}}, device="cpu")
    x = torch.randn(8, 16)
    pm = autopar.parallelize(model, {{"dp": world}}, (x.chunk(world)[rank],))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    for step in range(1, 6):
        loss = pm(x.chunk(world)[rank]).pow(2).mean()
        if rank == 1 and step == {step}:
            raise RuntimeError("boom")
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_exit_code_and_root_cause(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(timeout=TIMEOUT_S, step=STEP)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "RuntimeError: boom" in out
    assert f"autopar: rank 1 raised at step {STEP}" in out
    # torchrun's summary: the first rank to end is the one that raised, with exit code 1
    root = out.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*1\b", root), out[-3000:]


# --- the rules, on hand-written records -----------------------------------------------------

def _beat(step: int, pid: int = 100, where: str = "train.py:9 in main") -> dict:
    return {"beat": 1, "step": step, "pid": pid, "node": "n", "where": where}


def _judge(beats: dict, ends: dict | None = None, *, ages: dict | None = None, local: set | None = None,
           gone: set | None = None, settled: bool = False) -> Diagnosis | None:
    ends = {r: (ends or {}).get(r) for r in beats}
    return judge(0, beats, ends, ages or {}, local=local or set(), gone=gone or set(), stale_s=3.0, settled=settled)


def test_judge_prefers_a_recorded_exception() -> None:
    beats = {0: _beat(3), 1: _beat(3), 2: _beat(2)}
    ends = {1: {"kind": "raised", "step": 3, "error": "RuntimeError: boom"}}
    got = _judge(beats, ends, local={2}, gone={2})
    assert got == Diagnosis("raised", 1, 3, "RuntimeError: boom")
    assert got.what() == "rank 1 failed at step 3 (RuntimeError: boom)"


def test_judge_names_a_dead_process_then_a_silent_one() -> None:
    beats = {0: _beat(3), 1: _beat(3), 2: _beat(3)}
    assert _judge(beats, local={1, 2}, gone={2}).rank == 2
    assert _judge(beats, ages={1: 5.0}).kind == "died"              # another node: heartbeat stopped
    assert _judge(beats, ages={1: 5.0}, local={1}).kind == "hung"   # this node, process alive
    assert _judge(beats, ages={1: 2.0}) is None                     # not stale yet


def test_judge_follows_the_blame_and_skips_ranks_that_ended() -> None:
    beats = {0: _beat(3), 1: _beat(3), 2: _beat(3)}
    blame = Diagnosis("died", 1, 3, "its process 7 is gone").to_json()
    ends = {1: {"kind": "peer", "step": 3, "blame": {**blame, "rank": 0}},     # blames me: ignored
            2: {"kind": "peer", "step": 3, "blame": blame}}
    assert _judge(beats, ends, local={2}, gone={2}) == Diagnosis("died", 1, 3, "its process 7 is gone")


def test_judge_after_a_timeout_names_the_rank_that_never_joined() -> None:
    beats = {0: _beat(3), 1: _beat(3, where="train.py:20 in main"), 2: _beat(3)}
    ends = {2: {"kind": "timeout", "step": 3}}
    assert _judge(beats, ends) is None
    got = _judge(beats, ends, settled=True)
    assert (got.kind, got.rank, got.step) == ("stalled", 1, 3) and "train.py:20" in got.detail
    everyone = {1: {"kind": "timeout", "step": 3}, 2: {"kind": "timeout", "step": 3}}
    assert _judge(beats, everyone, settled=True).rank is None


def test_judge_names_a_rank_that_finished_early() -> None:
    beats = {0: _beat(6), 1: _beat(5)}
    got = _judge(beats, {1: {"kind": "exited", "step": 5}})
    assert (got.kind, got.rank, got.step) == ("exited", 1, 5)


def test_collective_errors_are_told_from_the_users_own() -> None:
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert looks_like_peer_failure(reset)
    assert not looks_like_peer_failure(ValueError("timed out waiting for the data loader"))
    assert health.explain(reset) is reset or health.monitor() is not None   # no monitor: unchanged


def test_timeout_knob(monkeypatch) -> None:
    monkeypatch.delenv(health.TIMEOUT_ENV, raising=False)
    assert health.resolve_timeout() == health.DEFAULT_TIMEOUT_S == 300.0
    monkeypatch.setenv(health.TIMEOUT_ENV, "42")
    assert health.resolve_timeout() == 42.0
    assert health.resolve_timeout(7) == 7.0
    monkeypatch.setenv(health.TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match="AUTOPAR_TIMEOUT_S"):
        health.resolve_timeout()
    with pytest.raises(ConfigError):
        health.resolve_timeout(-1)


class _CountingStore:
    def __init__(self) -> None:
        self.sets = 0
        self.data: dict = {}

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.data[key] = value

    def check(self, keys: list) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key].encode()


@pytest.mark.parametrize("world, writes", [(8, 500), (4096, 1)])
def test_heartbeats_at_large_worlds_are_rate_limited(world: int, writes: int) -> None:
    store = _CountingStore()
    mon = health.Monitor(store, 1, world, timeout_s=None, beat_s=60.0, store_host=1)
    for _ in range(500):          # 500 steps within one beat
        mon.beat(on_step=True)
    assert store.sets == writes


def test_the_heartbeat_interval_keeps_the_store_load_bounded() -> None:
    assert health.beat_interval(8) == 1.0 and health.beat_interval(1000) == 1.0
    assert health.beat_interval(16384) == pytest.approx(16.384)     # 1,000 writes a second in all
