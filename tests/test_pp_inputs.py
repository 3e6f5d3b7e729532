"""A pipelined model's non-tensor inputs (a flag such as ``return_loss=True``).

The capture fixes a non-tensor input's value in the graph, and torch's pipeline schedule moves
tensors only: the flag is held back from the schedule, and a step that passes another value is
refused with an InputMismatchError naming it, instead of crashing inside torch (as are inputs
packed in a tuple, ``pm.step((x,), ...)``). In a real
two-rank gloo world a small float64 network whose forward takes ``scale: bool`` runs on ``pp=2``
with two micro-batches: every rank's loss, and the gradient of every parameter a rank holds,
equal one process's.

A stage may hold no parameter at all (a model whose second half is parameter-free work): the
rank holding it still gets an optimizer (``autopar.optimizer`` there used to raise torch's
"empty parameter list"), whose state round-trips, and three SGD-momentum steps match one process.
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


class HeavyTail(torch.nn.Module):
    """One weight, then parameter-free work the cut balances against it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for _ in range(6):
            h = torch.tanh(h @ h.transpose(-1, -2) @ h / 16)
        return h


def _empty_stage() -> dict:
    torch.manual_seed(0)
    model = HeavyTail().double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(4, 32, 16, generator=g, dtype=torch.float64) for _ in range(2))
    pm = autopar.parallelize(model, {"pp": 2}, (x,), options=autopar.PipelineOptions(loss_fn=_loss))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    err = 0.0
    for _ in range(3):
        got = pm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        want = _loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        err = max(err, abs(float(got) - want.item()) / want.item())
    want_p = dict(ref.named_parameters())
    for k, p in pm.named_parameters():
        err = max(err, ((p - want_p[k]).abs().max() / want_p[k].abs().max()).item())
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    return {"err": err, "held": len(list(pm.parameters())), "groups": len(opt.param_groups),
            "state_keys": sorted(sd["state"])}


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
    try:
        pm.step((x,), target=y, scale=True)          # the inputs packed in a tuple
        packed = None
    except InputMismatchError as exc:
        packed = (exc.what, exc.fix)
    return {"err": max(errs), "refused": refused, "packed": packed, "held": len(list(pm.parameters())),
            "empty": _empty_stage()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


def test_a_flag_input_trains_as_one_process(results) -> None:
    assert sum(r["held"] for r in results) > 0
    for r in results:
        assert r["err"] < 1e-12, r


def test_a_stage_without_parameters_trains_as_one_process(results) -> None:
    held = [r["empty"]["held"] for r in results]
    assert 0 in held and sum(held) == 2, held          # one rank holds no parameter
    for r in results:
        e = r["empty"]
        assert e["err"] < 1e-12 and e["groups"] == 1, e
        assert len(e["state_keys"]) == e["held"], e     # momentum for each parameter held, none on the empty rank


def test_inputs_packed_in_a_tuple_are_a_typed_error(results) -> None:
    for r in results:
        assert r["packed"] is not None
        what, fix = r["packed"]
        assert "tuple" in what and "pm.step(*inputs" in fix


def test_another_value_of_the_flag_is_refused_naming_it(results) -> None:
    for r in results:
        assert r["refused"] is not None
        what, expected, got = r["refused"]
        assert "scale" in what and expected == "True" and got == "False"
