"""The data axis of a pipeline rank's stages: gradient averaging and ZeRO 1-3 over whole steps.

A pipeline step runs every micro-batch through this rank's stages before any parameter
changes, so the data axis works per step, not per micro-batch:

- each stage's gradients form one bucket (a parameter held by stages on several pipeline
  ranks, a tied embedding and head, goes in a last bucket of its own: its copies' gradients
  are summed over the pipeline axis first);
- a stage's bucket is issued the moment the schedule finishes that stage's last micro-batch
  backward (torch's ``REDUCE_GRAD`` action, :class:`autopar.runtime.pp.PipelineModule`), so it
  travels while the other stages still compute; the step waits for all of them at its end;
- ZeRO-0 all-reduces the bucket (the mean over the data axis lands in ``param.grad``);
  ZeRO-1 leaves the whole gradients to the optimizer, which reduce-scatters them at
  ``step()`` (:mod:`autopar.runtime.optim`); ZeRO-2 and ZeRO-3 reduce-scatter the bucket, so
  after the step a rank keeps only its piece of each gradient;
- ZeRO-3 stores each parameter as this rank's flat piece between steps. The step gathers
  every bucket once, before the first micro-batch, and the stages compute with the whole
  parameters until the step ends, when they are dropped again: the gathers are not repeated
  per micro-batch (the cost model assumes the same: one gather and one reduce-scatter per step,
  whole parameters and gradients of this rank's stages held while the step runs).

Gradients accumulate over micro-batches into whole tensors, under every stage, as the
schedule's autograd calls leave them; what ZeRO saves inside a pipeline is the optimizer
state (1-3) and, between steps, gradients (2-3) and parameters (3).

Under mixed precision (``compute_dtype`` 16-bit, the masters fp32) the stages hold 16-bit
parameters, the whole gradients are the pipeline's fp32 accumulators
(:class:`~autopar.runtime.main_grads.MainGrads`), every reduction travels in fp32, ZeRO-3's
pieces are the fp32 masters themselves and its step gathers them in the 16-bit dtype.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from autopar.runtime.collectives import all_gather_start, all_gather_wait, c10d
from autopar.runtime.dp import Bucket, DPRuntime, shard_range
from autopar.runtime.main_grads import MainGrads


class StageDataAxis:
    """The data axis of this rank's stages (module docstring). ``stages`` are
    ``(stage index, {state_dict key: the Parameter the stage computes with})``; ``shared``
    names the parameters several pipeline ranks hold; ``divisor`` how many ranks' rows a summed
    gradient covers (default ``n``; see :class:`~autopar.runtime.dp.DPRuntime`). Under mixed
    precision ``compute_dtype`` is the 16-bit dtype and ``grads`` the fp32 accumulators the
    whole gradients live in; the parameters are still in the master dtype when this is built
    (ZeRO-3 cuts its fp32 pieces from them) and are cast after."""

    def __init__(self, stages: Iterable[tuple[int, dict[str, nn.Parameter]]], *, zero_stage: int, n: int, rank: int,
                 group_name: str, device: torch.device, shared: Iterable[str] = (),
                 divisor: int | None = None, compute_dtype: torch.dtype | None = None,
                 grads: MainGrads | None = None) -> None:
        stages = list(stages)
        master = next((p.dtype for _, ps in stages for p in ps.values() if p.dtype.is_floating_point), torch.float32)
        self.rt = DPRuntime(stage=zero_stage, n=n, rank=rank, group_name=group_name, device=device,
                            master_dtype=master, compute_dtype=compute_dtype, divisor=divisor)
        self.main = grads
        self.zero_stage = zero_stage
        self.params: dict[str, nn.Parameter] = {}
        self.pieces: dict[str, nn.Parameter] = {}          # ZeRO-3: what the module registers and steps
        self._bucket_of: dict[int, Bucket] = {}             # stage index -> its bucket
        self._shared_bucket: Bucket | None = None
        self._pending: list[tuple[Bucket, torch.Tensor]] = []
        shared = set(shared)
        late: list[str] = []
        for index, named in stages:
            mine = []
            for fqn, p in named.items():
                if fqn in self.params or not (p.requires_grad or zero_stage == 3):
                    continue
                self.params[fqn] = p
                (late if fqn in shared else mine).append(fqn)
            if mine:
                self._bucket_of[index] = self._add(mine)
        if late:
            self._shared_bucket = self._add(late)
        if zero_stage == 3:
            for fqn, p in self.params.items():
                piece = nn.Parameter(_piece(p.detach(), n, rank), requires_grad=p.requires_grad)
                self.pieces[fqn] = piece
                self.rt.shard_params[fqn] = piece
                p.data = p.data.new_empty(0)            # whole only while a step runs

    def _add(self, fqns: list[str]) -> Bucket:
        return self.rt.add_bucket(fqns, [tuple(self.params[f].shape) for f in fqns],
                                  [self.params[f].requires_grad for f in fqns])

    @property
    def buckets(self) -> list[Bucket]:
        return self.rt.buckets

    # -- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """ZeRO-3: gather every bucket's whole parameters (all issued, then all awaited)."""
        if self.zero_stage != 3:
            return
        handles = [(b, b.issue_gather(self.rt.shards_of(b))) for b in self.buckets]
        for b, h in handles:
            for fqn, full in zip(b.fqns, b.finish_gather(h)):
                self.params[fqn].data = full.to(self.params[fqn].dtype)

    def stage_done(self, index: int) -> None:
        """The schedule finished stage ``index``'s last backward: send its bucket."""
        b = self._bucket_of.get(index)
        if b is not None:
            self._issue(b)

    def end_step(self) -> None:
        """After the pipeline-axis sums: send the shared bucket, wait for every bucket and
        leave each gradient where this ZeRO stage keeps it."""
        if self._shared_bucket is not None:
            self._issue(self._shared_bucket)
        pending, self._pending = self._pending, []
        for b, handle in pending:
            got = c10d.wait_tensor(handle)
            self._land(b, got)
        if self.zero_stage == 3:
            for fqn, p in self.params.items():
                self._drop_grad(fqn)
                p.data = p.data.new_empty(0)

    def grad(self, fqn: str) -> torch.Tensor | None:
        """The whole gradient of ``fqn`` this step accumulated (fp32 under mixed precision)."""
        return self.main.get(fqn) if self.main is not None else self.params[fqn].grad

    def _drop_grad(self, fqn: str) -> None:
        if self.main is not None:
            self.main.pop(fqn)
        else:
            self.params[fqn].grad = None

    def _issue(self, b: Bucket) -> None:
        rt = self.rt
        grads = [self.grad(f) for f in b.fqns]
        if self.zero_stage == 1 or all(g is None for g in grads):
            return
        if rt.modes is not None and rt.modes.local_step():    # local SGD: the optimizer averages parameters
            return
        if self.zero_stage == 0:
            flat = torch.cat([(g if g is not None else torch.zeros(s, dtype=rt.reduce_dtype, device=rt.device))
                              .reshape(-1).to(rt.reduce_dtype) for s, g in zip(b.shapes, grads)]).div_(rt.divisor)
            self._pending.append((b, c10d.all_reduce_(flat, "sum", rt.group_name)))
            return
        rows = b.to_rows(grads, rt.reduce_dtype).div_(rt.divisor)
        self._pending.append((b, c10d.reduce_scatter_tensor(rows.view(-1), "sum", rt.n, rt.group_name)))

    def _land(self, b: Bucket, got: torch.Tensor) -> None:
        if self.zero_stage == 0:
            for i, fqn in enumerate(b.fqns):
                g = self.grad(fqn)
                if g is not None:
                    g.copy_(got[b.flat_offsets[i]:b.flat_offsets[i + 1]].view_as(g))
            return
        for fqn, piece, ok in zip(b.fqns, b.row_pieces(got), b.trainable):
            if not ok or self.grad(fqn) is None:
                continue
            self._drop_grad(fqn)                           # the whole gradient is not kept
            if self.zero_stage == 2:
                self.rt.accumulate(fqn, piece)
            else:
                mine = self.pieces[fqn]
                mine.grad = piece.to(mine.dtype).clone() if mine.grad is None else mine.grad.add_(piece)

    # -- ZeRO-3 pieces and whole values (state_dict) -------------------------------------------
    def whole_local(self, fqn: str, piece: torch.Tensor) -> torch.Tensor:
        """The tensor-axis-local whole value of a ZeRO-3 piece (a collective on the data axis)."""
        rt = self.rt
        b, i = rt.where[fqn]
        bucket = rt.buckets[b]
        got = all_gather_wait(all_gather_start(piece.detach().contiguous(), rt.n, rt.group_name))
        return got.view(-1)[:bucket.numels[i]].view(bucket.shapes[i]).clone()

    def piece_of(self, whole: torch.Tensor) -> torch.Tensor:
        return _piece(whole.detach(), self.rt.n, self.rt.rank)


def _piece(whole: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat, zero-padded ``ceil(numel / n)`` elements of ``whole``."""
    flat = whole.reshape(-1)
    lo, hi = shard_range(flat.numel(), n, rank)
    out = flat.new_zeros(math.ceil(flat.numel() / n))
    out[:hi - lo] = flat[lo:hi]
    return out


__all__ = ["StageDataAxis"]
