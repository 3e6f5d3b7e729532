"""A pipelined model's non-tensor inputs (a flag such as ``return_loss=True``).

The capture fixes a non-tensor input's value in the graph, and torch's pipeline schedule moves
tensors only: the flag is held back from the schedule, and a step that passes another value is
refused with an InputMismatchError naming it, instead of crashing inside torch. In a real
two-rank gloo world a small float64 network whose forward takes ``scale: bool`` runs on ``pp=2``
with two micro-batches: every rank's loss, and the gradient of every parameter a rank holds,
equal one process's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.core.errors import InputMismatchError
from autopar.runtime.launch import run_ranks


class Flagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, scale: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        out = self.head(x)
        return out * 2 if scale else out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Flagged().double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 32, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    pm = autopar.parallelize(model, {"pp": 2}, (x,), example_kwargs={"scale": True}, options=autopar.PipelineOptions(
        schedule="gpipe", microbatches=2, loss_fn=_loss))
    got = pm.step(x, target=y, scale=True)
    want = _loss(ref(x, scale=True), y)
    want.backward()
    ref_grads = dict(ref.named_parameters())
    grad_err = max((((p.grad - ref_grads[k].grad).abs().max() / ref_grads[k].grad.abs().max().clamp_min(1e-12)).item()
                    for k, p in pm.named_parameters()), default=0.0)
    errs = [abs(float(got) - want.item()) / want.item(), grad_err]
    try:
        pm.step(x, target=y, scale=False)
        refused = None
    except InputMismatchError as exc:
        refused = (exc.what, exc.expected, exc.got)
    return {"err": max(errs), "refused": refused, "held": len(list(pm.parameters()))}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


def test_a_flag_input_trains_as_one_process(results) -> None:
    assert sum(r["held"] for r in results) > 0
    for r in results:
        assert r["err"] < 1e-12, r


def test_another_value_of_the_flag_is_refused_naming_it(results) -> None:
    for r in results:
        assert r["refused"] is not None
        what, expected, got = r["refused"]
        assert "scale" in what and expected == "True" and got == "False"
