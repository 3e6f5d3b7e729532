"""Unmodified ``transformers`` causal LMs, called as users call them (``pm(**batch)`` with
``labels``, the model's own loss), trained on real gloo ranks under every data and tensor
layout, equal the single-process run: the loss at every step and every parameter after two
optimizer steps (the second steps on the momentum or Adam moments the first left), in float32
and float64.

Under ``tp=2`` the plan is made with ``memory_budget=1`` so that every tensor that can split
does, and the test asserts that weights really were split. One world per size runs every
case, so the file starts two worlds in all; within a world the single-process run of each
architecture, dtype and optimizer is trained once and compared with every layout's.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.placement import Spec, transition
from autopar.runtime.launch import run_ranks

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402 - after the importorskip

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "gpt2", "opt", "falcon",
         "bloom", "deepseek_v3", "t5"]
STEPS = 2
LR = 0.05
# Parameter errors are relative to the parameter's largest entry, or to FLOOR for one that
# stays near zero: OPT's key biases start at zero and their gradient is zero up to round-off.
FLOOR = 1e-2


def _optimizer(kind: str):
    if kind == "sgd":
        return torch.optim.SGD, dict(lr=LR, momentum=0.9)
    return torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


_REFERENCE: dict[tuple, tuple[list[float], dict]] = {}


def reference(arch: str, dtype: torch.dtype, opt: str) -> tuple[list[float], dict]:
    """The single-process run on the whole batch: its loss at each step and its state_dict after
    the steps. The same for every layout, so trained once per rank and architecture, dtype, optimizer."""
    key = (arch, dtype, opt)
    if key not in _REFERENCE:
        ref, data = hf_tiny.build(arch, dtype), hf_tiny.batch()
        cls, kw = _optimizer(opt)
        ropt = cls(ref.parameters(), **kw)
        losses = []
        for _ in range(STEPS):
            want = ref(**data).loss
            want.backward()
            ropt.step()
            ropt.zero_grad()
            losses.append(want.item())
        _REFERENCE[key] = losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return _REFERENCE[key]


def train_case(rank: int, world: int, arch: str, mesh: dict, zero: int, dtype: torch.dtype, opt: str,
               sequence: bool | None = None) -> dict:
    """Train the parallel model and compare it with the single-process one; the errors (and how
    many of the rank's tensor-axis conversions are reduce-scatters: a sequence-parallel layout's)."""
    model = hf_tiny.build(arch, dtype)
    ref_losses, ref_state = reference(arch, dtype, opt)
    data = hf_tiny.batch()
    dp = mesh.get("dp", 1)
    dp_rank = rank // (world // dp)
    local = {k: v.chunk(dp)[dp_rank] for k, v in data.items()}
    pp = "pp" in mesh
    pm = autopar.parallelize(model, mesh, example_kwargs=local, zero_stage=zero if dp > 1 else None,
                             memory_budget=1 if "tp" in mesh else None, sequence_parallel=sequence,
                             **(dict(schedule="1f1b", microbatches=2) if pp else {}))
    cls, kw = _optimizer(opt)
    popt = autopar.optimizer(pm, cls, **kw)
    loss_err, out = 0.0, None
    for want in ref_losses:
        if pp:
            got = pm.step(**local)                 # the model's own loss, mean over micro-batches
        else:
            out = pm(**local)
            out.loss.backward()
            got = out.loss.detach().clone()
        popt.step()
        popt.zero_grad()
        torch.distributed.all_reduce(got)          # every rank's mean over its tokens; equal token counts
        got /= world
        loss_err = max(loss_err, abs(got.item() - want) / abs(want))
    param_err, worst = 0.0, ""
    for key, value in pm.state_dict().items():
        value, want = _whole(value), ref_state[key]
        if not want.is_floating_point():
            continue
        err = ((value - want).abs().max() / want.abs().max().clamp_min(FLOOR)).item()
        if err > param_err:
            param_err, worst = err, key
    split = sum(1 for fqn, _ in pm.named_parameters() if str(pm.placement_of(fqn)).startswith("S("))
    keys = set(pm.state_dict())
    scatters = 0 if pp else sum(1 for n in pm.graph_module.graph.nodes
                                if n.target is torch.ops.autopar.redistribute.default
                                and transition(Spec.parse(n.args[1]).value, Spec.parse(n.args[2]).value).kind
                                == "reduce_scatter")
    return {"loss": loss_err, "param": param_err, "worst": worst, "split": split, "scatters": scatters,
            "output": type(out).__name__ if out is not None else "CausalLMOutput (pipeline)",
            "keys": keys == set(ref_state)}      # a pipeline's state_dict() is whole too


def run_cases(rank: int, world: int, cases: list) -> list[dict]:
    return [train_case(rank, world, *case) for case in cases]


# float32: 1e-5 relative. float64: the same bound, because these models compute parts of the
# step in float32 whatever the parameters' dtype (the llama-family and Gemma RMSNorms cast to
# float32, and the library's causal-LM loss casts the logits to float32), so a float64 run
# agrees to float32 round-off (measured up to ~4e-7), not to 1e-15. AdamW runs in float64 only:
# in float32 it turns the round-off in gradients that are exactly zero (the key biases of OPT,
# GPT-2, Bloom, Qwen2) into lr-sized steps.
TOL = {torch.float32: 1e-5, torch.float64: 1e-5}
F32, F64 = torch.float32, torch.float64
TP_F32 = ("llama",)
DP_F32 = ("llama",)      # float32 data parallelism; every architecture runs dp in float64
# pipelines on architectures of different block shapes (the llama-like ones cut like llama)
PP = ("llama", "gemma2", "phi3", "gpt_neox", "gpt2", "opt", "falcon", "bloom", "deepseek_v3", "t5")


def _world2_cases() -> list:
    cases = []
    for arch in ARCHS:
        cases.append((arch, {"tp": 2}, 0, F64, "sgd"))
        if arch in TP_F32:
            cases.append((arch, {"tp": 2}, 0, F32, "sgd"))
        if arch in DP_F32:
            cases.append((arch, {"dp": 2}, 0, F32, "sgd"))
        cases.append((arch, {"dp": 2}, 3, F64, "adamw"))
        if arch in PP:
            cases.append((arch, {"pp": 2}, 0, F64, "sgd"))
    cases += [("llama", {"tp": 2}, 0, F64, "sgd", split) for split in (True, False)]    # sequence_parallel=
    return cases


WORLD4_CASES = [(arch, {"dp": 2, "tp": 2}, zero, F64, "sgd") for arch in ("llama", "gpt2") for zero in (0, 3)]


def _check(case: tuple, res: dict) -> None:
    arch, mesh, zero, dtype, opt, *sequence = case
    what = f"{arch} {mesh} zero={zero} {dtype} {opt} sequence_parallel={sequence}: {res}"
    assert "LMOutput" in res["output"], what
    assert res["keys"], what
    assert res["loss"] <= TOL[dtype], what
    assert res["param"] <= TOL[dtype], what
    if "tp" in mesh:      # memory_budget=1: every weight that can split does
        assert res["split"] >= MIN_SPLIT[arch], what
    if sequence:          # on: each layer's attention and MLP outputs reduce-scattered to a sequence slice
        assert (res["scatters"] >= 4) == sequence[0], what


# Parameters a tp=2 plan under memory_budget=1 must split, per architecture: at least the
# attention and MLP projections of both layers (fused qkv counts once).
MIN_SPLIT = {"llama": 14, "mistral": 14, "qwen2": 14, "qwen3": 14, "gemma2": 14, "gemma3": 14, "phi3": 8,
             "gpt_neox": 8, "gpt2": 8, "opt": 12, "falcon": 8, "bloom": 8,
             "deepseek_v3": 8, "t5": 16}


@pytest.fixture(scope="module")
def world2():
    cases = _world2_cases()
    return list(zip(cases, run_ranks(run_cases, 2, cases, timeout_s=900)[0]))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_layout_matches_one_process(world2, arch):
    checked = [(case, res) for case, res in world2 if case[0] == arch]
    assert len(checked) >= 2 + (arch in PP)      # tp and dp (ZeRO-3), and pp where listed
    for case, res in checked:
        _check(case, res)


def test_data_times_tensor_axes_match_one_process():
    for case, res in zip(WORLD4_CASES, run_ranks(run_cases, 4, WORLD4_CASES, timeout_s=600)[0]):
        _check(case, res)
