"""What each data-axis mode (``autopar/core/dp_mode.py``) costs per training step: bytes each rank
sends, collective calls, communication seconds, the part of them the step waits for, and the
saving against all-reduce.

The planner never picks a mode other than all-reduce: every other one changes the optimisation
(parameters differ between ranks, gradients are compressed or late), and its convergence cost
is not modelled here. ``autopar plan`` only *shows* the modes that would shorten the step by
more than 10 % (:func:`price_modes` and ``autopar/cli/hybrid.py``).

Bytes are the runtime's own accounting (:func:`autopar.runtime.data_modes.ring_allreduce_bytes`,
:func:`~autopar.runtime.data_modes.allgather_bytes`, what ``ModeState.sent_bytes`` counts);
seconds are the planner's alpha-beta model (:func:`autopar.cost.comm.collective_time` on the
data axis of the mesh ``pp x dp x tp``, tp innermost as :mod:`autopar.cost.hybrid` lays ranks
out), so all-reduce is priced exactly as :func:`autopar.cost.step_terms.data_collective`
charges it. Per mode, with G the gradient bytes one rank reduces, P its fp32 parameter bytes
(the optimizer's masters, what ``after_step`` averages), m the gradient exchanges per step
(the runtime reduces every micro-batch's backward without a pipeline; once with one):

==============  ===============================================  ==================================
mode            per step                                         exposed (what the step waits for)
==============  ===============================================  ==================================
allreduce       m x buckets all-reduces of G                     the planner's figure if given,
                                                                 else all of it
local_sgd H     one all-reduce of P every H steps                all (after the optimizer step)
compressed      m x topk: all-gathers of k values + k int32      the fraction all-reduce exposes
                indices; randk: all-reduce of k values;          (same buckets, same overlap
                quantize: all-reduces of an integer level per    with backward); compression
                entry and a scale per 512 (k = ratio x entries)  compute is not priced
gossip          P to each neighbour (point-to-point), per link   all (after the optimizer step)
                of the slowest rank; every K steps (K > 0) an
                all-reduce of P instead
async s         as allreduce                                     max(0, comm - s x step compute)
==============  ===============================================  ==================================

Gossip is topology-aware: the ranks of a data-parallel group are ``i x tp`` apart (plus the
pipeline block's offset), rank ``r`` lives on node ``r // ranks_per_node``; a rank's messages
to neighbours on its node go over the intra-node link, the others through its NIC (the
inter-node link, bandwidth per device). Both kinds run at once, so a rank needs
``base + max over link kinds (messages x hop latency + bytes / bandwidth)`` and the step the
slowest rank's time. Every topology is regular and symmetric, so a rank receives what it sends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.step_terms import DataBytes, bucket_count
from autopar.core.dp_mode import DataMode
from autopar.core.errors import ConfigError
from autopar.runtime.data_modes import (QUANT_CHUNK, allgather_bytes, keep_count, level_dtype, neighbours,
                                        ring_allreduce_bytes)

DEFAULT_MODES: tuple[DataMode, ...] = (
    DataMode("local_sgd", sync_every=4), DataMode("local_sgd", sync_every=16),
    DataMode("compressed", compressor="topk", ratio=0.01), DataMode("compressed", compressor="randk", ratio=0.01),
    DataMode("compressed", compressor="quantize", levels=5),
    DataMode("gossip", topology="ring"), DataMode("gossip", topology="exponential"),
    DataMode("async", staleness=1))
"""What :func:`price_modes` prices besides all-reduce when not told otherwise."""

UNMODELLED = "convergence cost not modelled"


@dataclass(frozen=True)
class ModePrice:
    """One data-axis mode's price per training step, for one rank of the data axis.

    ``bytes_per_step``: bytes the rank sends (amortised: local_sgd's average every H steps
    counts 1/H); ``collectives_per_step``: calls, a whole gradient exchange counting as one
    collective (the runtime splits it into buckets) and gossip one per neighbour message;
    ``comm_s``: data-axis communication seconds; ``exposed_s``: of them, what the step waits
    for; ``saving_s``: all-reduce's exposed seconds minus this mode's (positive: faster);
    ``per_link_bytes``: gossip's bytes per step through the slowest rank's ``intra`` and
    ``inter`` node links (empty for collectives); ``note``: what the figure leaves out."""

    mode: DataMode
    bytes_per_step: float
    collectives_per_step: float
    comm_s: float
    exposed_s: float
    saving_s: float
    note: str
    per_link_bytes: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"mode": self.mode.to_dict(), "label": label(self.mode), "bytes_per_step": self.bytes_per_step,
                "collectives_per_step": self.collectives_per_step, "comm_s": self.comm_s, "exposed_s": self.exposed_s,
                "saving_s": self.saving_s, "per_link_bytes": dict(self.per_link_bytes), "note": self.note}


def label(mode: DataMode) -> str:
    """A mode and the options that set its price, shortly: ``gossip(topology=ring)``,
    ``compressed(topk, ratio=0.01)``, ``local_sgd(sync_every=4)``."""
    if mode.kind == "compressed":
        opt = f"levels={mode.levels}" if mode.compressor == "quantize" else f"ratio={mode.ratio:g}"
        return f"compressed({mode.compressor}, {opt})"
    shown = {"local_sgd": ("sync_every", "warmup"), "gossip": ("topology", "global_every"), "async": ("staleness",)}
    opts = [f"{k}={getattr(mode, k)}" for k in shown.get(mode.kind, ())
            if k in ("sync_every", "topology", "staleness") or getattr(mode, k)]
    return f"{mode.kind}({', '.join(opts)})" if opts else mode.kind


@dataclass(frozen=True)
class _Layout:
    """Where the data axis sits: the mesh ``pp x dp x tp`` on ``cluster``."""

    cluster: Cluster
    axes: tuple[tuple[str, int], ...]
    dp: int
    inner: int

    def coll(self, kind: str, nbytes: float) -> float:
        return collective_time(kind, nbytes, self.cluster, self.axes, "dp") if self.dp > 1 else 0.0


def _layout(dp: int, cluster: Cluster, ranks_per_node: int | None, inner: int) -> _Layout:
    where = "cost.dp_modes.price_modes"
    for name, v in (("dp", dp), ("inner", inner)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive integer", where=where, got=repr(v),
                              fix="pass the data-axis degree as dp and the tensor degree as inner")
    per_node = cluster.devices_per_node if ranks_per_node is None else ranks_per_node
    world = cluster.world_size
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or world % per_node:
        raise ConfigError("ranks_per_node must be a positive divisor of the cluster's devices", where=where,
                          expected=f"a divisor of {world}", got=repr(ranks_per_node),
                          fix="leave it out to use the cluster's devices per node")
    if per_node != cluster.devices_per_node:
        cluster = replace(cluster, nodes=world // per_node, devices_per_node=per_node)
    if world % (dp * inner):
        raise ConfigError(f"dp={dp} x inner={inner} does not divide the cluster's {world} devices", where=where,
                          expected=f"dp x inner dividing {world}", got=f"dp={dp}, inner={inner}",
                          fix="pass the plan's data-axis degree and tensor degree")
    return _Layout(cluster=cluster, axes=(("pp", world // (dp * inner)), ("dp", dp), ("tp", inner)), dp=dp,
                   inner=inner)


def price_modes(grad_numel: int, dp: int, cluster: Cluster, *, grad_bytes_per_elem: int = 4,
                step_compute_s: float, allreduce_exposed_s: float | None = None,
                ranks_per_node: int | None = None, inner: int = 1, exchanges_per_step: int = 1,
                modes: Sequence[DataMode] | None = None) -> list[ModePrice]:
    """All-reduce first, then each of ``modes`` (default :data:`DEFAULT_MODES`), priced per step
    for a rank of a data axis of ``dp`` ranks that reduces ``grad_numel`` gradient entries of
    ``grad_bytes_per_elem`` bytes (its fp32 parameter masters are as many entries, 4 bytes each).

    ``step_compute_s``: the step's time without its data-axis communication (what ``async``
    hides its all-reduce under, once per step of staleness). ``allreduce_exposed_s``: what the
    planner says the step waits for of its all-reduce (None: all of it). ``ranks_per_node``:
    devices per node (default the cluster's); ``inner``: the ranks between two members of a
    data-axis group (the tensor degree, innermost); pipeline stages are outermost.
    ``exchanges_per_step``: gradient exchanges per step (micro-batches without a pipeline)."""
    if grad_numel < 0 or step_compute_s < 0 or exchanges_per_step < 1:
        raise ConfigError("price_modes needs grad_numel >= 0, step_compute_s >= 0 and exchanges_per_step >= 1",
                          where="cost.dp_modes.price_modes",
                          got=f"grad_numel={grad_numel!r}, step_compute_s={step_compute_s!r}, "
                              f"exchanges_per_step={exchanges_per_step!r}",
                          fix="pass the plan's per-rank gradient entries and step figures")
    lay = _layout(dp, cluster, ranks_per_node, inner)
    m, width = exchanges_per_step, float(grad_bytes_per_elem)
    grads, params = grad_numel * width, grad_numel * 4.0
    # one call per bucket, as the runtime cuts them (:func:`autopar.cost.step_terms.bucket_count`)
    calls = bucket_count(lay.cluster, lay.axes, DataBytes(grads=grads, params=params, expert_grads=0.0,
                                                          expert_params=0.0)) if dp > 1 else 1
    ar_comm = m * calls * lay.coll("all_reduce", grads / calls)
    ar_exposed = ar_comm if allreduce_exposed_s is None else float(allreduce_exposed_s)
    exposed_share = min(1.0, ar_exposed / ar_comm) if ar_comm > 0 else 0.0
    out = [ModePrice(mode=DataMode(), bytes_per_step=m * ring_allreduce_bytes(grads, dp),
                     collectives_per_step=float(m * calls) if dp > 1 else 0.0, comm_s=ar_comm, exposed_s=ar_exposed,
                     saving_s=0.0, note="every gradient averaged every step (the plan)")]
    for mode in (DEFAULT_MODES if modes is None else modes):
        if mode.kind == "allreduce":
            continue
        nbytes, calls, comm, exposed, note, links = _price(mode, lay, m, grads, params, grad_numel, width,
                                                           exposed_share, ar_comm, step_compute_s)
        if dp == 1:
            nbytes, calls, comm, exposed, links = 0.0, 0.0, 0.0, 0.0, {}
        out.append(ModePrice(mode=mode, bytes_per_step=nbytes, collectives_per_step=calls, comm_s=comm,
                             exposed_s=exposed, saving_s=ar_exposed - exposed, note=note, per_link_bytes=links))
    return out


def _price(mode: DataMode, lay: _Layout, m: int, grads: float, params: float, numel: int, width: float,
           exposed_share: float, ar_comm: float, step_compute_s: float):
    """(bytes, calls, comm, exposed, note, per-link bytes) of one mode other than all-reduce."""
    dp = lay.dp
    if mode.kind == "local_sgd":
        h = mode.sync_every
        comm = lay.coll("all_reduce", params) / h
        return (ring_allreduce_bytes(params, dp) / h, 1.0 / h, comm, comm,
                f"parameters averaged every {h} steps; {UNMODELLED}", {})
    if mode.kind == "async":
        exposed = max(0.0, ar_comm - mode.staleness * step_compute_s)
        return (m * ring_allreduce_bytes(grads, dp), float(m), ar_comm, exposed,
                f"gradients applied {mode.staleness} step(s) late; {UNMODELLED}", {})
    if mode.kind == "compressed":
        if mode.compressor == "quantize":
            # an integer level per entry (summed: level_dtype) and an fp32 scale per QUANT_CHUNK
            # entries (a max all-reduce), the runtime's accounting
            scales = 4.0 * math.ceil(numel / QUANT_CHUNK)
            entries = float(numel) * level_dtype(dp, mode.levels).itemsize
            nbytes = ring_allreduce_bytes(entries + scales, dp)
            comm = lay.coll("all_reduce", entries) + lay.coll("all_reduce", scales)
            calls, what = 2.0, f"{mode.levels} levels, an integer sum per entry and a scale per {QUANT_CHUNK}"
        elif mode.compressor == "topk":
            k = keep_count(numel, mode.ratio) if numel else 0
            nbytes = allgather_bytes(k * (width + 4), dp)    # values and int32 indices
            comm = lay.coll("all_gather", dp * k * width) + lay.coll("all_gather", dp * k * 4.0)
            calls, what = 2.0, f"top {100 * mode.ratio:g} % values + indices"
        else:
            k = keep_count(numel, mode.ratio) if numel else 0
            nbytes = ring_allreduce_bytes(k * width, dp)
            comm = lay.coll("all_reduce", k * width)
            calls, what = 1.0, f"random {100 * mode.ratio:g} % of the entries"
        return (m * nbytes, m * calls, m * comm, m * comm * exposed_share,
                f"{what}; compression compute not priced; {UNMODELLED}", {})
    if mode.kind == "gossip":
        t, links, degree = gossip_exchange(mode.topology, params, lay)
        k = mode.global_every
        sent = degree * params
        if k:   # every K-th step a global average replaces the neighbour exchange
            t = ((k - 1) * t + lay.coll("all_reduce", params)) / k
            sent = ((k - 1) * sent + ring_allreduce_bytes(params, dp)) / k
            links = {kind: (k - 1) * b / k for kind, b in links.items()}
            calls = ((k - 1) * degree + 1) / k
        else:
            calls = float(degree)
        where = "; ".join(f"{kind}-node {b / 1e6:.1f} MB" for kind, b in links.items() if b)
        return (sent, calls, t, t, f"{degree} neighbours, slowest rank sends {where or 'nothing'}; {UNMODELLED}",
                links)
    raise ConfigError(f"cannot price dp_mode {mode.kind!r}", where="cost.dp_modes.price_modes",
                      expected="local_sgd, compressed, gossip or async", got=repr(mode.kind),
                      fix="pass modes the planner knows")


def gossip_exchange(topology: str, nbytes: float, lay: _Layout) -> tuple[float, dict[str, float], int]:
    """One gossip round of ``nbytes`` to every neighbour (:func:`~autopar.runtime.data_modes.
    neighbours` on ``topology``) on every data-axis group of ``lay``: the slowest rank's seconds,
    its bytes per link kind and the degree (see the module docstring for the time model)."""
    c, dp, inner = lay.cluster, lay.dp, lay.inner
    per_node, span = c.devices_per_node, dp * inner
    if dp == 1:
        return 0.0, {}, 0
    peers = [neighbours(topology, dp, i) for i in range(dp)]
    # groups repeat the same way in every pipeline block when a block fills whole nodes
    blocks = range(1 if span % per_node == 0 else c.world_size // span)
    worst, worst_links, degree = -1.0, {}, len(peers[0])
    for b in blocks:
        for off in range(inner):
            node = [(b * span + i * inner + off) // per_node for i in range(dp)]
            for i in range(dp):
                here = sum(1 for j in peers[i] if node[j] == node[i])
                away = len(peers[i]) - here
                t = max(here * (c.intra.hop_latency_s + nbytes / c.intra.bandwidth),
                        away * (c.inter.hop_latency_s + nbytes / c.inter.bandwidth))
                t += max(c.intra.base_latency_s if here else 0.0, c.inter.base_latency_s if away else 0.0)
                if t > worst:
                    worst, worst_links = t, {"intra": here * nbytes, "inter": away * nbytes}
    return worst, worst_links, degree


def worth_showing(price: ModePrice, step_time_s: float, threshold: float = 0.10) -> bool:
    """Whether a mode shortens a step of ``step_time_s`` by more than ``threshold`` of it."""
    return price.mode.kind != "allreduce" and step_time_s > 0 and price.saving_s > threshold * step_time_s


# ResNet-50 (torchvision): 25,557,032 parameters
RESNET50_NUMEL = 25_557_032
PUBLISHED_RESNET50 = {"allreduce_s": 0.278, "partial_average_s": 0.150,
                      "source": "published figures from the decentralized SGD literature: ResNet-50 on "
                                "256 GPUs, ring all-reduce vs a partial (gossip) average, per iteration"}


def resnet50_prediction(cluster_spec: str = "32x8", hardware: str = "v100") -> dict:
    """The data-axis seconds per iteration this model predicts for ResNet-50's fp32 gradients
    (25.5 M) on ``cluster_spec`` (every device a data-parallel rank): all-reduce, and one gossip
    round on a ring and on the exponential graph, beside :data:`PUBLISHED_RESNET50`. Nothing is
    fitted to the published figures: the links are the built-in ones of ``hardware``."""
    cluster = Cluster.from_spec(cluster_spec, hardware=hardware)
    prices = price_modes(RESNET50_NUMEL, cluster.world_size, cluster, step_compute_s=0.0,
                         modes=(DataMode("gossip", topology="ring"), DataMode("gossip", topology="exponential")))
    by = {label(p.mode): p for p in prices}
    return {"cluster": cluster.name, "devices": cluster.world_size, "grad_bytes": 4.0 * RESNET50_NUMEL,
            "allreduce_s": by["allreduce"].comm_s, "gossip_ring_s": by["gossip(topology=ring)"].comm_s,
            "gossip_exponential_s": by["gossip(topology=exponential)"].comm_s,
            "published": dict(PUBLISHED_RESNET50)}


__all__ = ["DEFAULT_MODES", "ModePrice", "label", "price_modes", "gossip_exchange", "worth_showing",
           "resnet50_prediction", "RESNET50_NUMEL", "PUBLISHED_RESNET50"]
