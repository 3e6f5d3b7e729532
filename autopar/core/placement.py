"""Placements of values and of their gradients along one mesh axis, and the one rule
that turns a placement mismatch into a collective.

Along a mesh axis of ``n`` ranks a tensor is

- ``Replicate`` (``R``): every rank holds the whole tensor;
- ``Shard(dim)`` (``S(d)``): rank ``r`` holds the ``r``-th of ``n`` equal slices along ``d``;
- ``Partial`` (``P``): every rank holds a tensor of the whole shape; their sum is the value.

A :class:`Spec` pairs a value's placement with its gradient's. The gradient of a
``Shard(d)`` value is ``Shard(d)``; of a ``Partial`` value, ``Replicate`` (the loss's
derivative with respect to each summand is the whole gradient); a ``Replicate`` value
may have a ``Replicate`` or a ``Partial`` gradient (the input of a column-parallel
matmul gets a ``Partial`` one). :func:`transition` is the single place where a mismatch
becomes a collective: forward converts the value from the producer's placement to the
consumer's; backward converts the gradient the consumer emits to the one the producer
needs, with the same table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from autopar.core.errors import ConfigError


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]
R, P = Replicate(), Partial()

_SHARD = re.compile(r"^S\((-?\d+)\)$")


def parse(text: str) -> Placement:
    """``"R"``, ``"P"`` or ``"S(d)"`` to a placement."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)))
    raise ConfigError(f"unknown placement {text!r}", expected='"R", "P" or "S(dim)"', got=text,
                      fix="write placements as R, P or S(0), S(1), ...")


@dataclass(frozen=True)
class Spec:
    """A value's placement and its gradient's, along one axis."""

    value: Placement
    grad: Placement

    def __post_init__(self) -> None:
        # specs key the planners' dynamic programmes; hashing them is their hot loop
        object.__setattr__(self, "_hash", hash((self.value, self.grad)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return str(self.value) if self.grad == default_grad(self.value) else f"{self.value}/g{self.grad}"

    @staticmethod
    def parse(text: str) -> "Spec":
        if "/g" in text:
            value, grad = text.split("/g", 1)
            return Spec(parse(value), parse(grad))
        value = parse(text)
        return Spec(value, default_grad(value))


def default_grad(value: Placement) -> Placement:
    """The gradient placement a value has when nothing asks otherwise."""
    return R if isinstance(value, Partial) else value


def spec(value: Placement, grad: Placement | None = None) -> Spec:
    return Spec(value, default_grad(value) if grad is None else grad)


REP = Spec(R, R)


def shard(dim: int) -> Spec:
    return Spec(Shard(dim), Shard(dim))


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
LOCAL_KINDS = ("none", "chunk", "mask", "pad")


@dataclass(frozen=True)
class Step:
    """What converting a tensor from one placement to another takes on each rank.

    ``kind`` is one of the local steps ``none`` / ``chunk`` (keep this rank's slice along
    ``dst_dim``) / ``mask`` (rank 0 keeps the tensor, the others zeros) / ``pad`` (put this
    rank's shard at its slot along ``src_dim`` of a zero tensor of the whole shape), or one
    of the collectives ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``all_to_all``;
    ``src_dim``/``dst_dim`` are the tensor dims involved.
    """

    kind: str
    src_dim: int | None = None
    dst_dim: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COLLECTIVE_KINDS


NONE = Step("none")


def transition(src: Placement, dst: Placement, ndim: int | None = None) -> Step:
    """The step that turns a tensor placed ``src`` into one placed ``dst``.

    Used for values in forward (producer → consumer) and for gradients in backward
    (consumer's emitted gradient → producer's expected gradient). Given the tensor's
    ``ndim``, negative dims are resolved first (``S(-1)`` and ``S(1)`` of a 2-d tensor are
    one placement, and the step's dims are then never negative)."""
    if ndim is not None:
        src, dst = normalize(src, ndim), normalize(dst, ndim)
    if src == dst:
        return NONE
    if isinstance(dst, Replicate):
        if isinstance(src, Partial):
            return Step("all_reduce")
        return Step("all_gather", src_dim=src.dim)
    if isinstance(dst, Shard):
        if isinstance(src, Replicate):
            return Step("chunk", dst_dim=dst.dim)
        if isinstance(src, Partial):
            return Step("reduce_scatter", dst_dim=dst.dim)
        return Step("all_to_all", src_dim=src.dim, dst_dim=dst.dim)
    # dst is Partial
    if isinstance(src, Replicate):
        return Step("mask")
    return Step("pad", src_dim=src.dim)  # the shards, each zero-padded to the whole, sum to it


def comm_bytes(step: Step, full_bytes: float, n: int) -> float:
    """Bytes of the *whole* tensor a collective step moves (cost/comm's convention:
    all-reduce and all-to-all take the full size, all-gather its output, reduce-scatter
    its input); local steps (``chunk``, ``mask``, ``pad``) move none."""
    return float(full_bytes) if step.is_comm and n > 1 else 0.0


def local_shape(shape: tuple[int, ...], placement: Placement, n: int) -> tuple[int, ...]:
    """The shape one rank holds of a tensor of global ``shape``."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    dim = placement.dim % len(shape)
    out = list(shape)
    out[dim] //= n
    return tuple(out)


def normalize(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` on a 3-d tensor is ``Shard(2)``."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim % ndim)
    return placement


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the tensor axis.

    ``inputs`` has one :class:`Spec` per distinct tensor input (:func:`autopar.passes.sharding.tensor_inputs` order),
    ``outputs`` one per tensor output. ``work`` is the fraction of the op's FLOPs and
    bytes one rank does. ``local_op`` names a different local kernel the rewrite must use
    (e.g. the masked lookup of a vocabulary-parallel embedding)."""

    name: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    work: float = 1.0
    local_op: str | None = None

    def __str__(self) -> str:
        ins = ",".join(str(s) for s in self.inputs)
        outs = ",".join(str(s) for s in self.outputs)
        return f"{self.name}[{ins} -> {outs}]"
