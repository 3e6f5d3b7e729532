"""How the data axis communicates: the ``dp_mode`` of a plan and of :func:`autopar.parallelize`.

``allreduce`` (the default) averages every gradient over the data axis at every step, which is
what one process on the whole batch computes. The other four communicate less and change the
optimisation (each rank's parameters may differ between synchronisations):

- ``local_sgd``: every rank steps on its own gradient; parameters are averaged every
  ``sync_every`` steps (after ``warmup`` ordinary all-reduce steps). ``sync_every=1`` under
  SGD (with or without momentum) is all-reduce exactly.
- ``compressed``: gradients travel compressed: ``topk`` (the ``ratio`` largest magnitudes,
  values and indices), ``randk`` (``ratio`` of the entries at indices every rank draws alike,
  so they are summed with a small all-reduce) or ``quantize`` (random rounding to ``levels``
  levels of a scale per 512 entries that every rank shares, the largest magnitude over the
  ranks; unbiased: the integer levels of all ranks are summed by one all-reduce, int8 while
  ranks x levels <= 127). With ``error_feedback`` (on
  by default) what a compressor drops is kept and added to the next step's gradient.
- ``gossip``: every rank steps on its own gradient, then averages its parameters with its
  neighbours on a ``topology`` (``ring``, 2-D torus ``grid``, ``exponential``: the ranks at
  distance 1, 2, 4, ...; ``full``: everyone) with uniform weights; every ``global_every``
  steps (0: never) the average is global instead.
- ``async``: gradients are all-reduced in the background and a step applies the average
  from ``staleness`` steps earlier, so a rank waits for the slowest only that much later.
  ``staleness=0`` is all-reduce; the first ``staleness`` steps change nothing.

These run on the dense data axis with ZeRO-0 (``dp``, ``dp x tp``, and the data axis of a
pipeline for ``local_sgd``); anything else raises a :class:`~autopar.core.errors.ConfigError`
that says what composes. The runtime is ``runtime/data_modes.py``; the planner prices each
mode in ``cost/dp_modes.py``.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from autopar.core.errors import ConfigError

MODES = ("allreduce", "local_sgd", "compressed", "gossip", "async")
COMPRESSORS = ("topk", "randk", "quantize")
TOPOLOGIES = ("ring", "grid", "exponential", "full")
# the options each mode reads (every other option must keep its default)
OPTIONS = {"allreduce": (), "local_sgd": ("sync_every", "warmup"),
           "compressed": ("compressor", "ratio", "levels", "error_feedback", "seed"),
           "gossip": ("topology", "global_every"), "async": ("staleness",)}


@dataclass(frozen=True)
class DataMode:
    """One data-axis mode and its options (see the module docstring). Build it directly,
    ``DataMode("local_sgd", sync_every=4)``, or let :func:`data_mode` read a name or a dict."""

    kind: str = "allreduce"
    sync_every: int = 1          # local_sgd: steps between parameter averages
    warmup: int = 0              # local_sgd: all-reduce steps first
    compressor: str = "topk"     # compressed: topk | randk | quantize
    ratio: float = 0.01          # compressed topk/randk: fraction of entries sent
    levels: int = 5              # compressed quantize: levels of |x| / max |x|
    error_feedback: bool = True  # compressed: carry what was dropped into the next step
    seed: int = 0                # compressed randk/quantize: draws, alike on every rank
    topology: str = "ring"       # gossip: ring | grid | exponential | full
    global_every: int = 0        # gossip: a global average every K steps (0: never)
    staleness: int = 1           # async: steps between a gradient and its application

    def __post_init__(self) -> None:
        where = "dp_mode"
        if self.kind not in MODES:
            near = difflib.get_close_matches(str(self.kind), MODES, n=1)
            raise ConfigError(f"unknown data-axis mode {self.kind!r}", where=where, expected=" | ".join(MODES),
                              got=repr(self.kind), fix=f"did you mean {near[0]!r}?" if near else
                              "pick one of the modes listed")
        _int(self.sync_every, "sync_every", 1)
        _int(self.warmup, "warmup", 0)
        _int(self.levels, "levels", 1, high=127)
        _int(self.seed, "seed", 0)
        _int(self.global_every, "global_every", 0)
        _int(self.staleness, "staleness", 0)
        _choice(self.compressor, "compressor", COMPRESSORS)
        _choice(self.topology, "topology", TOPOLOGIES)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ConfigError("dp_mode ratio must be a fraction in (0, 1]", where=where, got=repr(self.ratio),
                              fix="e.g. ratio=0.01 sends 1 % of each bucket's entries")
        if not isinstance(self.error_feedback, bool):
            raise ConfigError("dp_mode error_feedback must be True or False", where=where,
                              got=repr(self.error_feedback), fix="pass a bool")
        given = [f.name for f in fields(self) if f.name != "kind" and f.name not in OPTIONS[self.kind]
                 and getattr(self, f.name) != f.default]
        if given:
            raise ConfigError(f"{', '.join(given)} do not apply to dp_mode {self.kind!r}", where=where,
                              expected=f"options of {self.kind!r}: {', '.join(OPTIONS[self.kind]) or 'none'}",
                              got=", ".join(f"{k}={getattr(self, k)!r}" for k in given),
                              fix=f"drop them, or pick the mode they belong to "
                                  f"({', '.join(sorted({m for k in given for m, o in OPTIONS.items() if k in o}))})")

    def to_dict(self) -> dict[str, Any]:
        """The kind and the options it reads (what a plan file stores)."""
        return {"kind": self.kind, **{k: getattr(self, k) for k in OPTIONS[self.kind]}}

    def describe(self) -> str:
        opts = ", ".join(f"{k}={getattr(self, k)}" for k in OPTIONS[self.kind])
        return f"{self.kind}({opts})" if opts else self.kind



def data_mode(spec: Any, *, where: str = "parallelize(dp_mode=...)") -> DataMode:
    """A :class:`DataMode` from None (all-reduce), a mode name, a dict ``{"kind": ..., options}``
    or a DataMode."""
    if spec is None:
        return ALLREDUCE
    if isinstance(spec, DataMode):
        return spec
    if isinstance(spec, str):
        return DataMode(spec)
    if isinstance(spec, Mapping):
        known = {f.name for f in fields(DataMode)}
        unknown = [k for k in spec if k not in known]
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
            raise ConfigError(f"unknown dp_mode option {unknown[0]!r}", where=where,
                              expected=", ".join(sorted(known)), got=repr(unknown[0]),
                              fix=f"did you mean {near[0]!r}?" if near else "use the options listed")
        if "kind" not in spec:
            raise ConfigError("a dp_mode dict needs its kind", where=where, got=repr(dict(spec)),
                              fix='e.g. {"kind": "local_sgd", "sync_every": 4}')
        return DataMode(**spec)
    raise ConfigError("dp_mode must be a mode name, a dict or an autopar.DataMode", where=where,
                      got=type(spec).__name__, fix='e.g. dp_mode="local_sgd" or '
                                                   'dp_mode={"kind": "compressed", "compressor": "topk", "ratio": 0.01}')


def _int(value: Any, name: str, low: int, *, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ConfigError(f"dp_mode {name} must be an integer >= {low}" + (f" and <= {high}" if high else ""),
                          where="dp_mode", got=repr(value), fix=f"pass an integer {name}")


def _choice(value: Any, name: str, options: tuple[str, ...]) -> None:
    if value not in options:
        near = difflib.get_close_matches(str(value), options, n=1)
        raise ConfigError(f"unknown dp_mode {name} {value!r}", where="dp_mode", expected=" | ".join(options),
                          got=repr(value), fix=f"did you mean {near[0]!r}?" if near else "pick one listed")


def check_composes(mode: DataMode, *, zero_stage: int | None, pipeline: bool = False, experts: bool = False,
                   mixed_precision: str | None = None) -> None:
    """Raise a ConfigError when ``mode`` cannot run with the rest of the configuration."""
    if mode.kind == "allreduce":
        return
    where = f"parallelize(dp_mode={mode.kind!r})"
    if experts:
        raise ConfigError(f"dp_mode {mode.kind!r} does not compose with expert parallelism", where=where,
                          got="an ep axis", fix="use dp_mode='allreduce' with experts: their tokens are exchanged "
                          "every step anyway, and the dense parameters average over dp x ep")
    if pipeline and mode.kind != "local_sgd":
        raise ConfigError(f"dp_mode {mode.kind!r} does not compose with a pipeline", where=where,
                          got="a pp axis", expected="allreduce or local_sgd with a pp axis",
                          fix="use dp_mode='local_sgd' (parameters averaged every sync_every steps), or no pp axis")
    if zero_stage not in (None, 0):
        why = {"local_sgd": "every rank steps its whole parameters on its own gradient",
               "gossip": "every rank steps its whole parameters on its own gradient",
               "compressed": "the compressed exchange hands every rank the whole averaged gradient",
               "async": "a delayed gradient is applied to whole parameters"}[mode.kind]
        raise ConfigError(f"dp_mode {mode.kind!r} needs zero_stage=0", where=where, got=f"zero_stage={zero_stage}",
                          fix=f"use zero_stage=0 ({why}; ZeRO-{zero_stage} keeps only a shard per rank), "
                              "or dp_mode='allreduce' to shard")
    if mode.kind == "async" and mixed_precision == "fp16":
        raise ConfigError("dp_mode 'async' does not compose with fp16 loss scaling", where=where,
                          got="mixed_precision='fp16'", fix="use mixed_precision='bf16' (no loss scale), "
                          "or another dp_mode: a delayed gradient was scaled by an older loss scale")


ALLREDUCE = DataMode()
