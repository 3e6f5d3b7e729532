"""The Plan: what autopar decided, as plain data that round-trips through JSON.

A plan names the mesh axes, the tensor axis, how every parameter is stored (its
placement on the tensor axis, by original ``state_dict`` key) and the strategy of every
graph node, plus the predicted costs. Finding a plan (:func:`autopar.plan`) is separate
from applying one (:func:`autopar.parallelize` with ``plan=``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import ConfigError
from autopar.passes.sharding import Strategy
from autopar.placement import Spec

PLAN_VERSION = 1


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
    """A tensor-parallel plan (see the module docstring)."""

    mesh: dict[str, int]
    tp_axis: str
    params: dict[str, str]                       # state_dict key -> stored placement ("R", "S(0)")
    nodes: dict[str, NodeStrategy]               # graph node name -> strategy
    predicted: dict[str, float] = field(default_factory=dict)
    model: str = ""
    version: int = PLAN_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"plan is not valid JSON: {exc}", where="plan", fix="pass a file written by Plan.save") from exc
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise ConfigError("plan has an unknown version", where="plan", expected=f"version {PLAN_VERSION}",
                              got=repr(data.get("version") if isinstance(data, dict) else data),
                              fix="re-plan with this autopar version (autopar.plan(...).save(path))")
        try:
            nodes = {k: NodeStrategy(**{**v, "inputs": tuple(v["inputs"]), "outputs": tuple(v["outputs"])})
                     for k, v in data["nodes"].items()}
            return cls(mesh=dict(data["mesh"]), tp_axis=data["tp_axis"], params=dict(data["params"]), nodes=nodes,
                       predicted=dict(data.get("predicted", {})), model=data.get("model", ""))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"plan is missing or mistypes a field: {exc}", where="plan",
                              fix="pass a file written by Plan.save") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def strategies(self) -> dict[str, Strategy]:
        return {k: v.strategy() for k, v in self.nodes.items()}

    def summary(self) -> dict[str, Any]:
        sharded = {k: v for k, v in self.params.items() if v != "R"}
        return {"mesh": self.mesh, "tp_axis": self.tp_axis, "sharded_params": len(sharded),
                "replicated_params": len(self.params) - len(sharded), **self.predicted}
