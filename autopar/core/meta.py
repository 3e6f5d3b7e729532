"""The one typed record autopar keeps per node, and the one per graph.

Everything autopar learns about a node lives in ``node.meta["autopar"]`` as a
:class:`NodeInfo`; everything about the whole graph in ``gm.meta["autopar"]`` as a
:class:`GraphInfo`. Passes read and write them only through :func:`info` and
:func:`graph_info`, so there is one place that knows the key.

Sizes, FLOPs and bytes are ``sympy`` expressions over the graph's named symbols
(``batch``, ``seq``): a formula the planner evaluates for any batch/sequence
without re-capturing. For a static capture they are plain integers.
"""
from __future__ import annotations

from typing import Any
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import sympy
import torch
import torch.fx as fx

from autopar.core.errors import AutoparInternalError

META_KEY = "autopar"

NodeKind = Literal["param", "buffer", "input", "constant", "op", "output"]
MoERole = Literal["router", "dispatch", "expert", "combine"]

ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and stride of one tensor value, sizes as sympy expressions."""

    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    stride: tuple[sympy.Expr, ...]

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * dtype_bytes(self.dtype)


@dataclass
class NodeInfo:
    """What autopar knows about one fx node. Filled in pass by pass."""

    kind: NodeKind
    fqn: str = ""                      # module path of the innermost module that made the node
    module_type: str = ""              # that module's class name
    target_fqn: str | None = None      # for param/buffer placeholders: the original state_dict key
    values: tuple[TensorInfo, ...] = ()  # one per tensor output (shape pass)
    requires_grad: bool = False        # does a gradient flow back through this value (flops pass)
    flops_fwd: sympy.Expr = ZERO       # matmul-class FLOPs (multiply and add count 2)
    flops_bwd: sympy.Expr = ZERO
    bytes_fwd: sympy.Expr = ZERO       # bytes read + written by the forward kernel
    bytes_bwd: sympy.Expr = ZERO
    saved_bytes: sympy.Expr = ZERO     # bytes of this node's output that forward keeps for backward
    fused_bytes: sympy.Expr = ZERO     # bytes a fused op recomputes instead (not in saved_bytes)
    # activation bytes live right after this node runs (forward): read as ``live_bytes``; the
    # memory pass leaves the sum as {monomial: coefficient}, made a formula when first read
    live_terms: Any = ZERO
    block_class: int | None = None     # repeated-block class id (blocks pass)
    block_member: str | None = None    # fqn of the class member the node belongs to
    moe_role: MoERole | None = None    # role inside an MoE region (moe pass)
    moe_region: str | None = None      # fqn of that region
    trainable: bool = False            # for param placeholders: requires_grad in the model
    made_by: str = "capture"           # which pass created the node
    placement: str | None = None       # tensor-axis placement of the output(s) (plan / rewrite)
    strategy: str | None = None        # the chosen strategy's name and specs (plan)
    collective: "CollectiveInfo | None" = None  # for nodes the rewrite inserted
    stage: int | None = None           # pipeline stage (split view); None: not split, or recomputed per stage

    @property
    def value(self) -> TensorInfo | None:
        """The node's single tensor value (None if it has none or several)."""
        return self.values[0] if len(self.values) == 1 else None

    @property
    def live_bytes(self) -> sympy.Expr:
        terms = self.live_terms
        if isinstance(terms, dict):
            terms = self.live_terms = sympy.Add(*(c * m for m, c in terms.items()))
        return terms

    @live_bytes.setter
    def live_bytes(self, value: sympy.Expr) -> None:
        self.live_terms = value

    @property
    def out_bytes(self) -> sympy.Expr:
        return sympy.Add(*(v.nbytes for v in self.values)) if self.values else ZERO


@dataclass(frozen=True)
class CollectiveInfo:
    """A placement conversion the rewrite inserted: what it does forward and backward."""

    axis: str
    forward: str                       # step kind: all_reduce, all_gather, chunk, none, ...
    backward: str
    src: str                           # spec the producer has
    dst: str                           # spec the consumer needs
    nbytes: float                      # the whole tensor's bytes at the planning sizes
    time_fwd_s: float
    time_bwd_s: float
    bucket: str = ""                   # data-axis nodes: which bucket ("dp.b3") they issue or wait for
    params: tuple[str, ...] = ()       # data-axis nodes: the parameters (state_dict keys) of the bucket


@dataclass(frozen=True)
class BlockClass:
    """A set of structurally identical module instances (e.g. the N transformer layers)."""

    id: int
    members: tuple[str, ...]           # module fqns, in graph order
    module_type: str
    nodes_per_member: int
    fingerprint: str


@dataclass(frozen=True)
class MoERegion:
    """A mixture-of-experts region found in the graph."""

    fqn: str
    num_experts: int
    top_k: int
    capacity: sympy.Expr | None        # tokens per expert, if the dispatch has a fixed capacity
    router_weight: str | None          # fqn of the router's parameter
    expert_params: tuple[str, ...]


@dataclass
class GraphInfo:
    """Facts about a whole captured graph."""

    symbols: dict[str, sympy.Symbol]           # "batch" -> Symbol("batch"), ...
    example_sizes: dict[str, int]              # the sizes the example inputs had
    export_symbols: dict[sympy.Symbol, sympy.Symbol] = field(default_factory=dict)  # s0 -> batch
    param_fqns: dict[str, str] = field(default_factory=dict)   # placeholder name -> fqn
    buffer_fqns: dict[str, str] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)
    module_types: dict[str, str] = field(default_factory=dict)  # fqn -> class name
    block_classes: list[BlockClass] = field(default_factory=list)
    # class id -> how many copies the real model has, for a graph captured with fewer
    # (autopar.cli.workload.capture_for_planning); a class not here has its captured count
    block_copies: dict[int, int] = field(default_factory=dict)
    moe_regions: list[MoERegion] = field(default_factory=list)
    passes_run: list[str] = field(default_factory=list)
    in_spec: Any = None                        # pytree spec of the user's inputs (export's)
    out_spec: Any = None                       # pytree spec of the user's outputs
    output_targets: list[tuple[str, str | None]] = field(default_factory=list)  # (kind, buffer fqn)
    param_aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name the graph uses
    input_constants: dict[int, Any] = field(default_factory=dict)  # user input index -> non-tensor value
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # lifted tensors, by placeholder target
    transient_buffers: set[str] = field(default_factory=set)  # buffers outside state_dict (persistent=False)
    without_cache: bool = False                # captured with the model's config.use_cache turned off
    # a graph exported with only the first layers of a run (passes/replicate.py): the run as
    # (layer list fqn, layers, start, period), so a cache hit needs no search for it
    layer_run: tuple[str, int, int, int] | None = None
    # how to switch the graph between train and eval mode (autopar/build/modes.py); None: it cannot differ
    mode_source: Any = None


@dataclass
class StageGraph:
    """One pipeline stage: its graph, what it reads and what it hands on (made by
    :func:`autopar.passes.pp_split.split_stages`, run by :class:`autopar.runtime.pp.StageModule`)."""

    index: int
    gm: fx.GraphModule
    params: list[str]                 # state_dict keys of parameters this stage holds (placeholder order)
    buffers: list[str]
    inputs: list[str]                 # names (in the whole graph) of the values crossing in
    outputs: list[str]                # names of the values crossing out (the model outputs, last stage)
    order: list[tuple[str, str]]      # per placeholder: (kind, fqn or value name)


def info(node: fx.Node) -> NodeInfo:
    """The node's record; a node without one is an internal error (capture makes them all)."""
    rec = node.meta.get(META_KEY)
    if rec is None:
        raise AutoparInternalError(f"node {node.name!r} has no autopar record")
    return rec


def set_info(node: fx.Node, rec: NodeInfo) -> None:
    node.meta[META_KEY] = rec


def graph_info(gm: fx.GraphModule) -> GraphInfo:
    rec = gm.meta.get(META_KEY)
    if rec is None:
        raise AutoparInternalError("graph has no autopar record: was it made by autopar.capture?")
    return rec


COPY_KEY = "autopar_copy_of"     # node.meta: the node a copied layer's node was made from (passes/replicate.py)


def template_of(node: fx.Node) -> fx.Node | None:
    """The earlier node of the same graph that ``node`` is a copy of (same op, values and
    wiring, one period of layers later; set by :func:`autopar.passes.replicate.expand`), so
    an analysis pass can take its per-node results instead of working them out again."""
    t = node.meta.get(COPY_KEY)
    return t if t is not None and t.graph is node.graph else None


def graph_module(graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over ``graph`` whose Python code is generated when it first runs (or its
    ``code`` is read), not at every ``recompile()``: the capture and rewrite passes each
    recompile after editing, and on a 32-layer model each real one costs 30-40 ms.
    :func:`ready` generates it ahead of the first step."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    return _LazyGraphModule(torch.nn.Module(), graph)


def ready(gm: fx.GraphModule) -> fx.GraphModule:
    """Generate ``gm``'s code now if a pass left it pending (:func:`graph_module`)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    _LazyGraphModule.force_recompile(gm)
    return gm


def block_copies(gm: fx.GraphModule, cls: BlockClass) -> int:
    """How many copies of ``cls`` the real model has: its captured members, unless ``gm`` was
    captured with fewer (``GraphInfo.block_copies``)."""
    return graph_info(gm).block_copies.get(cls.id, len(cls.members))


_DTYPE_BYTES: dict[torch.dtype, int] = {}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a dtype (bool counts one byte)."""
    if dtype not in _DTYPE_BYTES:
        _DTYPE_BYTES[dtype] = torch.empty((), dtype=dtype).element_size()
    return _DTYPE_BYTES[dtype]


def within(fqn: str, outer: str) -> bool:
    """Is module path ``fqn`` the module ``outer`` or inside it (every path is inside the root "")?"""
    return not outer or fqn == outer or fqn.startswith(outer + ".")


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol autopar uses for a named size (``batch``, ``seq``)."""
    return sympy.Symbol(name, positive=True, integer=True)


def evaluate(expr: sympy.Expr | int, sizes: dict[str, int]) -> int:
    """Evaluate a size/FLOP/byte formula at concrete symbol values, e.g. ``{"batch": 8}``."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, sympy.Integer):
        return int(expr)
    return _evaluate(sympy.sympify(expr), tuple(sorted(sizes.items())))


@lru_cache(maxsize=65536)
def _evaluate(expr: sympy.Expr, sizes: tuple[tuple[str, int], ...]) -> int:
    value = expr.xreplace({symbol(k): sympy.Integer(v) for k, v in sizes})
    if value.free_symbols:
        missing = ", ".join(sorted(str(s) for s in value.free_symbols))
        raise AutoparInternalError(f"formula {expr} still has free symbols ({missing}) after substitution")
    return int(value)
