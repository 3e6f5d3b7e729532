"""Shape pass: shape, dtype and stride of every value, sizes as sympy formulas.

Reads the FakeTensor each node carries in ``node.meta["val"]`` (export propagated
them; for a hand-built graph without them this pass runs ``FakeTensorProp`` first, from
the placeholders' values). Writes ``NodeInfo.values`` (one :class:`TensorInfo` per
tensor output, symbolic sizes renamed to ``batch``/``seq``). Never rewrites the graph.
"""
from __future__ import annotations

from typing import Any

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
    rename = graph_info(gm).export_symbols
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        t = template_of(node)              # a copied layer's node: its template's values
        info(node).values = info(t).values if t is not None else tuple(_tensor_infos(node.meta.get("val"), rename))
    return gm


def _tensor_infos(val: Any, rename: dict) -> list[TensorInfo]:
    if isinstance(val, torch.Tensor):
        return [TensorInfo(shape=tuple(to_expr(s, rename) for s in val.shape), dtype=val.dtype,
                           stride=tuple(to_expr(s, rename) for s in val.stride()))]
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
