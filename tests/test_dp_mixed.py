"""Mixed precision: bf16 compute with fp32 master weights, reductions and optimizer state.

bf16 rounds every activation, so the comparison with the fp32 single-process model is
loose (a few 1e-2 relative); the structure is exact: the module computes in bf16, the
optimizer steps fp32 masters, and training follows the fp32 trajectory. Two AdamW steps (the
second uses the moments the first left); one world of two ranks runs every ZeRO stage.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
STAGES = (0, 1, 2, 3)
STEPS = 2


def _run(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 2 * world, 8, device="cpu")
    local = tuple(a.chunk(world)[dist.get_rank()] for a in args)
    pm = autopar.parallelize(model, {"dp": world}, local, zero_stage=stage, mixed_precision="bf16", bucket_bytes=20000)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        loss = pm(*local).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for d in range(world):
            piece = tuple(a.chunk(world)[d] for a in args)
            ref_loss = ref(*piece).logsumexp(-1).mean()
            (ref_loss / world).backward()
            if d == dist.get_rank():
                ref_losses.append(ref_loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    masters = {m.dtype for m in opt.masters.values()}
    held = {p.dtype for p in pm.parameters()}
    state = {v.dtype for s in opt.state.values() for v in s.values() if v.dim() > 0}
    sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float() for k, v in pm.state_dict().items()}
    scale = max(v.abs().max().item() for v in ref.state_dict().values())
    param_err = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()) / scale
    return {"losses": losses, "ref": ref_losses, "masters": masters, "held": held, "state": state,
            "param_err": param_err}


def _stages(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    return {stage: _run(rank, world, stage) for stage in stages}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_ranks(_stages, 2, STAGES, timeout_s=600)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_compute_with_fp32_masters_follows_fp32_training(world2, stage):
    for r in (by_stage[stage] for by_stage in world2):
        assert len(r["losses"]) == STEPS, r["losses"]
        assert r["masters"] == {torch.float32} and r["state"] == {torch.float32}
        assert r["held"] == ({torch.float32} if stage == 3 else {torch.bfloat16})
        for got, want in zip(r["losses"], r["ref"]):
            assert abs(got - want) <= 2e-2 * abs(want), (r["losses"], r["ref"])
        assert r["losses"][-1] < r["losses"][0], "training did not reduce the loss"
        assert r["param_err"] <= 2e-2
