"""Fusion pass: ops written out in a model's code that keep more activations for backward than
they need, recognised in the ATen graph and replaced by the fused ops of
:mod:`autopar.runtime.fused` (same values and gradients, bit for bit; fewer tensors kept).

- **SwiGLU**: ``mul(silu(g), u)`` whose ``silu`` has no other reader (transformers' Llama,
  Qwen2, Mistral, Mixtral and DeepSeek MLPs and experts); GeGLU's ``mul(gelu(g), u)`` alike
  (Gemma). Frees ``silu(g)``; with the down projection that alone reads it, ``linear(silu(g) *
  u, w)`` (or transformers' grouped expert matmul on a CPU), the product too.
- **GELU into a projection**: ``linear(gelu(h), w[, b])`` where the projection alone reads the
  gelu (GPT MLPs). Frees ``gelu(h)``.
- **RMSNorm**: transformers' ``w * (x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)``
  with ``x32 = x.to(float32)`` (each cast optional), every intermediate read only inside the
  pattern, or Gemma's ``((x32 * rsqrt(...)) * (1 + w)).type_as(x)``. Frees the normalised rows.
- **A norm into its projections**: ``linear(y, w[, b])`` where ``y`` is an RMSNorm's (above) or
  ``layer_norm``'s output (or a view of it, or, on a tensor axis, the rewrite's conversion of it
  to a replicated value: a copy, or sequence parallelism's all-gather) and every reader of ``y``
  is such a projection (q, k and v; gate and up). Frees ``y``: each projection keeps the norm's
  input instead, which the norm keeps anyway (on a sequence-parallel axis, its own share of the
  sequence), and backward recomputes the output and converts it again (gathers it again).
  Where the projections read the norm's output itself and their weights exist before the norm,
  the norm and its projections become one op (``autopar_norm_project``): one autograd node.

:func:`unkept` names, for the memory pass, the values the fused ops do not keep (so the planner
and the simulator price the runtime's saved set); :func:`fuse` rewrites a graph. The final node
of each pattern keeps its place and name (what was planned for it, recomputation regions
included, still holds); the nodes it absorbs leave the graph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.runtime.fused import (autopar_gelu_linear, autopar_norm_linear, autopar_norm_project, autopar_rms_norm,
                                   autopar_swiglu, autopar_swiglu_grouped_mm, autopar_swiglu_linear)

aten = torch.ops.aten
_CHECKS = {aten._assert_tensor_metadata.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}


@dataclass(frozen=True)
class Match:
    """One pattern: its final node, the arguments the fused op takes, the nodes it absorbs and
    the values it no longer keeps."""

    node: fx.Node
    target: object
    args: tuple
    absorbed: tuple[fx.Node, ...]
    unkept: tuple[fx.Node, ...]


def _readers(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in _CHECKS]


def _only_reader(n: fx.Node, reader: fx.Node) -> bool:
    return isinstance(n, fx.Node) and _readers(n) == [reader]


def _call(n: object, *targets: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _cast(n: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """``(input, dtype)`` of a plain dtype cast node, else None."""
    if n.target is aten.to.dtype and len(n.args) >= 2 and isinstance(n.args[1], torch.dtype) \
            and not n.kwargs and len(n.args) == 2:
        return n.args[0], n.args[1]
    return None


def _gate(s: object) -> str | None:
    """The gate activation ``s`` is (:data:`autopar.runtime.fused.GATES`), else None."""
    if _call(s, aten.silu.default) and len(s.args) == 1 and not s.kwargs:
        return "silu"
    if _call(s, aten.gelu.default) and len(s.args) == 1 and set(s.kwargs) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(s.kwargs.get("approximate", "none"))
    return None


def _swiglu(m: fx.Node) -> Match | None:
    if not _call(m, aten.mul.Tensor) or len(m.args) != 2 or m.kwargs:
        return None
    for i in (0, 1):
        s, u = m.args[i], m.args[1 - i]
        act = _gate(s)
        if act is not None and isinstance(u, fx.Node) and _only_reader(s, m):
            g = s.args[0]
            if isinstance(g, fx.Node) and _same_shape(g, u):
                return Match(m, autopar_swiglu, (g, u, act), (s,), (s,))
    return None


def _swiglu_linear(lin: fx.Node) -> Match | None:
    """``linear(swiglu, w[, b])`` where the linear is the product's only reader."""
    if not _call(lin, aten.linear.default) or lin.kwargs or not isinstance(lin.args[0], fx.Node):
        return None
    inner = _swiglu(lin.args[0])
    if inner is None or not _only_reader(inner.node, lin):
        return None
    g, u, act = inner.args
    bias = lin.args[2] if len(lin.args) > 2 else None
    return Match(lin, autopar_swiglu_linear, (g, u, lin.args[1], bias, act), (inner.node, *inner.absorbed),
                 (inner.node, *inner.unkept))


GROUPED_MM = "transformers.grouped_mm_fallback.default"     # transformers' expert matmul on a CPU


def _swiglu_grouped_mm(mm: fx.Node) -> Match | None:
    """``grouped_mm_fallback(swiglu[.to(dtype)], w, offs)`` where the matmul (through the cast) is
    the product's only reader."""
    if mm.op != "call_function" or str(mm.target) != GROUPED_MM or mm.kwargs or len(mm.args) != 3 \
            or not isinstance(mm.args[0], fx.Node):
        return None
    p, cast, absorbed = mm.args[0], None, ()
    if _call(p, aten.to.dtype) and _cast(p) and _only_reader(p, mm):
        (p, cast), absorbed = _cast(p), (p,)
        if not isinstance(p, fx.Node) or not _only_reader(p, absorbed[0]):
            return None
    elif not _only_reader(p, mm):
        return None
    inner = _swiglu(p)
    if inner is None or inner.args[2] != "silu":
        return None
    g, u, _ = inner.args
    return Match(mm, autopar_swiglu_grouped_mm, (g, u, mm.args[1], mm.args[2], cast),
                 (*absorbed, inner.node, *inner.absorbed), (*absorbed, inner.node, *inner.unkept))


def _rms_norm(m: fx.Node) -> Match | None:
    if not _call(m, aten.mul.Tensor) or len(m.args) != 2 or m.kwargs:
        return None
    for i in (0, 1):
        w, nd = m.args[i], m.args[1 - i]
        if not isinstance(w, fx.Node) or not isinstance(nd, fx.Node):
            continue
        absorbed, out = [], None
        n = nd
        if _call(nd, aten.to.dtype) and _cast(nd) and _only_reader(nd, m):
            n, out = _cast(nd)
            absorbed.append(nd)
            if not _call(n, aten.mul.Tensor) or not _only_reader(n, nd):
                continue
        elif not _only_reader(nd, m):
            continue
        if not _call(n, aten.mul.Tensor) or len(n.args) != 2:
            continue
        xm, r = n.args
        if not (_call(r, aten.rsqrt.default) and _only_reader(r, n)):
            continue
        a = r.args[0]
        if not (_call(a, aten.add.Tensor) and _only_reader(a, r) and isinstance(a.args[1], float)):
            continue
        mean = a.args[0]
        if not (_call(mean, aten.mean.dim) and _only_reader(mean, a) and list(mean.args[1]) in ([-1],)
                and len(mean.args) > 2 and mean.args[2] is True):
            continue
        p = mean.args[0]
        if not (_call(p, aten.pow.Tensor_Scalar) and _only_reader(p, mean) and p.args[1] == 2 and p.args[0] is xm):
            continue
        absorbed += [n, r, a, mean, p]            # readers before what they read
        x, mid = xm, None
        if _call(xm, aten.to.dtype) and _cast(xm) and set(_readers(xm)) == {p, n}:
            x, mid = _cast(xm)
            absorbed.append(xm)
        return Match(m, autopar_rms_norm, (x, w, a.args[1], mid, out), tuple(absorbed), (n,) + ((nd,) if out else ()))
    return None


def _rms_norm_cast(c: fx.Node) -> Match | None:
    """An RMSNorm (:func:`_rms_norm`) cast after its weight, the cast its product's only reader:
    ``(n * (1 + w)).type_as(x)`` (Gemma) or ``.to(dtype)``."""
    if _call(c, aten.type_as.default) and len(c.args) == 2 and not c.kwargs:
        post = _dtype(c.args[1])
    elif _call(c, aten.to.dtype) and _cast(c):
        post = _cast(c)[1]
    else:
        return None
    y = c.args[0]
    inner = _rms_norm(y) if post is not None and _call(y, aten.mul.Tensor) and _only_reader(y, c) else None
    if inner is None:
        return None
    return Match(c, autopar_rms_norm, (*inner.args[:5], post), (y, *inner.absorbed), inner.unkept)


def _dtype(n: object) -> torch.dtype | None:
    from autopar.core.meta import info
    vals = info(n).values if isinstance(n, fx.Node) else None
    return getattr(vals[0], "dtype", None) if vals else None


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    from autopar.core.meta import info
    va, vb = info(a).values, info(b).values
    if not va or not vb:
        return False
    try:
        return tuple(va[0].shape) == tuple(vb[0].shape) and va[0].dtype == vb[0].dtype
    except (AttributeError, TypeError):
        return False


def _gelu_linear(lin: fx.Node) -> Match | None:
    """``linear(gelu(h), w[, b])`` where the linear is the gelu's only reader."""
    if not _call(lin, aten.linear.default) or lin.kwargs or not _call(lin.args[0], aten.gelu.default):
        return None
    a = lin.args[0]
    if not _only_reader(a, lin) or len(a.args) != 1 or set(a.kwargs) - {"approximate"}:
        return None
    bias = lin.args[2] if len(lin.args) > 2 else None
    return Match(lin, autopar_gelu_linear, (a.args[0], lin.args[1], bias, a.kwargs.get("approximate", "none")),
                 (a,), (a,))


def _norm_recipe(y: fx.Node) -> tuple | None:
    """``(kind, x, weight, bias, eps, shape, mid, out, post)`` of a norm whose output is ``y``: an
    ``aten.layer_norm`` or transformers' RMSNorm (:func:`_rms_norm`), else None."""
    if _call(y, aten.layer_norm.default) and not y.kwargs and isinstance(y.args[0], fx.Node):
        a = [*y.args, *(None, None, None, None, 1e-5)[len(y.args):]]      # the defaults not written
        return ("layer", a[0], a[2], a[3], a[4], list(a[1]), None, None, None)
    rms = _rms_norm(y) if _call(y, aten.mul.Tensor) else _rms_norm_cast(y)
    if rms is not None:
        x, w, eps, mid, out, post = (*rms.args, None)[:6]
        return ("rms", x, w, None, eps, None, mid, out, post)
    return None


def _projects(lin: fx.Node, y: fx.Node) -> bool:
    """Whether ``lin`` is a plain projection of ``y``: ``linear(y, w[, b])``, ``y`` nowhere else."""
    return (_call(lin, aten.linear.default) and not lin.kwargs and lin.args[0] is y
            and all(a is not y for a in lin.args[1:]))


def _conversion(y: fx.Node) -> tuple | None:
    """``(source, its (src, dst, group, n))`` where ``y`` is the tensor axis's conversion of a
    value for projections that read it whole (``autopar::redistribute``, inserted by the
    rewrite): replicated to replicated (forward a copy; backward the gradients' all-reduce) or
    sequence-sharded to replicated (sequence parallelism: forward an all-gather). Else None."""
    from autopar.core.placement import Replicate, Spec, transition
    from autopar.runtime import collectives  # noqa: F401 - registers autopar::redistribute
    if not (_call(y, torch.ops.autopar.redistribute.default) and not y.kwargs and len(y.args) == 5
            and isinstance(y.args[0], fx.Node) and _readers(y.args[0]) == [y]):
        return None
    src, dst = Spec.parse(y.args[1]).value, Spec.parse(y.args[2]).value
    if not isinstance(dst, Replicate) or transition(src, dst).kind not in ("none", "all_gather"):
        return None
    return y.args[0], tuple(y.args[1:])


def _norm_linear(lin: fx.Node) -> Match | None:
    """``linear(norm(x), w[, b])`` where every reader of the norm's output is such a projection
    (the output directly, a view of it, or the tensor axis's conversion of it: :func:`_conversion`;
    the fused op then converts its recomputed output the same way)."""
    if not _call(lin, aten.linear.default) or lin.kwargs or not isinstance(lin.args[0], fx.Node):
        return None
    y = lin.args[0]
    if not all(_projects(u, y) for u in _readers(y)):
        return None
    base, conv = y, None
    got = _conversion(y)
    if got is not None:
        base, conv = got
    # a view of the norm's output (DeepSeek's latent norm into its projection)
    if _call(base, aten.view.default, aten.reshape.default) and isinstance(base.args[0], fx.Node) \
            and _readers(base.args[0]) == [base]:
        base = base.args[0]
    recipe = _norm_recipe(base)
    if recipe is None:
        return None
    bias = lin.args[2] if len(lin.args) > 2 else None
    *recipe, post = recipe
    return Match(lin, autopar_norm_linear, (y, lin.args[1], bias, *recipe, len(_readers(y)), post, conv), (),
                 (y,) if base is y else (y, base))


def matches(gm: fx.GraphModule) -> list[Match]:
    """Every pattern of the module docstring in ``gm``."""
    out, inside = [], set()
    for n in reversed(list(gm.graph.nodes)):      # a down projection takes its SwiGLU in
        if n in inside:
            continue
        m = (_swiglu_linear(n) or _swiglu_grouped_mm(n) or _gelu_linear(n) or _norm_linear(n) or _swiglu(n)
             or _rms_norm_cast(n) or _rms_norm(n))
        if m is not None:
            out.append(m)
            inside.update(m.absorbed)
    return out[::-1]


def unkept(gm: fx.GraphModule) -> set[fx.Node]:
    """The values the fused ops do not keep for backward (read by the memory pass)."""
    return {u for m in matches(gm) for u in m.unkept}


def fuse(gm: fx.GraphModule) -> int:
    """Replace each pattern by its fused op (module docstring); returns how many."""
    found = matches(gm)
    for m in found:
        m.node.target, m.node.args, m.node.kwargs = m.target, m.args, {}
        for a in m.absorbed:
            for check in [u for u in a.users if u.target in _CHECKS]:
                gm.graph.erase_node(check)
        for a in m.absorbed:                      # readers first
            if not a.users:
                gm.graph.erase_node(a)
    _project(gm)
    if found:
        gm.graph.lint()
        gm.recompile()
    return len(found)


_ADDED = ("flops_fwd", "flops_bwd", "bytes_fwd", "bytes_bwd", "saved_bytes", "fused_bytes")


def _take_costs(into: fx.Node, gone: fx.Node) -> None:
    """``gone`` leaves the graph with its work done by ``into``'s op: ``into`` takes its FLOPs,
    bytes and the bytes kept for backward on its behalf (a GELU tail's input), so sums over the
    fused graph still count them."""
    from autopar.core.meta import info
    a, b = info(into), info(gone)
    for field in _ADDED:
        setattr(a, field, getattr(a, field) + getattr(b, field))


def _rows_kept(v: fx.Node, y: fx.Node, order: dict) -> bool:
    """Whether ``v`` reshapes ``y`` keeping its last dimension (so its rows are ``y``'s, in
    order) to a shape known where ``y`` is made."""
    from autopar.core.meta import info
    if not (_call(v, aten.view.default, aten.reshape.default) and len(v.args) == 2 and not v.kwargs
            and v.args[0] is y and isinstance(v.args[1], (list, tuple)) and v.args[1]):
        return False
    vals = info(y).values
    last = vals[0].shape[-1] if vals and vals[0].shape else None
    return (isinstance(v.args[1][-1], int) and last is not None and getattr(last, "is_number", True)
            and int(last) == v.args[1][-1]
            and all(not isinstance(d, fx.Node) or order[d] < order[y] for d in v.args[1]))


def _project(gm: fx.GraphModule) -> int:
    """Each norm whose output only :func:`autopar_norm_linear` projections read (directly, or one
    through a reshape that keeps its rows: :func:`_rows_kept`; no tensor-axis conversion
    between) becomes one :func:`autopar_norm_project` computing the norm and every projection,
    where each projection's weight and bias exist before the norm (not, say, a ZeRO-3 gather
    placed before the projection) and the norm and its projections belong to the same layer (so
    one recomputation region holds all or none of them). A projection whose output only a GELU
    projection reads takes it in as its tail. The norm node takes the op (its place and name
    kept) and each projection node (or its tail's) becomes an item of its result (their names
    kept); a tail's projection and the reshape leave the graph, their costs taken over
    (:func:`_take_costs`). Returns how many norms."""
    from autopar.core.meta import info
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for norm in list(gm.graph.nodes):
        if norm.op != "call_function" or norm.target not in (autopar_rms_norm, aten.layer_norm.default):
            continue
        projections = _readers(norm)
        view = projections[0] if len(projections) == 1 and _rows_kept(projections[0], norm, order) else None
        if view is not None:                 # a reshape keeping the rows (DeepSeek's latent norm)
            projections = _readers(view)
        y = norm if view is None else view
        if not projections or not all(
                p.target is autopar_norm_linear and p.args[0] is y and p.args[13] is None
                and p.args[11] == len(projections) and p.args[4] is norm.args[0]
                and all(not isinstance(a, fx.Node) or order[a] < order[norm] for a in p.args[1:3])
                and info(p).block_member == info(norm).block_member for p in projections):
            continue
        projections.sort(key=order.__getitem__)
        _, _, _, kind, x, nw, nb, eps, shape, mid, out, _, post, _ = projections[0].args
        # a projection whose output only a GELU projection reads (GPT's MLP) takes it in as its tail
        tails = {i: g for i, p in enumerate(projections) if len(_readers(p)) == 1
                 for g in _readers(p) if g.target is autopar_gelu_linear and g.args[0] is p
                 and all(not isinstance(a, fx.Node) or order[a] < order[norm] for a in g.args[1:3])
                 and info(g).block_member == info(norm).block_member}
        for check in [u for u in norm.users if u.target in _CHECKS]:
            gm.graph.erase_node(check)
        norm.target, norm.kwargs = autopar_norm_project, {}
        views = () if view is None else (view.args[1],) * len(projections)
        norm.args = (x, nw, nb, (kind, eps, shape, mid, out, post), tuple((i, g.args[3]) for i, g in tails.items()),
                     views, *(a for p in projections for a in (p.args[1], p.args[2])),
                     *(a for g in tails.values() for a in (g.args[1], g.args[2])))
        for i, p in enumerate(projections):
            p.target, p.args, p.kwargs = operator.getitem, (norm, i), {}
        for i, g in tails.items():           # the tail's node gives the output; the projection's leaves
            g.target, g.args, g.kwargs = operator.getitem, (norm, i), {}
            _take_costs(g, projections[i])
            gm.graph.erase_node(projections[i])
        if view is not None:
            _take_costs(projections[0] if 0 not in tails else tails[0], view)
            gm.graph.erase_node(view)
        done += 1
    return done


__all__ = ["Match", "matches", "unkept", "fuse"]
