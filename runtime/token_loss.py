"""A model's own token-mean loss over the global batch under a data axis.

A loss such as ``F.cross_entropy(logits, labels)`` with labels padded by ``ignore_index``
(``transformers`` models given ``labels``) is the mean over the real tokens *of the batch it
sees*. When the data axis gives each rank its share of the batch and the ranks hold different
numbers of real tokens, averaging the ranks' means (what DDP does) is not the mean over the
global batch that one process computes: each rank's tokens weigh ``1 / (ranks x its count)``
instead of ``1 / total count``.

A sum-reduced loss (``transformers``' CTC loss by default) is the sum over the global batch:
the ranks' sums, each rank's gradient ``ranks`` times its own (the data axis averages).

Where the loss a model returns *is* such a mean (the output reached from a mean-reduced
``cross_entropy_loss``/``nll_loss`` through views and casts only, integer targets, no class
weights), :func:`prepare` rewrites the graph to return the rank's sum and its count of real
tokens instead; :func:`global_mean` exchanges (count, sum) once per step (one all-reduce of
two numbers) and returns the global batch's mean, the same value on every rank, whose
gradient on this rank is ``ranks / total count`` times the sum's: averaged over the data axis,
exactly the single-process gradient, whatever each rank's count (0 included).

Without gradients (evaluation, possibly on one rank alone) there is no exchange: the value is
this rank's own mean, as the unmodified model computes it on this rank's rows.

A loss built otherwise (the model adds an auxiliary term, scales it, or the user computes it
outside the model from the logits) keeps the rows weighting of ``runtime/dp.py:row_weight``:
exact when every rank holds as many real tokens per row.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.runtime.collectives import c10d

aten = torch.ops.aten

_MEAN, _SUM = 1, 2
# ops that pass a scalar loss on unchanged (a view, a copy, a cast)
_SAME_VALUE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
               aten.alias.default, aten.squeeze.default, aten.squeeze.dim, aten.unsqueeze.default,
               aten.to.dtype, aten._to_copy.default, aten.detach.default}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
# losses whose ``reduction`` may be Sum: under a data axis their global value is the ranks' sum
_SUMMABLE = _LOSSES | {aten.ctc_loss.IntList, aten.ctc_loss.Tensor, aten.mse_loss.default, aten.l1_loss.default,
                       aten.smooth_l1_loss.default, aten.huber_loss.default, aten.kl_div.default,
                       aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default}


def _arg(node: fx.Node, i: int, name: str, default):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _reduction(node: fx.Node) -> int | None:
    names = [a.name for a in node.target._schema.arguments]
    i = names.index("reduction")
    return _arg(node, i, "reduction", node.target._schema.arguments[i].default_value)


def _loss_node(node: fx.Node) -> fx.Node | None:
    """The loss op whose result ``node`` passes on unchanged (views, casts), feeding nothing else."""
    for _ in range(16):
        if len(node.users) != 1:
            return None
        if node.op != "call_function" or node.target not in _SAME_VALUE:
            break
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    return node if node.op == "call_function" and node.target in _SUMMABLE else None


def _sum_loss(node: fx.Node) -> fx.Node | None:
    """The sum-reduced loss node ``node`` passes on unchanged, or None."""
    loss = _loss_node(node)
    return loss if loss is not None and _reduction(loss) == _SUM else None


def _mean_loss(node: fx.Node) -> fx.Node | None:
    """The mean-reduced, unweighted, integer-target loss node ``node`` passes on unchanged, or None."""
    node = _loss_node(node)
    if node is None or node.target not in _LOSSES:
        return None
    target = node.args[1]
    val = target.meta.get("val") if isinstance(target, fx.Node) else None
    if _arg(node, 2, "weight", None) is not None or _arg(node, 3, "reduction", _MEAN) != _MEAN:
        return None
    if val is None or val.dtype.is_floating_point:         # class probabilities: no tokens to count
        return None
    return node


def prepare(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """Rewrite ``gm`` so that each output that is a token-mean loss returns the sum over this
    rank's real tokens, and the count of those tokens is a new output at the end. Returns
    (the loss's output position, its count's output position) per loss, and (position, None)
    per output that is a sum-reduced loss (left as it is); [] leaves ``gm`` as it was."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], (tuple, list)):
        return []
    values = list(out.args[0])
    found, pairs = [], []
    for pos, v in enumerate(values):
        loss = _mean_loss(v) if isinstance(v, fx.Node) else None
        if loss is not None:
            found.append((pos, loss))        # (one loss at two outputs: both take its sum and count)
        elif isinstance(v, fx.Node) and _sum_loss(v) is not None:
            pairs.append((pos, None))        # a sum: the ranks' sum, nothing to count
    if not found:
        return pairs
    counted: dict[fx.Node, int] = {}
    for pos, loss in found:
        if loss in counted:
            pairs.append((pos, counted[loss]))
            continue
        schema = loss.target._schema.arguments
        names = [a.name for a in schema]
        full = [_arg(loss, i, a.name, a.default_value) for i, a in enumerate(schema)]
        full[names.index("reduction")] = _SUM
        ignore = full[names.index("ignore_index")]
        loss.args, loss.kwargs = tuple(full), {}
        with gm.graph.inserting_after(loss):
            real = gm.graph.call_function(aten.ne.Scalar, (loss.args[1], ignore))
            with gm.graph.inserting_after(real):
                count = gm.graph.call_function(aten.sum.default, (real,))
        counted[loss] = len(values)
        pairs.append((pos, len(values)))
        values.append(count)
    out.args = (tuple(values),)
    gm.graph.lint()
    gm.recompile()
    return pairs


def global_sum(total: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """A sum-reduced loss over the global batch: the ranks' sums (one all-reduce), with this
    rank's gradient ``ranks`` times its own sum's, so that the data axis's average is the sum's."""
    summed = c10d.wait_tensor(c10d.all_reduce(total.detach().clone(), "sum", group_name))
    scaled = total * ranks
    return scaled + (summed - scaled).detach()


def local_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """This rank's own mean (no exchange): what the unmodified model returns on its rows."""
    return total / count.to(total.dtype)


def global_mean(total: torch.Tensor, count: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """The global batch's token mean from this rank's ``total`` (sum over its real tokens) and
    ``count``: one all-reduce of (count, sum); its gradient is ``ranks / global count`` times
    the sum's, so that averaging gradients over ``ranks`` gives the global mean's."""
    wire = torch.stack([count.to(torch.float64), total.detach().to(torch.float64)])
    summed = c10d.wait_tensor(c10d.all_reduce(wire, "sum", group_name))
    n, s = summed[0], summed[1]
    scaled = total * (ranks / n).to(total.dtype)
    return scaled + ((s / n).to(total.dtype) - scaled).detach()


def counter(gm: fx.GraphModule, output: int, inputs: list[fx.Node] | None = None) -> fx.GraphModule | None:
    """For a pipeline: a small graph computing, from the model's user inputs (in call order), the
    count of real tokens the token-mean loss at output position ``output`` divides by; None when
    that output is no such loss, or its targets depend on more than the inputs (parameters,
    activations; ``inputs``: the placeholders it may read, by default the model's user inputs).
    The pipeline runs it on each micro-batch's inputs before the schedule."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    if output >= len(values) or not isinstance(values[output], fx.Node):
        return None
    loss = _mean_loss(values[output])
    if loss is None:
        return None
    if inputs is None:
        from autopar.core.meta import info
        inputs = [n for n in gm.graph.nodes
                  if n.op == "placeholder" and info(n).kind not in ("param", "buffer", "constant")]
    needed, stack = set(), [loss.args[1]]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.op == "placeholder" and n not in inputs or n.op not in ("placeholder", "call_function"):
            return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:                       # every user input, so the pipeline passes them all in order
        env[n] = g.placeholder(n.name)
    for n in gm.graph.nodes:
        if n in needed and n.op == "call_function":
            env[n] = g.node_copy(n, lambda a: env[a])
    ignore = _arg(loss, 4, "ignore_index", -100)
    real = g.call_function(aten.ne.Scalar, (env[loss.args[1]], ignore))
    g.output(g.call_function(aten.sum.default, (real,)))
    return fx.GraphModule(torch.nn.Module(), g)


def loss_fn_counter(loss_fn, output, target: torch.Tensor) -> fx.GraphModule | None:
    """For a pipeline's ``loss_fn(output, target)``: trace it once on a micro-batch's (zero)
    output and real target; when it is a token-mean loss whose targets come from ``target``
    alone, the graph counting a target chunk's real tokens, else None."""
    from torch.fx.experimental.proxy_tensor import make_fx
    try:
        traced = make_fx(lambda o, t: loss_fn(o, t), pre_dispatch=True)(output, target)
    except Exception:        # a loss that does not trace (data-dependent Python): rows weighting
        return None
    phs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return counter(traced, 0, inputs=phs[-1:])
