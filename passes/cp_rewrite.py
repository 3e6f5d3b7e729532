"""Context parallelism's rewrite: each rank runs the graph on its own tokens of the sequence.

The ``cp`` ranks of a data replica each hold the load-balanced share of every sequence
(``runtime/cp.py``: chunks ``r`` and ``2 cp - 1 - r``). Most of a transformer computes token by
token (projections, norms, MLPs, the loss per token): those ops run on the rank's tokens as they
are, the *local* version of each value. What mixes positions needs the whole sequence:

- **attention** (``scaled_dot_product_attention``) runs as one of the context-parallel kinds
  (``ring``, ``allgather``, ``alltoall``: :func:`autopar.runtime.cp.graph_attention`) on the
  local queries, keys and values, under the model's own mask computed on the whole sequence;
- **positions**: ``arange(seq)`` is this rank's global positions locally (so rotary and learned
  position embeddings see the positions one process gives these tokens) and the whole
  ``arange`` where the whole sequence is needed;
- **anything else that mixes positions** (the causal and sliding-window masks built from
  positions, packed documents found from position ids, the shift of the labels in the loss) runs
  on the *whole* version of its inputs (token ids and labels gathered over ``cp``, positions and
  sizes of the whole sequence) and hands each local reader this rank's rows of its result.

Which ops mix positions is decided by following the sequence dim through the graph with the
rules that follow the batch dim (:func:`autopar.passes.batch_coupling.carried_dims`): an op that
keeps the sequence in one dim of its outputs runs locally; one that pairs positions (a
product over the sequence, a scan along it, a value indexed by positions), shifts them (a slice
or pad of the sequence dim) or has no rule runs whole. A whole value read locally must hold the
sequence in exactly one dim (found by its size, the ``seq`` symbol); a float value that needs
gradients is gathered (its gradient returns to the ranks that hold its tokens) rather than
recomputed, everything else (ids, positions, masks) is recomputed whole from gathered inputs.
Reductions over the sequence (the loss) stay each rank's part, summed over ranks as a data axis
sums them (``runtime/token_loss.py``, gradients averaged over ``dp x cp``).
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from autopar.core.errors import ConfigError, UnsupportedError
from autopar.core.meta import META_KEY, NodeInfo, graph_info, info, set_info
from autopar.passes.sharding import tensor_args
from autopar.passes.batch_coupling import FREE, LOST, SUMMED, carried_dims
from autopar.runtime import cp as cp_runtime

aten = torch.ops.aten
ATTENTION = {aten.scaled_dot_product_attention.default}
# indexing a value along the sequence by position values needs the value's whole sequence
_INDEXING = {aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.index_put.default,
             aten.index_put_.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
             aten.select.int}


@dataclass
class CpReport:
    """What the rewrite did: the attention ops it replaced, the ops it ran on the whole sequence
    (their targets, counted), the values it gathered."""

    attention: list[str] = field(default_factory=list)
    whole_ops: dict[str, int] = field(default_factory=dict)
    gathered: list[str] = field(default_factory=list)


def cp_rewrite(gm: fx.GraphModule, *, cp: int, group_name: str, kind: str) -> CpReport:
    """Rewrite ``gm`` in place to run this rank's tokens of every sequence (module docstring)."""
    if kind not in cp_runtime.KINDS:
        raise ConfigError(f"unknown context-parallel kind {kind!r}", where="parallelize(cp_kind=...)",
                          expected=" | ".join(cp_runtime.KINDS), got=repr(kind),
                          fix="pick ring, allgather or alltoall")
    gi = graph_info(gm)
    seq = gi.symbols.get("seq")
    if seq is None:
        raise UnsupportedError("context parallelism splits the sequence, but no input has a sequence dim",
                               where="parallelize", got=f"named sizes {sorted(gi.symbols)}",
                               fix="label the sequence dim of the token inputs "
                                   "(TensorOptions(dims={'input_ids': {0: 'batch', 1: 'seq'}}))")
    an = _analyse(gm, seq)
    forced: set[fx.Node] = set()
    while True:         # a sum over the sequence read by anything but the outputs runs whole
        more = _partial_misread(gm, an) - forced
        if not more:
            break
        forced |= more
        an = _analyse(gm, seq, forced)
    if not an.attention and not an.scores:
        raise UnsupportedError("context parallelism found no attention in the graph", where="parallelize",
                               got="no scaled_dot_product_attention and no softmax(q @ k^T) @ v",
                               fix="drop the cp axis: a model without attention gains nothing from splitting the "
                                   "sequence")
    return _Emit(gm, an, seq, cp, group_name, kind).run()


@dataclass
class _Analysis:
    dim: dict[fx.Node, list]          # where each value's local version carries the sequence
    dep: set[fx.Node]                 # values that differ between the local and the whole sequence
    whole_only: set[fx.Node]          # ops that must run on the whole sequence
    sources: set[fx.Node]             # arange(seq): positions
    attention: set[fx.Node]
    # eager attention: values holding this rank's query rows against the whole sequence's keys
    # (their last dim is the whole sequence), and the arguments an op reads whole
    keys_whole: set[fx.Node] = field(default_factory=set)
    reads_whole: dict[fx.Node, set[fx.Node]] = field(default_factory=dict)
    scores: set[fx.Node] = field(default_factory=set)      # q @ k^T of eager attention


def _seq_dims(node: fx.Node, seq: sympy.Symbol) -> list[int | None]:
    """Per tensor output: the one dim whose size is the sequence, or None (none, or several)."""
    out = []
    for v in info(node).values if META_KEY in node.meta else ():
        dims = [d for d, s in enumerate(v.shape) if sympy.sympify(s) == seq]
        out.append(dims[0] if len(dims) == 1 else None)
    return out


def _inputs(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return list(dict.fromkeys(out))


def _is_tensor(node: fx.Node) -> bool:
    return META_KEY in node.meta and bool(info(node).values)


def _analyse(gm: fx.GraphModule, seq: sympy.Symbol, forced: set[fx.Node] = frozenset()) -> _Analysis:
    sizes = dict(graph_info(gm).example_sizes)
    an = _Analysis({}, set(), set(), set(), set())
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op != "call_function":
            d = _seq_dims(n, seq)[:1] if n.op == "placeholder" and info(n).kind == "input" else []
            if d and d[0] is not None:
                an.dim[n] = [d[0]]
                an.dep.add(n)
            elif n.op == "placeholder" and info(n).kind == "input" and any(
                    seq in sympy.sympify(s).free_symbols for v in info(n).values for s in v.shape):
                raise UnsupportedError("an input holds the sequence in several dims", where=f"input {n.name}",
                                       got=str([tuple(v.shape) for v in info(n).values]),
                                       fix="pass inputs with the sequence in one dim (dim 1 of token inputs)")
            else:
                an.dim[n] = [FREE]
            continue
        args = _inputs(n)
        if n.target is aten.sym_size.int:
            src, d = n.args
            if src in an.dep and an.dim.get(src, [None])[0] == d:
                an.dep.add(n)
            an.dim[n] = [FREE]
            continue
        if not any(a in an.dep for a in args):
            an.dim[n] = [FREE] * max(1, len(info(n).values) if META_KEY in n.meta else 1)
            continue
        an.dep.add(n)
        if not _is_tensor(n) and n.target is not operator.getitem:
            an.dim[n] = [FREE]                     # a size computed from sequence sizes
            continue
        if n.target in ATTENTION:
            an.attention.add(n)
            an.dim[n] = [an.dim[n.args[0]][0]]
            continue
        if n.target is aten.arange.default and sympy.sympify(info(n).values[0].shape[0]) == seq:
            an.sources.add(n)
            an.dim[n] = [0]
            continue
        if n.target is operator.getitem:
            src = n.args[0]
            if src in an.whole_only:
                an.whole_only.add(n)
                d = _seq_dims(n, seq)
                an.dim[n] = [d[0] if d and d[0] is not None else LOST]
            else:
                an.dim[n] = [an.dim[src][n.args[1]] if n.args[1] < len(an.dim[src]) else LOST]
            continue
        args = tensor_args(n)
        dims = [an.dim.get(a, [LOST])[0] for a in args]
        if _eager_attention(n, args, dims, an):
            continue
        if n.target in _RESHAPES and isinstance(dims[0], int) and not isinstance(dims[0], bool):
            got = [_reshaped(n, dims[0], sizes, seq)]
        elif any(a in an.keys_whole for a in args) and not _keeps_keys(n, args, an):
            got = None                   # an op this rewrite cannot follow on query rows: whole
        else:
            got = None if _indexes_sequence(n, dims) else carried_dims(n, dims, sizes)
        if got is None or any(g is LOST for g in got) or n in forced:
            an.whole_only.add(n)
            an.dim[n] = [d if d is not None else LOST for d in _seq_dims(n, seq)] or [LOST]
            if _query_by_key(n, seq):    # a mask over (query, key): localized, its rows are this rank's
                an.dim[n] = [len(info(n).values[0].shape) - 2]
                an.keys_whole.add(n)
        else:
            an.dim[n] = got
            if any(a in an.keys_whole for a in args):
                an.keys_whole.add(n)
    return an


# ops that keep a per-rank partial sum a partial sum: the value itself, a cast, a linear combination
_KEEPS_PARTIAL = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                  aten.alias.default, aten.detach.default, aten.squeeze.default, aten.squeeze.dim,
                  aten.unsqueeze.default, aten.to.dtype, aten._to_copy.default, aten.add.Tensor, aten.sub.Tensor,
                  aten.neg.default, aten.mul.Tensor, aten.div.Tensor}


def _partial_misread(gm: fx.GraphModule, an: _Analysis) -> set[fx.Node]:
    """Sums over the sequence (each rank's part of them) that something other than the graph's
    outputs reads as if whole (mean pooling fed to a classifier): those must run whole. A sum
    passed on unchanged, cast, or combined linearly with another such sum or a constant stays a
    part, as a loss summed over the data axis does."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or an.dim.get(n, [None])[0] is not SUMMED or n not in an.dep:
            continue
        for u in n.users:
            if u.op == "output":
                continue
            partial_args = [a for a in _inputs(u) if a in an.dep and a is not n
                            and an.dim.get(a, [None])[0] is not SUMMED and _is_tensor(a)]
            linear = u.target in _KEEPS_PARTIAL and not (
                u.target in (aten.mul.Tensor, aten.div.Tensor) and any(a in an.dep for a in _inputs(u) if a is not n))
            if not linear or partial_args:
                out.add(n)
    return out


_MATMULS = {aten.matmul.default, aten.bmm.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}


def _is_dim(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def _eager_attention(n: fx.Node, args: list[fx.Node], dims: list, an: _Analysis) -> bool:
    """Attention written out (``softmax(q @ k^T ...) @ v``): this rank's query rows against the
    whole sequence's keys (``q @ k^T`` with ``k^T`` read whole), then the weights times the whole
    sequence's values. Records the node and returns True when ``n`` is one of the two products."""
    if n.target not in _MATMULS or len(args) != 2 or not all(_is_dim(d) for d in dims):
        return False
    (a, b), (da, db) = args, dims
    ra, rb = (len(info(x).values[0].shape) for x in (a, b))
    if da != ra - 2 or ra != rb:
        return False
    if db == rb - 1 and a not in an.keys_whole:          # scores: queries x keys
        an.scores.add(n)
    elif db == rb - 2 and a in an.keys_whole:            # weights x values
        pass
    else:
        return False
    an.dim[n] = [ra - 2]
    an.reads_whole[n] = {b}
    if n not in an.scores:
        return True
    an.keys_whole.add(n)
    return True


def _keeps_keys(n: fx.Node, args: list[fx.Node], an: _Analysis) -> bool:
    """Ops that keep a (query rows x whole keys) value's key dim where it is: elementwise ones
    (scale, soft-cap, mask, casts, dropout) and a softmax over the keys."""
    if n.target in _SOFTMAX:
        rank = len(info(n).values[0].shape)
        return n.args[1] % rank == rank - 1
    tags = getattr(n.target, "tags", ())
    if torch.Tag.pointwise not in tags and n.target not in _ELEMENTWISE:
        return False
    shape = info(n).values[0].shape if info(n).values else ()
    return all(len(info(a).values[0].shape) in (0, len(shape)) or a not in an.keys_whole for a in args)


_ELEMENTWISE = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
                aten.contiguous.default, aten.alias.default, aten.detach.default, aten.dropout.default,
                aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.type_as.default}


def _query_by_key(n: fx.Node, seq: sympy.Symbol) -> bool:
    """Is ``n`` a (query, key) value: the sequence in its last two dims and nowhere else?"""
    vals = info(n).values if META_KEY in n.meta else ()
    if len(vals) != 1 or len(vals[0].shape) < 2:
        return False
    dims = [d for d, x in enumerate(vals[0].shape) if sympy.sympify(x) == seq]
    return dims == [len(vals[0].shape) - 2, len(vals[0].shape) - 1]


_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}


def _reshaped(n: fx.Node, d: int, sizes: dict[str, int], seq: sympy.Symbol):
    """Where a reshape puts the sequence: the dim of its group sized ``seq`` (a merged dim split
    back), else the one dim its dim ``d`` merges into (tokens stay whole rows of it, so token-wise
    ops still see each token's entries together), or LOST where the sequence is cut up."""
    from autopar.core.meta import evaluate
    from autopar.passes.sharding_rules import reshape_groups
    try:
        src = tuple(evaluate(x, sizes) for x in info(n.args[0]).values[0].shape)
        dst = tuple(evaluate(x, sizes) for x in info(n).values[0].shape)
    except Exception:  # noqa: BLE001 - a size known only at run time
        return LOST
    shape = info(n).values[0].shape
    for gi, gj in reshape_groups(src, dst) or ():
        if d in gi:
            exact = [j for j in gj if sympy.sympify(shape[j]) == seq]
            if len(exact) == 1:
                return exact[0]
            wide = [j for j in gj if dst[j] != 1]
            return wide[0] if len(wide) == 1 else LOST
    return LOST


def attention_ops(gm: fx.GraphModule, keep=lambda node: True) -> list[tuple[fx.Node, tuple, tuple, bool]]:
    """The attention ops of ``gm`` (those ``keep`` accepts) as context parallelism exchanges
    them: (node, query shape, key shape before a grouped-query repeat, masked or causal), sizes
    as formulas. What the build's kind choice and the simulator both price."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in ATTENTION and keep(n):
            causal = bool(n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False))
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            key = repeated_from(n.args[1]) or n.args[1]
            out.append((n, info(n.args[0]).values[0].shape, info(key).values[0].shape, causal or mask is not None))
    return out


def repeated_from(node: fx.Node) -> fx.Node | None:
    """The keys or values a grouped-query model repeated to its query heads to make ``node``
    (``x[:, :, None].expand(b, hk, rep, s, d).reshape(b, hk * rep, s, d)`` or
    ``x.repeat_interleave(rep, 1)``: head ``h`` reads key head ``h // rep``), or None."""
    src = None
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        ex = node.args[0]
        if isinstance(ex, fx.Node) and ex.target is aten.expand.default:
            un = ex.args[0]
            if isinstance(un, fx.Node) and un.target is aten.unsqueeze.default and un.args[1] == 2:
                src = un.args[0]
    elif node.target is aten.repeat_interleave.self_int and (node.args[2] if len(node.args) > 2
                                                             else node.kwargs.get("dim")) == 1:
        src = node.args[0]
    if src is None or not _is_tensor(src) or not _is_tensor(node):
        return None
    have, want = info(src).values[0].shape, info(node).values[0].shape
    if len(have) != 4 or len(want) != 4 or have[0] != want[0] or have[2:] != want[2:]:
        return None
    try:
        return src if sympy.sympify(want[1] / have[1]).is_integer else None
    except (TypeError, ZeroDivisionError):
        return None


def _unrepeated(node: fx.Node, an: _Analysis) -> fx.Node:
    """``node``'s keys or values before a grouped-query repeat (:func:`repeated_from`), where they
    hold the sequence where it does; else ``node``."""
    src = repeated_from(node)
    return src if src is not None and an.dim.get(src, [None])[0] == an.dim.get(node, [None])[0] else node


def _indexes_sequence(n: fx.Node, dims: list) -> bool:
    """Does ``n`` pick entries of a local value along its sequence dim by index values?"""
    if n.target not in _INDEXING or not dims or not isinstance(dims[0], int) or isinstance(dims[0], bool):
        return False
    d = dims[0]
    if n.target is aten.index.Tensor:
        idx = n.args[1]
        return d < len(idx) and idx[d] is not None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    rank = len(info(n.args[0]).values[0].shape)
    return isinstance(dim, int) and dim % max(rank, 1) == d


class _Emit:
    """Builds the rewritten graph: each node's local and/or whole version, as readers need them."""

    def __init__(self, gm, an: _Analysis, seq, cp: int, group_name: str, kind: str) -> None:
        self.gm, self.an, self.seq, self.cp, self.group, self.kind = gm, an, seq, cp, group_name, kind
        self.report = CpReport()
        self.local: dict[fx.Node, fx.Node] = {}
        self.whole: dict[fx.Node, fx.Node] = {}

    def run(self) -> CpReport:
        nodes = list(self.gm.graph.nodes)
        need_local, need_whole = self._demand(nodes)
        self.g = fx.Graph()
        inputs: list[fx.Node] = []        # placeholders to gather, after the last placeholder
        for n in nodes:
            if n.op != "placeholder":
                for p in inputs:
                    self._gather(p)
                inputs = []
            if n.op == "output":
                out = self.g.output(fx.node.map_arg(n.args[0], lambda a: self.local[a]))
                out.meta = copy.copy(n.meta)      # its record too: later steps read every node's
                continue
            derived = n.target is aten.sym_size.int or self._gathered(n)   # whole made from the local
            if n in need_whole and n in self.an.dep and not derived:
                self._emit_whole(n)
            if n in need_local or (n in need_whole and (n not in self.an.dep or derived)):
                self._emit_local(n)
            if n in need_whole and n in self.an.dep and derived:
                if n.op == "placeholder":
                    inputs.append(n)
                elif n.target is aten.sym_size.int:
                    self._emit_whole(n)
                else:
                    self._gather(n)
        self.g.owning_module = self.gm
        self.gm.graph = self.g
        self.gm.recompile()
        return self.report

    # ---------------------------------------------------------------- which versions are read

    def _gathered(self, n: fx.Node) -> bool:
        """The whole version comes from gathering the local one (not by recomputing it whole)."""
        if n.op == "placeholder" or n in self.an.attention:
            return True
        if n in self.an.whole_only or n in self.an.sources or not _is_tensor(n):
            return False
        rec = info(n)
        d = self.an.dim.get(n, [None])[0]
        exact = isinstance(d, int) and not isinstance(d, bool) and sympy.sympify(rec.values[0].shape[d]) == self.seq
        return exact and rec.requires_grad and rec.values[0].dtype.is_floating_point

    def _demand(self, nodes: list[fx.Node]) -> tuple[set, set]:
        need_local: set[fx.Node] = set()
        need_whole: set[fx.Node] = set()
        out = nodes[-1]
        fx.node.map_arg(out.args, need_local.add)
        for n in reversed(nodes[:-1]):
            if n in need_whole:
                if n not in self.an.dep or self._gathered(n):
                    need_local.add(n)
                elif n.target is aten.sym_size.int:
                    need_local.add(n)
                else:
                    for a in _inputs(n):
                        need_whole.add(a)
            if n in need_local:
                if n in self.an.attention:
                    q, k, v = n.args[:3]
                    need_local.update((q, _unrepeated(k, self.an), _unrepeated(v, self.an)))
                    mask = self._mask_arg(n)
                    if isinstance(mask, fx.Node):
                        need_whole.add(mask)
                elif n in self.an.whole_only and n in self.an.dep:
                    need_whole.add(n)
                    for a in _inputs(n):
                        need_whole.add(a)
                else:
                    whole = self.an.reads_whole.get(n, set())
                    need_local.update(a for a in _inputs(n) if a not in whole)
                    need_whole.update(whole)
        return need_local, need_whole

    @staticmethod
    def _mask_arg(n: fx.Node):
        return n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")

    # ---------------------------------------------------------------- emitting

    def _copy(self, n: fx.Node, env: dict, suffix: str = "") -> fx.Node:
        def arg(a: fx.Node) -> fx.Node:
            return env[a] if a in env else self.local[a]
        if not suffix:
            return self.g.node_copy(n, arg)
        new = self.g.create_node(n.op, n.target, fx.node.map_arg(n.args, arg), fx.node.map_arg(n.kwargs, arg),
                                 name=n.name + suffix)
        new.meta = copy.copy(n.meta)
        if META_KEY in n.meta:
            rec = copy.copy(info(n))
            rec.made_by = "cp_rewrite"
            rec.values = self._whole_values(rec.values)
            set_info(new, rec)
        return new

    def _whole_values(self, values: tuple) -> tuple:
        """A whole version's records: its sizes over the whole sequence (``seq`` is this rank's
        share in the graph's formulas, so the whole one is ``cp * seq``)."""
        from autopar.core.meta import TensorInfo
        whole = {self.seq: self.cp * self.seq}
        return tuple(TensorInfo(tuple(sympy.sympify(x).subs(whole) for x in v.shape), v.dtype,
                                tuple(sympy.sympify(x).subs(whole) for x in v.stride)) for v in values)

    def _emit_local(self, n: fx.Node) -> None:
        an = self.an
        if n in an.attention:
            self.local[n] = self._attention(n)
        elif n in an.sources:
            self.local[n] = self._positions(n)
        elif n in an.whole_only and n in an.dep:
            self.local[n] = self._localize(n)
        elif n in an.reads_whole:
            self.local[n] = self._copy(n, {a: self.whole[a] for a in an.reads_whole[n]})
            if n in an.scores:
                self.report.attention.append(n.name)
        else:
            self.local[n] = self._copy(n, self.local)

    def _emit_whole(self, n: fx.Node) -> None:
        if n.target is aten.sym_size.int:          # the whole sequence's length
            self.whole[n] = self._call(operator.mul, (self.local[n], self.cp), n, "_whole", tensor=False)
            return
        self.whole[n] = self._copy(n, self.whole, "_whole")
        if n in self.an.whole_only:
            op = str(n.target)
            self.report.whole_ops[op] = self.report.whole_ops.get(op, 0) + 1

    def _gather(self, n: fx.Node) -> None:
        d = self.an.dim.get(n, [None])[0]
        if not isinstance(d, int) or isinstance(d, bool):
            raise UnsupportedError("context parallelism needs the whole sequence of a value that holds it in "
                                   "no single dim", where=self._where(n), got=str(info(n).values[0].shape),
                                   fix="keep the sequence in one dim of the values that mix positions")
        self.whole[n] = self._call(cp_runtime.gather_sequence, (self.local[n], d, self.group), n, "_whole")
        info(self.whole[n]).values = self._whole_values(info(self.whole[n]).values)
        self.report.gathered.append(n.name)

    def _localize(self, n: fx.Node) -> fx.Node:
        d = self.an.dim[n][0]
        if not any(self.seq in sympy.sympify(x).free_symbols for v in info(n).values for x in v.shape):
            return self.whole[n]       # no sequence in it (a pooled value, a loss): the same on every rank
        if not isinstance(d, int) or isinstance(d, bool):
            raise UnsupportedError(
                f"context parallelism: {n.target} mixes positions of the sequence and its result, read by "
                "token-wise ops, does not hold the sequence in one dim", where=self._where(n),
                got=str([tuple(v.shape) for v in info(n).values]),
                fix="drop the cp axis for this model, or compute this value per token")
        return self._call(cp_runtime.local_rows, (self.whole[n], d, self.group), n, "_local")

    def _positions(self, n: fx.Node) -> fx.Node:
        end = n.args[0]
        kw = {k: v for k, v in n.kwargs.items() if k in ("dtype", "device")}
        return self._call(cp_runtime.local_positions, (self.local[end] if isinstance(end, fx.Node) else end,
                                                       self.group), n, "_positions", kwargs=kw)

    def _attention(self, n: fx.Node) -> fx.Node:
        def arg(i: int, name: str, default):
            return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)
        if arg(4, "dropout_p", 0.0) not in (0, 0.0):
            raise UnsupportedError("context parallelism runs attention without dropout", where=self._where(n),
                                   got=f"dropout_p={arg(4, 'dropout_p', 0.0)}",
                                   fix="set the model's attention dropout to 0 (e.g. config.attention_dropout=0.0)")
        # keys and values as the model made them, before a grouped-query model repeats them to the
        # query heads: the kinds repeat after the exchange, so it moves (and a ring holds) fewer heads
        q, k, v = (self.local[a] for a in (n.args[0], _unrepeated(n.args[1], self.an), _unrepeated(n.args[2], self.an)))
        mask = self._mask_arg(n)
        mask = self.whole[mask] if isinstance(mask, fx.Node) else None
        self.report.attention.append(n.name)
        return self._call(cp_runtime.graph_attention, (q, k, v, mask, arg(5, "is_causal", False),
                                                       arg(6, "scale", None), self.kind, self.group), n, "_cp")

    def _call(self, fn, args: tuple, like: fx.Node, suffix: str, *, tensor: bool = True,
              kwargs: dict | None = None) -> fx.Node:
        new = self.g.create_node("call_function", fn, args, kwargs or {}, name=like.name + suffix)
        src = info(like) if META_KEY in like.meta else None
        rec = NodeInfo(kind="op", fqn=src.fqn if src else "", module_type=src.module_type if src else "",
                       made_by="cp_rewrite", requires_grad=bool(src and src.requires_grad))
        if src is not None:       # the layer it stands in (recomputation regions are cut by layer)
            rec.block_class, rec.block_member, rec.stage = src.block_class, src.block_member, src.stage
            rec.moe_role, rec.moe_region = src.moe_role, src.moe_region
        if tensor and src is not None:
            rec.values = src.values
        if not tensor and "val" in like.meta:     # a size: later passes tell sizes by their value's type
            new.meta["val"] = like.meta["val"]
        set_info(new, rec)
        return new

    @staticmethod
    def _where(n: fx.Node) -> str:
        fqn = info(n).fqn if META_KEY in n.meta else ""
        return f"{fqn or '<root>'} (node {n.name})"
