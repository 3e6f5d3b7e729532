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
again from what forward kept and lets autograd differentiate them (:func:`graph_grads`), so
second derivatives are the unfused model's too.

The graph pass that puts them in place is :mod:`autopar.passes.fusion`.
"""
from __future__ import annotations

from autopar.runtime.fused_mlp import (GATES, autopar_gelu_linear, autopar_swiglu, autopar_swiglu_grouped_mm,
                                       autopar_swiglu_linear)
from autopar.runtime.fused_norms import autopar_norm_linear, autopar_norm_project, autopar_rms_norm

FUSED_OPS = (autopar_swiglu, autopar_swiglu_linear, autopar_swiglu_grouped_mm, autopar_gelu_linear, autopar_rms_norm,
             autopar_norm_linear, autopar_norm_project)

__all__ = ["GATES", "autopar_swiglu", "autopar_swiglu_linear", "autopar_swiglu_grouped_mm", "autopar_gelu_linear",
           "autopar_rms_norm", "autopar_norm_linear", "autopar_norm_project", "FUSED_OPS"]
