"""Checks of the user's input that run before anything is built or any collective is
issued. Each raises the :class:`~autopar.core.errors.AutoparError` subclass that names the
mistake: what, where (parameter, node, module), expected, got, and how to fix it.

- :func:`check_options`: planning sizes and memory budget (ConfigError);
- :func:`memory_bytes`: a memory budget as bytes, from a number or a string like "40GB" (ConfigError);
- :func:`forced_placements`: ``placements=`` the user forces (ShardingError, MeshError);
- :func:`check_sequence_option`: ``sequence_parallel=`` needs a dim named ``seq`` (ConfigError);
- :func:`check_plan_placements`: a given plan splits only dims the tensor axis divides (ShardingError);
- :func:`check_fits`: the plan's memory within an explicit ``memory_budget`` (DoesNotFitError);
- :func:`check_devices`: real tensors on the process group's device (UnsupportedError);
- :func:`check_runtime_dtypes`: dtypes the data-parallel runtime can store (UnsupportedError).
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn

from autopar.core.errors import ConfigError, DoesNotFitError, MeshError, ShardingError, UnsupportedError
from autopar.core.meta import evaluate, graph_info, info
from autopar.core.placement import Partial, Shard, normalize, parse

log = logging.getLogger("autopar")
MAX_DEVICES = 4096    # how far check_fits looks for a device count that fits


def check_sequence_option(gm: fx.GraphModule, sequence_parallel: Any, tp: Any) -> None:
    """``sequence_parallel`` is None or a bool, and a bool needs a tensor axis (``tp``: the
    ``(name, size)`` tensor axes of the mesh) and a sequence dim to act on: an input dim named
    ``"seq"`` (the tensor-axis solver splits, or keeps whole, the dims of every activation whose
    size involves it)."""
    if sequence_parallel is None:
        return
    if not isinstance(sequence_parallel, bool):
        raise ConfigError("sequence_parallel must be None, True or False", where="sequence_parallel",
                          expected="None (the cost model chooses), True or False", got=repr(sequence_parallel),
                          fix="e.g. sequence_parallel=False to keep activations whole along the sequence")
    if not tp or tp[0][1] == 1:
        raise ConfigError(f"sequence_parallel={sequence_parallel} needs a tensor axis", where="sequence_parallel",
                          got=f"tensor axes {dict(tp) or None}",
                          fix="add a tp axis of size 2 or more, or leave sequence_parallel=None")
    if "seq" not in graph_info(gm).example_sizes:
        raise ConfigError("sequence_parallel needs a sequence dim, and no input dim is named 'seq'",
                          where="sequence_parallel", got=f"input dims named {sorted(graph_info(gm).example_sizes)}",
                          fix='name it: dims=({0: "batch", 1: "seq"},) for one [batch, seq] input, or leave '
                              'sequence_parallel=None')


def check_options(sizes: Mapping[str, int] | None, memory_budget: float | None) -> None:
    """Planning sizes are positive integers; a memory budget is a positive number of bytes."""
    for name, size in dict(sizes or {}).items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"planning size {name!r} must be a positive integer", where=f"sizes[{name!r}]",
                              expected="an int >= 1", got=repr(size), fix='e.g. sizes={"batch": 8, "seq": 2048}')
    if memory_budget is not None and not memory_budget > 0:
        raise ConfigError("memory_budget must be a positive number of bytes per device", where="memory_budget",
                          expected="> 0 (or None: the device's memory)", got=repr(memory_budget),
                          fix='pass bytes per device or a size, e.g. memory_budget=80e9 or "80GB"')


MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def memory_bytes(budget: float | str | None, where: str = "memory_budget") -> float | None:
    """A memory budget as bytes: numbers are bytes already; strings carry a unit, decimal
    (``"40GB"`` = 40e9, ``"512MB"``) or binary (``"40 GiB"`` = 40 * 2**30), case-insensitive.
    None stays None (the device's memory). A string without a known unit (``"40"``: bytes or GB?)
    or that is not a size raises ConfigError."""
    if budget is None or isinstance(budget, bool) or not isinstance(budget, str):
        return budget      # a number (bytes), or something check_options refuses with its own message
    m = _MEMORY.fullmatch(budget)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in MEMORY_UNITS:
        raise ConfigError("memory_budget as a string needs a number and a unit", where=where,
                          expected=f"bytes (e.g. 40e9) or a number with a unit: {', '.join(MEMORY_UNITS)} "
                                   "(GB = 1e9 bytes, GiB = 2**30)",
                          got=repr(budget), fix='e.g. memory_budget="40GB", "40 GiB" or 40e9')
    return float(m.group(1)) * MEMORY_UNITS[unit]


def forced_placements(gm: fx.GraphModule, placements: Mapping[str, str], axes: tuple[tuple[str, int], ...]
                      ) -> dict[str, str]:
    """``{state_dict key: "R" | "S(dim)"}`` as ``{placeholder name: placement}`` for the
    tensor-axis solver, after checking each key is a parameter or buffer, each placement
    storable, and each split dim divisible by the tensor axis."""
    tp = dict(axes).get("tp", 1)
    ginfo = graph_info(gm)
    node_of = {fqn: name for name, fqn in {**ginfo.param_fqns, **ginfo.buffer_fqns}.items()}
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, str] = {}
    for fqn, text in placements.items():
        p = parse(str(text))
        if fqn not in node_of:
            raise ConfigError(f"placements names {fqn!r}, which is not a parameter or buffer the model uses",
                              where="placements=", expected=f"state_dict keys such as {sorted(node_of)[:3]}",
                              got=repr(fqn), fix="name parameters by their state_dict keys (model.state_dict())")
        if isinstance(p, Partial):
            raise ConfigError(f"a stored parameter cannot be partial ({fqn})", where=f"placements[{fqn!r}]",
                              expected='"R" or "S(dim)"', got=str(text), fix='use "R" or "S(dim)"')
        shape = [int(evaluate(d, ginfo.example_sizes)) for d in info(nodes[node_of[fqn]]).values[0].shape]
        if isinstance(p, Shard) and -len(shape) <= p.dim < 0:
            p = normalize(p, len(shape))
        if isinstance(p, Shard):
            if tp < 2:
                raise MeshError(f"placements splits {fqn} but the mesh has no tensor axis to split it over",
                                where=f"placements[{fqn!r}]", expected="a mesh with a tp axis of size >= 2",
                                got=str(dict(axes)), fix="add a tp axis, e.g. {'tp': 2}, or drop the placement")
            _check_divisible(fqn, f"placements[{fqn!r}]", shape, p.dim, tp)
        out[node_of[fqn]] = str(p)
    return out


def _check_divisible(what: str, where: str, shape: list[int], dim: int, n: int) -> None:
    dim = dim + len(shape) if -len(shape) <= dim < 0 else dim
    if not 0 <= dim < len(shape):
        raise ShardingError(f"{what} has no dim {dim} to split", where=where, expected=f"a dim below {len(shape)}",
                            got=f"shape {shape}", fix=f"split one of dims 0..{len(shape) - 1}, or replicate (R)")
    if shape[dim] % n or shape[dim] < n:
        raise ShardingError(f"{what}: dim {dim} of size {shape[dim]} does not split over the tensor axis of "
                            f"size {n}", where=where, expected=f"a dim size divisible by {n}",
                            got=f"shape {shape}, dim {dim} = {shape[dim]}",
                            fix=f"replicate it (R), split a dim divisible by {n}, use a tensor axis that divides "
                                f"{shape[dim]}, or leave the placement to the planner")


def check_plan_placements(gm: fx.GraphModule, plan: Any) -> None:
    """Every dim a plan splits (stored parameters, node outputs) divides by its tensor axis
    where the size is fixed; symbolic sizes are checked on each call (runtime/tp_module.py)."""
    n = plan.tp
    if n < 2:
        return
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder" and rec.kind in ("param", "buffer") and rec.values:
            p = parse(plan.params.get(rec.target_fqn, "R"))
            if isinstance(p, Shard):
                _check_divisible(f"parameter {rec.target_fqn}", f"plan.params[{rec.target_fqn!r}]",
                                 _fixed_shape(rec.values[0].shape), p.dim, n)
        s = plan.nodes.get(node.name)
        for i, out in enumerate(s.outputs if s is not None else ()):
            p = parse(out.split("/")[0])
            if isinstance(p, Shard) and i < len(rec.values):
                shape = _fixed_shape(rec.values[i].shape)
                if -len(shape) <= p.dim < len(shape) and shape[p.dim] < 0:
                    continue
                _check_divisible(f"node {node.name} ({rec.fqn or '<root>'})", f"plan.nodes[{node.name!r}]",
                                 shape, p.dim, n)


def _fixed_shape(shape: Any) -> list[int]:
    """Integer sizes; -1 for a symbolic one (its size is known only at each call)."""
    return [int(d) if not hasattr(d, "free_symbols") or not d.free_symbols else -1 for d in shape]


def check_fits(gm: fx.GraphModule, plan: Any, budget: float | None, sizes: Mapping[str, int] | None = None) -> None:
    """With an explicit ``budget``, the plan's predicted bytes per device must fit it, or a
    :class:`DoesNotFitError` says how many devices would (ZeRO-3 over a data axis no larger
    than the global batch, which is ``sizes["batch"]`` per data-axis rank). A budget that no
    device count meets (``memory_budget=1``, the idiom for "as lean as possible") only logs a
    warning: the plan is then the leanest the planner found."""
    need = (plan.predicted.get("memory_bytes") or {}).get("total")
    if budget is None or need is None or need <= budget:
        return
    batch = int(dict(sizes or {}).get("batch", 1)) * plan.dp
    smallest, dp = smallest_devices(gm, plan, budget, batch)
    if smallest is None:
        log.warning("the plan needs %.3g GB per device; no data axis dividing the global batch of %d meets "
                    "memory_budget=%.3g GB, so the leanest plan found is used", need / 1e9, batch, budget / 1e9)
        return
    world = math.prod(plan.mesh.values())
    how = (f"ZeRO-3 fits these {world} devices: zero_stage=3 (or None to let the planner choose)"
           if smallest <= world and plan.dp > 1 else
           f"{smallest} devices would fit (dp={dp} x tp={plan.tp} with zero_stage=3), or raise memory_budget")
    raise DoesNotFitError(f"the model does not fit in memory_budget={budget / 1e9:.3g} GB per device on mesh "
                          f"{plan.mesh}", where=f"plan (ZeRO-{plan.zero_stage}, tp={plan.tp})",
                          smallest_devices=smallest, expected=f"<= {budget:.4g} bytes per device",
                          got=f"{need:.4g} bytes per device ({_split_text(plan)})", fix=how)


def smallest_devices(gm: fx.GraphModule, plan: Any, budget: float, batch: int) -> tuple[int | None, int]:
    """The fewest devices (dp x the plan's tp; dp dividing the global ``batch``, ZeRO-3 when
    dp > 1) whose per-device state fits ``budget``, with that dp; (None, 0) if none does."""
    from autopar.cost.dp_planner import memory_split
    from autopar.cost.plan_sizes import local_numels, param_bytes

    trainable, frozen, buffers = local_numels(gm, plan)
    for dp in (d for d in range(1, batch + 1) if batch % d == 0 and d * plan.tp <= MAX_DEVICES):
        split = memory_split(trainable_numel=trainable, frozen_numel=frozen, dp=dp, zero_stage=3 if dp > 1 else 0,
                             mixed_precision=plan.mixed_precision, buffer_bytes=buffers, param_bytes=param_bytes(gm))
        if split.total <= budget:
            return dp * plan.tp, dp
    return None, 0


def _split_text(plan: Any) -> str:
    mem = plan.predicted.get("memory_bytes") or {}
    return ", ".join(f"{k} {mem[k]:.3g}" for k in ("params", "grads", "optimizer", "buffers") if mem.get(k))


def check_devices(model: nn.Module, args: tuple, device_type: str | None) -> None:
    """parallelize needs real tensors, all on the device type of the process group's backend
    (``None``: not known yet; only meta tensors and mixed devices are refused)."""
    named = [(f"parameter {k}", t) for k, t in model.named_parameters()]
    named += [(f"buffer {k}", t) for k, t in model.named_buffers()]
    named += [(f"input {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    meta = [what for what, t in named if t.is_meta]
    if meta:
        raise UnsupportedError("parallelize needs real tensors, and the model or its inputs are on the meta device",
                               where=", ".join(meta[:3]) + (" ..." if len(meta) > 3 else ""),
                               expected="tensors with values (cpu, or cuda with nccl)", got="device meta",
                               fix="plan on meta with autopar.plan(...); to parallelize, materialize the model "
                                   "(model.to_empty(device='cpu') and initialise it, or load its weights)")
    kinds = sorted({t.device.type for _, t in named})
    if len(kinds) > 1:
        first = {k: next(what for what, t in named if t.device.type == k) for k in kinds}
        raise UnsupportedError("the model and its inputs are on different devices", where=", ".join(first.values()),
                               expected="one device type", got=", ".join(kinds),
                               fix="move the model and the example inputs to one device (model.to(dev))")
    if device_type is not None and kinds and kinds != [device_type]:
        raise UnsupportedError(f"the model is on {kinds[0]}, but the process group runs on {device_type}",
                               where=named[0][0], expected=f"tensors on {device_type}", got=kinds[0],
                               fix="use the nccl backend for cuda models and gloo for cpu ones, and move the model "
                                   "to that device before parallelize")


def check_runtime_dtypes(model: nn.Module, gm: fx.GraphModule, plan: Any) -> None:
    """Dtypes the data-parallel runtime cannot store: integer parameters in ZeRO-3 pieces or
    mixed precision, float64 under autocast, batch norm's fp32 statistics beside 16-bit weights."""
    mixed, zero3 = plan.mixed_precision, plan.dp > 1 and plan.zero_stage == 3
    for fqn, p in model.named_parameters():
        if not p.is_floating_point() and (zero3 or mixed):
            raise UnsupportedError(f"parameter {fqn} is {_name(p.dtype)}; ZeRO-3 and mixed precision store "
                                   "parameters as floating-point values", where=f"parameter {fqn}",
                                   expected="floating-point parameters", got=_name(p.dtype),
                                   fix="register it as a buffer (module.register_buffer(name, tensor)): an "
                                       "integer parameter is never trained anyway")
        if mixed and p.dtype == torch.float64:
            raise UnsupportedError(f"mixed_precision={mixed!r} needs fp32 parameters; {fqn} is float64, which "
                                   "autocast does not cast", where=f"parameter {fqn}", expected="float32",
                                   got="float64", fix="model.float() before parallelize, or mixed_precision=None")
    floats = sorted({_name(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if len(floats) > 1 and plan.dp > 1 and plan.zero_stage >= 1:
        raise UnsupportedError("ZeRO flattens parameters into buckets of one dtype, and the parameters have several",
                               where="parallelize(zero_stage=...)", expected="one floating-point dtype",
                               got=", ".join(floats), fix="cast the model to one dtype (model.float()), or zero_stage=0")
    if mixed:
        for node in gm.graph.nodes:
            if "batch_norm" in str(node.target):
                raise UnsupportedError("batch norm under mixed precision is not supported yet: its running "
                                       "statistics stay fp32 while its weights are 16-bit",
                                       where=f"node {node.name}, module {info(node).fqn or '<root>'}",
                                       expected="no batch norm with mixed_precision", got=str(node.target),
                                       fix="mixed_precision=None, or use LayerNorm/GroupNorm")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
