"""The analysis pipeline: the passes in order, each with its reason, checked between.

Each pass annotates the graph in place and returns it; after each one the graph is
linted and autopar's own invariants are checked, so a broken pass fails at its own door.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.fx as fx

from autopar.core.errors import AutoparInternalError
from autopar.passes.attention import unrepeat_kv
from autopar.passes.blocks import block_pass
from autopar.passes.flops import flop_pass
from autopar.passes.memory import memory_pass
from autopar.core.meta import META_KEY, graph_info
from autopar.passes.meta import paused_gc
from autopar.passes.moe import moe_pass
from autopar.passes.shapes import shape_pass

log = logging.getLogger("autopar.passes")

Pass = Callable[[fx.GraphModule], fx.GraphModule]

ANALYSIS_PASSES: list[tuple[str, Pass, str]] = [
    ("shapes", shape_pass, "every later pass reads sizes, dtypes and strides"),
    ("flops", flop_pass, "needs shapes; decides which values carry a gradient"),
    ("memory", memory_pass, "needs requires_grad to know what backward keeps"),
    ("blocks", block_pass, "needs shapes for structural fingerprints of layers"),
    ("moe", moe_pass, "counts module-list experts with the block classes"),
]


def analyze(gm: fx.GraphModule, *, upto: str | None = None, kv_divisor: int = 1) -> fx.GraphModule:
    """Run the analysis passes in order (through ``upto`` if given) on a captured graph
    (``kv_divisor``: the tensor axis it is captured for, :func:`autopar.passes.attention.unrepeat_kv`)."""
    names = [name for name, _, _ in ANALYSIS_PASSES]
    if upto is not None and upto not in names:
        raise AutoparInternalError(f"no analysis pass named {upto!r}; passes are {names}")
    # one rewrite before the analyses: attention takes grouped-query keys and values unrepeated
    # (passes/attention.py), so every pass and the simulator read the attention that runs
    if "shapes" not in graph_info(gm).passes_run:
        unrepeat_kv(gm, kv_divisor)
    count = len(gm.graph.nodes)
    for name, fn, _ in ANALYSIS_PASSES:
        start = time.perf_counter()
        with paused_gc():
            out = fn(gm)
        if out is not gm:
            raise AutoparInternalError(f"analysis pass {name!r} returned a new graph; analysis passes annotate in place")
        if len(gm.graph.nodes) != count:
            raise AutoparInternalError(f"analysis pass {name!r} added or removed nodes; analysis passes annotate in place")
        # lint (a walk of every node's wiring) once, after the last pass: the passes only annotate
        check_invariants(gm, after=name, lint=name == ANALYSIS_PASSES[-1][0] or name == upto)
        graph_info(gm).passes_run.append(name)
        log.info("pass %-7s %5.2fs  %d nodes", name, time.perf_counter() - start, len(gm.graph.nodes))
        if name == upto:
            break
    return gm


def check_invariants(gm: fx.GraphModule, *, after: str, lint: bool = True) -> None:
    """graph.lint() (with ``lint``) plus: every node carries its autopar record; after shapes,
    every node with a tensor value has its TensorInfo."""
    try:
        if lint:
            gm.graph.lint()
    except Exception as exc:  # noqa: BLE001 - re-raised with the pass's name
        raise AutoparInternalError(f"graph failed lint after pass {after!r}: {exc}") from exc
    for node in gm.graph.nodes:
        rec = node.meta.get(META_KEY)
        if rec is None:
            raise AutoparInternalError(f"node {node.name!r} lost its autopar record in pass {after!r}")
        if after == "shapes" and node.op != "output" and _has_tensor(node) and not rec.values:
            raise AutoparInternalError(f"shape pass left node {node.name!r} without shapes")


def _has_tensor(node: fx.Node) -> bool:
    import torch
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)
