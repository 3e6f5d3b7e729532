"""Capture once per repeated block: export three periods of a model's layers, then copy them.

A transformer's layers are a few kinds repeated (:mod:`autopar.models.depth`, the same reading
of the layer pattern the planner uses). ``torch.export`` costs about the same per layer, so
:func:`find_run` finds the model's ``nn.ModuleList`` of layers and the periodic run at its end
(layers ``start .. n-1``, period ``p``), :func:`shallow` hides all but the first
``start + 3p`` layers while the model is exported, and :func:`expand` copies the last exported
period's nodes for every hidden layer: their own parameter and buffer placeholders, module
paths. Op nodes are numbered per stem in graph order after either kind of capture
(:func:`autopar.passes.meta.number_ops`), so the result is the graph a whole export gives (``tests/test_replicate.py`` compares them node by node on the zoo's and
``transformers``' models).

Where the pattern is not read from a known config (a zoo model's, or a ``transformers``
model's with a layer pattern :mod:`autopar.models.depth` understands), where the layers'
structure or attributes differ, where a parameter is shared between layers, or where the last
two exported periods are not copies of each other node for node (the same ops, constants,
values and wiring, each input either the same node or the node as many layers back), nothing
is hidden. Three periods are exported because the first can differ (its first layer reads the
embedding where the others read the layer before): the model is
exported whole. Layers differ in nothing but an index attribute (``layer_idx``) only when the
config says every layer of the run is of the same kind.
"""
from __future__ import annotations

import copy
import json
import logging
import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Iterator

import torch.fx as fx
from torch import nn

from autopar.passes.capture_key import Unkeyable, describe_module
from autopar.core.meta import COPY_KEY, META_KEY, graph_info, graph_module, info
from autopar.passes.meta import name_stem, number_ops
from autopar.core.layer_kinds import layer_kind_readers, register_layer_kinds  # noqa: F401  (re-exported)

log = logging.getLogger("autopar.capture")

_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
_MIN_SAVED = 1          # hide layers only when at least this many periods are left out


@dataclass(frozen=True)
class Run:
    """The model's layer list ``prefix`` (``holder``) of ``n`` layers, periodic from ``start``
    with ``period``; the export keeps its first ``kept`` layers."""

    holder: nn.ModuleList
    prefix: str
    n: int
    start: int
    period: int

    @property
    def kept(self) -> int:
        return self.start + 3 * self.period

    @property
    def record(self) -> tuple[str, int, int, int]:
        """What :func:`run_from_record` rebuilds the run from (kept with the shallow export)."""
        return self.prefix, self.n, self.start, self.period


def run_from_record(model: nn.Module, record: tuple[str, int, int, int] | None) -> Run | None:
    """The run :func:`find_run` found for a model of the same capture key (``record``, kept
    with its shallow export), without describing every layer again; None if ``model`` has no
    layer list of that length there."""
    if record is None:
        return None
    prefix, n, start, period = record
    try:
        holder = model.get_submodule(prefix)
    except AttributeError:
        return None
    if not isinstance(holder, nn.ModuleList) or len(holder) != n:
        return None
    return Run(holder=holder, prefix=prefix, n=n, start=start, period=period)


def periodic_run(kinds: Sequence[Hashable]) -> tuple[int, int, int]:
    """``(a, b, p)``: the longest stretch ``kinds[a:b]`` that repeats with period ``p``: the
    smallest period among the longest, the last among equally long (a model's main layers come
    after its few different first ones: deepseek-v3's dense layers)."""
    n = len(kinds)
    best = (0, min(n, 1), max(n, 1))
    for p in range(1, n // 2 + 1):
        start = 0
        for i in range(n - p + 1):
            if i == n - p or kinds[i] != kinds[i + p]:    # the stretch of matches ends at i
                a, b = start, i + p
                if b - a > best[1] - best[0] or (b - a == best[1] - best[0] and p == best[2]):
                    best = (a, b, p)
                start = i + 1
    return best


def find_run(model: nn.Module) -> Run | None:
    """The run of layers to export twice and copy, or None (module docstring)."""
    known = _config_kinds(model)
    if known is None:
        return None
    kinds, hf = known
    n = len(kinds)
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(lists) != 1 or n < 2:
        return None
    prefix, holder = lists[0]
    layers = list(holder)
    try:
        shapes = [json.dumps(describe_module(layer, ignore=_INDEX_ATTRS if hf else frozenset()), sort_keys=True,
                             default=str) for layer in layers]
    except Unkeyable:
        return None
    start, end, period = periodic_run(list(zip(kinds, shapes)))
    if end != n or (n - start) % period or n - start < (3 + _MIN_SAVED) * period or not _own_parameters(model, holder):
        return None
    return Run(holder=holder, prefix=prefix, n=n, start=start, period=period)


#: Readers of a model's layer kinds live in :mod:`autopar.core.layer_kinds` (the model zoo
#: registers its reader, :func:`autopar.models.depth.model_layer_kinds`, when ``autopar`` is
#: imported); ``register_layer_kinds`` is re-exported here.


def _config_kinds(model: nn.Module) -> tuple[list[Any], bool] | None:
    """One kind per layer from the first reader that knows the model, and whether it is a
    ``transformers`` one."""
    for reader in layer_kind_readers():
        known = reader(model)
        if known is not None:
            return known
    return None


def _own_parameters(model: nn.Module, holder: nn.ModuleList) -> bool:
    """No parameter or buffer of a layer is shared with another layer or the rest of the model."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(holder):
        for _, t in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]:
            if owner.setdefault(id(t), i) != i:
                return False
    inside = set(owner)
    prefix = _holder_fqn(model, holder)
    outside = [t for name, t in [*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)]
               if not _under(name, prefix)]
    return not any(id(t) in inside for t in outside)


def _holder_fqn(model: nn.Module, holder: nn.ModuleList) -> str:
    return next(fqn for fqn, m in model.named_modules() if m is holder)


def _under(name: str, prefix: str) -> bool:
    return name.startswith(prefix + ".") if prefix else True


@contextmanager
def shallow(run: Run) -> Iterator[None]:
    """The model with only the run's first ``kept`` layers while the block runs."""
    saved = run.holder._modules
    run.holder.__dict__["_modules"] = OrderedDict(list(saved.items())[:run.kept])
    try:
        yield
    finally:
        run.holder.__dict__["_modules"] = saved


# ---- copying the layers ------------------------------------------------------------------

class _NoCopy(Exception):
    """The exported layers are not copies of each other in a way this module can extend."""


def expand(gm: fx.GraphModule, run: Run, model: nn.Module) -> fx.GraphModule | None:
    """The whole model's graph from ``gm`` (exported under :func:`shallow`); None when the
    layers cannot be copied faithfully (the caller then exports the whole model)."""
    try:
        return _Expansion(gm, run, model).build()
    except _NoCopy as exc:
        log.info("capture: layers of %s not copied (%s); exporting every layer", run.prefix or "<root>", exc)
        return None


class _Expansion:
    def __init__(self, gm: fx.GraphModule, run: Run, model: nn.Module) -> None:
        self.gm, self.run, self.model = gm, run, model
        self.nodes = list(gm.graph.nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.segments = self._segments()
        p = run.period
        self.first = self.segments[run.start + p:run.start + 2 * p]    # the run's second exported period
        self.second = self.segments[run.start + 2 * p:run.kept]        # its third: the template
        self.last = self.second[-1][-1]
        if any(len(a) != len(b) for a, b in zip(self.first, self.second)):
            raise _NoCopy("the last two exported periods differ in length")

    # -- reading the exported graph --

    def _layer_of(self, n: fx.Node) -> int | None:
        """The layer index in the module path of the node that made ``n``."""
        return _layer_index(info(n).fqn, self.run.prefix)

    def _segments(self) -> list[list[fx.Node]]:
        """Per exported layer, its op nodes: from its first node to the next layer's first (what
        runs between two layers goes with the one before), the last layer to its last node."""
        firsts: dict[int, int] = {}
        lasts: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            layer = self._layer_of(n) if n.op == "call_function" else None
            if layer is not None:
                firsts.setdefault(layer, i)
                lasts[layer] = i
        kept = self.run.kept
        if sorted(firsts) != list(range(kept)) or any(firsts[i] >= firsts[i + 1] for i in range(kept - 1)):
            raise _NoCopy("the exported layers are not in order")
        bounds = [firsts[i] for i in range(kept)] + [lasts[kept - 1] + 1]
        segs = [self.nodes[bounds[i]:bounds[i + 1]] for i in range(kept)]
        for i, seg in enumerate(segs):
            if any(self._layer_of(n) not in (None, i) for n in seg if n.op == "call_function"):
                raise _NoCopy(f"layer {i}'s nodes are interleaved with another layer's")
        return segs

    def _where(self, x: fx.Node) -> tuple[int, int] | None:
        """(layer, position) of a node inside an exported layer, else None."""
        for li, seg in enumerate(self.segments):
            if seg and self.pos[seg[0]] <= self.pos[x] <= self.pos[seg[-1]]:
                return li, self.pos[x] - self.pos[seg[0]]
        return None

    def _refs(self, phase: int) -> list[list[tuple]]:
        """How each template node's inputs relate to it, checked against the period before: the
        same node in both (``abs``: a value from before the run, or one an earlier layer made
        for all), this layer's parameter (``own``), or the node at the same place ``d`` layers
        back (``rel``)."""
        t_layer = self.run.start + 2 * self.run.period + phase
        out = []
        for a, b in zip(self.first[phase], self.second[phase]):
            if (a.op, a.target) != (b.op, b.target) or name_stem(a.name) != name_stem(b.name):
                raise _NoCopy(f"node {b.name} is not a copy of {a.name}")
            if len(a.all_input_nodes) != len(b.all_input_nodes):
                raise _NoCopy(f"node {b.name}'s inputs are not those of {a.name}")
            refs = [self._ref(xa, xb, t_layer) for xa, xb in zip(a.all_input_nodes, b.all_input_nodes)]
            if None in refs:
                raise _NoCopy(f"node {b.name}'s inputs are not those of {a.name}")
            if repr(_strip(a.args)) != repr(_strip(b.args)) or repr(_strip(a.kwargs)) != repr(_strip(b.kwargs)):
                raise _NoCopy(f"node {b.name}'s constant arguments differ from {a.name}'s")
            if _shape(a) != _shape(b):
                raise _NoCopy(f"node {b.name}'s value differs from {a.name}'s")
            ia, ib = info(a), info(b)
            if (ia.kind, ia.module_type, _rel(ia.fqn, self.run.prefix)) != (ib.kind, ib.module_type,
                                                                          _rel(ib.fqn, self.run.prefix)):
                raise _NoCopy(f"node {b.name}'s module differs from {a.name}'s")
            out.append(refs)
        return out

    def _ref(self, xa: fx.Node, xb: fx.Node, t_layer: int) -> tuple | None:
        """What input ``xb`` of a template node is, given ``xa``, the same input one period before."""
        if xa is xb:
            return ("abs", xb.name)
        ra, rb = info(xa), info(xb)
        if xb.op == "placeholder" and rb.kind in ("param", "buffer"):
            rel_a = _rel_target(ra.target_fqn or "", self.run.prefix, t_layer - self.run.period)
            rel_b = _rel_target(rb.target_fqn or "", self.run.prefix, t_layer)
            return ("own", rb.kind, rel_b) if rel_b is not None and rel_a == rel_b and ra.kind == rb.kind else None
        wa, wb = self._where(xa), self._where(xb)
        if wa is None or wb is None or wb[0] < self.run.start + self.run.period:
            return None
        (la, qa), (lb, qb) = wa, wb
        da, db = t_layer - self.run.period - la, t_layer - lb
        ends = (len(self.segments[la]) - qa, len(self.segments[lb]) - qb)
        return ("rel", db, qb) if da == db and (qa == qb or ends[0] == ends[1]) else None

    # -- building the whole graph --

    def build(self) -> fx.GraphModule:
        run, p = self.run, self.run.period
        refs = [self._refs(r) for r in range(p)]
        periods = (run.n - run.start) // p
        extra = periods - 3
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        made: dict[tuple[int, int], fx.Node] = {}      # (layer, position) -> node, copied layers
        placeholders = self._placeholders(graph, env)
        for n in self.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                env[n] = graph.output(fx.node.map_arg(n.args[0], lambda a: self._after(a, env, made, extra)))
                env[n].meta = dict(n.meta)
                continue
            if self.pos[n] <= self.pos[self.last]:
                new = graph.node_copy(n, lambda a: env[a])
                env[n] = new
                if n is self.last:
                    self._copies(graph, refs, made, placeholders, env)
                continue
            new = graph.create_node(n.op, n.target, fx.node.map_arg(n.args, lambda a: self._after(a, env, made, extra)),
                                    fx.node.map_arg(n.kwargs, lambda a: self._after(a, env, made, extra)),
                                    name=name_stem(n.name))
            new.meta = dict(n.meta)
            env[n] = new
        if not number_ops(graph):
            raise _NoCopy("the node names collide with placeholders")
        out = graph_module(graph)
        out.shape_env = getattr(self.gm, "shape_env", None)
        out.meta[META_KEY] = self._graph_info(placeholders)
        log.info("capture: exported %d of %d layers of %s and copied %d (%d nodes)", run.kept, run.n,
                 run.prefix or "<root>", run.n - run.kept, len(graph.nodes))
        return out

    def _after(self, a: fx.Node, env: dict, made: dict, extra: int) -> fx.Node:
        """A post-run node's input: one from the exported second period moves to the last copy."""
        w = self._where(a)
        if w is None:
            return env[a]
        layer, q = w
        if layer < self.run.start + 2 * self.run.period:
            raise _NoCopy(f"{a.name} (layer {layer}) is used after the run")
        return made[(layer + extra * self.run.period, q)] if extra else env[a]

    def _copies(self, graph: fx.Graph, refs: list, made: dict, placeholders: dict, env: dict) -> None:
        run, p = self.run, self.run.period
        for layer in range(run.kept, run.n):
            phase = (layer - run.start) % p
            template = self.second[phase]
            t_layer = run.start + 2 * p + phase
            for q, (n, rb) in enumerate(zip(template, refs[phase])):
                inputs = []
                for ref in rb:
                    if ref[0] == "abs":
                        inputs.append(env[self.by_name[ref[1]]])
                    elif ref[0] == "own":
                        inputs.append(placeholders[(layer, ref[1], ref[2])])
                    else:
                        src = layer - ref[1]
                        inputs.append(made[(src, ref[2])] if src >= run.kept else env[self.segments[src][ref[2]]])
                lookup = dict(zip(n.all_input_nodes, inputs))
                new = graph.create_node(n.op, n.target, fx.node.map_arg(n.args, lookup.__getitem__),
                                        fx.node.map_arg(n.kwargs, lookup.__getitem__), name=name_stem(n.name))
                new.meta = _moved_meta(n, self.run.prefix, t_layer, layer)
                new.meta[COPY_KEY] = env[n]          # analysis takes this node's results (meta.template_of)
                made[(layer, q)] = new

    def _placeholders(self, graph: fx.Graph, env: dict) -> dict[tuple[int, str, str], fx.Node]:
        """Every placeholder, and the copied layers' parameters and buffers right after the last
        exported layer's (the order the whole model names them in)."""
        run = self.run
        holders = [n for n in self.nodes if n.op == "placeholder"]
        t_first = run.start + 2 * run.period
        inserts: dict[fx.Node, list[tuple[int, str, str, fx.Node]]] = {}
        for kind in ("param", "buffer"):
            nodes = [n for n in holders if info(n).kind == kind]
            by_phase = [[(rel, n) for n in nodes
                         for rel in [_rel_target(info(n).target_fqn or "", run.prefix, t_first + phase)] if rel is not None]
                        for phase in range(run.period)]          # each template layer's own, once
            rows = [(layer, kind, rel, n) for layer in range(run.kept, run.n)
                    for rel, n in by_phase[(layer - run.start) % run.period]]
            anchors = [n for n in nodes if _rel_target(info(n).target_fqn or "", run.prefix, run.kept - 1) is not None]
            if rows and not anchors:
                raise _NoCopy(f"the last exported layer has no {kind}s to place copies after")
            if rows:
                inserts[anchors[-1]] = rows
        new: dict[tuple[int, str, str], fx.Node] = {}
        for n in holders:
            env[n] = graph.node_copy(n, lambda a: env[a])
            for layer, kind, rel, template in inserts.get(n, []):
                target = f"{run.prefix}.{layer}.{rel}" if run.prefix else f"{layer}.{rel}"
                head = "p_" if kind == "param" else "b_"
                if template.name != head + _sanitized(info(template).target_fqn or ""):
                    raise _NoCopy(f"placeholder {template.name} is not named after its target")
                name = head + _sanitized(target)
                ph = graph.placeholder(name)
                if ph.name != name:
                    raise _NoCopy(f"placeholder name {name} is taken")
                ph.meta = _moved_meta(template, run.prefix, _layer_index(info(template).target_fqn or "", run.prefix), layer)
                rec = ph.meta[META_KEY]
                rec.target_fqn, rec.fqn = target, target.rsplit(".", 1)[0] if "." in target else ""
                new[(layer, kind, rel)] = ph
        return new

    def _graph_info(self, placeholders: dict) -> Any:
        """The exported graph's record with the copied layers' placeholders, in the order
        export lists a whole model's (its parameters', then its buffers' names)."""
        g = replace(graph_info(self.gm), layer_run=None)
        for kind, attr, named in (("param", "param_fqns", self.model.named_parameters),
                                  ("buffer", "buffer_fqns", self.model.named_buffers)):
            have = {**getattr(g, attr), **{ph.name: info(ph).target_fqn for (_, k, _), ph in placeholders.items()
                                           if k == kind}}
            order = [name for name in dict.fromkeys(("p_" if kind == "param" else "b_") + _sanitized(fqn)
                                                     for fqn, _ in named(remove_duplicate=False)) if name in have]
            if set(order) != set(have):
                raise _NoCopy(f"the {kind} placeholders are not named after the model's {kind}s")
            setattr(g, attr, {name: have[name] for name in order})
        g.module_types = {fqn: type(m).__name__ for fqn, m in self.model.named_modules()}
        g.transient_buffers = set(dict(self.model.named_buffers())) - set(self.model.state_dict())
        return g


def _moved_meta(n: fx.Node, prefix: str, src: int, dst: int) -> dict[str, Any]:
    """A copied node's meta: the same value and source line, its module paths moved to layer ``dst``."""
    meta = {k: v for k, v in n.meta.items() if k in ("val", "stack_trace", "nn_module_stack", META_KEY)}
    old, new = (f"{prefix}.{src}", f"{prefix}.{dst}") if prefix else (str(src), str(dst))
    move = (lambda p: new + p[len(old):] if p == old or p.startswith(old + ".") else p)
    if "nn_module_stack" in meta:
        meta["nn_module_stack"] = {k: (move(path), cls) for k, (path, cls) in meta["nn_module_stack"].items()}
    rec = meta[META_KEY] = copy.copy(info(n))        # a shallow copy: its values are immutable
    rec.fqn = move(rec.fqn)
    return meta


def _layer_index(path: str, prefix: str) -> int | None:
    """The layer index right after ``prefix`` in a module or parameter path (``layers.3.attn`` -> 3)."""
    head = prefix + "." if prefix else ""
    idx = path[len(head):].split(".", 1)[0] if path.startswith(head) else ""
    return int(idx) if idx.isdigit() else None


def _rel(fqn: str, prefix: str) -> str:
    """A module path relative to its layer (``layers.3.attn.q`` -> ``attn.q``)."""
    head = prefix + "." if prefix else ""
    if not fqn.startswith(head):
        return fqn
    rest = fqn[len(head):].split(".", 1)
    return rest[1] if len(rest) > 1 else ""


def _rel_target(target: str, prefix: str, layer: int) -> str | None:
    head = f"{prefix}.{layer}." if prefix else f"{layer}."
    return target[len(head):] if target.startswith(head) else None


def _sanitized(target: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", target)


def _strip(args: Any) -> Any:
    """Arguments with their nodes blanked: the constants that must agree between copies."""
    return fx.node.map_aggregate(args, lambda a: None if isinstance(a, fx.Node) else a)


def _shape(n: fx.Node) -> Any:
    """A value's shape, strides and dtype as text (comparing SymInts would add guards)."""
    v = n.meta.get("val")
    if isinstance(v, (list, tuple)):
        return tuple(_text(x) for x in v)
    return _text(v)


def _text(v: Any) -> Any:
    if hasattr(v, "shape") and hasattr(v, "stride"):
        return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.dtype))
    return str(v)


__all__ = ["Run", "expand", "find_run", "shallow"]
