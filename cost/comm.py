"""Alpha-beta cost (seconds) of collectives, per mesh axis, with the links that axis spans.

Bytes convention (every function here): ``nbytes`` is the size of the full logical tensor
one rank sees on the *large* side of the collective:

- ``all_reduce``: the tensor each rank holds (input size == output size per rank);
- ``all_gather``: the gathered OUTPUT per rank (n x the input shard);
- ``reduce_scatter``: the unscattered INPUT per rank (n x the output shard);
- ``all_to_all``: the whole send buffer per rank (== its receive buffer), of which (n-1)/n
  leaves the rank;
- ``broadcast``: the tensor broadcast; ``send_recv``: the message sent.

Bandwidth convention: ``bw`` is the *bus bandwidth* of nccl-tests (NCCL's
doc/PERFORMANCE.md): for all_reduce busbw = algbw * 2(n-1)/n, for all_gather /
reduce_scatter busbw = algbw * (n-1)/n, where algbw = nbytes / time. Hence the ring formulas
below with ``bw`` = busbw reproduce measured times, and the measured all-reduce busbw
(230 GB/s on DGX A100, 370 GB/s on DGX H100) is the intra-node figure for every collective.
Inter-node, each device's NIC bandwidth plays the same role.

Latency: ``alpha`` is the cost per ring step; ``base`` a fixed cost per call (NCCL's base
latency). With ``base = 0`` the closed forms are the textbook ones (Thakur et al., "Optimization
of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan 2009).
A group of size n == 1 costs 0.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from autopar.cost.cluster import AxisLinks, Cluster, Link
from autopar.core.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
               "broadcast")
_KIND_ALIASES = {"p2p": "send_recv", "send": "send_recv", "recv": "send_recv",
                 "allreduce": "all_reduce", "allgather": "all_gather",
                 "reducescatter": "reduce_scatter", "alltoall": "all_to_all"}


def ring_coefficients(kind: str, n: int) -> tuple[float, float]:
    """``(steps, volume)`` of the flat ring form: time = base + steps*alpha + volume*nbytes/bw.

    Shared by the cost functions and by calibration (which inverts it to get alpha and bw).
    """
    kind = canonical_kind(kind)
    if n <= 1:
        return 0.0, 0.0
    frac = (n - 1) / n
    table = {"all_reduce": (2.0 * (n - 1), 2.0 * frac),
             "all_gather": (n - 1.0, frac),
             "reduce_scatter": (n - 1.0, frac),
             "all_to_all": (n - 1.0, frac),
             # Pipelined ring/chain broadcast: the message streams once through each link.
             "broadcast": (n - 1.0, 1.0),
             "send_recv": (1.0, 1.0)}
    return table[kind]


def canonical_kind(kind: str) -> str:
    """The canonical collective name, or a ConfigError listing the known ones."""
    key = str(kind).strip().lower()
    key = _KIND_ALIASES.get(key, key)
    if key not in COLLECTIVES:
        raise ConfigError(f"unknown collective {kind!r}", where="collective kind",
                          expected=", ".join(COLLECTIVES), got=repr(kind))
    return key


def _check(nbytes: float, n: int) -> None:
    if nbytes < 0:
        raise ConfigError("a message size must not be negative", where="collective bytes",
                          expected=">= 0", got=repr(nbytes))
    if n < 1:
        raise ConfigError("a group needs at least one member", where="collective group size",
                          expected=">= 1", got=repr(n))


def _ring(kind: str, nbytes: float, n: int, bw: float, alpha: float, base: float) -> float:
    _check(nbytes, n)
    if n == 1:
        return 0.0
    steps, volume = ring_coefficients(kind, n)
    return base + steps * alpha + volume * nbytes / bw


def all_reduce(nbytes: float, n: int, bw: float, alpha: float, base: float = 0.0) -> float:
    """Ring all-reduce: 2(n-1)/n * nbytes/bw + 2(n-1) alpha (+ base)."""
    return _ring("all_reduce", nbytes, n, bw, alpha, base)


def all_gather(nbytes: float, n: int, bw: float, alpha: float, base: float = 0.0) -> float:
    """Ring all-gather of ``nbytes`` gathered output: (n-1)/n * nbytes/bw + (n-1) alpha."""
    return _ring("all_gather", nbytes, n, bw, alpha, base)


def reduce_scatter(nbytes: float, n: int, bw: float, alpha: float, base: float = 0.0) -> float:
    """Ring reduce-scatter of ``nbytes`` input: (n-1)/n * nbytes/bw + (n-1) alpha."""
    return _ring("reduce_scatter", nbytes, n, bw, alpha, base)


def all_to_all(nbytes: float, n: int, bw: float, alpha: float, base: float = 0.0) -> float:
    """Pairwise all-to-all of an ``nbytes`` buffer: (n-1)/n * nbytes/bw + (n-1) alpha."""
    return _ring("all_to_all", nbytes, n, bw, alpha, base)


def broadcast(nbytes: float, n: int, bw: float, alpha: float, base: float = 0.0) -> float:
    """Pipelined broadcast: nbytes/bw + (n-1) alpha (busbw == algbw for broadcast)."""
    return _ring("broadcast", nbytes, n, bw, alpha, base)


def send_recv(nbytes: float, bw: float, alpha: float, base: float = 0.0) -> float:
    """Point-to-point message: alpha + nbytes/bw (+ base)."""
    return _ring("send_recv", nbytes, 2, bw, alpha, base)


def flat_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """``kind`` over a flat ring of ``n`` members on one kind of ``link``."""
    kind = canonical_kind(kind)
    if kind == "send_recv" and n > 1:
        return send_recv(nbytes, link.bandwidth, link.hop_latency_s, link.base_latency_s)
    return _ring(kind, nbytes, n, link.bandwidth, link.hop_latency_s, link.base_latency_s)


def hierarchical_time(kind: str, nbytes: float, k: int, m: int, intra: Link, inter: Link) -> float:
    """``kind`` over ``k`` members per node on ``m`` nodes (n = k*m), in two levels.

    all_reduce: intra reduce-scatter, inter all-reduce of the 1/k shard, intra all-gather.
    all_gather: inter all-gather of the node-local shards (nbytes/k out), then intra all-gather.
    reduce_scatter: intra reduce-scatter, then inter reduce-scatter of the 1/k part.
    all_to_all: the (k-1)/n share moves intra-node, the (n-k)/n share through the NICs.
    broadcast: one pipelined chain through all members, paced by the slower link.
    send_recv: the neighbour may be on another node: charged as an inter-node message.
    """
    kind = canonical_kind(kind)
    _check(nbytes, k * m)
    if k * m == 1:
        return 0.0
    # One NCCL call pays its base latency once, however many levels it runs.
    base = max(intra.base_latency_s if k > 1 else 0.0, inter.base_latency_s if m > 1 else 0.0)
    return base + _two_level(kind, nbytes, k, m, replace(intra, base_latency_s=0.0),
                             replace(inter, base_latency_s=0.0))


def _two_level(kind: str, nbytes: float, k: int, m: int, intra: Link, inter: Link) -> float:
    if kind == "all_reduce":
        return (flat_time("reduce_scatter", nbytes, k, intra)
                + flat_time("all_reduce", nbytes / k, m, inter)
                + flat_time("all_gather", nbytes, k, intra))
    if kind == "all_gather":
        return (flat_time("all_gather", nbytes / k, m, inter)
                + flat_time("all_gather", nbytes, k, intra))
    if kind == "reduce_scatter":
        return (flat_time("reduce_scatter", nbytes, k, intra)
                + flat_time("reduce_scatter", nbytes / k, m, inter))
    if kind == "broadcast":  # one pipelined chain: every hop pays alpha, the slowest link paces
        return ((m - 1) * inter.hop_latency_s + (k - 1) * intra.hop_latency_s
                + nbytes / min(intra.bandwidth, inter.bandwidth))
    if kind == "send_recv":
        return flat_time("send_recv", nbytes, 2, inter if m > 1 else intra)
    n = k * m  # all_to_all
    return ((k - 1) * intra.hop_latency_s + (k - 1) / n * nbytes / intra.bandwidth
            + (n - k) * inter.hop_latency_s + (n - k) / n * nbytes / inter.bandwidth)


def axis_time(kind: str, nbytes: float, cluster: Cluster, links: AxisLinks) -> float:
    """``kind`` over one group of an axis whose placement is ``links``."""
    if links.size == 1:
        _check(nbytes, 1)
        return 0.0
    if links.kind == "intra":
        return flat_time(kind, nbytes, links.size, cluster.intra)
    if links.kind == "inter" and links.regular:
        return flat_time(kind, nbytes, links.size, cluster.inter)
    k = links.members_per_node
    m = max(links.nodes_spanned, -(-links.size // k))
    return hierarchical_time(kind, nbytes, k, m, cluster.intra, cluster.inter)


def collective_time(kind: str, bytes: float, cluster: Cluster,  # noqa: A002 - public name
                    mesh_axes: Sequence[tuple[str, int]], axis: str) -> float:
    """Seconds for one ``kind`` collective of ``bytes`` (see the module's bytes convention)
    over the process groups of mesh axis ``axis`` on ``cluster``.

    ``mesh_axes`` is ``[(name, size), ...]`` with the last axis innermost; its product must
    equal the cluster's world size.
    """
    links = cluster.axis_links(mesh_axes, axis)
    return axis_time(kind, float(bytes), cluster, links)
