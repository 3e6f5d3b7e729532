"""Which share of the batch this rank feeds a parallel model.

Ranks on the data axes (``dp``, and ``ep``: every expert-axis rank routes its own tokens) take
different rows of the global batch; ranks on the tensor and pipeline axes of the same data
replica take the same rows (the pipeline's first stage reads the inputs, its last the
targets). Ranks on the context axis (``cp``) take the same rows and each its own tokens of them:
dim 1 (the sequence) cut into ``2 cp`` chunks, rank ``r`` holding chunks ``r`` and
``2 cp - 1 - r`` (``runtime/cp.py``). :func:`batch_share` says which share a rank owns, :func:`shard` cuts a global batch
to it, and :func:`sampler` gives a ``DataLoader`` sampler that reads only this share of a
dataset. All three read the parallel module's mesh (``pm.plan.mesh``: axes outermost first,
ranks laid out row-major as ``init_device_mesh`` lays them)::

    pm = autopar.parallelize(model, {"dp": 2, "tp": 2}, example_kwargs=autopar.data.shard(batch, mesh))
    loader = DataLoader(dataset, batch_size=8, sampler=autopar.data.sampler(dataset, pm, seed=0))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError, InputMismatchError, MeshError

DATA_AXES = ("dp", "ep")     # the axes whose ranks take different rows
CONTEXT_AXIS = "cp"          # the axis whose ranks take different tokens of each row


@dataclass(frozen=True)
class Share:
    """This rank's share of the batch: share ``index`` of ``count`` equal ones."""

    index: int
    count: int


def _mesh_of(where: Any) -> dict[str, int]:
    """The ``{axis: size}`` mesh of a parallel module, a plan or a mesh mapping."""
    plan = getattr(where, "plan", None)
    mesh = getattr(plan, "mesh", None) if plan is not None else getattr(where, "mesh", None)
    if mesh is None and isinstance(where, Mapping):
        mesh = where
    if isinstance(where, int) and not isinstance(where, bool):
        mesh = {"tp": where}
    if not isinstance(mesh, Mapping) or not all(isinstance(n, int) and n >= 1 for n in mesh.values()):
        raise InputMismatchError("cannot tell the mesh of this object", where="autopar.data",
                                 got=type(where).__name__,
                                 expected="the module autopar.parallelize returned, its plan, or a {axis: size} mesh",
                                 fix="pass the parallel module (pm) or the mesh you gave parallelize")
    return dict(mesh)


def _coordinates(mesh: dict[str, int], rank: int) -> dict[str, int]:
    coord, r = {}, rank
    for axis, n in reversed(list(mesh.items())):
        coord[axis], r = r % n, r // n
    return coord


def context_share(where: Any, rank: int | None = None) -> Share:
    """Which of the context axis's shares of each sequence ``rank`` holds (count 1 without a cp axis)."""
    mesh = _mesh_of(where)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    n = mesh.get(CONTEXT_AXIS, 1)
    return Share(_coordinates(mesh, rank).get(CONTEXT_AXIS, 0) if n > 1 else 0, n)


def batch_share(where: Any, rank: int | None = None) -> Share:
    """The share of the global batch ``rank`` (default: this process's rank) feeds ``where`` (a
    parallel module, its plan, or the mesh given to :func:`autopar.parallelize`): its
    coordinate over the data axes (dp, then ep) of the mesh, and how many shares there are."""
    mesh = _mesh_of(where)
    world = 1
    for n in mesh.values():
        world *= n
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size() != world:
            raise MeshError("the mesh does not cover the process group", where="autopar.data.batch_share",
                            expected=f"{world} ranks (mesh {mesh})", got=f"{dist.get_world_size()} ranks",
                            fix="launch as many ranks as the mesh's axes multiply to")
    if not 0 <= rank < world:
        raise MeshError("rank outside the mesh", where="autopar.data.batch_share", expected=f"0..{world - 1}",
                        got=repr(rank), fix="pass a rank of the mesh")
    coord = _coordinates(mesh, rank)
    index, count = 0, 1
    for axis in mesh:                       # row-major over the data axes, outermost first
        if axis in DATA_AXES:
            index, count = index * mesh[axis] + coord[axis], count * mesh[axis]
    return Share(index, count)


def shard(batch: Any, where: Any, rank: int | None = None) -> Any:
    """This rank's rows of a global ``batch`` (a tensor, or a tuple, list or dict of them; other
    values pass through): every tensor cut along dim 0 into :func:`batch_share`'s count of
    equal shares. A batch whose rows do not divide evenly is refused (the parallel model
    weighs uneven shares by their rows, but a data loader should hand out equal ones). With a
    ``cp`` axis, dim 1 of every tensor of two dims or more (the sequence) is then cut to this
    rank's tokens (:func:`context_share`; the length must divide into ``2 cp`` chunks)."""
    share = batch_share(where, rank)
    context = context_share(where, rank)

    def cut(t: Any, name: str) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % share.count:
            raise InputMismatchError("the batch does not split evenly over the data shares",
                                     where=f"autopar.data.shard, input {name}",
                                     expected=f"rows a multiple of {share.count} (the mesh's data shares)",
                                     got=f"{t.shape[0]} rows", fix=f"use a global batch divisible by {share.count}")
        rows = t.shape[0] // share.count
        t = t[share.index * rows:(share.index + 1) * rows]
        if context.count > 1 and t.dim() >= 2:
            from autopar.runtime.cp import shard as cp_shard
            if t.shape[1] % (2 * context.count):
                raise InputMismatchError("the sequence does not cut into the context axis's chunks",
                                         where=f"autopar.data.shard, input {name}",
                                         expected=f"dim 1 a multiple of {2 * context.count} (2 x cp)",
                                         got=f"{t.shape[1]}", fix=f"pad the sequence to a multiple of "
                                                                  f"{2 * context.count}")
            t = cp_shard(t, 1, context.count, context.index)
        return t

    if isinstance(batch, Mapping):
        return {k: cut(v, repr(k)) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(v, str(i)) for i, v in enumerate(batch))
    return cut(batch, "0")


def sampler(dataset: Any, where: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
            rank: int | None = None) -> torch.utils.data.DistributedSampler:
    """A ``DistributedSampler`` over ``dataset`` that yields only this rank's share of each
    epoch: ranks of one data replica (tensor and pipeline ranks) read the same samples, the
    replicas disjoint ones. Call ``.set_epoch(epoch)`` each epoch to reshuffle."""
    share = batch_share(where, rank)
    if len(dataset) < share.count:
        raise ConfigError("the dataset has fewer samples than data shares", where="autopar.data.sampler",
                          expected=f"at least {share.count} samples", got=f"{len(dataset)}",
                          fix="use a larger dataset or fewer data-parallel ranks")
    return torch.utils.data.DistributedSampler(dataset, num_replicas=share.count, rank=share.index,
                                               shuffle=shuffle, seed=seed, drop_last=drop_last)
