"""A saved expert-parallel plan, re-applied, rebuilds the same parallel model.

Real gloo ranks, one world of two shared by every case (ep=2). The zoo's Mixtral-style
model (built with capacity factor 4.0) is parallelized with a calibration batch that makes
the balanced placement differ from experts in order, and a capacity factor of 0.5 that
drops tokens; its plan is saved, loaded and handed to ``parallelize(..., plan=)`` with a
freshly built copy of the model. The second parallel model must own the same experts,
compute the same outputs and, over two SGD-momentum steps, the same losses and parameters
as the first and as a single-process copy at that capacity factor (1e-5 relative; each ep
rank passes its own share of the batch, the reference runs every share in turn). The same
for transformers' Mixtral (dropless, stacked experts). Then the mistakes: a plan for another
mesh, a placement that is not a permutation, a plan for another model (other shapes, a
layer the model does not have, a module that is not a split MoE layer), a capacity factor
that contradicts the plan's — each a typed error on every rank, after which the ranks still
agree on a collective (nothing is left half-done).
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
import autopar.cost.ep_planner
from autopar import models
from autopar.core.plans import Plan
from autopar.runtime.launch import run_ranks
from tests.hf_tiny import Logits

RTOL = 1e-5
WORLD = 2
MESH = {"ep": 2}
MOE = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": 16, "experts": 4, "top_k": 2,
       "capacity_factor": 4.0}
CAPACITY = 0.5          # the plan's: drops tokens, so only a plan applied with it matches
SEQ = 8


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _moe(**over) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("moe", {**MOE, **over}, device="cpu")


def _mixtral() -> torch.nn.Module:
    """transformers' Mixtral, one layer, four experts (dropless), logits out."""
    import transformers

    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=MOE["vocab"], max_position_embeddings=32,
                                     num_experts_per_tok=2, intermediate_size=48, num_local_experts=4,
                                     bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():          # sizeable weights: every expert gets rows
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return Logits(model)


def _unbalanced_calibration(model: torch.nn.Module) -> tuple:
    """A batch of one repeated token for which the balanced placement of some MoE layer is
    not experts in order (so a plan that lost the placement would show)."""
    from autopar.build.prepare import capture_model
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    gm = capture_model(model, (torch.zeros(2, SEQ, dtype=torch.long),), {})
    for token in range(3, MOE["vocab"]):
        cal = (torch.full((2, SEQ), token, dtype=torch.long),)
        loads = autopar.cost.ep_planner.expert_loads(gm, cal, params)
        if any(autopar.cost.ep_planner.place_experts(len(v), MESH["ep"], v).perm != tuple(range(len(v))) for v in loads.values()):
            return cal
    raise AssertionError("no calibration token moves an expert off its in-order rank")


def _owned_rows(pm, fqn: str, want: torch.Tensor) -> torch.Tensor:
    """``want`` (the whole model's tensor) as this rank stores it: its own experts' rows."""
    for f, rt in pm.ep_runtimes.items():
        if fqn in pm.expert_params and fqn.startswith(f + ".") and pm.expert_storage[fqn] == "rows":
            return want.index_select(0, torch.tensor(rt.owned()))
    return want


def _replay(rank: int, build, path: str, capacity: float | None, dims=None) -> dict:
    """Parallelize with a calibration batch, save the plan, re-apply it on a fresh model and
    train both and a single-process reference two steps on the same data."""
    first, again, ref = build(), build(), build()
    if capacity is not None:
        for m in ref.modules():
            if hasattr(m, "capacity_factor"):
                m.capacity_factor = capacity
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, MOE["vocab"], (2 * WORLD, SEQ), generator=gen)
    target = torch.randint(0, MOE["vocab"], (2 * WORLD, SEQ), generator=gen)
    local, local_t = ids.chunk(WORLD)[rank], target.chunk(WORLD)[rank]

    start = time.perf_counter()
    pm1 = autopar.parallelize(first, MESH, (local,), dims=dims, calibration=_unbalanced_calibration(first),
                              capacity_factor=capacity)
    planned_s = time.perf_counter() - start
    if rank == 0:           # one writer; every rank applies rank 0's plan
        pm1.plan.save(path)
    dist.barrier()
    loaded = Plan.load(path)
    start = time.perf_counter()
    pm2 = autopar.parallelize(again, MESH, (local,), dims=dims, plan=loaded)
    applied_s = time.perf_counter() - start

    out_diff = (pm1(local) - pm2(local)).abs().max().item()
    opts = [autopar.optimizer(pm, torch.optim.SGD, lr=0.05, momentum=0.9) for pm in (pm1, pm2)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    loss_err = loss_diff = 0.0
    for _ in range(2):
        losses = []
        for pm, opt in zip((pm1, pm2), opts):
            loss = _loss(pm(local), local_t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        for s in range(WORLD):
            want = _loss(ref(ids.chunk(WORLD)[s]), target.chunk(WORLD)[s])
            if s == rank:
                want_loss = want.item()
            (want / WORLD).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max([loss_err] + [abs(got - want_loss) / abs(want_loss) for got in losses])
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
    ref_params = dict(ref.named_parameters())
    second = dict(pm2.named_parameters())
    param_err = 0.0
    for k, p in pm1.named_parameters():
        want = _owned_rows(pm1, k, ref_params[k].detach())
        scale = want.abs().max().clamp_min(1e-30)
        for got in (p.detach(), second[k].detach()):
            param_err = max(param_err, ((got - want).abs().max() / scale).item())
    return {"plan": pm1.plan.to_json(), "replan": pm2.plan.to_json(), "loaded_equal": loaded == pm1.plan,
            "capacity": (pm1.plan.capacity_factor, pm2.plan.capacity_factor),
            "owned": [{f: list(rt.owned()) for f, rt in pm.ep_runtimes.items()} for pm in (pm1, pm2)],
            "expert_rows": sorted({tuple(p.shape)[0] for k, p in pm2.named_parameters() if k in pm2.expert_params}),
            "out_diff": out_diff, "loss_diff": loss_diff, "loss_err": loss_err, "param_err": param_err,
            "planned_s": planned_s, "applied_s": applied_s}


def _refused(call) -> dict:
    """Run ``call``; the error it raised (type, text), and whether the ranks still agree on a
    collective afterwards (each adds its rank: both must see 0 + 1)."""
    try:
        call()
        err = {"type": None, "text": ""}
    except autopar.core.errors.AutoparError as exc:
        err = {"type": type(exc).__name__, "text": str(exc)}
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {**err, "in_step": t.item() == sum(range(dist.get_world_size()))}


def _mistakes(path: str) -> dict:
    plan = Plan.load(path)
    x = (torch.randint(3, MOE["vocab"], (2, SEQ), generator=torch.Generator().manual_seed(2)),)
    region = sorted(plan.expert_placement)[0]
    not_perm = dataclasses.replace(plan, expert_placement={**plan.expert_placement, region: [0, 0, 1, 2]})
    other_layers = _renamed(plan, region, "elsewhere")
    return {
        "mesh": _refused(lambda: autopar.parallelize(_moe(), {"dp": 2}, x, plan=plan)),
        "not_perm": _refused(lambda: autopar.parallelize(_moe(), MESH, x, plan=not_perm)),
        "other_shapes": _refused(lambda: autopar.parallelize(_moe(hidden=48), MESH, x, plan=plan)),
        "other_layers": _refused(lambda: autopar.parallelize(_moe(), MESH, x, plan=other_layers)),
        "capacity": _refused(lambda: autopar.parallelize(_moe(), MESH, x, plan=plan, capacity_factor=2.0)),
    }


def _renamed(plan: Plan, region: str, to: str) -> Plan:
    """``plan`` with the placement of MoE layer ``region`` filed under ``to``."""
    return dataclasses.replace(plan, expert_placement={to if f == region else f: p
                                                       for f, p in plan.expert_placement.items()})


def _not_moe(path: str) -> dict:
    """Mixtral's plan with its MoE layer's placement filed under its attention module: a
    module the model has, so only the captured graph shows it is not a split MoE layer."""
    plan = Plan.load(path)
    region, = plan.expert_placement
    wrong = _renamed(plan, region, region.replace(".mlp", ".self_attn"))
    x = (torch.randint(3, MOE["vocab"], (2, SEQ), generator=torch.Generator().manual_seed(2)),)
    return _refused(lambda: autopar.parallelize(_mixtral(), MESH, x, dims={}, plan=wrong))


def _world(rank: int, world: int, root: str, hf: bool) -> dict:
    out = {"moe": _replay(rank, _moe, f"{root}/moe.json", CAPACITY, dims={})}
    out["mistakes"] = _mistakes(f"{root}/moe.json")
    if hf:
        out["mixtral"] = _replay(rank, _mixtral, f"{root}/mixtral.json", None, dims={})
        out["mistakes"]["not_moe"] = _not_moe(f"{root}/mixtral.json")
    return out


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("ep_plans"))
    return run_ranks(_world, WORLD, root, _has_transformers(), timeout_s=300)


def _check_replay(rows: list[dict]) -> None:
    for r in rows:
        assert r["loaded_equal"], "the plan does not round-trip through save/load"
        assert Plan.from_json(r["replan"]) == Plan.from_json(r["plan"])    # re-applying rebuilds the same plan
        assert r["plan"] == rows[0]["plan"]                                  # every rank planned alike
        assert r["owned"][0] == r["owned"][1], r["owned"]
        assert r["expert_rows"] == [2], r["expert_rows"]                    # 4 experts over ep=2
        assert r["out_diff"] == 0.0 and r["loss_diff"] == 0.0, r      # the same model, bit for bit
        assert r["loss_err"] < RTOL and r["param_err"] < RTOL, r
    for f in rows[0]["owned"][0]:                       # every expert on exactly one rank
        assert sorted(e for r in rows for e in r["owned"][0][f]) == [0, 1, 2, 3]


def test_reapplied_moe_plan_owns_the_same_experts_and_trains_alike(world):
    rows = [r["moe"] for r in world]
    _check_replay(rows)
    plan = Plan.from_json(rows[0]["plan"])
    assert plan.ep_axis == "ep" and plan.mesh == MESH and plan.capacity_factor == CAPACITY
    assert any(p != sorted(p) for p in plan.expert_placement.values()), plan.expert_placement   # not in order
    assert all(r["capacity"] == (CAPACITY, CAPACITY) for r in rows)
    assert plan.shapes and plan.fingerprint == Plan.fingerprint_of(plan.shapes)


def test_reapplied_hf_mixtral_plan_trains_alike(world):
    if "mixtral" not in world[0]:
        pytest.skip("transformers is not installed")
    rows = [r["mixtral"] for r in world]
    _check_replay(rows)
    plan = Plan.from_json(rows[0]["plan"])
    assert any(p != sorted(p) for p in plan.expert_placement.values()), plan.expert_placement


@pytest.mark.parametrize("case,error,needle", [
    ("mesh", "MeshError", "does not match the plan's"),
    ("not_perm", "PlanFileError", "not a permutation"),
    ("other_shapes", "PlanFileError", "another model"),
    ("other_layers", "PlanFileError", "not this model's"),
    ("not_moe", "PlanFileError", "not this model's"),
    ("capacity", "ConfigError", "differs from the plan's"),
])
def test_a_plan_that_does_not_fit_is_refused_on_every_rank(world, case, error, needle):
    if case not in world[0]["mistakes"]:
        pytest.skip("transformers is not installed")
    for r in world:
        got = r["mistakes"][case]
        assert got["type"] == error and needle in got["text"], got
        assert "fix:" in got["text"], got["text"]
        assert got["in_step"], "the ranks no longer agree on a collective"

