"""One op for a norm and its projections (``autopar_norm_project``, :mod:`autopar.passes.fusion`):
bit for bit the unfused ops in every dtype, under autocast and through a reshape, and where the
pass puts it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.build.prepare import capture_model
from autopar.passes.fusion import fuse
from autopar.runtime.fused import autopar_norm_linear, autopar_norm_project
from tests.test_fusion import _gemma_rms, _grads, _llama, _rms


_NORMS = {   # name: (the model's norm of (input, weight, bias), autopar_norm_project's weight and norm tuple)
    "rms": (lambda dt: (lambda a, w, b: _rms(a, w, 1e-6, dt), lambda w: w,
                        ("rms", 1e-6, None, torch.float32, dt, None))),
    "rms in its input's dtype": (lambda dt: (
        lambda a, w, b: w * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)), lambda w: w,
        ("rms", 1e-6, None, None, None, None))),
    "gemma": (lambda dt: (lambda a, w, b: _gemma_rms(a, w, 1e-6), lambda w: 1.0 + w.float(),
                          ("rms", 1e-6, None, torch.float32, None, dt))),
    "layer": (lambda dt: (lambda a, w, b: F.layer_norm(a, [16], w, b, 1e-5), lambda w: w,
                          ("layer", 1e-5, [16], None, None, None))),
}


def _norm_blocks(kind: str, dt: torch.dtype, n: int, transposed: bool, tail: bool = False):
    """(plain, fused) of ``(x, norm weight, norm bias, q, k, v, q's bias, d, d's bias)``: a residual
    stream's norm into ``n`` of q (with a bias), k, v, the outputs read as they are or through a
    transposed matmul (a transposed gradient arrives); ``tail``: q's output through GELU into
    d (a GPT MLP's second projection, with a bias)."""
    norm, weight, recipe = _NORMS[kind](dt)
    m = torch.randn(16, 16, dtype=dt)

    def read(outs):
        if transposed:
            outs = [(m[:o.shape[-1], :o.shape[-1]] @ o.transpose(1, 2)).transpose(1, 2) for o in outs]
        return outs

    def plain(a, w, b, q, k, v, qb, d, db):
        h = a * 1.5
        y = norm(h, w, b)
        outs = [F.linear(y, q, qb), F.linear(y, k), F.linear(y, v)][:n]
        if tail:
            outs[0] = F.linear(F.gelu(outs[0]), d, db)
        return torch.cat([h, *read(outs)], -1)

    def fused(a, w, b, q, k, v, qb, d, db):
        h = a * 1.5
        outs = autopar_norm_project(h, weight(w), b if recipe[0] == "layer" else None, recipe,
                                    ((0, "none"),) if tail else (), (), *[q, qb, k, None, v, None][:2 * n],
                                    *((d, db) if tail else ()))
        return torch.cat([h, *read(list(outs))], -1)
    return plain, fused


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float64])
def test_a_norm_and_its_projections_in_one_op_equal_the_unfused_bit_for_bit(dt):
    """autopar_norm_project (the norm and every projection of its output as one autograd node):
    transformers' RMSNorm in float32 and in its input's dtype, Gemma's (cast after its weight)
    and LayerNorm, into one, two or three projections (a bias on the first), the first one's
    output alone or through GELU into another projection (a tail), on a residual stream, the
    outputs read directly or through a transposed matmul. Outputs and every gradient are the
    unfused ops' bit for bit (the norm output's gradient adds the projections' parts in
    autograd's order: the last projection's first); neither the norm's output nor the GELU's is
    kept."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, dtype=dt, requires_grad=True)
    nw, nb = (torch.randn(16, dtype=dt, requires_grad=True) for _ in range(2))
    ws = [torch.randn(o, 16, dtype=dt, requires_grad=True) for o in (16, 8, 8)]
    qb = torch.randn(16, dtype=dt, requires_grad=True)
    d, db = torch.randn(12, 16, dtype=dt, requires_grad=True), torch.randn(12, dtype=dt, requires_grad=True)
    inputs = (x, nw, nb, *ws, qb, d, db)
    for kind in _NORMS:
        for n in (1, 2, 3):
            for transposed, tail in ((False, False), (True, False), (False, True), (True, True)):
                plain, fused = _norm_blocks(kind, dt, n, transposed, tail)
                want = _grads(plain, *inputs)
                kept = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
                    got = _grads(fused, *inputs)
                case = (kind, n, transposed, tail)
                assert torch.equal(want[0], got[0]), case
                assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(want[1], got[1])), case
                assert got[1][0] is not None and got[1][3] is not None and (got[1][5] is None) == (n < 3), case
                assert (got[1][8] is None) == (not tail), case
                if not transposed:     # kept whole: the norm's input and the GELU's (the rest: weights, per row)
                    h = [t for t in kept if t.shape == x.shape]
                    assert len({t.untyped_storage().data_ptr() for t in h}) == 1 + tail, case


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_a_norm_read_through_a_reshape_and_its_projection_in_one_op_equal_the_unfused(dt):
    """DeepSeek-V3's latent norm: its output reshaped (a dimension inserted, the last kept) before
    its one projection. The op applies the same reshape; outputs and gradients are the unfused
    ops' bit for bit, also where the gradient arrives transposed."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, dtype=dt, requires_grad=True)
    nw = torch.randn(16, dtype=dt, requires_grad=True)
    w = torch.randn(12, 16, dtype=dt, requires_grad=True)
    recipe = ("rms", 1e-6, None, torch.float32, dt, None)
    for read in (lambda o: o, lambda o: o.transpose(1, 2).exp().transpose(1, 2)):
        want = _grads(lambda a, b, c: read(F.linear(_rms(a * 1.5, b, 1e-6, dt).reshape(2, 1, 6, 16), c)), x, nw, w)
        got = _grads(lambda a, b, c: read(autopar_norm_project(a * 1.5, b, None, recipe, (), ([2, 1, 6, 16],), c,
                                                               None)[0]), x, nw, w)
        assert want[0].shape == (2, 1, 6, 12) and torch.equal(want[0], got[0])
        assert all(torch.equal(p, q) for p, q in zip(want[1], got[1]))


def test_a_norm_and_its_projections_under_autocast_equal_the_unfused():
    """Under autocast the projections run in bfloat16 and the norm in float32: the op's backward
    runs the model's ops again as forward ran them (casts included) and lets autograd
    differentiate them, so every gradient is the unfused model's under autocast bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, requires_grad=True)
    nw, nb = (torch.randn(16, requires_grad=True) for _ in range(2))
    ws = [torch.randn(o, 16, requires_grad=True) for o in (16, 8, 8)]
    qb = torch.randn(16, requires_grad=True)
    d, db = torch.randn(12, 16, requires_grad=True), torch.randn(12, requires_grad=True)
    for kind in ("rms", "layer"):
        for tail in (False, True):
            plain, fused = _norm_blocks(kind, torch.float32, 3, False, tail)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = _grads(plain, x, nw, nb, *ws, qb, d, db)
                got = _grads(fused, x, nw, nb, *ws, qb, d, db)
            assert torch.equal(want[0], got[0]), kind
            assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(want[1], got[1])), kind


def test_a_projection_whose_weight_comes_after_the_norm_keeps_its_own_op():
    """A weight made after the norm (as a ZeRO-3 gather placed just before its projection) cannot
    be read where the norm runs: that norm and its projections stay apart, the others join."""
    x = torch.randint(0, 64, (2, 16))
    gm = capture_model(_llama(1), (x,), {})
    lin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
               and "k_proj" in str(n.args[1]))
    with gm.graph.inserting_before(lin):
        late = gm.graph.call_function(torch.ops.aten.mul.Tensor, (lin.args[1], 1.0))
    lin.args = (lin.args[0], late, *lin.args[2:])
    gm.recompile()
    fuse(gm)
    apart = [n for n in gm.graph.nodes if n.target is autopar_norm_linear]
    assert len(apart) == 3 and all("input_layernorm" in str(n.args[5]) for n in apart)
    assert sum(n.target is autopar_norm_project for n in gm.graph.nodes) == 1
