"""Mixtral-style mixture-of-experts decoder with fixed-capacity (static-shape) dispatch.

Every shape in the forward pass is a function of the (possibly symbolic) batch and seq
sizes only: expert capacity is computed with integer arithmetic, dropped tokens are
masked rather than removed, and dispatch/combine use scatter/gather on fixed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from .llama import Llama, LlamaBlock, LlamaConfig


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """A LLaMA config plus the expert layer's shape."""

    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts < 1:
            raise ValueError(f"MoEConfig.experts must be >= 1, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be in [1, experts={self.experts}]")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0, got {self.capacity_factor}")


MIN_CAPACITY = 2


def expert_capacity(tokens: int | torch.SymInt, experts: int, top_k: int,
                    capacity_factor: float) -> int | torch.SymInt:
    """``max(MIN_CAPACITY, ceil(capacity_factor * tokens * top_k / experts))``, exactly.

    ``tokens`` may be a SymInt; no float is ever formed from it, so export keeps it symbolic.
    The floor of 2 lets the tracer prove ``capacity != 1``; without it export installs a
    size-1 guard on the [E, C, h] buffers that fails for small batches.
    """
    frac = Fraction(capacity_factor).limit_denominator(1000)
    num, den = frac.numerator, frac.denominator
    ceil = (num * tokens * top_k + den * experts - 1) // (den * experts)
    return torch.sym_max(ceil, MIN_CAPACITY)


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts with stacked weights and capacity-limited buffers."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int,
                 capacity_factor: float) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) init for the stacked expert weights."""
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, mean=0.0, std=0.02)

    def route(self, x: torch.Tensor, capacity: int | torch.SymInt
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route flat tokens [T, h] to (expert, position, weight, keep), each [k*T].

        Rows are choice-major (all 1st choices, then all 2nd choices, ...), so a token's
        1st choice takes a buffer place before any token's 2nd choice; within a choice,
        earlier tokens go first. Dropped rows (``keep == 0``) point at position 0 of
        their expert and carry zero weight.
        """
        probs = F.softmax(self.router(x).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        expert = top_i.t().reshape(-1)
        weight = top_w.t().reshape(-1).to(x.dtype)
        onehot = (expert.unsqueeze(-1) == torch.arange(self.experts, device=x.device)).long()
        position = (torch.cumsum(onehot, dim=0) * onehot).sum(dim=-1) - 1
        keep = (position < capacity).long()
        return expert, position * keep, weight * keep.to(x.dtype), keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MoE to ``x`` [B, S, h]; tokens over capacity contribute zero."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        tokens = flat.shape[0]
        capacity = expert_capacity(tokens, self.experts, self.top_k, self.capacity_factor)
        expert, position, weight, keep = self.route(flat, capacity)
        src = flat.repeat(self.top_k, 1) * keep.to(x.dtype).unsqueeze(-1)
        buf = flat.new_zeros(self.experts, capacity, h)
        buf = buf.index_put((expert, position), src, accumulate=True)
        gate = torch.bmm(buf, self.w_gate.transpose(1, 2))
        up = torch.bmm(buf, self.w_up.transpose(1, 2))
        out = torch.bmm(F.silu(gate) * up, self.w_down.transpose(1, 2))
        picked = out[expert, position]
        combined = (picked * weight.unsqueeze(-1)).view(self.top_k, tokens, h).sum(dim=0)
        return combined.view(b, s, h)


class MoE(Llama):
    """Mixtral-style model: LLaMA blocks whose MLP is a :class:`MoELayer`."""

    config: MoEConfig

    def _make_block(self, cfg: LlamaConfig) -> LlamaBlock:
        """A LLaMA block with the SwiGLU MLP replaced by routed experts."""
        assert isinstance(cfg, MoEConfig)
        layer = MoELayer(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, cfg.capacity_factor)
        return LlamaBlock(cfg, mlp=layer)
