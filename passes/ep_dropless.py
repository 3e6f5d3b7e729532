"""Dropless MoE layers as the expert-parallel rewrite sees them: tokens in, experts, tokens out.

Reads the MoE pass's roles and regions; rewrites nothing (:mod:`autopar.passes.ep_rewrite`
does). A dropless layer, however a library writes its routing (sort + histogram + grouped
matmul over stacked ``[E, ...]`` weights, a gather of per-row expert weights + batched
matmul, a Python loop over ``E`` expert modules with ``index_select`` / ``index_add``),
computes

    y[t] = sum_j  w[t, j] * expert_{ids[t, j]}(x[t])

from the tokens ``x`` ``[T, h]``, the routing top-k ``ids`` and ``weights`` ``[T, k]``.
:func:`find_dropless` finds those three values and ``y`` in the graph, the nodes that compute
``y`` from them (the *replaced* nodes), and each expert's own computation (the *chain*: the
nodes that use an expert's weights and what lies between, plus row-wise casts around them)
as a small graph ``rows [R, h] -> [R, h']`` that :class:`LocalExperts` runs on any rows.

A chain may read routing-derived values besides its rows (the grouped matmul's offsets).
They are recomputed from the indices by their own nodes, as if every row went to expert 0;
stacked weights are then given as one expert's slice expanded to ``[E, ...]`` (a view), so
whatever expert a row is routed to, it meets that expert's weights.

:func:`check_dropless` runs the replaced nodes and the formula above side by side on random
tokens and routing with the model's own weights: a layer whose graph does not compute the
formula is reported (and runs dense) rather than split wrongly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.core.meta import MoERegion, evaluate, graph_info, info
from autopar.passes.moe import routing_topk, token_side, topk_indices

aten = torch.ops.aten

# Ops that act on each row alone and keep the row count: chains extend through them.
_ROWWISE = {aten.to.dtype, aten._to_copy.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.contiguous.default, aten.clone.default, aten.alias.default, aten.to.dtype_layout}
# Nodes that only check or describe other nodes: they go when what they check goes.
_SIDE = {aten._assert_scalar.default, aten._assert_tensor_metadata.default, aten.sym_size.int,
         aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}


@dataclass
class ExpertChain:
    """One expert's computation: ``graph(rows, *params, *aux)`` -> rows out."""

    graph: fx.GraphModule
    params: tuple[str, ...]            # fqns, in the graph's placeholder order
    aux: fx.GraphModule | None         # ids [R, 1] -> the routing-derived inputs, or None


@dataclass
class DroplessLayer:
    """A dropless MoE layer found in the graph (see the module docstring)."""

    region: MoERegion
    x: fx.Node
    ids: fx.Node
    weights: fx.Node
    y: fx.Node
    replaced: list[fx.Node]            # nodes computing y from (x, ids, weights), in graph order
    side: list[fx.Node]                # checks on them, removed with them
    chains: list[ExpertChain]          # one (stacked) or one per expert (expert id = index)
    stacked: bool
    num_experts: int

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(p for c in self.chains for p in c.params)


class Unsupported(Exception):
    """This layer is not one the dropless rewrite can split (the message says why)."""


def find_dropless(gm: fx.GraphModule, region: MoERegion) -> DroplessLayer:
    """The tokens, routing, output, replaced nodes and expert chains of ``region``
    (raises :class:`Unsupported` with the reason)."""
    topk = routing_topk(gm, region)
    idx = topk_indices(topk) if topk is not None else []
    if len(idx) != 1:
        raise Unsupported("no single routing top-k whose indices feed the experts")
    ids = idx[0]
    nodes = [n for n in gm.graph.nodes if info(n).moe_region == region.fqn]
    core = [n for n in nodes if info(n).moe_role == "expert"]
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and info(n).target_fqn in region.expert_params}
    comps = _components(core)
    tokens = token_side(gm, region)
    x = _tokens(comps, tokens, ids)
    outs = [_chain_out(c) for c in comps]
    y = _output(gm, nodes, outs, x)
    w = _weights(gm, ids, y)
    keep = _ancestors([x, ids, w]) | {x, ids, w}
    upstream = _ancestors([y]) | {y}
    replaced = [n for n in gm.graph.nodes if n in upstream and n not in keep and n.op == "call_function"]
    side = _side_nodes(replaced, y)
    _check_inputs(replaced, {x, ids, w} | params)
    stacked, num = _expert_layout(comps, params, region)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    comps.sort(key=lambda c: min(order[n] for n in c))
    chains = [_chain(gm, c, params, tokens, ids, set(replaced)) for c in comps]
    return DroplessLayer(region=region, x=x, ids=ids, weights=w, y=y, replaced=replaced, side=side,
                         chains=chains, stacked=stacked, num_experts=num)


def _components(core: list[fx.Node]) -> list[list[fx.Node]]:
    """Connected pieces of the expert nodes (one per expert module, or one for stacked)."""
    members, seen, out = set(core), set(), []
    for start in core:
        if start in seen:
            continue
        comp, todo = [], [start]
        while todo:
            n = todo.pop()
            if n in seen or n not in members:
                continue
            seen.add(n)
            comp.append(n)
            todo.extend(list(n.all_input_nodes) + list(n.users))
        out.append(comp)
    return out


def _rows_in(comp: list[fx.Node], tokens: set[fx.Node]) -> list[fx.Node]:
    """The comp's inputs on the token side (its rows, possibly through casts)."""
    members = set(comp)
    return list(dict.fromkeys(a for n in comp for a in n.all_input_nodes if a not in members and a in tokens))


def _tokens(comps: list[list[fx.Node]], tokens_side: set[fx.Node], ids: fx.Node) -> fx.Node:
    """The token tensor ``[T, h]`` every expert's rows are gathered from (through row-wise
    casts, then the gather or repeat that picks the rows: index, index_select, repeat_interleave)."""
    routed = _descendants([ids])
    tokens = _shape(ids)[0]
    found = set()
    for comp in comps:
        for r in _rows_in(comp, tokens_side):
            while r in routed or not _is_tensor(r) or _shape(r)[0] != tokens:
                if r.op != "call_function" or not r.args or not isinstance(r.args[0], fx.Node):
                    raise Unsupported("the experts' rows do not come from one token tensor")
                r = r.args[0]
            found.add(r)
    if len(found) != 1:
        raise Unsupported(f"the experts' rows come from {len(found)} token tensors, not one")
    return found.pop()


def _chain_out(comp: list[fx.Node]) -> fx.Node:
    """The one expert node read outside the expert, then the row-wise casts after it."""
    members = set(comp)
    outs = [n for n in comp if any(u not in members and u.target not in _SIDE for u in n.users)]
    if len(outs) != 1:
        raise Unsupported(f"an expert has {len(outs)} outputs, not one")
    out = outs[0]
    while True:
        users = [u for u in out.users if u.target not in _SIDE]
        if len(users) == 1 and users[0].target in _ROWWISE and users[0].args[0] is out:
            out = users[0]
        else:
            return out


def _output(gm: fx.GraphModule, nodes: list[fx.Node], outs: list[fx.Node], x: fx.Node) -> fx.Node:
    """The first node every expert output flows into that is shaped like the tokens."""
    want, region = _shape(x), set(nodes)
    after = set.intersection(*[_descendants([o]) for o in outs])
    for n in gm.graph.nodes:
        if n in after and n in region and info(n).moe_role == "combine" and _is_tensor(n) \
                and _shape(n) == want and _dtype(n).is_floating_point:
            return n
    raise Unsupported("no node merges the experts' outputs back into a tensor shaped like the tokens")


def _weights(gm: fx.GraphModule, ids: fx.Node, y: fx.Node) -> fx.Node:
    """The routing weights: the last floating tensor shaped like the indices that y reads."""
    before = _ancestors([y])
    cands = [n for n in gm.graph.nodes if n in before and n is not ids and _is_tensor(n)
             and _shape(n) == _shape(ids) and _dtype(n).is_floating_point]
    if not cands:
        raise Unsupported("no routing weights shaped like the top-k indices reach the output")
    return cands[-1]


def _side_nodes(replaced: list[fx.Node], y: fx.Node) -> list[fx.Node]:
    """Checks that read replaced nodes (assertions, sizes): removed with them. Anything else
    reading a replaced node means the layer's internals are used elsewhere."""
    rep, side = set(replaced), []
    todo = [u for n in replaced if n is not y and _is_tensor(n) for u in n.users]
    seen: set[fx.Node] = set()
    while todo:
        u = todo.pop()
        if u in rep or u in seen:
            continue
        seen.add(u)
        if u.target in _SIDE or (not _is_tensor(u) and u.op == "call_function"):
            side.append(u)
            todo.extend(u.users)
        else:
            raise Unsupported(f"{u.name} outside the experts reads their internals")
    return side


def _check_inputs(replaced: list[fx.Node], allowed: set[fx.Node]) -> None:
    rep = set(replaced)
    for n in replaced:
        for a in n.all_input_nodes:
            if a not in rep and a not in allowed and _is_tensor(a):
                raise Unsupported(f"the experts read {a.name} besides the tokens, routing indices and weights")


def _expert_layout(comps: list[list[fx.Node]], params: set[fx.Node], region: MoERegion) -> tuple[bool, int]:
    """Stacked (one computation over [E, ...] weights) or one computation per expert module."""
    used = [{p for n in c for p in _params_of(n, params)} for c in comps]
    if any(not u for u in used):
        raise Unsupported("an expert computation uses no expert weight")
    leads = {_shape(p)[0] for p in params} if params else set()
    if len(comps) == 1 and len(leads) == 1 and all(len(_shape(p)) >= 2 for p in params):
        return True, int(next(iter(leads)))
    if len(comps) == region.num_experts and all(len(u) == len(used[0]) for u in used) and \
            len(set().union(*used)) == sum(len(u) for u in used):
        return False, len(comps)
    raise Unsupported(f"{len(comps)} expert computations for {region.num_experts} experts, "
                      "neither one over stacked [E, ...] weights nor one per expert")


def _chain(gm: fx.GraphModule, comp: list[fx.Node], params: set[fx.Node], tokens: set[fx.Node], ids: fx.Node,
           replaced: set[fx.Node]) -> ExpertChain:
    """The chain of ``comp`` as a graph of its own (rows, params, routing-derived inputs)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members = set(comp)
    for r in _rows_in(comp, tokens):                     # row-wise casts before the first use
        while r.op == "call_function" and r.target in _ROWWISE and r in replaced and len(r.users) == 1:
            members.add(r)
            r = r.args[0]
    out = _chain_out(comp)
    n = out
    while n not in members:                              # row-wise casts after the last use
        members.add(n)
        n = n.args[0]
    rows = [a for a in _inputs_of(members, params) if a in tokens]
    aux = [a for a in _inputs_of(members, params) if a not in tokens]
    if len(rows) != 1:
        raise Unsupported(f"an expert reads {len(rows)} token-derived inputs, not one")
    plist = sorted({p for m in members for p in _params_of(m, params)}, key=lambda p: order[p])
    for m in members:
        for a in m.all_input_nodes:
            if a not in members and a not in params and a not in rows and a not in aux:
                raise Unsupported(f"an expert reads {a.name}")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {rows[0]: g.placeholder("rows")}
    for p in plist:
        env[p] = g.placeholder(p.name)
    for a in aux:
        env[a] = g.placeholder(a.name)
    for m in sorted(members, key=lambda m: order[m]):
        env[m] = g.node_copy(m, lambda a: env[a])
    g.output(env[out])
    return ExpertChain(graph=fx.GraphModule(gm, g), params=tuple(info(p).target_fqn for p in plist),
                       aux=_aux_graph(gm, aux, ids) if aux else None)


def _inputs_of(members: set[fx.Node], params: set[fx.Node]) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    for m in members:
        for a in m.all_input_nodes:
            if a not in members and a not in params and _is_tensor(a):
                seen[a] = None
    return list(seen)


def _aux_graph(gm: fx.GraphModule, aux: list[fx.Node], ids: fx.Node) -> fx.GraphModule:
    """ids -> the chain's routing-derived inputs, by the layer's own nodes."""
    from_ids = _descendants([ids])
    need = ((_ancestors(aux) | set(aux)) & from_ids) - {ids}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in need:
        for a in n.all_input_nodes:
            if a is not ids and a not in need:
                raise Unsupported(f"a routing-derived expert input also reads {a.name}")
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {ids: g.placeholder("ids")}
    for n in sorted(need, key=lambda n: order[n]):
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[a] for a in aux))
    return fx.GraphModule(gm, g)


# ------------------------------------------------------------------------ running experts

class LocalExperts:
    """Runs this rank's experts of a :class:`DroplessLayer` (``owned``: expert ids in slot
    order); ``params`` are the rank's expert tensors in :attr:`param_order`: the stacked
    weights holding the owned experts' rows, or each owned expert's own tensors in turn."""

    def __init__(self, layer: DroplessLayer, owned: Sequence[int]) -> None:
        self.stacked, self.num = layer.stacked, layer.num_experts
        self.chains = [layer.chains[0]] * len(owned) if layer.stacked else [layer.chains[e] for e in owned]
        self.param_order = layer.chains[0].params if layer.stacked else tuple(
            p for c in self.chains for p in c.params)
        self._ids_dtype = _dtype(layer.ids)

    def __call__(self, slot: int, rows: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        chain = self.chains[slot]
        if self.stacked:
            ps = [p[slot:slot + 1].expand(self.num, *p.shape[1:]) for p in params]
        else:
            n = len(chain.params)
            ps = list(params[slot * n:(slot + 1) * n])
        aux = ()
        if chain.aux is not None:
            aux = chain.aux(torch.zeros(rows.shape[0], 1, dtype=self._ids_dtype, device=rows.device))
        return chain.graph(rows, *ps, *aux)


def check_dropless(gm: fx.GraphModule, layer: DroplessLayer, tensors: dict[str, torch.Tensor]) -> float:
    """Relative error between the layer's own nodes and the dropless formula with
    :class:`LocalExperts` holding every expert, on random tokens and routing (at the
    example sizes) with the model's weights ``tensors``."""
    sizes = graph_info(gm).example_sizes
    tokens, k = (evaluate(s, sizes) for s in _shape(layer.ids))
    h = evaluate(_shape(layer.x)[-1], sizes)
    gen = torch.Generator().manual_seed(0)
    device = tensors[layer.params[0]].device
    x = torch.randn(tokens, h, generator=gen, dtype=torch.float64).to(device, _dtype(layer.x))
    e = layer.num_experts
    used = max(k, e - 1)                                           # the last expert gets no rows
    ids = torch.rand(tokens, used, generator=gen).argsort(dim=-1)[:, :k].to(device, _dtype(layer.ids))
    w = torch.rand(tokens, k, generator=gen, dtype=torch.float64).to(device, _dtype(layer.weights))
    with torch.no_grad():
        want = _run_replaced(gm, layer, x, ids, w, tensors)
        experts = LocalExperts(layer, list(range(e)))
        params = [tensors[p] for p in experts.param_order]
        outs = None
        for j in range(e):
            t, c = torch.where(ids == j)
            out = experts(j, x[t], params)
            outs = out.new_zeros(tokens, k, out.shape[-1]) if outs is None else outs
            outs[t, c] = out
        got = (outs * w.unsqueeze(-1)).sum(1)
    want = want.reshape(got.shape).to(torch.float64)
    return float((got.to(torch.float64) - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _run_replaced(gm: fx.GraphModule, layer: DroplessLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                  tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    env: dict[fx.Node, Any] = {layer.x: x.reshape(_example(layer.x)), layer.ids: ids, layer.weights: w}

    def value(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in env:
                env[a] = tensors[info(a).target_fqn] if a.op == "placeholder" and info(a).target_fqn in tensors \
                    else _example(a)
            return env[a]
        return a

    for n in layer.replaced:
        args = fx.node.map_aggregate(n.args, value)
        kwargs = fx.node.map_aggregate(n.kwargs, value)
        env[n] = n.target(*args, **kwargs)
    return env[layer.y]


# ------------------------------------------------------------------------------ helpers

def _example(n: fx.Node) -> Any:
    """A node's value at the example sizes, for sizes (SymInts) and shapes."""
    val = n.meta.get("val")
    if isinstance(val, torch.SymInt):
        return int(val.node.hint)
    if isinstance(val, (int, float, bool)):
        return val
    if _is_tensor(n):
        sizes = graph_info(n.graph.owning_module).example_sizes
        return tuple(evaluate(s, sizes) for s in _shape(n))
    raise Unsupported(f"the experts read {n.name}, whose example value is unknown")


def _is_tensor(n: fx.Node) -> bool:
    return bool(info(n).values) and len(info(n).values) == 1


def _shape(n: fx.Node) -> tuple:
    return tuple(info(n).values[0].shape)


def _dtype(n: fx.Node) -> torch.dtype:
    return info(n).values[0].dtype


def _params_of(n: fx.Node, params: set[fx.Node]) -> set[fx.Node]:
    out = {n} if n in params else set()
    for a in n.all_input_nodes:
        if a in params:
            out.add(a)
    return out


def _reach(todo: list[fx.Node], step) -> set[fx.Node]:
    """Every node reached from ``todo`` by repeatedly following ``step(node)``."""
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _ancestors(starts: Sequence[fx.Node]) -> set[fx.Node]:
    return _reach([a for s in starts for a in s.all_input_nodes], lambda n: n.all_input_nodes)


def _descendants(starts: Sequence[fx.Node]) -> set[fx.Node]:
    return _reach(list(starts), lambda n: n.users)


__all__ = ["DroplessLayer", "ExpertChain", "LocalExperts", "Unsupported", "find_dropless", "check_dropless"]
