"""A pipeline cut may land just before an op that writes its input in place (a CNN's
``ReLU(inplace=True)``): the stage receiving that value must run it on a copy (the received
tensor is a leaf the schedule owns), and the result must equal the single-process model."""
from __future__ import annotations

import copy

import torch
from torch import nn

import autopar
from autopar.runtime.launch import run_ranks


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def _train(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = SmallCNN().double()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    pm = autopar.parallelize(model, {"pp": 2}, (x,), loss_fn=_loss, schedule="1f1b", microbatches=2)
    # the cut this test is about: the second stage writes a received value in place
    writes = [st.index for st in pm.stages if st._mutated]
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_err = 0.0
    for _ in range(3):
        got = pm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        want = _loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(got.item() - want.item()) / abs(want.item()))
    ref_state = ref.state_dict()
    param_err = max(((v - ref_state[k]).abs().max() / ref_state[k].abs().max()).item()
                    for k, v in pm.state_dict().items())
    return {"loss": loss_err, "param": param_err, "writes": writes}


def test_pipeline_cut_before_an_in_place_op_matches_one_process():
    res = run_ranks(_train, 2)
    assert any(r["writes"] for r in res), "no stage received a value it writes in place: the cut moved"
    for r in res:
        assert r["loss"] <= 1e-6, r       # pm.step returns the loss as float32
        assert r["param"] <= 1e-12, r
