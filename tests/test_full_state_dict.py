"""``autopar.full_state_dict(pm)``: the original model's whole state dict on rank 0.

A ``transformers`` GPT-2 (tied embedding and head: two names, one tensor) in float64 trains
three SGD-momentum steps on dp=2 (ZeRO-3), tp=2 (``memory_budget=1``: weights split, asserted)
and pp=2 (the planner's schedule), beside one process. On rank 0 the gathered dict has exactly
the model's keys (the tied second name included), every tensor whole and equal to one
process's, and loads into a fresh model with ``strict=True``; every other rank gets ``{}``.
One world of 2 ranks runs every case.

Under a pipeline ``pm.state_dict()`` itself is the whole model's, on every rank (pp=2, and pp=2 x
tp=2 where a stage holds tensor-axis shards): the model's keys, every tensor whole and equal to
one process's; ``pm.local_state_dict()`` is the rank's own part; ``pm.load_state_dict`` takes a
whole state dict (another model's, strict) and each rank keeps its boxes of it.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

STEPS, TOL = 3, 1e-9


def _reference() -> dict:
    model, data = hf_tiny.build("gpt2", torch.float64), hf_tiny.batch(rows=4, seq=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _case(mesh: dict, **kw) -> dict:
    rank = dist.get_rank()
    model, data = hf_tiny.build("gpt2", torch.float64), hf_tiny.batch(rows=4, seq=8)
    part = {k: v.chunk(2)[rank] for k, v in data.items()} if "dp" in mesh else data
    pm = hf_tiny.train_parallel(model, mesh, part, STEPS, **kw)
    full = autopar.full_state_dict(pm)
    whole = _pipeline_state(pm) if "pp" in mesh else None
    split = sum(1 for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S(")) \
        if "tp" in mesh else None
    out = {"keys": sorted(full), "split": split, "loaded": None, "whole": whole}
    if full:
        fresh = hf_tiny.build("gpt2", torch.float64, seed=5)
        try:
            fresh.load_state_dict(full, strict=True)
            out["loaded"] = "ok"
        except RuntimeError as exc:
            out["loaded"] = str(exc)
        out["tied"] = fresh.lm_head.weight is fresh.transformer.wte.weight
        out["values"] = full
    return out


def _pipeline_state(pm) -> dict:
    """A pipeline rank's ``state_dict()`` (whole, every key), its own part, and a whole state dict
    of another model loaded into it (strict) and read back; a short one refused under strict."""
    got = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    other = hf_tiny.build("gpt2", torch.float64, seed=5).state_dict()
    pm.load_state_dict(other)
    back = pm.state_dict()
    err = max((back[k] - v).abs().max().item() for k, v in other.items() if v.is_floating_point())
    short = {k: v for k, v in other.items() if k != "transformer.ln_f.bias"}
    try:
        pm.load_state_dict(short)
        refused = ""
    except autopar.CheckpointError as exc:
        refused = str(exc)
    lenient = pm.load_state_dict(short, strict=False)
    return {"values": got, "local": sorted(pm.local_state_dict()), "reload_err": err, "refused": refused,
            "missing": list(lenient.missing_keys)}


def _check_pipeline_state(ranks: list[dict], want: dict) -> None:
    for rank, r in enumerate(ranks):
        got = r["whole"]
        assert sorted(got["values"]) == sorted(want), (rank, set(got["values"]) ^ set(want))
        for k, v in want.items():
            assert torch.allclose(got["values"][k], v, rtol=TOL, atol=TOL), (rank, k)
        assert set(got["local"]) < set(want), rank          # a rank's own part is part of the model
        assert got["reload_err"] == 0.0, (rank, got["reload_err"])
        assert "missing" in got["refused"] and got["missing"] == ["transformer.ln_f.bias"], got["refused"]


CASES = {"dp": ({"dp": 2}, dict(zero_stage=3)), "tp": ({"tp": 2}, dict(memory_budget=1)), "pp": ({"pp": 2}, {})}


def _all(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _case(mesh, **kw) for name, (mesh, kw) in CASES.items()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_all, 2, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_full_state_dict_is_the_models_whole_state(ranks, name):
    want = _reference()
    got, other = ranks[0][name], ranks[1][name]
    assert other["keys"] == [], other["keys"]          # rank 1: nothing
    assert got["keys"] == sorted(want), set(got["keys"]) ^ set(want)
    assert "lm_head.weight" in got["keys"]             # the tied second name is there
    assert got["loaded"] == "ok" and got["tied"], got["loaded"]
    for k, v in want.items():
        t = got["values"][k]
        assert t.shape == v.shape and t.dtype == v.dtype, k
        assert torch.allclose(t, v, rtol=TOL, atol=TOL), (k, (t - v).abs().max().item() if v.is_floating_point() else "")
    if name == "tp":
        assert got["split"] >= 4, got["split"]          # weights really were split
    if name == "pp":
        _check_pipeline_state([r[name] for r in ranks], want)


def _products(rank: int, world: int, root: str) -> dict:
    """pp=2 x tp=2 (a stage's tensor-axis shards, whole on no rank) and dp=2 x tp=2 ZeRO-3,
    trained as above; rank 0's gathered dict, and a save_pretrained directory of the first."""
    torch.set_num_threads(1)
    out = {}
    for name, mesh, kw in (("pp_tp", {"pp": 2, "tp": 2}, {}), ("dp_tp", {"dp": 2, "tp": 2}, dict(zero_stage=3, memory_budget=1))):
        model, data = hf_tiny.build("gpt2", torch.float64), hf_tiny.batch(rows=4, seq=8)
        share = (rank // 2) % mesh.get("dp", 1)
        part = {k: v.chunk(2)[share] for k, v in data.items()} if "dp" in mesh else data
        pm = hf_tiny.train_parallel(model, mesh, part, STEPS, **kw)
        split = [f for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S(")]
        full = autopar.full_state_dict(pm)
        if name == "pp_tp":
            autopar.save_pretrained(pm, f"{root}/pp_tp")
        whole = _pipeline_state(pm) if name == "pp_tp" else None     # loads other weights: last
        out[name] = {"split": split, "values": full, "whole": whole}
    return out


@pytest.fixture(scope="module")
def products(tmp_path_factory):
    root = tmp_path_factory.mktemp("products")
    return run_ranks(_products, 4, str(root), timeout_s=400), root


@pytest.mark.parametrize("name", ["pp_tp", "dp_tp"])
def test_full_state_dict_on_product_meshes(products, name):
    want = _reference()
    ranks, _ = products
    got = ranks[0][name]["values"]
    assert sorted(got) == sorted(want) and all(r[name]["values"] == {} for r in ranks[1:])
    assert ranks[0][name]["split"], "weights really were split on the tensor axis"
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=TOL, atol=TOL), k
    if name == "pp_tp":
        _check_pipeline_state([r[name] for r in ranks], want)


def test_save_pretrained_from_a_pipeline_of_tensor_shards(products):
    import transformers
    _, root = products
    got = transformers.AutoModelForCausalLM.from_pretrained(root / "pp_tp", dtype=torch.float64)
    for k, v in _reference().items():
        assert torch.allclose(got.state_dict()[k], v, rtol=TOL, atol=TOL), k
    assert got.lm_head.weight is got.transformer.wte.weight
