"""torch's ``PipelineStage`` as autopar's pipelines run it (:mod:`autopar.runtime.pp`): it tells
the data axis when a stage's last micro-batch backward ran, tells the pipeline after every
backward computation under mixed precision, and keeps the zero-bubble schedules exact where
torch's split backward (input gradients first, weight gradients later) would not be.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.pipelining import PipelineStage


class PipeStage(PipelineStage):
    """torch's pipeline stage, telling the data axis when the schedule has run this stage's
    last micro-batch backward (its ``REDUCE_GRAD`` action, after the gradient scaling), and,
    under mixed precision, the pipeline after every backward computation (full, input or
    weight: the zero-bubble schedules leave weight gradients outside autograd's accumulation)."""

    def __init__(self, *args: Any, on_last_backward: Callable[[int], None] | None = None,
                 on_backward: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_last_backward = on_last_backward
        self._on_backward = on_backward
        self._misses: bool | None = None     # does torch's split backward miss a weight here?

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type == "input" and self._split_misses_weights(bwd_kwargs):
            # torch's split backward differentiates, at the weight step, only the weights whose
            # gradients meet a path from an input that carries one; a weight reached only from
            # an integer input (an embedding after a stage that made position ids) would keep
            # no gradient. Such a stage runs its whole backward here; the weight step then has
            # nothing left to do (no parameter group).
            full = dict(bwd_kwargs)
            if full["output_grads"] is None and isinstance(full["stage_output"], (tuple, list)):
                full["stage_output"] = full["stage_output"][0]    # the loss: torch's full backward takes it bare
            grads, _ = super().backward_maybe_with_nosync("full", full, last_backward=last_backward)
            if self._on_backward is not None:
                self._on_backward(self.stage_index)
            return grads, []
        out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if self._on_backward is not None:
            self._on_backward(self.stage_index)
        return out

    def _split_misses_weights(self, bwd_kwargs: dict) -> bool:
        """Would the split backward leave a weight this stage's outputs reach without its
        gradient, or differentiate a weight group through several intermediates (a weight
        several layers use, such as T5's and Whisper's shared ones: torch's weight step then
        runs into saved tensors its input step freed)? Decided at the first micro-batch (each
        has the same graph)."""
        if self._misses is None:
            from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                                get_param_groups)
            outs = bwd_kwargs["stage_output"]
            outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
            roots = [f for f in map(_get_grad_fn_or_grad_acc, (o for o in outs if isinstance(o, torch.Tensor)))
                     if f is not None]
            ins = [f for f in (_get_grad_fn_or_grad_acc(v) for v in bwd_kwargs["input_values"]
                               if isinstance(v, torch.Tensor)) if f is not None]
            weights = [f for f in map(_get_grad_fn_or_grad_acc, (p for p in self.submod.parameters() if p.requires_grad))
                       if f is not None]
            reverse = construct_reverse_graph(roots)
            groups = get_param_groups(ins, weights, reverse)
            covered = {q for group in groups for q in group["params"]}
            self._misses = (any(w in reverse and w not in covered for w in weights)
                            or any(len(g["intermediates"]) > 1 for g in groups))
        return self._misses

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's scaling, but a parameter another stage of this rank also holds (a tied
        embedding and head, both on rank 0 under DualPipeV's V) is scaled once: by the stage of
        the lowest index, whose last backward comes last (``scaled_elsewhere``: set by the pipeline)."""
        if grad_scale_factor != 1:
            skip = getattr(self, "scaled_elsewhere", frozenset())
            for p in self.submod.parameters():
                if p.grad is not None and id(p) not in skip:
                    p.grad.div_(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        if self._on_last_backward is not None:
            self._on_last_backward(self.stage_index)


def scale_once(stages: list[PipeStage]) -> None:
    """Mark, on each of one rank's stages, the parameters a stage of lower index also holds
    (:meth:`PipeStage.scale_grads` leaves them to that stage)."""
    for ps in stages:
        ps.scaled_elsewhere = frozenset(id(p) for o in stages if o.stage_index < ps.stage_index
                                        for p in o.submod.parameters())
