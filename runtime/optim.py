"""The optimizer :func:`autopar.optimizer` hands back: any ``torch.optim`` optimizer over
this rank's share of the parameters.

Per ZeRO stage it steps:

- ZeRO-0: the module's parameters (gradients already averaged over the data axis);
- ZeRO-1: flat pieces (views into the module's parameters) of the elements this rank
  owns; at ``step()`` the whole local gradients are reduce-scattered bucket by bucket,
  the pieces are stepped, then all-gathered back into every rank's parameters;
- ZeRO-2: the same pieces, whose gradients backward already reduce-scattered;
- ZeRO-3: the module's parameters, which are the flat pieces themselves.

Under mixed precision a parameter the module holds in 16 bits gets an fp32 master here (its
owned piece under ZeRO-1/2 when a data axis holds it), stepped with the fp32 gradient (the
reduced one, a pipeline's fp32 accumulator, or the 16-bit one widened where nothing reduces
it); after the step the 16-bit parameters are refreshed from the masters (all-gathered in 16
bits under ZeRO-1/2). ZeRO-3's pieces are fp32 already and are stepped themselves.

Optimizer state therefore exists only for owned elements. The update must be elementwise
(Adam, AdamW, SGD, RMSprop, Adagrad, ...): an optimizer that looks at a parameter's shape
or whole norm would see pieces, so those are refused. ``state_dict()`` is keyed by the
original parameter names and holds whole (tensor-axis-local) state tensors.

Under fp16 a :class:`~autopar.runtime.loss_scale.LossScaler` (``self.scaler``; None for bf16
and fp32) scales backward; ``step()`` unscales the masters' fp32 gradients once they are in
place, and skips the step on every rank when any rank found an inf or nan
(:mod:`autopar.runtime.loss_scale`). Its state rides in the parameter groups, so
``state_dict()`` and autopar's checkpoints carry it.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Iterable

import torch
from torch import nn

from autopar.core.errors import OptimizerError
from autopar.runtime.collectives import all_gather_start, all_gather_wait, c10d
from autopar.runtime.dp import shard_range
from autopar.runtime.health import peer_errors
from autopar.runtime.loss_scale import LossScale, make_scaler

_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Muon")


def check_optimizer_class(optimizer_cls: Any) -> None:
    """Refuse what is not a ``torch.optim.Optimizer`` class, or one whose update is not elementwise."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise OptimizerError("autopar.optimizer takes an optimizer class", where="autopar.optimizer",
                             expected="e.g. torch.optim.AdamW", got=repr(optimizer_cls),
                             fix="pass the class and its keyword arguments: "
                                 "autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)")
    if optimizer_cls.__name__ in _NOT_ELEMENTWISE:
        raise OptimizerError(f"{optimizer_cls.__name__} does not update each element on its own, so it cannot "
                             "step split or sharded pieces", where="autopar.optimizer", got=optimizer_cls.__name__,
                             expected="an elementwise optimizer",
                             fix="use an elementwise optimizer (AdamW, Adam, SGD, RMSprop, Adagrad)")


def unknown_param_error(module: nn.Module, p: Any) -> OptimizerError:
    """The error for a tensor handed to the optimizer that ``module`` does not hold."""
    shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
    return OptimizerError("the optimizer was given a tensor that is not a parameter of this parallel model",
                          where="autopar.optimizer(params=...)",
                          expected=f"parameters of {type(module).__name__} (its {sum(1 for _ in module.parameters())} "
                                   "parameters, by pm.parameters() or pm.named_parameters())",
                          got=f"a tensor of shape {shape} (the original model's parameters are not the parallel "
                              "model's: parallelize copies this rank's share of each)",
                          fix="pass parameters of the model autopar.parallelize returned, e.g. pm.parameters()")


def check_params(module: nn.Module, params: Iterable | None) -> Any:
    """``params`` (tensors or parameter groups) as a list, after checking every tensor is one of
    ``module``'s parameters."""
    if params is None:
        return None
    groups = [{**g, "params": list(g["params"])} if isinstance(g, dict) else g for g in params]
    known = {id(p) for p in module.parameters()}
    for g in groups:
        for p in (g["params"] if isinstance(g, dict) else [g]):
            if id(p) not in known:
                raise unknown_param_error(module, p)
    return groups


# The original model's parameters a parallel module does not use (id -> weak reference): a
# torch optimizer built on them would step tensors nothing computes a gradient for.
_REPLACED: dict[int, weakref.ref] = {}
_VERDICTS: "weakref.WeakKeyDictionary[Any, tuple[int, int]]" = weakref.WeakKeyDictionary()
_HOOKED = False


def refuse_replaced_parameters(model: nn.Module, parallel: Iterable[nn.Module]) -> None:
    """Mark ``model``'s parameters that none of the modules ``parallel`` (the parallel module and
    its stages) holds, and have every torch optimizer refuse, at its first ``step()``, to step
    any of them: the DDP habit ``torch.optim.SGD(model.parameters())`` would otherwise train
    nothing, silently."""
    global _HOOKED
    used = {id(q) for m in parallel for q in m.parameters()}
    for q in model.parameters():
        if id(q) not in used:
            _REPLACED[id(q)] = weakref.ref(q, lambda _, key=id(q): _REPLACED.pop(key, None))
    if not _HOOKED and _REPLACED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_refuse_replaced)
        _HOOKED = True


def _replaced(p: Any) -> bool:
    ref = _REPLACED.get(id(p))
    return ref is not None and ref() is p


def _refuse_replaced(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A torch optimizer's step pre-hook: refuse one that steps a replaced parameter (checked
    once per optimizer, again if its parameter groups grow)."""
    if not _REPLACED:
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    seen = _VERDICTS.get(optimizer)
    if seen is None or seen[0] != count:
        seen = (count, sum(1 for g in optimizer.param_groups for p in g["params"] if _replaced(p)))
        _VERDICTS[optimizer] = seen
    if seen[1]:
        raise OptimizerError(f"{type(optimizer).__name__} steps parameters of the model given to autopar.parallelize, "
                             "which the parallel model does not use: it would train nothing",
                             where=f"{type(optimizer).__name__}.step",
                             got=f"{seen[1]} of its {count} parameters are the original model's",
                             fix="build the optimizer from the parallel model: opt = autopar.optimizer(pm, "
                                 f"torch.optim.{type(optimizer).__name__}, lr=...)")


class ShardedOptimizer(torch.optim.Optimizer):
    """See the module docstring. Build with :func:`autopar.optimizer`. A ``torch.optim.Optimizer``
    (a subclass that holds the real one, ``inner``, over this rank's pieces): torch's LR
    schedulers and ``transformers.get_scheduler`` drive it, and an edit to ``param_groups``
    (the inner optimizer's own) applies to what this rank steps. A model may have several
    data axes (with experts: the dense parameters on ``dp x ep``, the experts on ``dp``), one
    runtime each, all at the same ZeRO stage; each parameter is stepped as its own axis says.
    ``loss_scale`` configures fp16 loss scaling (default ``LossScale()``; refused for other
    precisions)."""

    def __init__(self, module: Any, optimizer_cls: type, params: Iterable | None = None, *,
                 loss_scale: LossScale | None = None, **kwargs: Any) -> None:
        check_optimizer_class(optimizer_cls)
        # torch.optim.Optimizer.__init__ is not run (it would hold the parameters itself): its
        # hook registries are made here, the groups and state are the inner optimizer's
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self.module = module
        self.rts = [rt for rt in data_runtimes(module) if rt is not None]
        self.rt = self.rts[0] if self.rts else None
        self.stage = self.rt.stage if self.rt is not None else 0
        self._rt_of = {fqn: rt for rt in self.rts for fqn in rt.where}
        named = dict(module.named_parameters())
        self._fqn_of = {id(p): f for f, p in named.items()}
        self.masters: dict[str, torch.Tensor] = {}
        master, compute = _dtypes(module, self.rts)
        self.copies: set[str] = set()     # parameters held in the compute dtype, with an fp32 master apart
        for fqn, p in named.items():
            if not p.requires_grad:
                continue
            rt = self._rt_of.get(fqn)
            if compute is not None and p.dtype == compute:   # fp32 master apart from the 16-bit parameter
                whole = module._master_init.pop(fqn, None)
                whole = p.detach().to(master) if whole is None else whole
                if self.stage in (1, 2) and rt is not None:
                    lo, hi = shard_range(p.numel(), rt.n, rt.rank)
                    whole = whole.reshape(-1)[lo:hi]
                self.masters[fqn] = nn.Parameter(whole.clone())
                self.copies.add(fqn)
            elif self.stage in (1, 2) and rt is not None:
                lo, hi = shard_range(p.numel(), rt.n, rt.rank)
                self.masters[fqn] = nn.Parameter(p.detach().view(-1)[lo:hi])
            else:
                self.masters[fqn] = p
        self.mixed = bool(self.copies)
        self._master_fqn = {id(m): f for f, m in self.masters.items()}
        groups = self._groups(params)
        self._placeholder: nn.Parameter | None = None
        if not any(g["params"] for g in groups):
            # this rank steps no parameter (a pipeline stage holding none): torch refuses an empty
            # list, so the inner optimizer holds one empty tensor that never has a gradient; its
            # parameter groups exist as on every other rank (learning-rate schedules, loss scale)
            self._placeholder = nn.Parameter(torch.zeros(0))
            groups = [{**(groups[0] if groups else {}), "params": [self._placeholder]}]
        self.inner = optimizer_cls(groups, **kwargs)
        self._ready: bool | None = None      # prepare_grads()'s answer for this step, once it ran
        self.scaler = make_scaler(module, compute, loss_scale, lambda: self.inner.param_groups,
                                  share=max((getattr(rt, "divisor", 1) for rt in self.rts), default=1))

    def _groups(self, params: Iterable | None) -> list[dict]:
        if params is None:
            return [{"params": list(self.masters.values())}]
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        out = []
        for g in groups:
            mapped = []
            for p in g["params"]:
                fqn = self._fqn_of.get(id(p))
                if fqn is None:
                    raise unknown_param_error(self.module, p)
                if fqn in self.masters:
                    mapped.append(self.masters[fqn])
            out.append({**g, "params": mapped})
        return out

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    def add_param_group(self, param_group: dict) -> None:
        raise OptimizerError("parameter groups of an autopar optimizer are fixed when it is built",
                             where="ShardedOptimizer.add_param_group",
                             fix="pass every group to autopar.optimizer(pm, cls, params=[{...}, {...}])")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._ready = None
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.module.parameters():
            p.grad = None
        for rt in self.rts:
            rt.sinks.clear()
        main = getattr(self.module, "main_grads", None)
        if main is not None:
            main.clear()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        with peer_errors():
            out = self._step(closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return out

    def _step(self, closure: Any) -> Any:
        if closure is not None:
            self._ready = None        # the closure makes new gradients
            with torch.enable_grad():
                closure()
        finite = self.prepare_grads()
        out = None
        if finite:
            out = self.inner.step()
        for rt in self.rts:        # local SGD / gossip average what was stepped; every mode counts the step
            if rt.modes is not None:
                rt.modes.after_step([self.masters[f] for b in rt.buckets for f in b.fqns if f in self.masters])
        if finite:
            self.refresh_params()
        if self.stage == 1 or self.mixed:      # the fp32 gradients were only needed for this step
            for m in self.masters.values():
                m.grad = None
        self._ready = None
        return out

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Put this step's gradients on the stepped tensors (reduce-scatter them under ZeRO-1,
        widen or copy them onto fp32 masters) and, under fp16, unscale them. Returns False when
        some rank found an inf or nan (the step will be skipped). Runs once per step:
        :func:`autopar.clip_grad_norm_` calls it before ``step()`` does."""
        if getattr(self, "_ready", None) is not None:
            return self._ready
        if self.stage == 1:
            self._reduce_scatter_grads()
        named = self._named()
        delayed = self._delayed_grads()
        if delayed is False:       # async: no gradient old enough yet, the step changes nothing
            self._ready = False
            return False
        for fqn, m in self.masters.items():
            rt = self._rt_of.get(fqn)
            if delayed and fqn in delayed:
                m.grad = delayed[fqn].to(m.dtype)
                continue
            if m is named[fqn] or (self.stage == 1 and rt is not None):
                continue     # autograd, ZeRO-3's scatter or the reduce-scatter above left its gradient on it
            g = rt.sinks.get(fqn) if rt is not None else None    # reduced in fp32: ZeRO-2, mixed ZeRO-0
            if g is None:
                g = self._whole_grad(fqn, named)
            m.grad = g.reshape(-1)[:m.numel()].view(m.shape).to(m.dtype) if g is not None else None
        self._ready = self._unscaled_finite()
        return self._ready

    def _delayed_grads(self) -> dict[str, torch.Tensor] | bool | None:
        """``async``: fqn -> the averaged gradient ``staleness`` steps old; False while none is
        that old; None under the other modes."""
        out: dict[str, torch.Tensor] = {}
        for rt in self.rts:
            if rt.modes is None or rt.modes.mode.kind != "async":
                continue
            got = rt.modes.take_delayed()
            if got is None:
                return False
            for b, flat in got.items():
                out.update(rt.grads_of(rt.buckets[b], flat))
        return out or None

    def _unscaled_finite(self) -> bool:
        """fp16: unscale the masters' gradients; False (the step is skipped, on every rank) when
        some rank has an inf or nan. Always True without a scaler."""
        if self.scaler is None:
            return True
        grads = [m.grad for m in self.masters.values() if m.grad is not None]
        device = next((m.device for m in self.masters.values()), self.rt.device if self.rt else torch.device("cpu"))
        finite = self.scaler.unscale_(grads, device)
        self.scaler.update(finite)
        return finite

    def refresh_params(self) -> None:
        """Bring the module's parameters up to the stepped masters: all-gather the pieces (ZeRO-1/2),
        copy (and round) whole fp32 masters into the 16-bit parameters."""
        if self.stage in (1, 2):
            self._gather_params()
        named = self._named()
        for fqn in self.copies:
            if not (self.stage in (1, 2) and fqn in self._rt_of):
                named[fqn].data.copy_(self.masters[fqn].detach())

    def _named(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def _whole_grad(self, fqn: str, named: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """This rank's whole gradient of ``fqn``: a pipeline's fp32 accumulator under mixed
        precision, else what autograd left."""
        main = getattr(self.module, "main_grads", None)
        return main.get(fqn) if main is not None else named[fqn].grad

    def _reduce_scatter_grads(self) -> None:
        named = self._named()
        pending = []
        for rt in self.rts:
            for b in rt.buckets:
                grads = [self._whole_grad(f, named) for f in b.fqns]
                if all(g is None for g in grads):
                    pending.append((b, None))
                    continue
                rows = b.to_rows(grads, rt.reduce_dtype).div_(rt.divisor)
                pending.append((b, c10d.reduce_scatter_tensor(rows.view(-1), "sum", rt.n, rt.group_name)))
        for b, h in pending:
            got = c10d.wait_tensor(h) if h is not None else None
            for fqn, piece in zip(b.fqns, b.row_pieces(got) if got is not None else [None] * len(b.fqns)):
                m = self.masters.get(fqn)
                if m is not None:
                    m.grad = piece[:m.numel()].to(m.dtype) if piece is not None else None

    def _gather_params(self) -> None:
        named = self._named()
        pending = []
        for rt in self.rts:
            for b in rt.buckets:
                row = torch.zeros(b.width, dtype=rt.param_dtype, device=rt.device)
                for i, fqn in enumerate(b.fqns):
                    m = self.masters[fqn]
                    row[b.offsets[i]:b.offsets[i] + m.numel()] = m.detach().view(-1)
                pending.append((b, all_gather_start(row, rt.n, rt.group_name)))
        for b, h in pending:
            fulls = b.from_rows(all_gather_wait(h).view(b.rt.n, b.width))
            for fqn, full in zip(b.fqns, fulls):
                named[fqn].data.copy_(full)

    # -- state_dict with original names and whole (tensor-axis-local) state ----------------------
    def _whole(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        if self.stage == 0 or not isinstance(t, torch.Tensor) or t.dim() == 0 or fqn not in self._rt_of:
            return t
        rt = self._rt_of[fqn]
        b, i = rt.where[fqn]
        bucket = rt.buckets[b]
        piece = torch.zeros(bucket.chunks[i], dtype=t.dtype, device=t.device)
        piece[:t.numel()] = t.reshape(-1)
        got = all_gather_wait(all_gather_start(piece, rt.n, rt.group_name))
        return got[:bucket.numels[i]].view(bucket.shapes[i]).clone()

    def _piece(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        if self.stage == 0 or not isinstance(t, torch.Tensor) or t.dim() == 0 or fqn not in self._rt_of:
            return t
        m = self.masters[fqn]
        rt = self._rt_of[fqn]
        lo, hi = shard_range(t.numel(), rt.n, rt.rank)
        out = torch.zeros(m.numel(), dtype=t.dtype, device=t.device)
        out[:hi - lo] = t.reshape(-1)[lo:hi]
        return out

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        order = [self._fqn_of_master(p) for g in self.inner.param_groups for p in g["params"]]
        state = {order[k]: {name: self._whole(order[k], v) for name, v in s.items()} for k, s in sd["state"].items()
                 if order[k] is not None}
        groups = [{**g, "params": [order[k] for k in g["params"] if order[k] is not None]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        order = [self._fqn_of_master(p) for g in self.inner.param_groups for p in g["params"]]
        index = {f: k for k, f in enumerate(order) if f is not None}
        unknown = sorted(set(state_dict["state"]) - set(index))
        if unknown:
            raise OptimizerError("optimizer state names parameters this optimizer does not step",
                                 where="ShardedOptimizer.load_state_dict", got=str(unknown[:5]),
                                 expected=f"names among {order[:3]}...",
                                 fix="load a state_dict saved from an optimizer over the same model")
        state = {index[f]: {name: self._piece(f, v) for name, v in s.items()} for f, s in state_dict["state"].items()}
        groups = [{**g, "params": [index[f] for f in g["params"]]} for g in state_dict["param_groups"]]
        if self._placeholder is not None and groups:      # the empty stand-in, which no state names
            groups[0]["params"] = [*groups[0]["params"], order.index(None)]
        self.inner.load_state_dict({"state": state, "param_groups": groups})

    def _fqn_of_master(self, p: torch.Tensor) -> str | None:
        return None if p is self._placeholder else self._master_fqn[id(p)]

    def __repr__(self) -> str:
        return f"ShardedOptimizer(ZeRO-{self.stage}, {self.inner!r})"


def _dtypes(module: Any, rts: list) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype masters are stepped in, the 16-bit compute dtype or None without mixed precision)."""
    mixed = next((rt for rt in rts if rt.mixed), None)
    if mixed is not None:
        return mixed.master_dtype, mixed.compute_dtype
    if getattr(module, "mixed", False):     # a pipeline with no data axis
        return module.master_dtype, module.compute_dtype
    return torch.float32, None


def data_runtimes(module: Any) -> list:
    """The data-axis runtimes of a parallel module (one per data axis; none without one)."""
    rts = getattr(module, "dp_runtimes", None)
    if rts is not None:
        return list(rts)
    rt = getattr(module, "dp_runtime", None)
    return [rt] if rt is not None else []
