"""MoE parallel folding (``ExpertOptions(fold=...)``, runtime/ep.py): a dropless layer beside a
tensor axis deals its experts over ep x tp and each tensor rank computes its share of the tokens.

One four-rank gloo world, ``{"ep": 2, "tp": 2}``, ``transformers`` Mixtral in float64 (its
equivalence with one process under folding is in tests/test_ep_hf.py and tests/test_pp_zero.py):
a checkpoint saved under folding resumes exactly (the next step's loss and the whole state dict
equal to the run that went on), and ``fold="off"`` keeps each layer's experts whole on the tensor
ranks (two of four a rank) and still trains as the folded run does.
"""
from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.runtime.launch import run_ranks
from tests.test_ep_hf import TOL_TP64, _loss, build

MESH = {"ep": 2, "tp": 2}


def _data(rank: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (8, 8), generator=gen)
    target = torch.randint(0, 64, (8, 8), generator=gen)
    share = rank // MESH["tp"]                 # the tensor ranks of an ep rank hold the same rows
    return ids.chunk(2)[share], target.chunk(2)[share]


def _stepped(pm, opt, local, target) -> float:
    loss = _loss(pm(local), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _world(rank: int, world: int, root: str) -> dict:
    local, target = _data(rank)
    pm = autopar.parallelize(build("mixtral", torch.float64), MESH, (local,))
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    _stepped(pm, opt, local, target)
    autopar.save(pm, opt, os.path.join(root, "folded"), step=1)
    went_on = _stepped(pm, opt, local, target)
    kept = {k: v.clone() for k, v in pm.state_dict().items()}
    again = autopar.parallelize(build("mixtral", torch.float64), MESH, (local,))
    again_opt = autopar.optimizer(again, torch.optim.AdamW, lr=1e-3)
    autopar.load(again, again_opt, os.path.join(root, "folded"))
    resumed = _stepped(again, again_opt, local, target)
    sd = again.state_dict()
    state_err = max((sd[k] - v).abs().max().item() for k, v in kept.items() if v.is_floating_point())
    whole = autopar.parallelize(build("mixtral", torch.float64), MESH, (local,),
                                options=[autopar.ExpertOptions(fold="off")])
    whole_opt = autopar.optimizer(whole, torch.optim.AdamW, lr=1e-3)
    off = [_stepped(whole, whole_opt, local, target) for _ in range(2)]
    return {"went_on": went_on, "resumed": resumed, "state_err": state_err, "off": off,
            "folded_owned": {f: len(rt.owned()) for f, rt in pm.ep_runtimes.items()},
            "off_owned": {f: len(rt.owned()) for f, rt in whole.ep_runtimes.items()}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_ranks(_world, 4, str(tmp_path_factory.mktemp("fold")), timeout_s=600)


def test_a_folded_checkpoint_resumes_exactly(world):
    for r in world:
        assert r["folded_owned"] and all(n == 1 for n in r["folded_owned"].values()), r   # 4 experts over ep x tp
        assert r["resumed"] == r["went_on"] and r["state_err"] == 0.0, r


def test_fold_off_keeps_experts_whole_on_the_tensor_ranks_and_trains_alike(world):
    for r in world:
        assert r["off_owned"] and all(n == 2 for n in r["off_owned"].values()), r          # 4 experts over ep
        # the second step's loss is the one the folded run went on to (same start, same data)
        assert r["off"][1] == pytest.approx(r["went_on"], rel=TOL_TP64), r
