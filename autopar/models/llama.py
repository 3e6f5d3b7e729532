"""LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, untied head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a LLaMA model."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    ffn: int = 704
    max_seq: int = 1024
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("hidden", "layers", "heads", "kv_heads", "vocab", "ffn", "max_seq"):
            if getattr(self, field) < 1:
                raise ValueError(f"{name}.{field} must be >= 1, got {getattr(self, field)}")
        if self.hidden % self.heads != 0:
            raise ValueError(f"{name}.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads != 0:
            raise ValueError(f"{name}.kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"{name}: head dim hidden/heads = {self.head_dim} must be even for RoPE")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(f"{name}.rope_theta and norm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x * rsqrt(mean(x^2) + eps) * weight`` (computed in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dim."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(seq: int, head_dim: int, theta: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``cos, sin`` of shape [seq, head_dim] for positions ``0..seq-1``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by the position tables (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE and no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, d
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` [B, S, h] using rotary tables [S, head_dim]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # grouped-query attention: query head i reads key head i // (heads / kv_heads), without
        # repeating the keys and values to every query head (neither computed nor saved)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` without biases."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP position-wise."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Run one block on [B, S, h]."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """LLaMA language model: ``forward(idx[B, S]) -> logits[B, S, vocab]``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(self._make_block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.apply(init_weights)

    def _make_block(self, cfg: LlamaConfig) -> LlamaBlock:
        """One transformer block (subclasses swap the MLP)."""
        return LlamaBlock(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] to next-token logits [B, S, vocab]."""
        x = self.embed(idx)
        cfg = self.config
        cos, sin = rope_cos_sin(idx.shape[1], cfg.head_dim, cfg.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def init_weights(module: nn.Module) -> None:
    """N(0, 0.02) init for linears and embeddings."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
