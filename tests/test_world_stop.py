"""One rank's failure stops the whole world, with a typed error in user code.

A real dp=2 x tp=2 gloo world (4 ranks, ``run_ranks_outcomes``) trains a small MLP; at step 2
one rank fails: it raises in user code, is killed (SIGKILL) or is stopped (SIGSTOP, so the
others wait out the collective timeout). Each case puts the failure on another rank, so
partners and ranks that share no group with it are both tried. The other three must catch
``autopar.PeerFailureError`` in their own ``try``/``except`` around the training step (the
forward, backward and ``opt.step()``), name the failed rank, end with a non-zero exit code
even though their function then returns normally, and none may finish the run; all within
the collective timeout plus the monitor's grace.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.health import STOP_GRACE_S
from autopar.runtime.launch import run_ranks_outcomes

STEPS, FAIL_AT, TIMEOUT_S = 4, 2, 4.0
CASES = {"raise": 3, "kill": 2, "stop": 1}          # how the failing rank fails -> which rank


def _train(rank: int, world: int, how: str, bad: int, out: str) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    pm = autopar.parallelize(model, {"dp": 2, "tp": 2}, (x,), memory_budget=1)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    seen = "finished"
    try:
        for step in range(1, STEPS + 1):
            if step == FAIL_AT and rank == bad:
                if how == "raise":
                    raise RuntimeError("boom in user code")
                if how == "stop":       # stopped until the others have given up on it, then let go
                    subprocess.Popen(["sh", "-c", f"sleep {3 * TIMEOUT_S + STOP_GRACE_S}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            pm(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except autopar.PeerFailureError as err:
        seen = f"PeerFailureError rank={err.rank}: {str(err).splitlines()[0]}"
    except BaseException as exc:
        seen = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise
    finally:
        Path(out, f"rank{rank}").write_text(seen)
    return seen                    # a survivor returns normally: it must still exit non-zero


@pytest.mark.parametrize("how", list(CASES))
def test_every_other_rank_stops_with_a_typed_error(tmp_path, how):
    bad = CASES[how]
    got = run_ranks_outcomes(_train, 4, how, bad, str(tmp_path), timeout_s=120, collective_timeout_s=TIMEOUT_S)
    survivors = [o for o in got if o.rank != bad]
    for o in survivors:
        seen = (tmp_path / f"rank{o.rank}").read_text()
        assert seen.startswith(f"PeerFailureError rank={bad}"), (o.rank, seen, o.message[:300])
        assert o.kind == "peer" and o.exitcode not in (0, None), (o.rank, o.kind, o.exitcode)
    # the survivors end within the timeout and the grace of the last one to learn of it
    first = min(o.elapsed_s for o in survivors)
    assert max(o.elapsed_s for o in survivors) - first < TIMEOUT_S + STOP_GRACE_S + 5, \
        [(o.rank, o.elapsed_s) for o in got]
