"""An unmodified model-library transformer (Hugging Face Llama), tensor-parallel on real
gloo ranks, computes what the single-process model computes."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.runtime.launch import run_ranks
from tests.hf_tiny import Logits

transformers = pytest.importorskip("transformers")


def _build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=128, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return Logits(LlamaForCausalLM(cfg).eval())


def _worker(rank: int, world: int, plan) -> dict:
    model = _build()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, world, (idx,), plan=plan)
    out, ref_out = pm(idx), ref(idx)
    out.float().pow(2).mean().backward()
    ref_out.float().pow(2).mean().backward()
    ref_params = dict(ref.named_parameters())
    grad_err = 0.0
    for fqn, p in pm.named_parameters():
        want = ref_params[fqn].grad
        placement = pm.placement_of(fqn)
        if getattr(placement, "dim", None) is not None:
            want = want.chunk(world, placement.dim)[rank]
        grad_err = max(grad_err, ((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    sharded = sum(1 for fqn, _ in pm.named_parameters() if str(pm.placement_of(fqn)).startswith("S("))
    return {"out": ((out - ref_out).abs().max() / ref_out.abs().max()).item(), "grad": grad_err, "sharded": sharded}


def test_hf_llama_tp2_matches_single_process():
    model = _build()
    idx = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = autopar.plan(model, 2, (idx,), memory_budget=1)
    for res in run_ranks(_worker, 2, plan, timeout_s=300):
        assert res["sharded"] > 0
        assert res["out"] <= 1e-5
        assert res["grad"] <= 1e-5
