"""The context axis's costs: what each kind of context-parallel attention sends and how long it
takes, per attention op, and which kind is cheapest.

The sequence of ``seq`` tokens is split over ``cp`` ranks (``t = seq / cp`` each, load-balanced
so causal work is even). Per attention op and rank, as ``runtime/cp.py`` runs them:

- **allgather**: the keys and values of the whole sequence are gathered (all-gather of
  ``2 b h_kv seq d`` elements), their gradients reduce-scattered in backward; neither hidden
  under compute (the attention needs the whole of them).
- **alltoall** (Ulysses): queries, keys, values and the output each cross once (all-to-all of
  ``b h t d`` elements), forward and backward; needs ``cp`` to divide the heads.
- **ring**: ``cp - 1`` steps, each sending this rank's key and value block (``2 b h_kv t d``) to
  the next rank while the block at hand is attended, so only what a step's transfer takes
  beyond a block's compute shows; backward sends keys, values and their gradient sums
  (twice the bytes) and waits for each step.

Compute per rank is the attention's ``4 b h t seq d`` FLOPs (half under a causal mask),
backward twice that. Collectives are priced on the links the cp axis spans
(:func:`autopar.cost.comm.collective_time`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate
from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.compute import compute_time

KINDS = ("ring", "allgather", "alltoall")


@dataclass(frozen=True)
class AttentionShape:
    """One attention op as the whole sequence sees it: ``[batch, heads, seq, head_dim]`` queries,
    ``kv_heads`` key/value heads, element size in bytes."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    itemsize: int = 2
    causal: bool = True


@dataclass(frozen=True)
class KindCost:
    """One kind's price for one attention op per rank: seconds of exposed communication forward
    and backward, bytes this rank sends per step, and why it cannot run (or "")."""

    kind: str
    comm_fwd_s: float
    comm_bwd_s: float
    sent_bytes: float
    refused: str = ""

    @property
    def exposed_s(self) -> float:
        return float("inf") if self.refused else self.comm_fwd_s + self.comm_bwd_s


def attention_flops(a: AttentionShape, cp: int) -> float:
    """Forward FLOPs of one rank's share of the attention (scores and weighted sum)."""
    flops = 4.0 * a.batch * a.heads * (a.seq / cp) * a.seq * a.head_dim
    return flops / 2 if a.causal else flops


def kind_cost(kind: str, a: AttentionShape, cp: int, cluster: Cluster, mesh_axes: Sequence[tuple[str, int]],
              axis: str = "cp", dtype: str = "bf16") -> KindCost:
    """What ``kind`` costs for attention ``a`` split over ``cp`` ranks (module docstring)."""
    if cp == 1:
        return KindCost(kind, 0.0, 0.0, 0.0)
    t = a.seq / cp

    def coll(what: str, nbytes: float) -> float:
        return collective_time(what, nbytes, cluster, mesh_axes, axis)
    if kind == "allgather":
        whole = 2.0 * a.batch * a.kv_heads * a.seq * a.head_dim * a.itemsize
        return KindCost(kind, coll("all_gather", whole), coll("reduce_scatter", whole), whole * (cp - 1) / cp)
    if kind == "alltoall":
        if a.heads % cp:
            return KindCost(kind, 0.0, 0.0, 0.0, refused=f"cp={cp} does not divide {a.heads} heads")
        kv = a.kv_heads if a.kv_heads % cp == 0 else a.heads          # too few key heads: repeated first
        q_bytes = a.batch * a.heads * t * a.head_dim * a.itemsize
        kv_bytes = a.batch * kv * t * a.head_dim * a.itemsize
        step = 2 * coll("all_to_all", q_bytes) + 2 * coll("all_to_all", kv_bytes)     # q, o; k, v
        return KindCost(kind, step, step, (2 * q_bytes + 2 * kv_bytes) * (cp - 1) / cp)
    if kind == "ring":
        block = 2.0 * a.batch * a.kv_heads * t * a.head_dim * a.itemsize
        hop = coll("send_recv", block)
        compute = compute_time(attention_flops(a, cp) / cp, cluster.device, dtype)
        fwd = (cp - 1) * max(0.0, hop - compute)
        bwd = (cp - 1) * coll("send_recv", 2 * block)
        return KindCost(kind, fwd, bwd, block * (cp - 1))
    raise ValueError(f"unknown context-parallel kind {kind!r}")


def choose_kind(ops: Sequence[AttentionShape], cp: int, cluster: Cluster, mesh_axes: Sequence[tuple[str, int]],
                axis: str = "cp", dtype: str = "bf16") -> tuple[str, dict[str, float]]:
    """The kind with the least exposed communication over ``ops`` (ties: ring, allgather,
    alltoall), and each kind's total seconds (inf where it cannot run)."""
    totals = {k: sum(kind_cost(k, a, cp, cluster, mesh_axes, axis, dtype).exposed_s for a in ops) for k in KINDS}
    best = min(KINDS, key=lambda k: (totals[k], KINDS.index(k)))
    return best, totals


def block_costs(facts, c, cluster: Cluster, axes: Sequence[tuple[str, int]], kind: str | None = None):
    """For one block of the simulator's model (``facts``: its ``attention_ops``) under
    configuration ``c`` (micro-batch, tp, cp): (kind, forward and backward seconds of the context
    axis's exchanges, each kind's total): ``kind``, or the cheapest. Heads are the tensor
    rank's (``tp`` splits them)."""
    at = facts.sizes(c.micro_batch)
    width = 2 if facts.dtype in ("bf16", "fp16") else 4
    shapes = []
    for q, k, causal in facts.attention_ops:
        b, h, s, d = (int(evaluate(x, at)) for x in q)
        shapes.append(AttentionShape(batch=b, heads=max(1, h // c.tp), kv_heads=max(1, int(evaluate(k[1], at)) // c.tp),
                                     seq=s, head_dim=d, itemsize=width, causal=causal))
    totals: dict[str, float] = {}
    if kind is None:
        kind, totals = choose_kind(shapes, c.cp, cluster, axes, "cp", facts.dtype)
    costs = [kind_cost(kind, a, c.cp, cluster, axes, "cp", facts.dtype) for a in shapes]
    if any(x.refused for x in costs):
        raise ConfigError(f"cp kind {kind}: {costs[0].refused}", where="config")
    return kind, sum(x.comm_fwd_s for x in costs), sum(x.comm_bwd_s for x in costs), totals
