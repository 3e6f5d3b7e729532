"""The context step: each rank of the ``cp`` axis runs its own tokens of every sequence
(:mod:`autopar.passes.cp_rewrite`), attention crossing the ranks by the plan's kind (given in
``ContextOptions(kind=...)``, the plan's, or the cheapest by ``cost/cp_planner.py``).

Parameters stay replicated over ``cp``; the data step averages gradients over ``dp x cp`` (each
rank's loss is its tokens' share). Nothing happens without a cp axis.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch.distributed as dist

from autopar.build.state import BuildState
from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate, graph_info, info
from autopar.cost.cp_planner import AttentionShape, choose_kind

log = logging.getLogger("autopar.build")


def context_step(s: BuildState) -> None:
    cp = s.sizes.get("cp", 1)
    if cp == 1:
        return
    given = s.request.options.context.kind
    planned = s.request.plan.cp_kind if s.request.plan is not None else None
    if given is not None and planned is not None and given != planned:
        raise ConfigError("ContextOptions(kind=...) differs from the plan's", where="parallelize(plan=...)",
                          expected=repr(planned), got=repr(given), fix="drop the kind (the plan's is used), or re-plan")
    kind, why = given or planned, "given" if given else "the plan's"
    shapes = attention_shapes(s.gm, cp)
    if kind is None and not shapes:      # written-out attention only: it runs as the all-gather kind
        kind, why = "allgather", "the model writes its attention out (matmul, softmax, matmul)"
    elif kind is None:
        kind, totals = choose_kind(shapes, cp, s.cluster(), tuple(s.sizes.items()))
        why = "cheapest: " + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in totals.items() if v != float("inf"))
    from autopar.passes.cp_rewrite import cp_rewrite
    group, _ = s.group("cp")
    report = cp_rewrite(s.gm, cp=cp, group_name=group.group_name, kind=kind)
    s.cp_kind = kind          # the plan records it (a pipeline's plan is made by the pipeline step)
    if s.plan is not None:
        s.plan = replace(s.plan, cp_axis="cp", cp_kind=kind)
    eager = len(report.attention) - len(shapes)
    if eager and kind != "allgather" and dist.get_rank() == 0:
        log.warning("%d attention op(s) written out (matmul, softmax, matmul) run as the all-gather kind, not %s: "
                    "each rank multiplies its queries by the whole sequence's keys", eager, kind)
    if dist.get_rank() == 0:
        log.info("context parallelism cp=%d, %s attention (%s) over %d attention ops; on the whole sequence: %s",
                 cp, kind, why, len(report.attention),
                 ", ".join(f"{k} x{v}" for k, v in sorted(report.whole_ops.items())) or "nothing")


def attention_shapes(gm, cp: int) -> list[AttentionShape]:
    """The attention ops of ``gm`` at its example sizes (the rank's share of the sequence), as
    the whole sequence sees them (keys before a grouped-query repeat, as they are exchanged)."""
    from autopar.passes.cp_rewrite import attention_ops
    sizes = dict(graph_info(gm).example_sizes)
    out = []
    for n, q, k, causal in attention_ops(gm):
        b, h, t, d = (evaluate(x, sizes) for x in q)
        out.append(AttentionShape(batch=b, heads=h, kv_heads=evaluate(k[1], sizes), seq=t * cp, head_dim=d,
                                  itemsize=info(n.args[0]).values[0].dtype.itemsize, causal=causal))
    return out
