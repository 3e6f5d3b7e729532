"""Train and eval mode after capture: ``pm.train()`` / ``pm.eval()`` act as on the original module.

A capture records the model in the mode it was in (an eval-mode model is captured in train
mode, then switched, so that what only training runs is in the graph): ``aten.dropout(x, p, True)``,
``aten.batch_norm(..., training=True, ...)``, the ``num_batches_tracked += 1`` of a training
BatchNorm, a ``transformers`` attention's ``dropout_p``. :func:`record_modes` captures the
model once more in the other mode (both, for a model whose submodules were in mixed modes)
and aligns the two graphs op by op:

- an op whose constant arguments differ (a flag, a probability) records both values under
  the op's node name (the graph's rewrites keep the names of the ops they do not replace), and
  a switch sets the values of the mode asked for in every graph of the parallel module and
  regenerates their code;
- an op only the training graph has, that adds a constant to a buffer in place (BatchNorm's
  counter), adds 0 in eval mode;
- any other difference (a ``self.training`` branch that runs other ops) makes that mode
  unavailable: switching to it raises a :class:`~autopar.core.errors.ConfigError` that says to
  parallelize the model in that mode.

The second capture costs as much as the first, so it happens at the first switch to the other
mode (:class:`ModeSource` keeps a copy of the model's structure and example inputs on the meta
device: no data), and never for a model that cannot depend on its mode (:func:`mode_dependent`: no dropout or normalisation layer, and no module whose source
file mentions ``training``).
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import inspect
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from autopar.core.errors import ConfigError
from autopar.core.meta import graph_info

__all__ = ["ModeSource", "modes_of", "mode_dependent"]

log = logging.getLogger(__name__)


def _mode_name(training: bool) -> str:
    return "train" if training else "eval"


@contextlib.contextmanager
def modes_of(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` (every submodule) in ``training`` mode inside, as it was after."""
    flags = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, t in flags.items():
            m.training = t


_MODE_LAYERS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase)
_TRAINING = re.compile(r"\btraining\b")


@functools.lru_cache(maxsize=None)
def _file_mentions_training(path: str | None) -> bool:
    if path is None:
        return True                      # no source to read: assume it does
    try:
        return bool(_TRAINING.search(Path(path).read_text(errors="replace")))
    except OSError:
        return True


def mode_dependent(model: nn.Module) -> bool:
    """Could ``model`` compute differently in train and eval mode? Yes if it has a dropout or
    normalisation layer, or if the source file of any of its modules' classes mentions
    ``training`` (``self.training`` branches, ``F.dropout(..., training=...)``); a model whose
    code never does cannot, and needs no second capture."""
    for m in model.modules():
        if isinstance(m, _MODE_LAYERS):
            return True
        cls = type(m)
        if cls.__module__.startswith("torch.nn."):
            continue                     # torch's own layers: only those above depend on the mode
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:
            path = None
        if _file_mentions_training(path):
            return True
    return False


@dataclass(frozen=True)
class _Ref:
    """A node argument, by the name of the node it reads."""

    name: str


@dataclass(frozen=True)
class _Op:
    """One op of a captured graph, as the alignment compares it."""

    name: str
    target: str
    leaves: tuple          # the leaves of (args, kwargs); node arguments as _Ref
    counter: bool          # ``buffer.add_(constant)``: BatchNorm's ``num_batches_tracked`` update


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _structure(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _leaf(x: Any) -> Any:
    """A leaf as the alignment compares it: a node by name; a device as any device (the other
    mode is captured on the meta device)."""
    if isinstance(x, fx.Node):
        return _Ref(x.name)
    return _DEVICE if isinstance(x, torch.device) else x


_DEVICE = "<device>"


def _call(node: fx.Node) -> tuple[tuple, dict]:
    """The node's arguments, for an ATen op by keyword with every default filled in (a mode may
    pass an argument the other leaves at its default, e.g. ``dropout_p``)."""
    if isinstance(node.target, torch._ops.OpOverload):
        try:
            bound = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                       normalize_to_only_use_kwargs=True)
        except Exception:  # noqa: BLE001 - an op torch cannot bind: as it is
            bound = None
        if bound is not None:
            return (), dict(bound.kwargs)
    return tuple(node.args), dict(node.kwargs)


def _as_called(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arguments :func:`_call` named, back as the op takes them: positional ones by position."""
    if args or not isinstance(target, torch._ops.OpOverload):
        return args, kwargs
    # normalize_function names an op's ``self`` argument ``input``
    positional = ["input" if a.name == "self" else a.name for a in target._schema.arguments if not a.kwarg_only]
    return tuple(kwargs.pop(n) for n in positional if n in kwargs), kwargs


def _signature(gm: fx.GraphModule) -> list[_Op]:
    buffers = set(graph_info(gm).buffer_fqns)
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        leaves = tuple(_leaf(x) for x in pytree.tree_leaves(_call(n)))
        counter = (str(n.target) == "aten.add_.Tensor" and len(n.args) >= 2
                   and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
                   and n.args[0].name in buffers and not isinstance(n.args[1], fx.Node))
        out.append(_Op(n.name, str(n.target), leaves, counter))
    return out


def _align(mine: list[_Op], theirs: list[_Op], mode: bool) -> tuple[str | None, list[tuple[str, int, Any, Any]]]:
    """Why a graph of ``mine`` cannot run as ``theirs`` (captured in ``mode``) does, or the
    changes that make it: (op name, leaf, its value, the value in ``mode``)."""
    matcher = difflib.SequenceMatcher(None, [o.target for o in mine], [o.target for o in theirs], autojunk=False)
    to_mine: dict[str, str] = {}       # their op names -> mine (inputs keep their names)
    changes: list[tuple[str, int, Any, Any]] = []
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(mine[i0:i1], theirs[j0:j1]):
                if len(a.leaves) != len(b.leaves):
                    return f"{a.name} ({a.target}) takes other arguments in {_mode_name(mode)} mode", []
                for k, (x, y) in enumerate(zip(a.leaves, b.leaves)):
                    if isinstance(x, _Ref) or isinstance(y, _Ref):
                        if not (isinstance(x, _Ref) and isinstance(y, _Ref)) or x.name != to_mine.get(y.name, y.name):
                            return f"{a.name} ({a.target}) reads other values in {_mode_name(mode)} mode", []
                    elif x != y:
                        changes.append((a.name, k, x, y))
                to_mine[b.name] = a.name
            continue
        extra_mine = mine[i0:i1] if tag in ("delete", "replace") else []
        extra_theirs = theirs[j0:j1] if tag in ("insert", "replace") else []
        if extra_theirs or not all(o.counter and not mode for o in extra_mine):
            first = (extra_theirs or extra_mine)[0]
            return (f"its forward runs other ops in {_mode_name(mode)} mode (first: {first.target}, a "
                    f"`self.training` branch)"), []
        # a counter eval lacks: add 0 (its ``other``, the leaf after ``self``)
        changes += [(o.name, 1, o.leaves[1], 0) for o in extra_mine]
    return None, changes


def _names(copy_ops: list[_Op], real_ops: list[_Op]) -> dict[str, str]:
    """The real graph's name of each op of the copy's that the two graphs share (same op, same
    constant arguments, in the same order)."""
    key = lambda o: (o.target, tuple(x for x in o.leaves if not isinstance(x, _Ref)))  # noqa: E731
    matcher = difflib.SequenceMatcher(None, [key(o) for o in copy_ops], [key(o) for o in real_ops], autojunk=False)
    out: dict[str, str] = {}
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag == "equal":
            out.update((a.name, b.name) for a, b in zip(copy_ops[i0:i1], real_ops[j0:j1]))
    return out


class ModeSource:
    """What switching a captured graph to another train/eval mode needs (module docstring):
    the model's structure and example inputs on the meta device, the pristine graph's ops, and per mode the values
    that differ, found at the first switch to it."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: Any, labels: Any) -> None:
        # the model's structure on the meta device (its tensors become meta tensors: no data is
        # copied or kept), so that the user's model may be freed and no memory is held
        self._model = _structure(model)
        self._inputs = pytree.tree_map(_meta, (args, kwargs)) + (labels,)
        uniform = len({m.training for m in model.modules()}) == 1
        self.base: bool | None = model.training if uniform else None     # None: captured in mixed modes
        self._ops = _signature(gm)
        self.values: dict[bool, dict[str, dict[int, Any]]] = {}
        self.blocked: dict[bool, str] = {}

    def _learn(self, mode: bool) -> None:
        """Find what differs in ``mode`` (once per mode): the meta-device copy is captured as it
        was captured for real and in ``mode``, the two are aligned, and the ops that differ are
        mapped onto the real graph's by aligning it with the copy's (a library may run other
        ops on the meta device, e.g. a ``.contiguous()`` it skips on CPU: those stay unmapped)."""
        if mode == self.base or mode in self.values or mode in self.blocked:
            return
        from autopar.passes.capture import capture

        args, kwargs, labels = self._inputs

        def captured(training: bool | None) -> list[_Op]:
            with modes_of(self._model, training) if training is not None else contextlib.nullcontext():
                return _signature(capture(self._model, args, kwargs=kwargs, dims=labels))
        try:
            as_base, other = captured(self.base), captured(mode)
        except Exception as exc:  # noqa: BLE001 - that mode is refused, with the reason
            self.blocked[mode] = f"the model cannot be captured in {_mode_name(mode)} mode ({exc})"
            return
        why, changes = _align(as_base, other, mode)
        to_real = _names(as_base, self._ops)
        lost = sorted({name for name, *_ in changes if name not in to_real})
        if why or lost:
            self.blocked[mode] = why or f"ops {lost[:3]} that differ in {_mode_name(mode)} mode are not in the graph"
            return
        self.values.setdefault(mode, {})
        for name, k, mine, theirs in changes:
            self.values[mode].setdefault(to_real[name], {})[k] = theirs
            if self.base is not None:
                self.values.setdefault(self.base, {}).setdefault(to_real[name], {})[k] = mine
        log.info("modes: %d ops differ in %s mode", len({c[0] for c in changes}), _mode_name(mode))

    def switch(self, graphs: Iterable[fx.GraphModule], mode: bool, where: str) -> int:
        """Set ``graphs`` (and their sub-graphs) to ``mode``; raise if the model cannot run in it.
        Returns how many ops changed."""
        self._learn(mode)
        why = self.blocked.get(mode)
        if why:
            raise ConfigError(f"this parallel model cannot switch to {_mode_name(mode)} mode: {why}", where=where,
                              fix=f"parallelize the model in {_mode_name(mode)} mode for that use "
                                  f"(model.{'train' if mode else 'eval'}(); autopar.parallelize(...)) and load the "
                                  f"trained weights into it with load_state_dict")
        values = self.values.get(mode, {})
        changed = 0
        for top in graphs:
            for gm in top.modules():
                if not isinstance(gm, fx.GraphModule):
                    continue
                touched = False
                for node in gm.graph.nodes:
                    want = values.get(node.name)
                    if not want or node.op != "call_function":
                        continue
                    leaves, spec = pytree.tree_flatten(_call(node))
                    if all(leaves[k] == v for k, v in want.items()):
                        continue
                    for k, v in want.items():
                        leaves[k] = v
                    node.args, node.kwargs = _as_called(node.target, *pytree.tree_unflatten(leaves, spec))
                    touched = True
                    changed += 1
                if touched:
                    gm.recompile()
        return changed
