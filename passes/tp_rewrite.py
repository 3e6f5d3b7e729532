"""Rewrite: turn a graph with chosen tensor-axis strategies into one rank's graph.

Reads each node's chosen :class:`~autopar.passes.sharding.Strategy` (``solution``) and
writes a per-rank graph:

- every place a value's placement differs from what its reader needs (value or
  gradient) gets one ``torch.ops.autopar.redistribute`` node, shared by all readers that
  need the same spec, recorded with a :class:`~autopar.core.meta.CollectiveInfo`
  (axis, forward/backward step, bytes, predicted seconds);
- size arguments of reshapes/expands become local sizes along split dims;
- ops whose strategy names a local kernel (vocabulary-parallel embedding) call it;
- graph outputs are converted to replicated, so every rank returns the whole result;
- dtype/device assertions are dropped (they describe the captured, whole tensors).

Parameter placeholders keep their names; the runtime feeds them this rank's slices.
"""
from __future__ import annotations

import logging
import operator
from typing import Callable, Mapping

import torch
import torch.fx as fx

from autopar.core.meta import CollectiveInfo, NodeInfo, evaluate, info, set_info
from autopar.passes.sharding import IGNORED, tensor_inputs, written_in_place
from autopar.core.placement import REP, Shard, Spec, Strategy, comm_bytes, transition
from autopar.runtime.collectives import LOCAL_OPS  # also registers torch.ops.autopar.redistribute

log = logging.getLogger("autopar.rewrite")
aten = torch.ops.aten
# Ops whose argument 1 is the output shape.
_SHAPE_ARG1 = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
               aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}

CommTimer = Callable[[str, float], float]


def tp_rewrite(gm: fx.GraphModule, solution: Mapping[str, Strategy], *, n: int, axis: str, group_name: str,
               sizes: Mapping[str, int], comm_time: CommTimer | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` in place for one rank of an ``n``-rank tensor axis (see module docstring)."""
    graph = gm.graph
    specs: dict[fx.Node, tuple[Spec, ...]] = {}
    made: dict[tuple[fx.Node, Spec], fx.Node] = {}
    ctx = _Ctx(n, axis, group_name, dict(sizes), comm_time or (lambda kind, nbytes: 0.0), made)
    ctx.written = written_in_place(gm)
    inserted = 0
    for node in list(graph.nodes):
        if node.op == "placeholder":
            specs[node] = _placeholder_specs(node, solution)
            _mark(node, specs[node], solution.get(node.name))
            continue
        if node.op == "output":
            inserted += _convert_outputs(graph, node, specs, ctx)
            continue
        if node.target in IGNORED:
            graph.erase_node(node)
            continue
        if node.target is operator.getitem and node.args[0] in specs:
            specs[node] = (specs[node.args[0]][node.args[1]],)
            _mark(node, specs[node], None)
            continue
        strategy = solution.get(node.name)
        if strategy is None:
            continue
        for u, need in zip(tensor_inputs(node), strategy.inputs):
            have = specs[u][0]
            if have != need:
                before = len(made)
                node.replace_input_with(u, _conversion(graph, u, have, need, ctx, node))
                inserted += len(made) - before
        specs[node] = strategy.outputs
        _localize_sizes(graph, node, strategy, n)
        if strategy.local_op:
            node.target = LOCAL_OPS[strategy.local_op]
            node.args = tuple(node.args[:2]) + (group_name,)
            node.kwargs = {}
        _mark(node, strategy.outputs, strategy)
    # A split op's local result can be laid out otherwise than the whole one the capture saw, so a
    # ``.contiguous()`` that was a no-op there (and left no node) may be missing: every view
    # reshapes instead (a view wherever the layout allows one, a copy where the view would fail).
    for node in graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    graph.lint()
    gm.recompile()
    log.info("tp_rewrite: %d conversions inserted on axis %s (n=%d)", inserted, axis, n)
    return gm


class _Ctx:
    def __init__(self, n: int, axis: str, group_name: str, sizes: dict[str, int], comm_time: CommTimer,
                 made: dict) -> None:
        self.n, self.axis, self.group_name, self.sizes = n, axis, group_name, sizes
        self.comm_time, self.made = comm_time, made
        self.written: set[fx.Node] = set()


def _placeholder_specs(node: fx.Node, solution: Mapping[str, Strategy]) -> tuple[Spec, ...]:
    s = solution.get(node.name)
    if s is not None:
        return s.outputs
    return (REP,) * max(1, len(info(node).values))


def _mark(node: fx.Node, outputs: tuple[Spec, ...], strategy: Strategy | None) -> None:
    rec = info(node)
    rec.placement = ",".join(str(s) for s in outputs)
    if strategy is not None:
        rec.strategy = str(strategy)


def _conversion(graph: fx.Graph, u: fx.Node, have: Spec, need: Spec, ctx: _Ctx, reader: fx.Node) -> fx.Node:
    """The node converting ``u`` to ``need``: made once, right after ``u``, or, for a value
    written in place later, just before ``reader`` (after the writes)."""
    late = u in ctx.written
    key = (u, need, reader) if late else (u, need)
    if key in ctx.made:
        return ctx.made[key]
    with graph.inserting_before(reader) if late else graph.inserting_after(u):
        conv = graph.call_function(torch.ops.autopar.redistribute.default, (u, str(have) + _g(have), str(need) + _g(need),
                                                  ctx.group_name, ctx.n))
    src_rec = info(u)
    nbytes = float(evaluate(src_rec.values[0].nbytes, ctx.sizes)) if src_rec.values else 0.0
    fwd, bwd = transition(have.value, need.value), transition(need.grad, have.grad)
    if not src_rec.requires_grad:
        bwd = transition(need.grad, need.grad)
    rec = NodeInfo(kind="op", fqn=src_rec.fqn, module_type=src_rec.module_type, made_by="tp_rewrite",
                   requires_grad=src_rec.requires_grad)
    rec.values = src_rec.values  # global shape and dtype of the value it carries
    rec.placement = str(need)
    rec.collective = CollectiveInfo(
        axis=ctx.axis, forward=fwd.kind, backward=bwd.kind, src=str(have), dst=str(need), nbytes=nbytes,
        time_fwd_s=_time(ctx, fwd, nbytes), time_bwd_s=_time(ctx, bwd, nbytes))
    set_info(conv, rec)
    ctx.made[key] = conv
    return conv


def _g(spec: Spec) -> str:
    """Always spell the gradient placement out in the op's arguments."""
    return "" if "/g" in str(spec) else f"/g{spec.grad}"


def _time(ctx: _Ctx, step, nbytes: float) -> float:
    moved = comm_bytes(step, nbytes, ctx.n)
    if step.kind == "all_to_all":
        moved /= ctx.n
    return ctx.comm_time(step.kind, moved) if moved else 0.0


def _convert_outputs(graph: fx.Graph, out: fx.Node, specs: dict, ctx: _Ctx) -> int:
    before = len(ctx.made)

    def fix(a: fx.Node) -> fx.Node:
        if a in specs and specs[a][0] != REP:
            return _conversion(graph, a, specs[a][0], REP, ctx, out)
        return a
    out.args = fx.node.map_arg(out.args, fix)
    return len(ctx.made) - before


def _localize_sizes(graph: fx.Graph, node: fx.Node, strategy: Strategy, n: int) -> None:
    """Reshape-like ops name the output shape: divide the split dim's size by ``n``."""
    if node.target not in _SHAPE_ARG1 or not strategy.outputs:
        return
    out = strategy.outputs[0].value
    if not isinstance(out, Shard):
        return
    shape = list(node.args[1])  # every op here names the whole output shape
    d = out.dim
    size = shape[d]
    if isinstance(size, int):
        if size == -1:
            return
        shape[d] = size // n
    else:
        with graph.inserting_before(node):
            shape[d] = graph.call_function(operator.floordiv, (size, n))
        set_info(shape[d], NodeInfo(kind="op", fqn=info(node).fqn, made_by="tp_rewrite"))
    node.args = (node.args[0], shape) + tuple(node.args[2:])
