"""Analysis: the dtype each value of a captured graph has when it runs under autocast.

A graph is captured in the model's dtype (fp32); under mixed precision it runs with 16-bit
parameters under ``torch.autocast``, which computes matmul-like ops in the 16-bit dtype, keeps
others in fp32 and lets the rest follow their inputs. What a pipeline stage hands to the next
must travel in the dtype the value really has then: 16-bit for what the matmuls and the
residual stream make, fp32 for what autocast keeps in fp32 (a norm's statistics, whose
gradient can exceed fp16's range), so that the split model computes what the whole one does.

Each op runs once on fake tensors (no memory, no compute) of its captured shape and the
propagated dtype, under autocast, so autocast's own rules decide. An op that cannot run that
way (one of autopar's collectives or exchanges, a view whose sizes the tensor rewrite made
local) keeps the dtype of its first floating-point input. Reads ``info(node).values``; writes
nothing (returns the dtypes by node name).
"""
from __future__ import annotations

import contextlib
import logging
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.meta import info

aten = torch.ops.aten


def autocast_dtypes(gm: fx.GraphModule, compute: torch.dtype, device_type: str = "cpu") -> dict[str, torch.dtype]:
    """Node name -> the dtype of its (first) tensor value when ``gm`` runs under autocast to
    ``compute`` with its floating-point parameters in ``compute``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[fx.Node, Any] = {}
    dtypes: dict[str, torch.dtype] = {}
    with _quiet():
        for node in gm.graph.nodes:
            _visit(node, mode, fakes, dtypes, compute, device_type)
    return dtypes


def _visit(node: fx.Node, mode: FakeTensorMode, fakes: dict, dtypes: dict[str, torch.dtype], compute: torch.dtype,
           device_type: str) -> None:
    """One node: its fake value(s) in ``fakes``, its dtype in ``dtypes``."""
    rec = info(node) if "autopar" in node.meta else None
    captured = rec.values if rec is not None else ()
    if node.op == "placeholder":
        dtype = captured[0].dtype if captured else None
        if rec is not None and rec.kind == "param" and dtype is not None and dtype.is_floating_point:
            dtype = compute
        fakes[node] = _fake(mode, captured[0], dtype, device_type) if captured else None
    elif node.op == "call_function":
        fakes[node] = _run(mode, node, fakes, compute, device_type, captured, dtypes)
    else:
        return
    first = fakes[node][0] if isinstance(fakes[node], (tuple, list)) and fakes[node] else fakes[node]
    if isinstance(first, torch.Tensor):
        dtypes[node.name] = first.dtype
    elif captured:
        dtypes[node.name] = _follow(node, dtypes) or captured[0].dtype


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Fake tensors log every op that fails on them; here failing is expected (see the module docstring)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake(mode: FakeTensorMode, value: Any, dtype: torch.dtype | None, device_type: str) -> torch.Tensor | None:
    """A fake of ``value``'s shape on ``device_type``: autocast acts only on tensors of its own
    device type, so a CPU fake under CUDA autocast would keep fp32 where the GPU gives bf16."""
    try:
        shape = [int(d) for d in value.shape]
    except TypeError:          # a symbolic size: no fake value, the dtype still propagates
        return None
    with mode:
        return torch.empty(shape, dtype=dtype or value.dtype, device=device_type)


def _run(mode: FakeTensorMode, node: fx.Node, fakes: dict, compute: torch.dtype, device_type: str,
         captured: tuple, dtypes: dict[str, torch.dtype]) -> Any:
    """The op on fake inputs under autocast, or (when it cannot run so) fakes of the captured
    shapes in the dtype of its first floating-point input."""
    if node.target is operator.getitem and isinstance(fakes.get(node.args[0]), (tuple, list)):
        return fakes[node.args[0]][node.args[1]]
    if isinstance(node.target, torch._ops.OpOverload) and all(fakes.get(a) is not None
                                                                for a in node.all_input_nodes):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: fakes[a])
        try:
            with torch.autocast(device_type, dtype=compute), mode:
                return node.target(*args, **kwargs)
        except Exception:      # noqa: BLE001 - any op fake tensors cannot run keeps its inputs' dtype
            pass
    dtype = _follow(node, dtypes)
    outs = [_fake(mode, v, dtype if v.dtype.is_floating_point else v.dtype, device_type) for v in captured]
    return outs[0] if len(outs) == 1 else tuple(outs) if outs else None


def _follow(node: fx.Node, dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    """The dtype of ``node``'s first floating-point input."""
    return next((dtypes[a.name] for a in node.all_input_nodes
                 if a.name in dtypes and dtypes[a.name].is_floating_point), None)


__all__ = ["autocast_dtypes"]


def drop_dtype_checks(gm: fx.GraphModule) -> fx.GraphModule:
    """Erase the capture's ``_assert_tensor_metadata`` checks from a graph that runs under
    autocast (mixed precision) without the tensor rewrite, which drops them anyway: they pin the
    dtypes the model was captured in (fp32). Returns ``gm``, recompiled if anything went."""
    dropped = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default
               and not n.users]
    for node in dropped:
        gm.graph.erase_node(node)
    if dropped:
        gm.recompile()
    return gm
