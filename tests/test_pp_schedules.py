"""Every schedule the pipeline planner can pick runs a model that returns its own loss.

A ``transformers`` model given labels returns its loss, which the last stage hands over as a
view; the zero-bubble schedule detaches it in place, which torch refuses for a view. In a real
two-rank gloo world, HF Llama in float64 on ``pp=2``, with ``schedule="zb"`` and with the
planner's own choice, trains two SGD steps: each step's loss and every parameter a rank holds
must equal one process on the whole batch (1e-5 relative: the library computes its loss and
norms in float32 whatever the parameters' dtype).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.launch import run_ranks

import hf_tiny

STEPS = 2
TOL = 1e-5


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    ref, data = hf_tiny.build("llama", torch.float64), hf_tiny.batch()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = ref(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _case(schedule: str | None) -> dict:
    want_losses, want_state = _reference()
    model, data = hf_tiny.build("llama", torch.float64), hf_tiny.batch()
    pm = autopar.parallelize(model, {"pp": 2}, example_kwargs=data, options=autopar.PipelineOptions(
        schedule=schedule, microbatches=2 if schedule else None))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    loss_err = 0.0
    for want in want_losses:
        got = pm.step(**data)
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, abs(float(got) - want) / abs(want))
    param_err, held = 0.0, 0
    for key, value in pm.state_dict().items():
        want = want_state[key]
        if want.is_floating_point():
            held += 1
            param_err = max(param_err, ((value - want).abs().max() / want.abs().max().clamp_min(1e-3)).item())
    return {"schedule": pm.plan.schedule, "loss": loss_err, "param": param_err, "held": held}


def _ranks(rank: int, world: int) -> dict:
    return {name: _case(schedule) for name, schedule in (("zb", "zb"), ("planner", None))}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


@pytest.mark.parametrize("name", ["zb", "planner"])
def test_a_model_with_its_own_loss_trains_under_the_schedule(results, name) -> None:
    for r in results:
        got = r[name]
        assert got["held"] > 0
        assert got["loss"] < TOL and got["param"] < TOL, got
    if name == "zb":
        assert all(r[name]["schedule"] == "zb" for r in results)
