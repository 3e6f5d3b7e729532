"""Attention as the fused kernels take it (passes/attention.py, runtime/attention.py).

- A grouped-query repeat (``repeat_kv``'s unsqueeze-expand-reshape, or ``repeat_interleave``)
  in front of ``scaled_dot_product_attention`` becomes ``enable_gqa=True`` on the unrepeated keys
  and values: the same result, the repeat gone from the graph.
- A ``transformers`` model's causal mask (built as a tensor under capture) runs as causal
  attention: autopar on one rank keeps exactly the bytes the eager model keeps for backward
  (before: the repeated keys and values and a float copy of the mask in every layer, 1.10x),
  and computes what it computes; a sliding-window mask shorter than the sequence still runs
  as the mask it is.
- The flop pass prices a mask made of sizes alone at the pairs it allows (causal: half).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.core.meta import evaluate, graph_info, info
from autopar.runtime.launch import run_ranks

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


class Repeats(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = v = self.kv(x).view(b, s, 2, 8).transpose(1, 2)
        if self.style == "interleave":
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        else:
            k = k[:, :, None].expand(b, 2, 2, s, 8).reshape(b, 4, s, 8)
            v = v[:, :, None].expand(b, 2, 2, s, 8).reshape(b, 4, s, 8)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("style", ["interleave", "expand"])
def test_a_grouped_query_repeat_becomes_enable_gqa(style):
    from autopar.build.prepare import capture_model
    torch.manual_seed(0)
    model = Repeats(style)
    x = torch.randn(2, 6, 32)
    gm = capture_model(model, (x,), {}, {})
    attn = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(attn) == 1 and attn[0].kwargs.get("enable_gqa") is True
    assert [tuple(info(a).values[0].shape)[1] for a in attn[0].args[1:3]] == [2, 2]    # unrepeated heads
    assert not [n for n in gm.graph.nodes if n.target in (aten.repeat_interleave.self_int, aten.expand.default)]
    params = {**dict(model.named_parameters())}
    args = [params[info(n).target_fqn] if info(n).target_fqn in params else x
            for n in gm.graph.nodes if n.op == "placeholder"]
    got = gm(*args)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.allclose(got, model(x), rtol=1e-6)


def _config(kind: str):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attention_dropout=0.0)
    if kind == "mistral":         # a sliding window shorter than the sequence: not causal
        return transformers.MistralConfig(**common, sliding_window=8)
    return transformers.LlamaConfig(**common)


def _held(fn, params) -> tuple[int, list]:
    seen: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(b for b, _ in seen.values()), out


def _one_rank(rank: int, world: int) -> dict:
    out = {}
    for kind in ("llama", "mistral"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind)).to(torch.float64)
        ref = copy.deepcopy(model)
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        pm = autopar.parallelize(model, {"dp": 1}, example_kwargs={"input_ids": ids})
        params = {p.untyped_storage().data_ptr() for p in pm.parameters()} | \
                 {p.untyped_storage().data_ptr() for p in ref.parameters()}
        got_bytes, got = _held(lambda: pm(input_ids=ids).logits, params)
        want_bytes, want = _held(lambda: ref(input_ids=ids).logits, params)
        got.square().mean().backward()
        want.square().mean().backward()
        grads = dict(ref.named_parameters())
        err = max([(got - want).abs().max().item() / want.abs().max().item()] +
                  [((p.grad - grads[f].grad).abs().max() / grads[f].grad.abs().max().clamp_min(1e-30)).item()
                   for f, p in pm.named_parameters()])
        kinds = {str(n.target).split(".")[-1] if not callable(n.target) else n.target.__name__
                 for n in pm.graph_module.graph.nodes if "sdpa" in str(n.target) or "scaled_dot" in str(n.target)}
        out[kind] = {"held": got_bytes, "eager": want_bytes, "err": err, "targets": sorted(kinds)}
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_ranks(_one_rank, 1, timeout_s=300)[0]


def test_a_causal_mask_runs_as_causal_attention_and_keeps_what_eager_keeps(one_rank):
    got = one_rank["llama"]
    assert got["targets"] == ["graph_sdpa"], got
    # no repeated keys, no mask kept for backward (and the fused norms and MLP keep less than
    # eager's, passes/fusion.py)
    assert got["held"] < got["eager"], got
    assert got["err"] < 1e-12, got


def test_a_sliding_window_mask_runs_as_the_mask_it_is(one_rank):
    got = one_rank["mistral"]
    assert got["err"] < 1e-12, got
    assert got["held"] > one_rank["llama"]["held"], got     # the mask is kept: it is not causal


def test_the_flop_pass_prices_a_causal_mask_at_half_and_a_window_at_every_pair():
    from autopar.build.prepare import capture_model
    flops = {}
    for kind in ("llama", "mistral"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind))
        gm = capture_model(model, (), None, {"input_ids": torch.randint(0, 128, (2, 32))})
        at = graph_info(gm).example_sizes
        flops[kind] = [evaluate(info(n).flops_fwd, at) for n in gm.graph.nodes
                       if n.target is aten.scaled_dot_product_attention.default]
    pair = 2 * 2 * 4 * (16 + 16)              # 2 x batch x query heads x (E + Ev)
    assert flops["llama"] == [pair * 32 * 33 // 2] * 2
    assert flops["mistral"] == [pair * 32 * 32] * 2


def test_the_repeat_stays_where_the_tensor_axis_cannot_split_the_key_heads():
    # two key heads: tp=2 splits them (unrepeated, enable_gqa); tp=4 cannot, so the keys stay
    # repeated to the four query heads, which it splits as before
    from autopar.build.prepare import capture_model
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    batch = {"input_ids": torch.randint(0, 128, (2, 16))}
    for tp, gqa, heads in ((2, True, 2), (4, None, 4)):
        gm = capture_model(model, (), None, batch, tp=tp)
        attn = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
        assert attn and all(n.kwargs.get("enable_gqa") is gqa for n in attn), (tp, [n.kwargs for n in attn])
        assert {tuple(info(n.args[1]).values[0].shape)[1] for n in attn} == {heads}, tp
