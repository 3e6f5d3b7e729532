"""Published-scale models analysed on the meta device, checked against analytic formulas
(the transformer FLOP and parameter formulas of bench/anchors/README.md).

Each model is captured and analysed at its published width with 2 and with 3 layers, and its
figures extrapolated to the published depth: every figure of these uniform stacks is linear in
the layer count (the capture of all 80-96 layers took most of a minute on 2 cores). That the
planner's figures from fewer layers equal the whole model's is tested in
tests/test_plan_capture.py."""
from __future__ import annotations

import dataclasses

import pytest

from autopar import models
from autopar.summary import at, totals
from tests.conftest import analysed

B, S = 1, 2048
CAUSAL = (S + 1) / (2 * S)    # a causal kernel computes the S(S+1)/2 query-key pairs at or below the diagonal


def analyse(name: str, overrides=None):
    overrides = dict(overrides or {})
    cfg = models.build(name, overrides, device="meta").config
    got = []
    for layers in (2, 3):
        model = models.build(name, {**overrides, "layers": layers}, device="meta")
        args, dims = models.example_inputs(model, 2, 8)
        got.append(totals(analysed(model, args, dims, max_sizes={"seq": model.config.max_seq})))
    two, three = got
    more = cfg.layers - 2
    grown = {f: getattr(two, f) + more * (getattr(three, f) - getattr(two, f))
             for f in ("params", "active_params", "flops_fwd", "flops_bwd")}
    return cfg, dataclasses.replace(two, **grown)


def test_gpt3_175b_params_and_flops():
    cfg, t = analyse("gpt3-175b")
    assert 174e9 <= t.params <= 176e9
    l, h, v = cfg.layers, cfg.hidden, cfg.vocab
    # Megatron's parameter formula (it omits the final LayerNorm's 2h)
    assert t.params == pytest.approx(12 * l * h * h * (1 + 13 / (12 * h) + (v + S) / (12 * l * h)) + 2 * h, rel=1e-9)
    fwd = at(t.flops_fwd, {"batch": B, "seq": S})
    attention = 4 * B * S * S * h * l * CAUSAL
    assert fwd == pytest.approx(2 * t.params * B * S + attention, rel=0.02)
    # Model FLOPs per step (forward + backward, no recompute): 72·B·s·l·h²·(1 + s/6h + V/12lh), its
    # attention term s/6h (every pair) at the causal share
    step = fwd + at(t.flops_bwd, {"batch": B, "seq": S})
    assert step == pytest.approx(72 * B * S * l * h * h * (1 + CAUSAL * S / (6 * h) + v / (12 * l * h)), rel=0.01)


def test_llama3_70b_params_and_flops():
    cfg, t = analyse("llama3-70b")
    assert t.params == pytest.approx(70.6e9, rel=0.01)
    fwd = at(t.flops_fwd, {"batch": B, "seq": S})
    attention = 4 * B * S * S * cfg.hidden * cfg.layers * CAUSAL
    assert fwd == pytest.approx(2 * t.params * B * S + attention, rel=0.02)
    # exactly: the input embedding is a lookup, so its parameters do no matmul work
    lookup = cfg.vocab * cfg.hidden
    assert fwd == pytest.approx(2 * (t.params - lookup) * B * S + attention, rel=1e-3)


def test_mixtral_8x7b_active_params_and_flops(capacity_factor=1.25):
    cfg, t = analyse("mixtral-8x7b", {"capacity_factor": capacity_factor})
    assert t.params == pytest.approx(46.7e9, rel=0.01)
    assert t.active_params == pytest.approx(models.active_param_count(cfg), rel=1e-6)
    assert t.active_params == pytest.approx(12.9e9, rel=0.01)
    fwd = at(t.flops_fwd, {"batch": B, "seq": S})
    attention = 4 * B * S * S * cfg.hidden * cfg.layers * CAUSAL
    # fixed-capacity dispatch computes capacity_factor × the routed tokens in the experts
    expert_active = cfg.layers * cfg.top_k * 3 * cfg.hidden * cfg.ffn
    padded = 2 * (capacity_factor - 1) * expert_active * B * S
    assert fwd == pytest.approx(2 * t.active_params * B * S + attention + padded, rel=0.02)
