"""FLOP pass: per-op formulas on hand-built graphs, and whole models vs FlopCounterMode."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from autopar import models
from autopar.passes.capture import wrap_graph
from autopar.passes.flops import flop_pass
from autopar.core.meta import info
from autopar.passes.shapes import shape_pass
from autopar.summary import at, totals
from tests.conftest import analysed

aten = torch.ops.aten


def hand_graph(build, inputs: dict[str, torch.Tensor], params: dict[str, str]) -> fx.GraphModule:
    """A GraphModule built node by node; ``build(graph, placeholders)`` returns the output."""
    g = fx.Graph()
    phs = {}
    for name, val in inputs.items():
        phs[name] = g.placeholder(name)
        phs[name].meta["val"] = val
    g.output(build(g, phs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    wrap_graph(gm, params=params)
    shape_pass(gm)
    return flop_pass(gm)


def test_linear_counts_2mkn_forward_and_one_matmul_per_input_needing_grad():
    gm = hand_graph(lambda g, p: g.call_function(aten.linear.default, (p["x"], p["w"])),
                    {"x": torch.randn(4, 6, 8), "w": torch.randn(5, 8)}, {"w": "fc.weight"})
    lin = next(n for n in gm.graph.nodes if n.target is aten.linear.default)
    assert info(lin).flops_fwd == 2 * 24 * 8 * 5
    # x is an input without grad: backward only computes dW
    assert info(lin).flops_bwd == 2 * 24 * 8 * 5
    assert info(lin).bytes_fwd == (4 * 6 * 8 + 5 * 8 + 4 * 6 * 5) * 4


def test_bmm_with_both_operands_needing_grad_costs_twice_forward_backward():
    gm = hand_graph(lambda g, p: g.call_function(aten.bmm.default, (p["a"], p["b"])),
                    {"a": torch.randn(3, 4, 5), "b": torch.randn(3, 5, 6)}, {"a": "a", "b": "b"})
    bmm = next(n for n in gm.graph.nodes if n.target is aten.bmm.default)
    assert info(bmm).flops_fwd == 2 * 3 * 4 * 5 * 6
    assert info(bmm).flops_bwd == 2 * info(bmm).flops_fwd


def test_attention_formula_includes_the_cpu_kernel_torch_does_not_count():
    q = torch.randn(2, 4, 16, 8)
    gm = hand_graph(lambda g, p: g.call_function(aten.scaled_dot_product_attention.default,
                                                 (p["q"], p["k"], p["v"]), {"is_causal": True}),
                    {"q": q, "k": q.clone(), "v": q.clone()}, {"q": "q", "k": "k", "v": "v"})
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    # causal: the 16 * 17 / 2 query-key pairs at or below the diagonal, not all 16 * 16
    assert info(sdpa).flops_fwd == 4 * 2 * 4 * (16 * 17 // 2) * 8
    assert info(sdpa).flops_bwd == 2 * info(sdpa).flops_fwd
    with FlopCounterMode(display=False) as fc:  # the CPU flash kernel: torch's counter sees nothing
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc_math:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert fc.get_total_flops() < info(sdpa).flops_fwd * 16 * 2 / 17 == fc_math.get_total_flops()


def test_elementwise_ops_do_no_matmul_flops_but_move_bytes():
    gm = hand_graph(lambda g, p: g.call_function(aten.gelu.default, (p["x"],)), {"x": torch.randn(10, 10)}, {})
    gelu = next(n for n in gm.graph.nodes if n.target is aten.gelu.default)
    assert info(gelu).flops_fwd == 0 and info(gelu).bytes_fwd == 800
    assert info(gelu).flops_bwd == 0 and info(gelu).bytes_bwd == 0  # no gradient flows here


@pytest.mark.parametrize("name,overrides", [("mlp", {}), ("gpt", {"layers": 2}), ("llama", {"layers": 2, "kv_heads": 2}),
                                            ("moe", {"layers": 2})])
def test_model_flops_equal_flop_counter_mode(name, overrides):
    torch.manual_seed(0)
    model = models.build(name, overrides, device="cpu")
    args, dims = models.example_inputs(model, 2, 16, device="cpu")
    gm = analysed(model, args, dims)
    t = totals(gm)
    sizes = {"batch": 2, "seq": 16}
    with sdpa_kernel(SDPBackend.MATH):  # the math path shows torch's counter every matmul
        with FlopCounterMode(display=False) as fwd:
            out = model(*args)
        with FlopCounterMode(display=False) as bwd:
            out.float().pow(2).mean().backward()
    # torch's counter counts causal attention's masked pairs too: 2 (E + Ev) FLOPs for each of
    # the S (S - 1) / 2 query-key pairs above the diagonal, per batch row and head
    skipped = sum(2 * 2 * n.args[0].meta["val"].shape[1] * (16 * 15 // 2) * 2 * n.args[0].meta["val"].shape[-1]
                  for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)
                  and n.kwargs.get("is_causal", len(n.args) > 5 and n.args[5]))
    assert (skipped > 0) == (name != "mlp")
    assert at(t.flops_fwd, sizes) == fwd.get_total_flops() - skipped
    assert at(t.flops_bwd, sizes) == bwd.get_total_flops() - 2 * skipped
