"""The Plan: what autopar decided, as plain data that round-trips through JSON.

A plan names the mesh axes, the tensor axis, how every parameter is stored (its
placement on the tensor axis, by original ``state_dict`` key) and the strategy of every
graph node; the data axis with its ZeRO stage, gradient bucket size, overlap and mixed
precision; the pipeline axis with its stage cuts, schedule and micro-batches; plus the predicted costs (seconds, and bytes per device split into
parameters / gradients / optimizer / activations / buffers). Finding a plan (:func:`autopar.plan`) is separate
from applying one (:func:`autopar.parallelize` with ``plan=``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import ConfigError, PlanFileError
from autopar.passes.sharding import Strategy
from autopar.placement import Spec

PLAN_VERSION = 3
_READABLE = (1, 2, 3)   # older plans read with data-axis / pipeline defaults


@dataclass(frozen=True, kw_only=True)
class NodeStrategy:
    """A node's strategy in plain strings."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    work: float = 1.0
    local_op: str | None = None

    @classmethod
    def of(cls, s: Strategy) -> "NodeStrategy":
        return cls(name=s.name, inputs=tuple(_spec(x) for x in s.inputs), outputs=tuple(_spec(x) for x in s.outputs),
                   work=s.work, local_op=s.local_op)

    def strategy(self) -> Strategy:
        return Strategy(self.name, tuple(Spec.parse(x) for x in self.inputs),
                        tuple(Spec.parse(x) for x in self.outputs), self.work, self.local_op)


def _spec(s: Spec) -> str:
    return f"{s.value}/g{s.grad}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A plan over a (pp x) dp x tp mesh (see the module docstring)."""

    mesh: dict[str, int]                         # axis name -> size, outermost first
    tp_axis: str | None
    params: dict[str, str]                       # state_dict key -> stored placement on the tp axis ("R", "S(0)")
    nodes: dict[str, NodeStrategy]               # graph node name -> strategy on the tp axis
    predicted: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    dp_axis: str | None = None                   # the axis that splits the batch
    zero_stage: int = 0                          # 0 (replicated) .. 3 (parameters sharded)
    bucket_bytes: int = 0                        # gradient/gather bucket size; 0: from the cost model
    overlap: bool = True                         # schedule collectives early/late (False: at their consumer)
    mixed_precision: str | None = None           # None (fp32) | "bf16" | "fp16": compute dtype, fp32 master
    pp_axis: str | None = None                   # the axis that holds pipeline stages
    stage_starts: tuple[str, ...] = ()           # the first op (node name) of each stage, p * v of them
    schedule: str | None = None                  # gpipe | 1f1b | interleaved | zb
    microbatches: int = 1                        # per step, per data-axis rank
    virtual_stages: int = 1                      # stages per pipeline rank (stage s on rank s % pp)
    ep_axis: str | None = None                   # the axis that holds experts
    expert_placement: dict[str, list[int]] = field(default_factory=dict)  # MoE region -> experts in owner order
    capacity_factor: float | None = None          # MoE capacity factor (None: the model's own)
    shapes: dict[str, list[int]] = field(default_factory=dict)   # the model's parameters, by state_dict key
    fingerprint: str = ""                         # hash of ``shapes``: which model the plan is for
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("zero_stage must be 0, 1, 2 or 3", where="plan", got=repr(self.zero_stage),
                              fix="pick a ZeRO stage between 0 and 3")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ConfigError("bucket_bytes must be a non-negative integer", where="plan", got=repr(self.bucket_bytes),
                              fix="pass bytes per gradient bucket, or 0 to let the cost model choose")
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ConfigError("mixed_precision must be None, 'bf16' or 'fp16'", where="plan",
                              got=repr(self.mixed_precision), fix="use bf16 (or fp16) compute, or None for fp32")
        if self.pp_axis is not None and self.schedule not in ("gpipe", "1f1b", "interleaved", "zb"):
            raise ConfigError("a pipeline plan needs a schedule", where="plan", got=repr(self.schedule),
                              fix="one of gpipe, 1f1b, interleaved, zb")
        for axis in (self.tp_axis, self.dp_axis, self.pp_axis, self.ep_axis):
            if axis is not None and axis not in self.mesh:
                raise ConfigError(f"plan axis {axis!r} is not a mesh axis", where="plan", got=str(self.mesh),
                                  fix="name the tp/dp axes among the mesh axes")

    @property
    def dp(self) -> int:
        return self.mesh.get(self.dp_axis, 1) if self.dp_axis else 1

    @property
    def pp(self) -> int:
        return self.mesh.get(self.pp_axis, 1) if self.pp_axis else 1

    @property
    def tp(self) -> int:
        return self.mesh.get(self.tp_axis, 1) if self.tp_axis else 1

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"plan is not valid JSON: {exc}", where="plan",
                                fix="pass a file written by Plan.save") from exc
        if not isinstance(data, dict) or data.get("version") not in _READABLE:
            raise PlanFileError("plan has an unknown version", where="plan",
                                expected=f"version {', '.join(map(str, _READABLE))}",
                                got=repr(data.get("version") if isinstance(data, dict) else data),
                                fix="re-plan with this autopar version (autopar.plan(...).save(path))")
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFileError(f"plan is missing or mistypes a field: {type(exc).__name__}: {exc}", where="plan",
                                fix="pass a file written by Plan.save") from exc
        except ConfigError as exc:    # a field out of range (Plan.__post_init__)
            raise PlanFileError(f"plan has an invalid field: {exc.what}", where="plan", got=exc.got,
                                fix="pass a file written by Plan.save, or re-plan") from exc

    @classmethod
    def _from_dict(cls, data: dict) -> "Plan":
        nodes = {k: NodeStrategy(**{**v, "inputs": tuple(v["inputs"]), "outputs": tuple(v["outputs"])})
                 for k, v in data["nodes"].items()}
        return cls(mesh=dict(data["mesh"]), tp_axis=data["tp_axis"], params=dict(data["params"]), nodes=nodes,
                   predicted=dict(data.get("predicted", {})), model=data.get("model", ""),
                   dp_axis=data.get("dp_axis"), zero_stage=int(data.get("zero_stage", 0)),
                   bucket_bytes=int(data.get("bucket_bytes", 0)), overlap=bool(data.get("overlap", True)),
                   mixed_precision=data.get("mixed_precision"), pp_axis=data.get("pp_axis"),
                   stage_starts=tuple(data.get("stage_starts", ())), schedule=data.get("schedule"),
                   microbatches=int(data.get("microbatches", 1)),
                   virtual_stages=int(data.get("virtual_stages", 1)), ep_axis=data.get("ep_axis"),
                   expert_placement={k: list(v) for k, v in data.get("expert_placement", {}).items()},
                   capacity_factor=data.get("capacity_factor"),
                   shapes={k: list(v) for k, v in data.get("shapes", {}).items()},
                   fingerprint=str(data.get("fingerprint", "")))

    def check_model(self, model: Any) -> None:
        """Raise a :class:`PlanFileError` naming the first parameters whose names or shapes differ from
        the model the plan was made for (plans without recorded shapes are not checked)."""
        if not self.shapes:
            return
        have = {k: list(p.shape) for k, p in model.named_parameters()}
        missing = sorted(set(self.shapes) - set(have))
        extra = sorted(set(have) - set(self.shapes))
        differ = sorted(k for k in set(have) & set(self.shapes) if have[k] != self.shapes[k])
        if missing or extra or differ:
            got = "; ".join(part for part in (
                f"missing {missing[:3]}" if missing else "", f"not in the plan {extra[:3]}" if extra else "",
                ", ".join(f"{k} is {have[k]}, the plan has {self.shapes[k]}" for k in differ[:3])) if part)
            raise PlanFileError(f"the plan was made for another model ({self.model or 'unnamed'}, fingerprint "
                                f"{self.fingerprint[:12] or '?'})", where="plan", expected="the same parameter names "
                                "and shapes", got=got, fix="re-plan for this model: autopar.plan(model, mesh, inputs)")

    @staticmethod
    def fingerprint_of(shapes: dict[str, list[int]]) -> str:
        import hashlib
        return hashlib.sha256(json.dumps(sorted(shapes.items())).encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path, model: Any = None) -> "Plan":
        """Read a plan file; with ``model``, check it is for that model before anything runs."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanFileError(f"cannot read the plan file: {exc}", where=str(path),
                                fix="pass the path of a file written by Plan.save") from exc
        try:
            plan = cls.from_json(text)
            if model is not None:
                plan.check_model(model)
        except PlanFileError as exc:      # say which file
            raise PlanFileError(exc.what, where=f"plan file {path}", expected=exc.expected, got=exc.got,
                                fix=exc.fix) from exc.__cause__
        return plan

    def strategies(self) -> dict[str, Strategy]:
        return {k: v.strategy() for k, v in self.nodes.items()}

    def summary(self) -> dict[str, Any]:
        sharded = {k: v for k, v in self.params.items() if v != "R"}
        return {"mesh": self.mesh, "tp_axis": self.tp_axis, "dp_axis": self.dp_axis, "zero_stage": self.zero_stage,
                "mixed_precision": self.mixed_precision, "sharded_params": len(sharded),
                "replicated_params": len(self.params) - len(sharded), **self.predicted}
