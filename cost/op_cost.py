"""Seconds of one captured op on one device, as every planner prices it.

:func:`node_seconds` is the one place the planners (the hybrid simulator, the tensor-axis
solver, the pipeline cutter and the data-parallel planner) turn an analysed node into forward
and backward seconds. Over the roofline of :mod:`autopar.cost.compute` it adds what the
op's shape and its tensor-parallel strategy change:

- **bytes by placement**: a rank running a strategy reads each input and writes each output
  at the size its placement leaves it — a sharded value ``1/n`` of it, a replicated or
  partial one whole. A column-parallel matmul reads the whole activation and ``1/n`` of the
  weight; a row-parallel one writes a whole partial sum. (Scaling every byte by the
  strategy's work fraction would under-count both.)
- **GEMM efficiency by shape**: a matmul reaches :func:`autopar.cost.compute.gemm_efficiency`
  of peak for its local ``(m, n, k)``; its backward runs the two GEMMs ``dX = dY·Wᵀ``
  (``m, k, n``) and ``dW = Xᵀ·dY`` (``k, n, m``), each at its own shape's efficiency.
- **attention**: a fused (flash) attention kernel runs at the device's
  ``attention_efficiency``.

Backward bytes stay the flop pass's proxy: twice forward's.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.fx as fx

from autopar.cost.compute import gemm_efficiency, op_time
from autopar.cost.hardware import DeviceSpec
from autopar.core.meta import evaluate, info
from autopar.passes.sharding import tensor_inputs
from autopar.core.placement import Shard

aten = torch.ops.aten
_GEMMS = {aten.mm.default: "mm", aten.matmul.default: "mm", aten.addmm.default: "addmm",
          aten.bmm.default: "bmm", aten.baddbmm.default: "addmm", aten.linear.default: "linear"}


def node_seconds(node: fx.Node, at: Mapping[str, int], device: DeviceSpec, dtype: str, *,
                 strategy: Any = None, n: int = 1, width: float = 1.0,
                 extra_bytes: tuple[float, float] = (0.0, 0.0), attention: str = "flash",
                 flops_scale: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of ``node`` at sizes ``at`` under ``strategy`` (a tensor-axis
    :class:`~autopar.passes.sharding.Strategy` over ``n`` ranks, or None: unsplit). ``width``
    scales the recorded bytes (0.5 for a graph captured in fp32 and run in 16 bits);
    ``extra_bytes`` adds (forward, backward) traffic the graph does not record, already local.
    ``attention="materialized"`` prices an attention node as its two batched GEMMs (scores
    written out) instead of a fused kernel; ``flops_scale`` multiplies the recorded FLOPs (the
    whole square such GEMMs compute under a causal mask the flop pass counts at half)."""
    rec = info(node)
    work = (strategy.work if strategy is not None else 1.0) * flops_scale
    ff = float(evaluate(rec.flops_fwd, at)) * work
    fb = float(evaluate(rec.flops_bwd, at)) * work if rec.requires_grad else 0.0
    bf = local_bytes(node, at, strategy, n) * width
    bb = 2 * bf if rec.requires_grad else 0.0
    bf, bb = bf + extra_bytes[0], bb + (extra_bytes[1] if rec.requires_grad else 0.0)
    eff_f, eff_b = efficiencies(node, at, device, strategy, n, attention=attention)
    f = op_time(ff, bf, device, dtype, efficiency=eff_f)
    b = op_time(fb, bb, device, dtype, efficiency=eff_b) if rec.requires_grad else 0.0
    return f, b


def local_bytes(node: fx.Node, at: Mapping[str, int], strategy: Any = None, n: int = 1) -> float:
    """Bytes one rank's kernel reads and writes for ``node`` (module docstring)."""
    rec = info(node)
    whole = float(evaluate(rec.bytes_fwd, at))
    if strategy is None or n == 1 or whole == 0.0:
        return whole
    ins = tensor_inputs(node)
    if len(ins) != len(strategy.inputs) or len(rec.values) != len(strategy.outputs):
        return whole * strategy.work          # a rule that speaks of other values: its work share
    total = 0.0
    for arg, spec in zip(ins, strategy.inputs):
        total += float(evaluate(info(arg).out_bytes, at)) * _share(spec, n)
    for value, spec in zip(rec.values, strategy.outputs):
        total += float(evaluate(value.nbytes, at)) * _share(spec, n)
    return total


def _share(spec: Any, n: int) -> float:
    return 1.0 / n if isinstance(spec.value, Shard) else 1.0


def efficiencies(node: fx.Node, at: Mapping[str, int], device: DeviceSpec, strategy: Any = None,
                 n: int = 1, *, attention: str = "flash") -> tuple[float | None, float | None]:
    """(forward, backward) fraction of peak of a matmul or attention node; (None, None) for
    any other op (the device's plain ``matmul_efficiency`` applies)."""
    if _is_attention(node):
        if attention != "materialized":
            return device.attention_efficiency, device.attention_efficiency
        q = _local_shape(node.args[0], at, None, 1)
        kv = _local_shape(node.args[1], at, None, 1)
        if not q or not kv or len(q) < 3:
            return None, None
        heads = math.prod(q[:-2]) * (strategy.work if strategy is not None else 1.0)
        e = gemm_efficiency(q[-2], kv[-2], q[-1], device, batch=max(1, round(heads)))
        return e, e
    kind = _GEMMS.get(node.target)
    if kind is None:
        return None, None
    dims = _gemm_dims(node, kind, at, strategy, n)
    if dims is None:
        return None, None
    m, nn, k, batch = dims
    fwd = gemm_efficiency(m, nn, k, device, batch=batch)
    # backward: dX (m x k, inner n) and dW (k x n, inner m), equal FLOPs: harmonic mean
    dx, dw = gemm_efficiency(m, k, nn, device, batch=batch), gemm_efficiency(k, nn, m, device, batch=batch)
    return fwd, 2.0 / (1.0 / dx + 1.0 / dw)


def _is_attention(node: fx.Node) -> bool:
    return "scaled_dot_product" in getattr(node.target, "__name__", str(node.target))


def _local_shape(arg: Any, at: Mapping[str, int], spec: Any, n: int) -> list[int] | None:
    if not isinstance(arg, fx.Node) or "autopar" not in arg.meta or not info(arg).values:
        return None
    shape = [int(evaluate(d, at)) for d in info(arg).values[0].shape]
    if spec is not None and isinstance(spec.value, Shard) and shape:
        d = spec.value.dim % len(shape)
        shape[d] = max(1, math.ceil(shape[d] / n))
    return shape


def _gemm_dims(node: fx.Node, kind: str, at: Mapping[str, int], strategy: Any, n: int
               ) -> tuple[int, int, int, int] | None:
    """The local (m, n, k, batch) of a matmul node under ``strategy``."""
    ins = tensor_inputs(node)
    specs = dict(zip(ins, strategy.inputs)) if strategy is not None and len(ins) == len(strategy.inputs) else {}
    first = 1 if kind == "addmm" else 0
    if len(node.args) < first + 2:
        return None
    a = _local_shape(node.args[first], at, specs.get(node.args[first]), n)
    b = _local_shape(node.args[first + 1], at, specs.get(node.args[first + 1]), n)
    if not a or not b or len(a) < 2 and kind != "linear":
        return None
    if kind == "linear":                      # x[..., k] @ w[n, k]^T
        return math.prod(a[:-1]) or 1, b[0], a[-1], 1
    if len(a) == 3 and len(b) == 3:           # bmm / baddbmm
        return a[1], b[2], a[2], a[0]
    if len(b) == 2:                           # mm / matmul / addmm, leading dims folded into m
        return math.prod(a[:-1]), b[-1], a[-1], 1
    return math.prod(a[-2:-1]), b[-1], a[-1], math.prod(a[:-2]) or 1


__all__ = ["node_seconds", "local_bytes", "efficiencies"]
