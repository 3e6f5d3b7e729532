"""MoE pass: mark mixture-of-experts regions for the expert-parallel planner.

Reads the graph structure, ``fqn``, ``values`` and ``GraphInfo.block_classes``. Writes
``GraphInfo.moe_regions`` and, on the nodes of a region, ``moe_role``:

- router: the nodes that compute the routing top-k from the region's input (gate matmul,
  softmax, group-limited top-ks, ``topk``), i.e. the ancestors of that ``topk`` inside the region;
- expert: nodes that use a routed expert parameter, and the nodes between those uses;
- dispatch: nodes that feed the experts (sorting, histograms, gathers, capacity masks,
  scatter into per-expert buffers);
- combine: nodes after the top-k or the experts that merge expert outputs back into tokens
  (the routing weights included).

Nodes of the region outside all four (a shared expert, a dense MLP every token runs) keep no
role: they are dense compute.

The region is found from a ``topk`` over a learned gate, not from module names: it is the
smallest module around the ``topk`` that also holds parameters other than the gate's. When a
router takes several top-ks (group-limited routing), the routing one is the last whose
indices reach an expert. Routed experts are the parameters whose use depends on those indices
(stacked weights ``[E, ...]`` run as a batched/grouped matmul or loop, or ``E`` identical
modules in a Python loop); parameters used on every token regardless of routing (shared
experts) are not experts. Only when no parameter depends on the indices (every expert runs
on every token, masked by the routing weights) are all non-router parameters the experts.
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from autopar.passes.flops import is_view_like
from autopar.core.meta import MoERegion, graph_info, info, within
from autopar.core.placement import Shard

aten = torch.ops.aten


def moe_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Find MoE regions (router → top-k → dispatch → experts → combine) and mark them."""
    groups: dict[str, list[fx.Node]] = {}
    for topk in [n for n in gm.graph.nodes if n.target is aten.topk.default]:
        fqn = _region_fqn(gm, topk)
        if fqn is not None:
            groups.setdefault(fqn, []).append(topk)
    regions = [r for fqn, topks in groups.items() if (r := _mark_region(gm, fqn, topks)) is not None]
    graph_info(gm).moe_regions = regions
    return gm


def routing_topk(gm: fx.GraphModule, region: MoERegion) -> fx.Node | None:
    """The ``topk`` whose indices route the tokens of ``region`` (its indices feed dispatch)."""
    for n in gm.graph.nodes:
        if n.target is aten.topk.default and info(n).moe_region == region.fqn and any(
                info(u).moe_role == "dispatch" for u in topk_indices(n)):
            return n
    return None


def topk_indices(topk: fx.Node) -> list[fx.Node]:
    """The ``getitem(topk, 1)`` nodes: the chosen indices."""
    return [u for u in topk.users if u.target is operator.getitem and u.args[1] == 1]


def _region_nodes(gm: fx.GraphModule, fqn: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and within(info(n).fqn, fqn)]


def _region_fqn(gm: fx.GraphModule, topk: fx.Node) -> str | None:
    """The smallest module around ``topk`` holding parameters other than its router's."""
    fqn = info(topk).fqn
    while True:
        nodes = _region_nodes(gm, fqn)
        router_params = _params_used(_ancestors_within(topk, set(nodes)) + [topk])
        others = {k for k in _params_used(nodes) if k not in router_params}
        if others and router_params:
            return fqn
        if not fqn:
            return None                  # a top-k that is not a learned gate choosing between weights
        fqn = fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _params_used(nodes: list[fx.Node]) -> dict[str, fx.Node]:
    out: dict[str, fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if info(a).kind == "param":
                out[info(a).target_fqn or a.name] = a
    return out


def _mark_region(gm: fx.GraphModule, fqn: str, topks: list[fx.Node]) -> MoERegion | None:
    nodes = _region_nodes(gm, fqn)
    region = set(nodes)
    chosen = None
    for topk in topks:                   # the last top-k whose indices reach a routed parameter
        router = set(_ancestors_within(topk, region)) | {topk}
        routed = _routed_params(nodes, router, topk, region)
        if routed:
            chosen = (topk, router, routed)
    if chosen is None:                   # experts masked, not routed: every expert runs on every token
        topk = topks[-1]
        router = set(_ancestors_within(topk, region)) | {topk}
        router_params = _params_used(list(router))
        routed = {k: v for k, v in _params_used(nodes).items() if k not in router_params}
        chosen = (topk, router, routed)
    topk, router, routed = chosen
    router_params = _params_used(list(router))
    if not router_params or not routed:
        return None
    roles = _assign_roles(nodes, router, set(routed.values()), topk)
    for n, role in roles.items():
        if role is not None:
            info(n).moe_role, info(n).moe_region = role, fqn
    num_experts, capacity = _experts_and_capacity(gm, fqn, nodes, routed)
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k", 1)
    return MoERegion(fqn=fqn, num_experts=num_experts, top_k=int(k), capacity=capacity,
                     router_weight=next(iter(router_params)), expert_params=tuple(routed))


def _routed_params(nodes: list[fx.Node], router: set[fx.Node], topk: fx.Node,
                   region: set[fx.Node]) -> dict[str, fx.Node]:
    """Non-router parameters with a use that depends on the top-k's indices."""
    router_params = set(_params_used(list(router)).values())
    after = _descendants_within(topk_indices(topk), region)
    out: dict[str, fx.Node] = {}
    for n in (n for n in nodes if n in after):          # graph order: the same names, in the same order, every run
        for a in n.all_input_nodes:
            p = _param_of(a)
            if p is not None and p not in router_params:
                out[info(p).target_fqn or p.name] = p
    return out


def _ancestors_within(node: fx.Node, region: set[fx.Node]) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [a for a in node.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in seen or n not in region:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]      # graph order (a set's order changes run to run)


def _assign_roles(nodes: list[fx.Node], router: set[fx.Node], expert_params: set[fx.Node],
                  topk: fx.Node) -> dict[fx.Node, str | None]:
    """router: the top-k's ancestors; expert: what computes with the experts' weights
    (token-side ops reading an expert weight or a view / gather of one, those views and
    gathers, and what lies between two such ops); dispatch: what feeds an expert;
    combine: what follows the top-k or an expert; no role: the rest (dense compute such as
    a shared expert)."""
    region = set(nodes)
    tokens = _token_side(nodes, topk)
    weight_side: set[fx.Node] = set()
    for n in nodes:                      # graph order: inputs before users
        if n not in tokens and any(a in expert_params or a in weight_side for a in n.all_input_nodes):
            weight_side.add(n)
    uses = [n for n in nodes if n in tokens and any(a in expert_params or a in weight_side
                                                    for a in n.all_input_nodes)]
    after = _descendants_within(uses, region)
    before: set[fx.Node] = set()
    for u in uses:
        before.update(_ancestors_within(u, region))
    routed = _descendants_within([topk], region)
    roles: dict[fx.Node, str | None] = {}
    for n in nodes:
        if n in router:
            roles[n] = "router"
        elif n in uses or (n in after and n in before) or (n in weight_side and n in before):
            roles[n] = "expert"
        elif n in before:
            roles[n] = "dispatch"
        elif n in after or n in routed:
            roles[n] = "combine"
        else:
            roles[n] = None
    return roles


def token_side(gm: fx.GraphModule, region: MoERegion) -> set[fx.Node]:
    """The nodes of ``region`` that the tokens reach other than through the routing top-k
    (the router's own ops, the gathers of token rows, the experts' matmuls, ...)."""
    nodes = _region_nodes(gm, region.fqn)
    topk = routing_topk(gm, region)
    return _token_side(nodes, topk) if topk is not None else set()


def _token_side(nodes: list[fx.Node], topk: fx.Node) -> set[fx.Node]:
    region = set(nodes) - {topk}
    inputs = {a for n in nodes for a in n.all_input_nodes
              if a not in region and a is not topk and info(a).kind not in ("param", "buffer", "constant")
              and len(info(a).values) == 1}
    seen: set[fx.Node] = set()
    todo = [u for a in inputs for u in a.users if u in region]
    while todo:
        n = todo.pop()
        if n not in seen and n in region:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _descendants_within(starts: list[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(starts)
    while todo:
        n = todo.pop()
        if n in seen or n not in region:
            continue
        seen.add(n)
        todo.extend(n.users)
    return seen


def _experts_and_capacity(gm: fx.GraphModule, fqn: str, nodes: list[fx.Node],
                          expert_params: dict[str, fx.Node]) -> tuple[int, sympy.Expr | None]:
    """Stacked weights [E, ...]: E is their shared leading dim and the capacity is the
    per-expert token dim of the batched matmul's input. Otherwise count the identical
    expert modules (a block class inside the region)."""
    leads = {info(p).values[0].shape[0] for p in expert_params.values() if len(info(p).values[0].shape) == 3}
    if len(leads) == 1:
        num = int(next(iter(leads)))
        weights = set(expert_params.values())
        for n in nodes:
            if n.target is aten.bmm.default and _param_of(n.args[1]) in weights:
                return num, info(n.args[0]).values[0].shape[1]
        return num, None
    for cls in graph_info(gm).block_classes:
        inner = [m for m in cls.members if within(m, fqn) and m != fqn]
        if len(inner) > 1:
            return len(inner), None
    return len({k.rsplit(".", 2)[0] for k in expert_params}), None


def _param_of(node: fx.Node) -> fx.Node | None:
    """The parameter placeholder a chain of views starts from (None if it is not one)."""
    while node.op == "call_function" and is_view_like(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if info(node).kind == "param" else None


def expert_side(node: fx.Node) -> bool:
    """Expert-side nodes of an MoE region (dispatch, experts, combine) and the expert weights."""
    rec = info(node)
    if rec.moe_role in ("dispatch", "expert", "combine"):
        return True
    return rec.kind == "param" and any(rec.target_fqn in r.expert_params
                                       for r in graph_info(node.graph.owning_module).moe_regions)


def expert_tensor_pin(node: fx.Node) -> Any:
    """What the tensor axis may do with an MoE region under expert parallelism: the token
    buffers' dispatch and combine stay whole (every tensor rank sends the same tokens over the
    expert axis); the experts' matmuls and weights may be split over the tensor axis on any dim
    but the expert dim (dim 0, which the expert axis deals): expert tensor parallelism, each
    tensor rank computing its slice of every owned expert for the tokens. Fixed-capacity layers
    only: a dropless layer's experts are run one by one on the rows each receives, whole."""
    rec = info(node)
    if not expert_side(node):
        return False
    regions = graph_info(node.graph.owning_module).moe_regions
    region = next((r for r in regions if r.fqn == rec.moe_region or rec.target_fqn in r.expert_params), None)
    if rec.moe_role in ("dispatch", "combine") or region is None or region.capacity is None:
        return True       # a dropless layer's experts run alone on the owner (runtime/ep.py): kept whole
    return _keeps_expert_dim


def _keeps_expert_dim(strategy: Any) -> bool:
    return not any(isinstance(p, Shard) and p.dim == 0
                   for spec in (*strategy.inputs, *strategy.outputs) for p in (spec.value, spec.grad))
