"""Checkpoints that survive re-planning: :func:`save` and :func:`load`.

A checkpoint holds the *whole* model and optimizer state keyed by the original model's
names (``model/<param>``, ``optim/<param>/<state>``), written with
``torch.distributed.checkpoint``: every rank writes the pieces it holds, in parallel, each
piece a box of the whole tensor. Whatever a plan does to a tensor on a rank is described as
boxes of the whole:

- tensor axis ``Shard(d)``: one box, offset ``rank * ceil(D / n)`` along ``d``;
- experts spread over ``ep``: one box per owned expert (a row of the stacked weight);
- ZeRO pieces (a flat range ``[lo, hi)`` of the tensor-axis-local value): the range cut
  into at most ``2 * ndim - 1`` boxes that are each contiguous in memory.

Replicas write the same box and ``torch.distributed.checkpoint`` keeps one; the planner
checks that the boxes tile every tensor exactly. Loading asks, per rank, for the boxes the
*new* plan holds, so a checkpoint written under dp x ZeRO-3 loads under tp, pp, ep or a
single process with no process group, and the other way round.

Layout of ``path``: one directory per save (``step-<n>`` or ``ckpt-<time>``, each with a
``MANIFEST.json`` of its files' sizes and sha256s) and a file ``LATEST`` naming the newest
complete one, replaced atomically only after every rank has finished writing, and never
moved back to a lower step. A save that dies part-way leaves ``LATEST`` pointing at the
previous one. :mod:`autopar.ckpt_integrity` keeps reading safe (no code runs, every file
checked) and saves serialised (one lock per ``path``).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar import ckpt_integrity as integrity, ckpt_modes
from autopar.ckpt_integrity import latest
from autopar.errors import AutoparInternalError, CheckpointError

__all__ = ["save", "load", "latest"]

FORMAT = 1


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


def _whole(shape: tuple[int, ...]) -> Layout:
    shape = tuple(shape)
    return Layout(shape, shape, [((0,) * len(shape), shape, (0,) * len(shape))])


# -- what each kind of parallel module holds ---------------------------------------------------
def _kind(model: nn.Module) -> str:
    from autopar.runtime.pp import PipelineModule
    from autopar.runtime.tp_module import ParallelModule
    if isinstance(model, PipelineModule):
        return "pp"
    if isinstance(model, ParallelModule):
        return "parallel"
    return "plain"


def _aliases(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the name its state is saved under (the first of tied names)."""
    if hasattr(model, "param_aliases"):
        return dict(model.param_aliases)
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    if hasattr(model, "global_shapes"):
        return dict(model.global_shapes)
    return {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def _tp_coord(model: nn.Module) -> tuple[int, int]:
    """(rank, size) on the tensor axis."""
    if _kind(model) == "parallel":
        return model._rank, model._n
    plan = getattr(model, "plan", None)
    if plan is None or plan.tp_axis is None or not dist.is_initialized():
        return 0, 1
    names, sizes = list(plan.mesh), list(plan.mesh.values())
    coord, r = {}, dist.get_rank()
    for name, n in zip(reversed(names), reversed(sizes)):   # row-major, as init_device_mesh lays ranks out
        coord[name], r = r % n, r // n
    return coord[plan.tp_axis], plan.mesh[plan.tp_axis]


def _base_layout(model: nn.Module, fqn: str, shape: tuple[int, ...], local_shape: tuple[int, ...]) -> Layout:
    """The layout of ``fqn``'s tensor-axis-local value (before any ZeRO flattening)."""
    from autopar.passes.meta import graph_info
    from autopar.placement import Shard, parse
    kind = _kind(model)
    experts = getattr(model, "expert_params", ())
    if getattr(model, "expert_storage", {}).get(fqn) == "whole":
        return _whole(shape)            # a whole expert module this rank owns (a ModuleList member)
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
    rank, n = _tp_coord(model)
    if isinstance(placement, Shard) and n > 1:
        d = placement.dim % len(shape)
        offset = [0] * len(shape)
        offset[d] = rank * math.ceil(shape[d] / n)
        return Layout(shape, local_shape, [((0,) * len(shape), local_shape, tuple(offset))])
    if local_shape != shape:
        raise AutoparInternalError(f"{fqn}: local shape {local_shape} differs from {shape} with no sharding")
    return _whole(shape)


def _runtimes(model: nn.Module) -> list:
    """The data-axis runtimes of a parallel module (several with experts in a pipeline)."""
    from autopar.runtime.optim import data_runtimes
    return data_runtimes(model) if _kind(model) != "plain" else []


def _model_entries(model: nn.Module) -> list[tuple[str, Layout, torch.Tensor]]:
    """(whole-state key, layout, local tensor) of every parameter and persistent buffer."""
    shapes, aliases = _shapes(model), _aliases(model)
    rt_of = {f: rt for rt in _runtimes(model) for f in rt.where}
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
            lay = _base_layout(model, name, shape, local)
            from autopar.runtime.dp import shard_range
            lay = lay.with_flat(*shard_range(math.prod(local), rt.n, rt.rank))
        else:
            lay = _base_layout(model, name, shape, tuple(t.shape))
        out.append((key, lay, t))
    return out


def _optimizer_entries(model: nn.Module, opt: Any) -> tuple[torch.optim.Optimizer, list[tuple[str, Layout, torch.Tensor]]]:
    """The torch optimizer that holds the state, and (key, layout, stepped tensor) per parameter."""
    from autopar.runtime.dp import shard_range
    from autopar.runtime.optim import ShardedOptimizer
    aliases, shapes = _aliases(model), _shapes(model)
    layouts = {key: lay for key, lay, _ in _model_entries(model)}
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
                lay = _base_layout(model, fqn, tuple(shapes[key]), local)
                lay = lay.with_flat(*shard_range(math.prod(local), rt.n, rt.rank))
            else:
                lay = _base_layout(model, fqn, tuple(shapes[key]), tuple(m.shape))
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


def _masters(model: nn.Module, opt: Any, entries: list) -> list:
    """Under mixed precision the fp32 masters in the optimizer are the parameters' true
    values: checkpoint those (the compute-dtype copies are derived from them)."""
    from autopar.runtime.optim import ShardedOptimizer
    if not (isinstance(opt, ShardedOptimizer) and opt.mixed):
        return entries
    aliases = _aliases(model)
    _, stepped = _optimizer_entries(model, opt)
    masters = {key: (lay, m) for key, lay, m in stepped}
    frozen = {aliases.get(f, f) for f, p in model.named_parameters() if not p.requires_grad}
    out = []
    for key, lay, t in entries:
        if key in masters and key not in frozen:
            lay, t = masters[key]
        out.append((key, lay, t))
    return out


def _groups_of(inner: torch.optim.Optimizer, entries) -> list[dict]:
    key_of = {id(t): key for key, _, t in entries}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [key_of[id(p)] for p in g["params"]]}
            for g in inner.param_groups]


# -- save ------------------------------------------------------------------------------------
def save(model: nn.Module, optimizer: Any, path: str | os.PathLike, *, step: int | None = None,
         extra: dict | None = None) -> Path:
    """Write ``model``'s and ``optimizer``'s whole state under ``path`` (every rank calls it).

    Returns the new checkpoint directory; ``path/LATEST`` names it once every rank is done,
    unless ``LATEST`` already names a higher step: ``LATEST`` only moves forward, so a lower
    step is written, with a warning, and loads by passing its directory. ``extra`` (e.g. a
    data-loader position) must be JSON-serialisable; :func:`load` returns it as JSON reads it
    back (tuples as lists, keys as strings). Beside the shards goes ``MANIFEST.json``, their
    sizes and sha256s, checked by :func:`load`. One save per ``path`` at a time: a second,
    concurrent one raises :class:`CheckpointError` naming the owner of ``path/.autopar-save.lock``."""
    root, distributed = Path(path), dist.is_initialized()
    extra_json = integrity.collectively(lambda: integrity.extra_to_json(extra), distributed)
    name = f"step-{step:08d}" if step is not None else f"ckpt-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    if distributed:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    target = root / name
    with integrity.save_lock(root, distributed, lambda: integrity.prepare(root, target)):
        tensors, items, objects = _write_items(model, optimizer)
        objects["autopar/meta"] = {"format": FORMAT, "step": step, "extra_json": extra_json,
                                   "shapes": {k: list(v) for k, v in _shapes(model).items()},
                                   "plan": getattr(getattr(model, "plan", None), "mesh", None),
                                   "world": dist.get_world_size() if distributed else 1}
        integrity.write(root, target, tensors, items, objects, distributed)
    return target


def _write_items(model: nn.Module, optimizer: Any) -> tuple[dict, list, dict[str, Any]]:
    """The pieces of tensors this rank writes, their write items, and the objects beside them."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    items: list[WriteItem] = []
    objects: dict[str, Any] = {}
    mode = ckpt_modes.mode_state(model)     # a data-axis mode: one replica per data-axis rank

    def add(key: str, lay: Layout, t: torch.Tensor) -> None:
        if key.startswith(("model/", "optim/")):
            lay, t = ckpt_modes.replica(mode, lay, t)
        t = t.detach()
        for offsets, sizes, view in lay.pieces(t):
            if (key, offsets) in tensors:
                continue
            tensors[(key, offsets)] = view
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                            properties=TensorProperties.create_from_tensor(view),
                                            size=torch.Size(lay.shape))))

    for key, lay, t in _masters(model, optimizer, _model_entries(model)):
        add(f"model/{key}", lay, t)
    if optimizer is not None:
        inner, entries = _optimizer_entries(model, optimizer)
        for key, lay, m in entries:
            for state_name, v in inner.state.get(m, {}).items():
                skey = f"optim/{key}/{state_name}"
                if isinstance(v, torch.Tensor):
                    add(skey, lay if v.dim() > 0 else _whole(()), v)
                else:
                    objects[skey] = v
        objects["optim/param_groups"] = _groups_of(inner, entries)
    ckpt_modes.save_items(mode, add, objects)
    return tensors, items, objects


# -- load ------------------------------------------------------------------------------------
def load(model: nn.Module, optimizer: Any, path: str | os.PathLike) -> dict:
    """Read the newest checkpoint under ``path`` into ``model`` and ``optimizer`` (every rank
    calls it, with the model and optimizer of its current plan, whatever plan saved it).
    Returns ``{"step": ..., "extra": ..., "path": ...}``, step and extra as given to :func:`save`.

    Nothing read runs code: ``.metadata`` is unpickled against an allow-list of plain data
    and stored objects with ``weights_only=True``. Every file is first checked against the
    directory's ``MANIFEST.json`` (size and sha256; the ranks split the files between them);
    a checkpoint without one (older autopar) loads unverified, with a warning. Anything
    wrong raises the same :class:`CheckpointError` on every rank, naming the file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    distributed = dist.is_initialized()
    target = integrity.collectively(lambda: integrity.latest(path), distributed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    manifest = integrity.collectively(lambda: integrity.verify(target, rank, world), distributed)
    reader = integrity.SafeReader(target, manifest)
    md = integrity.collectively(lambda: reader.read_metadata().state_dict_metadata, distributed)

    dests: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}
    wanted: dict[str, Layout] = {}
    problems: list[str] = []
    after: list[Any] = []

    mode = ckpt_modes.mode_state(model)

    def want(key: str, lay: Layout, t: torch.Tensor) -> None:
        saved = md.get(key)
        if not isinstance(saved, TensorStorageMetadata):
            problems.append(f"{key} is missing")
            return
        replicas = len(saved.size) == len(lay.shape) + 1 and tuple(saved.size)[1:] == tuple(lay.shape)
        if replicas and mode is not None and key.startswith(("model/", "optim/")):
            lay, t = ckpt_modes.replica(mode, lay, t)      # this data-axis rank's own copy
        elif replicas:
            problems.append(f"{key} holds {saved.size[0]} data-axis replicas (saved under a dp_mode other than "
                            "all-reduce): load it under that dp_mode and data axis")
            return
        if tuple(saved.size) != tuple(lay.shape):
            problems.append(f"{key} is {list(saved.size)} there, {list(lay.shape)} here")
            return
        wanted[key] = lay
        for offsets, _, view in lay.pieces(t):
            dests.setdefault((key, offsets), []).append(view)

    with torch.no_grad():
        for key, lay, t in _masters(model, optimizer, _model_entries(model)):
            if f"model/{key}" not in md and _is_buffer(model, key):
                continue    # a buffer the saving model did not persist: keep this one's
            want(f"model/{key}", lay, t.data)
        objects_wanted = ["autopar/meta"]
        if optimizer is not None:
            inner, entries = _optimizer_entries(model, optimizer)
            for key, lay, m in entries:
                prefix = f"optim/{key}/"
                names = [k[len(prefix):] for k in md if k.startswith(prefix)]
                inner.state.pop(m, None)
                if not names:
                    continue
                state: dict[str, Any] = {}
                for sname in names:
                    saved = md[prefix + sname]
                    if isinstance(saved, TensorStorageMetadata):
                        dtype = saved.properties.dtype
                        if len(saved.size) == 0:
                            state[sname] = torch.zeros((), dtype=dtype)
                            want(prefix + sname, _whole(()), state[sname])
                        else:
                            state[sname] = torch.zeros(m.shape, dtype=dtype, device=m.device)
                            want(prefix + sname, lay, state[sname])
                    else:
                        objects_wanted.append(prefix + sname)
                        after.append((state, sname, prefix + sname))
                inner.state[m] = state
            objects_wanted.append("optim/param_groups")
        restore_mode = ckpt_modes.load_plan(mode, md, want, objects_wanted, problems)
        for key in objects_wanted:
            if key not in md:
                problems.append(f"{key} is missing")
        _agree(problems, target, distributed)
        objects = integrity.read(reader, target, md, dests, objects_wanted, distributed)
        restore_mode(objects)
        for state, sname, key in after:
            state[sname] = objects[key]
        if optimizer is not None:
            _restore_groups(inner, objects["optim/param_groups"])
            _masters_to_params(optimizer)
    meta = objects["autopar/meta"]
    try:
        extra = json.loads(meta["extra_json"]) if "extra_json" in meta else meta.get("extra")   # older: "extra"
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"autopar/meta in {target} is unreadable", where="autopar.load", got=str(e),
                              fix="restore the checkpoint from a copy, or load an older one") from None
    return {"step": meta.get("step"), "extra": extra, "path": target}


def _is_buffer(model: nn.Module, key: str) -> bool:
    return key in dict(model.named_buffers(remove_duplicate=False))


def _agree(problems: list[str], target: Path, distributed: bool) -> None:
    """Raise the same CheckpointError on every rank when any rank found the checkpoint unusable
    (a rank raising alone would leave the others waiting in the load's collectives)."""
    mine = problems[:5]
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        found = sorted({p for ps in everyone for p in ps})
    else:
        found = mine
    if found:
        raise CheckpointError(f"the checkpoint at {target} does not fit this model", where="autopar.load",
                              expected="the same parameter names and whole shapes",
                              got="; ".join(found[:6]) + (" ..." if len(found) > 6 else ""),
                              fix="load a checkpoint saved from this model (any plan is fine)")


def _restore_groups(inner: torch.optim.Optimizer, saved: list[dict]) -> None:
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer parameter groups, this optimizer "
                              f"{len(inner.param_groups)}", where="autopar.load",
                              fix="build the optimizer with the same parameter groups as the saved one")
    for group, old in zip(inner.param_groups, saved):
        for k, v in old.items():
            if k != "params":
                group[k] = v


def _masters_to_params(opt: Any) -> None:
    """After loading fp32 masters, refresh the compute-dtype parameters from them."""
    from autopar.runtime.optim import ShardedOptimizer
    if isinstance(opt, ShardedOptimizer) and opt.mixed:
        opt.refresh_params()            # ZeRO-1/2: every rank's pieces all-gathered; whole masters cast
