"""Fused ops that keep fewer activations (runtime/fused.py, passes/fusion.py).

- Each fused op gives the unfused ops' values and gradients bit for bit (float32, bfloat16,
  float64, and a bfloat16 input with a float32 weight for the norm).
- The pass finds transformers' RMSNorm, SwiGLU and SwiGLU-into-down-projection in a Llama graph,
  and the memory pass prices the saved set without what the fused ops recompute.
- ``autopar.parallelize`` runs them by default: a four-layer ``transformers`` Llama keeps at most
  0.75x the activations the plain model keeps in one forward (counted by unique storage), and
  its outputs and gradients are the plain model's.

Every other equivalence test of the suite (tensor, data, ZeRO-3, pipeline, experts, recompute)
runs through the same module step, so through the fused ops too.
"""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.build.prepare import capture_model
from autopar.core.meta import evaluate, info
from autopar.passes.fusion import fuse, matches, unkept
from autopar.runtime.fused import (FUSED_OPS, autopar_gelu_linear, autopar_norm_linear, autopar_norm_project,
                                   autopar_rms_norm, autopar_swiglu, autopar_swiglu_grouped_mm, autopar_swiglu_linear)
from autopar.runtime.launch import run_ranks


def _rms(x, w, eps, out):
    xm = x.to(torch.float32)
    return w * (xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + eps)).to(out)


def _gemma_rms(x, w, eps):
    xm = x.float()
    return ((xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + eps)) * (1.0 + w.float())).type_as(x)


def _grads(fn, *inputs):
    for t in inputs:
        t.grad = None
    y = fn(*inputs)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), [None if t.grad is None else t.grad.clone() for t in inputs]


@pytest.mark.parametrize("dt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_fused_ops_equal_the_unfused_bit_for_bit(dt, wdt):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=dt, requires_grad=True)
    w = torch.randn(16, dtype=wdt, requires_grad=True)
    want, got = _grads(lambda a, b: _rms(a, b, 1e-6, dt), x, w), _grads(
        lambda a, b: autopar_rms_norm(a, b, 1e-6, torch.float32, dt), x, w)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))
    # Gemma's: float32 rows times (1 + w), cast back to the input's dtype after the weight
    want, got = _grads(lambda a, b: _gemma_rms(a, b, 1e-6), x, w), _grads(
        lambda a, b: autopar_rms_norm(a, (1.0 + b.float()), 1e-6, torch.float32, None, a.dtype), x, w)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))
    g, u = (torch.randn(2, 5, 12, dtype=dt, requires_grad=True) for _ in range(2))
    down, bias = torch.randn(7, 12, dtype=dt, requires_grad=True), torch.randn(7, dtype=dt, requires_grad=True)
    pairs = [(lambda a, b: F.silu(a) * b, autopar_swiglu, (g, u)),
             (lambda a, b, c, d: F.linear(F.silu(a) * b, c, d), autopar_swiglu_linear, (g, u, down, bias)),
             (lambda a, b, c: F.linear(F.silu(a) * b, c), autopar_swiglu_linear, (g, u, down)),
             (lambda a, c, d: F.linear(F.gelu(a), c, d), autopar_gelu_linear, (g, down, bias)),
             (lambda a, c: F.linear(F.gelu(a, approximate="tanh"), c),
              lambda a, c: autopar_gelu_linear(a, c, None, "tanh"), (g, down)),
             # GeGLU (Gemma's MLP): the gate through gelu, exact or tanh
             (lambda a, b: F.gelu(a) * b, lambda a, b: autopar_swiglu(a, b, "gelu"), (g, u)),
             (lambda a, b, c, d: F.linear(F.gelu(a, approximate="tanh") * b, c, d),
              lambda a, b, c, d: autopar_swiglu_linear(a, b, c, d, "gelu_tanh"), (g, u, down, bias))]
    for plain, fused, inputs in pairs:
        want, got = _grads(plain, *inputs), _grads(fused, *inputs)
        assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1])), fused


@pytest.mark.parametrize("shape", [(2, 5, 16), (1, 16), (16,), (3, 1)])
def test_backwards_written_over_their_own_tensors_equal_the_unfused(shape):
    """One dtype throughout (float64, no cast), where the fused backwards write their results
    over tensors they made: an RMSNorm of one row (its weight's gradient sums nothing, a view of
    the product written over next), of width 1, and a gated MLP whose gate and up are one tensor
    (the product's gradient is written over while the other half still reads it)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    plain = lambda a, b: b * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))    # noqa: E731
    want, got = _grads(plain, x, w), _grads(lambda a, b: autopar_rms_norm(a, b, 1e-6, None, None), x, w)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))
    down = torch.randn(3, shape[-1], dtype=torch.float64, requires_grad=True)
    for act, gate in (("silu", F.silu), ("gelu", F.gelu)):
        want = _grads(lambda a, c: F.linear(gate(a) * a, c), x, down)
        got = _grads(lambda a, c: autopar_swiglu_linear(a, a, c, None, act), x, down)
        assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1])), act
        want, got = _grads(lambda a: gate(a) * a, x), _grads(lambda a: autopar_swiglu(a, a, act), x)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1][0], got[1][0]), act
    want = _grads(lambda a, c: F.linear(F.gelu(a), c), x, down)
    got = _grads(lambda a, c: autopar_gelu_linear(a, c), x, down)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_an_rms_norm_on_the_residual_stream_adds_its_gradients_as_autograd_does(dt):
    """Where an RMSNorm runs in its input's dtype, the model reads the input twice (its square's
    mean; the input times the per-row scale) and autograd adds both gradients into the input's
    one at a time, after the residual's: the fused norm hands them over apart, in that order, and
    the input's gradient is the unfused one bit for bit (a sum taken inside the norm first rounded
    differently in most rows). Also with a transposed gradient arriving (a reduction's order
    follows its operand's layout), and with the model's no-op cast to float32."""
    torch.manual_seed(0)
    x = torch.randn(2, 64, 32, dtype=dt, requires_grad=True)
    w = torch.randn(32, dtype=dt, requires_grad=True)
    v = torch.randn(32, 32, dtype=dt)
    plain = lambda a, b: b * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))    # noqa: E731
    for mid in (None, dt):
        for head in (lambda h: h @ v, lambda h: (v @ h.transpose(1, 2)).transpose(1, 2)):
            block = lambda a, b, norm: a * 1.5 + head(norm(a * 1.5, b))     # noqa: E731
            want = _grads(lambda a, b: block(a, b, plain), x, w)
            got = _grads(lambda a, b: block(a, b, lambda p, q: autopar_rms_norm(p, q, 1e-6, mid, None)), x, w)
            assert torch.equal(want[0], got[0]), mid
            assert torch.equal(want[1][0], got[1][0]) and torch.equal(want[1][1], got[1][1]), mid


def _penalty_grads(fn, *inputs):
    """The gradients of a gradient penalty: backward through backward (``create_graph=True``)."""
    for t in inputs:
        t.grad = None
    y = fn(*inputs)
    first = torch.autograd.grad((y * y).sum(), inputs, create_graph=True)
    sum((g * g).sum() for g in first).backward()
    return [t.grad.clone() for t in inputs]


def test_second_derivatives_through_fused_ops_are_the_unfused():
    """A backward that builds a graph (a gradient penalty) runs the unfused ops again from what
    forward kept and differentiates them, so the second derivative is the unfused model's; the
    fused formulas read a norm's per-row scale computed in forward without a graph, and would
    miss its terms (an RMSNorm's penalty gradient was off by 150 that way). float64."""
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    x, u = torch.randn(2, 5, 12, **f64), torch.randn(2, 5, 12, **f64)
    w, b, nw, nb = torch.randn(7, 12, **f64), torch.randn(7, **f64), torch.randn(12, **f64), torch.randn(12, **f64)
    rms = lambda a, c: c * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))   # noqa: E731
    pairs = [(lambda a, b_, c, d: F.linear(F.silu(a) * b_, c, d), autopar_swiglu_linear, (x, u, w, b)),
             (lambda a, b_: F.gelu(a) * b_, lambda a, b_: autopar_swiglu(a, b_, "gelu"), (x, u)),
             (lambda a, c, d: F.linear(F.gelu(a), c, d), autopar_gelu_linear, (x, w, b)),
             (rms, lambda a, c: autopar_rms_norm(a, c, 1e-6, None, None), (x, nw)),
             # a fused RMSNorm into two projections (the per-row scale handed over), and a LayerNorm into one
             (lambda a, c, d: F.linear(rms(a, c), d) * F.linear(rms(a, c), d).flip(-1),
              lambda a, c, d: (lambda y: autopar_norm_linear(y, d, None, "rms", a, c, None, 1e-6, readers=2)
                               * autopar_norm_linear(y, d, None, "rms", a, c, None, 1e-6, readers=2).flip(-1))(
                  autopar_rms_norm(a, c, 1e-6, None, None)), (x, nw, w)),
             (lambda a, c, d, e: F.linear(F.layer_norm(a, [12], c, d), e, b),
              lambda a, c, d, e: autopar_norm_linear(F.layer_norm(a, [12], c, d), e, b, "layer", a, c, d, 1e-5, [12]),
              (x, nw, nb, w)),
             # the norm and its projections as one op: an RMSNorm into two, a LayerNorm into one
             (lambda a, c, d: F.linear(rms(a, c), d) * F.linear(rms(a, c), d).flip(-1),
              lambda a, c, d: (lambda p, q: p * q.flip(-1))(
                  *autopar_norm_project(a, c, None, ("rms", 1e-6, None, None, None, None), (), (), d, None, d, None)),
              (x, nw, w)),
             (lambda a, c, d, e: F.linear(F.layer_norm(a, [12], c, d), e, b),
              lambda a, c, d, e: autopar_norm_project(a, c, d, ("layer", 1e-5, [12], None, None, None), (), (),
                                                      e, b)[0],
              (x, nw, nb, w)),
             # and into a GELU projection (its tail)
             (lambda a, c, d, e: F.linear(F.gelu(F.linear(F.layer_norm(a, [12], c, d), e, b)), e.t()),
              lambda a, c, d, e: autopar_norm_project(a, c, d, ("layer", 1e-5, [12], None, None, None),
                                                      ((0, "none"),), (), e, b, e.t(), None)[0],
              (x, nw, nb, w))]
    for plain, fused, inputs in pairs:
        want, got = _penalty_grads(plain, *inputs), _penalty_grads(fused, *inputs)
        scale = max(g.abs().max().item() for g in want)
        assert all((p - q).abs().max().item() <= 1e-12 * scale for p, q in zip(want, got)), fused


def test_a_forward_stopped_between_a_norms_projections_does_not_keep_its_output():
    """Projections of one norm output share its recomputation through an entry keyed by the
    output; if the forward stops after the first of three (an exception in the model), the entry
    must not keep the output alive."""
    import gc
    import weakref
    x, nw, w = torch.randn(2, 5, 16), torch.randn(16), torch.randn(8, 16)
    y = _rms(x, nw, 1e-6, torch.float32)
    autopar_norm_linear(y, w, None, "rms", x, nw, None, 1e-6, None, torch.float32, torch.float32, 3)
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None
    # and the next output, even at a reused address, gets its own entry: three readers run alike
    y2 = _rms(x, nw, 1e-6, torch.float32)
    outs = [autopar_norm_linear(y2, w, None, "rms", x, nw, None, 1e-6, None, torch.float32, torch.float32, 3)
            for _ in range(3)]
    assert all(torch.equal(o, F.linear(y2, w)) for o in outs)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float64])
def test_projections_of_a_norm_equal_the_unfused_bit_for_bit(dt):
    """Three projections of one norm's output (q, k, v), with and without a bias: the outputs and
    every gradient (the norm's input and weights, the projections' weights) are the unfused
    ones, and the norm's output is no longer kept."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=dt, requires_grad=True)
    nw, nb = torch.randn(16, dtype=dt, requires_grad=True), torch.randn(16, dtype=dt, requires_grad=True)
    ws = [torch.randn(o, 16, dtype=dt, requires_grad=True) for o in (16, 8, 8)]
    bias = torch.randn(16, dtype=dt, requires_grad=True)
    norms = {"rms": (lambda a, w, b: _rms(a, w, 1e-6, dt), ("rms", 1e-6, None, torch.float32, dt)),
             "layer": (lambda a, w, b: F.layer_norm(a, [16], w, b, 1e-5), ("layer", 1e-5, [16], None, None))}
    for kind, (norm, (k, eps, shape, mid, out)) in norms.items():
        def plain(a, w, b, q, kk, v, qb):
            y = norm(a, w, b)
            return torch.cat([F.linear(y, q, qb), F.linear(y, kk), F.linear(y, v)], -1)

        outs = []

        def fused(a, w, b, q, kk, v, qb):
            y = norm(a, w, b)
            outs.append(y)          # held, so no later tensor can take its address
            nb_ = b if k == "layer" else None
            return torch.cat([autopar_norm_linear(y, wt, bb, k, a, w, nb_, eps, shape, mid, out, 3)
                              for wt, bb in ((q, qb), (kk, None), (v, None))], -1)
        inputs = (x, nw, nb, *ws, bias)
        want = _grads(plain, *inputs)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            got = _grads(fused, *inputs)
        assert torch.equal(want[0], got[0]), kind
        assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(want[1], got[1])), kind
        assert (want[1][2] is None) == (k == "rms")          # the RMSNorm has no bias
        y_at = outs[0].untyped_storage().data_ptr()
        assert kept and all(t.untyped_storage().data_ptr() != y_at for t in kept), kind   # y is not kept


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float64])
def test_projections_of_a_fused_rms_norm_recompute_from_its_scale_and_hand_it_the_rows(dt, monkeypatch):
    """As the pass builds Llama's attention input: a fused RMSNorm whose output three projections
    read (one through a view, as a latent norm into its up projection). Their backward recomputes
    the output from the norm's per-row scale, not by the whole norm again, and the norm's own
    backward takes the rows they computed; everything equals the unfused ops bit for bit."""
    import autopar.runtime.fused_norms as fused_mod
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=dt, requires_grad=True)
    nw = torch.randn(16, dtype=dt, requires_grad=True)
    ws = [torch.randn(o, 16, dtype=dt, requires_grad=True) for o in (16, 8, 8)]

    def plain(a, w, q, k, v):
        y = _rms(a, w, 1e-6, dt)
        return torch.cat([F.linear(y, q), F.linear(y, k), F.linear(y.view(10, 16), v).view(2, 5, 8)], -1)

    def fused(a, w, q, k, v):
        y = autopar_rms_norm(a, w, 1e-6, torch.float32, dt)
        recipe = ("rms", a, w, None, 1e-6, None, torch.float32, dt, 3)
        return torch.cat([autopar_norm_linear(y, q, None, *recipe), autopar_norm_linear(y, k, None, *recipe),
                          autopar_norm_linear(y.view(10, 16), v, None, *recipe).view(2, 5, 8)], -1)
    whole, took = [], []
    monkeypatch.setattr(fused_mod, "_norm_again", lambda *a: whole.append(a) or None)
    take = fused_mod._RowsSlot.take
    monkeypatch.setattr(fused_mod._RowsSlot, "take", lambda self: took.append(take(self)) or took[-1])
    want, got = _grads(plain, x, nw, *ws), _grads(fused, x, nw, *ws)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))
    assert not whole and len(took) == 1 and took[0] is not None


def test_a_kept_norm_output_does_not_keep_the_norms_input():
    """The norm hands its projections its input on its output tensor: a caller keeping the
    output (a returned hidden state, no graph) must not keep the input alive with it."""
    import gc
    import weakref
    x, w = torch.randn(2, 5, 16), torch.randn(16)
    with torch.no_grad():
        y = autopar_rms_norm(x, w, 1e-6, None, None)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None and y._autopar_norm_rows.x() is None


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_swiglu_into_transformers_grouped_expert_matmul_equals_the_unfused_bit_for_bit(dt):
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback
    torch.manual_seed(0)
    g, u = (torch.randn(10, 12, dtype=dt, requires_grad=True) for _ in range(2))
    w = torch.randn(3, 12, 7, dtype=dt, requires_grad=True)
    offs = torch.tensor([4, 4, 10])                 # the second expert gets no rows
    plain = lambda a, b, c: torch.ops.transformers.grouped_mm_fallback(F.silu(a) * b, c, offs)
    want, got = _grads(plain, g, u, w), _grads(lambda a, b, c: autopar_swiglu_grouped_mm(a, b, c, offs), g, u, w)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))
    # transformers casts the product to the weights' dtype first (a no-op here, float32 -> float32)
    cast = lambda a, b, c: torch.ops.transformers.grouped_mm_fallback((F.silu(a) * b).to(dt), c, offs)
    want = _grads(cast, g, u, w)
    got = _grads(lambda a, b, c: autopar_swiglu_grouped_mm(a, b, c, offs, dt), g, u, w)
    assert torch.equal(want[0], got[0]) and all(torch.equal(p, q) for p, q in zip(want[1], got[1]))


def _llama(layers: int = 2) -> torch.nn.Module:
    import transformers
    from tests.hf_tiny import Logits
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=64)
    return Logits(transformers.AutoModelForCausalLM.from_config(cfg))


def test_the_pass_finds_llamas_norms_and_mlps_and_the_memory_pass_prices_them():
    from autopar.passes.pipeline import analyze
    x = torch.randint(0, 64, (2, 16))
    gm = capture_model(_llama(), (x,), {})
    found = matches(gm)
    kinds = sorted(m.target.__name__ for m in found)
    # two layers: two norms each and the final one; each MLP's SwiGLU taken into its down
    # projection; q, k, v and gate, up take their norm in
    assert kinds == ["autopar_norm_linear"] * 10 + ["autopar_rms_norm"] * 5 + ["autopar_swiglu_linear"] * 2, kinds
    freed = unkept(gm)
    analyze(gm)
    assert freed and all(float(evaluate(info(n).saved_bytes, {})) == 0.0 for n in freed)
    linears = {m.node.name for m in found if m.target is autopar_norm_linear}
    assert fuse(gm) == 17 and not matches(gm)
    assert not any(n.target is torch.ops.aten.silu.default for n in gm.graph.nodes)
    # each layer's two norms take their projections in: one op each, the projections its items
    # (their nodes and names kept); the final norm's output reaches the head through an alias
    ops = [n for n in gm.graph.nodes if n.target is autopar_norm_project]
    assert len(ops) == 4 and [len(n.args) - 6 for n in ops] == [6, 4, 6, 4]
    assert not any(n.target is autopar_norm_linear for n in gm.graph.nodes)
    items = {n.name for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] in ops}
    assert items == linears
    assert sum(n.target is autopar_rms_norm for n in gm.graph.nodes) == 1


def _kept(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _saved_and_equal(rank: int, world: int) -> dict:
    model = _llama(4)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, {"dp": 1}, (x,))
    want, eager = _kept(lambda: ref(x))
    got, ours = _kept(lambda: pm(x))
    want.pow(2).mean().backward()
    got.pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    return {"eager": eager, "ours": ours, "out": (want - got).abs().max().item(),
            "grad": max((p.grad - grads[k].grad).abs().max().item() for k, p in pm.named_parameters()),
            "fused": sum(1 for n in pm.graph_module.graph.nodes if "autopar_" in getattr(n.target, "__name__", ""))}


def test_parallelize_keeps_at_most_three_quarters_of_eager_activations():
    r = run_ranks(_saved_and_equal, 1, timeout_s=300)[0]
    assert r["fused"] >= 9, r                         # 4 layers x (2 norms + MLP) + the final norm
    assert r["ours"] <= 0.75 * r["eager"], r
    assert r["out"] == 0.0 and r["grad"] == 0.0, r


def _eager_cores(rank: int, world: int, name: str, recompute: str = "none", dtype: torch.dtype = torch.float64) -> dict:
    import transformers
    from tests.hf_tiny import Logits
    torch.manual_seed(0)
    if name == "gemma2":
        cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                                        max_position_embeddings=64, sliding_window=8)
        model = Logits(transformers.AutoModelForCausalLM.from_config(cfg)).to(dtype)
    else:           # tests/test_ep_hf.py's small DeepSeek-V3: latent attention, queries 16 wide, values 8
        from tests.test_ep_hf import build
        model = build("deepseek_v3", dtype, num_hidden_layers=2, first_k_dense_replace=0)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, {"dp": 1}, (x,), recompute=recompute)
    shapes: list[tuple] = []
    per_head: set[tuple] = set()       # distinct storages kept in [b, heads, ., .] form

    def pack(t):
        shapes.append(tuple(t.shape))
        if t.dim() == 4 and t.shape[0] == 2 and t.shape[-1] != t.shape[-2]:
            per_head.add((t.untyped_storage().data_ptr(), t.shape[1]))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = pm(x)
    want = ref(x)
    want.pow(2).mean().backward()
    got.pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    from autopar.runtime.recompute import eager_attention_cores
    def last(n):          # the cast after the weight (a norm's projections: before the conversion)
        a = n.args[12] if n.target is autopar_norm_linear else n.args[3][5] if n.target is autopar_norm_project \
            else n.args[-1]
        return a if isinstance(a, (str, torch.dtype)) else None
    fused = [(n.target.__name__, last(n)) for n in pm.graph_module.graph.nodes if n.target in FUSED_OPS]
    return {"scores": sum(1 for s in shapes if len(s) == 4 and s[1] == 4 and s[-1] == s[-2] == 24),   # [b, heads, s, s]
            "fused": sorted(set(fused)), "count": len(fused),
            "per_head": sorted(h for _, h in per_head),
            "cores": len(set(eager_attention_cores(pm.graph_module).values())),
            "out": (want - got).abs().max().item(),
            "grad": max((p.grad - grads[k].grad).abs().max().item() for k, p in pm.named_parameters())}


def test_an_eager_soft_capped_attention_keeps_no_scores_and_trains_as_eager():
    """transformers' Gemma 2 writes its attention out (scale, soft cap, sliding-window mask,
    softmax): each layer's core runs checkpointed, so no [b, heads, s, s] tensor is kept for
    backward (the [b, 1, s, s] masks are, once each), and outputs and gradients are the eager
    model's bit for bit (float64). The core starts before the keys and values are repeated to the
    query heads: they are kept with their 2 heads, the queries with 4. Gemma's norms
    (``(1 + w)``, cast after the weight) and its GeGLU MLP are fused like Llama's."""
    r = run_ranks(_eager_cores, 1, "gemma2", timeout_s=300)[0]
    assert r["cores"] == 2, r
    assert r["scores"] == 0, r
    assert r["per_head"] == [2, 2, 2, 2, 4, 4], r
    # per layer: 2 norms with their projections (q, k, v; gate, up), 2 more norms, the GeGLU down
    # projection; and the final norm
    assert r["fused"] == [("autopar_norm_project", torch.float64), ("autopar_rms_norm", torch.float64),
                          ("autopar_swiglu_linear", "gelu_tanh")] and r["count"] == 2 * (2 + 2 + 1) + 1, r
    assert r["out"] == 0.0 and r["grad"] == 0.0, r


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_latent_attention_core_keeps_the_latent_projection_not_its_keys_and_values(dtype):
    """DeepSeek-V3's attention call takes queries 16 wide and values 8 (only the math kernel, which
    keeps the scores, takes it): it runs checkpointed from the ops that assemble its keys (the
    latent projection's output split, its rotary part expanded, both copied into one tensor):
    per layer the core keeps the queries (4 heads) and the projection's output and rotary part
    (1 head each), not keys and values per head; its latent norm's output, read through a view
    by that projection, is recomputed. Outputs and gradients are the eager model's bit for bit,
    in float64 and in float32 (where the model's casts to float32 are no-ops and its RMSNorms run
    in the input's own dtype)."""
    r = run_ranks(_eager_cores, 1, "deepseek_v3", "none", dtype, timeout_s=300)[0]
    assert r["cores"] == 2 and r["scores"] == 0, r
    assert r["per_head"] == [1, 1, 1, 1, 4, 4], r
    assert r["out"] == 0.0 and r["grad"] == 0.0, r


@pytest.mark.parametrize("recompute", ["selective", "layers:1"])
def test_an_eager_attention_keeps_no_scores_under_the_other_recompute_modes(recompute):
    """Selective recomputation runs an eager attention's whole core again (its scores' matmul
    too, not only the ops on the scores, whose input would be the [b, heads, s, s] scores), and
    under ``layers:1`` the layer not recomputed still runs its core checkpointed: no scores kept
    in either, as the memory pass prices them; exact against eager (float64)."""
    r = run_ranks(_eager_cores, 1, "gemma2", recompute, timeout_s=300)[0]
    assert r["scores"] == 0, r
    assert r["out"] == 0.0 and r["grad"] == 0.0, r


def _tensor_axis(rank: int, world: int, sequence: bool, fused: bool) -> dict:
    """A float64 Llama on tp=2, its projections split by hand (q, k, v, gate, up by rows; o, down
    by columns), two SGD-momentum steps: outputs, losses and the whole state dict against one
    process, the fused ops and the conversions they take, and the activations kept."""
    import autopar.passes.fusion as fusion
    from autopar.core.placement import Spec, transition
    model = _llama(2).double()
    ref = copy.deepcopy(model)
    pl = {n: "S(0)" for n, _ in model.named_parameters() if any(k in n for k in ("q_proj", "k_proj", "v_proj",
                                                                               "gate_proj", "up_proj"))}
    pl.update({n: "S(1)" for n, _ in model.named_parameters() if "o_proj" in n or "down_proj" in n})
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    found = fusion.matches
    if not fused:      # every other fusion as it is: the norms' projections alone left unfused
        fusion.matches = lambda gm: [m for m in found(gm) if m.target is not autopar_norm_linear]
    try:
        pm = autopar.parallelize(model, {"tp": 2}, (x,),
                                 options=autopar.TensorOptions(sequence_parallel=sequence, placements=pl))
    finally:
        fusion.matches = found
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out_err = 0.0
    for step in range(2):
        if step == 0:
            got, kept = _kept(lambda: pm(x))
        else:
            got = pm(x)
        want = ref(x)
        out_err = max(out_err, (got - want).abs().max().item())
        got.pow(2).mean().backward()
        want.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    state = pm.state_dict()
    want = ref.state_dict()
    err = max(((v.full_tensor() if hasattr(v, "full_tensor") else v) - want[k]).abs().max().item()
              for k, v in state.items() if want[k].is_floating_point())
    convs = [transition(Spec.parse(n.args[13][0]).value, Spec.parse(n.args[13][1]).value).kind
             for n in pm.graph_module.graph.nodes if n.target is autopar_norm_linear and n.args[13] is not None]
    split = sum(1 for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S("))
    return {"out": out_err, "state": err, "convs": sorted(set(convs)), "fused_projections": len(convs),
            "kept": kept, "split": split}


def _split_norms(rank: int, world: int) -> dict:
    """The same Llama on tp=2 under ``memory_budget=1`` (every weight that can split does, the
    norms' too): which fused ops the rank's graph runs, and the norms' placements."""
    model = _llama(2).double()
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    pm = autopar.parallelize(model, {"tp": 2}, (x,), memory_budget=1)
    ops = sorted({n.target.__name__ for n in pm.graph_module.graph.nodes
                  if n.op == "call_function" and n.target in FUSED_OPS})
    norms = sorted({str(pm.placement_of(f)) for f, _ in pm.named_parameters() if "norm" in f})
    return {"ops": ops, "norms": norms}


def _tensor_axis_cases(rank: int, world: int) -> dict:
    return {**{(sequence, fused): _tensor_axis(rank, world, sequence, fused)
               for sequence in (False, True) for fused in (True, False)},
            "split norms": _split_norms(rank, world)}


@pytest.fixture(scope="module")
def tensor_axis():
    return run_ranks(_tensor_axis_cases, 2, timeout_s=600)[0]      # one world for the four builds


@pytest.mark.parametrize("sequence", [False, True])
def test_a_norms_projections_on_a_tensor_axis_recompute_and_convert_its_output_again(tensor_axis, sequence):
    """On a tensor axis the rewrite converts a norm's output before its projections read it: a
    copy where it stays replicated, an all-gather of the sequence under sequence parallelism. The
    projections still keep the norm's input instead of it (the copy or the gathered whole were
    kept before), and their backward recomputes the output and converts it again. Two SGD steps
    in float64 against one process: outputs and the whole state dict agree to the model's own
    float32 round-off (its RMSNorms and rotary tables run in float32), exactly as far as the
    build with these projections unfused does, and the two builds' activations differ by the
    kept copies."""
    on, off = tensor_axis[(sequence, True)], tensor_axis[(sequence, False)]
    assert on["split"] == off["split"] >= 14, on                  # 7 projections x 2 layers at least
    assert on["convs"] == ["all_gather" if sequence else "none"], on
    assert on["fused_projections"] == 2 * (3 + 2), on            # q, k, v; gate, up
    assert off["fused_projections"] == 0, off
    assert on["out"] < 1e-6 and on["state"] < 1e-6, on
    assert on["out"] == off["out"] and on["state"] == off["state"], (on, off)     # the same arithmetic
    # per layer 2 norm outputs [2, 64, 64] float64 (whole: replicated, or gathered) no longer kept
    assert off["kept"] - on["kept"] == 2 * 2 * (2 * 64 * 64 * 8), (on["kept"], off["kept"])


def test_a_norm_split_along_its_own_dimension_runs_unfused(tensor_axis):
    """Where a layout splits a norm's weight (``memory_budget=1`` splits every weight that can),
    the rewrite computes the norm on slices of the hidden dimension: the RMSNorm pattern is gone,
    so neither the norm nor its projections run fused (the SwiGLU down projection still does).
    The simulator prices such a layout so (cost/model_facts.py; tests/test_cost_fidelity.py)."""
    got = tensor_axis["split norms"]
    assert got["norms"] == ["S(0)"], got
    assert "autopar_rms_norm" not in got["ops"] and "autopar_norm_linear" not in got["ops"], got
    assert "autopar_swiglu_linear" in got["ops"], got
