"""The tensor-axis solver rediscovers Megatron's layout by cost, and the placement rules."""
from __future__ import annotations

import pytest
import torch

from autopar import models
from autopar.build.prepare import planned_graph
from autopar.core.meta import info, within
from autopar.passes.sharding import strategies
from autopar.core.placement import P, R, Shard, Spec, transition

N = 4
BATCH, SEQ = 8, 1024


@pytest.fixture(scope="module")
def gpt2_tp4():
    model = models.build("gpt2-small", {}, device="meta")
    args, dims = models.example_inputs(model, 2, 8, device="meta")
    return planned_graph(model, {"tp": N}, args, dims=dims, hardware="a100", rewrite=True,
                         sizes={"batch": BATCH, "seq": SEQ})


def _strategy(gm, fqn: str) -> str:
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.fqn == fqn and rec.strategy and str(node.target).endswith("linear.default"):
            return rec.strategy.split("[")[0]
    raise AssertionError(f"no linear in {fqn}")


def test_gpt2_small_tp4_is_the_megatron_layout(gpt2_tp4):
    gm, plan = gpt2_tp4
    for i in (0, 5, 11):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert _strategy(gm, f"layers.{i}.attn.{proj}") == "colwise"
            assert plan.params[f"layers.{i}.attn.{proj}.weight"] == "S(0)"
        assert _strategy(gm, f"layers.{i}.attn.o_proj") == "rowwise"
        assert plan.params[f"layers.{i}.attn.o_proj.weight"] == "S(1)"
        assert _strategy(gm, f"layers.{i}.mlp.fc") == "colwise"
        assert _strategy(gm, f"layers.{i}.mlp.proj") == "rowwise"
        assert plan.params[f"layers.{i}.mlp.fc.weight"] == "S(0)"
        assert plan.params[f"layers.{i}.mlp.proj.weight"] == "S(1)"
    # Attention runs with its heads split.
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert all(info(n).strategy.startswith("heads") for n in sdpa)
    # 50257 does not divide by 4: the vocabulary is never split.
    assert plan.params["wte.weight"] in ("R", "S(1)")


def _bus_factor(kind: str) -> float:
    return {"all_reduce": 2 * (N - 1) / N, "all_gather": (N - 1) / N, "reduce_scatter": (N - 1) / N,
            "all_to_all": (N - 1) / N ** 2}.get(kind, 0.0)


def test_gpt2_small_tp4_moves_two_all_reduces_per_layer_each_way(gpt2_tp4):
    gm, _ = gpt2_tp4
    fwd = bwd = 0.0
    param_grads = []
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.collective is None or not within(rec.fqn, "layers.3"):
            continue
        if node.args[0].op == "placeholder":
            # Sequence-parallel norms: their weights' partial gradients are summed.
            param_grads.append((info(node.args[0]).target_fqn, rec.collective.forward, rec.collective.backward))
            continue
        fwd += _bus_factor(rec.collective.forward) * rec.collective.nbytes
        bwd += _bus_factor(rec.collective.backward) * rec.collective.nbytes
    for fqn, f, b in param_grads:  # row-parallel biases are masked locally, no communication
        assert f in ("none", "mask") and (b == "none" or (".ln" in fqn and b == "all_reduce")), (fqn, f, b)
    bsh = BATCH * SEQ * 768 * 4  # fp32 activations
    expected = 2 * _bus_factor("all_reduce") * bsh
    assert fwd == pytest.approx(expected, rel=1e-9)
    assert bwd == pytest.approx(expected, rel=1e-9)


def test_tiny_layers_stay_replicated_when_communication_costs_more():
    model = models.build("gpt", dict(layers=1, hidden=32, heads=4, vocab=64, max_seq=16), device="meta")
    args, dims = models.example_inputs(model, 2, 8, device="meta")
    _, plan = planned_graph(model, {"tp": 2}, args, dims=dims, hardware="a100", sizes={"batch": 2, "seq": 8})
    assert set(plan.params.values()) == {"R"}


def test_memory_budget_forces_splitting():
    model = models.build("gpt", dict(layers=1, hidden=32, heads=4, vocab=64, max_seq=16), device="meta")
    args, dims = models.example_inputs(model, 2, 8, device="meta")
    _, plan = planned_graph(model, {"tp": 2}, args, dims=dims, hardware="a100", sizes={"batch": 2, "seq": 8},
                            memory_budget=1)
    assert sum(v != "R" for v in plan.params.values()) >= 10


@pytest.mark.parametrize("src,dst,kind", [
    (R, R, "none"), (Shard(1), R, "all_gather"), (P, R, "all_reduce"), (P, Shard(0), "reduce_scatter"),
    (R, Shard(2), "chunk"), (Shard(0), Shard(1), "all_to_all"), (R, P, "mask")])
def test_transition_table(src, dst, kind):
    assert transition(src, dst).kind == kind


def test_spec_text_round_trips():
    for text in ("R", "P", "S(2)", "R/gP"):
        assert str(Spec.parse(text)) == text


def test_every_zoo_op_has_a_rule_or_is_a_source(caplog):
    """Ops the zoo's dense models produce all have sharding rules, except the
    position/frequency sources that only ever run replicated."""
    for name, ov in (("gpt", {}), ("llama", {})):
        model = models.build(name, dict(layers=1, **ov), device="meta")
        args, dims = models.example_inputs(model, 2, 8, device="meta")
        gm, _ = planned_graph(model, {"tp": 2}, args, dims=dims, hardware="a100")
        for node in gm.graph.nodes:
            if node.op == "call_function" and info(node).values and "arange" not in str(node.target) \
                    and "pow.Scalar" not in str(node.target):
                assert len(strategies(node, 2, {"batch": 2, "seq": 8})) >= 1
    sources = {"aten.arange.default", "aten.arange.start_step", "aten.pow.Scalar"}
    for rec in caplog.records:
        if "no sharding rule" in rec.getMessage():
            assert any(s in rec.getMessage() for s in sources), rec.getMessage()


class _Norm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_adding_a_number_never_keeps_a_partial_value():
    """P + 1e-6 would add the number once per rank: only tensor + tensor stays partial."""
    from conftest import analysed
    gm = analysed(_Norm(), (torch.randn(2, 4, 8),))
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert adds
    for node in adds:
        for s in strategies(node, 2, {}):
            assert all(spec.value != P for spec in s.inputs + s.outputs), str(s)
