"""Block pass: find repeated-block classes (layer 0..N-1 are one class) by structure.

Reads ``fqn`` and ``values`` of every node. Writes ``GraphInfo.block_classes`` and, on
each node inside a class member, ``block_class``/``block_member``.

Module boundaries only delimit candidate regions; two regions are the same class when
their subgraphs are identical: the same ATen ops in the same order, wired the same way
inside the region, with the same shapes, dtypes and parameter shapes. Names play no part,
so two differently named but identical layers match and two same-typed layers of
different widths do not. Size arithmetic nodes (``sym_size``, products of sizes) are
shared between layers by export's CSE, so they are compared by value, not by node. Classes are taken largest first; a class member nested in a
member already taken is dropped, and a class needs two members left to count.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict

import torch.fx as fx

from autopar.core.meta import BlockClass, graph_info, info, template_of, within


def block_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Group structurally identical module instances into block classes."""
    regions = _regions(gm)
    by_print: dict[str, list[str]] = defaultdict(list)
    values: dict[fx.Node, str] = {}          # a node's value text, once (it is in every enclosing region)
    prints: dict[str, str] = {}
    sizes = defaultdict(int)
    for nodes in regions.values():
        sizes[len(nodes)] += 1
    for fqn, nodes in regions.items():
        if sizes[len(nodes)] == 1:           # no other region as long: in no class (the layer list holder)
            continue
        template = _template_region(fqn, nodes, regions)
        fp = prints.get(template) if template is not None else None
        prints[fqn] = fp or _fingerprint(nodes, values)
        by_print[prints[fqn]].append(fqn)
    groups = [(fp, members) for fp, members in by_print.items() if len(members) > 1]
    groups.sort(key=lambda g: (-len(regions[g[1][0]]), g[1][0]))
    taken: list[str] = []
    classes: list[BlockClass] = []
    for fp, members in groups:
        free = [m for m in members if not any(within(m, t) for t in taken)]
        if len(free) < 2:
            continue
        cls = BlockClass(id=len(classes), members=tuple(free), nodes_per_member=len(regions[free[0]]),
                         module_type=graph_info(gm).module_types.get(free[0], ""), fingerprint=fp)
        classes.append(cls)
        taken.extend(free)
        for member in free:
            for node in regions[member]:
                info(node).block_class, info(node).block_member = cls.id, member
    graph_info(gm).block_classes = classes
    return gm


def _regions(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Every non-root module path with the op nodes made inside it (in graph order)."""
    regions: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not info(node).values:
            continue  # size arithmetic (sym_size, mul of sizes) is shared between layers by CSE
        fqn = info(node).fqn
        parts = fqn.split(".") if fqn else []
        for i in range(1, len(parts) + 1):
            regions[".".join(parts[:i])].append(node)
    return dict(regions)


def _template_region(fqn: str, nodes: list[fx.Node], regions: dict[str, list[fx.Node]]) -> str | None:
    """The region a copied layer's region was made from, node for node (``layers.9.attn`` ->
    ``layers.5.attn`` when every node is a copy of that region's, in order); it has the same
    fingerprint, since the copy checked ops, wiring and values (:mod:`autopar.passes.replicate`)."""
    made_from = [template_of(n) for n in nodes]
    if None in made_from:
        return None
    template = ".".join(info(made_from[0]).fqn.split(".")[:fqn.count(".") + 1])
    got = regions.get(template)
    return template if got is not None and len(got) == len(made_from) and all(
        a is b for a, b in zip(got, made_from)) else None


def _fingerprint(nodes: list[fx.Node], values: dict[fx.Node, str]) -> str:
    """A hash of the region's structure: ops, internal wiring, shapes; never names."""
    local = {n: i for i, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}
    parts = []
    for n in nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: _ref(a, local, external))
        vals = values.get(n)
        if vals is None:
            vals = values[n] = str([(_dims(v.shape), str(v.dtype)) for v in info(n).values])
        parts.append(f"{n.target}|{args}|{vals}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def _dims(shape: tuple) -> tuple[str, ...]:
    out = _DIMS.get(shape)
    if out is None:
        if len(_DIMS) > 50_000:
            _DIMS.clear()
        out = _DIMS[shape] = tuple(str(d) for d in shape)
    return out


_DIMS: dict[tuple, tuple[str, ...]] = {}     # a shape's text, printed once per distinct shape


def _ref(a: fx.Node, local: dict[fx.Node, int], external: dict[fx.Node, int]) -> str:
    if a in local:
        return f"%{local[a]}"
    rec = info(a)
    if not rec.values and a.op == "call_function":
        return f"size({a.meta.get('val')})"  # a symbolic size: equal by value, not by node
    shape = _dims(rec.values[0].shape) if rec.values else ()
    if rec.kind in ("param", "buffer"):
        return f"{rec.kind}{shape}"
    if a not in external:
        external[a] = len(external)
    return f"in{external[a]}{shape}"

