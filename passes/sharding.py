"""Sharding strategies of ATen ops along the tensor axis: the registry and its lookup.

A :class:`Strategy` says, for one op, which placement (and gradient placement) each tensor
input must have, which each output then has, and what fraction of the op's work one rank
does. Rules live in :mod:`autopar.passes.sharding_rules`, keyed by ATen op. Every op also
has the replicated strategy (all inputs gathered, work repeated on every rank), which is
always correct; an op with no rule gets only that one and a one-time warning naming the op
and the module path, so a missing rule costs speed, never correctness.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

import sympy

from autopar.core.meta import evaluate, info, symbol
from autopar.core.placement import REP, Shard, Spec, Strategy

log = logging.getLogger("autopar.sharding")


@dataclass
class OpCtx:
    """What a rule sees: the node, the tensor inputs' and outputs' shapes at the planning
    sizes, and the axis size ``n``."""

    node: fx.Node
    n: int
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    args: list[fx.Node] = field(default_factory=list)   # the tensor_args, in order

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.node.args):
            return self.node.args[i]
        return self.node.kwargs.get(name, default)

    def divides(self, size: int) -> bool:
        return size % self.n == 0 and size >= self.n

    def strategy(self, name: str, inputs: list[Spec], outputs: list[Spec], *,
                 work: float | None = None, local_op: str | None = None) -> Strategy:
        return Strategy(name, tuple(inputs), tuple(outputs),
                        1.0 / self.n if work is None else work, local_op)


Rule = Callable[[OpCtx], list[Strategy]]
RULES: dict[Any, Rule] = {}
# Ops that only check or constrain; they hold no value and need no placement.
IGNORED = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
           torch.ops.aten.sym_constrain_range_for_size.default}
_warned: set[str] = set()


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return register


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes ``node`` reads, one per argument position (lists flattened,
    kwargs after args); a node passed twice appears twice. Rules speak in this order."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if _is_tensor(a) else None)
    return out


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The distinct tensor-valued nodes ``node`` reads, in argument order; a Strategy's
    ``inputs`` follow this order."""
    return list(dict.fromkeys(tensor_args(node)))


def _is_tensor(arg: fx.Node) -> bool:
    rec = node_meta(arg)
    return rec is not None and bool(rec.values)


def node_meta(node: fx.Node):
    return info(node) if "autopar" in node.meta else None


def concrete_shapes(node: fx.Node, sizes: dict[str, int]) -> list[tuple[int, ...]]:
    rec = node_meta(node)
    if rec is None:
        return []
    return [tuple(evaluate(d, sizes) for d in v.shape) for v in rec.values]


def replicated(k_in: int, k_out: int) -> Strategy:
    return Strategy("replicate", (REP,) * k_in, (REP,) * k_out, 1.0)


def is_decision(node: fx.Node) -> bool:
    """Does the solver choose a strategy for this node? (Tensor-producing ops.)"""
    if node.op != "call_function" or node.target in IGNORED or node.target is operator.getitem:
        return False
    rec = node_meta(node)
    return rec is not None and bool(rec.values)


def strategies(node: fx.Node, n: int, sizes: dict[str, int]) -> list[Strategy]:
    """All valid strategies of ``node`` on an axis of ``n`` ranks; replicated first."""
    args = tensor_args(node)
    distinct = list(dict.fromkeys(args))
    ctx = OpCtx(node, n, [concrete_shapes(a, sizes)[0] for a in args], concrete_shapes(node, sizes), args)
    out = [replicated(len(distinct), len(ctx.out_shapes))]
    fn = RULES.get(node.target)
    if fn is None:
        _warn_missing(node)
        return out
    if n == 1:
        return out
    for s in fn(ctx):
        merged = _merge_duplicates(s, args, distinct)
        if merged is not None and len(merged.outputs) == len(ctx.out_shapes) and merged not in out \
                and not _splits_batch(merged, node, distinct):
            out.append(merged)
    return out


BATCH = symbol("batch")


def _splits_batch(s: Strategy, node: fx.Node, inputs: list[fx.Node]) -> bool:
    """The batch belongs to the data axis: the tensor axis never splits a dim whose size
    depends on the ``batch`` symbol."""
    pairs = [(sp, info(u).values[0]) for sp, u in zip(s.inputs, inputs)]
    pairs += list(zip(s.outputs, info(node).values))
    for sp, val in pairs:
        if isinstance(sp.value, Shard) and BATCH in sympy.sympify(val.shape[sp.value.dim]).free_symbols:
            return True
    return False


def _merge_duplicates(s: Strategy, args: list[fx.Node], distinct: list[fx.Node]) -> Strategy | None:
    """Rules give one spec per argument position; a node passed twice must get one spec."""
    if len(s.inputs) != len(args):
        return None
    by_node: dict[fx.Node, Spec] = {}
    for a, sp in zip(args, s.inputs):
        if by_node.setdefault(a, sp) != sp:
            return None
    return Strategy(s.name, tuple(by_node[a] for a in distinct), s.outputs, s.work, s.local_op)


def _warn_missing(node: fx.Node) -> None:
    key = str(node.target)
    if key in _warned:
        return
    _warned.add(key)
    rec = node_meta(node)
    where = rec.fqn if rec and rec.fqn else "<root>"
    log.warning("no sharding rule for %s (first seen in module %r, node %s): it runs replicated "
                "(inputs gathered on every rank) - correct but slower", key, where, node.name)


def reset_warnings() -> None:
    _warned.clear()


# The rules register themselves on import.
from autopar.passes import sharding_rules, sharding_rules_library  # noqa: E402,F401


_aten = torch.ops.aten
# Ops whose output shares its input's storage.
VIEW_OPS = {_aten.slice.Tensor, _aten.select.int, _aten.view.default, _aten.narrow.default,
            _aten.as_strided.default, _aten.transpose.int, _aten.unsqueeze.default, _aten.squeeze.dim,
            _aten.expand.default, _aten.permute.default, _aten.alias.default, _aten._unsafe_view.default,
            _aten.t.default, _aten.diagonal.default, _aten.unflatten.int, _aten.split.Tensor}


def written_in_place(gm: fx.GraphModule) -> set[fx.Node]:
    """Values some op writes in place (``key[..., :d] = k`` becomes ``copy_`` into a slice of a
    fresh tensor), with their bases, every view between, and the writing ops. These stay
    replicated with no conversion between them, so the write lands in the storage later ops
    read; a conversion that reads such a value is made just before its reader, after the writes."""
    def base(node: fx.Node) -> fx.Node:
        while node.op == "call_function" and node.target in VIEW_OPS and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return node

    def views(node: fx.Node) -> set[fx.Node]:
        out, stack = {node}, [node]
        while stack:
            for user in stack.pop().users:
                if user.op == "call_function" and user.target in VIEW_OPS and user.args and user.args[0] in out \
                        and user not in out:
                    out.add(user)
                    stack.append(user)
        return out
    group: set[fx.Node] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if isinstance(value, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
                group |= views(base(value)) | {node}
    return group


def replication_reason(node: fx.Node) -> str | None:
    """Why ``node`` can only run replicated: the op's stated reason, or that it has no rule."""
    if not is_decision(node) or \
            node.target in RULES and RULES[node.target] is not sharding_rules_library.replicated_by_design:
        return None
    return sharding_rules_library.replication_reason(node.target) or f"no sharding rule for {node.target}"
