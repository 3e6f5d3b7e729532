"""A plain stack of square Linear layers with GELU between them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """``depth`` Linear(width, width) layers."""

    width: int = 256
    depth: int = 4

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"MLPConfig.width must be >= 1, got {self.width}")
        if self.depth < 1:
            raise ValueError(f"MLPConfig.depth must be >= 1, got {self.depth}")


class MLP(nn.Module):
    """``forward(x[B, width]) -> [B, width]``: Linear, GELU, ..., Linear (no GELU after the last)."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(cfg.depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply every layer, with GELU between consecutive layers."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                x = F.gelu(x)
        return x
