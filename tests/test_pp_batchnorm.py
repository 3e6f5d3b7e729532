"""BatchNorm in a pipeline: exact, or refused with the approximation offered by name.

In training a BatchNorm normalises by the statistics of the rows it sees; a pipeline that
splits the batch into micro-batches would normalise each by its own, which one process on the
whole batch does not do. In a real two-rank gloo world a small BatchNorm network on ``pp=2``:
with two micro-batches it is refused with an UnsupportedError naming the BatchNorm layers and
offering ``PipelineOptions(batchnorm="microbatch")``, which then builds and trains; with one
micro-batch (nothing split) the loss and every parameter and running statistic a rank holds
equal one process after two SGD steps, in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.core.errors import UnsupportedError
from autopar.runtime.launch import run_ranks

STEPS = 2


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).double()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def _parallel(microbatches: int, batchnorm: str | None = None):
    x, _ = _data()
    return autopar.parallelize(_net(), {"pp": 2}, (x,), options=autopar.PipelineOptions(
        schedule="gpipe", microbatches=microbatches, loss_fn=_loss, batchnorm=batchnorm))


def _ranks(rank: int, world: int) -> dict:
    out: dict = {}
    try:
        _parallel(2)
        out["refused"] = None
    except UnsupportedError as exc:
        out["refused"] = (exc.where, exc.fix)
    x, y = _data()
    pm = _parallel(2, "microbatch")
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    out["microbatch_loss"] = float(pm.step(x, target=y))
    opt.step()
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pm = _parallel(1)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    errs = []
    for _ in range(STEPS):
        got = pm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        want = _loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        errs.append(abs(float(got) - want.item()) / want.item())
    ref_state = ref.state_dict()
    held = {k: v for k, v in pm.state_dict().items() if v.is_floating_point()}
    out["loss_err"] = max(errs)
    out["state_err"] = max(((v - ref_state[k]).abs().max() / ref_state[k].abs().max().clamp_min(1e-3)).item()
                           for k, v in held.items())
    out["held"] = sorted(held)
    # the whole state dict, integer buffers too: BatchNorm's counter counts this rank's steps
    whole = pm.state_dict()
    out["keys"] = sorted(whole) == sorted(ref_state)
    out["counters"] = {k: (int(whole[k]), int(v)) for k, v in ref_state.items() if "num_batches_tracked" in k}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


def test_batchnorm_over_split_micro_batches_is_refused_offering_the_approximation(results) -> None:
    for r in results:
        assert r["refused"] is not None, "BatchNorm over two micro-batches built silently"
        where, fix = r["refused"]
        assert "1" in where and "4" in where and "batchnorm='microbatch'" in fix


def test_the_approximation_runs_when_asked_for(results) -> None:
    for r in results:
        assert r["microbatch_loss"] == r["microbatch_loss"]      # a number, not nan


def test_batchnorm_with_one_micro_batch_equals_one_process(results) -> None:
    assert any(any("running_mean" in k for k in r["held"]) for r in results)
    for r in results:
        assert r["loss_err"] < 1e-10 and r["state_err"] < 1e-10, r
        assert r["keys"] and len(r["counters"]) == 2, r
        assert all(got == want == STEPS for got, want in r["counters"].values()), r["counters"]
