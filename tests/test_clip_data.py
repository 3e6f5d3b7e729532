"""Gradient clipping over split and sharded parameters, and each rank's share of the batch.

One 4-rank gloo world runs every layout. Per layout the model is trained three SGD-momentum
steps with ``autopar.clip_grad_norm_`` at a max norm well below the gradient's norm (so
every step clips), beside a single-process copy clipped by ``torch.nn.utils.clip_grad_norm_``
on the whole batch: the returned norm must be the single-process norm each step, and the
parameters after the steps must match (float64: to 1e-9). Each rank's batch comes from
``autopar.data.shard``, so a wrong share would fail the comparison too. Each case asserts
the layout really split or sharded something.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

# the gpt family: no op casts to float32 (llama's RMSNorm does), so float64 runs agree to 1e-9
SMALL = {"hidden": 32, "heads": 4, "vocab": 64, "max_seq": 16, "layers": 2}
CASES = {   # name: (mesh, parallelize options, norm type)
    "tp2_dp2_zero3": ({"dp": 2, "tp": 2}, {"zero_stage": 3}, 2.0),
    "dp4_zero1_inf": ({"dp": 4}, {"zero_stage": 1}, math.inf),
    "pp2_tp2_fp32": ({"pp": 2, "tp": 2}, {"schedule": "1f1b", "microbatches": 2}, 2.0),
    "pp2_dp2_zero2": ({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 2}, 2.0),
}


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _case(mesh: dict, opts: dict, norm_type: float) -> dict:
    torch.manual_seed(0)
    model = models.build("gpt", SMALL, device="cpu").to(torch.float64)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 8, 8, device="cpu")
    target = torch.randint(0, SMALL["vocab"], (8, 8))
    local, local_t = autopar.data.shard(args, mesh), autopar.data.shard(target, mesh)
    tp = mesh.get("tp", 1)
    pp = "pp" in mesh
    # below the replicated state (in float64), so the solver splits this tiny model's weights
    budget = (2.5 if pp else 1) * 0.75 * 16 * sum(p.numel() for p in model.parameters()) if tp > 1 else None
    pm = autopar.parallelize(model, mesh, local, memory_budget=budget, **({"loss_fn": _loss} if pp else {}), **opts)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for _ in range(3):
        if pp:
            pm.step(*local, target=local_t)
        else:
            _loss(pm(*local), local_t).backward()
        got = autopar.clip_grad_norm_(pm, opt, 0.05, norm_type)
        opt.step()
        opt.zero_grad()
        _loss(ref(*args), target).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append((got.item(), want.item()))
    # against the largest parameter: a key bias's gradient is zero up to round-off, its own scale 1e-22
    ref_state, err, slices = ref.state_dict(), 0.0, 0
    scale = max(p.abs().max().item() for p in ref.parameters())
    for fqn, v in pm.state_dict().items():      # whole under ZeRO-3; this tensor rank's slice when split
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        want = ref_state[fqn]
        if v.shape != want.shape:
            dim = next(d for d in range(v.dim()) if v.shape[d] != want.shape[d])
            want = want.chunk(tp, dim)[dist.get_rank() % tp]
            slices += 1
        err = max(err, (v - want).abs().max().item() / scale)
    share = autopar.data.batch_share(pm)
    split = sum(1 for v in pm.plan.params.values() if v.startswith("S"))    # stored split on the tensor axis
    return {"norms": norms, "param_err": err, "slices": slices, "split": split, "share": (share.index, share.count)}


def _all_cases(rank: int, world: int) -> dict:
    return {name: _case(*spec) for name, spec in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 4, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_clipped_training_matches_one_process(results, name):
    mesh = CASES[name][0]
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in r["norms"]:
            assert want > 0.05                      # every step clips
            assert got == pytest.approx(want, rel=1e-9), (rank, r["norms"])
        assert r["param_err"] < 1e-9, (name, rank, r["param_err"])
    if "tp" in mesh:
        assert all(res[name]["split"] for res in results), "the tensor axis split no weight"
    shares = [res[name]["share"] for res in results]
    count = mesh.get("dp", 1) * mesh.get("ep", 1)
    assert {c for _, c in shares} == {count} and {i for i, _ in shares} == set(range(count))


def test_batch_share_follows_the_mesh_layout():
    # axes outermost first, ranks row-major: the data coordinate of each rank
    assert [autopar.data.batch_share({"pp": 2, "dp": 2, "tp": 2}, r).index for r in range(8)] == [0, 0, 1, 1] * 2
    assert [autopar.data.batch_share({"dp": 2, "ep": 2}, r) for r in range(4)] == \
        [autopar.data.Share(i, 4) for i in range(4)]
    batch = {"input_ids": torch.arange(8).view(4, 2), "n": 3}
    assert autopar.data.shard(batch, {"dp": 2, "tp": 2}, 3)["input_ids"].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(autopar.InputMismatchError, match="split evenly"):
        autopar.data.shard(torch.zeros(3, 2), {"dp": 2}, 0)
    with pytest.raises(autopar.MeshError):
        autopar.data.batch_share({"dp": 2}, 5)
