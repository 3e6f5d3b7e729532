"""Sharding rules for the ops library models (``transformers``) add around the core ones:
broadcasting ``matmul`` and ``baddbmm`` (Falcon's linear layers, eager attention), ``x.T``,
tensor factories and the mask-building ops, and the ops that run replicated on purpose, each
with the reason ``dump`` shows.
"""
from __future__ import annotations

import torch

from autopar.passes.sharding import OpCtx, rule
from autopar.passes.sharding_rules import POINTWISE, REP_PGRAD, pointwise
from autopar.core.placement import P, R, Spec, Strategy, shard

aten = torch.ops.aten
PARTIAL = Spec(P, R)

# Elementwise ops (comparisons, casts, in-mask selections) that the core list lacks.
MORE_POINTWISE = [aten.to.device, aten.gt.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.ge.Scalar,
                  aten.le.Scalar, aten.ne.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf,
                  aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
                  aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
                  aten.pow.Scalar, aten.rsub.Scalar, aten.sub.Tensor, aten.sigmoid.default,
                  aten.log1p.default, aten.expm1.default, aten.floor.default, aten.ceil.default,
                  aten.remainder.Scalar, aten.floor_divide.default, aten.masked_fill.Tensor]
rule(*[op for op in MORE_POINTWISE if op not in POINTWISE])(pointwise)

# Ops that make a tensor from sizes (and at most another tensor's shape, dtype and device):
# every rank makes the whole one, which costs nothing to keep replicated.
FACTORIES = [aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
             aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
             aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
             aten.lift_fresh_copy.default, aten.zeros_like.default, aten.ones_like.default,
             aten.full_like.default]

# Ops that run replicated by design, and why (``autopar dump --after plan`` shows it).
REPLICATED = {
    aten.index.Tensor: "advanced indexing reads positions chosen by data",
    aten.diff.default: "mask building on token positions (tiny, integer)",
    aten.repeat.default: "mask building (tiny)",
    aten.cross_entropy_loss.default: "the loss reads whole rows of logits over the vocabulary",
    aten.nll_loss_forward.default: "the loss reads whole rows over the classes",
    aten.add_.Tensor: "an in-place update of a value other ops may read",
    aten.copy_.default: "an in-place copy",
    aten.fill_.Tensor: "an in-place write",
    aten.fill_.Scalar: "an in-place write",
    aten.masked_fill_.Scalar: "an in-place write",
}
for _op in FACTORIES:
    REPLICATED.setdefault(_op, "makes a new tensor from sizes: every rank makes the whole one")


@rule(*REPLICATED)
def replicated_by_design(ctx: OpCtx) -> list[Strategy]:
    return []


def replication_reason(target: object) -> str | None:
    """Why an op runs replicated, when it does so by design."""
    return REPLICATED.get(target)


def _dim(d: int, nd: int) -> int:
    return d % nd if nd else 0


@rule(aten.numpy_T.default)
def numpy_t(ctx: OpCtx) -> list[Strategy]:
    """``x.T`` reverses the dims."""
    nd = len(ctx.in_shapes[0])
    found = [ctx.strategy(f"shard{d}", [shard(d)], [shard(nd - 1 - d)])
             for d in range(nd) if ctx.divides(ctx.in_shapes[0][d])]
    found.append(ctx.strategy("partial", [PARTIAL], [PARTIAL], work=1.0))
    return found


@rule(aten.matmul.default)
def matmul(ctx: OpCtx) -> list[Strategy]:
    """``a @ b`` with both at least 2-d: split the rows of ``a`` (``b`` whole), the columns of
    ``b`` (``a`` whole), the contracted dim of both (a partial result), or a batch dim both
    share (one that broadcasts stays whole)."""
    if len(ctx.in_shapes) != 2:
        return []
    (a, b), out = ctx.in_shapes, ctx.out_shapes[0]
    if len(a) < 2 or len(b) < 2:
        return []
    k = len(out)
    found = []
    if ctx.divides(out[-2]):
        found.append(ctx.strategy("rows", [shard(len(a) - 2), REP_PGRAD], [shard(k - 2)]))
    if ctx.divides(out[-1]):
        found.append(ctx.strategy("colwise", [REP_PGRAD, shard(len(b) - 1)], [shard(k - 1)]))
    if ctx.divides(a[-1]):
        found.append(ctx.strategy("rowwise", [shard(len(a) - 1), shard(len(b) - 2)], [PARTIAL]))
    for d in range(k - 2):
        if not ctx.divides(out[d]):
            continue
        specs = []
        for shp in (a, b):
            di = d - (k - len(shp))
            specs.append(shard(di) if di >= 0 and shp[di] == out[d] else REP_PGRAD)
        found.append(ctx.strategy(f"batch{d}", specs, [shard(d)]))
    return found


@rule(aten.baddbmm.default)
def baddbmm(ctx: OpCtx) -> list[Strategy]:
    """``beta * c + alpha * (a @ b)`` over 3-d ``a``, ``b``: split the batch, the rows of ``a``
    or the columns of ``b``, and ``c`` the same way where it has that dim (else whole)."""
    if len(ctx.in_shapes) != 3:
        return []
    c, a, b = ctx.in_shapes
    out = ctx.out_shapes[0]

    def c_spec(d: int) -> Spec:
        di = d - (3 - len(c))
        return shard(di) if di >= 0 and c[di] == out[d] else REP_PGRAD
    found = []
    if ctx.divides(out[0]):
        found.append(ctx.strategy("batch", [c_spec(0), shard(0), shard(0)], [shard(0)]))
    if ctx.divides(out[1]):
        found.append(ctx.strategy("rows", [c_spec(1), shard(1), REP_PGRAD], [shard(1)]))
    if ctx.divides(out[2]):
        found.append(ctx.strategy("colwise", [c_spec(2), REP_PGRAD, shard(2)], [shard(2)]))
    return found


@rule(aten.pad.default, aten.constant_pad_nd.default)
def pad(ctx: OpCtx) -> list[Strategy]:
    """Padding the last ``len(pad) // 2`` dims: any other dim may be split."""
    widths = ctx.arg(1, "pad", ())
    nd = len(ctx.in_shapes[0])
    padded = set(range(nd - len(widths) // 2, nd))
    return [ctx.strategy(f"shard{d}", [shard(d)], [shard(d)])
            for d in range(nd) if d not in padded and ctx.divides(ctx.in_shapes[0][d])]


__all__ = ["FACTORIES", "REPLICATED", "replication_reason"]
