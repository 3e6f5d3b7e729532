"""Tests of the model zoo: configs, param counts, dynamic-shape export, numerics."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim, export

from autopar.core.errors import ConfigError
from autopar.models import (
    GPTConfig, LlamaConfig, MLPConfig, MoEConfig, MoELayer, active_param_count, build,
    example_inputs, expert_capacity, get_config, list_models, param_count,
)

SMALL = {
    "gpt": {"layers": 2},
    "llama": {"layers": 2},
    "moe": {"layers": 2},
    "mlp": {"depth": 3},
}

PUBLISHED = {  # name: (total, active) in parameters
    "gpt3-175b": (175e9, None),
    "llama3-8b": (8.03e9, None),
    "llama3-70b": (70.6e9, None),
    "llama3-405b": (405.9e9, None),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
}


def _dynamic_shapes(dims: tuple[dict[int, str], ...], max_seq: int) -> tuple[dict[int, Dim], ...]:
    made = {"batch": lambda: Dim("batch", min=1, max=1 << 20),
            "seq": lambda: Dim("seq", min=2, max=max_seq)}
    named = {n: made[n]() for d in dims for n in d.values()}
    return tuple({i: named[n] for i, n in d.items()} for d in dims)


def _export(model: torch.nn.Module, device: str):
    args, dims = example_inputs(model, 2, 8, device=device)
    max_seq = getattr(model.config, "max_seq", 1024)
    return export(model, args, dynamic_shapes=_dynamic_shapes(dims, max_seq), strict=False), dims


# ---------------------------------------------------------------- registry / configs

def test_list_models_has_required_names() -> None:
    names = set(list_models())
    for n in ("gpt2-small", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b",
              "mixtral-8x7b", "mixtral-8x22b", "mlp", "gpt", "llama", "moe"):
        assert n in names


def test_named_config_shapes() -> None:
    c = get_config("gpt2-small")
    assert (c.layers, c.hidden, c.heads, c.vocab, c.max_seq) == (12, 768, 12, 50257, 1024)
    c = get_config("llama3-405b")
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab) == (16384, 126, 128, 8, 53248, 128256)
    assert c.rope_theta == 500000
    c = get_config("mixtral-8x22b")
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.experts, c.top_k, c.vocab) == \
        (6144, 56, 48, 8, 16384, 8, 2, 32768)


def test_overrides_convert_strings() -> None:
    c = get_config("moe", {"hidden": "128", "layers": 3, "experts": "8", "capacity_factor": "0.5",
                           "top_k": 1.0})
    assert (c.hidden, c.layers, c.experts, c.top_k, c.capacity_factor) == (128, 3, 8, 1, 0.5)
    assert isinstance(c.hidden, int) and isinstance(c.capacity_factor, float)
    assert get_config("mlp", {"width": "64", "depth": "2"}) == MLPConfig(width=64, depth=2)


def test_unknown_name_and_key_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="llama3-8b"):
        get_config("llama-9000")
    with pytest.raises(ConfigError, match="kv_heads"):
        get_config("llama", {"num_layers": 2})
    with pytest.raises(ConfigError):
        get_config("gpt", {"kv_heads": 2})
    with pytest.raises(ConfigError):
        get_config("gpt", {"layers": "two"})
    with pytest.raises(ConfigError, match="divisible"):
        get_config("gpt", {"hidden": 100, "heads": 3})


def test_config_validation_raises_value_error() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(hidden=10, heads=3)
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(hidden=64, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(capacity_factor=0.0)
    with pytest.raises(TypeError):
        GPTConfig(256)  # keyword-only


# ---------------------------------------------------------------- param counts

@pytest.mark.parametrize("name", list_models())
def test_param_count_matches_meta_build(name: str) -> None:
    t0 = time.perf_counter()
    model = build(name)
    assert time.perf_counter() - t0 < 5.0
    assert all(p.is_meta for p in model.parameters())
    cfg = get_config(name)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    if name in PUBLISHED:
        total, active = PUBLISHED[name]
        assert param_count(cfg) == pytest.approx(total, rel=0.01)
        if active is not None:
            assert active_param_count(cfg) == pytest.approx(active, rel=0.01)
        else:
            assert active_param_count(cfg) == param_count(cfg)


def test_build_dtype() -> None:
    model = build("llama", {"layers": 1}, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# ---------------------------------------------------------------- export with dynamic dims

@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "mlp"])
def test_export_keeps_batch_and_seq_symbolic(name: str, device: str) -> None:
    torch.manual_seed(0)
    model = build(name, SMALL[name], device=device)
    ep, dims = _export(model, device)
    inputs = [n for n in ep.graph.nodes if n.op == "placeholder"
              and n.name not in ep.graph_signature.inputs_to_parameters
              and n.name not in ep.graph_signature.inputs_to_buffers]
    assert len(inputs) == len(dims)
    for node, d in zip(inputs, dims):
        shape = node.meta["val"].shape
        for i in d:
            assert isinstance(shape[i], torch.SymInt), (name, i, shape)
        if len(d) == 2:
            assert str(shape[0]) != str(shape[1])
    if device == "cpu":  # the exported graph runs at other sizes and agrees with eager
        for batch, seq in ((3, 5), (1, 11)):
            args, _ = example_inputs(model, batch, seq, device="cpu")
            torch.testing.assert_close(ep.module()(*args), model(*args))


def test_moe_capacity_is_exact_integer_ceil() -> None:
    for cf in (0.3, 0.5, 1.0, 1.25, 2.0, 3.7):
        for tokens in (1, 2, 7, 16, 1000, 12345):
            for experts, k in ((4, 1), (8, 2), (3, 2)):
                want = max(2, math.ceil(cf * tokens * k / experts - 1e-9))
                assert expert_capacity(tokens, experts, k, cf) == want


def test_moe_export_capacity_symbolic() -> None:
    model = build("moe", {"layers": 1, "capacity_factor": 0.5}, device="cpu")
    ep, _ = _export(model, "cpu")
    buffers = [n for n in ep.graph.nodes if n.target == torch.ops.aten.new_zeros.default]
    assert buffers, "no expert buffer in the graph"
    for node in buffers:  # [E, C, h] with a symbolic capacity C, not a specialised constant
        cap = node.meta["val"].shape[1]
        assert isinstance(cap, torch.SymInt), node.meta["val"].shape
        assert "Float" not in str(cap) and "Ceil" not in str(cap), f"float capacity maths: {cap}"
    assert "//" in ep.graph_module.code
    for batch, seq in ((1, 2), (4, 13), (7, 3)):
        args, _ = example_inputs(model, batch, seq, device="cpu")
        torch.testing.assert_close(ep.module()(*args), model(*args))


# ---------------------------------------------------------------- numerics on cpu

@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "mlp"])
def test_forward_backward_all_params_get_grads(name: str) -> None:
    torch.manual_seed(0)
    model = build(name, SMALL[name], device="cpu")
    (x,), _ = example_inputs(model, 2, 8, device="cpu")
    out = model(x)
    if name == "mlp":
        assert out.shape == (2, model.config.width)
        loss = out.pow(2).mean()
    else:
        assert out.shape == (2, 8, model.config.vocab)
        assert int(x.min()) >= 0 and int(x.max()) < model.config.vocab
        loss = F.cross_entropy(out.flatten(0, 1), x.roll(-1, 1).flatten())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


def test_moe_dropped_tokens_get_zero_output() -> None:
    torch.manual_seed(0)
    hidden, tokens = 16, 8
    layer = MoELayer(hidden, 32, experts=4, top_k=2, capacity_factor=0.5)
    with torch.no_grad():  # every token prefers expert 0, then expert 1
        layer.router.weight.copy_(torch.tensor([[1.0], [0.5], [-1.0], [-1.0]]).expand(4, hidden))
    x = torch.rand(1, tokens, hidden) + 0.1
    assert expert_capacity(tokens, 4, 2, 0.5) == 2
    out = layer(x)[0]
    assert out[:2].abs().sum(-1).gt(0).all()  # first two tokens fit in both experts
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))  # the rest are dropped everywhere
    model = build("moe", {"layers": 1, "capacity_factor": 0.25}, device="cpu")
    (idx,), _ = example_inputs(model, 2, 8, device="cpu")
    model(idx).sum().backward()  # a model that drops tokens still runs forward and backward


def test_moe_layer_matches_dense_reference_when_nothing_dropped() -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 24, experts=4, top_k=2, capacity_factor=2.0)  # C = T >= any load
    x = torch.randn(2, 5, 16)
    flat = x.reshape(-1, 16)
    probs = F.softmax(layer.router(flat), dim=-1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(idx[t, j])
            h = F.silu(flat[t] @ layer.w_gate[e].T) * (flat[t] @ layer.w_up[e].T)
            ref[t] += w[t, j] * (h @ layer.w_down[e].T)
    torch.testing.assert_close(layer(x).reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)


def _manual_mha(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    from autopar.models.llama import apply_rope
    b, s, _ = x.shape
    nh, d = attn.heads, attn.head_dim
    q = apply_rope(attn.q_proj(x).view(b, s, nh, d).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, s, nh, d).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(b, s, nh, d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.o_proj(y.transpose(1, 2).reshape(b, s, nh * d))


def test_gqa_equals_mha_reference_and_replicated_kv() -> None:
    from autopar.models.llama import LlamaAttention, rope_cos_sin
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    cos, sin = rope_cos_sin(6, 8, 10000.0, x.device, x.dtype)
    mha = LlamaAttention(LlamaConfig(hidden=32, heads=4, kv_heads=4))
    torch.testing.assert_close(mha(x, cos, sin), _manual_mha(mha, x, cos, sin))
    gqa = LlamaAttention(LlamaConfig(hidden=32, heads=4, kv_heads=2))
    with torch.no_grad():  # give the MHA copy each kv head repeated for its query group
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(2, 8, 32).repeat_interleave(2, dim=0)
            getattr(mha, name).weight.copy_(w.reshape(32, 32))
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_causal(name: str) -> None:
    torch.manual_seed(0)
    model = build(name, SMALL[name], device="cpu")
    (idx,), _ = example_inputs(model, 2, 10, device="cpu")
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % model.config.vocab
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_example_inputs_by_name() -> None:
    args, dims = example_inputs("llama3-8b", 4, 128)
    assert args[0].shape == (4, 128) and args[0].is_meta and args[0].dtype == torch.long
    assert dims == ({0: "batch", 1: "seq"},)
    args, dims = example_inputs("mlp", 3, 0, overrides={"width": 8}, device="cpu")
    assert args[0].shape == (3, 8) and dims == ({0: "batch"},)
    with pytest.raises(ConfigError):
        example_inputs("gpt2-small", 1, 4096)
