"""What a plan leaves on each rank: tensor-axis-local parameter sizes and the parameters' width.

Shared by the ZeRO memory split (``cost/dp_planner.py``), the fit checks (``autopar/build/checks.py``)
and the plan's predicted memory (``autopar/build/prepare.py``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from autopar.core.meta import info
from autopar.core.placement import Shard, parse


def dtype_of(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.kind == "param" and rec.values:
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(rec.values[0].dtype, "fp32")
    return "fp32"


def param_bytes(gm: fx.GraphModule) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype_of(gm), 4)


def local_numels(gm: fx.GraphModule, the_plan: Any) -> tuple[int, int, int]:
    """Per-rank (tensor-axis-local) trainable and frozen parameter elements, and buffer bytes."""
    trainable = frozen = buffers = 0
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op != "placeholder" or rec.kind not in ("param", "buffer") or not rec.values:
            continue
        numel = math.prod(local_shape(rec.values[0].shape, the_plan.params.get(rec.target_fqn, "R"), the_plan.tp))
        if rec.kind == "buffer":
            buffers += numel * rec.values[0].dtype.itemsize
        elif rec.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return trainable, frozen, buffers


def local_shape(shape: Any, placement: str, tp: int) -> tuple[int, ...]:
    out = [int(d) for d in shape]
    p = parse(placement)
    if isinstance(p, Shard):
        out[p.dim] //= tp
    return tuple(out)

