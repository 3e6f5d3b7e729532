"""Expert parallelism computes what the single-process model computes.

Real gloo processes: ep=2 and ep=4, dp=2 x ep=2, and ep=2 with tp=2 on the dense parts;
one world per size runs every case of the file. Every rank builds the Mixtral-style zoo
model with the same seed and trains its parallel copy on its share of a global batch for
two AdamW steps (the second runs on the moments the first left); a single-process copy trains
on every share in turn (each share's loss scaled by 1/shares, as the parallel model
averages). Routing and token dropping happen per share in both (the capacity comes from
the share's token count), so they match exactly, including capacity factors that drop
tokens. Per step, the loss of each share must match within 1e-5 relative; the gradients at
the first step and every parameter after the steps must match within 1e-5 relative to the
model's scale — each rank holding only its own experts.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
import autopar.cost.ep_planner
from autopar import models
from autopar.runtime.launch import run_ranks

STEPS = 2
RTOL = 1e-5


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _build(overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("moe", overrides, device="cpu")


def _train(rank: int, world: int, overrides: dict, mesh: dict, batch: int, seq: int, skew: bool,
           capacity: float | None = None) -> dict:
    dp, ep, tp = mesh.get("dp", 1), mesh["ep"], mesh.get("tp", 1)
    shares = dp * ep
    model = _build(overrides)
    ref = copy.deepcopy(model)
    if capacity is not None:      # the plan's capacity factor: the reference runs at it too
        for m in ref.modules():
            if hasattr(m, "capacity_factor"):
                m.capacity_factor = capacity
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch * shares, seq, device="cpu")
    target = torch.randint(0, overrides["vocab"], (batch * shares, seq))
    share = rank // tp
    local, local_t = tuple(a.chunk(shares)[share] for a in args), target.chunk(shares)[share]
    calib = None
    if skew:   # a calibration batch of one repeated token whose experts the contiguous placement puts together
        calib = _skewed_calibration(model, overrides, mesh["ep"], batch, seq)
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters()) if tp > 1 else None
    pm = autopar.parallelize(model, mesh, local, calibration=calib, memory_budget=budget,
                             capacity_factor=capacity)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    loss_err = grad_err = 0.0
    scale = max(p.abs().max().item() for p in ref.parameters())
    for step in range(STEPS):
        loss = _loss(pm(*local), local_t)
        loss.backward()
        for s in range(shares):
            piece = tuple(a.chunk(shares)[s] for a in args)
            ref_loss = _loss(ref(*piece), target.chunk(shares)[s])
            if s == share:
                loss_err = max(loss_err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
            (ref_loss / shares).backward()
        opt.step()
        if step == 0:
            grad_err = _compare(pm, {k: p.grad for k, p in ref.named_parameters()}, tp, rank, scale)
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    param_err = _compare(pm, dict(ref.named_parameters()), tp, rank, scale, params=True)
    perm = {f: rt.owned() for f, rt in pm.ep_runtimes.items()}
    return {"loss_err": loss_err, "grad_err": grad_err, "param_err": param_err,
            "capacity": pm.plan.capacity_factor,
            "owned": {f: list(v) for f, v in perm.items()},
            "expert_shapes": {k: list(p.shape) for k, p in pm.named_parameters() if k in pm.expert_params},
            "imbalance": {f: p.imbalance for f, p in pm.placements.items()},
            "naive_imbalance": {f: autopar.cost.ep_planner.contiguous(len(p.perm), p.ranks, p.loads).imbalance
                                for f, p in pm.placements.items()}}


def _skewed_calibration(model, overrides: dict, ep: int, batch: int, seq: int) -> tuple:
    from autopar.build.prepare import capture_model
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for token in range(overrides["vocab"]):
        cal = (torch.full((batch, seq), token, dtype=torch.long),)
        loads = autopar.cost.ep_planner.expert_loads(capture_model(model, cal, ()), cal, params)
        if all(autopar.cost.ep_planner.contiguous(len(v), ep, v).imbalance > 1.5 for v in loads.values()):
            return cal
    raise AssertionError("no token routes its rows onto one rank's experts")


def _compare(pm, ref: dict, tp: int, rank: int, scale: float, params: bool = False) -> float:
    region_of = {}
    for f, rt in pm.ep_runtimes.items():
        for k in pm.expert_params:
            if k.startswith(f + ".") or f == "":
                region_of[k] = rt
    err = 0.0
    for k, p in pm.named_parameters():
        got = p.detach() if params else p.grad
        want = ref[k].detach()
        if k in pm.expert_params:
            want = want.index_select(0, torch.tensor(region_of[k].owned()))
        if got.shape != want.shape:     # a tensor-axis slice
            dim = next(d for d in range(got.dim()) if got.shape[d] != want.shape[d])
            want = want.chunk(tp, dim)[rank % tp]
        err = max(err, (got - want).abs().max().item() / scale)
    return err


MOE = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": 16, "experts": 4, "top_k": 2}


def _check(res: list[dict], experts: int, ep: int) -> None:
    for r in res:
        assert r["loss_err"] < RTOL and r["grad_err"] < RTOL and r["param_err"] < RTOL, r
        for shape in r["expert_shapes"].values():
            assert shape[0] == experts // ep          # only this rank's experts are stored
    for f in res[0]["owned"]:                          # every expert lives on exactly one rank of the ep axis
        held = sorted(e for r in res for e in r["owned"][f])
        assert held == sorted(list(range(experts)) * (len(res) // ep))


def _train_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Every case of one world: each (overrides, mesh, batch, seq, skew, capacity)."""
    return [_train(rank, world, *c) for c in cases]


def case(overrides: dict, mesh: dict, batch: int, seq: int, skew: bool = False,
         capacity: float | None = None) -> tuple:
    return overrides, mesh, batch, seq, skew, capacity


def _size(c: tuple) -> int:
    mesh = c[1]
    return mesh.get("dp", 1) * mesh["ep"] * mesh.get("tp", 1)


MESHES = [({"ep": 2}, 2), ({"ep": 4}, 4), ({"dp": 2, "ep": 2}, 4), ({"ep": 2, "tp": 2}, 4)]
# Experts, top-k, capacity factor, seq and hidden size of the generated test: the four examples
# Hypothesis drew when each started its own world (derandomized, from experts in {2, 4, 8} x
# top_k 1..2 x capacity in {0.25, 0.5, 1.0, 1.25, 2.0} x seq in {4, 8} x hidden in {16, 32}).
# Drawn once here, so that one world runs them all.
GENERATED = [dict(experts=2, top_k=1, capacity=0.25, seq=4, hidden=16),
             dict(experts=8, top_k=2, capacity=0.5, seq=8, hidden=16),
             dict(experts=2, top_k=2, capacity=0.5, seq=4, hidden=32),
             dict(experts=4, top_k=1, capacity=0.25, seq=4, hidden=16)]
SKEWED = {**MOE, "experts": 8, "layers": 1}


def _cases() -> dict:
    """test key -> case, every case of the file."""
    cases = {("mesh", str(mesh)): case(MOE, mesh, 2, 8) for mesh, _ in MESHES}
    for i, ex in enumerate(GENERATED):
        over = {**MOE, "experts": ex["experts"], "top_k": ex["top_k"], "capacity_factor": ex["capacity"],
                "hidden": ex["hidden"]}
        cases[("generated", i)] = case(over, {"ep": 2}, 2, ex["seq"])
    cases["skewed"] = case(SKEWED, {"ep": 2}, 2, 8, True)
    # the model is built at 1.25; the plan's 0.5 drops tokens, exactly as the model at 0.5 does
    cases["capacity"] = case(MOE, {"ep": 2}, 2, 8, False, 0.5)
    return cases


CASES = _cases()


def _world(size: int) -> dict:
    """test key -> each rank's result, for every case on ``size`` ranks: one world runs them all."""
    mine = [k for k, c in CASES.items() if _size(c) == size]
    results = run_ranks(_train_cases, size, [CASES[k] for k in mine], timeout_s=900)
    return {k: [r[i] for r in results] for i, k in enumerate(mine)}


def _results(request, key) -> list[dict]:
    c = CASES[key]
    res = request.getfixturevalue(f"world{_size(c)}")[key]
    assert len(res) == _size(c)
    return res


@pytest.mark.parametrize("mesh,world", MESHES)
def test_ep_meshes(request, mesh, world):
    res = _results(request, ("mesh", str(mesh)))
    _check(res, MOE["experts"], mesh["ep"])
    if mesh.get("tp", 1) > 1:
        # expert tensor parallelism: each tensor rank holds its slice of its experts' ffn dim
        whole = {k: list(p.shape) for k, p in _build(MOE).named_parameters()}
        for r in res:
            for k, shape in r["expert_shapes"].items():
                assert shape[0] == MOE["experts"] // mesh["ep"], (k, shape)
                assert math.prod(shape) * mesh["ep"] * mesh["tp"] == math.prod(whole[k]), (k, shape, whole[k])


@pytest.mark.parametrize("example", range(len(GENERATED)), ids=lambda i: str(GENERATED[i]))
def test_ep2_generated_experts_topk_capacity(request, example):
    _check(_results(request, ("generated", example)), GENERATED[example]["experts"], 2)


def test_skewed_calibration_balances_the_placement(request):
    res = _results(request, "skewed")
    _check(res, 8, 2)
    for r in res:
        for f, imb in r["imbalance"].items():
            assert imb < r["naive_imbalance"][f]           # better than experts in order
        assert any(v != list(range(v[0], v[0] + len(v))) for v in r["owned"].values())   # not in order


def test_balanced_placement_evens_out_skewed_loads():
    from autopar.cost.ep_planner import contiguous, place_experts
    loads = [100, 90, 5, 5, 4, 3, 2, 1]
    naive, placed = contiguous(8, 2, loads), place_experts(8, 2, loads)
    assert placed.imbalance < naive.imbalance
    assert sorted(placed.perm) == list(range(8)) and all(len(placed.owned(r)) == 4 for r in range(2))
    assert place_experts(8, 4).perm == tuple(range(8))           # uniform loads: experts in order
    with pytest.raises(autopar.core.errors.ConfigError, match="do not split evenly"):
        place_experts(6, 4)


def test_capacity_factor_is_a_plan_field(request):
    res = _results(request, "capacity")
    _check(res, MOE["experts"], 2)
    assert all(r["capacity"] == 0.5 for r in res)


def test_autopar_train_moe_matches_its_single_process_run(capsys):
    """Dropping tokens over a capacity counted per call: the single-process reference of
    ``autopar train`` runs the ranks' micro-batches, not the whole batch in one call."""
    from autopar.cli import main
    code = main(["train", "--model", "moe", "--ranks", "2", "--steps", "2", "--batch", "4", "--seq", "8",
                 "--set", "layers=1", "--set", "hidden=32", "--set", "vocab=64", "--set", "capacity_factor=0.5"])
    out = capsys.readouterr().out
    assert code == 0 and "above 1e-5" not in out, out


def _train64(rank: int, world: int) -> dict:
    """{"ep": 2, "tp": 2} in float64 with SGD-momentum: the experts split over both axes."""
    mesh, tp, shares = {"ep": 2, "tp": 2}, 2, 2
    model = _build(MOE).double()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 2 * shares, 8, device="cpu")
    target = torch.randint(0, MOE["vocab"], (2 * shares, 8))
    share = rank // tp
    local, local_t = tuple(a.chunk(shares)[share] for a in args), target.chunk(shares)[share]
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters())
    pm = autopar.parallelize(model, mesh, local, memory_budget=budget)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        _loss(pm(*local), local_t).backward()
        opt.step()
        opt.zero_grad()
        for s in range(shares):
            (_loss(ref(*tuple(a.chunk(shares)[s] for a in args)), target.chunk(shares)[s]) / shares).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"param_err": _compare(pm, dict(ref.named_parameters()), tp, rank, 1.0, params=True),
            "expert_shapes": {k: list(p.shape) for k, p in pm.named_parameters() if k in pm.expert_params}}


def test_expert_tensor_parallelism_trains_as_one_process_in_float64():
    # within 1e-8 (measured 2.4e-9), as with the experts whole: the zoo model computes its
    # RMSNorm and rotary tables in float32, where the tensor axis's sums round differently
    # (ep alone is within 1.4e-17)
    whole = {k: list(p.shape) for k, p in _build(MOE).named_parameters()}
    for r in run_ranks(_train64, 4, timeout_s=600):
        assert r["param_err"] <= 1e-8, r["param_err"]
        assert r["expert_shapes"], "no expert was split"
        for k, shape in r["expert_shapes"].items():          # a quarter of every expert weight per rank
            assert math.prod(shape) * 4 == math.prod(whole[k]), (k, shape)
