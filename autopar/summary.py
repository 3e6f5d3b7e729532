"""Totals and per-module summaries of an analysed graph, as formulas or at given sizes."""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch.fx as fx

from autopar.passes.memory import state_bytes
from autopar.core.meta import ZERO, graph_info, info, within
from autopar.core.meta import evaluate as at  # noqa: F401 - re-exported: formula at sizes


@dataclass
class Totals:
    """Whole-graph figures; sizes are sympy formulas over batch/seq (ints when static)."""

    params: int
    trainable_params: int
    active_params: int                 # per token: MoE experts counted top_k/num_experts
    buffers: int
    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    bytes_fwd: sympy.Expr
    bytes_bwd: sympy.Expr
    activation_bytes: sympy.Expr      # kept by forward for backward
    peak_live_bytes: list[sympy.Expr] = field(default_factory=list)  # candidates; max at given sizes


@dataclass
class ModuleRow:
    fqn: str
    module_type: str
    params: int
    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    activation_bytes: sympy.Expr
    nodes: int
    block_class: int | None


def totals(gm: fx.GraphModule) -> Totals:
    """Sum the per-node records of an analysed graph."""
    nodes = list(gm.graph.nodes)
    params = trainable = buffers = 0
    for n in nodes:
        rec = info(n)
        if rec.kind in ("param", "buffer") and rec.values:
            numel = int(rec.values[0].numel)
            if rec.kind == "buffer":
                buffers += numel
            else:
                params += numel
                trainable += numel if rec.trainable else 0

    def add(attr: str) -> sympy.Expr:
        return sympy.expand(sympy.Add(*(getattr(info(n), attr) for n in nodes)))

    live = {sympy.expand(info(n).live_bytes) for n in nodes}
    return Totals(params=params, trainable_params=trainable, active_params=_active_params(gm, params),
                  buffers=buffers, flops_fwd=add("flops_fwd"), flops_bwd=add("flops_bwd"),
                  bytes_fwd=add("bytes_fwd"), bytes_bwd=add("bytes_bwd"),
                  activation_bytes=add("saved_bytes"), peak_live_bytes=sorted(live, key=str))


def _active_params(gm: fx.GraphModule, params: int) -> int:
    """Parameters a token passes through: each MoE region's experts count top_k / E."""
    numel = {info(n).target_fqn: int(info(n).values[0].numel) for n in gm.graph.nodes
             if info(n).kind == "param" and info(n).values}
    active = params
    for region in graph_info(gm).moe_regions:
        expert = sum(numel.get(p, 0) for p in region.expert_params)
        active -= expert - expert * region.top_k // max(region.num_experts, 1)
    return active


def module_rows(gm: fx.GraphModule, depth: int = 2) -> list[ModuleRow]:
    """Per-module figures, modules cut at ``depth`` path components, in graph order."""
    rows: dict[str, ModuleRow] = {}
    ginfo = graph_info(gm)
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind in ("output", "input", "constant"):
            continue
        key = ".".join(rec.fqn.split(".")[:depth]) if rec.fqn else ""
        row = rows.get(key)
        if row is None:
            row = rows[key] = ModuleRow(fqn=key, module_type=ginfo.module_types.get(key, ""), params=0,
                                        flops_fwd=ZERO, flops_bwd=ZERO, activation_bytes=ZERO, nodes=0,
                                        block_class=None)
        if rec.kind == "param" and rec.values:
            row.params += int(rec.values[0].numel)
            continue
        if rec.kind == "buffer":
            continue
        row.nodes += 1
        row.flops_fwd += rec.flops_fwd
        row.flops_bwd += rec.flops_bwd
        row.activation_bytes += rec.saved_bytes
        if rec.block_class is not None and rec.block_member is not None and within(key, rec.block_member):
            row.block_class = rec.block_class
    return list(rows.values())


def state_memory(gm: fx.GraphModule, optimizer: str = "adamw") -> dict[str, int]:
    s = state_bytes(gm, optimizer)
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "buffers": s.buffers}


def peak_live(t: Totals, sizes: dict[str, int]) -> int:
    return max((at(e, sizes) for e in t.peak_live_bytes), default=0)

