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
previous one. :mod:`autopar.checkpoint.integrity` keeps reading safe (no code runs, every file
checked) and saves serialised (one lock per ``path``).
"""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.health import peer_errors
from autopar.checkpoint import integrity, modes as ckpt_modes
from autopar.checkpoint.layout import Layout, key_aliases, model_entries, optimizer_entries, whole, whole_shapes
from autopar.checkpoint.integrity import latest
from autopar.core.errors import CheckpointError

__all__ = ["save", "load", "latest"]

FORMAT = 1


def master_entries(model: nn.Module, opt: Any, entries: list) -> list:
    """Under mixed precision the fp32 masters in the optimizer are the parameters' true
    values: checkpoint those (the compute-dtype copies are derived from them)."""
    from autopar.runtime.optim import ShardedOptimizer
    if not (isinstance(opt, ShardedOptimizer) and opt.mixed):
        return entries
    aliases = key_aliases(model)
    _, stepped = optimizer_entries(model, opt)
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
@peer_errors()
def save(model: nn.Module, optimizer: Any, path: str | os.PathLike, *, step: int | None = None,
         extra: dict | None = None, key: str | bytes | None = None, scheduler: Any = None) -> Path:
    """Write ``model``'s and ``optimizer``'s whole state under ``path`` (every rank calls it).

    Returns the new checkpoint directory; ``path/LATEST`` names it once every rank is done,
    unless ``LATEST`` already names a higher step: ``LATEST`` only moves forward, so a lower
    step is written, with a warning, and loads by passing its directory. ``extra`` (e.g. a
    data-loader position) must be JSON-serialisable; :func:`load` returns it as JSON reads it
    back (tuples as lists, keys as strings). Beside the shards goes ``MANIFEST.json``, their
    sizes and sha256s, checked by :func:`load`. One save per ``path`` at a time: a second,
    concurrent one raises :class:`CheckpointError` naming the owner of ``path/.autopar-save.lock``.
    With ``key`` (bytes, or a string), the manifest is signed: ``load(..., key=)`` then refuses
    a checkpoint whose manifest was altered, or signed with another key, or is missing.

    ``scheduler``: a torch LR scheduler (``LambdaLR``, transformers' schedules ...) whose position
    :func:`load` restores with ``scheduler=``. The number of data shares the batch is split over is
    recorded too, so a load under another layout can say that the global batch changes."""
    root, distributed = Path(path), dist.is_initialized()
    secret = integrity.signing_key(key, "autopar.save")
    extra_json = integrity.collectively(lambda: integrity.extra_to_json(extra), distributed)
    scheduler_json = None if scheduler is None else integrity.collectively(
        lambda: _scheduler_json(scheduler), distributed)
    name = f"step-{step:08d}" if step is not None else f"ckpt-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    if distributed:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    target = root / name
    with integrity.save_lock(root, distributed, lambda: integrity.prepare(root, target)):
        tensors, items, objects = _write_items(model, optimizer)
        objects["autopar/meta"] = {"format": FORMAT, "step": step, "extra_json": extra_json,
                                   "shapes": {k: list(v) for k, v in whole_shapes(model).items()},
                                   "plan": getattr(getattr(model, "plan", None), "mesh", None),
                                   "world": dist.get_world_size() if distributed else 1,
                                   "data_shares": data_shares(model), "scheduler_json": scheduler_json}
        try:
            integrity.write(root, target, tensors, items, objects, distributed, secret)
        except BaseException:
            if not distributed or dist.get_rank() == 0:
                integrity.remove_partial(root, target)
            raise
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

    for key, lay, t in master_entries(model, optimizer, model_entries(model)):
        add(f"model/{key}", lay, t)
    if optimizer is not None:
        inner, entries = optimizer_entries(model, optimizer)
        for key, lay, m in entries:
            for state_name, v in inner.state.get(m, {}).items():
                skey = f"optim/{key}/{state_name}"
                if isinstance(v, torch.Tensor):
                    add(skey, lay if v.dim() > 0 else whole(()), v)
                else:
                    objects[skey] = v
        objects["optim/param_groups"] = _groups_of(inner, entries)
    ckpt_modes.save_items(mode, add, objects)
    return tensors, items, objects


# -- load ------------------------------------------------------------------------------------
@peer_errors()
def _scheduler_json(scheduler: Any) -> str:
    if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "load_state_dict"):
        raise CheckpointError("scheduler= takes a torch LR scheduler", where="autopar.save",
                              got=type(scheduler).__name__, fix="pass the scheduler built on the autopar optimizer")
    try:
        return json.dumps(scheduler.state_dict())
    except (TypeError, ValueError) as e:
        raise CheckpointError("the scheduler's state_dict() is not plain data", where="autopar.save(scheduler=)",
                              got=str(e), fix="save its position in extra= instead") from None


def data_shares(model: nn.Module) -> int:
    """How many shares the global batch is split over under ``model``'s plan (1 for a plain module)."""
    from autopar.data import batch_share
    try:
        return batch_share(model, 0).count
    except Exception:   # noqa: BLE001 - a plain module or a plan without a mesh: one share
        return 1


def _changes(model: nn.Module, meta: dict, scheduler: Any, target: Path) -> list[str]:
    """What a resume under this layout changes of the saved run, in words (said loudly by :func:`load`)."""
    said = []
    saved, now = meta.get("data_shares"), data_shares(model)
    if isinstance(saved, int) and saved != now:
        said.append(f"the batch was split over {saved} data share(s) when {target.name} was saved and is over {now} "
                    f"now: with the same rows per share the global batch is {now / saved:g}x the saved one (and "
                    f"the rows each step reads change); give each share {saved / now:g}x the rows it had to keep "
                    f"the run as it was")
    if scheduler is not None and not meta.get("scheduler_json"):
        said.append(f"{target.name} holds no LR scheduler state (saved without scheduler=): the schedule starts "
                    "again from its beginning; the learning rates in the optimizer's groups are the saved ones until "
                    "its first step")
    return said


def load(model: nn.Module, optimizer: Any, path: str | os.PathLike, *, key: str | bytes | None = None,
         scheduler: Any = None) -> dict:
    """Read the newest checkpoint under ``path`` into ``model`` and ``optimizer`` (every rank
    calls it, with the model and optimizer of its current plan, whatever plan saved it).
    Returns ``{"step": ..., "extra": ..., "path": ...}``, step and extra as given to :func:`save`.

    Nothing read runs code: ``.metadata`` is unpickled against an allow-list of plain data
    and stored objects with ``weights_only=True``. Every file is first checked against the
    directory's ``MANIFEST.json`` (size and sha256; the ranks split the files between them);
    a checkpoint without one (older autopar) loads unverified, with a warning. Anything
    wrong raises the same :class:`CheckpointError` on every rank, naming the file.

    ``scheduler``: the run's LR scheduler, put back where it was (``save(..., scheduler=)``).
    What this layout changes of the saved run (the global batch, when the data shares differ;
    a schedule the checkpoint does not hold) is said in a warning on rank 0 and listed under
    ``"changed"`` in the returned dict.

    Two other kinds of directory load weights only (the optimizer's state is left as it is):
    one ``transformers`` wrote (``config.json`` and safetensors; :mod:`autopar.checkpoint.pretrained`)
    and a plain ``torch.distributed.checkpoint`` save of a model's ``state_dict()`` (keys the
    model's own names, or under ``model.`` when the save was ``{"model": model.state_dict()}``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from autopar.checkpoint.pretrained import is_pretrained_dir, load_pretrained
    if is_pretrained_dir(path):
        if key is not None:
            raise CheckpointError(f"{path} is a transformers directory: it has no manifest a key could vouch for",
                                  where="autopar.load", fix="load it without key= only if you trust where it "
                                                            "came from")
        return load_pretrained(model, optimizer, Path(path))
    distributed = dist.is_initialized()
    target = integrity.collectively(lambda: integrity.latest(path), distributed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    secret = integrity.signing_key(key, "autopar.load")
    manifest = integrity.collectively(lambda: integrity.verify(target, rank, world, secret), distributed)
    reader = integrity.SafeReader(target, manifest)
    md = integrity.collectively(lambda: reader.read_metadata().state_dict_metadata, distributed)

    dests: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}
    wanted: dict[str, Layout] = {}
    problems: list[str] = []
    after: list[Any] = []

    mode = ckpt_modes.mode_state(model)
    plain = _plain_prefix(model, md)     # None for autopar's own checkpoints

    def want(key: str, lay: Layout, t: torch.Tensor) -> None:
        if plain is not None:
            key = plain + key[len("model/"):]
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
        for key, lay, t in master_entries(model, optimizer, model_entries(model)):
            if ("model/" if plain is None else plain) + key not in md and is_buffer(model, key):
                continue    # a buffer the saving model did not persist: keep this one's
            want(f"model/{key}", lay, t.data)
        objects_wanted = ["autopar/meta"] if plain is None else []
        if plain is not None and mode is not None:
            problems.append("a plain torch.distributed.checkpoint save holds no state of the data-axis mode "
                            f"{mode.mode.kind!r}: load it without a dp_mode, then save with autopar.save")
        if optimizer is not None and plain is None:
            inner, entries = optimizer_entries(model, optimizer)
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
                            want(prefix + sname, whole(()), state[sname])
                        else:
                            state[sname] = torch.zeros(m.shape, dtype=dtype, device=m.device)
                            want(prefix + sname, lay, state[sname])
                    else:
                        objects_wanted.append(prefix + sname)
                        after.append((state, sname, prefix + sname))
                inner.state[m] = state
            objects_wanted.append("optim/param_groups")
        restore_mode = ckpt_modes.load_plan(mode if plain is None else None, md, want, objects_wanted, problems)
        for key in objects_wanted:
            if key not in md:
                problems.append(f"{key} is missing")
        _agree(problems, target, distributed)
        objects = integrity.read(reader, target, md, dests, objects_wanted, distributed)
        restore_mode(objects)
        for state, sname, key in after:
            state[sname] = objects[key]
        if optimizer is not None and plain is None:
            _restore_groups(inner, objects["optim/param_groups"])
        masters_to_params(optimizer)
    if plain is not None:
        return {"step": None, "extra": None, "path": target}
    meta = objects["autopar/meta"]
    try:
        extra = json.loads(meta["extra_json"]) if "extra_json" in meta else meta.get("extra")   # older: "extra"
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"autopar/meta in {target} is unreadable", where="autopar.load", got=str(e),
                              fix="restore the checkpoint from a copy, or load an older one") from None
    if scheduler is not None and meta.get("scheduler_json"):
        try:
            scheduler.load_state_dict(json.loads(meta["scheduler_json"]))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError("the saved scheduler state does not fit this scheduler", where="autopar.load",
                                  got=str(e)[:200], fix="pass a scheduler of the kind saved") from None
    changed = _changes(model, meta, scheduler, target)
    if changed and (not distributed or dist.get_rank() == 0):
        warnings.warn("resuming changes the run: " + "; ".join(changed), stacklevel=3)
    return {"step": meta.get("step"), "extra": extra, "path": target, "changed": changed}


def _plain_prefix(model: nn.Module, md: dict) -> str | None:
    """For a checkpoint autopar did not write (no ``autopar/meta``, no ``model/`` keys): the
    prefix its keys carry the model's names under (``""`` or ``"model."``, whichever finds more
    of them). None for autopar's own."""
    if "autopar/meta" in md or any(k.startswith("model/") for k in md):
        return None
    keys = [key for key, _, _ in model_entries(model)]
    return max(("", "model."), key=lambda p: sum(p + k in md for k in keys))


def is_buffer(model: nn.Module, key: str) -> bool:
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
    if not isinstance(saved, list) or not all(isinstance(g, dict) and all(isinstance(k, str) for k in g)
                                              for g in saved):
        raise CheckpointError("the checkpoint's optimizer parameter groups are not a list of settings",
                              where="autopar.load (optim/param_groups)", got=type(saved).__name__,
                              fix="restore the checkpoint from a copy, or load an older one")
    for i, (group, old) in enumerate(zip(inner.param_groups, saved)):
        for k, v in old.items():
            if k != "params" and (k not in group or not _same_kind(group[k], v)):
                raise CheckpointError(f"parameter group {i}'s setting {k!r} in the checkpoint does not fit this "
                                      "optimizer", where="autopar.load (optim/param_groups)",
                                      expected=f"{type(group[k]).__name__} like {group[k]!r}" if k in group
                                      else f"one of {sorted(x for x in group if x != 'params')}",
                                      got=repr(v)[:80], fix="load it into the same optimizer class the run was "
                                                            "saved with, or restore the checkpoint from a copy")
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer parameter groups, this optimizer "
                              f"{len(inner.param_groups)}", where="autopar.load",
                              fix="build the optimizer with the same parameter groups as the saved one")
    for group, old in zip(inner.param_groups, saved):
        for k, v in old.items():
            if k != "params":
                group[k] = v


def _same_kind(now: Any, saved: Any) -> bool:
    """Whether a saved group setting can take the place of the live one: numbers for numbers,
    flags for flags, equal-length sequences of numbers, strings for strings; None for None."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) or \
            isinstance(x, torch.Tensor) and x.numel() == 1
    if now is None:
        return saved is None or isinstance(saved, bool) or number(saved)
    if isinstance(now, bool):
        return saved is None or isinstance(saved, bool)
    if number(now):
        return number(saved)
    if isinstance(now, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(now) and all(number(x) for x in saved)
    if isinstance(now, str):
        return isinstance(saved, str)
    return type(saved) is type(now)


def masters_to_params(opt: Any) -> None:
    """After loading fp32 masters, refresh the compute-dtype parameters from them."""
    from autopar.runtime.optim import ShardedOptimizer
    if isinstance(opt, ShardedOptimizer) and opt.mixed:
        opt.refresh_params()            # ZeRO-1/2: every rank's pieces all-gathered; whole masters cast
