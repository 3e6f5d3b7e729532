"""Train and eval mode after capture: ``pm.train()`` / ``pm.eval()`` act as on the original module.

A capture records the model in the mode it was in (an eval-mode model is captured in train
mode, then switched, so that what only training runs is in the graph): ``aten.dropout(x, p, True)``,
``aten.batch_norm(..., training=True, ...)``, the ``num_batches_tracked += 1`` of a training
BatchNorm, a ``transformers`` attention's ``dropout_p``. :func:`record_modes` captures the
model once more in the other mode (both, for a model whose submodules were in mixed modes)
and aligns the two graphs op by op:

- an op whose constant arguments differ (a flag, a probability) records both values on its
  node (``NodeInfo.mode_args``); the graph's rewrites keep them, and :func:`apply_mode` sets the
  values of the mode asked for and regenerates the graph's code;
- an op only the training graph has, that adds a constant to a buffer in place (BatchNorm's
  counter), adds 0 in eval mode;
- any other difference (a ``self.training`` branch that runs other ops) makes that mode
  unavailable: ``GraphInfo.mode_blocked`` says why, and switching to it raises a
  :class:`~autopar.errors.ConfigError` that says to parallelize the model in that mode.

The second capture costs as much as the first, so it is skipped for a model that cannot depend
on its mode (:func:`mode_dependent`: no dropout or normalisation layer, and no module whose
source file mentions ``training``).
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from autopar.errors import ConfigError
from autopar.passes.meta import graph_info, info

__all__ = ["record_modes", "apply_mode", "check_mode", "modes_of", "mode_dependent"]

log = logging.getLogger(__name__)


def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


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


def record_modes(gm: fx.GraphModule, model: nn.Module, recapture: Callable[[], fx.GraphModule]) -> None:
    """Annotate ``gm`` (captured from ``model`` as it is) with what differs in the other mode(s),
    capturing ``model`` again with :func:`recapture` in each (the model's modes are restored)."""
    uniform = len({m.training for m in model.modules()}) == 1
    ginfo = graph_info(gm)
    others: dict[bool, fx.GraphModule | None] = {}
    for mode in (True, False):
        if uniform and mode == model.training:
            continue
        with modes_of(model, mode):
            try:
                others[mode] = recapture()
            except Exception as exc:  # noqa: BLE001 - the other mode is refused when used, not now
                ginfo.mode_blocked[mode] = f"the model cannot be captured in {_mode_name(mode)} mode ({exc})"
                others[mode] = None
    base = model.training if uniform else None
    for mode, other in others.items():
        if other is not None:
            why = _align(gm, other, mode, base)
            if why:
                ginfo.mode_blocked[mode] = why
    changed = sum(1 for n in gm.graph.nodes if n.meta and _mode_args(n))
    log.info("modes: captured in %s mode; %d ops differ in the other%s", _mode_name(base) if base is not None
             else "mixed", changed, "".join(f"; {_mode_name(m)} unavailable: {w}" for m, w in ginfo.mode_blocked.items()))


def _mode_args(node: fx.Node) -> dict | None:
    try:
        return info(node).mode_args
    except Exception:  # noqa: BLE001 - nodes autopar did not make carry no record
        return None


def _leaves(node: fx.Node) -> list[Any]:
    return pytree.tree_leaves((node.args, node.kwargs))


def _is_buffer_counter(node: fx.Node) -> bool:
    """``buffer.add_(constant)``: BatchNorm's ``num_batches_tracked`` update."""
    if str(node.target) != "aten.add_.Tensor" or len(node.args) < 2 or node.kwargs:
        return False
    dest, other = node.args[0], node.args[1]
    return isinstance(dest, fx.Node) and dest.op == "placeholder" and not isinstance(other, fx.Node) \
        and dest.name in graph_info(dest.graph.owning_module).buffer_fqns


def _align(gm: fx.GraphModule, other: fx.GraphModule, mode: bool, base: bool | None) -> str | None:
    """Record on ``gm``'s nodes the values ``other`` (captured in ``mode``) gives their constant
    arguments; return why ``gm`` cannot run in ``mode``, or None."""
    mine, theirs = _ops(gm), _ops(other)
    keys = lambda nodes: [str(n.target) for n in nodes]  # noqa: E731
    matcher = difflib.SequenceMatcher(None, keys(mine), keys(theirs), autojunk=False)
    pairs: dict[str, str] = {n.name: n.name for n in gm.graph.nodes if n.op == "placeholder"}
    peer = {n.name: n.name for n in other.graph.nodes if n.op == "placeholder"}
    changes: list[tuple[fx.Node, int, Any, Any]] = []
    for tag, i0, i1, j0, j1 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(mine[i0:i1], theirs[j0:j1]):
                la, lb = _leaves(a), _leaves(b)
                if len(la) != len(lb):
                    return f"{a.name} ({a.target}) takes other arguments in {_mode_name(mode)} mode"
                for k, (x, y) in enumerate(zip(la, lb)):
                    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
                        if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)) \
                                or pairs.get(x.name) != peer.get(y.name, y.name):
                            return f"{a.name} ({a.target}) reads other values in {_mode_name(mode)} mode"
                    elif x != y:
                        changes.append((a, k, x, y))
                pairs[a.name] = a.name
                peer[b.name] = a.name
            continue
        extra_mine = mine[i0:i1] if tag in ("delete", "replace") else []
        extra_theirs = theirs[j0:j1] if tag in ("insert", "replace") else []
        if extra_theirs or not all(_is_buffer_counter(n) and not mode for n in extra_mine):
            first = (extra_theirs or extra_mine)[0]
            return (f"its forward runs other ops in {_mode_name(mode)} mode (first: {first.target}, a "
                    f"`self.training` branch)")
        for n in extra_mine:          # a counter the eval graph lacks: add 0 there
            changes.append((n, 1, n.args[1], 0))
            pairs[n.name] = n.name
    for node, k, mine_value, their_value in changes:
        rec = info(node)
        rec.mode_args = rec.mode_args or {}
        rec.mode_args.setdefault(mode, {})[k] = their_value
        if base is not None:
            rec.mode_args.setdefault(base, {})[k] = mine_value
    return None


def check_mode(blocked: dict[bool, str], training: bool, where: str) -> None:
    """Raise if a graph cannot run in ``training`` mode (``GraphInfo.mode_blocked``)."""
    why = blocked.get(training)
    if why:
        raise ConfigError(f"this parallel model cannot switch to {_mode_name(training)} mode: {why}",
                          where=where,
                          fix=f"parallelize the model in {_mode_name(training)} mode for that use "
                              f"(model.{'train' if training else 'eval'}(); autopar.parallelize(...)) and load the "
                              f"trained weights into it with load_state_dict")


def apply_mode(graphs: Iterable[fx.GraphModule], training: bool) -> int:
    """Set every recorded mode-dependent argument in ``graphs`` (and their sub-graphs) to its
    ``training`` value; regenerate the code of those that changed. Returns the ops changed."""
    changed = 0
    for top in graphs:
        for gm in top.modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            touched = False
            for node in gm.graph.nodes:
                values = (_mode_args(node) or {}).get(training)
                if not values:
                    continue
                leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
                if all(leaves[k] == v for k, v in values.items()):
                    continue
                for k, v in values.items():
                    leaves[k] = v
                node.args, node.kwargs = pytree.tree_unflatten(leaves, spec)
                touched = True
                changed += 1
            if touched:
                gm.recompile()
    return changed
