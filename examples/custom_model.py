"""A model of your own for the CLI: ``autopar dump --model examples/custom_model.py:factory``
(or ``autopar plan --model ...``). The file defines ``factory(batch, seq)`` returning the
model, its example inputs and which input dims are the batch and the sequence; the CLI builds
it on the meta device, so its size costs no memory."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """An embedding, repeated residual MLP blocks and a head: the shape of a language model."""

    def __init__(self, vocab: int = 1000, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def factory(batch: int, seq: int):
    model = TokenMLP()
    ids = torch.randint(0, 1000, (batch, seq))
    return model, (ids,), ({0: "batch", 1: "seq"},)
