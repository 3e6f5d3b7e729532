"""Fused ops that keep fewer activations for backward than the ops they replace, and compute the
same values and gradients (each backward runs the very formulas autograd runs for the unfused
ops, each op on the same operands, so the results are the unfused model's bit for bit).

- :func:`autopar_swiglu` ``(g, u, act)``: ``silu(g) * u`` (or GeGLU's ``gelu(g) * u``). Eager
  autograd keeps ``g`` (for the activation), ``silu(g)`` and ``u`` (for the product); this keeps
  ``g`` and ``u`` and recomputes ``silu(g)`` in backward (one elementwise op).
- :func:`autopar_swiglu_linear` ``(g, u, w, b)``: ``linear(silu(g) * u, w, b)``, an MLP's down
  projection of its SwiGLU. Eager keeps the product too (the projection's weight gradient reads
  it); this keeps ``g`` and ``u`` and recomputes it.
- :func:`autopar_swiglu_grouped_mm` ``(g, u, w, offs)``: the same for the experts' down
  projection as transformers runs it on a CPU (its ``grouped_mm_fallback`` operator).
- :func:`autopar_gelu_linear` ``(h, w, b, approximate)``: ``linear(gelu(h), w, b)``; eager keeps
  ``h`` (for gelu) and ``gelu(h)`` (for the weight gradient); this keeps ``h``.
- :func:`autopar_rms_norm` ``(x, w, eps, mid, out, post)``: an RMSNorm written out as transformers
  writes it, ``w * (x.to(mid) * rsqrt(x.to(mid).pow(2).mean(-1, keepdim=True) + eps)).to(out)``
  (Gemma's: ``((x * rsqrt(...)) * (1 + w)).to(post)``, its ``1 + w`` taken as the weight).
  Eager autograd keeps ``x``, the per-row ``rsqrt`` and the normalised rows (for the weight's
  gradient); this keeps ``x`` and the per-row ``rsqrt`` and recomputes the normalised rows.
- :func:`autopar_norm_linear`: a projection of a norm's output (RMSNorm as above, or
  ``layer_norm``; or a view of it) when only projections read it (an attention block's q, k and v, an MLP's gate
  and up). Eager keeps the norm's output for the weights' gradients; this keeps the norm's
  input, which the norm itself keeps, and recomputes the output in backward. Behind a fused
  RMSNorm it recomputes from the norm's per-row scale (two ops, not the whole norm), and the
  norm's backward takes the normalised rows it computed.
- :func:`autopar_norm_project`: the norm and all of its projections as one op (where the pass can
  place them so: the output read by projections alone, directly), keeping the norm's input (and
  an RMSNorm's per-row scale); one autograd node where the two above make one per projection
  and one for an RMSNorm (LayerNorm's own is torch's), which at small widths costs more than
  the recomputation.

Their backwards write a result over a tensor they made and no longer read where the dtypes
allow (the in-place or ``out=`` form of an op, on the same operands, gives the same bits): an
RMSNorm's backward makes one row-sized tensor instead of seven, a gated MLP's two instead of
five, GELU's one instead of two, so they touch less fresh memory than the unfused ops' backward
and what they recompute costs less.

A backward that builds a graph (``create_graph=True``: a gradient penalty) runs the unfused ops
again from what forward kept and lets autograd differentiate them (:func:`_graph_grads`), so
second derivatives are the unfused model's too.

The graph pass that puts them in place is :mod:`autopar.passes.fusion`.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

aten = torch.ops.aten


GATES = ("silu", "gelu", "gelu_tanh")        # the gate activations of a gated MLP the ops take
_WIDE = (torch.float32, torch.float64)       # where doubling a norm's input cannot overflow in practice


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (None: as it is): a cast only where one changes something, since each
    no-op call costs as much as a small op's dispatch in these backwards."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _graph_grads(ctx, grad: torch.Tensor, forward, inputs: tuple, has_bias: bool = False) -> tuple:
    """A backward that builds a graph (``create_graph=True``: a gradient penalty, a Hessian-vector
    product). The fused formulas read values forward computed without one (a norm's per-row
    scale), so their second derivative would miss terms: instead the unfused ops run again from
    the saved ``inputs`` (``forward()``) and autograd differentiates them, graph kept, so every
    derivative is the unfused model's. ``has_bias``: the op's next argument after ``inputs`` is a
    linear's bias, whose gradient is the rows' sum of ``grad`` (``forward`` leaves it out)."""
    idx = [i for i, t in enumerate(inputs) if ctx.needs_input_grad[i] and isinstance(t, torch.Tensor)]
    with torch.enable_grad():
        out = forward()
    got = torch.autograd.grad(out, [inputs[i] for i in idx], grad, create_graph=True, allow_unused=True) \
        if idx else ()
    res = [None] * len(ctx.needs_input_grad)
    for i, gr in zip(idx, got):
        res[i] = gr
    if has_bias and ctx.needs_input_grad[len(inputs)]:
        res[len(inputs)] = grad.reshape(-1, grad.shape[-1]).sum(0)
    return tuple(res)


def _gate(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def _gate_backward(grad: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """The activation's backward as autograd runs it."""
    if act == "silu":
        return aten.silu_backward.default(grad, g)
    return aten.gelu_backward.default(grad, g, approximate="tanh" if act == "gelu_tanh" else "none")


def _gate_backward_over(grad: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """:func:`_gate_backward`, written over ``grad`` (which the caller owns)."""
    if act == "silu":
        return aten.silu_backward.grad_input(grad, g, grad_input=grad)
    return aten.gelu_backward.grad_input(grad, g, approximate="tanh" if act == "gelu_tanh" else "none",
                                         grad_input=grad)


def _gated_grads(grad: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, product: bool, own: bool):
    """``act(g) * u``'s backward for the product's gradient ``grad`` by autograd's formulas:
    (``g``'s gradient, ``u``'s, and the product again when ``product``). Each result is written
    over a tensor nothing reads after it where the dtypes allow; ``own``: ``grad`` is the
    caller's to write over."""
    s = _gate(g, act)
    p = s * u if product else None
    if not grad.dtype == s.dtype == u.dtype:
        return _gate_backward(grad * u, g, act), grad * s, p
    grad_u = s.mul_(grad)                        # grad * s (a product's bits do not depend on the order)
    return _gate_backward_over(grad.mul_(u) if own else grad * u, g, act), grad_u, p


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        ctx.act = act
        return _gate(g, act) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _graph_grads(ctx, grad, lambda: _gate(g, ctx.act) * u, (g, u))
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            grad_g, grad_u, _ = _gated_grads(grad, g, u, ctx.act, False, own=False)
            return grad_g, grad_u, None
        s = _gate(g, ctx.act)
        grad_u = grad * s if ctx.needs_input_grad[1] else None
        grad_g = _gate_backward(grad * u, g, ctx.act) if ctx.needs_input_grad[0] else None
        return grad_g, grad_u, None


def autopar_swiglu(g: torch.Tensor, u: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``silu(g) * u`` (``act`` "gelu" / "gelu_tanh": GeGLU's ``gelu(g) * u``), keeping ``g`` and
    ``u`` only (graph node; module docstring)."""
    return _SwiGLU.apply(g, u, act)


class _SwiGLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                act: str) -> torch.Tensor:
        ctx.save_for_backward(g, u, w)
        ctx.has_bias, ctx.act = b is not None, act
        return F.linear(_gate(g, act) * u, w, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u, w = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _graph_grads(ctx, grad, lambda: F.linear(_gate(g, ctx.act) * u, w), (g, u, w),
                                has_bias=ctx.has_bias)
        # linear's own backward as autograd runs it (rows flattened, one mm each way), the
        # input's gradient first: each op reads what the one before it just wrote or read
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_p = grad2.mm(w).view(g.shape) if any(ctx.needs_input_grad[:2]) else None
        if all(ctx.needs_input_grad[:3]):
            grad_g, grad_u, p = _gated_grads(grad_p, g, u, ctx.act, True, own=True)
        else:
            grad_g = _gate_backward(grad_p * u, g, ctx.act) if ctx.needs_input_grad[0] else None
            s = _gate(g, ctx.act)
            grad_u = grad_p * s if ctx.needs_input_grad[1] else None
            p = s * u if ctx.needs_input_grad[2] else None
        grad_w = grad2.t().mm(p.reshape(-1, p.shape[-1])) if ctx.needs_input_grad[2] else None
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return grad_g, grad_u, grad_w, grad_b, None


def autopar_swiglu_linear(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                          b: torch.Tensor | None = None, act: str = "silu") -> torch.Tensor:
    """``linear(silu(g) * u, w, b)`` (an MLP's down projection of its SwiGLU; ``act`` as in
    :func:`autopar_swiglu`), keeping ``g`` and ``u`` only: backward recomputes the product the
    projection's weight gradient reads."""
    return _SwiGLULinear.apply(g, u, w, b, act)


class _SwiGLUGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                cast: torch.dtype | None) -> torch.Tensor:
        ctx.save_for_backward(g, u, w, offs)
        ctx.cast = cast
        p = F.silu(g) * u
        return torch.ops.transformers.grouped_mm_fallback(p.to(cast) if cast is not None else p, w, offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u, w, offs = ctx.saved_tensors
        if torch.is_grad_enabled():
            def again() -> torch.Tensor:
                p = F.silu(g) * u
                return torch.ops.transformers.grouped_mm_fallback(p.to(ctx.cast) if ctx.cast is not None else p, w, offs)
            return _graph_grads(ctx, grad, again, (g, u, w))
        s = F.silu(g)
        p = s * u
        # the grouped matmul's own backward (transformers registers it), on the recomputed product
        grad_p, grad_w = torch.ops.transformers.grouped_mm_fallback_backward(
            p.to(ctx.cast) if ctx.cast is not None else p, w, offs, grad)
        grad_p = grad_p.to(p.dtype)                  # the cast's own backward
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and grad_p.dtype == s.dtype == u.dtype:
            grad_u = s.mul_(grad_p)                  # over s and grad_p, as _gated_grads writes
            grad_g = _gate_backward_over(grad_p.mul_(u), g, "silu")
        else:
            grad_g = aten.silu_backward.default(grad_p * u, g) if ctx.needs_input_grad[0] else None
            grad_u = grad_p * s if ctx.needs_input_grad[1] else None
        return grad_g, grad_u, grad_w if ctx.needs_input_grad[2] else None, None, None


def autopar_swiglu_grouped_mm(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                              cast: torch.dtype | None = None) -> torch.Tensor:
    """transformers' grouped expert matmul (``grouped_mm_fallback``, the experts' down projection)
    of a SwiGLU (cast to ``cast`` first when given), keeping ``g`` and ``u`` only: backward
    recomputes the product."""
    return _SwiGLUGroupedMM.apply(g, u, w, offs, cast)


def _gelu_linear_grads(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, approximate: str, need_h: bool,
                       need_w: bool, need_b: bool) -> tuple:
    """``linear(gelu(h), w, b)``'s backward (``h``'s, ``w``'s and ``b``'s gradients), recomputing
    ``gelu(h)`` for the weight's."""
    grad2 = grad.reshape(-1, grad.shape[-1])
    grad_b = grad2.sum(0) if need_b else None
    a = F.gelu(h, approximate=approximate) if need_w else None
    grad_w = grad2.t().mm(a.view(-1, a.shape[-1]) if a.is_contiguous() else a.reshape(-1, a.shape[-1])) \
        if need_w else None
    if not need_h:
        return None, grad_w, grad_b
    # gelu's gradient goes where gelu(h) was once the weight's gradient has read it (mm
    # writes the same bits into a buffer of its own shape), then gelu's backward over it:
    # one fresh tensor of h's size where autograd makes two
    if need_w and a.is_contiguous() and grad.dtype == w.dtype == a.dtype:
        gp = torch.mm(grad2, w, out=a.view(-1, a.shape[-1])).view(h.shape)
    else:
        gp = grad2.mm(w).view(h.shape)
    del a
    return aten.gelu_backward.grad_input(gp, h, approximate=approximate, grad_input=gp), grad_w, grad_b


class _GeluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.has_bias, ctx.approximate = b is not None, approximate
        return F.linear(F.gelu(h, approximate=approximate), w, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, w = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _graph_grads(ctx, grad, lambda: F.linear(F.gelu(h, approximate=ctx.approximate), w), (h, w),
                                has_bias=ctx.has_bias)
        need = ctx.needs_input_grad
        return *_gelu_linear_grads(grad, h, w, ctx.approximate, need[0], need[1], ctx.has_bias and need[2]), None


def autopar_gelu_linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                        approximate: str = "none") -> torch.Tensor:
    """``linear(gelu(h), w, b)`` (a GPT MLP's second projection), keeping ``h`` only: backward
    recomputes ``gelu(h)`` for the projection's weight gradient."""
    return _GeluLinear.apply(h, w, b, approximate)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, mid: torch.dtype | None,
         out: torch.dtype | None, post: torch.dtype | None = None,
         xp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm as the model writes it: (output, per-row rsqrt). ``post``: the cast
    after the weight (Gemma's ``(n * (1 + w)).type_as(x)``). ``xp``: the same input as ``x``, as a
    second operand whose gradient is the square's part alone (:class:`_RMSNorm`)."""
    xm = _as(x, mid)
    r = torch.rsqrt((xm if xp is None else xp).pow(2).mean(-1, keepdim=True) + eps)
    y = w * _as(xm * r, out)
    return _as(y, post), r


def _rows_again(x: torch.Tensor, r: torch.Tensor, mid: torch.dtype | None,
                out: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMSNorm's input in its working dtype and normalised rows (before the weight), from its
    per-row scale ``r`` by the ops :func:`_rms` runs after computing it."""
    xm = _as(x, mid)
    return xm, _as(xm * r, out)


class _RowsSlot:
    """Where a projection's backward leaves the normalised rows it recomputed, for the norm's own
    backward to take (so they are computed once): held by the ctx of both."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows, self.rows = self.rows, None
        return rows


class _NormRows:
    """What an RMSNorm's forward hands the projections of its output, on the output tensor: its
    input (weakly: an output the caller keeps must not keep the input too), its per-row scale,
    from which their backward recomputes the output in two ops instead of six, and the norm's
    :class:`_RowsSlot`."""

    __slots__ = ("x", "r", "slot")

    def __init__(self, x: torch.Tensor, r: torch.Tensor, slot: _RowsSlot) -> None:
        self.x, self.r, self.slot = weakref.ref(x), r, slot


def _rms_grads(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, xm: torch.Tensor,
               nd: torch.Tensor, need_x: bool, need_w: bool):
    """An RMSNorm's backward (:func:`_rms`) for its output's gradient ``grad`` (in the output's
    dtype before any post cast), from the input in its working dtype ``xm`` and the normalised
    rows ``nd``: (``x``'s gradient, ``w``'s), autograd's formulas. ``x``'s comes in two parts
    where the norm runs in ``x``'s own dtype (the product's part, then the square's: see
    :class:`_RMSNorm`), else as one, the parts' sum cast back; (part, part or None, ``w``'s)."""
    # y = w * nd
    # (autograd hands each input its gradient in that input's dtype)
    grad_w = _as((grad * nd).sum_to_size(w.shape), w.dtype) if need_w else None
    if not need_x:
        return None, None, grad_w
    # n = xm * r (n's dtype is xm's); r = rsqrt(mean(xm ** 2) + eps)
    grad_n = _as(_as(grad * w, nd.dtype), xm.dtype)
    grad_a = grad_n * r
    grad_r = (grad_n * xm).sum_to_size(r.shape)
    grad_v = -0.5 * grad_r * r.pow(3)
    # mean's backward divides the row's gradient expanded to the row; dividing it once per
    # row and then expanding gives the same quotients. pow's: grad * (2 * xm ** 1), and
    # 2 * xm ** 1 is exactly xm * 2.
    grad_p = (grad_v / xm.shape[-1]).expand(xm.shape)
    grad_b = grad_p * (xm * 2)
    if xm.dtype == x.dtype:
        return grad_a, grad_b, grad_w
    return _as(grad_a + grad_b, x.dtype), None, grad_w


def _rms_grads_over(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, xm: torch.Tensor,
                    nd: torch.Tensor, need_x: bool, need_w: bool):
    """:func:`_rms_grads` by the same ops, written over ``nd`` (the caller's, read by nothing
    after) and the first product where every dtype is one: the same values, with one fresh
    row-sized tensor instead of seven."""
    if not (need_x and need_w) or not grad.dtype == nd.dtype == xm.dtype == w.dtype == r.dtype == x.dtype \
            or not (grad.is_contiguous() and nd.is_contiguous() and xm.is_contiguous()):
        # (a reduction's bits depend on its input's layout: written over ``nd``, a product takes
        # nd's, where autograd's would take a transposed gradient's)
        return _rms_grads(grad, x, w, r, xm, nd, need_x, need_w)
    t = grad * nd
    grad_w = t.sum_to_size(w.shape)
    if grad_w.data_ptr() == t.data_ptr():       # nothing summed (one row): a view of t, which is written over next
        grad_w = grad_w.clone()
    grad_n = torch.mul(grad, w, out=t)
    grad_r = torch.mul(grad_n, xm, out=nd).sum_to_size(r.shape)
    grad_a = grad_n.mul_(r)
    grad_v = -0.5 * grad_r * r.pow(3)
    grad_p = grad_v / xm.shape[-1]                         # as in _rms_grads, one per row
    if xm.dtype in _WIDE:
        # pow's backward multiplies by xm * 2; doubling is exact (short of overflow, which
        # these dtypes' range puts out of reach), so doubling the row's factor instead gives
        # the same products with one full-size op fewer
        grad_b = torch.mul(xm, grad_p * 2, out=nd)
    else:
        grad_b = torch.mul(grad_p.expand(xm.shape), torch.mul(xm, 2, out=nd), out=nd)
    return grad_a, grad_b, grad_w


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, xp: torch.Tensor, w: torch.Tensor, eps: float, mid: torch.dtype | None,
                out: torch.dtype | None, post: torch.dtype | None) -> torch.Tensor:
        # xp is x: the model reads x twice (its square's mean; x times the per-row scale), and
        # where no cast comes between, autograd adds the two gradients into x's after whatever
        # reached x before them (the residual's), one at a time; summing them here first would
        # round differently. Taking x twice hands autograd the two parts in the same order.
        y, r = _rms(x, w, eps, mid, out)
        ctx.save_for_backward(x, w, r)
        ctx.mid, ctx.out, ctx.y_dtype, ctx.eps, ctx.post = mid, out, y.dtype, eps, post
        result = _as(y, post)
        ctx.rows = None
        if not torch.compiler.is_compiling():
            ctx.rows = _RowsSlot()
            result._autopar_norm_rows = _NormRows(x, r, ctx.rows)
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, r = ctx.saved_tensors
        got = ctx.rows.take() if ctx.rows is not None else None
        if torch.is_grad_enabled():
            # where uncast, x's two reads as two views of it, each differentiated alone
            xa, xp = (x.view_as(x), x.view_as(x)) if x.dtype == (ctx.mid or x.dtype) else (x, None)
            return _graph_grads(ctx, grad, lambda: _as(_rms(xa, w, ctx.eps, ctx.mid, ctx.out, xp=xp)[0], ctx.post),
                                (xa, xp, w))
        grad = grad.to(ctx.y_dtype)                  # the post cast's backward (none without one)
        # the rows a projection's backward computed already (handed over: nothing else reads
        # them), else computed here
        xm, nd = got if got is not None else _rows_again(x, r, ctx.mid, ctx.out)
        need = ctx.needs_input_grad
        return *_rms_grads_over(grad, x, w, r, xm, nd, need[0] or need[1], need[2]), None, None, None, None


def autopar_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mid: torch.dtype | None,
                     out: torch.dtype | None, post: torch.dtype | None = None) -> torch.Tensor:
    """An RMSNorm keeping its input and per-row scale only (graph node; module docstring)."""
    return _RMSNorm.apply(x, x, w, eps, mid, out, post)


def _norm_again(kind: str, x: torch.Tensor, nw: torch.Tensor | None, nb: torch.Tensor | None, eps: float,
                shape: list[int] | None, mid: torch.dtype | None, out: torch.dtype | None,
                post: torch.dtype | None = None) -> torch.Tensor:
    """The norm's output, by the very ops its forward ran (so bit for bit the same)."""
    if kind == "rms":
        return _rms(x, nw, eps, mid, out, post)[0]
    return aten.layer_norm.default(x, shape, nw, nb, eps)


def _convert_again(y: torch.Tensor, conv: tuple) -> torch.Tensor:
    """A recomputed norm output converted as forward converted it (``conv``: the
    ``autopar::redistribute`` arguments, the rank last where the graph is compiled): an all-gather
    runs again (each rank's recomputed share is its forward share bit for bit); a copy is left out
    (the values are the same)."""
    from autopar.core.placement import Spec, transition
    src, dst = conv[0], conv[1]
    if transition(Spec.parse(src).value, Spec.parse(dst).value, y.dim()).kind == "none":
        return y
    if len(conv) == 5:
        return torch.ops.autopar.redistribute_at(y, *conv)
    return torch.ops.autopar.redistribute(y, *conv)


class _Shared:
    """One norm output's recomputation, shared by the projections that read it: the first
    backward to need it computes it, the last one to finish lets it go."""

    def __init__(self, owner: torch.Tensor, readers: int) -> None:
        # the output, weakly: a forward that stops between the readers (an exception) must not
        # keep it alive; a dead owner means the entry is stale (its id may name a new tensor)
        self.owner = weakref.ref(owner)
        self.readers, self.seen, self.value = readers, 0, None

    def take(self, make) -> torch.Tensor:
        y = self.value if self.value is not None else make()
        self.readers -= 1
        self.value = y if self.readers > 0 else None
        return y


_SHARED: "dict[int, _Shared]" = {}      # id(norm output) -> its recomputation, while forward runs


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor,
                nw: torch.Tensor | None, nb: torch.Tensor | None, norm: tuple, readers: int) -> torch.Tensor:
        # norm: (kind, eps, shape, mid, out, post, conv), one argument (each argument of apply costs)
        traced = torch.compiler.is_compiling()
        hand = None if traced else getattr(y if y._base is None else y._base, "_autopar_norm_rows", None)
        if hand is not None and hand.x() is x:       # the RMSNorm's own scale and slot
            ctx.save_for_backward(x, nw, nb, w, hand.r)
            ctx.slot = hand.slot
        else:
            ctx.save_for_backward(x, nw, nb, w)
            ctx.slot = None
        ctx.has_bias, ctx.norm = b is not None, norm
        ctx.y_shape = y.shape               # y may be a view of the norm's output
        ctx.shared = None
        result = F.linear(y, w, b)
        # under autocast the linear ran in another dtype than y's and w's: backward mirrors the casts
        ctx.dtypes = (result.dtype, y.dtype, w.dtype, b.dtype if b is not None else None)
        dev = x.device.type
        ctx.amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        if traced:                           # each recomputes (the compiler may share it)
            return result
        # the projections of one output share one recomputation (keyed by the output's identity
        # until the last of them has run forward)
        key = id(y)
        shared = _SHARED.get(key)
        if shared is None or shared.owner() is not y:
            if len(_SHARED) > 64:            # entries a stopped forward left behind
                for k in [k for k, v in _SHARED.items() if v.owner() is None]:
                    del _SHARED[k]
            shared = _SHARED[key] = _Shared(y, readers)
        shared.seen += 1
        if shared.seen >= readers:
            del _SHARED[key]
        ctx.shared = shared
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, nw, nb, w, *r = ctx.saved_tensors
        kind, eps, shape, mid, out, post, conv = ctx.norm
        dt, y_dt, w_dt, b_dt = ctx.dtypes
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_y = grad_w = grad_b = None
        spare = None               # the recomputed output, where nothing reads it after this
        if ctx.needs_input_grad[1]:
            graph = torch.is_grad_enabled()     # create_graph: y again as a function of x (see _graph_grads)

            def again() -> torch.Tensor:
                if conv is not None:            # the tensor axis's conversion, as forward ran it
                    return _convert_again(_norm_again(kind, x, nw, nb, eps, shape, mid, out, post), conv)
                if not r or graph:
                    return _norm_again(kind, x, nw, nb, eps, shape, mid, out, post)
                # from the norm's per-row scale; the norm's backward takes the rows
                ctx.slot.rows = xm_nd = _rows_again(x, r[0], mid, out)
                return _as(nw * xm_nd[1], post)

            def make() -> torch.Tensor:        # the norm as forward ran it (under its autocast, if any)
                if ctx.amp is None:
                    return again()
                with torch.autocast(ctx.amp[0], dtype=ctx.amp[1]):
                    return again()
            shared = None if graph else ctx.shared
            y = _as((shared.take(make) if shared is not None else make()).reshape(ctx.y_shape), dt)
            y2 = y.view(-1, y.shape[-1]) if y.is_contiguous() else y.reshape(-1, y.shape[-1])
            grad_w = _as(grad2.t().mm(y2), w_dt)
            if not graph and (shared is None or shared.readers == 0) and y.is_contiguous() \
                    and y2.shape == (grad2.shape[0], w.shape[1]) and dt == y_dt == w.dtype:
                spare = y2
            del y, y2
        if ctx.needs_input_grad[0]:
            # where the recomputed output is this backward's alone, y's gradient is written over it
            # once the weight's gradient has read it (mm writes the same bits into a buffer of its
            # own shape): no fresh tensor of y's size
            g = torch.mm(grad2, w, out=spare) if spare is not None else _as(grad2.mm(_as(w, dt)), y_dt)
            grad_y = g.view(*grad.shape[:-1], w.shape[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _as(grad2.sum(0), b_dt)
        return grad_y, grad_w, grad_b, None, None, None, None, None


def autopar_norm_linear(y: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str, x: torch.Tensor,
                        nw: torch.Tensor | None, nb: torch.Tensor | None, eps: float, shape: list[int] | None = None,
                        mid: torch.dtype | None = None, out: torch.dtype | None = None,
                        readers: int = 1, post: torch.dtype | None = None, conv: tuple | None = None) -> torch.Tensor:
    """``linear(y, w, b)`` where ``y`` is a norm's output (``kind`` "rms": transformers' RMSNorm of
    ``x`` with weight ``nw``; "layer": ``layer_norm(x, shape, nw, nb, eps)``) that only
    projections read. Keeps the norm's input ``x`` (which the norm keeps anyway) instead of ``y``
    and recomputes ``y`` for the weight's gradient; ``y``'s own gradient is the plain linear's.
    ``readers``: how many such projections read ``y``; they recompute it once between them.
    ``post``: an RMSNorm's cast after its weight (:func:`autopar_rms_norm`). ``conv``: ``y`` is
    the tensor axis's conversion of the norm's output, ``(src, dst, group, n[, rank])`` of the
    ``autopar::redistribute`` that made it (a copy, or an all-gather of the sequence): backward
    converts the recomputed output again (:func:`_convert_again`)."""
    return _NormLinear.apply(y, w, b, x, nw, nb, (kind, eps, shape, mid, out, post, conv), readers)


def _viewed(y: torch.Tensor, views: tuple, i: int) -> torch.Tensor:
    """The norm's output as projection ``i`` reads it (:class:`_NormProject`'s ``views``)."""
    return y if not views or views[i] is None else aten.reshape.default(y, views[i])


_W = 7        # where _NormProject's weights start among its inputs (x, xp, nw, nb, norm, tails, views, ...)


def _norm_project_replayed(ctx, grads: tuple, x: torch.Tensor, nw: torch.Tensor | None, nb: torch.Tensor | None,
                           wb: tuple) -> tuple:
    """:class:`_NormProject`'s backward where its own formulas do not apply as they are (a graph
    to keep: ``create_graph=True``; autocast; mixed dtypes): the norm, the projections and their
    GELU tails run again from what forward kept, as forward ran them, and autograd
    differentiates them, so every gradient (and second derivative) is the unfused ops'."""
    import contextlib
    kind, eps, shape, mid, out, post = ctx.norm
    need, n = ctx.needs_input_grad, ctx.n
    with torch.enable_grad(), (torch.autocast(ctx.amp[0], dtype=ctx.amp[1]) if ctx.amp is not None
                               else contextlib.nullcontext()):
        # every input differentiated through a view of its own: autograd.grad then stops at the
        # view, so no hook on the tensor itself runs (a data axis's gradient hook on a
        # parameter would take this for the parameter's gradient), and one weight in two
        # projections gets each part in its own slot (autograd adds them), not the sum in both
        alias = lambda t, i: t.view_as(t) if t is not None and need[i] else t     # noqa: E731
        nw, nb = alias(nw, 2), alias(nb, 3)
        if kind == "rms":
            # where uncast, x's two reads apart, each differentiated alone (_RMSNorm)
            xa, xp = (alias(x, 0), alias(x, 1)) if x.dtype == (mid or x.dtype) else (alias(x, 0), None)
            y = _as(_rms(xa, nw, eps, mid, out, xp=xp)[0], post)
        else:
            xa, xp = alias(x, 0), None
            y = aten.layer_norm.default(xa, shape, nw, nb, eps)
        wb = [alias(t, _W + k) for k, t in enumerate(wb)]
        outs = [F.linear(_viewed(y, ctx.views, i), wb[2 * i], wb[2 * i + 1]) for i in range(n)]
        for t, (i, approximate) in enumerate(ctx.tails):
            outs[i] = F.linear(F.gelu(outs[i], approximate=approximate), wb[2 * n + 2 * t], wb[2 * n + 2 * t + 1])
    slots = [(0, xa), (1, xp), (2, nw), (3, nb), *((_W + k, t) for k, t in enumerate(wb))]
    slots = [(i, t) for i, t in slots if t is not None and need[i]]
    got = torch.autograd.grad(outs, [t for _, t in slots], grads, create_graph=torch.is_grad_enabled(),
                              allow_unused=True) if slots else ()
    res = [None] * len(need)
    for (i, _), g in zip(slots, got):
        res[i] = g
    return tuple(res)


class _NormProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, xp: torch.Tensor | None, nw: torch.Tensor | None, nb: torch.Tensor | None,
                norm: tuple, tails: tuple, views: tuple, *wb: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        # norm: (kind, eps, shape, mid, out, post); xp: x again for an RMSNorm, its two reads of
        # x (see _RMSNorm), else None; wb: each projection's weight and bias in the graph's
        # order, then each tail's; tails: ((projection, approximate), ...), the projections whose
        # output goes through GELU into another projection (the tail), in order; views: () or
        # per projection None or the shape it reshapes the norm's output to first (the last
        # dimension kept, so its rows are the output's, in order)
        kind, eps, shape, mid, out, post = norm
        dev = x.device.type
        ctx.amp = (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        if kind == "rms":
            y, r = _rms(x, nw, eps, mid, out)
            ctx.rms_dtype = y.dtype                   # before the cast after the weight
            y, kept = _as(y, post), (r,)
        elif ctx.amp is None:
            # the graph's layer_norm is this op's first output; it keeps the statistics, as
            # LayerNorm's own backward does
            y, *kept = aten.native_layer_norm.default(x, shape, nw, nb, eps)
        else:                                         # (autocast takes layer_norm whole)
            y, kept = aten.layer_norm.default(x, shape, nw, nb, eps), ()
        n = len(wb) // 2 - len(tails)
        outs = [F.linear(_viewed(y, views, i), wb[2 * i], wb[2 * i + 1]) for i in range(n)]
        hs = []
        for t, (i, approximate) in enumerate(tails):
            hs.append(outs[i])                        # kept: the tail's GELU reads it (gelu(h) is recomputed)
            outs[i] = F.linear(F.gelu(outs[i], approximate=approximate), wb[2 * n + 2 * t], wb[2 * n + 2 * t + 1])
        ctx.save_for_backward(x, nw, nb, *wb, *hs, *kept)
        ctx.norm, ctx.n, ctx.tails, ctx.views, ctx.y_dtype = norm, n, tails, views, y.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n, tails, need = ctx.n, ctx.tails, ctx.needs_input_grad
        saved = ctx.saved_tensors
        k = 2 * n + 2 * len(tails)
        x, nw, nb, wb = saved[0], saved[1], saved[2], saved[3:3 + k]
        hs, stats = saved[3 + k:3 + k + len(tails)], saved[3 + k + len(tails):]
        kind, eps, shape, mid, out, post = ctx.norm
        y_dt = ctx.y_dtype
        if torch.is_grad_enabled() or ctx.amp is not None or any(g.dtype != y_dt for g in grads) \
                or any(w is not None and w.dtype != y_dt for w in wb):
            return _norm_project_replayed(ctx, grads, x, nw, nb, wb)
        res = [None] * len(need)
        grads = list(grads)
        for t, (i, approximate) in enumerate(tails):  # a tail's backward first, as autograd runs it
            j = _W + 2 * n + 2 * t
            grads[i], res[j], res[j + 1] = _gelu_linear_grads(grads[i], hs[t], wb[2 * n + 2 * t], approximate,
                                                              True, need[j], wb[j + 1 - _W] is not None and need[j + 1])
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        if kind == "rms":
            xm, nd = _rows_again(x, stats[0], mid, out)      # the rows, for the norm's backward too
            y = _as(nw * nd, post)
        else:
            y, mean, rstd = aten.native_layer_norm.default(x, shape, nw, nb, eps)[0], *stats
        y2 = y.view(-1, y.shape[-1]) if y.is_contiguous() else y.reshape(-1, y.shape[-1])
        for i, g2 in enumerate(g2s):
            if need[_W + 2 * i]:
                res[_W + 2 * i] = g2.t().mm(y2)
            if wb[2 * i + 1] is not None and need[_W + 2 * i + 1]:
                res[_W + 2 * i + 1] = g2.sum(0)
        if not (need[0] or need[1] or need[2] or need[3]):
            return tuple(res)
        # y's gradient: autograd adds its readers' parts as their backwards run, the last
        # projection's first (the latest node first), each later part into the sum; written over
        # the recomputed y where more than one part is made (mm writes the same bits there)
        spare = y2 if y.is_contiguous() else None
        del y
        ws = wb[0:2 * n:2]
        grad_y = None
        for i in reversed(range(n)):
            if grad_y is None:
                grad_y = torch.mm(g2s[i], ws[i], out=spare) if n == 1 and spare is not None else g2s[i].mm(ws[i])
            else:
                grad_y += torch.mm(g2s[i], ws[i], out=spare) if spare is not None else g2s[i].mm(ws[i])
        del spare, y2
        grad_y = grad_y.view(*x.shape[:-1], grad_y.shape[-1])
        if kind == "rms":
            res[0], res[1], res[2] = _rms_grads_over(_as(grad_y, ctx.rms_dtype), x, nw, stats[0], xm, nd,
                                                     need[0] or need[1], need[2])
        else:
            res[0], res[2], res[3] = aten.native_layer_norm_backward.default(
                grad_y, x, shape, mean, rstd, nw, nb, [need[0], nw is not None and need[2], nb is not None and need[3]])
        return tuple(res)


def autopar_norm_project(x: torch.Tensor, nw: torch.Tensor | None, nb: torch.Tensor | None, norm: tuple,
                         tails: tuple, views: tuple, *wb: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A norm of ``x`` and every projection of its output, in one op: ``norm`` ``(kind, eps, shape,
    mid, out, post)`` as :func:`autopar_norm_linear` takes them (``kind`` "rms": transformers'
    RMSNorm with weight ``nw``; "layer": ``layer_norm(x, shape, nw, nb, eps)``), ``wb`` each
    projection's weight and bias (None), in the graph's order, then each tail's; returns the
    projections' outputs. ``tails`` ``((i, approximate), ...)``: projection ``i``'s output goes
    through GELU into a projection of its own (a GPT MLP), whose output is returned in its place
    (``autopar_gelu_linear``'s saved set: the GELU's input). ``views``: ``()``, or per
    projection None or the shape the output is reshaped to before it (its last dimension kept).
    Keeps ``x`` (and the norm's statistics), not the norm's output: backward recomputes it once
    for the projections' weight gradients and runs the norm's backward on the sum of the
    projections' gradients, added in autograd's order. Where it applies
    (:mod:`autopar.passes.fusion`) it replaces the norm, its :func:`autopar_norm_linear`
    projections and their GELU tails: one autograd node for up to five (each costs a Python
    call in forward and backward)."""
    return _NormProject.apply(x, x if norm[0] == "rms" else None, nw, nb, norm, tails, views, *wb)


FUSED_OPS = (autopar_swiglu, autopar_swiglu_linear, autopar_swiglu_grouped_mm, autopar_gelu_linear, autopar_rms_norm,
             autopar_norm_linear, autopar_norm_project)

__all__ = ["autopar_swiglu", "autopar_swiglu_linear", "autopar_swiglu_grouped_mm", "autopar_gelu_linear",
           "autopar_rms_norm", "autopar_norm_linear", "autopar_norm_project", "FUSED_OPS"]
