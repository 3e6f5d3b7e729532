"""autopar.runtime.launch: real multi-process gloo worlds on one machine."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from autopar.runtime.launch import run_ranks, run_ranks_outcomes

from autopar.core.errors import AutoparError

# --- rank workers (module level so they pickle) -------------------------------------------

def _all_reduce(rank: int, world: int) -> torch.Tensor:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t


def _raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom from the test worker")
    dist.barrier()  # the other ranks get stuck here: the parent must terminate them
    return rank


def _faulthandler_on(rank: int, world: int) -> bool:
    import faulthandler
    return faulthandler.is_enabled()


def _exit_on_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


# --- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_sum_on_every_rank(world: int) -> None:
    results = run_ranks(_all_reduce, world, timeout_s=60)
    expected = world * (world + 1) / 2
    assert len(results) == world
    for t in results:
        assert isinstance(t, torch.Tensor)
        assert t.tolist() == [expected]


def test_raising_rank_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(AutoparError) as info:
        run_ranks(_raise_on_one, 2, timeout_s=60)
    assert time.monotonic() - start < 15
    msg = str(info.value)
    assert "rank 1" in msg
    assert "boom from the test worker" in msg
    assert "ValueError" in msg


def test_exiting_rank_is_reported_not_hung() -> None:
    start = time.monotonic()
    with pytest.raises(AutoparError) as info:
        run_ranks(_exit_on_one, 2, timeout_s=20)
    assert time.monotonic() - start < 15
    msg = str(info.value)
    assert "rank 1" in msg
    assert "code 3" in msg


def test_a_native_crash_would_print_the_ranks_python_stack() -> None:
    """Each rank runs with faulthandler on: a rank killed by a signal (glibc's abort on a
    corrupted heap, a segfault) leaves every thread's Python stack on its stderr."""
    assert run_ranks(_faulthandler_on, 2, timeout_s=30) == [True, True]


def test_outcomes_of_a_clean_run() -> None:
    outcomes = run_ranks_outcomes(_all_reduce, 2, timeout_s=60)
    assert [(o.rank, o.kind, o.exitcode) for o in outcomes] == [(0, "ok", 0), (1, "ok", 0)]
    assert all(o.result.tolist() == [3.0] and 0 < o.elapsed_s < 60 for o in outcomes)


def test_a_killed_rank_is_reported_with_what_the_others_saw() -> None:
    with pytest.raises(AutoparError) as info:
        run_ranks(_exit_on_one, 2, timeout_s=20)
    msg = str(info.value)
    assert "rank 1 of 2 exited with code 3" in msg
    assert "rank 1 died at step 0" in msg      # rank 0's diagnosis, through the health monitor
