"""Capture once per repeated block: the copied graph is the whole export's, node for node, and
models whose layers cannot be copied faithfully are exported whole."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autopar import capture
from autopar.passes.capture_cache import CaptureCache, _signature
from autopar.core.meta import graph_info
from autopar.passes.replicate import find_run
from autopar.build.prepare import default_dims
from tests.conftest import TOKEN_DIMS, small
from tests.hf_tiny import build as hf_build


def _both(model, args, kwargs=None, dims=TOKEN_DIMS, caplog=None):
    whole = capture(model, args, kwargs=kwargs, dims=dims, cache=None, per_block=False)
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        copied = capture(model, args, kwargs=kwargs, dims=dims, cache=None)
    return whole, copied


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_zoo_models_copied_layers_equal_the_whole_export(name, caplog):
    m = small(name, layers=6, vocab=64)
    whole, copied = _both(m, (torch.randint(0, 64, (2, 8)),), caplog=caplog)
    assert "exported 3 of 6 layers of layers and copied 3" in caplog.text
    assert _signature(copied) == _signature(whole)
    assert list(graph_info(copied).param_fqns) == list(graph_info(whole).param_fqns)


@pytest.mark.parametrize("arch,layers,exported", [("llama", 8, 3), ("gemma2", 8, 6), ("gpt2", 8, 3),
                                                  ("opt", 8, 3), ("qwen3", 8, 3)])
def test_transformers_copied_layers_equal_the_whole_export(arch, layers, exported, caplog):
    """Tied heads (gpt2, opt), alternating sliding/full attention (gemma2: period 2)."""
    m = hf_build(arch, layers=layers)
    ids = torch.randint(3, 64, (2, 8))
    kw = {"labels": ids}
    whole, copied = _both(m, (ids,), kw, default_dims((ids,), kw), caplog=caplog)
    assert f"exported {exported} of {layers} layers" in caplog.text
    assert _signature(copied) == _signature(whole)
    assert list(graph_info(copied).param_fqns) == list(graph_info(whole).param_fqns)
    assert sorted(graph_info(copied).param_fqns.values()) == sorted(
        k for k, _ in m.named_parameters(remove_duplicate=False))


def test_a_copied_graph_computes_what_the_model_computes():
    m = small("llama", layers=6, vocab=64).double()
    x = torch.randint(0, 64, (2, 8))
    gm = capture(m, (x,), dims=TOKEN_DIMS, cache=None)
    g = graph_info(gm)
    assert len(g.param_fqns) == len(dict(m.named_parameters()))
    state = {**dict(m.named_parameters()), **dict(m.named_buffers()), **g.constants}
    inputs = [state[g.param_fqns.get(n.name) or g.buffer_fqns.get(n.name) or n.target] if n.name != "idx" else x
              for n in gm.graph.nodes if n.op == "placeholder"]
    out = gm(*inputs)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, m(x), rtol=0, atol=0)


def test_layers_the_export_cannot_prove_alike_are_exported_whole(caplog):
    """falcon's layers each lift a fresh constant: the last two periods' nodes do not match."""
    m = hf_build("falcon", layers=8)
    ids = torch.randint(3, 64, (2, 8))
    whole, copied = _both(m, (ids,), {"labels": ids}, default_dims((ids,), {"labels": ids}), caplog=caplog)
    assert "not copied" in caplog.text and "exporting every layer" in caplog.text
    assert _signature(copied) == _signature(whole)


class Stack(nn.Module):
    """Identical layers, but no config autopar reads a layer pattern from."""

    def __init__(self, n=6, shared=False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        if shared:
            self.layers[3].weight = self.layers[0].weight

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i != 4 else layer(x).relu()    # what two exported periods cannot see
        return x


def test_a_model_without_a_known_layer_pattern_is_exported_whole():
    assert find_run(Stack()) is None


def test_layers_sharing_a_parameter_are_not_copied():
    m = small("gpt", layers=6, vocab=64)
    assert find_run(m) is not None
    m.layers[4].mlp.fc.weight = m.layers[1].mlp.fc.weight
    assert find_run(m) is None


def test_a_layer_that_differs_ends_the_run_and_no_layer_is_copied():
    m = small("gpt", layers=6, vocab=64)
    m.layers[5].attn.extra = 1.5           # the last layer is not like the others: the run stops before it
    assert find_run(m) is None             # a run must reach the last layer


def test_the_cache_keeps_the_exported_periods_and_copies_them_again(tmp_path, caplog, monkeypatch):
    """The entry keeps the run with the shallow export: a hit copies the layers without
    describing every layer again to find the run."""
    from autopar.passes import capture_cache, replicate
    m = small("gpt", layers=8, vocab=64)
    x = torch.randint(0, 64, (2, 8))
    capture_cache._memory.clear()
    first = capture(m, (x,), dims=TOKEN_DIMS, cache=CaptureCache(tmp_path))
    entry, = tmp_path.glob("capture-*.json.z")
    assert entry.name.endswith(".blocks.json.z")
    capture_cache._memory.clear()

    def no_search(model):
        raise AssertionError("find_run called on a cache hit")
    monkeypatch.setattr(replicate, "find_run", no_search)
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        again = capture(m, (x,), dims=TOKEN_DIMS, cache=CaptureCache(tmp_path))
    assert "from the cache (disk)" in caplog.text and "copied 5" in caplog.text
    assert _signature(again) == _signature(first)
    assert graph_info(again).layer_run is None          # the whole graph: no run left to copy
