"""Which node each rank runs on, so tensor-parallel and expert groups can be kept inside one.

A rank's node is torchrun's node rank (``GROUP_RANK``) when torchrun started it, else its host
name. Ranks agree on everyone's node with one all-gather of a 64-bit digest of that name (no
object is unpickled). :func:`node_size` is the ranks per node without a collective: torchrun's
``LOCAL_WORLD_SIZE``.
"""
from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

_cache: dict[tuple[int, int], tuple[int, ...]] = {}


def node_size() -> int | None:
    """Ranks per node as torchrun says (``LOCAL_WORLD_SIZE``); None when unknown."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return n if n >= 1 else None


def _my_node() -> str:
    group = os.environ.get("GROUP_RANK")
    return f"{socket.gethostname()}/node-{group}" if group is not None else socket.gethostname()


def node_of_ranks() -> tuple[int, ...]:
    """Every rank's node index (numbered by first appearance in rank order); every rank calls it.
    One process: ``(0,)``."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return (0,)
    key = (id(dist.group.WORLD), dist.get_world_size())
    if key not in _cache:
        from autopar.runtime.agreement import collective_device
        digest = int.from_bytes(hashlib.sha256(_my_node().encode()).digest()[:8], "big", signed=True)
        device = collective_device()
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        index: dict[int, int] = {}
        _cache[key] = tuple(index.setdefault(int(t.item()), len(index)) for t in every)
    return _cache[key]


def regular_layout(nodes: Sequence[int]) -> tuple[int, int] | None:
    """``(node count, ranks per node)`` when every node holds the same number of consecutive
    ranks (how torchrun numbers them), else None."""
    count = len(set(nodes))
    if len(nodes) % count:
        return None
    per = len(nodes) // count
    return (count, per) if all(nodes[r] == nodes[r - r % per] for r in range(len(nodes))) and len(
        {nodes[i * per] for i in range(count)}) == count else None


def spanning_groups(ranks: torch.Tensor, dim: int, nodes: Sequence[int]) -> int:
    """The most nodes one group of mesh dimension ``dim`` touches (``ranks``: the DeviceMesh's
    tensor of ranks)."""
    groups = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim])
    return max(len({nodes[int(r)] for r in row}) for row in groups.tolist()) if groups.numel() else 1


__all__ = ["node_of_ranks", "node_size", "regular_layout", "spanning_groups"]
