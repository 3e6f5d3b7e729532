"""The fused ops of a model's MLP (SwiGLU, GeGLU, a GELU projection) and the helpers every fused op
shares; :mod:`autopar.runtime.fused` describes them all and exports them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


GATES = ("silu", "gelu", "gelu_tanh")        # the gate activations of a gated MLP the ops take


def as_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (None: as it is): a cast only where one changes something, since each
    no-op call costs as much as a small op's dispatch in these backwards."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def graph_grads(ctx, grad: torch.Tensor, forward, inputs: tuple, has_bias: bool = False) -> tuple:
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
            return graph_grads(ctx, grad, lambda: _gate(g, ctx.act) * u, (g, u))
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
            return graph_grads(ctx, grad, lambda: F.linear(_gate(g, ctx.act) * u, w), (g, u, w),
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
            return graph_grads(ctx, grad, again, (g, u, w))
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


def gelu_linear_grads(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, approximate: str, need_h: bool,
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
            return graph_grads(ctx, grad, lambda: F.linear(F.gelu(h, approximate=ctx.approximate), w), (h, w),
                                has_bias=ctx.has_bias)
        need = ctx.needs_input_grad
        return *gelu_linear_grads(grad, h, w, ctx.approximate, need[0], need[1], ctx.has_bias and need[2]), None


def autopar_gelu_linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                        approximate: str = "none") -> torch.Tensor:
    """``linear(gelu(h), w, b)`` (a GPT MLP's second projection), keeping ``h`` only: backward
    recomputes ``gelu(h)`` for the projection's weight gradient."""
    return _GeluLinear.apply(h, w, b, approximate)
