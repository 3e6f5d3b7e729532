"""fp32 gradient accumulators of a mixed-precision pipeline (Megatron-LM's ``main_grad``).

Under mixed precision a pipeline stage computes with 16-bit parameters, so autograd leaves
each micro-batch's gradient in 16 bits. Summing the micro-batches there would round every
partial sum to 8 (bf16) or 11 (fp16) bits of mantissa; instead, after every backward
computation of a stage (the schedule's full, input or weight backward,
:class:`autopar.runtime.pp.PipelineModule`), :meth:`MainGrads.collect` adds the 16-bit
gradients, scaled by 1/micro-batches as the mean micro-batch loss asks, into one fp32 tensor
per parameter and drops the 16-bit ones, so at most one micro-batch's 16-bit gradient exists
at a time. The data axis reduces these fp32 sums (:mod:`autopar.runtime.stage_dp`) and the
optimizer steps the fp32 master weights with them (:mod:`autopar.runtime.optim`).

An accumulator lives from the step's first backward until ``zero_grad``, or under ZeRO-2/3
until the step's reduce-scatter has handed on this rank's piece of it.
"""
from __future__ import annotations

from typing import Iterable

import torch


class MainGrads:
    """One fp32 accumulator per trainable parameter of this rank's stages, by ``state_dict`` key.
    ``scale`` multiplies every micro-batch's gradient as it arrives (1/micro-batches)."""

    def __init__(self, scale: float, dtype: torch.dtype = torch.float32) -> None:
        self.scale, self.dtype = scale, dtype
        self.grads: dict[str, torch.Tensor] = {}
        self._divisor: dict[str, int] = {}

    def divide(self, fqns: Iterable[str], n: int) -> None:
        """Also divide the gradients of ``fqns`` by ``n`` as they arrive, in fp32 (experts with no
        data axis: their owner received ``n`` ranks' rows, :func:`autopar.runtime.ep.average_over_senders`)."""
        for fqn in fqns:
            self._divisor[fqn] = n

    @torch.no_grad()
    def collect(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Move the 16-bit gradients autograd left on ``named`` parameters into the accumulators."""
        for fqn, p in named:
            g = p.grad
            if g is None:
                continue
            p.grad = None
            have, scale = self.grads.get(fqn), self.scale / self._divisor.get(fqn, 1)
            if have is None:
                self.grads[fqn] = g.to(self.dtype, copy=True).mul_(scale)
            else:
                have.add_(g, alpha=scale)      # in fp32: the 16-bit gradient is widened first

    def get(self, fqn: str) -> torch.Tensor | None:
        return self.grads.get(fqn)

    def set(self, fqn: str, g: torch.Tensor) -> None:
        self.grads[fqn] = g

    def pop(self, fqn: str) -> torch.Tensor | None:
        return self.grads.pop(fqn, None)

    def clear(self) -> None:
        self.grads.clear()


__all__ = ["MainGrads"]
