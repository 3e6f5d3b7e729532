"""Data parallelism and ZeRO 0-3 compute what the single-process model computes.

Real gloo processes (world 2 and 4, and a 2 x 2 dp x tp mesh), one world per size shared
by every case of the file. Every rank builds the model with the same seed, trains its
parallel copy on its share of a global batch for two AdamW steps (the second runs on the
moments the first left; optionally accumulating two micro-batches per step), and trains a
single-process copy on the whole batch (each rank's share and micro-batch in turn, the
loss scaled exactly as data parallelism averages it). Per step, the loss of each share
must match within 1e-5 relative; after the steps every parameter (whole, from
``state_dict()``) and the optimizer's moments (``state_dict()`` keyed by parameter name)
must match within 1e-5 relative to the model's scale.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

STEPS = 2
RTOL = 1e-5
STAGES = (0, 1, 2, 3)


def _build(name: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    m = models.build(name, overrides, device="cpu")
    for fqn, p in m.named_parameters():
        # Attention is invariant to a constant added to every key: the key bias's gradient is
        # exactly zero and any rounding noise would drive AdamW, so it is frozen (which also
        # exercises frozen parameters in every stage).
        if fqn.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return m


def _loss(name: str, out: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return out.pow(2).mean()
    torch.manual_seed(2)
    target = torch.randint(0, out.shape[-1], out.shape[:-1])
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return (a - b).abs().max().item() / max(scale, 1e-12)


def _train_stage(name: str, overrides: dict, mesh: dict, stage: int, batch: int, seq: int, micro: int,
                 overlap: bool) -> dict:
    dp, tp = mesh.get("dp", 1), mesh.get("tp", 1)
    model = _build(name, overrides)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch, seq, device="cpu")
    dp_rank = dist.get_rank() // tp
    local = tuple(a.chunk(dp)[dp_rank] for a in args)
    pm = autopar.parallelize(model, mesh, local, zero_stage=stage, overlap=overlap, bucket_bytes=4096,
                             memory_budget=1 if tp > 1 else None)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    loss_err = 0.0
    for _ in range(STEPS):
        for mb in range(micro):
            piece = tuple(a.chunk(micro)[mb] for a in local)
            loss = _loss(name, pm(*piece)) / micro
            loss.backward()
            with torch.no_grad():
                want = _loss(name, ref(*piece)) / micro
            loss_err = max(loss_err, _rel(loss.detach(), want, want.abs().item()))
        for d in range(dp):           # the single-process step sees the whole global batch
            for mb in range(micro):
                piece = tuple(a.chunk(dp)[d].chunk(micro)[mb] for a in args)
                (_loss(name, ref(*piece)) / (micro * dp)).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    sd, ref_sd = pm.state_dict(), ref.state_dict()
    scale = max(v.abs().max().item() for v in ref_sd.values())
    param_err = max(_rel(_whole(sd[k]), v, scale) for k, v in ref_sd.items())
    moved = max(_rel(_whole(sd[k]), v, scale) for k, v in _build(name, overrides).state_dict().items())
    osd = opt.state_dict()
    names = {id(p): k for k, p in ref.named_parameters()}
    ref_state = {names[id(p)]: s for p, s in ref_opt.state.items()}
    moment_err = 0.0
    for fqn, s in osd["state"].items():
        want = ref_state[fqn]["exp_avg"]
        got = s["exp_avg"]
        if got.shape != want.shape:   # split on the tensor axis: the state is this rank's slice
            want = want.chunk(tp, pm.placement_of(fqn).dim)[pm._rank]
        moment_err = max(moment_err, _rel(got, want, want.abs().max().item() + 1e-8))
    return {"loss": loss_err, "param": param_err, "moved": moved, "moment": moment_err,
            "keys": sorted(sd) == sorted(ref_sd),
            "opt_keys": sorted(osd["state"]) == sorted(k for k, p in ref.named_parameters() if p.requires_grad)}


def _ranks(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Every case of one world: each (name, overrides, mesh, batch, seq, micro, stages, overlap)."""
    torch.set_num_threads(1)
    return [{stage: _train_stage(name, overrides, mesh, stage, batch, seq, micro, overlap) for stage in stages}
            for name, overrides, mesh, batch, seq, micro, stages, overlap in cases]


def case(name: str, overrides: dict, mesh: dict, batch: int, seq: int, micro: int,
         stages: tuple[int, ...] = STAGES, overlap: bool = True) -> tuple:
    return name, overrides, mesh, batch, seq, micro, stages, overlap


def check(results: list[dict], name: str, overrides: dict, mesh: dict, batch: int, seq: int, micro: int,
          stages: tuple[int, ...], overlap: bool) -> None:
    """``results``: each rank's result for this case."""
    assert len(results) == mesh.get("dp", 1) * mesh.get("tp", 1)
    for rank, by_stage in enumerate(results):
        assert sorted(by_stage) == sorted(stages)
        for stage, r in by_stage.items():
            what = (f"rank {rank}, ZeRO-{stage}, {name} {overrides}, mesh {mesh}, batch {batch}, seq {seq}, "
                    f"micro-batches {micro}, overlap {overlap}")
            assert r["keys"] and r["opt_keys"], f"{what}: state_dict keys are not the original names"
            assert r["moved"] > 100 * RTOL, f"{what}: training did not move the parameters ({r['moved']:.1e})"
            for k in ("loss", "param", "moment"):
                assert r[k] <= RTOL, f"{what}: {k} differs by {r[k]:.2e} relative"


WORLDS = [pytest.param(2, 2, id="dp2-accumulate2"), pytest.param(4, 1, id="dp4")]
# The model of each (dp, micro-batches) case: the example Hypothesis drew when each of these
# started its own world (derandomized, one example: the simplest in each space, here for
# gpt heads in {2, 4} x head_dim in {4, 8} x layers 1..2 x rows per rank 1..2 x seq in {4, 8};
# llama heads in {2, 4} x kv heads heads/{1, 2} x layers 1..2 x seq in {4, 8}; mlp width in
# {6, 16, 24} x depth 1..3 x rows per rank 1..3). Drawn once here, so one world runs them all.
ZOO = {
    "gpt": (dict(layers=1, hidden=8, heads=2, vocab=64, max_seq=16), 1, 4),          # overrides, rows per rank, seq
    "llama": (dict(layers=1, hidden=16, heads=2, kv_heads=2, ffn=24, vocab=48, max_seq=16), 1, 4),
    "mlp": (dict(width=6, depth=1), 1, 1),
}
DP_TP = {
    "gpt": dict(layers=1, hidden=16, heads=4, vocab=64, max_seq=16),
    "llama": dict(layers=1, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=64, max_seq=16),
    "mlp": dict(width=16, depth=2),
}
OVERLAP_OFF = case("gpt", dict(layers=2, hidden=16, heads=2, vocab=64, max_seq=16), {"dp": 2}, 4, 4, 1,
                   stages=(0, 2, 3), overlap=False)


def _cases() -> dict:
    """test key -> case, every case of the file."""
    cases = {}
    for dp, micro in ((2, 2), (4, 1)):
        for name, (ov, per_rank, seq) in ZOO.items():
            cases[(name, dp, micro)] = case(name, ov, {"dp": dp}, dp * micro * per_rank, seq, micro)
    for name, ov in DP_TP.items():
        cases[(name, "dp2_tp2")] = case(name, ov, {"dp": 2, "tp": 2}, 4, 4 if name != "mlp" else 1, 2)
    cases["overlap_off"] = OVERLAP_OFF
    return cases


CASES = _cases()


def _size(c: tuple) -> int:
    return c[2].get("dp", 1) * c[2].get("tp", 1)


def _world(size: int) -> dict:
    """test key -> each rank's result, for every case on ``size`` ranks: one world runs them all."""
    mine = [k for k, c in CASES.items() if _size(c) == size]
    results = run_ranks(_ranks, size, [CASES[k] for k in mine], timeout_s=900)
    return {k: [r[i] for r in results] for i, k in enumerate(mine)}


def _verify(request, key) -> None:
    c = CASES[key]
    check(request.getfixturevalue(f"world{_size(c)}")[key], *c)


@pytest.mark.parametrize("dp,micro", WORLDS)
def test_gpt_zero_stages_match_single_process(request, dp, micro):
    _verify(request, ("gpt", dp, micro))


@pytest.mark.parametrize("dp,micro", WORLDS)
def test_llama_zero_stages_match_single_process(request, dp, micro):
    _verify(request, ("llama", dp, micro))


@pytest.mark.parametrize("dp,micro", WORLDS)
def test_mlp_zero_stages_match_single_process(request, dp, micro):
    _verify(request, ("mlp", dp, micro))


@pytest.mark.parametrize("name", list(DP_TP))
def test_dp2_tp2_matches_single_process(request, name):
    _verify(request, (name, "dp2_tp2"))


def test_overlap_off_matches_too(request):
    _verify(request, "overlap_off")
