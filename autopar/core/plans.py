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

from autopar.core import strict_json
from autopar.core.errors import ConfigError, PlanFileError
from autopar.core.placement import Spec, Strategy

PLAN_VERSION = 4
_READABLE = (1, 2, 3, 4)   # older plans read with data-axis / pipeline defaults
_NODE_NAMES_SINCE = 4      # op nodes numbered per stem in graph order (passes/meta.py:number_ops)


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
    dp_mode: dict[str, Any] = field(default_factory=dict)   # data-axis mode (autopar/core/dp_mode.py); {}: all-reduce
    cp_axis: str | None = None                    # the axis that splits the sequence (context parallelism)
    cp_kind: str | None = None                    # how attention crosses it: ring | allgather | alltoall
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
        if self.pp_axis is not None and self.schedule not in _SCHEDULES:
            raise ConfigError("a pipeline plan needs a schedule", where="plan", got=repr(self.schedule),
                              fix="one of gpipe, 1f1b, interleaved, zb")
        if self.dp_mode:
            from autopar.core.dp_mode import data_mode
            data_mode(self.dp_mode, where="plan dp_mode")     # raises ConfigError on a bad one
        if self.cp_kind not in (None, "ring", "allgather", "alltoall"):
            raise ConfigError("cp_kind must be ring, allgather or alltoall", where="plan", got=repr(self.cp_kind),
                              fix="pick one of ring, allgather, alltoall")
        for axis in (self.tp_axis, self.dp_axis, self.pp_axis, self.ep_axis, self.cp_axis):
            if axis is not None and axis not in self.mesh:
                raise ConfigError(f"plan axis {axis!r} is not a mesh axis", where="plan", got=str(self.mesh),
                                  fix="name the tp/dp axes among the mesh axes")

    @property
    def dp(self) -> int:
        return self.mesh.get(self.dp_axis, 1) if self.dp_axis else 1

    @property
    def cp(self) -> int:
        return self.mesh.get(self.cp_axis, 1) if self.cp_axis else 1

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
    def from_json(cls, text: str, *, where: str = "plan") -> "Plan":
        """Read :meth:`to_json`'s text strictly: every field of its type and range (a bool is not
        an int, numbers are finite), no unknown field (the nearest valid name is suggested);
        anything else is a :class:`~autopar.core.errors.PlanFileError` naming the field."""
        data = strict_json.parse(text, where=where, fix=_FIX)
        if not isinstance(data, dict) or type(data.get("version")) is not int or data["version"] not in _READABLE:
            raise PlanFileError("plan has an unknown version", where=where,
                                expected=f"version {', '.join(map(str, _READABLE))}",
                                got=repr(data.get("version") if isinstance(data, dict) else data)[:80],
                                fix="re-plan with this autopar version (autopar.plan(...).save(path))")
        if data["version"] < _NODE_NAMES_SINCE and data.get("nodes"):
            raise PlanFileError("plan names graph nodes as an older autopar numbered them", where=f"{where}: nodes",
                                expected=f"a version {_NODE_NAMES_SINCE} plan (op nodes numbered per name in graph "
                                         "order)", got=f"version {data['version']} with {len(data['nodes'])} nodes",
                                fix="re-plan with this autopar version (autopar.plan(...).save(path)); the "
                                    "placements it chooses are the same")
        try:
            return cls(**_fields(data, where))
        except ConfigError as exc:
            if isinstance(exc, PlanFileError):
                raise
            raise PlanFileError(f"plan has an invalid field: {exc.what}", where=where, got=exc.got,
                                fix="pass a file written by Plan.save, or re-plan") from exc

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
        where = f"plan file {path}"
        text = strict_json.read_text(path, where=where, fix="pass the path of a file written by Plan.save")
        plan = cls.from_json(text, where=where)
        if model is not None:
            try:
                plan.check_model(model)
            except PlanFileError as exc:      # say which file
                raise PlanFileError(exc.what, where=where, expected=exc.expected, got=exc.got,
                                    fix=exc.fix) from exc.__cause__
        return plan

    def strategies(self) -> dict[str, Strategy]:
        return {k: v.strategy() for k, v in self.nodes.items()}

    def summary(self) -> dict[str, Any]:
        sharded = {k: v for k, v in self.params.items() if v != "R"}
        return {"mesh": self.mesh, "tp_axis": self.tp_axis, "dp_axis": self.dp_axis, "zero_stage": self.zero_stage,
                **({"cp_axis": self.cp_axis, "cp_kind": self.cp_kind} if self.cp_axis else {}),
                "dp_mode": self.dp_mode.get("kind", "allreduce"),
                "mixed_precision": self.mixed_precision, "sharded_params": len(sharded),
                "replicated_params": len(self.params) - len(sharded), **self.predicted}


# ---------------------------------------------------------------------------------------------
# Reading a plan file field by field (Plan.from_json).

_FIX = "pass a file written by Plan.save (or correct that field)"
_REQUIRED = ("mesh", "tp_axis", "params", "nodes")
_NODE_FIELDS = ("name", "inputs", "outputs", "work", "local_op")
_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")
_MAX_COUNT = 2**31 - 1      # mesh sizes, micro-batches, bucket bytes: int32 counts (NCCL's, torch's)


def _fields(data: dict, where: str) -> dict[str, Any]:
    """Plan's keyword arguments from a plan file's object, every field checked (a PlanFileError
    naming the first bad one); absent optional fields take their defaults (older versions)."""
    from dataclasses import fields
    names = [f.name for f in fields(Plan)]
    strict_json.reject_unknown(data, names, where=where, fix=_FIX)
    for key in _REQUIRED:
        if key not in data:
            raise PlanFileError(f"the plan is missing or mistypes a field: {key} is missing", where=f"{where}, "
                                f"field {key}", expected=f"the fields {', '.join(_REQUIRED)} at least", fix=_FIX)
    sj, at = strict_json, {"where": where, "fix": _FIX}
    out: dict[str, Any] = {"version": data["version"]}
    out["mesh"] = {str(k): sj.integer(v, f"mesh.{k}", low=1, high=_MAX_COUNT, **at)
                   for k, v in sj.mapping(data["mesh"], "mesh", **at).items()}
    for key in ("tp_axis", "dp_axis", "pp_axis", "ep_axis", "cp_axis", "cp_kind", "mixed_precision", "schedule",
                "capacity_factor"):
        out[key] = data.get(key)
    for key in ("tp_axis", "dp_axis", "pp_axis", "ep_axis", "cp_axis"):
        sj.text(out[key], key, optional=True, **at)
    sj.choice(out["cp_kind"], "cp_kind", (None, "ring", "allgather", "alltoall"), **at)
    sj.choice(out["mixed_precision"], "mixed_precision", (None, "bf16", "fp16"), **at)
    sj.choice(out["schedule"], "schedule", (None, *_SCHEDULES), **at)
    if out["capacity_factor"] is not None:
        sj.number(out["capacity_factor"], "capacity_factor", above=True, **at)
    out["params"] = {k: sj.text(v, f"params.{k}", **at) for k, v in sj.mapping(data["params"], "params", **at).items()}
    out["nodes"] = {k: _node(k, v, where) for k, v in sj.mapping(data["nodes"], "nodes", **at).items()}
    out["predicted"] = dict(sj.mapping(data.get("predicted", {}), "predicted", **at))
    out["model"] = sj.text(data.get("model", ""), "model", **at)
    out["fingerprint"] = sj.text(data.get("fingerprint", ""), "fingerprint", **at)
    out["zero_stage"] = sj.integer(data.get("zero_stage", 0), "zero_stage", low=0, high=3, **at)
    out["bucket_bytes"] = sj.integer(data.get("bucket_bytes", 0), "bucket_bytes", high=_MAX_COUNT, **at)
    out["overlap"] = sj.flag(data.get("overlap", True), "overlap", **at)
    out["microbatches"] = sj.integer(data.get("microbatches", 1), "microbatches", low=1, high=_MAX_COUNT, **at)
    out["virtual_stages"] = sj.integer(data.get("virtual_stages", 1), "virtual_stages", low=1, high=_MAX_COUNT, **at)
    out["stage_starts"] = tuple(sj.text(x, "stage_starts[]", **at)
                                for x in sj.array(data.get("stage_starts", []), "stage_starts", **at))
    out["expert_placement"] = {k: [sj.integer(x, f"expert_placement.{k}[]", high=_MAX_COUNT, **at)
                                   for x in sj.array(v, f"expert_placement.{k}", **at)]
                               for k, v in sj.mapping(data.get("expert_placement", {}), "expert_placement",
                                                      **at).items()}
    out["dp_mode"] = dict(sj.mapping(data.get("dp_mode", {}), "dp_mode", **at))
    out["shapes"] = {k: [sj.integer(x, f"shapes.{k}[]", **at) for x in sj.array(v, f"shapes.{k}", **at)]
                     for k, v in sj.mapping(data.get("shapes", {}), "shapes", **at).items()}
    return out


def _node(name: str, v: Any, where: str) -> NodeStrategy:
    """One entry of a plan file's ``nodes``, every field checked."""
    sj, at, key = strict_json, {"where": where, "fix": _FIX}, f"nodes.{name}"
    sj.reject_unknown(sj.mapping(v, key, **at), _NODE_FIELDS, prefix=f"{key}.", **at)
    for field_ in ("name", "inputs", "outputs"):
        if field_ not in v:
            raise PlanFileError(f"the plan is missing or mistypes a field: {key}.{field_} is missing",
                                where=f"{where}, field {key}.{field_}", expected=f"the fields {', '.join(_NODE_FIELDS)}",
                                fix=_FIX)
    return NodeStrategy(name=sj.text(v["name"], f"{key}.name", **at),
                        inputs=tuple(sj.text(x, f"{key}.inputs[]", **at)
                                     for x in sj.array(v["inputs"], f"{key}.inputs", **at)),
                        outputs=tuple(sj.text(x, f"{key}.outputs[]", **at)
                                      for x in sj.array(v["outputs"], f"{key}.outputs", **at)),
                        work=float(sj.number(v.get("work", 1.0), f"{key}.work", **at)),
                        local_op=sj.text(v.get("local_op"), f"{key}.local_op", optional=True, **at))


#: The recomputation modes a configuration may name; ``"layers:K"`` (:func:`recompute_layers`) too.
RECOMPUTE = ("none", "selective", "pointwise", "full")


def recompute_layers(mode: Any) -> int | None:
    """K of a ``"layers:K"`` recomputation (the first K layers of every pipeline stage, of the
    model without a pipeline, re-run in backward: Megatron-LM's block method), None for a named
    mode (:data:`RECOMPUTE`: ``pointwise`` re-runs every layer's ops but its matmuls and
    attention, whose outputs are kept); a :class:`ConfigError` for anything else."""
    if mode in RECOMPUTE:
        return None
    text = mode if isinstance(mode, str) else ""
    count = text[len("layers:"):] if text.startswith("layers:") else ""
    if not (count.isdigit() and int(count) >= 1):
        raise ConfigError(f"unknown recompute mode {mode!r}", where="recompute",
                          expected="none, selective, pointwise, full or layers:K (K >= 1)",
                          fix="e.g. recompute='full', or 'layers:2' for the first two layers of each stage")
    return int(count)


def recompute_rank(mode: str) -> float:
    """How much a mode recomputes, for ordering: none < selective < pointwise < layers:K (by K) < full."""
    k = recompute_layers(mode)
    return {"none": 0.0, "selective": 1.0, "pointwise": 1.5, "full": 3.0}[mode] if k is None else 2.0 + k / (k + 1.0)


@dataclass(frozen=True)
class Config:
    """One point of the joint planner's search space (:mod:`autopar.cost.plan_search`): the
    degrees, micro-batch size, schedule, recomputation and ZeRO stage the simulator scores."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "none"
    zero_stage: int = 0
    ep: int = 1
    cp: int = 1                       # context parallelism: ranks splitting each sequence
    cp_kind: str | None = None        # ring | allgather | alltoall (None: the simulator's cheapest)
    shard_group: int = 0              # hybrid sharding (ZeRO-2/3): data ranks per piece group (0: all)

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, **({"cp": self.cp} if self.cp > 1 else {})}
