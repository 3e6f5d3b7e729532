"""The DDP habit: a torch optimizer on the original model's parameters.

After ``parallelize`` the parallel module holds its own parameter objects, so
``torch.optim.SGD(model.parameters())`` would step tensors no gradient reaches and train
nothing. In a real two-rank gloo world, on dp=2 and on tp=2 (weights split), such an optimizer
must raise an OptimizerError at its first step naming ``autopar.optimizer``; an optimizer on a
copy of the model made after ``parallelize`` and the one ``autopar.optimizer`` returns must step
as usual (the latter: the parallel model's loss goes down). That optimizer is a
``torch.optim.Optimizer``: torch's ``LambdaLR`` and ``transformers``' cosine schedule with warmup
drive it on dp=2 ZeRO-1 and on tp=2, and after three SGD-momentum steps in float64 the learning
rates and every parameter equal one process under the same schedule.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar import models
from autopar.core.errors import OptimizerError
from autopar.runtime.launch import run_ranks

GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)


def _loss(pm, x) -> torch.Tensor:
    return pm(x).float().logsumexp(-1).mean()


def _case(rank: int, mesh: dict) -> dict:
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    args, _ = models.example_inputs(model, 4, 8, device="cpu")
    x = args[0].chunk(2)[rank] if "dp" in mesh else args[0]
    pm = autopar.parallelize(model, mesh, (x,), memory_budget=1 if "tp" in mesh else None)
    split = any(tuple(p.shape) != tuple(q.shape) for p, q in zip(pm.parameters(), model.parameters()))
    out = {"split": split}
    habit = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(pm, x).backward()
    try:
        habit.step()
        out["habit"] = None
    except OptimizerError as exc:
        out["habit"] = (exc.where, exc.fix)
    copied = copy.deepcopy(model)                   # made after parallelize: a model of its own
    before = [p.detach().clone() for p in copied.parameters()]
    own = torch.optim.SGD(copied.parameters(), lr=0.1)
    _loss(copied, args[0]).backward()
    own.step()
    out["copy_moved"] = any(not torch.equal(a, b) for a, b in zip(before, copied.parameters()))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    first = _loss(pm, x).item()
    for _ in range(3):
        opt.zero_grad()
        _loss(pm, x).backward()
        opt.step()
    out["went_down"] = _loss(pm, x).item() < first
    return out


SCHEDULES = {   # name -> scheduler over an optimizer (what a real training script builds)
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine_with_warmup": lambda opt: __import__("transformers").get_cosine_schedule_with_warmup(opt, 1, 4),
}


def _train_scheduled(model, step_loss, opt, schedule) -> list[float]:
    sched, lrs = SCHEDULES[schedule](opt), []
    for _ in range(3):
        step_loss().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _scheduled(rank: int, mesh: dict, schedule: str) -> dict:
    """autopar.optimizer is a torch Optimizer: a torch / transformers LR schedule drives it."""
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu").double()
    args, _ = models.example_inputs(model, 4, 8, device="cpu")
    x = args[0].chunk(2)[rank] if "dp" in mesh else args[0]
    pm = autopar.parallelize(model, mesh, (x,), zero_stage=1 if "dp" in mesh else None,
                             memory_budget=1 if "tp" in mesh else None)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.2, momentum=0.9)
    lrs = _train_scheduled(pm, lambda: _loss(pm, x), opt, schedule)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in pm.state_dict().items()}
    return {"optimizer": isinstance(opt, torch.optim.Optimizer), "lrs": lrs, "state": state}


def _ranks(rank: int, world: int) -> dict:
    out = {name: _case(rank, mesh) for name, mesh in (("dp", {"dp": 2}), ("tp", {"tp": 2}))}
    out["scheduled"] = {(name, sched): _scheduled(rank, mesh, sched) for name, mesh in (("dp", {"dp": 2}),
                        ("tp", {"tp": 2})) for sched in SCHEDULES}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("name", ["dp", "tp"])
def test_a_torch_optimizer_on_the_original_parameters_is_refused_at_its_first_step(results, name) -> None:
    for r in results:
        assert r[name]["habit"] is not None, "the optimizer stepped the original model's parameters silently"
        where, fix = r[name]["habit"]
        assert where == "SGD.step" and "autopar.optimizer(pm, torch.optim.SGD" in fix


@pytest.mark.parametrize("name", ["dp", "tp"])
def test_other_optimizers_step_as_usual(results, name) -> None:
    for r in results:
        assert r[name]["copy_moved"] and r[name]["went_down"]
    assert all(r["tp"]["split"] for r in results), "tp=2 split no weight"


@pytest.mark.parametrize("name", ["dp", "tp"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_lr_schedulers_drive_it_as_one_process(results, name, schedule) -> None:
    torch.manual_seed(0)
    ref = models.build("gpt", GPT, device="cpu").double()
    args, _ = models.example_inputs(ref, 4, 8, device="cpu")
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    want_lrs = _train_scheduled(ref, lambda: _loss(ref, args[0]), opt, schedule)
    for r in results:
        got = r["scheduled"][(name, schedule)]
        assert got["optimizer"], "autopar.optimizer is not a torch.optim.Optimizer"
        assert got["lrs"] == pytest.approx(want_lrs, rel=1e-12) and len(set(want_lrs)) > 1
        for k, v in ref.state_dict().items():
            assert torch.allclose(got["state"][k], v, rtol=1e-9, atol=1e-12), k
