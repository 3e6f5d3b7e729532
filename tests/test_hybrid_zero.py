"""Hybrid-sharded ZeRO (``DataOptions(shard_group=g)``): the ZeRO-3 pieces are cut over groups of
``g`` data ranks and replicated across the groups (runtime/dp.py), on 4 gloo ranks as 2 x 2.

- A ``transformers`` Llama in float64, three SGD-momentum steps with its own loss on each
  rank's rows: every parameter equals one process's on the whole batch; the pieces are halves
  (cut over 2 ranks, not 4) and each rank's pieces equal its replica's; the same over a data
  axis of two mesh axes (dp 2 x cp 2, each sequence split in two).
- A checkpoint saved under hybrid sharding loads under plain ZeRO-3 and continues exactly.
- The bytes a rank holds (pieces, gradients, AdamW state) are what the simulator predicts for
  the same layout (cost/hybrid.py, ``Config(shard_group=2)``), within 10 %.
- Refusals: a group not dividing the data axis, hybrid sharding at ZeRO-1, with a pipeline.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.checkpoint.full import every_rank_state_dict
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

ROWS, SEQ, STEPS = 8, 8, 3
PARAM_TOL = 1e-10
GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _cases(rank: int, world: int, root: str) -> dict:
    import autopar.checkpoint  # noqa: F401 - autopar.save / autopar.load
    torch.set_num_threads(1)
    out = {}
    data = hf_tiny.batch(rows=ROWS, seq=SEQ)
    part = autopar.data.shard(data, {"dp": world})
    hybrid = autopar.DataOptions(shard_group=2)
    pm = autopar.parallelize(hf_tiny.build("llama", torch.float64), {"dp": world}, example_kwargs=part,
                             zero_stage=3, options=hybrid)
    rt = pm.dp_runtime
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(STEPS):
        pm(**part).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            autopar.save(pm, opt, root, step=2)
    out["groups"] = (rt.n, rt.replicas, rt.data_n)
    out["pieces"] = {f: t.detach().clone() for f, t in rt.shard_params.items()}
    out["state"] = {k: v.detach().clone() for k, v in every_rank_state_dict(pm).items()}
    # the data axis over two mesh axes (dp x cp, each sequence split in two): groups of 2 of its 4 ranks
    long = hf_tiny.batch(rows=ROWS // 2, seq=2 * SEQ)
    mesh = {"dp": 2, "cp": 2}
    mine = autopar.data.shard(long, mesh)
    pm4 = autopar.parallelize(hf_tiny.build("llama", torch.float64), mesh, example_kwargs=mine, zero_stage=3,
                              options=hybrid)
    opt4 = autopar.optimizer(pm4, torch.optim.SGD, lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        pm4(**mine).loss.backward()
        opt4.step()
        opt4.zero_grad()
    out["cp_groups"] = (pm4.dp_runtime.n, pm4.dp_runtime.replicas)
    out["cp_state"] = {k: v.detach().clone() for k, v in every_rank_state_dict(pm4).items()}
    # the checkpoint of step 2, loaded under plain ZeRO-3 over all 4 ranks: step 3 lands the same
    pm2 = autopar.parallelize(hf_tiny.build("llama", torch.float64, seed=7), {"dp": world}, example_kwargs=part,
                              zero_stage=3)
    opt2 = autopar.optimizer(pm2, torch.optim.SGD, lr=0.1, momentum=0.9)
    autopar.load(pm2, opt2, root)
    pm2(**part).loss.backward()
    opt2.step()
    out["resumed"] = {k: v.detach().clone() for k, v in every_rank_state_dict(pm2).items()}
    # what a rank holds under AdamW (fp32 GPT of the zoo, every tensor divisible by 2)
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    args, _ = models.example_inputs(model, 2 * world, 8, device="cpu")
    local = tuple(a.chunk(world)[dist.get_rank()] for a in args)
    pm3 = autopar.parallelize(model, {"dp": world}, local, zero_stage=3, options=hybrid)
    opt3 = autopar.optimizer(pm3, torch.optim.AdamW, lr=1e-3)
    for _ in range(2):
        opt3.zero_grad()
        pm3(*local).logsumexp(-1).mean().backward()
        opt3.step()
    rt3 = pm3.dp_runtime
    out["held"] = {"params": _bytes(pm3.parameters()),
                   "grads": _bytes([p.grad for p in pm3.parameters()] + list(rt3.sinks.values())
                                   + [m.grad for m in opt3.masters.values()]),
                   "optimizer": _bytes([v for s in opt3.state.values() for v in s.values()])}
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_ranks(_cases, 4, str(tmp_path_factory.mktemp("hybrid") / "ckpt"), timeout_s=600)


def _reference(steps: int, rows: int = ROWS, seq: int = SEQ) -> dict:
    model = hf_tiny.build("llama", torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = hf_tiny.batch(rows=rows, seq=seq)
    for _ in range(steps):
        model(**data, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_hybrid_zero3_trains_as_one_process(world4):
    want = _reference(STEPS)
    for r in world4:
        assert r["groups"] == (2, 2, 4)                   # pieces over 2 ranks, 2 replicas, 4 data ranks
        assert sorted(r["state"]) == sorted(want)
        err = max((r["state"][k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
        assert err <= PARAM_TOL, err
        err = max((r["resumed"][k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
        assert err <= PARAM_TOL, ("resumed under plain ZeRO-3", err)
    whole = sum(v.numel() for v in want.values())
    for r in world4:
        held = sum(t.numel() for t in r["pieces"].values())
        assert whole / 2 <= held < whole / 2 + 64 * len(r["pieces"])        # halves (padded), not quarters
    # over dp x cp: the same, each group two of the four ranks
    want = _reference(STEPS, ROWS // 2, 2 * SEQ)
    for r in world4:
        assert r["cp_groups"] == (2, 2)
        err = max((r["cp_state"][k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
        assert err <= PARAM_TOL, ("dp x cp", err)
    # ranks 0 and 2 (and 1 and 3) hold the same pieces: the groups are {0, 1} and {2, 3}
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(world4[a]["pieces"][f], world4[b]["pieces"][f]) for f in world4[a]["pieces"])
    assert not all(torch.equal(world4[0]["pieces"][f], world4[1]["pieces"][f]) for f in world4[0]["pieces"])


def test_hybrid_memory_is_what_the_simulator_predicts(world4):
    from autopar.cli.workload import capture_workload, load_workload
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import Config, ModelFacts, simulate
    w = load_workload("gpt", batch=1, seq=8, overrides={k: str(v) for k, v in GPT.items()})
    facts = ModelFacts(capture_workload(w), seq=8, dtype="fp32")
    cluster = Cluster.from_spec("1x4", hardware="cpu")
    sim = {g: simulate(facts, cluster, Config(dp=4, tp=1, pp=1, micro_batch=1, zero_stage=3, shard_group=g),
                       batch=8).memory for g in (0, 2)}
    for r in world4:
        got = r["held"]
        for kind in ("grads", "optimizer"):
            assert abs(got[kind] - sim[2][kind]) <= 0.10 * sim[2][kind], (kind, got[kind], sim[2][kind])
        # at rest the pieces; the simulator adds the two gathered buckets a step holds
        assert got["params"] * 0.9 <= sim[2]["params"]
    assert sim[2]["optimizer"] == pytest.approx(2 * sim[0]["optimizer"])     # half the ranks share a piece


def test_hybrid_refusals(fake_world):
    fake_world(4)
    model, data = hf_tiny.build("llama"), hf_tiny.batch(rows=4, seq=SEQ)
    with pytest.raises(autopar.ConfigError, match="does not divide"):
        autopar.parallelize(model, {"dp": 4}, example_kwargs=data, zero_stage=3,
                            options=autopar.DataOptions(shard_group=3))
    with pytest.raises(autopar.ConfigError, match="ZeRO-1"):
        autopar.parallelize(model, {"dp": 4}, example_kwargs=data, zero_stage=1,
                            options=autopar.DataOptions(shard_group=2))
    with pytest.raises(autopar.ConfigError, match="shard_group"):
        autopar.parallelize(model, {"pp": 2, "dp": 2}, example_kwargs=data, zero_stage=3,
                            options=autopar.DataOptions(shard_group=2))
    with pytest.raises(autopar.ConfigError, match="shard_group"):
        autopar.DataOptions(shard_group=-1)


def test_a_saved_hybrid_plan_keeps_its_groups_and_scales(tmp_path):
    from autopar.core.plans import Config
    from autopar.core.saved_plan import SavedPlan
    from autopar.scaled_plan import scale_plan
    c = Config(dp=32, tp=1, pp=1, micro_batch=1, zero_stage=3, shard_group=8)
    saved = SavedPlan(model="gpt", overrides={}, cluster="4x8", hardware="h100", devices=32, batch=64, seq=128,
                      dtype="bf16", config=c, microbatches=2)
    path = tmp_path / "plan.json"
    saved.save(path)
    again = SavedPlan.load(path)
    assert again.config.shard_group == 8
    scaled = scale_plan(again, world=4)
    assert scaled.options["shard_group"] == 2 and any("shard groups of 8 -> 2" in n for n in scaled.notes)
    kw = scaled.parallelize_kwargs()
    assert kw["options"].shard_group == 2 and kw["zero_stage"] == 3
    assert scale_plan(again, world=2).options.get("shard_group") is None          # one group left: plain ZeRO
    # a plan without hybrid sharding writes no shard group (older files read the same)
    plain = SavedPlan(**{**saved.__dict__, "config": Config(dp=32, tp=1, pp=1, micro_batch=1, zero_stage=3)})
    plain.save(path)
    assert "shard_group" not in path.read_text()


def test_the_planner_prices_and_offers_hybrid_sharding():
    # ZeRO-3 over 128 data ranks on 16 nodes: every gather crosses the NICs with 127 ring steps;
    # groups of a node's 8 gather over NVLink and add one all-reduce of a piece across nodes
    from autopar.cli.workload import capture_for_planning, load_workload
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import Config, ModelFacts, simulate
    from autopar.cost.plan_search import configurations
    w = load_workload("llama3-8b", batch=1, seq=4096)
    cap = capture_for_planning(w)
    facts = ModelFacts(cap.gm, seq=4096, dtype="bf16", layers=cap.block_copies)
    cluster = Cluster.from_spec("16x8", hardware="h100")
    whole, hybrid = (simulate(facts, cluster, Config(dp=128, tp=1, pp=1, micro_batch=1, zero_stage=3,
                                                     recompute="full", shard_group=g), batch=256) for g in (0, 8))
    assert hybrid.parts["dp_comm_s"] < whole.parts["dp_comm_s"]
    assert hybrid.memory["optimizer"] == pytest.approx(16 * whole.memory["optimizer"])
    offered = {c.shard_group for c in configurations(facts, devices=128, batch=256, per_node=8,
                                                     recomputes=("full",), micro_batches=(1,))}
    assert {0, 8, 64} <= offered
