"""Shape pass: shape, dtype and stride of every value, sizes as sympy formulas.

Reads the FakeTensor each node carries in ``node.meta["val"]`` (export propagated
them; for a hand-built graph without them this pass runs ``FakeTensorProp`` first, from
the placeholders' values). Writes ``NodeInfo.values`` (one :class:`TensorInfo` per
tensor output, symbolic sizes renamed to ``batch``/``seq``; a data-dependent size at its
bound). Never rewrites the graph.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar.core.errors import AutoparInternalError
from autopar.passes.capture import to_expr
from autopar.core.meta import TensorInfo, graph_info, info, template_of


def shape_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate every node with the shapes/dtypes/strides of its tensor outputs."""
    if any("val" not in n.meta for n in gm.graph.nodes if n.op not in ("output",)):
        _propagate_fake(gm)
    rename = dict(graph_info(gm).export_symbols)
    rename.update(_data_dependent_bounds(gm, rename))
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        t = template_of(node)              # a copied layer's node: its template's values
        info(node).values = info(t).values if t is not None else tuple(_tensor_infos(node.meta.get("val"), rename))
    return gm


_SPLITS = {torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.sizes}
_NONZERO = {torch.ops.aten.nonzero.default, torch.ops.aten.where.default, torch.ops.aten.argwhere.default,
            torch.ops.aten.masked_select.default}


def _data_dependent_bounds(gm: fx.GraphModule, rename: dict) -> dict:
    """Each data-dependent size (export's unbacked ``u0``) an op like ``torch.where(mask)``
    introduces -> its bound, the mask's element count (as a formula over the named sizes), and
    each data-dependent split size -> the split dim: the pricing passes see the most rows such
    an op can give one piece."""
    out = {}
    for node in gm.graph.nodes:       # sizes a split takes from data (``sizes.tolist()``): each at most the dim
        if node.target in _SPLITS and isinstance(node.args[0], fx.Node) and len(node.args) > 1:
            whole = node.args[0].meta.get("val")
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            if isinstance(whole, torch.Tensor) and isinstance(node.args[1], (list, tuple)):
                bound = to_expr(whole.shape[dim], rename)
                for part in node.args[1]:
                    v = part.meta.get("val") if isinstance(part, fx.Node) else None
                    if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
                        out.setdefault(v.node.expr, bound)
    for node in gm.graph.nodes:
        found = node.meta.get("unbacked_bindings") or {}
        if not found or node.target not in _NONZERO:
            continue
        first = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(first, torch.Tensor):
            continue
        numel = sympy.Integer(1)
        for d in first.shape:
            numel *= to_expr(d, rename)
        for u in found:
            out[u] = numel
    return out


def _size(s: Any, rename: dict):
    """A size as a formula; a data-dependent one (export's unbacked ``u0``: the rows
    ``torch.where`` finds) is priced at its bound, the most it can be (all rows)."""
    expr = to_expr(s, rename)
    unbacked = [u for u in getattr(expr, "free_symbols", ()) if str(u).startswith("u")]
    if unbacked and isinstance(s, torch.SymInt):
        ranges = s.node.shape_env.var_to_range
        bounds = {u: ranges[u].upper for u in unbacked if u in ranges}
        bounds = {u: b for u, b in bounds.items() if getattr(b, "is_Integer", False) and int(b) < 2 ** 40}
        expr = expr.xreplace(bounds)
    return expr


def _tensor_infos(val: Any, rename: dict) -> list[TensorInfo]:
    if isinstance(val, torch.Tensor):
        return [TensorInfo(shape=tuple(_size(s, rename) for s in val.shape), dtype=val.dtype,
                           stride=tuple(_size(s, rename) for s in val.stride()))]
    if isinstance(val, (tuple, list)):
        out: list[TensorInfo] = []
        for v in val:
            out.extend(_tensor_infos(v, rename))
        return out
    return []  # SymInt, None, python scalars: not tensors


def _propagate_fake(gm: fx.GraphModule) -> None:
    """Run FakeTensorProp from the placeholders' example values (hand-built graphs)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val", node.meta.get("example_value"))
        if not isinstance(val, torch.Tensor):
            raise AutoparInternalError(f"placeholder {node.name!r} has no example value to propagate from")
        inputs.append(mode.from_tensor(val) if not isinstance(val, torch._subclasses.FakeTensor) else val)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
