"""Every configuration the planner can emit builds and computes what one process computes.

Hypothesis draws configurations from the planner's own search space
(``cost/plan_search.configurations``: dp x tp x pp x ep, ZeRO stage, recomputation,
micro-batch size, schedule, virtual stages) for a small dense model and a small
mixture-of-experts model on 4 devices. Each drawn configuration is built on 4 real gloo ranks
exactly as ``autopar train`` builds a plan (``autopar.cli.train.runtime_mesh``: the planner's dp
counts the ep ranks), trained for two SGD-momentum steps, and compared with the
single-process model trained on the whole batch: each step's loss and, after the steps,
every parameter (the union of the ranks' state), to 1e-5 relative. A configuration with a
tensor axis must really split a weight. One world per drawn batch of configurations.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks
from autopar.cli.train import runtime_mesh

WORLD, BATCH, SEQ, STEPS = 4, 8, 8, 2
MODELS = {"gpt": {"layers": 4, "hidden": 32, "heads": 4, "vocab": 64, "max_seq": SEQ},
          "moe": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": SEQ, "experts": 4,
                  "top_k": 2, "capacity_factor": 4.0}}   # a capacity no routing exceeds: no token drops


@functools.lru_cache(maxsize=None)
def _space(name: str) -> list[dict]:
    from autopar.cost.hybrid import ModelFacts
    from autopar.cost.plan_search import configurations
    from autopar.cli.workload import capture_workload, load_workload

    w = load_workload(name, batch=BATCH, seq=SEQ, overrides={k: str(v) for k, v in MODELS[name].items()})
    facts = ModelFacts(capture_workload(w), seq=SEQ, dtype="fp32")
    return [{"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "zero_stage": c.zero_stage, "recompute": c.recompute,
             "micro_batch": c.micro_batch, "schedule": c.schedule, "virtual": c.virtual}
            for c in configurations(facts, devices=WORLD, batch=BATCH, per_node=WORLD)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _one(name: str, cfg: dict) -> dict:
    torch.manual_seed(0)
    model = models.build(name, MODELS[name], device="cpu")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x = torch.randint(0, MODELS[name]["vocab"], (BATCH, SEQ))
    y = torch.randint(0, MODELS[name]["vocab"], (BATCH, SEQ))
    dp, tp, pp = cfg["dp"], cfg["tp"], cfg["pp"]
    share = (dist.get_rank() // tp) % dp            # every data replica, ep ranks included, has its rows
    lx, ly = x.chunk(dp)[share], y.chunk(dp)[share]
    calls = lx.shape[0] // cfg["micro_batch"]
    opts = dict(zero_stage=cfg["zero_stage"], recompute=cfg["recompute"])
    if tp > 1:    # below the replicated state: the solver must split this tiny model's weights
        opts["memory_budget"] = 0.75 * 16 * sum(p.numel() for p in model.parameters())
    if pp > 1:
        opts.update(loss_fn=_loss, schedule=cfg["schedule"], microbatches=calls,
                    virtual_stages=cfg["virtual"] if cfg["schedule"] == "interleaved" else None)
    pm = autopar.parallelize(model, runtime_mesh(cfg), (lx,), **opts)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_err = 0.0
    for _ in range(STEPS):
        want = _loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if pp > 1:
            loss = pm.step(lx, target=ly).detach().clone()
        else:
            loss = torch.zeros(())
            for xi, yi in zip(lx.chunk(calls), ly.chunk(calls)):
                part = _loss(pm(xi), yi) / calls
                part.backward()
                loss += part.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()     # tp and pp ranks hold the same value: the mean of the shares
        loss_err = max(loss_err, abs(loss.item() - want.item()) / abs(want.item()))
    ref_state = ref.state_dict()
    scale = max(p.abs().max().item() for p in ref.parameters())
    owned = getattr(pm, "expert_owned", None) or {}
    if not owned and getattr(pm, "ep_runtimes", None):
        from autopar.core.meta import graph_info
        owned = {f: pm.ep_runtimes[r.fqn].owned() for r in graph_info(pm.graph_module).moe_regions
                 for f in r.expert_params}
    param_err, split = 0.0, 0
    for fqn, v in pm.state_dict().items():
        if hasattr(v, "full_tensor"):
            v, split = v.full_tensor(), split + 1
        want = ref_state[fqn]
        if fqn in owned and v.shape[0] != want.shape[0]:
            want = want[list(owned[fqn])]
        if v.shape != want.shape:         # a pipeline's tensor-axis slice
            dim = next(d for d in range(v.dim()) if v.shape[d] != want.shape[d])
            want, split = want.chunk(tp, dim)[dist.get_rank() % tp], split + 1
        param_err = max(param_err, (v - want).abs().max().item() / scale)
    state = pm.state_dict()               # whole (tensor-axis-local) values; the module may hold pieces
    held = {f: p.numel() for f, p in pm.named_parameters()}
    sharded = any(n < (state[f].to_local() if hasattr(state[f], "to_local") else state[f]).numel()
                  for f, n in held.items() if f in state)
    return {"loss_err": loss_err, "param_err": param_err, "split": split, "keys": sorted(pm.state_dict()),
            "all": sorted(ref_state), "sharded": sharded, "zero": pm.plan.zero_stage}


def _cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    return [_one(name, cfg) for name, cfg in cases]


@settings(max_examples=1, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_drawn_planner_configurations_build_and_match(data):
    cases = [("gpt", c) for c in data.draw(st.lists(st.sampled_from(_space("gpt")), min_size=4, max_size=4,
                                                    unique_by=lambda c: tuple(sorted(c.items()))))]
    cases += [("moe", c) for c in data.draw(st.lists(st.sampled_from(_space("moe")), min_size=3, max_size=3,
                                                     unique_by=lambda c: tuple(sorted(c.items()))))]
    results = run_ranks(_cases, WORLD, cases, timeout_s=600)
    for i, (name, cfg) in enumerate(cases):
        got = [r[i] for r in results]
        for r in got:
            assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, (name, cfg, r)
        assert set().union(*(r["keys"] for r in got)) == set(got[0]["all"]), (name, cfg)
        if cfg["tp"] > 1:
            assert any(r["split"] for r in got), (name, cfg)


def _cfg(dp: int, tp: int, pp: int, ep: int = 1, *, zero: int = 0, recompute: str = "none", micro: int = 1,
         schedule: str = "gpipe", virtual: int = 1) -> dict:
    return {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "zero_stage": zero, "recompute": recompute, "micro_batch": micro,
            "schedule": schedule, "virtual": virtual}


# Named corners of the space, run every time: experts with each ZeRO stage, with and without a
# pipeline; ZeRO-3 with recomputation beside a tensor axis.
FIXED = [("moe", _cfg(4, 1, 1, 2, zero=1)), ("moe", _cfg(4, 1, 1, 2, zero=2, micro=2)),
         ("moe", _cfg(4, 1, 1, 4, zero=3, recompute="full")), ("moe", _cfg(2, 1, 2, 2, zero=3, schedule="1f1b")),
         ("gpt", _cfg(2, 2, 1, zero=3, recompute="full")), ("gpt", _cfg(2, 1, 2, zero=2, recompute="selective",
                                                                         schedule="zb"))]


def test_named_corners_build_and_match():
    results = run_ranks(_cases, WORLD, FIXED, timeout_s=600)
    for i, (name, cfg) in enumerate(FIXED):
        got = [r[i] for r in results]
        for r in got:
            assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, (name, cfg, r)
            assert r["zero"] == cfg["zero_stage"], (name, cfg, r)
        if cfg["zero_stage"] == 3 and cfg["pp"] == 1:      # parameters are stored as pieces between steps
            assert all(r["sharded"] for r in got), (name, cfg)
        if cfg["tp"] > 1:
            assert any(r["split"] for r in got), (name, cfg)


def test_the_space_has_every_axis_and_stage():
    """What the draws come from: every axis, ZeRO stage, schedule and recompute mode occurs."""
    space = _space("gpt") + _space("moe")
    assert {c["zero_stage"] for c in space} == {0, 1, 2, 3}
    assert {c["recompute"] for c in space} == {"none", "selective", "pointwise", "full"}
    assert {c["schedule"] for c in space if c["pp"] > 1} == {"1f1b", "interleaved", "gpipe", "zb", "dualpipev"}
    assert any(c["ep"] > 1 and c["pp"] > 1 for c in space) and any(c["ep"] > 1 and c["zero_stage"] for c in space)
    assert any(c["tp"] > 1 and c["pp"] > 1 for c in space) and any(c["tp"] > 1 and c["dp"] > 1 for c in space)
