"""``parallelize(..., compile=True)``: each rank's rewritten graph through ``torch.compile``.

What a rank runs is already one ATen graph with its communication as nodes, so it is handed to
``torch.compile`` as it is (inductor by default: C++/OpenMP kernels on CPU, Triton on GPUs):

- the tensor axis's collectives stay in the graph: ``autopar::redistribute`` is a registered
  custom op (a fake implementation and a backward), swapped for ``autopar::redistribute_at``,
  which names the rank in the call. Traced, the plain op's backward looks the rank up and bakes
  it into the backward graph, where no cache key sees it; ranks share inductor's on-disk caches,
  so a rank could load another's backward (a wrong step: loss 1.7 % and parameters 200 % off
  after three steps of a tensor-parallel GPT on 2 ranks);
- the data axis's nodes (``grad_reduce_issue``/``wait``, ZeRO-3's ``param_gather_*``), expert
  exchanges and synchronised BatchNorm are Python functions with side effects on a runtime
  (buckets, queues, tokens); each runs eagerly between compiled pieces (``torch._dynamo.disable``
  on a copy of the graph, so the eager graph and every pass that reads it are untouched);
- recomputation is not compiled: ``compile=True`` with ``recompute`` other than ``"none"``
  raises (its regions run through an interpreter that checkpoints them one by one).

Compilation happens on the first call of each input shape (``dynamic=False``: a new shape, an
uneven last batch, compiles once more). Fusion may reorder floating-point sums; in float64 the
compiled model still equals the single-process one to round-off (``tests/test_compile.py``).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.fx as fx

from autopar.core.errors import ConfigError

BACKENDS = ("inductor", "aot_eager", "eager")


def backend_of(compile: Any) -> str | None:
    """The ``torch.compile`` backend ``parallelize(compile=...)`` asks for: None for False."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "inductor"
    if compile in BACKENDS:
        return compile
    raise ConfigError("compile must be True, False or a torch.compile backend name", where="parallelize(compile=...)",
                      expected=" | ".join(("True", "False", *BACKENDS)), got=repr(compile),
                      fix="compile=True compiles with inductor; 'aot_eager' traces without generating kernels")


def _traced(fn: Any) -> bool:
    """Whether dynamo may trace into ``fn``: pure tensor code (autopar's local ops and its fused
    ops, ``runtime/fused.py``), not the runtime functions with side effects."""
    from autopar.runtime.collectives import LOCAL_OPS
    from autopar.runtime.fused import FUSED_OPS
    return fn in LOCAL_OPS.values() or fn in FUSED_OPS


def eager_islands(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose autopar Python functions run eagerly under ``torch.compile``.

    The vocabulary-sharded embedding reads its group's rank from a buffer of the copy: as a
    constant the rank would make the ranks' graphs differ (rank 0's folds ``indices - 0``
    away), and inductor could then order their collectives differently."""
    from autopar.runtime.collectives import group_rank, vocab_parallel_embedding, vocab_parallel_embedding_at
    from autopar.runtime.fused import autopar_norm_linear
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attrs[node.target] = _fetch(gm, node.target)
        new = graph.node_copy(node, lambda n: env[n])
        target = node.target
        if target is vocab_parallel_embedding:
            name = f"autopar_rank_{node.name}"
            attrs[name] = torch.tensor(group_rank(node.args[2]), dtype=torch.int64)
            with graph.inserting_before(new):
                rank = graph.get_attr(name)
            new.target = vocab_parallel_embedding_at
            new.args = (*new.args[:2], rank)
        elif target is torch.ops.autopar.redistribute.default:    # the rank in the call (collectives.py)
            new.target = torch.ops.autopar.redistribute_at.default
            new.args = (*new.args, group_rank(node.args[3]))
        elif target is autopar_norm_linear and len(node.args) > 13 and node.args[13] is not None:
            conv = node.args[13]                  # a conversion its backward runs again: the rank too
            new.args = (*new.args[:13], (*conv, group_rank(conv[2])), *new.args[14:])
        elif (node.op == "call_function" and isinstance(target, types.FunctionType)
                and target.__module__.startswith("autopar") and not _traced(target)):
            new.target = torch._dynamo.disable(target)
        env[node] = new
    root = torch.nn.Module()
    for name, value in attrs.items():
        _put(root, name, value)
    out = fx.GraphModule(root, graph)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def _fetch(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _put(root: torch.nn.Module, target: str, value: Any) -> None:
    *path, leaf = target.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    if isinstance(value, torch.nn.Parameter):
        root.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        root.register_buffer(leaf, value)
    else:
        setattr(root, leaf, value)


def compile_graph(gm: fx.GraphModule, backend: str) -> Callable:
    """``gm`` compiled with ``backend`` (see the module docstring): called like ``gm``. Its
    attention calls take the model's mask as given (``runtime/attention.plain_attention``: the
    causal check would break the compiled graph)."""
    from autopar.runtime.attention import plain_attention
    plain_attention(gm)
    return torch.compile(eager_islands(gm), backend=backend, dynamic=False)


def check_compile(backend: str | None, recompute: str) -> None:
    if backend is not None and recompute != "none":
        raise ConfigError("compile=True does not compose with recomputation", where="parallelize(compile=...)",
                          got=f"recompute={recompute!r}", fix="use recompute='none' with compile=True, or leave "
                          "compile off to recompute (its regions run through autopar's checkpointing interpreter)")
