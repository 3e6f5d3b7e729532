"""Pipeline parallelism computes what the single-process model computes.

Real gloo processes: pp=2 and pp=4, pp=2 x tp=2 and pp=2 x dp=2, under each schedule
(GPipe, 1F1B, interleaved 1F1B, zero-bubble), and pp=2 with full and selective recomputation
in the stages (tests/test_pp_zero.py adds ZeRO, experts and eight-rank meshes). Every rank builds the model with the same
seed, trains its pipeline for three AdamW steps with ``pm.step(inputs, target=...)``, and
trains a single-process copy on the same batch with the same loss (the mean over the
batch, which is what the mean of equal micro-batch losses is). Per step the loss every rank
gets back must match within 1e-5 relative; after the steps every parameter a rank holds
(under its original name) must match the reference within 1e-5 relative to the model's
scale, the union of the ranks' ``local_state_dict()`` keys must be the model's, and each rank's
``state_dict()`` must be the whole model's (every key, whole, equal to the reference).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

STEPS = 3
RTOL = 1e-5


def _build(name: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    m = models.build(name, overrides, device="cpu")
    for fqn, p in m.named_parameters():
        if fqn.endswith("k_proj.bias"):   # exactly-zero gradient (see test_dp_equivalence)
            p.requires_grad_(False)
    return m


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _run(rank: int, world: int, name: str, overrides: dict, mesh: dict, schedule: str, micro: int, virtual: int | None,
         batch: int, seq: int, recompute: str = "none") -> dict:
    dp, tp = mesh.get("dp", 1), mesh.get("tp", 1)
    model = _build(name, overrides)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch * dp, seq, device="cpu")
    target = torch.randint(0, overrides["vocab"], (batch * dp, seq))
    dp_rank = (dist.get_rank() // tp) % dp
    local = tuple(a.chunk(dp)[dp_rank] for a in args)
    local_target = target.chunk(dp)[dp_rank]
    # With a tensor axis, a budget below the replicated model's state (16 bytes per parameter
    # under fp32 AdamW) makes the solver split weights rather than replicate this tiny model.
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters()) if tp > 1 else None
    pm = autopar.parallelize(model, mesh, local, loss_fn=_loss, schedule=schedule, microbatches=micro,
                             virtual_stages=virtual, memory_budget=budget, recompute=recompute)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    loss_err = 0.0
    for _ in range(STEPS):
        ref_loss = _loss(ref(*args), target)
        want = ref_loss.detach()      # a pipeline returns the global batch's token mean, before the step
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = pm.step(*local, target=local_target)
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, abs(loss.item() - want.item()) / abs(want.item()))
    scale = max(p.abs().max().item() for p in ref.parameters())
    ref_state = ref.state_dict()
    param_err, tp_slices = 0.0, 0
    whole = pm.state_dict()      # every entry, whole, on every rank
    whole_err = max((whole[k] - v).abs().max().item() / scale for k, v in ref_state.items() if v.is_floating_point())
    for fqn, v in pm.local_state_dict().items():      # this rank's own part
        want = ref_state[fqn]
        if v.shape != want.shape:    # a tensor-axis slice: compare with the matching slice
            dim = next(d for d in range(v.dim()) if v.shape[d] != want.shape[d])
            want = want.chunk(tp, dim)[dist.get_rank() % tp]
            tp_slices += 1
        param_err = max(param_err, (v - want).abs().max().item() / scale)
    return {"loss_err": loss_err, "param_err": param_err, "keys": sorted(pm.local_state_dict()),
            "whole_keys": sorted(whole), "whole_err": whole_err,
            "all_keys": sorted(ref_state), "stages": [s.index for s in pm.stages], "tp_slices": tp_slices,
            "schedule": pm.schedule_name, "micro": pm.microbatches,
            "checkpointed": sum(len(st._recompute) for st in pm.stages),
            "regions": [len(set(st._recompute.values())) for st in pm.stages]}


def _check(results: list[dict], mesh: dict) -> None:
    keys = set()
    for r in results:
        assert r["loss_err"] < RTOL, r
        assert r["param_err"] < RTOL, r
        assert r["whole_keys"] == r["all_keys"] and r["whole_err"] < RTOL, r
        keys |= set(r["keys"])
    assert keys == set(results[0]["all_keys"])          # every parameter lives somewhere, named as before
    assert len({tuple(r["stages"]) for r in results}) == mesh["pp"]   # each pipeline rank its own stages
    if mesh.get("tp", 1) > 1:
        assert any(r["tp_slices"] for r in results)       # the tensor axis really split something


SMALL = {"gpt": {"hidden": 32, "heads": 4, "vocab": 64, "max_seq": 16},
         "llama": {"hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": 16}}


SCHEDULES = [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb", None)]
# (name, overrides, mesh, schedule, micro-batches, virtual stages, batch, seq[, recompute]) per world size;
# each world runs all of its cases once (launching worlds is the slow part)
CASES = {
    2: [("gpt", {**SMALL["gpt"], "layers": 4 if v else 2}, {"pp": 2}, s, 4, v, 8, 8) for s, v in SCHEDULES]
    + [("gpt", {**SMALL["gpt"], "layers": 4}, {"pp": 2}, s, 2, v, 4, 8, rc)
       for rc, s, v in (("full", "1f1b", None), ("selective", "interleaved", 2))]
    + [("llama", {**SMALL["llama"], "layers": 6}, {"pp": 2}, "1f1b", 2, None, 4, 8, "layers:2")],
    4: [("llama", {**SMALL["llama"], "layers": 8 if v else 4}, {"pp": 4}, s, 4, v, 8, 8) for s, v in SCHEDULES]
    + [(name, {**SMALL[name], "layers": 4 if v else 2}, {"pp": 2, inner: 2}, s, 2, v, 4, 8)
       for inner, name in (("tp", "gpt"), ("dp", "llama")) for s, v in SCHEDULES],
}


def _all(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    return [_run(rank, world, *case) for case in cases]


@pytest.fixture(scope="module")
def worlds():
    done: dict[int, list] = {}

    def results(world: int) -> list:
        if world not in done:
            done[world] = run_ranks(_all, world, CASES[world], timeout_s=600)
        return done[world]
    return results


@pytest.mark.parametrize("world,i", [(w, i) for w, cases in CASES.items() for i in range(len(cases))],
                         ids=lambda v: str(v))
def test_pipeline_matches_single_process(worlds, world, i):
    """pp=2 (GPT) and pp=4 (Llama) under each schedule, pp=2 x tp=2 and pp=2 x dp=2 under each
    schedule, and pp=2 with full, selective and two of three layers' recomputation in the stages."""
    case = CASES[world][i]
    mesh = case[2]
    results = [rank[i] for rank in worlds(world)]
    _check(results, mesh)
    if len(case) > 8:
        assert all(r["checkpointed"] > 0 for r in results)     # every stage really runs checkpointed regions
    if len(case) > 8 and case[8].startswith("layers:"):        # the first K layers of each stage, no more
        assert all(r["regions"] == [int(case[8][len("layers:"):])] for r in results), results


@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(st.tuples(st.sampled_from(["gpt", "llama"]), st.integers(2, 5), st.sampled_from([2, 3, 4, 6]),
                                st.sampled_from(["gpipe", "1f1b", "zb"])), min_size=4, max_size=4, unique=True))
def test_pp2_generated_depth_and_microbatches(drawn):
    """Drawn depths, micro-batch counts and schedules, all run in one two-rank world."""
    mesh = {"pp": 2}
    cases = [(name, {**SMALL[name], "layers": layers}, mesh, schedule, micro, None, micro * 2, 8)
             for name, layers, micro, schedule in drawn]
    results = run_ranks(_all, 2, cases, timeout_s=600)
    for i, (_, _, micro, _) in enumerate(drawn):
        got = [rank[i] for rank in results]
        _check(got, mesh)
        assert all(r["micro"] == micro for r in got)


def _replan(rank: int, world: int) -> dict:
    from autopar.core.plans import Plan
    over = {**SMALL["gpt"], "layers": 3}
    model = _build("gpt", over)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 8, 8, device="cpu")
    target = torch.randint(0, over["vocab"], (8, 8))
    first = autopar.parallelize(model, {"pp": 2}, args, loss_fn=_loss, schedule="1f1b", microbatches=4)
    text = first.plan.to_json()
    again = autopar.parallelize(_build("gpt", over), {"pp": 2}, args, loss_fn=_loss, plan=Plan.from_json(text))
    return {"starts": list(first.plan.stage_starts), "again": list(again.plan.stage_starts),
            "schedule": again.schedule_name, "micro": again.microbatches,
            "losses": [first.step(*args, target=target).item(), again.step(*args, target=target).item()]}


def test_pipeline_plan_round_trips_through_json():
    res = run_ranks(_replan, 2)
    for r in res:
        assert r["starts"] == r["again"] and len(r["starts"]) == 2
        assert r["schedule"] == "1f1b" and r["micro"] == 4
        assert r["losses"][0] == r["losses"][1]
