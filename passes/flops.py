"""FLOP and byte pass: forward and backward work of every node, as formulas.

Reads ``NodeInfo.values`` (shape pass). Writes ``requires_grad`` (does a gradient reach
this value), ``flops_fwd``/``flops_bwd`` (matmul-class FLOPs, a multiply-add counting 2,
the same convention as ``torch.utils.flop_counter``) and ``bytes_fwd``/``bytes_bwd``
(bytes the kernel reads and writes; views move none).

Formulas live in :data:`FLOP_RULES`, keyed by the ATen op. An op without a rule does no
matmul-class work (elementwise ops, norms, reductions: memory-bound, costed by bytes).
Backward bytes are modelled as twice forward (read the output gradient and the saved
values, write the input gradients) for every op a gradient flows through.
"""
from __future__ import annotations

from collections.abc import Callable

import sympy
import torch
import torch.fx as fx

from autopar.core.meta import ZERO, NodeInfo, graph_info, info, template_of

aten = torch.ops.aten

# An op rule: (node, its input records) -> (forward FLOPs, backward FLOPs).
FlopRule = Callable[[fx.Node, list[NodeInfo | None]], tuple[sympy.Expr, sympy.Expr]]
FLOP_RULES: dict[object, FlopRule] = {}

# Ops whose output aliases an input (no data moved) or that carry no data at all.
VIEW_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.squeeze.dims, aten.t.default, aten.alias.default,
    aten.detach.default, aten.unflatten.int, aten.flatten.using_ints, aten.chunk.default,
    aten.unbind.int, aten.view_as.default, aten.sym_size.int, aten.lift_fresh_copy.default,
    aten.contiguous.default, aten.movedim.int,
}
_NO_DATA = {"getitem", "sym_size", "_assert", "sym_constrain_range", "_guards"}


def flop_rule(*ops: object) -> Callable[[FlopRule], FlopRule]:
    def register(fn: FlopRule) -> FlopRule:
        for op in ops:
            FLOP_RULES[op] = fn
        return fn
    return register


def _shape(rec: NodeInfo | None) -> tuple[sympy.Expr, ...]:
    return rec.values[0].shape if rec is not None and rec.values else ()


def _rg(rec: NodeInfo | None) -> int:
    return int(rec is not None and rec.requires_grad)


@flop_rule(aten.linear.default)
def _linear(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    x, w = _shape(ins[0]), _shape(ins[1])
    m = sympy.Mul(*x[:-1]) if len(x) > 1 else sympy.Integer(1)
    fwd = 2 * m * x[-1] * w[0]
    return fwd, fwd * (_rg(ins[0]) + _rg(ins[1]))


@flop_rule(aten.mm.default, aten.matmul.default)
def _mm(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = _shape(ins[0]), _shape(ins[1])
    batch = sympy.Mul(*a[:-2]) if len(a) > 2 else sympy.Integer(1)
    fwd = 2 * batch * a[-2] * a[-1] * b[-1] if len(a) >= 2 else 2 * a[-1] * b[-1]
    return fwd, fwd * (_rg(ins[0]) + _rg(ins[1]))


@flop_rule(aten.addmm.default)
def _addmm(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = _shape(ins[1]), _shape(ins[2])
    fwd = 2 * a[0] * a[1] * b[1]
    return fwd, fwd * (_rg(ins[1]) + _rg(ins[2]))


@flop_rule(aten.bmm.default)
def _bmm(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = _shape(ins[0]), _shape(ins[1])
    fwd = 2 * a[0] * a[1] * a[2] * b[2]
    return fwd, fwd * (_rg(ins[0]) + _rg(ins[1]))


@flop_rule(aten.baddbmm.default)
def _baddbmm(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    a, b = _shape(ins[1]), _shape(ins[2])
    fwd = 2 * a[0] * a[1] * a[2] * b[2]
    return fwd, fwd * (_rg(ins[1]) + _rg(ins[2]))


@flop_rule(aten.scaled_dot_product_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_cudnn_attention.default)
def _sdpa(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    """Q·Kᵀ and P·V: 2·b·h·(query, key pairs)·(E + Ev), the pairs L·S, or L(L+1)/2 under
    ``is_causal`` with L == S (the flash kernels skip the key blocks above the diagonal, so
    causal attention does about half the work; torch's flop counter counts it whole). Backward
    is dP=dO·Vᵀ, dV=Pᵀ·dO, dQ=dS·K, dK=dSᵀ·Q: twice forward (the flash recompute of P is not
    counted). An explicit mask counts every pair (the kernels that take one compute every
    block), unless it is made of sizes alone and is exactly causal at the example's sizes
    (:func:`autopar.passes.attention.causal_at_probe`): the runtime runs such a mask as causal
    (runtime/attention.graph_sdpa). Registered for the CPU flash kernel too, which torch's
    counter lacks."""
    q, k, v = _shape(ins[0]), _shape(ins[1]), _shape(ins[2])
    b_h = sympy.Mul(*q[:-2])
    causal = bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if not causal and isinstance(mask, fx.Node):
        from autopar.passes.attention import causal_at_probe
        causal = causal_at_probe(mask, graph_info(mask.graph.owning_module).example_sizes)
    pairs = q[-2] * (q[-2] + 1) / 2 if causal and sympy.simplify(q[-2] - k[-2]) == 0 else q[-2] * k[-2]
    fwd = 2 * b_h * pairs * (q[-1] + v[-1])
    needs = max(_rg(ins[0]), _rg(ins[1]), _rg(ins[2]))
    return fwd, 2 * fwd * needs


@flop_rule(aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
def _conv(node: fx.Node, ins: list[NodeInfo | None]) -> tuple[sympy.Expr, sympy.Expr]:
    out = info(node).values[0].shape
    w = _shape(ins[1])  # (C_out, C_in/groups, *kernel)
    fwd = 2 * sympy.Mul(*out) * sympy.Mul(*w[1:])
    return fwd, fwd * (_rg(ins[0]) + _rg(ins[1]))


def flop_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate requires_grad, forward/backward FLOPs and bytes on every node."""
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            rec.requires_grad = rec.trainable and _is_float(rec)
            continue
        if node.op != "call_function":
            continue
        ins = _input_records(node)
        rec.requires_grad = _is_float(rec) and any(r is not None and r.requires_grad for r in ins)
        t = template_of(node)
        if t is not None and _grads(_input_records(t)) == _grads(ins):   # a copied layer's node, as trainable
            tr = info(t)
            rec.flops_fwd, rec.flops_bwd, rec.bytes_fwd, rec.bytes_bwd = tr.flops_fwd, tr.flops_bwd, tr.bytes_fwd, \
                tr.bytes_bwd
            continue
        rule = FLOP_RULES.get(node.target)
        if rule is not None:
            rec.flops_fwd, bwd = (sympy.expand(e) for e in rule(node, ins))
            rec.flops_bwd = bwd if rec.requires_grad else ZERO
        rec.bytes_fwd = _bytes_moved(node, rec, ins)
        rec.bytes_bwd = 2 * rec.bytes_fwd if rec.requires_grad else ZERO
    return gm


def _input_records(node: fx.Node) -> list[NodeInfo | None]:
    """Records of the node's positional args (None where an arg is not a node)."""
    out: list[NodeInfo | None] = []
    for a in node.args:
        out.append(info(a) if isinstance(a, fx.Node) else None)
    return out


def _grads(records: list[NodeInfo | None]) -> list[bool | None]:
    return [r.requires_grad if r is not None else None for r in records]


def _is_float(rec: NodeInfo) -> bool:
    return bool(rec.values) and any(v.dtype.is_floating_point or v.dtype.is_complex for v in rec.values)


def is_view_like(node: fx.Node) -> bool:
    try:
        return _VIEW_LIKE[node.target]
    except (KeyError, TypeError):      # TypeError: an unhashable target, not remembered
        name = getattr(node.target, "__name__", str(node.target))
        got = node.target in VIEW_OPS or any(tag in name for tag in _NO_DATA)
        try:
            _VIEW_LIKE[node.target] = got
        except TypeError:
            pass
        return got


_VIEW_LIKE: dict = {}     # target -> is_view_like, worked out once per target


def _bytes_moved(node: fx.Node, rec: NodeInfo, ins: list[NodeInfo | None]) -> sympy.Expr:
    if is_view_like(node):
        return ZERO
    read = sympy.Add(*(r.out_bytes for r in _all_input_records(node)))
    return sympy.expand(read + rec.out_bytes)


def _all_input_records(node: fx.Node) -> list[NodeInfo]:
    return [info(n) for n in node.all_input_nodes]
