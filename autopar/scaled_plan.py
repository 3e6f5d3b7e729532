"""A cluster plan (``autopar plan ... --save-plan FILE``) applied to the ranks at hand.

``autopar plan`` chooses dp x tp x pp (x ep), the ZeRO stage, recomputation, the schedule
and the micro-batches for a cluster that may not be this one: the laptop before the job, or a
smaller allocation. :func:`scale_plan` turns it into what :func:`autopar.parallelize` builds
on ``world`` ranks:

- with as many ranks as the plan's devices, the plan as it is;
- otherwise the model-parallel axes first, since they are what makes the model fit a device:
  tp becomes the largest divisor of the planned tp that divides the ranks (tensor splits
  must divide the heads the plan split), then pp the largest degree up to the planned one
  that divides what is left, and dp the rest; ep the largest divisor of dp up to the planned
  ep (the expert axis is part of the data axis);
- the ZeRO stage, recomputation, micro-batch size and micro-batches per step stay the
  plan's; what needs an axis that is gone goes with it (ZeRO without a data axis, the
  schedule and virtual stages without a pipeline), and each such change is a note;
- the global batch follows: data shares x micro-batch x micro-batches.

``ScaledPlan.notes`` says what was scaled and why; :func:`autopar.parallelize` logs them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.core.errors import ConfigError


@dataclass(frozen=True)
class ScaledPlan:
    """A saved cluster plan scaled to ``world`` ranks (see the module docstring)."""

    saved: Any                                  # the SavedPlan it came from
    world: int
    mesh: dict[str, int]                        # axes pp, dp, cp, ep, tp (size-1 axes left out)
    micro_batch: int
    microbatches: int                           # per step, per data share
    options: dict[str, Any] = field(default_factory=dict)   # the settings, by parallelize's flat keyword names

    def parallelize_kwargs(self) -> dict[str, Any]:
        """:attr:`options` as :func:`autopar.parallelize` takes them: the common ones as keywords,
        the pipeline's in ``options=PipelineOptions(...)``."""
        from autopar.core.options import ContextOptions, DataOptions, PipelineOptions
        pipe = {k: self.options[k] for k in ("schedule", "microbatches", "virtual_stages") if k in self.options}
        flat = {k: v for k, v in self.options.items() if k not in pipe and k not in ("cp_kind", "shard_group")}
        parts = ([PipelineOptions(**pipe)] if pipe else []) + (
            [ContextOptions(kind=self.options["cp_kind"])] if self.options.get("cp_kind") else []) + (
            [DataOptions(shard_group=self.options["shard_group"])] if self.options.get("shard_group") else [])
        return {**flat, "options": parts[0] if len(parts) == 1 else parts} if parts else flat
    notes: tuple[str, ...] = ()

    @property
    def shares(self) -> int:
        """How many data shares the batch is cut into (dp x ep ranks)."""
        return self.mesh.get("dp", 1) * self.mesh.get("ep", 1)

    @property
    def batch(self) -> int:
        """The global batch per optimizer step: data shares x micro-batch x micro-batches."""
        return self.shares * self.micro_batch * self.microbatches

    def describe(self) -> str:
        s, c = self.saved, self.saved.config
        planned = " x ".join(f"{k}={v}" for k, v in (("pp", c.pp), ("dp", c.dp), ("cp", c.cp), ("ep", c.ep), ("tp", c.tp)) if v > 1)
        here = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        head = (f"plan for {s.model} on {s.cluster} {s.hardware} ({s.devices} devices, mesh {planned or 'one device'})"
                f" applied to {self.world} rank{'s' * (self.world > 1)}: mesh {here}, "
                f"micro-batch {self.micro_batch} x {self.microbatches} per data share, global batch {self.batch}")
        return head + "".join(f"\n  {n}" for n in self.notes)


def is_saved_plan_file(path: Any) -> bool:
    """Is ``path`` a file ``autopar plan --save-plan`` wrote (rather than a parallelize Plan)?"""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, OSError, UnicodeDecodeError):
        return False      # Plan.load says what is wrong with it
    return isinstance(data, dict) and data.get("format") == "autopar plan"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def scale_plan(plan: Any, world: int | None = None, *, per_node: int | None = None) -> ScaledPlan:
    """The saved plan ``plan`` (a path or a SavedPlan) for ``world`` ranks (default: the process
    group's size), ``per_node`` ranks to a node (default: torchrun's ``LOCAL_WORLD_SIZE``; unknown:
    one node). Across nodes the tensor and expert axes are kept inside one (tp x ep divides the
    ranks of a node); the data and pipeline axes take the rest."""
    from autopar.core.saved_plan import SavedPlan
    saved = plan if isinstance(plan, SavedPlan) else SavedPlan.load(plan)
    if world is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            raise ConfigError("scaling a plan to the ranks needs the process group", where="autopar.scale_plan",
                              fix="call torch.distributed.init_process_group first, or pass world=")
        world = dist.get_world_size()
    if type(world) is not int or world < 1:
        raise ConfigError("the rank count must be a positive integer", where="autopar.scale_plan",
                          got=repr(world), fix="pass world= a positive integer")
    if per_node is None:
        from autopar.runtime.nodes import node_size
        per_node = node_size()
    if per_node is not None and (type(per_node) is not int or per_node < 1):
        raise ConfigError("the ranks per node must be a positive integer", where="autopar.scale_plan",
                          got=repr(per_node), fix="pass per_node= a positive integer (or leave it to torchrun)")
    nodes = per_node is not None and world > per_node and world % per_node == 0
    c, notes = saved.config, []
    if world == saved.devices and not (nodes and per_node % (c.tp * c.ep)):
        tp, pp, dp, ep = c.tp, c.pp, c.dp * c.cp, c.ep        # dp here: every rank beside tp and pp
    elif nodes and per_node % (c.tp * c.ep):
        tp = max(d for d in _divisors(c.tp) if world % d == 0 and per_node % d == 0)
        pp = max(d for d in _divisors(world // tp) if d <= c.pp)
        dp = world // (tp * pp)
        ep = max(d for d in _divisors(dp) if d <= c.ep and per_node % (d * tp) == 0)
        notes.append(f"{world // per_node} nodes of {per_node} ranks: tp {c.tp} -> {tp}" + (
            f", ep {c.ep} -> {ep}" if c.ep > 1 else "") + f", pp {c.pp} -> {pp}, dp {c.dp} -> {dp} (the tensor "
            "and expert axes kept inside a node, whose links are the fast ones; data and pipeline across)")
    else:
        tp = max(d for d in _divisors(c.tp) if world % d == 0)
        pp = max(d for d in _divisors(world // tp) if d <= c.pp)
        dp = world // (tp * pp)
        ep = max(d for d in _divisors(dp) if d <= c.ep)
        notes.append(f"{world} ranks instead of the plan's {saved.devices}: tp {c.tp} -> {tp}, pp {c.pp} -> {pp}, "
                     f"dp {c.dp} -> {dp}" + (f", ep {c.ep} -> {ep}" if c.ep > 1 else "")
                     + " (tensor and pipeline axes kept first: they are what makes the model fit a device)")
    cp = 1
    if c.cp > 1:        # the context axis takes its share of the data ranks: each sequence split as planned
        cp = max(d for d in _divisors(c.cp) if dp % d == 0 and (d == 1 or saved.seq % (2 * d) == 0))
        dp //= cp
        if dp % ep:
            ep = max(d for d in _divisors(dp) if d <= ep)
        if cp != c.cp:
            notes.append(f"cp {c.cp} -> {cp}")
    zero = c.zero_stage if dp * cp > 1 else 0
    if zero != c.zero_stage:
        notes.append(f"ZeRO-{c.zero_stage} -> ZeRO-0: no data axis to shard over")
    options: dict[str, Any] = {"zero_stage": zero, "recompute": c.recompute}
    if saved.dtype in ("bf16", "fp16"):
        options["mixed_precision"] = saved.dtype
    m = saved.microbatches
    if pp > 1:
        schedule, virtual = c.schedule, c.virtual
        if schedule == "interleaved" and m % pp:
            notes.append(f"the interleaved schedule needs micro-batches a multiple of pp={pp} ({m} are not): 1f1b")
            schedule, virtual = "1f1b", 1
        options.update(schedule=schedule, microbatches=m)
        if schedule == "interleaved":
            options["virtual_stages"] = virtual
    elif c.pp > 1:
        notes.append(f"the {c.schedule} schedule goes with the pipeline: the {m} micro-batches per step are "
                     "yours to accumulate (ScaledPlan.microbatches)")
    if pp == 1 and m > 1 and c.pp == 1:
        notes.append(f"{m} micro-batches per step: accumulate them in your loop (ScaledPlan.microbatches)")
    if cp > 1:
        options["cp_kind"] = c.cp_kind
    if c.shard_group and zero >= 2 and pp == 1:
        # hybrid sharding on fewer ranks: the largest group no bigger than the plan's leaving two or more
        data = dp * cp
        g = max((d for d in _divisors(data) if d <= c.shard_group and d < data), default=1)
        if g > 1:
            options["shard_group"] = g
        if g != c.shard_group:
            notes.append(f"shard groups of {c.shard_group} -> " + (f"{g}" if g > 1 else "the whole data axis"))
    mesh = {k: v for k, v in (("pp", pp), ("dp", dp // ep), ("cp", cp), ("ep", ep), ("tp", tp)) if v > 1} or {"dp": 1}
    return ScaledPlan(saved=saved, world=world, mesh=mesh, micro_batch=c.micro_batch, microbatches=m,
                      options=options, notes=tuple(notes))


_DEFAULTS = {"zero_stage": None, "recompute": "none", "mixed_precision": None, "schedule": None,
             "microbatches": None, "virtual_stages": None, "cp_kind": None, "shard_group": 0}


def merge_options(scaled: ScaledPlan, mesh: Any, given: dict[str, Any]) -> tuple[dict[str, int], dict[str, Any]]:
    """The mesh and the parallelize options a scaled plan asks for, with what the caller gave:
    a mesh or an option that contradicts the plan is refused (a ConfigError naming both)."""
    if mesh is not None and mesh != scaled.mesh:
        raise ConfigError("the mesh differs from the plan file's, scaled to these ranks",
                          where="parallelize(plan=FILE)", expected=str(scaled.mesh), got=str(mesh),
                          fix="leave the mesh out (the plan gives it), or re-plan for this mesh")
    out = {}
    for name, value in scaled.options.items():
        have = given.get(name, _DEFAULTS.get(name))
        if have != _DEFAULTS.get(name) and have != value:
            raise ConfigError(f"{name}= differs from the plan file's", where="parallelize(plan=FILE)",
                              expected=repr(value), got=repr(have),
                              fix=f"drop {name}= (the plan's is used), or re-plan with autopar plan")
        out[name] = value
    return dict(scaled.mesh), out
