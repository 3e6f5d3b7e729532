"""Dynamic loss scaling for fp16 mixed precision.

fp16 keeps 5 exponent bits: a gradient under about 6e-8 flushes to zero (under 6e-5 it loses
mantissa bits), so small gradients of an fp16 backward vanish. The usual cure (Micikevicius et
al. 2018, "Mixed Precision Training"; ``torch.amp.GradScaler``) multiplies the loss by a scale
``S`` before backward, so every gradient backward makes is ``S`` times larger, and divides the
fp32 gradients by ``S`` before the optimizer step. ``S`` adapts: a step whose gradients hold an
inf or a nan (``S`` was too large) is skipped and ``S`` halved; after ``interval``
consecutive good steps ``S`` doubles.

Where autopar applies ``S`` (user code is unchanged: ``pm(x) -> loss.backward()`` or
``pm.step(x, target=y)``, then ``opt.step()``):

- a :class:`~autopar.runtime.tp_module.ParallelModule` returns its floating-point outputs in
  fp32 under fp16 (an fp16 output is widened, an fp32 one aliased by a view), each with a tensor
  hook that multiplies the gradient arriving there by ``S`` (installed by a forward hook,
  :func:`attach`). The hook sits on the new tensor handed to the user, not on the graph's own:
  a model that returns both its logits and a loss computed from them (``transformers``'
  ``out.loss``) sends the loss's gradient into the graph's logits, which must not be scaled again. The user's loss and its
  gradient down to the model's outputs are therefore computed in fp32, and scaling the
  gradient where it enters the model equals scaling the loss (backward is linear in it). A
  loss term on the parameters themselves (not through the model's outputs, e.g. an L2 penalty
  on ``pm.parameters()``) is not scaled and would come out ``1/S`` too small: use the
  optimizer's ``weight_decay`` instead;
- a :class:`~autopar.runtime.pp.PipelineModule` computes the loss itself: its loss function's
  result (in fp32) gets the same hook, so the schedule's backward starts from ``S`` while the
  loss it reports is unscaled. (A hook, not an identity autograd function: the zero-bubble
  schedules ``detach_()`` the loss, which a function's view output refuses.)

Under a data axis each rank's loss is the mean over its share of the batch, so its gradients are
about ``n`` times the whole batch's (``n`` data ranks); summed over ranks and divided by ``n``
they become the whole batch's. Backward therefore runs at ``S / n`` and the step unscales by
``S / n`` (:attr:`LossScaler.applied`): the same fp16 range as one process at ``S``, where ``S``
itself would overflow ``n`` times sooner. Any factor gives the same result in exact arithmetic;
this one keeps ``S`` meaning what it means without autopar.

The optimizer (:class:`~autopar.runtime.optim.ShardedOptimizer`) unscales the fp32 gradients
of its masters in place, checking them for inf/nan in the same pass, then all-reduces the
found-inf flag over the whole process group (the mesh covers it: every pipeline stage, data,
expert and tensor rank), so every rank makes the same decision even when only one rank's
piece of a gradient overflowed: step, or skip (parameters, masters and optimizer state
unchanged). ``S`` changes only in ``step()``, so every backward of a step used the ``S`` the
step unscales by, on every rank (a pipeline rank without the last stage never sees the loss:
it receives gradients already scaled). The optimizer must therefore exist before the step's
first forward.

The state (``S`` and the count of good steps) lives in the optimizer's parameter groups (keys
:data:`SCALE_KEY` and :data:`GOOD_STEPS_KEY`, as a learning-rate scheduler keeps
``initial_lr`` there), so ``opt.state_dict()`` / ``load_state_dict()`` and autopar's
checkpoints (which save and restore every parameter-group entry) carry it with no extra call.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.core.errors import ConfigError

log = logging.getLogger("autopar.loss_scale")

SCALE_KEY = "loss_scale"
GOOD_STEPS_KEY = "loss_scale_good_steps"


@dataclass(frozen=True, kw_only=True)
class LossScale:
    """How fp16 loss scaling adapts (``autopar.optimizer(pm, cls, ..., loss_scale=LossScale(...))``).

    ``init``: the first scale (``torch.amp.GradScaler``'s default, 2**16); ``growth``: the factor
    after ``interval`` consecutive steps with finite gradients; ``backoff``: the factor after a
    step with an inf or nan gradient (which is skipped). ``LossScale(init=1, growth=1)`` turns
    scaling off but still skips non-finite steps."""

    init: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def __post_init__(self) -> None:
        def real(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        checks = (("init", self.init, real(self.init) and self.init > 0, "a positive finite number"),
                  ("growth", self.growth, real(self.growth) and self.growth >= 1, "a number >= 1"),
                  ("backoff", self.backoff, real(self.backoff) and 0 < self.backoff < 1, "a number in (0, 1)"),
                  ("interval", self.interval, isinstance(self.interval, int) and not isinstance(self.interval, bool)
                   and self.interval >= 1, "an int >= 1"))
        for name, value, ok, expected in checks:
            if not ok:
                raise ConfigError(f"LossScale.{name} is out of range", where=f"LossScale({name}=...)",
                                  expected=expected, got=repr(value),
                                  fix="e.g. LossScale(init=2**16, growth=2.0, backoff=0.5, interval=2000)")


class LossScaler:
    """The dynamic scale of one optimizer (module docstring). ``groups`` returns the optimizer's
    current parameter groups, where the state is kept (read from the first, written to all)."""

    def __init__(self, config: LossScale, groups: Callable[[], list[dict]], share: int = 1) -> None:
        self.config = config
        self._groups = groups
        self.skipped = 0                       # steps skipped so far (not saved)
        # the data ranks whose mean the gradients become: each rank's loss is the mean over its
        # share of the batch, so its gradients are about ``share`` times the whole batch's; the
        # backward runs at ``scale / share`` (and the step unscales by the same), so an fp16
        # gradient on each rank is as large as one process's at ``scale``, not ``share`` times
        self.share = max(1, int(share))
        for g in groups():
            g.setdefault(SCALE_KEY, float(config.init))
            g.setdefault(GOOD_STEPS_KEY, 0)

    @property
    def scale(self) -> float:
        return float(self._groups()[0].get(SCALE_KEY, self.config.init))

    @property
    def good_steps(self) -> int:
        return int(self._groups()[0].get(GOOD_STEPS_KEY, 0))

    def _set(self, scale: float, good_steps: int) -> None:
        for g in self._groups():
            g[SCALE_KEY], g[GOOD_STEPS_KEY] = float(scale), int(good_steps)

    # -- backward: scale -----------------------------------------------------------------------
    def scale_outputs(self, out: Any, alias: bool = True) -> Any:
        """``out`` (any pytree) with each fp16 tensor widened to fp32 and each floating tensor
        that requires grad hooked so that its gradient is multiplied by the scale (once per
        tensor, however often the pytree holds it). ``alias=False``: hook fp32 tensors themselves
        (a pipeline's loss, which nothing else reads and which the zero-bubble schedule
        detaches in place, as a view cannot be)."""
        done: dict[int, torch.Tensor] = {}

        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return t
            if id(t) not in done:
                # a new autograd node: a hook on ``t`` itself would also fire for the gradient the
                # model's own code sends into ``t`` (``out.loss`` computed from the ``logits`` it
                # also returns), scaling that path twice
                wide = t.float() if t.dtype == torch.float16 else t.view_as(t) if alias and t.requires_grad else t
                if wide.requires_grad:
                    wide.register_hook(self._scaled)
                done[id(t)] = wide
            return done[id(t)]
        return pytree.tree_map(one, out)

    @property
    def applied(self) -> float:
        """The factor backward multiplies gradients by (and the step divides them by)."""
        return self.scale / self.share

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.applied

    # -- step: unscale, decide, adapt --------------------------------------------------------------
    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor], device: torch.device) -> bool:
        """Divide ``grads`` (fp32) in place by the scale; True when every gradient on every rank
        is finite (one all-reduce over the whole process group)."""
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), 1.0 / self.applied, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():     # fused check-and-multiply, as torch.amp.GradScaler does
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv.to(same[0].dtype))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found.item() == 0

    def update(self, finite: bool) -> None:
        """Adapt the scale after a step (``finite``) or a skipped one."""
        c, scale, good = self.config, self.scale, self.good_steps
        if not finite:
            self.skipped += 1
            log.info("fp16 step skipped (inf/nan gradient on some rank): loss scale %g -> %g",
                     scale, scale * c.backoff)
            self._set(scale * c.backoff, 0)
        elif good + 1 >= c.interval:
            self._set(scale * c.growth, 0)
        else:
            self._set(scale, good + 1)

    def state_dict(self) -> dict[str, Any]:
        return {SCALE_KEY: self.scale, GOOD_STEPS_KEY: self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set(state[SCALE_KEY], state[GOOD_STEPS_KEY])

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g}, good_steps={self.good_steps}, {self.config})"


def make_scaler(module: Any, compute: torch.dtype | None, config: LossScale | None,
                groups: Callable[[], list[dict]], share: int = 1) -> LossScaler | None:
    """The scaler for an optimizer over ``module`` (fp16 compute only), attached to the module;
    ``config`` given for any other precision is refused rather than ignored."""
    if config is not None and not isinstance(config, LossScale):
        raise ConfigError("loss_scale must be a LossScale", where="autopar.optimizer(loss_scale=...)",
                          got=repr(config), fix="from autopar.runtime.loss_scale import LossScale; "
                                                "autopar.optimizer(pm, cls, lr=..., loss_scale=LossScale(init=2**16))")
    if compute != torch.float16:
        refuse_loss_scale(config)
        return None
    scaler = LossScaler(config or LossScale(), groups, share)
    attach(module, scaler)
    return scaler


def refuse_loss_scale(config: LossScale | None) -> None:
    """``loss_scale`` given where no fp16 compute runs would be silently unused: refuse it."""
    if config is not None:
        raise ConfigError("loss_scale applies only under mixed_precision='fp16'",
                          where="autopar.optimizer(loss_scale=...)", got=repr(config),
                          fix="drop loss_scale=, or parallelize with mixed_precision='fp16' "
                              "(bf16 and fp32 need no loss scaling)")


def attach(module: Any, scaler: LossScaler) -> None:
    """Make ``module``'s backward use ``scaler`` (the last optimizer built over it wins). A
    pipeline's loss wrapper reads ``module.loss_scaler``; a ParallelModule gets a forward hook."""
    from autopar.runtime.pp import PipelineModule
    module.loss_scaler = scaler
    if isinstance(module, PipelineModule) or hasattr(module, "_loss_scale_hook"):
        return
    module._loss_scale_hook = module.register_forward_hook(_scaled_outputs)


def _scaled_outputs(module: Any, args: Any, out: Any) -> Any:
    scaler = getattr(module, "loss_scaler", None)
    return out if scaler is None else scaler.scale_outputs(out)


__all__ = ["GOOD_STEPS_KEY", "LossScale", "LossScaler", "SCALE_KEY", "attach", "make_scaler", "refuse_loss_scale"]
