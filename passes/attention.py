"""Attention as torch's fused kernels take it: grouped-query keys and values left unrepeated.

A grouped-query model (Llama, Qwen2, Mistral, Gemma, ...) repeats each key and value head to the
query heads it serves before it calls ``scaled_dot_product_attention`` (``repeat_kv``:
``x[:, :, None].expand(b, hk, rep, s, d).reshape(b, hk * rep, s, d)``, or
``x.repeat_interleave(rep, 1)``). The repeat is a copy: autograd saves the repeated keys and
values for backward (``rep`` times their bytes) and the kernel reads ``rep`` times the keys.
Torch's attention takes the unrepeated ones with ``enable_gqa=True``, pairs query head ``h`` with
key head ``h // rep`` (the pairing the repeat made), saves them as they are and computes the same
result. :func:`unrepeat_kv` rewrites each such call, right after capture, so every later pass
(the flop, memory and sharding rules, the tensor and context rewrites) and the simulator see
the attention that runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def unrepeat_kv(gm: fx.GraphModule, divisor: int = 1) -> int:
    """Give each attention call its keys and values before a grouped-query repeat, with
    ``enable_gqa=True``; drop the repeats nothing else reads. Returns how many calls changed.
    ``divisor``: the tensor axis the graph is captured for; a call whose key heads it does not
    divide keeps its repeat (the tensor axis then splits the repeated heads, as the query's)."""
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        if n.kwargs.get("enable_gqa") or len(n.args) < 3:
            continue
        q, k, v = n.args[:3]
        k_src, v_src = repeated_from(k), repeated_from(v)
        if k_src is None or v_src is None or not _same_repeat(q, k_src, v_src) or _shape(k_src)[1] % divisor:
            continue
        n.args = (q, k_src, v_src, *n.args[3:])
        n.kwargs = {**n.kwargs, "enable_gqa": True}
        for old in (k, v):
            _drop_unused(gm, old)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def repeated_from(node) -> fx.Node | None:
    """The keys or values ``node`` repeats head-wise to the query heads (``repeat_kv``'s
    unsqueeze-expand-reshape, or ``repeat_interleave`` on dim 1), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    src = None
    if node.target in _RESHAPES:
        ex = node.args[0]
        if isinstance(ex, fx.Node) and ex.target is aten.expand.default:
            un = ex.args[0]
            if isinstance(un, fx.Node) and un.target is aten.unsqueeze.default and un.args[1] == 2:
                src = un.args[0]
                if not _expands_heads(un, ex):
                    return None
    elif node.target is aten.repeat_interleave.self_int and len(node.args) > 1 and isinstance(node.args[1], int) \
            and (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) == 1:
        src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    have, want = _shape(src), _shape(node)
    if have is None or want is None or len(have) != 4 or len(want) != 4:
        return None
    if not (_eq(have[0], want[0]) and _eq(have[2], want[2]) and _eq(have[3], want[3])):
        return None
    if not (isinstance(have[1], int) and isinstance(want[1], int) and have[1] and want[1] % have[1] == 0):
        return None
    return src if want[1] > have[1] else None


def _expands_heads(un: fx.Node, ex: fx.Node) -> bool:
    """The expand only repeats the inserted dim: [b, hk, 1, s, d] -> [b, hk, rep, s, d]."""
    a, b = _shape(un), _shape(ex)
    return a is not None and b is not None and len(a) == 5 and len(b) == 5 and \
        all(_eq(a[i], b[i]) for i in (0, 1, 3, 4)) and a[2] == 1


def _same_repeat(q, k: fx.Node, v: fx.Node) -> bool:
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if qs is None or len(qs) != 4 or not isinstance(qs[1], int):
        return False
    return ks[1] == vs[1] and qs[1] % ks[1] == 0


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else s for s in val.shape)


def _eq(a, b) -> bool:
    return a == b if isinstance(a, int) and isinstance(b, int) else str(a) == str(b)


def _drop_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and then its inputs while nothing reads them (a repeat's chain)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.users or n.target not in (*_RESHAPES, aten.expand.default,
                                                                 aten.unsqueeze.default,
                                                                 aten.repeat_interleave.self_int,
                                                                 aten.clone.default, aten.contiguous.default):
            continue
        inputs = [a for a in n.all_input_nodes]
        gm.graph.erase_node(n)
        todo.extend(inputs)


# the longest sequence a mask is probed at (a 16K x 16K boolean mask: 256 MB)
PROBE_MAX_SEQ = 16384
# ops that read only an input's sizes, dtype or device, never its values
_METADATA = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.new_ones.default,
             aten.new_zeros.default, aten.new_empty.default, aten.new_full.default}


def causal_at_probe(mask: fx.Node, sizes: dict[str, int]) -> bool:
    """Is the mask ``mask`` computes exactly causal at ``sizes`` (the sequence capped at
    :data:`PROBE_MAX_SEQ`)? Only for a mask made of sizes alone (the graph's inputs reach it
    through their sizes, dtype or device only, no parameter or buffer): then it is computed here
    on stand-in inputs. What the simulator prices for attention under such a mask
    (passes/flops.py); the runtime checks each mask itself (runtime/attention.graph_sdpa), so a
    mask that is causal only at the probe's size is still run exactly."""
    from autopar.core.meta import evaluate, info
    from autopar.runtime.attention import is_causal_mask
    cache = mask.meta.setdefault("autopar_causal_probe", {})
    at = {k: min(v, PROBE_MAX_SEQ) if k == "seq" else v for k, v in sizes.items()}
    key = tuple(sorted(at.items()))
    if key in cache:
        return cache[key]
    nodes, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in nodes:
            continue
        nodes.add(n)
        todo.extend(n.all_input_nodes)
    verdict = False
    if all(n.op in ("placeholder", "call_function") for n in nodes) and all(
            u.target in _METADATA for n in nodes if n.op == "placeholder" for u in n.users if u in nodes) \
            and not any(n.op == "placeholder" and info(n).kind in ("param", "buffer") for n in nodes):
        env: dict[fx.Node, object] = {}
        try:
            for n in mask.graph.nodes:
                if n not in nodes:
                    continue
                if n.op == "placeholder":
                    v = info(n).values[0]
                    env[n] = torch.zeros([evaluate(d, at) for d in v.shape], dtype=v.dtype)
                else:
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
                    kwargs = {k: (torch.device("cpu") if k == "device" else x) for k, x in kwargs.items()}
                    env[n] = n.target(*args, **kwargs)
            out = env[mask]
            verdict = isinstance(out, torch.Tensor) and is_causal_mask(out)
        except Exception:       # noqa: BLE001 - a mask this probe cannot compute is priced as given
            verdict = False
    cache[key] = verdict
    return verdict


__all__ = ["unrepeat_kv", "repeated_from", "causal_at_probe", "PROBE_MAX_SEQ"]
