"""Expert-parallel runtime: the all-to-all token exchange around a mixture-of-experts layer.

Each rank of the expert axis routes its own tokens into a fixed-capacity buffer
``[E, C, h]`` (exactly as the single-device model does for those tokens) and owns ``E/n``
experts. :func:`dispatch` sends every expert's rows to the rank that owns it; the owner
runs its experts on ``[E/n, n*C, h]`` (the rows of all ranks side by side) and
:func:`combine` sends the results back, so each rank reads its tokens' outputs from a
``[E, C, h]`` buffer again. The expert order ``perm`` puts the experts a rank owns next
to each other: rank ``r`` owns ``perm[r*E/n:(r+1)*E/n]`` (the placement the planner chose).
Both are autograd functions whose backward is the opposite exchange. The graph calls them
as ``autopar_ep_dispatch(x, rid)`` / ``autopar_ep_combine(y, rid)`` nodes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

_RUNTIMES: dict[int, "EPRuntime"] = {}
_IDS = itertools.count()


@dataclass
class EPRuntime:
    """One expert axis: its group, this rank's place on it, and the expert order."""

    n: int
    rank: int
    group: dist.ProcessGroup | None
    perm: tuple[int, ...]            # expert ids in owner order
    id: int = -1

    def __post_init__(self) -> None:
        self.id = next(_IDS)
        _RUNTIMES[self.id] = self
        self.inverse = tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i]))
        self._perm_t = torch.tensor(self.perm)
        self._inv_t = torch.tensor(self.inverse)
        self._identity = list(self.perm) == sorted(self.perm)   # experts in order: no reordering copies

    @property
    def experts(self) -> int:
        return len(self.perm)

    def owned(self, rank: int | None = None) -> tuple[int, ...]:
        per = self.experts // self.n
        r = self.rank if rank is None else rank
        return self.perm[r * per:(r + 1) * per]

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    # [E, C, h] in expert order -> [E/n, n*C, h] of this rank's experts
    def to_owners(self, x: torch.Tensor) -> torch.Tensor:
        e, c = x.shape[0], x.shape[1]
        rest = x.shape[2:]
        per = e // self.n
        ordered = x if self._identity else x.index_select(0, self._perm_t.to(x.device))
        got = self._exchange(ordered)                                        # [n(src) * per, C, ...]
        return got.reshape(self.n, per, c, *rest).transpose(0, 1).reshape(per, self.n * c, *rest)

    # [E/n, n*C, h] of this rank's experts -> [E, C, h] in expert order
    def from_owners(self, y: torch.Tensor) -> torch.Tensor:
        per, nc = y.shape[0], y.shape[1]
        rest = y.shape[2:]
        c = nc // self.n
        out = y.reshape(per, self.n, c, *rest).transpose(0, 1).reshape(self.n * per, c, *rest)
        back = self._exchange(out)                                           # [E (owner order), C, ...]
        return back if self._identity else back.index_select(0, self._inv_t.to(y.device))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rid: int) -> torch.Tensor:
        ctx.rid = rid
        return _RUNTIMES[rid].to_owners(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RUNTIMES[ctx.rid].from_owners(grad), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, rid: int) -> torch.Tensor:
        ctx.rid = rid
        return _RUNTIMES[rid].from_owners(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RUNTIMES[ctx.rid].to_owners(grad), None


def autopar_ep_dispatch(x: torch.Tensor, rid: int) -> torch.Tensor:
    """Send each expert's buffer rows to its owner (graph node)."""
    return _Dispatch.apply(x, rid)


def autopar_ep_combine(y: torch.Tensor, rid: int) -> torch.Tensor:
    """Send the experts' outputs back to the ranks whose tokens they are (graph node)."""
    return _Combine.apply(y, rid)


EP_OPS = (autopar_ep_dispatch, autopar_ep_combine)

__all__ = ["EPRuntime", "autopar_ep_dispatch", "autopar_ep_combine", "EP_OPS"]
