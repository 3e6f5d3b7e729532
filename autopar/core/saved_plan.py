"""The plan file ``autopar plan --save-plan FILE`` writes and ``autopar train --plan FILE`` (or
``autopar.parallelize(plan=FILE)``) reads: the configuration the joint planner chose, with what
it was chosen for, checked field by field on read."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autopar.core.errors import ConfigError, PlanFileError

PLAN_FILE_FORMAT = "autopar plan"   # tells this file from a parallelize Plan (autopar.core.plans)
PLAN_FILE_VERSION = 1
_READABLE_PLAN_FILES = (1,)
_SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb", "dualpipev")
_PREDICTED = ("step_time_s", "mfu", "tflops_per_device", "peak_memory_bytes")
_PLAN_FILE_FIX = "write the file with `autopar plan ... --save-plan FILE` (or correct that field)"
_PLAN_FILE_FIELDS = ("format", "version", "model", "overrides", "cluster", "hardware", "devices", "batch", "seq",
                     "dtype", "config", "microbatches", "predicted")
_MAX_INT = 2**31 - 1    # counts and sizes: a tensor dimension or NCCL element count past int32 is no plan
_INF = float("inf")


@dataclass(frozen=True)
class SavedPlan:
    """The configuration ``autopar plan`` chose, with what it was chosen for.

    ``config`` is the planner's :class:`~autopar.cost.hybrid.Config` (``dp`` counts every data
    replica, ``ep`` is a sub-axis of it); ``microbatches`` is the micro-batch count per step of
    one data replica, so ``batch == dp * micro_batch * microbatches``; ``predicted`` holds the
    simulator's step time, model TFLOP/s, MFU and peak memory per device (each may be absent or null).
    ``autopar train --plan`` rebuilds the structure from it (every Config field), so a file is
    checked field by field on read: a hand-edited or truncated file fails with a
    :class:`~autopar.core.errors.PlanFileError` naming the field, never half-way into a run."""

    model: str
    overrides: dict
    cluster: str
    hardware: str
    devices: int
    batch: int
    seq: int
    dtype: str
    config: Any                       # a autopar.core.plans.Config
    microbatches: int
    predicted: dict = field(default_factory=dict)
    version: int = PLAN_FILE_VERSION

    def to_dict(self) -> dict:
        return {"format": PLAN_FILE_FORMAT, "version": self.version, "model": self.model,
                "overrides": dict(self.overrides), "cluster": self.cluster, "hardware": self.hardware,
                "devices": self.devices, "batch": self.batch, "seq": self.seq, "dtype": self.dtype,
                "config": _config_dict(self.config), "microbatches": self.microbatches,
                "predicted": dict(self.predicted)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        try:
            Path(path).write_text(self.to_json() + "\n")
        except OSError as exc:
            raise PlanFileError(f"cannot write the plan file: {exc}", where=f"--save-plan {path}",
                                fix="pass a path in a writable directory") from exc

    @classmethod
    def load(cls, path: str | Path) -> "SavedPlan":
        """Read and check a file ``autopar plan --save-plan`` wrote."""
        from autopar.core import strict_json
        text = strict_json.read_text(path, where=f"plan file {path}",
                                     fix="pass the path of a file written by `autopar plan ... --save-plan FILE`")
        return cls.from_json(text, where=f"plan file {path}")

    @classmethod
    def from_json(cls, text: str, *, where: str = "plan file") -> "SavedPlan":
        from autopar.core import strict_json
        return cls.from_dict(strict_json.parse(text, where=where, fix=_PLAN_FILE_FIX), where=where)

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "plan file") -> "SavedPlan":
        """Check every field's presence, type and range, then that the degrees agree with each
        other; each failure is a PlanFileError naming the field."""
        import typing

        from autopar.core.plans import RECOMPUTE, Config, recompute_layers

        if not isinstance(data, dict):
            raise PlanFileError("the plan file is not a JSON object", where=where, expected="{...}",
                                got=type(data).__name__, fix=_PLAN_FILE_FIX)
        if data.get("format") != PLAN_FILE_FORMAT:
            other = "mesh" in data and "nodes" in data
            raise PlanFileError("this is not a file `autopar plan --save-plan` wrote", where=f"{where}, field format",
                                expected=repr(PLAN_FILE_FORMAT), got=repr(data.get("format")),
                                fix="that is a parallelize plan (Plan.save): pass it to autopar.parallelize(plan=...)"
                                if other else _PLAN_FILE_FIX)
        from autopar.core.strict_json import reject_unknown
        reject_unknown(data, _PLAN_FILE_FIELDS, where=where, fix=_PLAN_FILE_FIX)
        version = _checked(data, "version", "int", where)
        if version not in _READABLE_PLAN_FILES:
            raise PlanFileError("the plan file has an unknown version", where=f"{where}, field version",
                                expected=f"version {', '.join(map(str, _READABLE_PLAN_FILES))}", got=repr(version),
                                fix="re-plan with this autopar version (autopar plan ... --save-plan FILE)")
        overrides = _checked(data, "overrides", "dict", where)
        for k, v in overrides.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool) or v != v or v in (_INF, -_INF):
                raise PlanFileError("a model override is not a string or a number", where=f"{where}, field overrides",
                                    expected="KEY: VALUE as --set KEY=VALUE gave it", got=f"{k}: {v!r}",
                                    fix=_PLAN_FILE_FIX)
        raw = _checked(data, "config", "dict", where)
        reject_unknown(raw, [f.name for f in fields(Config)], where=where, fix=_PLAN_FILE_FIX, prefix="config.")
        hints = typing.get_type_hints(Config)
        kw = {}
        for f in fields(Config):
            if f.name in _OPTIONAL_FIELDS and f.name not in raw:     # no context axis, no hybrid sharding
                continue
            if f.name == "cp_kind":
                kw[f.name] = _checked(raw, f.name, "str", where, prefix="config.")
                _choice(kw, "cp_kind", ("ring", "allgather", "alltoall"), where)
                continue
            kind = "int" if hints[f.name] is int else "str"
            kw[f.name] = _checked(raw, f.name, kind, where, prefix="config.",
                                  low=0 if f.name == "zero_stage" else 1)
        _choice(kw, "zero_stage", (0, 1, 2, 3), where)
        _choice({"dtype": data.get("dtype")}, "dtype", ("fp32", "bf16", "fp16"), where, prefix="")
        _choice(kw, "schedule", _SCHEDULES, where)
        if not (isinstance(kw["recompute"], str) and kw["recompute"].startswith("layers:")):
            _choice(kw, "recompute", RECOMPUTE, where)
        else:
            try:
                recompute_layers(kw["recompute"])
            except ConfigError:
                raise PlanFileError("the plan file's config.recompute is not one autopar knows",
                                    where=f"{where}, field config.recompute",
                                    expected="none | selective | full | layers:K", got=repr(kw["recompute"])[:80],
                                    fix=_PLAN_FILE_FIX) from None
        predicted = _checked(data, "predicted", "dict", where) if "predicted" in data else {}
        reject_unknown(predicted, _PREDICTED, where=where, fix=_PLAN_FILE_FIX, prefix="predicted.")
        for k in _PREDICTED:
            if k in predicted and predicted[k] is not None:
                _checked(predicted, k, "number", where, prefix="predicted.")
        plan = cls(model=_checked(data, "model", "str", where), overrides={str(k): v for k, v in overrides.items()},
                   cluster=_checked(data, "cluster", "str", where), hardware=_checked(data, "hardware", "str", where),
                   devices=_checked(data, "devices", "int", where), batch=_checked(data, "batch", "int", where),
                   seq=_checked(data, "seq", "int", where), dtype=_checked(data, "dtype", "str", where),
                   config=Config(**kw), microbatches=_checked(data, "microbatches", "int", where),
                   predicted={k: predicted[k] for k in _PREDICTED if k in predicted}, version=version)
        plan._check_degrees(where)
        return plan

    def _check_degrees(self, where: str) -> None:
        c = self.config
        for what, ok, expected, got in (
                ("dp x cp x tp x pp is not the plan's device count", c.dp * c.cp * c.tp * c.pp == self.devices,
                 f"dp x cp x tp x pp = devices = {self.devices}", f"dp={c.dp} cp={c.cp} tp={c.tp} pp={c.pp}"),
                ("ep does not divide dp (the expert axis is a sub-axis of the data axis)", c.dp % c.ep == 0,
                 f"ep dividing dp={c.dp}", f"ep={c.ep}"),
                ("the global batch is not dp x micro-batch x micro-batches",
                 self.batch == c.dp * c.micro_batch * self.microbatches,
                 f"batch = {c.dp} x {c.micro_batch} x {self.microbatches} = {c.dp * c.micro_batch * self.microbatches}",
                 f"batch {self.batch}")):
            if not ok:
                raise PlanFileError(f"the plan file's {what}", where=f"{where}, field config", expected=expected,
                                    got=got, fix=_PLAN_FILE_FIX)


_CONTEXT_FIELDS = ("cp", "cp_kind")      # written only for a plan with a context axis
_OPTIONAL_FIELDS = (*_CONTEXT_FIELDS, "shard_group")     # ... and the shard group where hybrid sharding is on


def _config_dict(c: Any) -> dict:
    """The Config as the file keeps it: the context axis's fields only where it has one, the
    shard group only under hybrid sharding (older files read as before)."""
    out = asdict(c)
    if out.get("cp", 1) == 1:
        for k in _CONTEXT_FIELDS:
            out.pop(k, None)
    if not out.get("shard_group"):
        out.pop("shard_group", None)
    return out


def _checked(data: dict, key: str, kind: str, where: str, *, prefix: str = "", low: int = 1) -> Any:
    """``data[key]`` if it is there and of ``kind`` (an int must be an int, not a bool or a float;
    ints are at least ``low``, strings non-empty); a PlanFileError naming the field otherwise."""
    at = f"{where}, field {prefix}{key}"
    expected = {"int": f"an integer {low}..{_MAX_INT}", "str": "a non-empty string", "dict": "a JSON object",
                "number": "a finite number"}[kind]
    if key not in data:
        raise PlanFileError(f"the plan file has no {prefix}{key} field", where=at, expected=expected,
                            got="nothing", fix=_PLAN_FILE_FIX)
    v = data[key]
    ok = {"int": lambda: type(v) is int and low <= v <= _MAX_INT, "str": lambda: isinstance(v, str) and bool(v),
          "dict": lambda: isinstance(v, dict),
          "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < _INF}[kind]()
    if not ok:
        raise PlanFileError(f"the plan file's {prefix}{key} is not {expected}", where=at, expected=expected,
                            got=f"{repr(v)[:80]} ({type(v).__name__})", fix=_PLAN_FILE_FIX)
    return v


def _choice(kw: dict, key: str, allowed: tuple, where: str, prefix: str = "config.") -> None:
    """A PlanFileError unless ``kw[key]`` is one of ``allowed``."""
    if kw[key] not in allowed:
        raise PlanFileError(f"the plan file's {prefix}{key} is not one autopar knows",
                            where=f"{where}, field {prefix}{key}", expected=" | ".join(map(str, allowed)),
                            got=repr(kw[key])[:80], fix=_PLAN_FILE_FIX)
