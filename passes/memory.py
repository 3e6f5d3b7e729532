"""Memory pass: what forward keeps for backward, and what is live when.

Reads ``values`` and ``requires_grad`` (shape and FLOP passes). Writes, per node,
``saved_bytes`` (bytes of this node's output that forward keeps alive for backward) and
``live_bytes`` (activation bytes live just after the node runs in forward).

Which values an op saves is per-op knowledge in :data:`SAVE_RULES` (keyed by ATen op):
a rule returns the saved inputs (by position) and whether the output itself is saved.
A view that is saved counts against the value it views. An op with no rule that a
gradient flows through is assumed to save all of its tensor inputs (an upper bound) and
is named once in a warning.

Parameter, gradient and optimizer-state bytes are not per node: see
:func:`state_bytes` and :func:`optimizer_state_bytes`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopar.core.errors import ConfigError
from autopar.passes.flops import is_view_like
from autopar.core.meta import ZERO, dtype_bytes, info, template_of, within

log = logging.getLogger("autopar.memory")
aten = torch.ops.aten


@dataclass(frozen=True)
class Saves:
    """What one op keeps for its backward: input positions, the output, extra bytes."""

    inputs: tuple[int, ...] = ()
    output: bool = False


# rule: (node) -> Saves. Only consulted when a gradient flows through the node.
SAVE_RULES: dict[object, Callable[[fx.Node], Saves]] = {}
_warned: set[str] = set()


def _needs(node: fx.Node, i: int) -> bool:
    a = node.args[i] if i < len(node.args) else None
    return isinstance(a, fx.Node) and info(a).requires_grad


def _save(*ops: object) -> Callable[[Callable[[fx.Node], Saves]], Callable[[fx.Node], Saves]]:
    def register(fn: Callable[[fx.Node], Saves]) -> Callable[[fx.Node], Saves]:
        for op in ops:
            SAVE_RULES[op] = fn
        return fn
    return register


def _const(saves: Saves) -> Callable[[fx.Node], Saves]:
    return lambda node: saves


def _operands(node: fx.Node) -> Saves:
    """Binary products: the gradient w.r.t. each operand needs the other one."""
    keep = tuple(i for i, j in ((0, 1), (1, 0)) if _needs(node, j))
    return Saves(inputs=keep)


for _op in (aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
            aten.mul.Tensor, aten.div.Tensor):
    SAVE_RULES[_op] = _operands
for _op in (aten.addmm.default, aten.baddbmm.default):
    SAVE_RULES[_op] = lambda n: Saves(inputs=tuple(i for i, j in ((1, 2), (2, 1)) if _needs(n, j)))

_NOTHING = Saves()
for _op in (aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.mul.Scalar, aten.div.Scalar,
            aten.add.Scalar, aten.sub.Scalar, aten.sum.dim_IntList, aten.sum.default,
            aten.mean.dim, aten.mean.default, aten.cat.default, aten.stack.default,
            aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout,
            aten.type_as.default, aten.cumsum.default, aten.copy.default, aten.zeros_like.default,
            aten.ones_like.default, aten.full_like.default, aten.new_zeros.default, aten.pad.default,
            aten.constant_pad_nd.default, aten.repeat.default, aten.repeat_interleave.self_int,
            aten.index_put.default, aten.masked_fill.Scalar, aten.scatter_add.default,
            aten.scatter.src, aten.scatter.value, aten.add_.Tensor, aten.copy_.default,
            aten.new_empty.default, aten.numpy_T.default):
    SAVE_RULES[_op] = _const(_NOTHING)
for _op in (aten.gelu.default, aten.silu.default, aten.pow.Tensor_Scalar, aten.log.default,
            aten.sin.default, aten.cos.default, aten.abs.default, aten.erf.default,
            aten.leaky_relu.default, aten.gelu_.default, aten.silu_.default, aten.square.default):
    SAVE_RULES[_op] = _const(Saves(inputs=(0,)))
for _op in (aten.relu.default, aten.relu_.default, aten.tanh.default, aten.sigmoid.default,
            aten.exp.default, aten.rsqrt.default, aten.sqrt.default, aten.softmax.int,
            aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
            aten.reciprocal.default):
    SAVE_RULES[_op] = _const(Saves(output=True))
# layer_norm keeps its input (plus per-row mean/rstd, counted in _extra_bytes).
SAVE_RULES[aten.layer_norm.default] = _const(Saves(inputs=(0,)))
SAVE_RULES[aten.rms_norm.default] = _const(Saves(inputs=(0,)))
SAVE_RULES[aten.embedding.default] = _const(Saves(inputs=(1,)))
for _op in (aten.gather.default, aten.index_select.default, aten.index.Tensor,
            aten.take_along_dim.default):
    SAVE_RULES[_op] = _const(Saves(inputs=(2,) if _op is not aten.index.Tensor else ()))
for _op in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
    SAVE_RULES[_op] = _const(Saves(inputs=(0,)))        # the condition picks where the gradient goes
SAVE_RULES[aten.div_.Tensor] = _const(Saves(inputs=(1,), output=True))
SAVE_RULES[aten.scatter_.value] = _const(Saves(inputs=(2,)))     # the index
# operators other libraries register, by name (they exist only once the library is imported)
NAMED_SAVE_RULES: dict[str, Callable[[fx.Node], Saves]] = {
    "transformers.grouped_mm_fallback.default": _const(Saves(inputs=(0, 1))),   # a grouped matmul
}
# cross entropy keeps its log-softmax (the size of its input) and the targets
SAVE_RULES[aten.cross_entropy_loss.default] = _const(Saves(inputs=(0, 1)))
SAVE_RULES[aten.topk.default] = _const(Saves(output=True))     # the indices (dedup by node)
SAVE_RULES[aten.max.dim] = _const(Saves(output=True))
# flash-style attention keeps q, k, v, its output and a per-row logsumexp (fp32).
for _op in (aten.scaled_dot_product_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default):
    SAVE_RULES[_op] = _const(Saves(inputs=(0, 1, 2), output=True))
SAVE_RULES[aten.dropout.default] = _const(Saves(output=True))  # its mask, about as big


def memory_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate saved-for-backward bytes and forward liveness on every node."""
    from autopar.passes.fusion import unkept
    saved: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not info(node).requires_grad:
            continue
        for base in _saved_values(node):
            if info(base).kind not in ("param", "buffer", "constant"):
                saved.add(base)
    fused = saved & unkept(gm)     # what the runtime's fused ops recompute instead (passes/fusion.py)
    saved -= fused
    from autopar.runtime.recompute import eager_attention_cores
    cores = eager_attention_cores(gm)      # recomputed whatever the mode: their scores are never kept
    saved -= {n for n in cores if all(u in cores for u in n.users)}
    # and a core keeps what it reads (checkpoint's inputs): the keys and values as the model made
    # them, a mask
    saved |= {b for n in cores for a in n.all_input_nodes if a not in cores and info(a).values
              for b in (_base(a),) if info(b).kind not in ("param", "buffer", "constant")}
    for node in gm.graph.nodes:
        rec = info(node)
        t = template_of(node)
        if t is not None and (t in saved) == (node in saved) and (t in fused) == (node in fused) \
                and info(t).requires_grad == rec.requires_grad:
            rec.saved_bytes = info(t).saved_bytes        # a copied layer's node, kept alike
            rec.fused_bytes = info(t).fused_bytes
            continue
        rec.fused_bytes = rec.out_bytes if node in fused else ZERO
        own = rec.out_bytes if node in saved else ZERO
        stats = _extra_bytes(node) if node.op == "call_function" and rec.requires_grad else ZERO
        rec.saved_bytes = sympy.expand(own + stats)
    _liveness(gm, saved)
    return gm


def _saved_values(node: fx.Node) -> list[fx.Node]:
    rule = SAVE_RULES.get(node.target) or NAMED_SAVE_RULES.get(str(node.target))
    if rule is None:
        if is_view_like(node):
            return []
        name = str(node.target)
        if name not in _warned:
            _warned.add(name)
            log.warning("memory: no saved-tensor rule for %s (first at %s); assuming it keeps all "
                        "its tensor inputs for backward", name, info(node).fqn or "<root>")
        return [_base(a) for a in node.all_input_nodes]
    saves = rule(node)
    out = [_base(node.args[i]) for i in saves.inputs
           if i < len(node.args) and isinstance(node.args[i], fx.Node)]
    if saves.output:
        out.append(node)
    return out


def _extra_bytes(node: fx.Node) -> sympy.Expr:
    """Small per-row statistics some ops keep (norms: mean and rstd; attention: logsumexp)."""
    v = info(node).value
    if v is None:
        return ZERO
    if node.target in (aten.layer_norm.default,):
        rows = v.numel / v.shape[-1]
        return 2 * rows * 4
    if node.target in (aten.scaled_dot_product_attention.default,):
        return v.numel / v.shape[-1] * 4
    return ZERO


def _base(node: fx.Node) -> fx.Node:
    """Follow views back to the value whose storage they share."""
    while node.op == "call_function" and is_view_like(node) and node.all_input_nodes:
        first = node.args[0]
        if not isinstance(first, fx.Node):
            break
        node = first
    return node


def _liveness(gm: fx.GraphModule, saved: set[fx.Node]) -> None:
    """Forward liveness: a value lives from its producer to its last use, or to the end of
    forward when backward needs it. Views add nothing of their own. The running sum is kept
    as {monomial: coefficient} (integer arithmetic, no formula per node) and each node gets
    its own copy, made a sympy formula only where it is read (``NodeInfo.live_bytes``)."""
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for a in node.all_input_nodes:
            last_use[_base(a)] = i
    live: dict[fx.Node, dict] = {}
    terms: dict[fx.Node, dict] = {}       # every value's bytes as terms (a copy takes its template's)
    total: dict = {}
    snapshot: dict = {}

    def add(value: dict, sign: int) -> None:
        for m, c in value.items():
            v = total.get(m, 0) + sign * c
            if v:
                total[m] = v
            else:
                del total[m]

    for i, node in enumerate(nodes):
        rec = info(node)
        changed = False
        if node.op == "call_function" and not is_view_like(node):
            t = template_of(node)
            own = terms[node] = terms[t] if t in terms else _terms(rec.out_bytes)
            live[node] = own
            add(own, 1)
            changed = True
        for a in set(_base(x) for x in node.all_input_nodes):
            if a in live and last_use.get(a) == i and a not in saved:
                add(live.pop(a), -1)
                changed = True
        if changed:
            snapshot = dict(total)
        rec.live_terms = snapshot if snapshot else ZERO


def _terms(expr: sympy.Expr) -> dict:
    return {m: int(c) if c.is_Integer else c for m, c in sympy.expand(expr).as_coefficients_dict().items() if c}


# ---- parameters, gradients and optimizer state ------------------------------------------

# Optimizer state in elements per trainable parameter, kept in fp32.
OPTIMIZER_STATE: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2,
                                   "adagrad": 1, "rmsprop": 1, "adafactor": 0}


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


def optimizer_state_bytes(trainable_numel: int, optimizer: str = "adamw", *,
                          master_weights: bool = False) -> int:
    """fp32 optimizer state for ``trainable_numel`` parameters (plus fp32 master weights when
    the model computes in 16-bit; with Adam that is ZeRO's 12 bytes per parameter)."""
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}", expected=", ".join(sorted(OPTIMIZER_STATE)),
                          got=optimizer, fix="pick one of the listed optimizer kinds")
    per = OPTIMIZER_STATE[key] + (1 if master_weights else 0)
    return trainable_numel * per * 4


def state_bytes(gm: fx.GraphModule, optimizer: str = "adamw", *, param_dtype: torch.dtype | None = None,
                prefix: str = "") -> StateBytes:
    """Parameter, gradient, optimizer and buffer bytes of the graph (or of module ``prefix``).

    ``param_dtype`` overrides the stored dtype (e.g. bf16 training of an fp32-built model);
    16-bit parameters imply fp32 master weights in the optimizer state.
    """
    params = grads = trainable = buffers = 0
    master = False
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.kind not in ("param", "buffer") or not rec.values or not within(rec.target_fqn or "", prefix):
            continue
        v = rec.values[0]
        numel = int(v.numel)
        dtype = param_dtype or v.dtype
        if rec.kind == "buffer":
            buffers += numel * dtype_bytes(v.dtype)
            continue
        params += numel * dtype_bytes(dtype)
        if rec.trainable:
            grads += numel * dtype_bytes(dtype)
            trainable += numel
            master = master or dtype_bytes(dtype) < 4
    return StateBytes(params=params, grads=grads, buffers=buffers,
                      optimizer=optimizer_state_bytes(trainable, optimizer, master_weights=master))

