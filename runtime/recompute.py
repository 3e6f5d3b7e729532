"""Activation recomputation: run a captured graph with some regions checkpointed.

``full`` checkpoints every member of the repeated block classes (each transformer layer): its
forward keeps only the tensors entering the layer, and backward runs the layer's forward
again. ``layers:K`` checkpoints so the first K layers of the graph (of each pipeline stage's
graph), in graph order, and keeps the others' activations. ``pointwise`` checkpoints every
layer as ``full`` does, under torch's selective checkpoint (:data:`KEPT_OPS`): the outputs of
its matmuls and attention are kept from forward (backward's recomputation takes them instead of
running those ops again) and everything else (norms, activations, rotary, casts, gathers) runs
again. ``selective`` checkpoints only the attention cores (a fused attention op, or the run of
score ops between the two attention matmuls), which hold the ``[b, heads, s, s]`` scores.
``none`` still checkpoints an attention the model writes out eagerly, from the layout ops that
only feed it (keys and values repeated per query head) through its scores' matmul to its values'
matmul (:func:`eager_attention_cores`), as a fused attention kernel recomputes its scores: the
scores are never kept. ``selective`` checkpoints such a core whole too, and ``layers:K`` each one
outside its K recomputed layers.
Regions are runs of consecutive graph nodes; each runs under ``torch.utils.checkpoint``
(non-reentrant, RNG state preserved) as a function of the tensors it reads from outside, and
hands on the values read after it. Collectives inside a region run again in the recomputation,
on every rank alike.

Under ZeRO-3 a region reads whole parameters that a bucket gather made just for this forward.
Checkpoint would keep them as region inputs until backward; instead the region gets a token
for each (:meth:`~autopar.runtime.dp.DPRuntime.token_for`) and its recomputation gathers the
parameter again (:meth:`~autopar.runtime.dp.DPRuntime.whole_for_backward`), as backward does for
every whole parameter autograd saves. The data-axis nodes the scheduling pass placed inside a
region's run of nodes (a bucket's gather just before its first use) run just before the region,
so they do not cut it in two.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.core.errors import ConfigError
from autopar.core.meta import graph_info, info
from autopar.core.plans import RECOMPUTE, recompute_layers
from autopar.runtime.dp import DP_OPS, DPRuntime

MODES = RECOMPUTE           # and "layers:K" (autopar.core.plans.recompute_layers)
_SCORE_OPS = {"_softmax", "softmax", "_safe_softmax", "masked_fill", "where", "dropout", "native_dropout"}


def regions(gm: fx.GraphModule, mode: str, members: Sequence[str] | None = None) -> dict[fx.Node, int]:
    """Node -> region id for ``mode`` (empty for ``none``). ``members`` names the layers
    ``full`` checkpoints (default: the members of ``gm``'s repeated block classes; a pipeline
    stage passes the whole model's, since it holds only some of them); ``layers:K`` takes the
    first K of them that ``gm`` holds."""
    count = recompute_layers(mode)
    out: dict[fx.Node, int] = {}
    cores = eager_attention_cores(gm)
    if mode == "none":
        return cores
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if mode in ("full", "pointwise") or count is not None:
        if members is None:
            members = layer_members(gm)
        if count is not None:
            wanted = set(members)
            members = [m for m in dict.fromkeys(info(n).block_member for n in nodes) if m in wanted][:count]
        index = {m: i for i, m in enumerate(members)}
        for n in nodes:
            m = info(n).block_member
            if m in index:
                out[n] = index[m]
        if count is not None:      # the layers not recomputed still run their eager cores checkpointed
            _add_cores(out, cores)
        return out
    # selective: an eager core as a whole (its scores' matmul too, so no [b, heads, s, s] tensor
    # is kept), the score ops of the other attentions
    _add_cores(out, cores)
    rid = len(set(out.values()))
    for i, n in enumerate(nodes):
        if n in cores:
            continue
        name = _name(n)
        if "scaled_dot_product" in name:
            out[n] = rid
            rid += 1
        elif name in _SCORE_OPS and _square_last(n):
            prev = nodes[i - 1] if i else None
            if prev is not None and prev in out and _name(prev) in _SCORE_OPS:
                out[n] = out[prev]
            else:
                out[n] = rid
                rid += 1
    return out


_MATMULS = {"bmm", "matmul", "baddbmm"}
_THROUGH = {"mul", "div", "tanh", "add", "sub", "to", "_to_copy", "clone", "view", "_unsafe_view", "reshape",
            "expand", "contiguous", "masked_fill", "where", "dropout", "native_dropout", "alias", "detach",
            "_softmax", "softmax", "_safe_softmax"}


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if info(a).values]


def _add_cores(out: dict[fx.Node, int], cores: dict[fx.Node, int]) -> None:
    """Add each eager core none of whose nodes is in a region of ``out`` yet, as regions of their own."""
    members: dict[int, list[fx.Node]] = {}
    for n, r in cores.items():
        members.setdefault(r, []).append(n)
    base = max(out.values(), default=-1) + 1
    for r, ns in members.items():
        if not any(n in out for n in ns):
            for n in ns:
                out[n] = base + r


def eager_attention_cores(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Node -> region of each attention a model writes out eagerly (transformers' eager
    attention: Gemma 2's soft-capped scores, DeepSeek's latent attention): the batched matmul
    of queries and keys into ``[.., s, s]`` scores, the ops on the scores (scale, soft cap,
    mask, softmax, casts, dropout) and the batched matmul of the probabilities with the values;
    and an attention call whose queries and values differ in width (the math kernel, which keeps
    the scores, is the only one that takes it).
    Under ``recompute="none"`` such a core runs checkpointed, as a fused attention kernel does:
    forward keeps its inputs (queries, keys, values, mask), not the scores, and backward runs
    the same ops again (so the gradients are bit for bit the eager model's)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    at = {n: i for i, n in enumerate(nodes)}
    out: dict[fx.Node, int] = {}
    for soft in nodes:
        if _name(soft) not in ("_softmax", "softmax", "_safe_softmax") or not _square_last(soft):
            continue
        start, n = None, soft                     # back to the scores' matmul
        for _ in range(16):
            ins = [a for a in _tensor_args(n) if a in at]
            if not ins:
                break
            n = max(ins, key=lambda a: at[a])     # the latest input: the scores, not the mask
            if _name(n) in _MATMULS:
                start = n
                break
            if _name(n) not in _THROUGH:
                break
        end, n = None, soft                       # on to the values' matmul
        for _ in range(16):
            users = [u for u in n.users if u in at]
            if len(users) != 1:
                break
            n = users[0]
            if _name(n) in _MATMULS:
                end = n
                break
            if _name(n) not in _THROUGH:
                break
        if start is None or end is None or any(m in out for m in nodes[at[start]:at[end] + 1]):
            continue
        first = _feeds_before(nodes, at, at[start], at[end], out)
        rid = len(set(out.values()))
        for m in nodes[first:at[end] + 1]:
            out[m] = rid
    for n in nodes:      # an attention call no kernel that keeps log-sum-exp takes: the math one keeps scores
        if _name(n) in ("scaled_dot_product_attention", "graph_sdpa") and n not in out and _math_only(n):
            rid = len(set(out.values()))
            for m in nodes[_feeds_before(nodes, at, at[n], at[n], out):at[n] + 1]:
                out[m] = rid
    return out


_LAYOUT = {"expand", "unsqueeze", "reshape", "view", "_unsafe_view", "clone", "contiguous", "transpose", "permute",
           "alias", "t", "split", "split_with_sizes", "getitem", "slice", "select", "new_empty", "copy_"}
_VIEWS = {"expand", "unsqueeze", "view", "_unsafe_view", "transpose", "permute", "alias", "t", "slice", "select"}


def _feeds_before(nodes: list[fx.Node], at: dict[fx.Node, int], first: int, last: int,
                  taken: dict[fx.Node, int]) -> int:
    """Where a core starts once the layout ops just before it that only feed it join it:
    transformers' ``repeat_kv`` (keys and values expanded to every query head and copied), the
    keys' transpose, DeepSeek's keys assembled from the latent projection's output and the
    rotary part. These ops copy or view, so the core then keeps what they read (the keys and
    values as the model made them) instead of their per-head copies. An in-place copy joins
    only with the tensor it writes."""
    inside = set(nodes[first:last + 1])
    start = first
    while start > 0:
        n = nodes[start - 1]
        if _name(n) not in _LAYOUT or n in taken or not all(u in inside for u in n.users):
            break
        if not n.users and not _name(n).endswith("_"):
            break
        start -= 1
        inside.add(n)
    cut = True
    while cut:                            # an in-place write into a tensor made outside: start after it
        cut, region = False, set(nodes[start:last + 1])
        for n in nodes[start:first]:
            root = n.args[0] if not n.users else None
            while isinstance(root, fx.Node) and root in region and _name(root) in _VIEWS:
                root = root.args[0]
            if not n.users and root not in region:
                start, cut = at[n] + 1, True
                break
    return start


def _math_only(n: fx.Node) -> bool:
    """Whether ``n`` (a ``scaled_dot_product_attention`` call) runs the math kernel, which keeps
    the scores: queries and values of other head widths (DeepSeek's latent attention), which the
    flash kernels do not take."""
    try:
        q, v = info(n.args[0]).values[0], info(n.args[2]).values[0]
        return str(q.shape[-1]) != str(v.shape[-1])
    except (IndexError, AttributeError, TypeError):
        return False


def layer_members(gm: fx.GraphModule) -> list[str]:
    """The members (layers) of ``gm``'s repeated block classes, in graph order: every layer of
    a model whose layers differ (DeepSeek-V3's dense first layers and its MoE ones)."""
    classes = graph_info(gm).block_classes
    if not classes:
        raise ConfigError("full recomputation needs repeated layers, and the graph has none", where="recompute",
                          fix="use recompute='selective' or 'none'")
    members = {m for c in classes for m in c.members}
    order = dict.fromkeys(info(n).block_member for n in gm.graph.nodes if info(n).block_member in members)
    return list(order)


def _name(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def _square_last(n: fx.Node) -> bool:
    vals = info(n).values
    return bool(vals) and len(vals[0].shape) == 4 and str(vals[0].shape[-1]) == str(vals[0].shape[-2])


HELD: dict[int, int] = {}   # storage pointer -> bytes of the tensors regions kept for backward

aten = torch.ops.aten
# ``pointwise``: the ops whose outputs a region keeps (the matmuls and the attention kernels);
# backward's recomputation runs the rest again
KEPT_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default,
                      aten._scaled_dot_product_attention_math.default, aten.convolution.default,
                      aten._grouped_mm.default})


def _outside_policy():
    """The dispatch modes (the selective checkpoint's record) set aside for a block of ops."""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def run(gm: fx.GraphModule, args: Sequence[Any], where: dict[fx.Node, int],
        zero3: Sequence[DPRuntime] = (), mode: str = "full") -> Any:
    """Execute ``gm`` on ``args`` like ``gm(*args)``, checkpointing the regions in ``where``
    (``mode`` ``pointwise``: under the selective policy that keeps matmul and attention outputs).
    ``zero3`` are the ZeRO-3 runtimes whose gathered whole parameters regions must not keep (see
    the module docstring). The tensors each region keeps (its inputs) are noted in ``HELD`` for
    measurement."""
    env: dict[fx.Node, Any] = {}
    inputs = iter(args)
    nodes = list(gm.graph.nodes)
    i = 0
    while i < len(nodes):
        n = nodes[i]
        if n.op == "placeholder":
            env[n] = next(inputs)
        elif n.op == "output":
            return fx.node.map_arg(n.args[0], lambda a: env[a])
        elif n in where:
            members, before, i = _region_at(nodes, i, where)
            for m in before:
                env[m] = _execute(gm, m, env)
            _run_region(gm, members, env, zero3, mode == "pointwise")
            continue
        else:
            env[n] = _execute(gm, n, env)
        i += 1
    raise ConfigError("graph has no output node", where="recompute")


def _region_at(nodes: list[fx.Node], i: int, where: dict[fx.Node, int]) -> tuple[list[fx.Node], list[fx.Node], int]:
    """The region starting at ``nodes[i]``: its nodes, the data-axis nodes among them (to run
    before it: they read only parameters and each other, never the region's values), and the
    index just past its last node."""
    rid = where[nodes[i]]
    members: list[fx.Node] = []
    before: list[fx.Node] = []
    between: list[fx.Node] = []
    end = i
    for j in range(i, len(nodes)):
        n = nodes[j]
        if where.get(n) == rid:
            members.append(n)
            before += between
            between = []
            end = j + 1
        elif _data_axis(n):
            between.append(n)
        else:
            break
    return members, before, end


def _data_axis(n: fx.Node) -> bool:
    """A node the data-parallel rewrite inserted (or one unpacking its outputs)."""
    src = n.args[0] if n.target is operator.getitem else n
    return isinstance(src, fx.Node) and src.target in DP_OPS


def _execute(gm: fx.GraphModule, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args = fx.node.map_arg(n.args, lambda a: env[a])
    kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "get_attr":
        obj = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj
    if n.op == "call_module":
        return gm.get_submodule(str(n.target))(*args, **kwargs)
    if n.op == "call_method":
        return getattr(args[0], str(n.target))(*args[1:], **kwargs)
    raise ConfigError(f"cannot run node {n.name} ({n.op})", where="recompute")


def _run_region(gm: fx.GraphModule, run_nodes: list[fx.Node], env: dict[fx.Node, Any],
                zero3: Sequence[DPRuntime], keep_matmuls: bool = False) -> None:
    inside = set(run_nodes)
    reads: list[fx.Node] = []
    for n in run_nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in reads:
                reads.append(a)
    tensors = [a for a in reads if isinstance(env[a], torch.Tensor)]
    others = {a: env[a] for a in reads if not isinstance(env[a], torch.Tensor)}
    outs = [n for n in run_nodes if any(u not in inside for u in n.users)]
    tokens: dict[fx.Node, tuple[DPRuntime, Any]] = {}
    if torch.is_grad_enabled():    # without grad nothing is recomputed
        for a in tensors:
            for rt in zero3:
                tok = rt.token_for(env[a])
                if tok is not None:
                    tokens[a] = (rt, tok)
                    break
    kept = [a for a in tensors if a not in tokens]
    live = {a: env[a] for a in tokens}            # the gathered parameters, for the first run only
    needs_grad = {a: env[a].requires_grad for a in tokens}

    def region(*values: torch.Tensor) -> tuple:
        local = dict(others)
        local.update(zip(kept, values))
        if live:
            local.update(live)
            live.clear()         # checkpoint keeps this function for the recomputation: let them go
        else:
            # Recomputation: gathered again, with the gradient flag they had, so the ops save
            # the same tensors as in forward (checkpoint matches them by order). Under the
            # selective policy the gather runs outside its op record: forward took these whole
            # parameters from outside the region, and the recomputation must meet the same ops.
            with _outside_policy() if keep_matmuls else contextlib.nullcontext():
                for a, (rt, tok) in tokens.items():
                    local[a] = rt.whole_for_backward(tok).detach().requires_grad_(needs_grad[a])
        for n in run_nodes:
            local[n] = _execute(gm, n, local)
        return tuple(local[o] for o in outs)

    for a in kept:
        t = env[a]
        if t.requires_grad or t.grad_fn is not None:
            HELD[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)} \
        if keep_matmuls else {}
    got = checkpoint(region, *[env[a] for a in kept], use_reentrant=False, **extra)
    env.update(zip(outs, got))


__all__ = ["MODES", "HELD", "layer_members", "regions", "run"]
