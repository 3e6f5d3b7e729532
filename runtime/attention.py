"""Attention as a captured graph calls it, run the way the model runs it eagerly.

A ``transformers`` model captured by ``torch.export`` builds its causal mask as a tensor (the
library skips the mask and asks for ``is_causal=True`` only when it is not being traced), so
the graph calls ``scaled_dot_product_attention(q, k, v, attn_mask=mask)``. With the mask, the
kernel computes every query-key pair (the flash kernels that skip the blocks above the
diagonal take no mask) and autograd keeps the mask for backward. :func:`graph_sdpa` looks at
the mask itself: when it is exactly the causal mask in every batch row and head it calls the
kernel with ``is_causal=True`` and no mask (what the model does eagerly), otherwise with the
mask as given (a sliding window, padding, a document mask). The check runs on the tensor, once
per mask (every layer of a step reads the same one), so it holds for any size a symbolic graph
is called with. :func:`fuse_attention` points a graph's attention calls at it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

_LAST_MASK: list = [None, -1, False]     # the last mask checked (held, so its memory is not reused), version, result


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Is ``mask`` (a boolean mask over (query, key), broadcast over batch and heads) exactly the
    causal mask in every row of the batch and head?"""
    if mask.dtype != torch.bool or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2] or mask.requires_grad:
        return False
    if _LAST_MASK[0] is mask and _LAST_MASK[1] == mask._version:
        return _LAST_MASK[2]
    seq = mask.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril_()
    _LAST_MASK[:] = [mask, mask._version, bool(torch.equal(mask, causal.expand_as(mask)))]
    return _LAST_MASK[2]


def graph_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` with a mask that is exactly causal run as causal."""
    if attn_mask is not None and not is_causal and q.shape[-2] == k.shape[-2] and is_causal_mask(attn_mask):
        attn_mask, is_causal = None, True
    return aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                             enable_gqa=enable_gqa)


def fuse_attention(gm: fx.GraphModule) -> int:
    """Point ``gm``'s masked attention calls at :func:`graph_sdpa` (the nodes keep their place
    and meaning, so what was planned for them holds). Returns how many."""
    count = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default:
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            if isinstance(mask, fx.Node):
                n.target = graph_sdpa
                count += 1
    if count:
        gm.recompile()
    return count


def plain_attention(gm: fx.GraphModule) -> None:
    """Undo :func:`fuse_attention` (a compiled graph keeps the mask: the check would break it)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is graph_sdpa:
            n.target = aten.scaled_dot_product_attention.default
            changed = True
    if changed:
        gm.recompile()


__all__ = ["graph_sdpa", "fuse_attention", "plain_attention", "is_causal_mask"]
