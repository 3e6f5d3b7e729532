"""Per-op sharding rules on the tensor axis, keyed by ATen op.

Each rule returns the op's non-replicated strategies (the replicated one is added by
:func:`autopar.passes.sharding.strategies`). Specs are given per tensor argument position
(:func:`~autopar.passes.sharding.tensor_args`). A rule only offers a ``Shard(d)`` when the
dim's size at the planning sizes divides by the axis size, so every slice is equal.

Gradient placements follow one principle: a rank's local backward is the op's backward on
the local pieces, so a ``Replicate`` input that meets a sharded operand (the input of a
column-parallel matmul, a norm weight under a sharded sequence, a broadcast operand)
gets a ``Partial`` gradient.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.sharding import OpCtx, rule
from autopar.core.placement import P, R, Spec, Strategy, shard

aten = torch.ops.aten
PARTIAL = Spec(P, R)          # a partial value; its gradient is whole on every rank
REP_PGRAD = Spec(R, P)        # a replicated value whose gradient comes back partial
REP = Spec(R, R)


# ---------------------------------------------------------------- elementwise

POINTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.gelu.default,
    aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.neg.default, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.cos.default, aten.sin.default,
    aten.reciprocal.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.type_as.default, aten.dropout.default, aten.where.self, aten.eq.Tensor, aten.eq.Scalar,
    aten.ne.Scalar, aten.lt.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.__and__.Tensor,
    aten.masked_fill.Scalar, aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar,
    aten.abs.default, aten.erf.default, aten.square.default, aten.minimum.default,
    aten.maximum.default, aten.clamp.default,
]
# Ops linear in every tensor argument together (a sum of partials stays partial).
_LINEAR_ALL = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.to.dtype,
               aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
               aten.contiguous.default, aten.alias.default, aten.type_as.default,
               aten.mul.Scalar, aten.div.Scalar}
# Ops linear in their first argument when the others are replicated.
_LINEAR_FIRST = {aten.mul.Tensor, aten.div.Tensor}
# Sums that are affine, not linear, when an operand is a number: P + 1e-6 would add the
# number once per rank.
_SUMS = {aten.add.Tensor, aten.sub.Tensor}


@rule(*POINTWISE)
def pointwise(ctx: OpCtx) -> list[Strategy]:
    """Broadcasting elementwise ops: shard any output dim the inputs share; an input
    broadcast along that dim stays replicated and gets a partial gradient."""
    out_shape = ctx.out_shapes[0]
    k = len(out_shape)
    found = []
    for d in range(k):
        if out_shape[d] <= 1 or not ctx.divides(out_shape[d]):
            continue
        specs = []
        for shp in ctx.in_shapes:
            di = d - (k - len(shp))
            specs.append(shard(di) if di >= 0 and shp[di] == out_shape[d] else REP_PGRAD)
        found.append(ctx.strategy(f"shard{d}", specs, [shard(d)]))
    found += _partial_strategies(ctx)
    return found


def _partial_strategies(ctx: OpCtx) -> list[Strategy]:
    op = ctx.node.target
    if op in _SUMS and not all(isinstance(a, fx.Node) for a in ctx.node.args[:2]):
        return []
    if op in _LINEAR_ALL and all(s == ctx.out_shapes[0] for s in ctx.in_shapes):
        return [ctx.strategy("partial", [PARTIAL] * len(ctx.in_shapes), [PARTIAL], work=1.0)]
    if op in _LINEAR_FIRST and ctx.in_shapes and ctx.in_shapes[0] == ctx.out_shapes[0] \
            and ctx.args and ctx.args[0] is ctx.node.args[0]:
        rest = [REP_PGRAD] * (len(ctx.in_shapes) - 1)
        return [ctx.strategy("partial", [PARTIAL] + rest, [PARTIAL], work=1.0)]
    return []


# ---------------------------------------------------------------- views and layout

def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Split a reshape into groups of src dims and dst dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i); pi = src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj = dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif pj < pi and j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape: tuple[int, ...]) -> int | None:
    """The outermost dim of a group with size > 1."""
    for d in dims:
        if shape[d] > 1:
            return d
    return None


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def reshape(ctx: OpCtx) -> list[Strategy]:
    """A sharded dim survives a reshape when it is the outermost dim of its group on both
    sides and the new outermost size still divides by n."""
    src, dst = ctx.in_shapes[0], ctx.out_shapes[0]
    groups = reshape_groups(src, dst)
    found = [ctx.strategy("partial", [PARTIAL], [PARTIAL], work=1.0)]
    for gi, gj in groups or []:
        a, b = _major(gi, src), _major(gj, dst)
        if a is not None and b is not None and ctx.divides(src[a]) and ctx.divides(dst[b]):
            found.append(ctx.strategy(f"shard{a}", [shard(a)], [shard(b)]))
    return found


def _remap(ctx: OpCtx, mapping: dict[int, int], *, partial: bool = True) -> list[Strategy]:
    """Strategies for a single-input layout op whose output dim ``mapping[d]`` is input dim ``d``."""
    src = ctx.in_shapes[0]
    found = [ctx.strategy(f"shard{d}", [shard(d)], [shard(e)])
             for d, e in mapping.items() if src[d] > 1 and ctx.divides(src[d])]
    if partial:
        found.append(ctx.strategy("partial", [PARTIAL], [PARTIAL], work=1.0))
    return found


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


@rule(aten.transpose.int)
def transpose(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    a, b = _dim(ctx.arg(1, "dim0"), nd), _dim(ctx.arg(2, "dim1"), nd)
    perm = {d: d for d in range(nd)}
    perm[a], perm[b] = b, a
    return _remap(ctx, perm)


@rule(aten.t.default)
def t(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    return _remap(ctx, {0: 1, 1: 0} if nd == 2 else {0: 0})


@rule(aten.permute.default)
def permute(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    dims = [_dim(d, nd) for d in ctx.arg(1, "dims")]
    return _remap(ctx, {d: i for i, d in enumerate(dims)})


@rule(aten.unsqueeze.default)
def unsqueeze(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    at = _dim(ctx.arg(1, "dim"), nd + 1)
    return _remap(ctx, {d: d if d < at else d + 1 for d in range(nd)})


@rule(aten.squeeze.dim)
def squeeze(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    at = _dim(ctx.arg(1, "dim"), nd)
    if ctx.in_shapes[0][at] != 1:
        return _remap(ctx, {d: d for d in range(nd)})
    return _remap(ctx, {d: d if d < at else d - 1 for d in range(nd) if d != at})


@rule(aten.expand.default)
def expand(ctx: OpCtx) -> list[Strategy]:
    src, dst = ctx.in_shapes[0], ctx.out_shapes[0]
    lead = len(dst) - len(src)
    keep = {d: d + lead for d in range(len(src)) if src[d] == dst[d + lead]}
    return _remap(ctx, keep, partial=False)


@rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def slice_(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    at = _dim(ctx.arg(1, "dim", 0), nd)
    if ctx.node.target is aten.select.int:
        mapping = {d: d if d < at else d - 1 for d in range(nd) if d != at}
    else:
        mapping = {d: d for d in range(nd) if d != at}
    return _remap(ctx, mapping)


@rule(aten.cat.default)
def cat(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.out_shapes[0])
    at = _dim(ctx.arg(1, "dim", 0), nd)
    if any(len(s) != nd for s in ctx.in_shapes):
        return []
    found = [ctx.strategy(f"shard{d}", [shard(d)] * len(ctx.in_shapes), [shard(d)])
             for d in range(nd) if d != at and ctx.divides(ctx.out_shapes[0][d])]
    found.append(ctx.strategy("partial", [PARTIAL] * len(ctx.in_shapes), [PARTIAL], work=1.0))
    return found


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(ctx: OpCtx) -> list[Strategy]:
    nd = len(ctx.in_shapes[0])
    at = _dim(ctx.arg(2, "dim", 0), nd)
    k = len(ctx.out_shapes)
    found = [ctx.strategy(f"shard{d}", [shard(d)], [shard(d)] * k)
             for d in range(nd) if d != at and ctx.divides(ctx.in_shapes[0][d])]
    found.append(ctx.strategy("partial", [PARTIAL], [PARTIAL] * k, work=1.0))
    return found


@rule(aten.repeat_interleave.self_int)
def repeat_interleave(ctx: OpCtx) -> list[Strategy]:
    """Along its own dim too: contiguous shards of the input repeat into contiguous shards
    of the output (grouped-query attention's key/value heads)."""
    nd = len(ctx.in_shapes[0])
    at = ctx.arg(2, "dim")
    if at is None:
        return []
    return _remap(ctx, {d: d for d in range(nd)})


# ---------------------------------------------------------------- matmuls

@rule(aten.linear.default)
def linear(ctx: OpCtx) -> list[Strategy]:
    """x[..., k] @ w[o, k]^T (+ b[o]): column (w split on o), row (w split on k, partial
    output, bias added on one rank's share), or split on a leading dim of x."""
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    bias = len(ctx.in_shapes) == 3
    o, k = w
    nd = len(x)
    found = []
    if ctx.divides(o):
        found.append(ctx.strategy("colwise", [REP_PGRAD, shard(0)] + [shard(0)] * bias, [shard(nd - 1)]))
    if ctx.divides(k):
        found.append(ctx.strategy("rowwise", [shard(nd - 1), shard(1)] + [PARTIAL] * bias, [PARTIAL]))
    if not is_param(ctx.args[1]):
        for d in range(nd - 1):
            if ctx.divides(x[d]):
                found.append(ctx.strategy(f"shard{d}", [shard(d), REP_PGRAD] + [REP_PGRAD] * bias, [shard(d)]))
    return found


def is_param(node) -> bool:
    """Is ``node`` a parameter, possibly seen through views? On the tensor axis a matmul
    with a parameter splits the parameter or runs replicated: splitting only its tokens
    while every rank keeps the whole weight is data parallelism, the data axis's job."""
    from autopar.passes.flops import is_view_like
    from autopar.core.meta import info
    while node.op == "call_function" and is_view_like(node) and node.args:
        node = node.args[0]
    return node.op == "placeholder" and info(node).kind == "param"


@rule(aten.mm.default)
def mm(ctx: OpCtx) -> list[Strategy]:
    (m, k), (_, n_) = ctx.in_shapes
    found = []
    if ctx.divides(n_):
        found.append(ctx.strategy("colwise", [REP_PGRAD, shard(1)], [shard(1)]))
    if ctx.divides(k):
        found.append(ctx.strategy("rowwise", [shard(1), shard(0)], [PARTIAL]))
    if ctx.divides(m) and not is_param(ctx.args[1]):
        found.append(ctx.strategy("shard0", [shard(0), REP_PGRAD], [shard(0)]))
    return found


@rule(aten.addmm.default)
def addmm(ctx: OpCtx) -> list[Strategy]:
    """bias + a[m, k] @ b[k, n] with a 1-d bias (the Conv1D form)."""
    bias, (m, k), (_, n_) = ctx.in_shapes
    if len(bias) != 1:
        return []
    found = []
    if ctx.divides(n_):
        found.append(ctx.strategy("colwise", [shard(0), REP_PGRAD, shard(1)], [shard(1)]))
    if ctx.divides(k):
        found.append(ctx.strategy("rowwise", [PARTIAL, shard(1), shard(0)], [PARTIAL]))
    if ctx.divides(m) and not is_param(ctx.args[2]):
        found.append(ctx.strategy("shard0", [REP_PGRAD, shard(0), REP_PGRAD], [shard(0)]))
    return found


@rule(aten.bmm.default)
def bmm(ctx: OpCtx) -> list[Strategy]:
    (bsz, m, k), (_, _, n_) = ctx.in_shapes
    found = []
    if ctx.divides(bsz):
        found.append(ctx.strategy("shard0", [shard(0), shard(0)], [shard(0)]))
    if ctx.divides(n_):
        found.append(ctx.strategy("colwise", [REP_PGRAD, shard(2)], [shard(2)]))
    if ctx.divides(k):
        found.append(ctx.strategy("rowwise", [shard(2), shard(1)], [PARTIAL]))
    if ctx.divides(m):
        found.append(ctx.strategy("shard1", [shard(1), REP_PGRAD], [shard(1)]))
    return found


@rule(aten.outer.default)
def outer(ctx: OpCtx) -> list[Strategy]:
    (m,), (n_,) = ctx.in_shapes
    found = []
    if ctx.divides(m):
        found.append(ctx.strategy("shard0", [shard(0), REP_PGRAD], [shard(0)]))
    if ctx.divides(n_):
        found.append(ctx.strategy("shard1", [REP_PGRAD, shard(0)], [shard(1)]))
    return found


@rule(aten.scaled_dot_product_attention.default)
def sdpa(ctx: OpCtx) -> list[Strategy]:
    """q, k, v [batch, heads, seq, dim]: split batch or heads on all three (and on a mask
    that is not broadcast there)."""
    q = ctx.in_shapes[0]
    if len(q) != 4 or any(len(s) != 4 for s in ctx.in_shapes[1:3]):
        return []
    found = []
    for d in (0, 1):
        if not all(ctx.divides(s[d]) for s in ctx.in_shapes[:3]):
            continue
        specs = [shard(d)] * 3
        for mask in ctx.in_shapes[3:]:
            di = d - (4 - len(mask))
            specs.append(shard(di) if di >= 0 and mask[di] == q[d] else REP_PGRAD)
        found.append(ctx.strategy("heads" if d == 1 else "batch", specs, [shard(d)]))
    return found


# ---------------------------------------------------------------- embeddings, norms, reductions

@rule(aten.embedding.default)
def embedding(ctx: OpCtx) -> list[Strategy]:
    """weight[V, h] looked up by indices: split h; split the indices' dims; or split the
    vocabulary (each rank looks up the ids it owns, zeros elsewhere: a partial output)."""
    (vocab, hidden), idx = ctx.in_shapes
    nd = len(ctx.out_shapes[0])
    found = []
    if ctx.divides(hidden):
        found.append(ctx.strategy("hidden", [shard(1), REP], [shard(nd - 1)]))
    if ctx.divides(vocab):
        found.append(ctx.strategy("vocab", [shard(0), REP], [PARTIAL], local_op="vocab_parallel_embedding"))
    for d in range(len(idx) * (not is_param(ctx.args[0]))):
        if ctx.divides(idx[d]):
            found.append(ctx.strategy(f"shard{d}", [REP_PGRAD, shard(d)], [shard(d)]))
    return found


@rule(aten.layer_norm.default)
def layer_norm(ctx: OpCtx) -> list[Strategy]:
    """Split any dim outside the normalized ones (sequence parallelism); weight and bias
    stay replicated and get partial gradients."""
    x = ctx.in_shapes[0]
    normalized = len(ctx.arg(1, "normalized_shape"))
    params = len(ctx.in_shapes) - 1
    return [ctx.strategy(f"shard{d}", [shard(d)] + [REP_PGRAD] * params, [shard(d)])
            for d in range(len(x) - normalized) if ctx.divides(x[d])]


def _reduced_dims(ctx: OpCtx) -> set[int]:
    nd = len(ctx.in_shapes[0])
    dims = ctx.arg(1, "dim")
    if dims is None:
        return set(range(nd))
    dims = [dims] if isinstance(dims, int) else dims
    return {_dim(d, nd) for d in dims} if dims else set(range(nd))


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.softmax.int, aten._softmax.default,
      aten.log_softmax.int, aten._log_softmax.default, aten.cumsum.default, aten.topk.default,
      aten.argmax.default, aten.max.dim)
def reduction(ctx: OpCtx) -> list[Strategy]:
    """Reductions and scans over some dims: any other dim may be split. A sum over a split
    dim gives a partial result."""
    op = ctx.node.target
    nd = len(ctx.in_shapes[0])
    along = {_dim(ctx.arg(1 if op is not aten.topk.default else 2, "dim", -1), nd)} \
        if op not in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default) else _reduced_dims(ctx)
    keep = len(ctx.out_shapes[0]) == nd
    k_out = len(ctx.out_shapes)
    found = []
    for d in range(nd):
        if d in along or not ctx.divides(ctx.in_shapes[0][d]):
            continue
        e = d if keep else d - sum(1 for r in along if r < d)
        found.append(ctx.strategy(f"shard{d}", [shard(d)], [shard(e)] * k_out))
    if op in (aten.sum.dim_IntList, aten.mean.dim):
        found.append(ctx.strategy("partial", [PARTIAL], [PARTIAL], work=1.0))
    return found
