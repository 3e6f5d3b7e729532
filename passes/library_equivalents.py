"""Shape-static equivalents of library layers whose Python code ``torch.export`` cannot follow.

Some ``transformers`` layers loop over a tensor whose length depends on the data (``for i in
mask.nonzero():``), which no graph can hold. Where such a loop has an equivalent over a fixed
range that computes the same values by the same ops in the same order, the capture swaps the
layer's ``forward`` for that equivalent while it traces (:func:`equivalents`), and only then:
the user's model is never changed. Each entry says why its equivalent is exact.

- ``transformers`` DBRX ``DbrxExperts``: the library runs the experts some token chose, in
  ascending order; the equivalent runs every expert in ascending order, and an expert no token
  chose gathers no row and adds nothing (``index_add_`` of zero rows), so every value is the same.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


def _dbrx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
    # integer masks carry no gradient: the library's no_grad blocks are left out (no grad-mode nodes)
    expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    split_expert_shape = (-1, self.ffn_hidden_size, self.hidden_size)
    for expert_idx in range(self.num_experts):      # every expert, in order (the module docstring)
        idx, token_idx = torch.where(expert_mask[expert_idx])
        v1 = self.mlp.v1.view(split_expert_shape)[expert_idx]
        w1 = self.mlp.w1.view(split_expert_shape)[expert_idx]
        w2 = self.mlp.w2.view(split_expert_shape)[expert_idx]
        states = self.mlp(hidden_states[token_idx], w1, v1, w2)
        states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]
        next_states.index_add_(0, token_idx, states)
    return next_states.view(batch_size, -1, self.hidden_size)


# (module, class) -> the forward to trace instead of the class's own
EQUIVALENTS: dict[tuple[str, str], Callable] = {
    ("transformers.models.dbrx.modeling_dbrx", "DbrxExperts"): _dbrx_experts_forward,
}


@contextmanager
def equivalents(model: torch.nn.Module) -> Iterator[None]:
    """While capturing ``model``: each library class of :data:`EQUIVALENTS` it uses traces its
    equivalent forward (the class's own is put back afterwards, whatever happens)."""
    used = {(type(m).__module__, type(m).__name__): type(m) for m in model.modules()}
    swapped = []
    try:
        for key, forward in EQUIVALENTS.items():
            cls = used.get(key)
            if cls is None or cls is not getattr(importlib.import_module(key[0]), key[1], None):
                continue
            swapped.append((cls, cls.__dict__["forward"]))
            cls.forward = forward
        yield
    finally:
        for cls, own in swapped:
            cls.forward = own
