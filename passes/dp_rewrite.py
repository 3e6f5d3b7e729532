"""Data-axis rewrite and the overlap scheduling pass.

:func:`bucket_params` groups parameters into communication buckets in the order forward
first uses them (so a bucket's gradients complete together in backward).
:func:`dp_rewrite` inserts the data-axis nodes of :mod:`autopar.runtime.dp` for a ZeRO
stage, unscheduled: every issue sits right next to its wait, so nothing overlaps.
:func:`schedule` then moves them:

- a gradient-reduction issue goes just before its bucket's first use (in backward it then
  fires as soon as the bucket's gradients are complete and overlaps the rest of backward);
  its wait stays at the top of forward (the end of backward);
- a ZeRO-3 gather wait goes just before its bucket's first use, and its issue just after
  the previous bucket's wait (one bucket of prefetch, overlapping that bucket's compute);
- tensor-axis conversions of parameters sink to just before their first reader.

Nodes keep their names; each data-axis node carries a ``CollectiveInfo`` for ``dump``.
"""
from __future__ import annotations

import operator
from typing import Callable, Mapping

import torch.fx as fx

from autopar.core.meta import CollectiveInfo, NodeInfo, info, set_info
from autopar.runtime.dp import (
    DP_OPS,
    grad_reduce_issue,
    grad_reduce_wait,
    param_gather_issue,
    param_gather_wait,
)

CommTimer = Callable[[str, float], float]


def param_placeholders(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {info(n).target_fqn: n for n in gm.graph.nodes
            if n.op == "placeholder" and info(n).kind == "param" and info(n).target_fqn}


def _is_conversion(node: fx.Node) -> bool:
    return node.op == "call_function" and "autopar" in node.meta and info(node).collective is not None \
        and node.target not in DP_OPS


def _first_use(node: fx.Node, order: dict[fx.Node, int]) -> int:
    """Position of the first real reader of ``node`` (looking through conversions and getitems)."""
    best = len(order)
    for u in node.users:
        if _is_conversion(u) or u.target is operator.getitem or u.target in DP_OPS:
            best = min(best, _first_use(u, order))
        else:
            best = min(best, order[u])
    return best


def bucket_params(gm: fx.GraphModule, *, nbytes: Mapping[str, int], include: Callable[[str], bool],
                  bucket_bytes: int) -> list[list[str]]:
    """Buckets of parameters (state_dict keys), in order of first use. A bucket takes
    parameters until it holds at least ``bucket_bytes``, so each is about that size or one
    parameter larger (small ones such as biases never sit alone between large ones)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    phs = param_placeholders(gm)
    used = sorted((_first_use(n, order), fqn) for fqn, n in phs.items() if include(fqn) and n.users)
    buckets: list[list[str]] = []
    size = bucket_bytes   # full: the first parameter opens a bucket
    for _, fqn in used:
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(fqn)
        size += nbytes[fqn]
    return buckets


def dp_rewrite(gm: fx.GraphModule, *, rid: int, stage: int, buckets: list[list[str]], axis: str, n: int,
               nbytes: Mapping[str, int], comm_time: CommTimer | None = None) -> fx.GraphModule:
    """Insert the data-axis nodes for ZeRO ``stage`` (ZeRO-1 reduces at the optimizer step:
    nothing is inserted). Issues are placed next to their waits; run :func:`schedule` next
    (it lints the graph)."""
    if stage == 1 or n == 1:
        return gm
    graph = gm.graph
    phs = param_placeholders(gm)
    timer = comm_time or (lambda kind, b: 0.0)
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    # Conversions the tensor-axis rewrite left among the placeholders read parameters the
    # data-axis nodes are about to wrap: move them below the last placeholder first.
    early = []
    for node in graph.nodes:
        if node is anchor:
            break
        if node.op != "placeholder":
            early.append(node)
    _place_after(graph, early, anchor)
    for b, fqns in enumerate(buckets):
        nodes = [phs[f] for f in fqns]
        total = float(sum(nbytes[f] for f in fqns))
        name = f"dp.b{b}"
        if stage in (0, 2):
            kind = "all_reduce" if stage == 0 else "reduce_scatter"
            wait = _call(graph, anchor, grad_reduce_wait, (rid, b, *nodes))
            _annotate(wait, axis, "none", f"{kind}:wait", name, fqns, total, 0.0, 0.0)
            issue = _call(graph, wait, grad_reduce_issue, (rid, b, wait))      # the wait's tuple, whole
            _annotate(issue, axis, "none", f"{kind}:issue", name, fqns, total, 0.0, timer(kind, total))
            out = _unpack(graph, issue, len(nodes))
            for ph, new in zip(nodes, out):
                ph.replace_all_uses_with(new, delete_user_cb=lambda u, w=wait: u is not w)
            anchor = out[-1]
        else:
            issue = _call(graph, anchor, param_gather_issue, (rid, b, *nodes))
            _annotate(issue, axis, "all_gather:issue", "reduce_scatter:wait", name, fqns, total,
                      timer("all_gather", total), timer("all_gather", total))
            wait = _call(graph, issue, param_gather_wait, (rid, b, issue))
            _annotate(wait, axis, "all_gather:wait", "reduce_scatter:issue", name, fqns, total, 0.0,
                      timer("reduce_scatter", total))
            out = _unpack(graph, wait, len(nodes))
            for ph, new in zip(nodes, out):
                ph.replace_all_uses_with(new, delete_user_cb=lambda u, i=issue: u is not i)
            anchor = out[-1]
            _place_before(graph, [issue, wait, *out], _first_use_node(out))
    gm.recompile()           # linted once, by schedule(), which always comes next
    return gm


def schedule(gm: fx.GraphModule, *, overlap: bool = True) -> fx.GraphModule:
    """Move issue/wait positions (see the module docstring). With ``overlap=False`` only
    the ZeRO-3 gathers move, each issue right before its wait just before first use."""
    graph = gm.graph
    if overlap:
        for node in list(graph.nodes):
            if _is_conversion(node) and all(a.op == "placeholder" or a.target is operator.getitem
                                            for a in node.all_input_nodes):
                target = _first_use_node([node])
                if target is not None:
                    target.prepend(node)
    waits = [n for n in graph.nodes if n.target is param_gather_wait]
    for w in waits:
        out = _getitems(w)
        target = _first_use_node(out)
        if target is not None:
            _place_before(graph, [w, *out], target)
    order = {n: i for i, n in enumerate(graph.nodes)}
    waits.sort(key=order.__getitem__)      # moving the waits may have reordered them
    for k, w in enumerate(waits):
        issue = w.args[2]
        if overlap and k > 0:
            prev = _getitems(waits[k - 1])
            _place_after(graph, [issue], prev[-1] if prev else waits[k - 1])
        else:
            w.prepend(issue)
    if overlap:
        for issue in [n for n in graph.nodes if n.target is grad_reduce_issue]:
            out = _getitems(issue)
            target = _first_use_node(out)
            if target is not None:
                _place_before(graph, [issue, *out], target)
    graph.lint()
    gm.recompile()
    return gm


def schedule_table(gm: fx.GraphModule) -> list[dict]:
    """Where each data-axis bucket's collectives are issued and waited, forward and backward."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    rows: dict[str, dict] = {}
    for n in nodes:
        if n.target not in DP_OPS:
            continue
        c = info(n).collective
        row = rows.setdefault(c.bucket, {"bucket": c.bucket, "params": len(c.params), "bytes": c.nbytes})
        first = _first_use_node(_getitems(n))
        where = f"#{pos[n]} before {first.name}" if first is not None else f"#{pos[n]}"
        if n.target is grad_reduce_wait:
            row["kind"] = c.backward.split(":")[0]
            row["backward_wait"] = "end of backward"
        elif n.target is grad_reduce_issue:
            row["backward_issue"] = f"after the backward of {first.name}" if first is not None else "end of backward"
            row["forward_position"] = where
        elif n.target is param_gather_issue:
            row["kind"] = "all_gather+reduce_scatter"
            row["forward_issue"] = f"#{pos[n]} after {nodes[pos[n] - 1].name}"
            row["backward_wait"] = f"when backward reaches #{pos[n]}"
        else:
            row["forward_wait"] = where
            row["backward_issue"] = f"after the backward of {first.name}" if first is not None else "-"
    return list(rows.values())


# ---------------------------------------------------------------------------------------------

def _call(graph: fx.Graph, after: fx.Node, fn, args: tuple) -> fx.Node:
    with graph.inserting_after(after):
        return graph.call_function(fn, args)


def _unpack(graph: fx.Graph, node: fx.Node, k: int) -> list[fx.Node]:
    out, last = [], node
    for i in range(k):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (node, i))
        set_info(last, NodeInfo(kind="op", fqn="", made_by="dp_rewrite"))
        out.append(last)
    return out


def _getitems(node: fx.Node) -> list[fx.Node]:
    return sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])


def _first_use_node(values: list[fx.Node]) -> fx.Node | None:
    """The earliest node (in graph order) that reads any of ``values``."""
    inside = set(values)
    users = {u for v in values for u in v.users if u not in inside}
    if not users:
        return None
    for node in values[0].graph.nodes:
        if node in users:
            return node
    return None


def _place_before(graph: fx.Graph, nodes: list[fx.Node], target: fx.Node | None) -> None:
    if target is None:
        return
    for node in nodes:
        if node is not target:
            target.prepend(node)


def _place_after(graph: fx.Graph, nodes: list[fx.Node], anchor: fx.Node) -> None:
    for node in nodes:
        anchor.append(node)
        anchor = node


def _annotate(node: fx.Node, axis: str, fwd: str, bwd: str, bucket: str, fqns: list[str], nbytes: float,
              t_fwd: float, t_bwd: float) -> None:
    rec = NodeInfo(kind="op", fqn="", made_by="dp_rewrite")
    rec.placement = ""
    rec.collective = CollectiveInfo(axis=axis, forward=fwd, backward=bwd, src="", dst="", nbytes=nbytes,
                                    time_fwd_s=t_fwd, time_bwd_s=t_bwd, bucket=bucket, params=tuple(fqns))
    set_info(node, rec)
