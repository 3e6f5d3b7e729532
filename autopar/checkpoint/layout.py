"""Where a rank's tensors sit in the whole model: each stepped or saved tensor described as
boxes of the whole tensor (:class:`Layout`), under any plan. The checkpoint
(:mod:`autopar.checkpoint.state`) writes and reads these boxes; gradient clipping
(:mod:`autopar.clip`) counts each box once across ranks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import AutoparInternalError, CheckpointError


# -- boxes -----------------------------------------------------------------------------------
def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[lo, hi)`` of a C-contiguous tensor of ``shape`` as boxes
    ``(offsets, sizes)``, each contiguous in memory, in order."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    row = lambda r, a, b: [((r, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a, b)]  # noqa: E731
    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


@dataclass
class Layout:
    """Where a rank's local tensor sits in the whole one.

    ``segments`` are ``(local offsets, sizes, whole offsets)`` boxes of the local value
    (shape ``local_shape``); ``flat`` is ``(lo, hi)`` when the rank holds only that flat
    range of the local value, as a 1-d tensor (a ZeRO piece, possibly padded)."""

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    segments: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    flat: tuple[int, int] | None = None

    def with_flat(self, lo: int, hi: int) -> "Layout":
        return Layout(self.shape, self.local_shape, self.segments, (lo, hi))

    def pieces(self, t: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]:
        """``(whole offsets, sizes, view of t)`` for every box this rank holds."""
        if self.flat is None:
            if tuple(t.shape) != self.local_shape:
                raise AutoparInternalError(f"checkpoint layout expects {self.local_shape}, tensor is {tuple(t.shape)}")
            return [(g, s, t[tuple(slice(o, o + n) for o, n in zip(lo, s))]) for lo, s, g in self.segments
                    if all(s)]
        lo, hi = self.flat
        flat = t.reshape(-1)
        strides = [math.prod(self.local_shape[i + 1:]) for i in range(len(self.local_shape))]
        out = []
        for boff, bsz in flat_boxes(self.local_shape, lo, hi):
            for soff, ssz, goff in self.segments:
                a = [max(b, s) for b, s in zip(boff, soff)]
                e = [min(b + bn, s + sn) for b, bn, s, sn in zip(boff, bsz, soff, ssz)]
                size = tuple(y - x for x, y in zip(a, e))
                if any(n <= 0 for n in size):
                    continue
                start = sum(x * st for x, st in zip(a, strides)) - lo
                numel = math.prod(size)
                end = sum((x + n - 1) * st for x, n, st in zip(a, size, strides)) - lo + 1
                if end - start != numel:
                    raise AutoparInternalError(f"checkpoint box {a}+{size} of {self.local_shape} is not contiguous")
                out.append((tuple(g + x - s for g, x, s in zip(goff, a, soff)), size,
                            flat[start:start + numel].view(size)))
        return out


def whole(shape: tuple[int, ...]) -> Layout:
    shape = tuple(shape)
    return Layout(shape, shape, [((0,) * len(shape), shape, (0,) * len(shape))])


# -- what each kind of parallel module holds ---------------------------------------------------
def module_kind(model: nn.Module) -> str:
    from autopar.runtime.pp import PipelineModule
    from autopar.runtime.tp_module import ParallelModule
    if isinstance(model, PipelineModule):
        return "pp"
    if isinstance(model, ParallelModule):
        return "parallel"
    return "plain"


def key_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name its state is saved under (the first of tied names)."""
    if hasattr(model, "param_aliases"):
        return dict(model.param_aliases)
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def whole_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    if hasattr(model, "global_shapes"):
        return dict(model.global_shapes)
    return {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def tp_coord(model: nn.Module) -> tuple[int, int]:
    """(rank, size) on the tensor axis."""
    if module_kind(model) == "parallel":
        return model._rank, model._n
    plan = getattr(model, "plan", None)
    if plan is None or plan.tp_axis is None or not dist.is_initialized():
        return 0, 1
    names, sizes = list(plan.mesh), list(plan.mesh.values())
    coord, r = {}, dist.get_rank()
    for name, n in zip(reversed(names), reversed(sizes)):   # row-major, as init_device_mesh lays ranks out
        coord[name], r = r % n, r // n
    return coord[plan.tp_axis], plan.mesh[plan.tp_axis]


def base_layout(model: nn.Module, fqn: str, shape: tuple[int, ...], local_shape: tuple[int, ...]) -> Layout:
    """The layout of ``fqn``'s tensor-axis-local value (before any ZeRO flattening)."""
    from autopar.core.meta import graph_info
    from autopar.core.placement import Shard, parse
    kind = module_kind(model)
    experts = getattr(model, "expert_params", ())
    if getattr(model, "expert_storage", {}).get(fqn) == "whole":
        return whole(shape)            # a whole expert module this rank owns (a ModuleList member)
    if kind == "pp" and getattr(model, "expert_storage", {}).get(fqn) == "rows":
        rest = tuple(local_shape[1:])
        zeros = (0,) * len(rest)
        return Layout(shape, local_shape, [((j, *zeros), (1, *rest), (e, *zeros))
                                           for j, e in enumerate(model.expert_owned[fqn])])
    if kind == "parallel" and fqn in experts:
        for region in graph_info(model.graph_module).moe_regions:
            if fqn in region.expert_params:
                owned = model.ep_runtimes[region.fqn].owned()
                rest = tuple(local_shape[1:])
                zeros = (0,) * len(rest)
                return Layout(shape, local_shape, [((j, *zeros), (1, *rest), (e, *zeros)) for j, e in enumerate(owned)])
    placement = None
    if kind == "parallel":
        placement = model.placement_of(fqn)
    elif kind == "pp" and model.plan.params.get(fqn):
        placement = parse(model.plan.params[fqn])
    rank, n = tp_coord(model)
    if isinstance(placement, Shard) and n > 1:
        d = placement.dim % len(shape)
        offset = [0] * len(shape)
        offset[d] = rank * math.ceil(shape[d] / n)
        return Layout(shape, local_shape, [((0,) * len(shape), local_shape, tuple(offset))])
    if local_shape != shape:
        raise AutoparInternalError(f"{fqn}: local shape {local_shape} differs from {shape} with no sharding")
    return whole(shape)


def data_runtimes_of(model: nn.Module) -> list:
    """The data-axis runtimes of a parallel module (several with experts in a pipeline)."""
    from autopar.runtime.optim import data_runtimes
    return data_runtimes(model) if module_kind(model) != "plain" else []


def model_entries(model: nn.Module) -> list[tuple[str, Layout, torch.Tensor]]:
    """(whole-state key, layout, local tensor) of every parameter and persistent buffer."""
    shapes, aliases = whole_shapes(model), key_aliases(model)
    rt_of = {f: rt for rt in data_runtimes_of(model) for f in rt.where}
    out, seen = [], set()
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(n, b) for n, b in model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        key = aliases.get(name, name)
        if key in seen or key not in shapes:
            continue            # a tied copy already taken, or a buffer the model does not persist
        seen.add(key)
        shape = tuple(shapes[key])
        rt = rt_of.get(name)
        if rt is not None and rt.stage == 3:
            b, i = rt.where[name]
            local = tuple(rt.buckets[b].shapes[i])
            lay = base_layout(model, name, shape, local)
            from autopar.runtime.dp import shard_range
            lay = lay.with_flat(*shard_range(math.prod(local), rt.n, rt.rank))
        else:
            lay = base_layout(model, name, shape, tuple(t.shape))
        out.append((key, lay, t))
    return out


def optimizer_entries(model: nn.Module, opt: Any) -> tuple[torch.optim.Optimizer, list[tuple[str, Layout, torch.Tensor]]]:
    """The torch optimizer that holds the state, and (key, layout, stepped tensor) per parameter."""
    from autopar.runtime.dp import shard_range
    from autopar.runtime.optim import ShardedOptimizer
    aliases, shapes = key_aliases(model), whole_shapes(model)
    layouts = {key: lay for key, lay, _ in model_entries(model)}
    out = []
    if isinstance(opt, ShardedOptimizer):
        named = dict(model.named_parameters())
        for fqn, m in opt.masters.items():
            key = aliases.get(fqn, fqn)
            rt = opt._rt_of.get(fqn)
            if opt.stage == 3 and rt is not None:
                lay = layouts[key]
            elif opt.stage in (1, 2) and rt is not None:
                local = tuple(named[fqn].shape)
                lay = base_layout(model, fqn, tuple(shapes[key]), local)
                lay = lay.with_flat(*shard_range(math.prod(local), rt.n, rt.rank))
            else:
                lay = base_layout(model, fqn, tuple(shapes[key]), tuple(m.shape))
            out.append((key, lay, m))
        return opt.inner, out
    inner = opt
    if not isinstance(inner, torch.optim.Optimizer):
        raise CheckpointError("save/load takes the optimizer autopar.optimizer returned or a torch.optim optimizer",
                              where="autopar checkpoint", got=type(opt).__name__,
                              fix="pass the optimizer that steps this model's parameters")
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    for group in inner.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of this model",
                                      where="autopar checkpoint", got=f"tensor of shape {tuple(p.shape)}",
                                      fix="pass the model and the optimizer built over its parameters")
            key = aliases.get(name, name)
            out.append((key, layouts[key], p))
    return inner, out
