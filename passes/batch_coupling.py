"""Where a graph pairs samples of the batch with each other: the ops that make a split batch
compute something else than the whole batch.

A data rank (or a pipeline's micro-batch) runs the model on its own rows. That is the
single-process model exactly when every value is computed sample by sample and only the loss
sums over samples; an op that lets one sample's value depend on another's (a contrastive loss's
``text @ image.T`` over the batch, a softmax across samples) sees only the rows of its piece.

:func:`batch_coupling` follows the batch dim from the user's tensor inputs (dim 0 of each) through
the graph: per value, the dim holding the sample index, ``FREE`` (no sample's data: parameters,
constants), ``SUMMED`` (an aggregate over samples: a sum, mean or max over the batch dim, a loss)
or ``LOST`` (the analysis stops following: an op with no rule). An op that meets a per-sample
value with a ``SUMMED`` one pairs samples (``x - x.mean(0)``: every sample shifted by all the
others); ``SUMMED`` values among themselves (a loss plus an auxiliary loss) do not. Rules live in
:data:`RULES`, keyed by ATen op; an op with no rule makes its outputs ``LOST`` when an input
carries the batch, so a missing rule can hide a pairing but never invents one. It reads the
shape pass's records and writes nothing; the build refuses a graph with
pairings when the batch is split (``autopar/build/tensor.py``).
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.core.meta import evaluate, graph_info, info
from autopar.passes.sharding_rules import reshape_groups

__all__ = ["Pairing", "batch_coupling", "carried_dims", "FREE", "LOST", "SUMMED"]

aten = torch.ops.aten
FREE, LOST, SUMMED = None, "lost", "summed"
Dim = Any                    # int (the batch dim), FREE, SUMMED or LOST
# Ops that pick by a value rather than compute with it: an aggregate used to choose rows (the
# experts some token chose) is not followed, and not taken as a pairing.
PICKING = {aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.select.int,
           aten.slice.Tensor, aten.index_put.default, aten.index_add.default, aten.scatter.src,
           aten.scatter.value, aten.scatter_add.default, aten.nonzero.default, aten.where.self}


class _Pairs(Exception):
    """Raised by a rule: this op pairs samples (why)."""


@dataclass(frozen=True)
class Pairing:
    """One op that makes a sample's value depend on other samples."""

    node: str
    fqn: str
    op: str
    why: str

    def __str__(self) -> str:
        return f"{self.op} at {self.fqn or '<root>'} (node {self.node}): {self.why}"


@dataclass
class Ctx:
    node: fx.Node
    dims: list[Dim]                      # per tensor argument (lists flattened), in order
    shapes: list[tuple[int, ...]]        # their shapes
    out: list[tuple[int, ...]]           # the outputs' shapes

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.node.args):
            return self.node.args[i]
        return self.node.kwargs.get(name, default)

    @property
    def carried(self) -> list[tuple[int, int]]:
        """(argument index, batch dim) of the arguments that carry the batch."""
        return [(i, d) for i, d in enumerate(self.dims) if isinstance(d, int)]


Rule = Callable[[Ctx], list[Dim]]
RULES: dict[Any, Rule] = {}


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return register


def batch_coupling(gm: fx.GraphModule, inputs: list[str] | None = None) -> list[Pairing]:
    """The ops of ``gm`` that pair samples, in graph order; ``inputs`` names the placeholders
    whose dim 0 is the batch (default: the user's tensor inputs)."""
    gi = graph_info(gm)
    sizes = dict(gi.example_sizes)
    batched = set(gi.input_names if inputs is None else inputs)
    state: dict[fx.Node, list[Dim]] = {}
    found: list[Pairing] = []
    for node in gm.graph.nodes:
        shapes = _shapes(node, sizes)
        if node.op == "placeholder":
            state[node] = [0 if node.name in batched and s else FREE for s in shapes] or [FREE]
            continue
        if node.op != "call_function":
            state[node] = [FREE] * max(1, len(shapes))
            continue
        if node.target is operator.getitem:
            src = state.get(node.args[0], [LOST])
            i = node.args[1]
            state[node] = [src[i] if isinstance(i, int) and i < len(src) else LOST]
            continue
        args = _tensor_args(node)
        dims = [state.get(a, [LOST])[0] for a in args]
        if not any(d is not FREE for d in dims):
            state[node] = [FREE] * max(1, len(shapes))      # made from no sample's data
            continue
        ctx = Ctx(node, dims, [(_shapes(a, sizes) or [()])[0] for a in args], shapes)
        try:
            state[node] = _apply(ctx)
        except _Pairs as why:
            rec = info(node) if "autopar" in node.meta else None
            found.append(Pairing(node.name, rec.fqn if rec else "", str(node.target), str(why)))
            state[node] = [LOST] * max(1, len(shapes))
    return found


def carried_dims(node: fx.Node, dims: list[Dim], sizes: dict[str, int]) -> list[Dim] | None:
    """Where ``node``'s outputs carry the followed dim when its tensor arguments (lists flattened,
    kwargs after args) carry it at ``dims``; None when the op pairs entries of that dim with each
    other. The same rules as :func:`batch_coupling`, for a caller following another dim (context
    parallelism follows the sequence: ``passes/cp_rewrite.py``)."""
    args = _tensor_args(node)
    ctx = Ctx(node, dims, [(_shapes(a, sizes) or [()])[0] for a in args], _shapes(node, sizes))
    try:
        return _apply(ctx)
    except _Pairs:
        return None


def _apply(ctx: Ctx) -> list[Dim]:
    if any(d is LOST for d in ctx.dims):
        return [LOST] * max(1, len(ctx.out))
    node = ctx.node
    if SUMMED in ctx.dims:
        if node.target in PICKING:
            return [LOST] * max(1, len(ctx.out))
        if ctx.carried:
            raise _Pairs("a per-sample value meets an aggregate over the batch (a sum, mean or max over "
                         "samples): every sample's result depends on the others")
        return [SUMMED] * max(1, len(ctx.out))    # aggregates combined (a loss plus an auxiliary loss)
    if "autopar" in node.meta and (info(node).collective is not None or info(node).made_by != "capture"):
        return _same(ctx)                # a tensor-axis exchange or slice: never along the batch
    fn = RULES.get(node.target)
    if fn is None and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        fn = pointwise
    if fn is None:
        return [LOST] * max(1, len(ctx.out))
    try:
        got = fn(ctx)
    except _NotSimple:
        return [LOST] * max(1, len(ctx.out))
    return got if len(got) >= max(1, len(ctx.out)) else got + [LOST] * (len(ctx.out) - len(got))


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if _is_tensor(a) else None)
    return out


def _is_tensor(a: fx.Node) -> bool:
    if "autopar" in a.meta:
        return bool(info(a).values)
    return isinstance(a.meta.get("val"), torch.Tensor)


def _shapes(node: fx.Node, sizes: dict[str, int]) -> list[tuple[int, ...]]:
    if "autopar" not in node.meta:
        v = node.meta.get("val")
        return [tuple(int(x) for x in v.shape)] if isinstance(v, torch.Tensor) else []
    try:
        return [tuple(evaluate(d, sizes) for d in v.shape) for v in info(node).values]
    except Exception:  # noqa: BLE001 - a size known only at run time: rank-only reasoning below
        return [tuple(-1 for _ in v.shape) for v in info(node).values]


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _one(ctx: Ctx) -> int:
    """The batch dim of the first argument (rules whose other arguments are FREE)."""
    carried = ctx.carried
    if len(carried) != 1 or carried[0][0] != 0:
        raise _NotSimple
    return carried[0][1]


class _NotSimple(Exception):
    pass


def _same(ctx: Ctx) -> list[Dim]:
    """Outputs keep the batch where the first argument has it (same rank), else LOST."""
    try:
        d = _one(ctx)
    except _NotSimple:
        return [LOST] * max(1, len(ctx.out))
    return [d if len(o) == len(ctx.shapes[0]) else LOST for o in ctx.out] or [d]


# ---------------------------------------------------------------- elementwise

@rule(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default,
      aten.contiguous.default, aten.alias.default, aten.detach.default, aten.type_as.default,
      aten.dropout.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
      aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
      aten.rand_like.default, aten.randn_like.default, aten.lift_fresh_copy.default, aten.fill.Scalar,
      aten.clamp.default, aten.clamp.Tensor, aten.pow.Tensor_Scalar, aten.gelu.default, aten.silu.default,
      aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor)
def pointwise(ctx: Ctx) -> list[Dim]:
    """Broadcasting: each carrying argument's batch dim lands at the same output dim, or the
    op pairs samples (``x[:, None] - y[None, :]``)."""
    k = len(ctx.out[0]) if ctx.out else 0
    at = set()
    for i, d in ctx.carried:
        r = len(ctx.shapes[i])
        j = d + (k - r)
        if ctx.shapes[i][d] == 1 and ctx.out[0][j] != 1:
            raise _Pairs("a one-sample batch is broadcast over another dim")
        at.add(j)
    if len(at) > 1:
        raise _Pairs(f"samples along output dims {sorted(at)} meet elementwise: every sample with every sample")
    return [at.pop()] * max(1, len(ctx.out))


# ---------------------------------------------------------------- views and layout

@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
      aten.unflatten.int)
def reshape(ctx: Ctx) -> list[Dim]:
    """The batch dim survives as the outermost dim of its group (sizes with equal products)."""
    d = _one(ctx)
    src, dst = ctx.shapes[0], ctx.out[0]
    if -1 in src or -1 in dst:
        return [LOST]
    groups = reshape_groups(tuple(src), tuple(dst))
    for gi, gj in groups or ():
        if d in gi:
            outer = [x for x in gi if src[x] > 1]
            if outer and outer[0] != d:
                return [LOST]               # the batch is not the group's outermost: rows interleave
            target = [x for x in gj if dst[x] > 1] or gj
            return [target[0]] if target else [LOST]
    return [LOST]


@rule(aten.transpose.int)
def transpose(ctx: Ctx) -> list[Dim]:
    d, r = _one(ctx), len(ctx.shapes[0])
    a, b = _norm(ctx.arg(1, "dim0"), r), _norm(ctx.arg(2, "dim1"), r)
    return [b if d == a else a if d == b else d]


@rule(aten.t.default, aten.numpy_T.default)
def t(ctx: Ctx) -> list[Dim]:
    d, r = _one(ctx), len(ctx.shapes[0])
    return [r - 1 - d]


@rule(aten.permute.default)
def permute(ctx: Ctx) -> list[Dim]:
    d, r = _one(ctx), len(ctx.shapes[0])
    order = [_norm(x, r) for x in ctx.arg(1, "dims")]
    return [order.index(d)]


@rule(aten.unsqueeze.default)
def unsqueeze(ctx: Ctx) -> list[Dim]:
    d, r = _one(ctx), len(ctx.shapes[0])
    at = _norm(ctx.arg(1, "dim"), r + 1)
    return [d + 1 if at <= d else d]


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(ctx: Ctx) -> list[Dim]:
    d, shape = _one(ctx), ctx.shapes[0]
    given = ctx.arg(1, "dim")
    dims = range(len(shape)) if given is None else [given] if isinstance(given, int) else given
    gone = {_norm(x, len(shape)) for x in dims if shape[_norm(x, len(shape))] == 1}
    return [LOST if d in gone else d - sum(1 for x in gone if x < d)]


@rule(aten.expand.default, aten.expand_as.default, aten.repeat.default)
def expand(ctx: Ctx) -> list[Dim]:
    d = ctx.dims[0]                          # expand_as reads only its second argument's shape
    if not isinstance(d, int):
        return [FREE if d is FREE else d]
    lead = len(ctx.out[0]) - len(ctx.shapes[0])
    if ctx.node.target is aten.repeat.default and ctx.arg(1, "repeats")[lead + d] != 1:
        return [LOST]
    return [d + lead]


@rule(aten.slice.Tensor, aten.narrow.default)
def slice_(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    dim = _norm(ctx.arg(1, "dim", 0), len(ctx.shapes[0]))
    if dim == d and ctx.out[0][d] != ctx.shapes[0][d]:
        return [LOST]                      # some of the samples
    return [d]


@rule(aten.select.int)
def select(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    dim = _norm(ctx.arg(1, "dim"), len(ctx.shapes[0]))
    return [LOST if dim == d else d - (dim < d)]


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    dim = _norm(ctx.arg(2 if ctx.node.target is not aten.unbind.int else 1, "dim", 0), len(ctx.shapes[0]))
    if dim == d:
        return [LOST] * max(1, len(ctx.out))
    keep = d - (dim < d) if ctx.node.target is aten.unbind.int else d
    return [keep] * max(1, len(ctx.out))


@rule(aten.cat.default, aten.stack.default)
def cat(ctx: Ctx) -> list[Dim]:
    """Pieces carrying the batch at one dim, joined along another."""
    dims = {d for _, d in ctx.carried}
    if len(dims) != 1:
        return [LOST]
    d = dims.pop()
    r = len(ctx.shapes[ctx.carried[0][0]])
    along = ctx.arg(1, "dim", 0)
    if ctx.node.target is aten.stack.default:
        along = _norm(along, r + 1)
        return [d + 1 if along <= d else d]
    return [LOST if _norm(along, r) == d else d]


@rule(aten.constant_pad_nd.default, aten.pad.default)
def pad(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    return [d if ctx.out[0][d] == ctx.shapes[0][d] else LOST]


# ---------------------------------------------------------------- contractions

def _matmul(ctx: Ctx, a: int, b: int) -> list[Dim]:
    """``a @ b`` with torch.matmul's broadcasting: where each operand's batch dim lands."""
    ra, rb, k = len(ctx.shapes[a]), len(ctx.shapes[b]), len(ctx.out[0])
    at: list[Any] = []
    for i, role in ((a, "a"), (b, "b")):
        d = ctx.dims[i]
        if not isinstance(d, int):
            continue
        r = ra if role == "a" else rb
        if role == "a":
            if d == r - 1:
                at.append("sum")
            elif r >= 2 and d == r - 2:
                at.append(k - 2 if rb >= 2 else k - 1)
            else:
                at.append(d + (k - r))
        else:
            if r == 1 or d == r - 2:
                at.append("sum")
            elif d == r - 1:
                at.append(k - 1)
            else:
                at.append(d + (k - r))
    if len(at) == 2 and at[0] != at[1]:
        raise _Pairs("both operands carry the batch and it is not a shared batch dim of the product: "
                     "every sample is multiplied with every sample")
    if at[0] == "sum":
        return [SUMMED]                    # a sum over samples
    return [at[0]]


@rule(aten.matmul.default, aten.mm.default, aten.bmm.default)
def matmul(ctx: Ctx) -> list[Dim]:
    return _matmul(ctx, 0, 1)


@rule(aten.addmm.default, aten.baddbmm.default)
def addmm(ctx: Ctx) -> list[Dim]:
    got = _matmul(ctx, 1, 2)
    if isinstance(ctx.dims[0], int) and got[0] != ctx.dims[0] + len(ctx.out[0]) - len(ctx.shapes[0]):
        raise _Pairs("the added term carries the batch at another dim than the product")
    return got


@rule(aten.linear.default)
def linear(ctx: Ctx) -> list[Dim]:
    if any(i != 0 for i, _ in ctx.carried):
        if isinstance(ctx.dims[0], int):
            raise _Pairs("both the input and the weight carry the batch")
        return [LOST]
    d = ctx.dims[0]
    return [LOST if d == len(ctx.shapes[0]) - 1 else d]


@rule(aten.scaled_dot_product_attention.default)
def sdpa(ctx: Ctx) -> list[Dim]:
    """Attention pairs positions, not samples, when query, key and value share the batch dim."""
    dims = {d for _, d in ctx.carried}
    if len(dims) != 1:
        raise _Pairs("query, key and value carry the batch at different dims")
    d = dims.pop()
    if d >= len(ctx.shapes[0]) - 2:
        raise _Pairs("the batch is the attended dim: samples attend to each other")
    return [d]


@rule(aten.embedding.default)
def embedding(ctx: Ctx) -> list[Dim]:
    if isinstance(ctx.dims[0], int):
        return [LOST]
    return [ctx.dims[1]]


@rule(aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
      aten._convolution.default, aten.conv_transpose1d.default, aten.conv_transpose2d.input)
def conv(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    return [0 if d == 0 else LOST]


@rule(aten.batch_norm.default, aten.native_batch_norm.default, aten._native_batch_norm_legit_functional.default,
      aten.group_norm.default, aten.native_group_norm.default, aten.instance_norm.default)
def channel_norm(ctx: Ctx) -> list[Dim]:
    """Batch statistics are synchronised over the data axis and refused in a pipeline elsewhere
    (``runtime/sync_bn.py``, ``build/pipeline.py``); per sample otherwise."""
    d = _one(ctx)
    return [0 if d == 0 else LOST] + [LOST] * (len(ctx.out) - 1)


@rule(aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default, aten._fused_rms_norm.default)
def layer_norm(ctx: Ctx) -> list[Dim]:
    d = _one(ctx)
    normed = len(ctx.arg(1, "normalized_shape"))
    if d >= len(ctx.shapes[0]) - normed:
        raise _Pairs("the normalised dims include the batch: statistics over several samples")
    return [d] + [d] * (len(ctx.out) - 1)


# ---------------------------------------------------------------- reductions and scans

def _reduced(ctx: Ctx, dims: Any, keepdim: bool) -> list[Dim]:
    d, r = _one(ctx), len(ctx.shapes[0])
    if dims is None or dims == []:
        return [SUMMED] * max(1, len(ctx.out))
    gone = {_norm(x, r) for x in ([dims] if isinstance(dims, int) else dims)}
    if d in gone:
        return [SUMMED] * max(1, len(ctx.out))    # a sum (or max) over samples
    keep = d if keepdim else d - sum(1 for x in gone if x < d)
    return [keep] * max(1, len(ctx.out))


@rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.prod.dim_int,
      aten.any.dim, aten.all.dim, aten.logsumexp.default, aten.var.correction, aten.std.correction,
      aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim, aten.count_nonzero.dim_IntList)
def reduction(ctx: Ctx) -> list[Dim]:
    op = ctx.node.target
    dims = ctx.arg(1, "dim")
    keep = ctx.arg(2, "keepdim", False)
    if op in (aten.var.correction, aten.std.correction):
        keep = ctx.node.kwargs.get("keepdim", False)
    return _reduced(ctx, dims, bool(keep))


@rule(aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim)
def vector_norm(ctx: Ctx) -> list[Dim]:
    return _reduced(ctx, ctx.arg(2, "dim"), bool(ctx.arg(3, "keepdim", False)))


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
      aten.cumsum.default, aten.cumprod.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
      aten.argsort.stable, aten.topk.default)
def along(ctx: Ctx) -> list[Dim]:
    """Softmax, scans, top-k: along the batch dim they mix samples (a token's capacity slot
    counts the tokens before it; the samples an expert picks depend on the others). A sort along
    it only reorders the samples (tokens grouped by expert): not followed."""
    d, r = _one(ctx), len(ctx.shapes[0])
    if ctx.node.target in (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable):
        dim = _norm(ctx.arg(1, "dim", -1), r)
        return [LOST if dim == d else d] * max(1, len(ctx.out))
    default = -1
    pos = 2 if ctx.node.target is aten.topk.default else 1
    dim = _norm(ctx.arg(pos, "dim", default), r)
    if dim == d and "autopar" in ctx.node.meta and info(ctx.node).moe_region is not None:
        # a mixture-of-experts layer's capacity slots, counted over the tokens of each piece of
        # the batch: the documented semantics of a fixed-capacity layer (every rank routes and
        # drops its own tokens, as each device does in GShard and Switch), not a pairing
        return [d] * max(1, len(ctx.out))
    if dim == d:
        raise _Pairs(f"{ctx.node.target.__name__.split('.')[0]} along the batch dim: each sample's value "
                     "depends on the others")
    return [d] * max(1, len(ctx.out))


# ---------------------------------------------------------------- indexing

@rule(aten.index.Tensor)
def index(ctx: Ctx) -> list[Dim]:
    """``x[i0, i1, ...]``: the indexed dims become the indices' broadcast shape. The batch stays
    per sample when an index carries it (``x[arange(B), pos]`` picks one row per sample)."""
    idx = ctx.arg(1, "indices")
    x_d = ctx.dims[0]
    given = [i for i, v in enumerate(idx) if v is not None]
    if not given or given != list(range(given[0], given[0] + len(given))):
        return [LOST]
    idx_dims = ctx.dims[1:]
    idx_shapes = ctx.shapes[1:]
    width = max(len(s) for s in idx_shapes)
    carried = {d + width - len(s) for d, s in zip(idx_dims, idx_shapes) if isinstance(d, int)}
    if len(carried) > 1:
        return [LOST]
    lead = given[0]
    if isinstance(x_d, int) and x_d not in given:      # indexing other dims of per-sample rows
        if carried:
            return [LOST]
        return [x_d if x_d < lead else x_d - len(given) + width]
    if not carried:
        return [LOST]                 # the batch dim indexed by a constant: some of the samples
    return [lead + carried.pop()]


@rule(aten.index_select.default, aten.gather.default)
def index_select(ctx: Ctx) -> list[Dim]:
    x_d, i_d = ctx.dims[0], ctx.dims[1]
    dim = _norm(ctx.arg(1, "dim"), len(ctx.shapes[0]))
    if ctx.node.target is aten.gather.default:
        return [x_d if isinstance(x_d, int) and x_d == i_d and dim != x_d else LOST]
    if isinstance(x_d, int) and dim != x_d and i_d is FREE:
        return [x_d]
    if isinstance(x_d, int) and dim == x_d and isinstance(i_d, int):
        return [x_d]                 # rows picked per sample (tokens routed to one expert)
    if x_d is FREE and isinstance(i_d, int):
        return [dim]
    return [LOST]


@rule(aten.sum.default, aten.mean.default, aten.max.default, aten.min.default,
      aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default,
      aten.nll_loss2d_forward.default, aten.mse_loss.default, aten.l1_loss.default,
      aten.smooth_l1_loss.default, aten.huber_loss.default, aten.binary_cross_entropy.default,
      aten.binary_cross_entropy_with_logits.default, aten.kl_div.default, aten.ctc_loss.IntList,
      aten.ctc_loss.Tensor)
def total(ctx: Ctx) -> list[Dim]:
    """Whole-tensor reductions and losses: an aggregate over samples (per sample with
    ``reduction="none"``, where the loss keeps its input's batch dim)."""
    if ctx.out and len(ctx.out[0]) > 0:
        carried = ctx.carried
        return [carried[0][1] if carried and carried[0][1] < len(ctx.out[0]) else LOST] * max(1, len(ctx.out))
    return [SUMMED] * max(1, len(ctx.out))
