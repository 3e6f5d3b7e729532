"""Hugging Face directories in and out of a parallel model.

``autopar.save_pretrained(pm, dir)`` from tp=2 under ``torchrun`` (a tiny Llama trained under
``LambdaLR`` then ``get_cosine_schedule_with_warmup``; the learning rates follow the schedules)
and from dp=2 ZeRO-3, pp=2 and ep=2 (a two-rank world): ``from_pretrained`` in one process
gives the parallel model's logits (tp) or a one-process run's (float64, SGD-momentum; the tied
GPT-2 head stays tied). ``autopar.load`` reads a directory ``transformers`` wrote, and a plain
``torch.distributed.checkpoint`` save of a model's ``state_dict`` (with and without a
``"model"`` level), into tp=2 and pp=2: the whole state equals the source.
"""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.core.errors import CheckpointError
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

ROOT = Path(__file__).resolve().parents[1]
STEPS, TOL = 2, 1e-9


def _sgd_train(model, data, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _mixtral(dtype=torch.float64):
    import transformers
    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=hf_tiny.VOCAB, max_position_embeddings=32,
                                     num_experts_per_tok=2, experts_implementation="batched_mm", bos_token_id=0,
                                     eos_token_id=1, pad_token_id=2, intermediate_size=48, num_local_experts=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.to(dtype)


SAVES = {"dp": ("gpt2", {"dp": 2}, dict(zero_stage=3)), "pp": ("gpt2", {"pp": 2}, {}),
         "ep": ("mixtral", {"ep": 2}, {})}


def _model(arch: str):
    return _mixtral() if arch == "mixtral" else hf_tiny.build(arch, torch.float64)


def _save_case(name: str, root: str) -> dict:
    arch, mesh, kw = SAVES[name]
    rank = dist.get_rank()
    model, data = _model(arch), hf_tiny.batch(rows=4, seq=8)
    part = {k: v.chunk(2)[rank] for k, v in data.items()} if ("dp" in mesh or "ep" in mesh) else data
    pm = hf_tiny.train_parallel(model, mesh, part, STEPS, **kw)
    autopar.save_pretrained(pm, Path(root, name))
    held = {"ep": len(getattr(pm, "ep_runtimes", {}))} if "ep" in mesh else {}
    return held


def _load_case(mesh: dict, source: str, kw: dict) -> dict:
    model, data = hf_tiny.build("llama", torch.float64, seed=3), hf_tiny.batch(rows=4, seq=8)
    pm = autopar.parallelize(model, mesh, example_kwargs=data, **kw)
    autopar.load(pm, None, source)
    return {k: v for k, v in autopar.full_state_dict(pm).items()}


def _all(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    torch.set_num_threads(1)
    out = {name: _save_case(name, root) for name in SAVES}
    source = hf_tiny.build("llama", torch.float64, seed=11)
    if rank == 0:
        source.save_pretrained(Path(root, "theirs"))              # transformers' own writer
    dcp.save(source.state_dict(), checkpoint_id=str(Path(root, "dcp")))
    dcp.save({"model": source.state_dict()}, checkpoint_id=str(Path(root, "dcp_nested")))
    dist.barrier()
    loads = {}
    for mesh, kw in (({"tp": 2}, dict(memory_budget=1)), ({"pp": 2}, {})):
        for src in ("theirs", "dcp", "dcp_nested"):
            loads[f"{next(iter(mesh))}/{src}"] = _load_case(mesh, str(Path(root, src)), kw)
    try:                                                       # a directory of another model: refused on every rank
        _load_case({"tp": 2}, str(Path(root, "dp")), dict(memory_budget=1))
        out["wrong"] = None
    except CheckpointError as exc:
        out["wrong"] = str(exc)
    out["loads"] = loads
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return run_ranks(_all, 2, str(root), timeout_s=500), root


@pytest.mark.parametrize("name", list(SAVES))
def test_save_pretrained_from_any_mesh_loads_in_transformers(world, name):
    import transformers
    results, root = world
    arch, mesh, _ = SAVES[name]
    data = hf_tiny.batch(rows=4, seq=8)
    ref = _sgd_train(_model(arch), data)
    extra = dict(experts_implementation="batched_mm") if arch == "mixtral" else {}   # float64 has no grouped_mm
    got = transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float64, **extra)
    assert sorted(got.state_dict()) == sorted(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.allclose(got.state_dict()[k], v, rtol=TOL, atol=TOL), k
    with torch.no_grad():
        want, have = ref(**data).logits, got(**data).logits
    assert torch.allclose(have, want, rtol=TOL, atol=TOL), (have - want).abs().max().item()
    if arch == "gpt2":                                   # the tied head stays one tensor
        assert got.lm_head.weight is got.transformer.wte.weight
    if name == "ep":
        assert results[0][name]["ep"] > 0                # experts really were spread


@pytest.mark.parametrize("src", ["theirs", "dcp", "dcp_nested"])
@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_load_reads_transformers_and_plain_dcp_directories(world, axis, src):
    results, _ = world
    want = hf_tiny.build("llama", torch.float64, seed=11).state_dict()
    got = results[0]["loads"][f"{axis}/{src}"]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert results[1]["loads"][f"{axis}/{src}"] == {}


def test_a_directory_of_another_model_is_refused_on_every_rank(world):
    results, _ = world
    for r in results:
        assert r["wrong"] is not None and "do not fit this model" in r["wrong"], r["wrong"]


def test_pickled_weights_are_refused(tmp_path):
    model = hf_tiny.build("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        autopar.load(model, None, tmp_path)


def test_save_pretrained_under_torchrun_after_torch_schedulers(tmp_path):
    """tp=2 under torchrun: LambdaLR then cosine with warmup; from_pretrained gives the
    parallel model's logits."""
    import transformers
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "tests" / "pretrained_run.py"), str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["split"] >= 4, result["split"]             # weights really were split
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    want = []
    for schedule, steps in ((torch.optim.lr_scheduler.LambdaLR(probe, lambda s: 1.0 / (1 + s)), 3),
                            (transformers.get_cosine_schedule_with_warmup(probe, 2, 6), 4)):
        for _ in range(steps):
            want.append(probe.param_groups[0]["lr"])
            probe.step()
            schedule.step()
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(result["lrs"], want)), (result["lrs"], want)
    assert len(result["lrs"]) == len(want) == 7
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model(**hf_tiny.batch(rows=4, seq=8)).logits
    assert torch.allclose(logits, result["logits"], atol=1e-5, rtol=1e-5), (logits - result["logits"]).abs().max()
