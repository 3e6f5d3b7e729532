"""The fused ops of a norm (transformers' RMSNorm, LayerNorm) and its projections;
:mod:`autopar.runtime.fused` describes them all and exports them."""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from autopar.runtime.fused_mlp import as_dtype, gelu_linear_grads, graph_grads

aten = torch.ops.aten


_WIDE = (torch.float32, torch.float64)       # where doubling a norm's input cannot overflow in practice


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, mid: torch.dtype | None,
         out: torch.dtype | None, post: torch.dtype | None = None,
         xp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm as the model writes it: (output, per-row rsqrt). ``post``: the cast
    after the weight (Gemma's ``(n * (1 + w)).type_as(x)``). ``xp``: the same input as ``x``, as a
    second operand whose gradient is the square's part alone (:class:`_RMSNorm`)."""
    xm = as_dtype(x, mid)
    r = torch.rsqrt((xm if xp is None else xp).pow(2).mean(-1, keepdim=True) + eps)
    y = w * as_dtype(xm * r, out)
    return as_dtype(y, post), r


def _rows_again(x: torch.Tensor, r: torch.Tensor, mid: torch.dtype | None,
                out: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMSNorm's input in its working dtype and normalised rows (before the weight), from its
    per-row scale ``r`` by the ops :func:`_rms` runs after computing it."""
    xm = as_dtype(x, mid)
    return xm, as_dtype(xm * r, out)


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
    grad_w = as_dtype((grad * nd).sum_to_size(w.shape), w.dtype) if need_w else None
    if not need_x:
        return None, None, grad_w
    # n = xm * r (n's dtype is xm's); r = rsqrt(mean(xm ** 2) + eps)
    grad_n = as_dtype(as_dtype(grad * w, nd.dtype), xm.dtype)
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
    return as_dtype(grad_a + grad_b, x.dtype), None, grad_w


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
        result = as_dtype(y, post)
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
            return graph_grads(ctx, grad, lambda: as_dtype(_rms(xa, w, ctx.eps, ctx.mid, ctx.out, xp=xp)[0], ctx.post),
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
            graph = torch.is_grad_enabled()     # create_graph: y again as a function of x (see graph_grads)

            def again() -> torch.Tensor:
                if conv is not None:            # the tensor axis's conversion, as forward ran it
                    return _convert_again(_norm_again(kind, x, nw, nb, eps, shape, mid, out, post), conv)
                if not r or graph:
                    return _norm_again(kind, x, nw, nb, eps, shape, mid, out, post)
                # from the norm's per-row scale; the norm's backward takes the rows
                ctx.slot.rows = xm_nd = _rows_again(x, r[0], mid, out)
                return as_dtype(nw * xm_nd[1], post)

            def make() -> torch.Tensor:        # the norm as forward ran it (under its autocast, if any)
                if ctx.amp is None:
                    return again()
                with torch.autocast(ctx.amp[0], dtype=ctx.amp[1]):
                    return again()
            shared = None if graph else ctx.shared
            y = as_dtype((shared.take(make) if shared is not None else make()).reshape(ctx.y_shape), dt)
            y2 = y.view(-1, y.shape[-1]) if y.is_contiguous() else y.reshape(-1, y.shape[-1])
            grad_w = as_dtype(grad2.t().mm(y2), w_dt)
            if not graph and (shared is None or shared.readers == 0) and y.is_contiguous() \
                    and y2.shape == (grad2.shape[0], w.shape[1]) and dt == y_dt == w.dtype:
                spare = y2
            del y, y2
        if ctx.needs_input_grad[0]:
            # where the recomputed output is this backward's alone, y's gradient is written over it
            # once the weight's gradient has read it (mm writes the same bits into a buffer of its
            # own shape): no fresh tensor of y's size
            g = torch.mm(grad2, w, out=spare) if spare is not None else as_dtype(grad2.mm(as_dtype(w, dt)), y_dt)
            grad_y = g.view(*grad.shape[:-1], w.shape[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = as_dtype(grad2.sum(0), b_dt)
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
            y = as_dtype(_rms(xa, nw, eps, mid, out, xp=xp)[0], post)
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
            y, kept = as_dtype(y, post), (r,)
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
            grads[i], res[j], res[j + 1] = gelu_linear_grads(grads[i], hs[t], wb[2 * n + 2 * t], approximate,
                                                              True, need[j], wb[j + 1 - _W] is not None and need[j + 1])
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        if kind == "rms":
            xm, nd = _rows_again(x, stats[0], mid, out)      # the rows, for the norm's backward too
            y = as_dtype(nw * nd, post)
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
            res[0], res[1], res[2] = _rms_grads_over(as_dtype(grad_y, ctx.rms_dtype), x, nw, stats[0], xm, nd,
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
