"""GPT-2 / GPT-3 style decoder-only transformer (pre-LayerNorm, learned positions, tied head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model. ``ffn == 0`` means the usual ``4 * hidden``."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 1024
    max_seq: int = 1024
    ffn: int = 0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "vocab", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.ffn < 0:
            raise ValueError(f"GPTConfig.ffn must be >= 0 (0 means 4*hidden), got {self.ffn}")
        if self.hidden % self.heads != 0:
            raise ValueError(f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.norm_eps <= 0:
            raise ValueError(f"GPTConfig.norm_eps must be > 0, got {self.norm_eps}")

    @property
    def ffn_dim(self) -> int:
        """Width of the MLP's inner layer."""
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


class GPTAttention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape [B, S, h]; returns [B, S, h]."""
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class GPTMLP(nn.Module):
    """``fc`` (h -> ffn), GELU, ``proj`` (ffn -> h)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP position-wise."""
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run one block on [B, S, h]."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT language model: ``forward(idx[B, S]) -> logits[B, S, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] to next-token logits [B, S, vocab] (head tied to ``wte``)."""
        seq = idx.shape[1]
        pos = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style init: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
