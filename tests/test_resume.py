"""A resume keeps the run, or says what changed.

On two ranks: a tiny GPT trains three steps on tp=2 under ``LambdaLR`` and is saved with
``scheduler=``. Loaded under tp=2 with a fresh scheduler: the schedule is where it was (its
step count, and the next learning rate equal to an uninterrupted run's), nothing is said. Loaded
under dp=2: the same schedule, and a warning on rank 0 (and ``"changed"``) that the batch now
splits over 2 data shares instead of 1, so the same rows per share make twice the global batch.
A checkpoint saved without ``scheduler=`` loaded with one says that the schedule starts again.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)


def _lambda(step: int) -> float:
    return 1.0 / (1 + step)


def _build(mesh: dict):
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    local = x.chunk(2)[dist.get_rank()] if "dp" in mesh else x
    pm = autopar.parallelize(model, mesh, (local,))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    return pm, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda), local


def _run(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    pm, opt, sched, x = _build({"tp": 2})
    for _ in range(3):
        pm(x).float().logsumexp(-1).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    autopar.save(pm, opt, f"{root}/with", step=3, scheduler=sched)
    autopar.save(pm, opt, f"{root}/without", step=3)
    out = {"want": (sched.last_epoch, opt.param_groups[0]["lr"])}
    for name, mesh, where in (("same", {"tp": 2}, "with"), ("other", {"dp": 2}, "with"),
                              ("none", {"tp": 2}, "without")):
        pm, opt, sched, _ = _build(mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = autopar.load(pm, opt, f"{root}/{where}", scheduler=sched)
        said = [str(w.message) for w in caught if "resuming changes the run" in str(w.message)]
        out[name] = {"got": (sched.last_epoch, opt.param_groups[0]["lr"]), "changed": info["changed"], "said": said}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_run, 2, str(tmp_path_factory.mktemp("resume")), timeout_s=300)


def test_the_schedule_resumes_where_it_was(ranks):
    for r in ranks:
        assert r["want"] == (3, pytest.approx(0.1 / 4))
        assert r["same"]["got"] == r["want"] and r["other"]["got"] == r["want"]
    assert ranks[0]["same"]["changed"] == [] and ranks[0]["same"]["said"] == []


def test_another_data_layout_says_the_global_batch_changes(ranks):
    changed = ranks[0]["other"]["changed"]
    assert len(changed) == 1 and "over 1 data share(s)" in changed[0] and "over 2 now" in changed[0]
    assert "2x the saved one" in changed[0]
    assert ranks[0]["other"]["said"] and not ranks[1]["other"]["said"]     # said once, on rank 0


def test_a_checkpoint_without_the_schedule_says_it_restarts(ranks):
    assert any("holds no LR scheduler state" in c for c in ranks[0]["none"]["changed"])
    assert ranks[0]["none"]["got"][0] == 0
