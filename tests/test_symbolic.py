"""Symbolic sizes: formulas captured once equal static re-captures at other sizes."""
from __future__ import annotations

import pytest
import sympy
import torch

from autopar import models
from autopar.core.meta import graph_info, info
from autopar.summary import at, totals
from tests.conftest import analysed

FIELDS = ("flops_fwd", "flops_bwd", "bytes_fwd", "bytes_bwd", "activation_bytes")


@pytest.mark.parametrize("name,overrides", [("gpt", {"layers": 2}), ("llama", {"layers": 2, "kv_heads": 2}),
                                            ("moe", {"layers": 1, "capacity_factor": 1.5}), ("mlp", {})])
def test_formulas_at_two_sizes_equal_recaptured_figures(name, overrides):
    model = models.build(name, overrides, device="meta")
    args, dims = models.example_inputs(model, 2, 8, device="meta")
    symbolic = totals(analysed(model, args, dims, max_sizes={"seq": model.config.max_seq}
                               if hasattr(model.config, "max_seq") else None))
    for batch, seq in ((3, 5), (4, 24)):
        static_args, _ = models.example_inputs(model, batch, seq, device="meta")
        static = totals(analysed(model, static_args))
        sizes = {"batch": batch, "seq": seq} if name != "mlp" else {"batch": batch}
        for field in FIELDS:
            assert at(getattr(symbolic, field), sizes) == at(getattr(static, field), {}), field


def test_formulas_are_polynomials_in_batch_and_seq():
    model = models.build("gpt", {"layers": 1}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    gm = analysed(model, args, dims)
    b, s = graph_info(gm).symbols["batch"], graph_info(gm).symbols["seq"]
    flops = totals(gm).flops_fwd
    assert flops.free_symbols == {b, s}
    poly = sympy.Poly(flops, b, s)
    assert poly.degree(b) == 1 and poly.degree(s) == 2  # attention is quadratic in seq
    sdpa = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert [str(d) for d in info(sdpa).value.shape] == ["batch", str(model.config.heads), "seq",
                                                         str(model.config.hidden // model.config.heads)]
