"""MoE pass: mark mixture-of-experts regions for the expert-parallel planner.

Reads the graph structure, ``fqn``, ``values`` and ``GraphInfo.block_classes``. Writes
``GraphInfo.moe_regions`` and, on every node of a region, ``moe_role``:

- router: the nodes that compute the top-k from the region's input (gate matmul, softmax,
  ``topk``), i.e. the ancestors of the ``topk`` inside the region;
- expert: nodes that use an expert parameter (any parameter of the region other than the
  router's), and the nodes between those uses;
- dispatch: nodes after the top-k that feed the experts (positions, capacity masks,
  scatter into per-expert buffers);
- combine: the rest, which merges expert outputs back into tokens.

The region is found from a ``topk`` over a learned gate, not from module names: it is the
smallest module around the ``topk`` that also holds parameters other than the gate's.
Experts stored as one stacked weight ``[E, ...]`` and experts as E identical modules are
both recognised.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from autopar.passes.flops import is_view_like
from autopar.passes.meta import MoERegion, graph_info, info, within

aten = torch.ops.aten


def moe_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Find MoE regions (router → top-k → dispatch → experts → combine) and mark them."""
    regions: list[MoERegion] = []
    for topk in [n for n in gm.graph.nodes if n.target is aten.topk.default]:
        region = _mark_region(gm, topk)
        if region is not None and all(r.fqn != region.fqn for r in regions):
            regions.append(region)
    graph_info(gm).moe_regions = regions
    return gm


def _params_used(nodes: list[fx.Node]) -> dict[str, fx.Node]:
    out: dict[str, fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if info(a).kind == "param":
                out[info(a).target_fqn or a.name] = a
    return out


def _mark_region(gm: fx.GraphModule, topk: fx.Node) -> MoERegion | None:
    fqn = info(topk).fqn
    while True:
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and within(info(n).fqn, fqn)]
        router = _ancestors_within(topk, set(nodes))
        router_params = _params_used(router + [topk])
        expert_params = {k: v for k, v in _params_used(nodes).items() if k not in router_params}
        if expert_params or not fqn:
            break
        fqn = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    if not router_params or not expert_params:
        return None  # a top-k that is not a learned gate choosing between weights
    roles = _assign_roles(nodes, set(router) | {topk}, set(expert_params.values()))
    for n, role in roles.items():
        info(n).moe_role, info(n).moe_region = role, fqn
    num_experts, capacity = _experts_and_capacity(gm, fqn, nodes, expert_params)
    k = topk.args[1] if len(topk.args) > 1 else topk.kwargs.get("k", 1)
    return MoERegion(fqn=fqn, num_experts=num_experts, top_k=int(k), capacity=capacity,
                     router_weight=next(iter(router_params)), expert_params=tuple(expert_params))


def _ancestors_within(node: fx.Node, region: set[fx.Node]) -> list[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [a for a in node.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in seen or n not in region:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return [n for n in region if n in seen]


def _assign_roles(nodes: list[fx.Node], router: set[fx.Node], expert_params: set[fx.Node]) -> dict:
    """router: the top-k's ancestors; expert: expert-weight users and what lies between two
    of them; dispatch: what feeds an expert use; combine: the rest."""
    region = set(nodes)
    uses = [n for n in nodes if any(_param_of(a) in expert_params for a in n.all_input_nodes)
            or n in expert_params or _param_of(n) in expert_params]
    after = _descendants_within(uses, region)
    before: set[fx.Node] = set()
    for u in uses:
        before.update(_ancestors_within(u, region))
    roles: dict[fx.Node, str] = {}
    for n in nodes:
        if n in router:
            roles[n] = "router"
        elif n in uses or (n in after and n in before):
            roles[n] = "expert"
        elif n in before:
            roles[n] = "dispatch"
        else:
            roles[n] = "combine"
    return roles


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

