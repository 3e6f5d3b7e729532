"""Memory pass: saved-for-backward bytes vs what autograd really saves; state bytes."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar import models
from autopar.core.errors import ConfigError
from autopar.passes.capture import wrap_graph
from autopar.passes.flops import flop_pass
from autopar.passes.memory import memory_pass, optimizer_state_bytes, state_bytes
from autopar.core.meta import info
from autopar.passes.shapes import shape_pass
from autopar.summary import at, totals
from tests.conftest import analysed

aten = torch.ops.aten


def measured_saved_bytes(model: torch.nn.Module, args: tuple) -> int:
    """Bytes of distinct non-parameter storages autograd saves during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(seen.values())


SAVED_CASES = [("mlp", {}), ("gpt", {"layers": 2}), ("llama", {"layers": 2}), ("moe", {"layers": 2})]


def _runtime_saved(rank: int, world: int) -> list[tuple[int, int]]:
    """Per case: the bytes the plain model and the model as autopar runs it (one rank, its fused
    ops in place: passes/fusion.py) save in one forward."""
    import autopar
    out = []
    for name, overrides in SAVED_CASES:
        torch.manual_seed(0)
        model = models.build(name, overrides, device="cpu")
        args, _ = models.example_inputs(model, 2, 16, device="cpu")
        plain = measured_saved_bytes(model, args)
        out.append((plain, measured_saved_bytes(autopar.parallelize(model, {"dp": 1}, args), args)))
    return out


@pytest.fixture(scope="module")
def runtime_saved():
    from autopar.runtime.launch import run_ranks
    return run_ranks(_runtime_saved, 1, timeout_s=300)[0]


@pytest.mark.parametrize("i", range(len(SAVED_CASES)), ids=[c[0] for c in SAVED_CASES])
def test_saved_bytes_match_autograd(runtime_saved, i):
    """The memory pass's saved bytes are what autograd saves when autopar runs the model (with
    its fused ops; the plain model keeps more where they apply: the zoo Llama's norms and MLPs)."""
    name, overrides = SAVED_CASES[i]
    torch.manual_seed(0)
    model = models.build(name, overrides, device="cpu")
    args, dims = models.example_inputs(model, 2, 16, device="cpu")
    predicted = at(totals(analysed(model, args, dims)).activation_bytes, {"batch": 2, "seq": 16})
    plain, measured = runtime_saved[i]
    assert predicted == pytest.approx(measured, rel=0.01)
    assert measured <= plain


def _chain() -> fx.GraphModule:
    """x -> linear(w1) -> gelu -> linear(w2): gelu's input is saved; its output, which the
    projection alone reads, runs fused and is recomputed (passes/fusion.py)."""
    g = fx.Graph()
    x, w1, w2 = g.placeholder("x"), g.placeholder("w1"), g.placeholder("w2")
    x.meta["val"], w1.meta["val"], w2.meta["val"] = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    h = g.call_function(aten.linear.default, (x, w1))
    a = g.call_function(aten.gelu.default, (h,))
    g.output(g.call_function(aten.linear.default, (a, w2)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    wrap_graph(gm, params={"w1": "fc1.weight", "w2": "fc2.weight"})
    return memory_pass(flop_pass(shape_pass(gm)))


def test_hand_graph_saved_values_and_liveness():
    gm = _chain()
    by = {n.name: info(n) for n in gm.graph.nodes}
    assert by["x"].saved_bytes == 4 * 8 * 4          # input of linear(w1), w1 trainable
    assert by["linear_default"].saved_bytes == 4 * 16 * 4    # gelu keeps its input
    assert by["gelu_default"].saved_bytes == 0               # fused into linear(w2): recomputed
    assert by["linear_default_1"].saved_bytes == 0           # the output is not saved
    # liveness: after the last node, saved values plus the output are live
    assert by["linear_default_1"].live_bytes == 4 * 16 * 4 + 4 * 8 * 4


def test_state_bytes_by_optimizer():
    gm = _chain()
    n = 16 * 8 * 2
    s = state_bytes(gm, "adamw")
    assert (s.params, s.grads, s.optimizer) == (n * 4, n * 4, n * 8)
    assert state_bytes(gm, "sgd").optimizer == 0
    bf16 = state_bytes(gm, "adam", param_dtype=torch.bfloat16)
    assert (bf16.params, bf16.grads, bf16.optimizer) == (n * 2, n * 2, n * 12)  # ZeRO's 2+2+12


def test_unknown_optimizer_is_a_config_error():
    with pytest.raises(ConfigError, match="lion"):
        optimizer_state_bytes(10, "lion")


def test_transformers_models_reach_only_operators_with_saved_tensor_rules():
    """Every operator a tiny Llama, GPT-2 and Mixtral (its grouped-matmul fallback included)
    reach has a saved-tensor rule (or is a view), so no rank prints "no saved-tensor rule"."""
    pytest.importorskip("transformers")
    import transformers

    from autopar.passes.capture import capture
    from autopar.passes.flops import is_view_like
    from autopar.passes.memory import NAMED_SAVE_RULES, SAVE_RULES
    from autopar.passes.pipeline import analyze
    from tests import hf_tiny
    from tests.test_ep_hf import _config
    models_ = [hf_tiny.build("llama"), hf_tiny.build("gpt2"),
               transformers.AutoModelForCausalLM.from_config(_config("mixtral", None))]
    missing = set()
    for model in models_:
        gm = analyze(capture(model, kwargs=hf_tiny.batch(), cache=False))
        for node in gm.graph.nodes:
            if node.op == "call_function" and info(node).requires_grad and not is_view_like(node) and (
                    node.target not in SAVE_RULES and str(node.target) not in NAMED_SAVE_RULES):
                missing.add(str(node.target))
    assert not missing, sorted(missing)
