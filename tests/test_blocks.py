"""Repeated-block classes found from structure, not names."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from autopar import models
from autopar.core.meta import graph_info, info
from tests.conftest import analysed


@settings(max_examples=6, deadline=None)
@given(layers=st.integers(1, 5), family=st.sampled_from(["gpt", "llama", "moe"]))
def test_n_layer_model_has_one_class_of_n_members(layers, family):
    model = models.build(family, {"layers": layers}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    classes = graph_info(analysed(model, args, dims)).block_classes
    if layers == 1:
        assert classes == [] or all(len(c.members) >= 2 for c in classes)
        assert not any(c.members[0].startswith("layers.") and c.members[0].count(".") == 1 for c in classes)
    else:
        top = [c for c in classes if all(m.count(".") == 1 for m in c.members)]
        assert len(top) == 1 and top[0].members == tuple(f"layers.{i}" for i in range(layers))
        assert len(classes) == 1  # nothing nested is reported again


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Named(nn.Module):
    """Identical blocks with unrelated names, and one block of another width."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.encoder_tail, self.last = Block(16), Block(16), Block(16)
        self.up = nn.Linear(16, 32)
        self.wide = Block(32)

    def forward(self, x):
        return self.wide(self.up(self.last(self.encoder_tail(self.first(x)))))


def test_classes_come_from_structure_not_names():
    gm = analysed(Named(), (torch.randn(4, 16),))
    classes = graph_info(gm).block_classes
    assert classes[0].members == ("first", "encoder_tail", "last")
    assert all("wide" not in c.members for c in classes)  # same type, other width: not a member
    wide_nodes = [n for n in gm.graph.nodes if info(n).fqn.startswith("wide")]
    assert wide_nodes and all(info(n).block_class != 0 for n in wide_nodes)
