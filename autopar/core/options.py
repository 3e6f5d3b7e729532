"""The per-axis options of :func:`autopar.parallelize`, one small frozen dataclass per build step
that reads them.

The options every build reads (mesh, example inputs, plan, ZeRO stage, recomputation, mixed
precision, memory budget, compile) are :func:`~autopar.parallelize`'s own keywords; the rest
belong to one axis each and are given as ``options=`` — one of these or a sequence of them::

    autopar.parallelize(model, {"pp": 2, "dp": 2}, (x,),
                        options=[PipelineOptions(schedule="1f1b", loss_fn=loss), DataOptions(overlap=False)])

Each is validated on construction (a wrong type raises a :class:`~autopar.core.errors.ConfigError`
naming the field), and a build refuses one whose axis it does not have, as it refuses any option
it would silently drop.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.core.errors import ConfigError


def _check(cls_name: str, field: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{cls_name}.{field} must be {expected}", where=f"{cls_name}({field}=...)",
                          got=repr(value), fix=f"pass {expected}")


# a dropless MoE layer's token chunks whose exchanges overlap its experts (runtime/ep.py, priced
# by cost/hybrid.py): two hide all but about half a chunk's exchange at either end
DISPATCH_CHUNKS = 2


def _count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


@dataclass(frozen=True, kw_only=True)
class TensorOptions:
    """The tensor axis (read by the tensor step, ``autopar/build/tensor.py``).

    ``placements`` forces how parameters are stored on the tensor axis (``{"fc1.weight": "S(0)"}``);
    ``sequence_parallel`` whether activations between the tensor-parallel regions are split along
    the sequence (None: the cost model chooses per value); ``dims`` labels each input's symbolic
    dims (``({0: "batch", 1: "seq"},)``) and ``sizes`` gives the sizes the plan is priced at
    (``{"batch": 8, "seq": 2048}``)."""

    placements: Mapping[str, str] | None = None
    sequence_parallel: bool | None = None
    dims: Any = None
    sizes: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(name, "placements", self.placements, self.placements is None or isinstance(self.placements, Mapping),
               "a {parameter: placement} mapping or None")
        _check(name, "sequence_parallel", self.sequence_parallel,
               self.sequence_parallel is None or isinstance(self.sequence_parallel, bool), "True, False or None")
        _check(name, "sizes", self.sizes, self.sizes is None or isinstance(self.sizes, Mapping),
               "a {symbol: size} mapping or None")


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """The data axis (read by the data and overlap steps, ``autopar/build/data.py``, ``overlap.py``).

    ``overlap`` issues each gradient bucket's reduction as soon as its gradients exist and waits
    late; ``bucket_bytes`` sizes the buckets (0: the cost model's size); ``dp_mode`` says how the
    data axis communicates (``"allreduce"``, ``"local_sgd"``, ...; :mod:`autopar.core.dp_mode`);
    ``sync_params`` makes every rank take rank 0's weights first. ``cross_sample="local"`` accepts
    that an op pairing samples of the batch with each other (a contrastive loss's similarity
    matrix) pairs only the rows of each piece of a split batch (data rank, expert rank,
    micro-batch); without it such a model is refused when the batch is split. ``shard_group=g``
    (hybrid sharding, ZeRO-2/3) cuts the ZeRO pieces over groups of ``g`` consecutive data ranks
    (within a node, say) and replicates them across the groups: gathers stay inside a group and
    a gradient's reduction adds one all-reduce of a piece across them; 0 (default): the whole
    data axis."""

    overlap: bool = True
    bucket_bytes: int = 0
    dp_mode: Any = None
    sync_params: bool = True
    cross_sample: str | None = None
    shard_group: int = 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(name, "overlap", self.overlap, isinstance(self.overlap, bool), "True or False")
        _check(name, "bucket_bytes", self.bucket_bytes,
               isinstance(self.bucket_bytes, int) and not isinstance(self.bucket_bytes, bool) and self.bucket_bytes >= 0,
               "a byte count >= 0")
        _check(name, "sync_params", self.sync_params, isinstance(self.sync_params, bool), "True or False")
        _check(name, "cross_sample", self.cross_sample, self.cross_sample in (None, "local"), "None or 'local'")
        _check(name, "shard_group", self.shard_group,
               isinstance(self.shard_group, int) and not isinstance(self.shard_group, bool) and self.shard_group >= 0,
               "a rank count >= 0 (0: the whole data axis)")


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The pipeline axis (read by the schedule and pipeline steps, ``autopar/build/pipeline.py``).

    ``schedule`` (gpipe, 1f1b, interleaved, zb, dualpipev), ``microbatches`` and ``virtual_stages`` are chosen
    by the simulator unless given; ``loss_fn(output, target)`` runs on the last stage (None: the
    model's own loss, a ``transformers`` model given ``labels``). ``batchnorm="microbatch"``
    accepts that a training-mode BatchNorm in a pipeline normalises each micro-batch (on each data
    rank) by its own statistics, which one process on the whole batch does not; without it such a
    model is refused when the batch is split."""

    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    loss_fn: Callable | None = None
    batchnorm: str | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(name, "schedule", self.schedule, self.schedule is None or isinstance(self.schedule, str),
               "a schedule name (gpipe, 1f1b, interleaved, zb, dualpipev) or None")
        _check(name, "microbatches", self.microbatches, _count(self.microbatches), "an int >= 1 or None")
        _check(name, "virtual_stages", self.virtual_stages, _count(self.virtual_stages), "an int >= 1 or None")
        _check(name, "loss_fn", self.loss_fn, self.loss_fn is None or callable(self.loss_fn),
               "a callable loss_fn(output, target) or None")
        _check(name, "batchnorm", self.batchnorm, self.batchnorm in (None, "microbatch"), "None or 'microbatch'")


@dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """The expert axis (read by the capacity and experts steps, ``autopar/build/experts.py``).

    ``calibration`` (example inputs) measures each expert's load so ``placement="balanced"`` can
    even it out (``"contiguous"``: experts in order); ``capacity_factor`` overrides the MoE
    layers' own. ``dispatch_chunks``: a dropless layer's tokens go in this many chunks, so one
    chunk's all-to-all travels while another chunk's experts compute (1: no overlap; the
    result is the same). ``dispatch``: how a dropless layer's tokens reach experts on other
    nodes: ``"two_hop"`` sends a token once to each node holding one of its experts, where
    the rank at the sender's place hands it on inside the node and sums the experts' outputs
    (fewer bytes on the inter-node links when a token's experts share nodes, as node-limited
    routing makes them); ``"direct"`` sends one copy per (token, expert) pair; ``"auto"``
    (default): two hops when the expert axis spans nodes with several of its ranks on each.
    ``fold``: with a tensor axis beside the expert axis, ``"auto"`` (default) folds the tensor
    axis into the experts' of dropless layers (when ep x tp divides every such layer's experts):
    each tensor rank computes its share of the tokens, the experts are dealt over the ep x tp
    ranks and the outputs are gathered back over the tensor axis, so no tensor rank repeats
    another's expert work (Megatron-Core's MoE parallel folding, expert tensor size 1);
    ``"off"`` keeps the experts whole on every tensor rank, each computing every token."""

    calibration: Any = None
    placement: str = "balanced"
    capacity_factor: float | None = None
    dispatch_chunks: int = DISPATCH_CHUNKS
    dispatch: str = "auto"
    fold: str = "auto"

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check(name, "placement", self.placement, self.placement in ("balanced", "contiguous"),
               "'balanced' or 'contiguous'")
        _check(name, "capacity_factor", self.capacity_factor,
               self.capacity_factor is None or (isinstance(self.capacity_factor, (int, float))
                                                and not isinstance(self.capacity_factor, bool)),
               "a number or None")
        _check(name, "dispatch_chunks", self.dispatch_chunks, _count(self.dispatch_chunks) and
               self.dispatch_chunks is not None, "an int >= 1")
        _check(name, "dispatch", self.dispatch, self.dispatch in ("auto", "direct", "two_hop"),
               "'auto', 'direct' or 'two_hop'")
        _check(name, "fold", self.fold, self.fold in ("auto", "off"), "'auto' or 'off'")


@dataclass(frozen=True, kw_only=True)
class ContextOptions:
    """The context axis (read by the context step, ``autopar/build/context.py``).

    ``kind`` is how attention crosses the ranks that split the sequence: ``"ring"`` (keys and
    values passed round the ranks, overlapped with the attention of the block at hand),
    ``"allgather"`` (every rank gathers the whole sequence's keys and values) or ``"alltoall"``
    (Ulysses: the sequence split traded for a head split; cp must divide the heads). None: the
    cheapest by the cost model (``cost/cp_planner.py``)."""

    kind: str | None = None

    def __post_init__(self) -> None:
        _check(type(self).__name__, "kind", self.kind, self.kind in (None, "ring", "allgather", "alltoall"),
               "'ring', 'allgather', 'alltoall' or None")


AxisOptions = TensorOptions | DataOptions | PipelineOptions | ExpertOptions | ContextOptions
KINDS: tuple[type, ...] = (TensorOptions, DataOptions, PipelineOptions, ExpertOptions, ContextOptions)


@dataclass(frozen=True)
class Options:
    """One of each kind, defaults where not given (what the build reads)."""

    tensor: TensorOptions = TensorOptions()
    data: DataOptions = DataOptions()
    pipeline: PipelineOptions = PipelineOptions()
    experts: ExpertOptions = ExpertOptions()
    context: ContextOptions = ContextOptions()
    given: frozenset[str] = frozenset()      # the kinds the caller passed

    def flat(self) -> dict[str, Any]:
        """Every option by its field name (``expert_placement`` for ``ExpertOptions.placement``)."""
        out: dict[str, Any] = {}
        for part in (self.tensor, self.data, self.pipeline, self.experts, self.context):
            for f in dataclasses.fields(part):
                key = "expert_placement" if isinstance(part, ExpertOptions) and f.name == "placement" else f.name
                key = "cp_kind" if isinstance(part, ContextOptions) else key
                out[key] = getattr(part, f.name)
        return out


_ATTR = {TensorOptions: "tensor", DataOptions: "data", PipelineOptions: "pipeline", ExpertOptions: "experts",
         ContextOptions: "context"}


def collect(options: AxisOptions | Sequence[AxisOptions] | None) -> Options:
    """``options=`` as given to parallelize (None, one per-axis object or a sequence of them, at
    most one of each kind) as one :class:`Options`."""
    if options is None:
        return Options()
    items = [options] if isinstance(options, KINDS) else options
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, KINDS) for o in items):
        raise ConfigError("options= takes TensorOptions, DataOptions, PipelineOptions, ExpertOptions or "
                          "ContextOptions, or a list "
                          "of them", where="parallelize(options=...)", got=repr(options),
                          fix="e.g. options=[autopar.PipelineOptions(schedule='1f1b'), autopar.DataOptions(overlap=False)]")
    parts: dict[str, Any] = {}
    for o in items:
        attr = _ATTR[type(o)]
        if attr in parts:
            raise ConfigError(f"options= has two {type(o).__name__}", where="parallelize(options=...)",
                              got=repr(options), fix=f"merge them into one {type(o).__name__}")
        parts[attr] = o
    return Options(**parts, given=frozenset(parts))


#: The keywords parallelize took before the options were grouped: old name -> (class, field).
OLD_KEYWORDS: dict[str, tuple[type, str]] = {
    "placements": (TensorOptions, "placements"), "sequence_parallel": (TensorOptions, "sequence_parallel"),
    "dims": (TensorOptions, "dims"), "sizes": (TensorOptions, "sizes"),
    "overlap": (DataOptions, "overlap"), "bucket_bytes": (DataOptions, "bucket_bytes"),
    "dp_mode": (DataOptions, "dp_mode"), "sync_params": (DataOptions, "sync_params"),
    "schedule": (PipelineOptions, "schedule"), "microbatches": (PipelineOptions, "microbatches"),
    "virtual_stages": (PipelineOptions, "virtual_stages"), "loss_fn": (PipelineOptions, "loss_fn"),
    "calibration": (ExpertOptions, "calibration"), "expert_placement": (ExpertOptions, "placement"),
    "capacity_factor": (ExpertOptions, "capacity_factor"),
}


def with_old_keywords(options: Any, old: Mapping[str, Any]) -> tuple[Any, str]:
    """``options`` with the old keywords ``old`` folded in, and the text of the warning that
    says how to spell them now. A field given both ways is a :class:`ConfigError`."""
    merged = collect(options)
    by_class: dict[type, dict[str, Any]] = {}
    for key, value in old.items():
        cls, field = OLD_KEYWORDS[key]
        by_class.setdefault(cls, {})[field] = value
    parts = {}
    for cls, fields in by_class.items():
        attr = _ATTR[cls]
        current = getattr(merged, attr)
        if attr in merged.given:
            clash = sorted(f for f in fields if getattr(current, f) != getattr(cls(), f))
            if clash:
                raise ConfigError(f"{', '.join(clash)} given both as a keyword and in {cls.__name__}",
                                  where="parallelize", fix=f"give it once, in options={cls.__name__}(...)")
        parts[attr] = dataclasses.replace(current, **fields)
    result = dataclasses.replace(merged, **parts, given=merged.given | frozenset(parts))
    spelled = ", ".join(f"{k}= -> options={OLD_KEYWORDS[k][0].__name__}({OLD_KEYWORDS[k][1]}=...)" for k in old)
    return [getattr(result, a) for a in ("tensor", "data", "pipeline", "experts") if a in result.given], \
        f"parallelize keywords are grouped by axis now: {spelled}"
