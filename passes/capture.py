"""Capture: an unmodified ``nn.Module`` into an ATen-level ``torch.fx.GraphModule``.

Reads the model and its example inputs; writes a graph whose every node carries a
:class:`~autopar.core.meta.NodeInfo` (module path, kind, original parameter/buffer
name) and a :class:`~autopar.core.meta.GraphInfo` with the named size symbols.

The capture is ``torch.export.export(strict=False)`` in its training IR (``aten.linear``,
``aten.scaled_dot_product_attention`` stay whole). Dims the caller labels (``batch``,
``seq``) are exported as dynamic, so every shape downstream is a formula in them.
Works on the ``meta`` device: nothing is allocated.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, TensorArgument

from autopar.core.errors import InputMismatchError, UnsupportedError
from autopar.passes import capture_cache, replicate
from autopar.passes.autograd_functions import opaque_functions
from autopar.passes.library_equivalents import equivalents
from autopar.passes.capture_guards import pinned_sizes_fail_fast
from autopar.passes.capture_errors import capture_error, describe, module_tracker, source_of, user_line
from autopar.passes.capture_key import capture_key
from autopar.core.meta import META_KEY, GraphInfo, NodeInfo, graph_info, set_info, symbol
from autopar.passes.meta import number_ops, paused_gc, training_config

log = logging.getLogger("autopar.capture")

DimLabels = Sequence[Mapping[int, str]]

def capture(model: nn.Module, example_inputs: Any = (), *, kwargs: Mapping[str, Any] | None = None,
            dims: DimLabels | Mapping[str, Mapping[int, str]] | None = None,
            max_sizes: Mapping[str, int] | None = None,
            cache: "capture_cache.CaptureCache | bool | None" = True, per_block: bool = True) -> fx.GraphModule:
    """Capture ``model`` called on ``example_inputs`` (and keyword inputs ``kwargs``) into an
    annotated ATen graph.

    ``dims`` labels the dims that are symbolic sizes: per positional input, e.g.
    ``({0: "batch", 1: "seq"},)``, or by input name or position, e.g.
    ``{"input_ids": {0: "batch", 1: "seq"}}`` (the form that reaches keyword inputs); the same name on several inputs is one size.
    Without it the capture is static (every size an integer). ``max_sizes`` bounds a symbol's
    range (default 2**20). A model with a ``config.use_cache`` (``transformers``) is captured
    with it off: a training graph never returns cache objects. Tied parameters (one tensor
    under several names) become one placeholder under the first name. A model that cannot be
    captured raises :class:`CaptureError` naming the module and source line that failed.
    ``cache``: where an equal capture is looked up and kept (:mod:`autopar.passes.capture_cache`;
    True: the process's cache, None: none). ``per_block``: a model whose layers repeat a
    pattern autopar reads from its config is exported with three periods of its layers and the
    rest copied (:mod:`autopar.passes.replicate`); False exports every layer.
    """
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}
    _check_inputs(model, args, dims, kwargs)
    flat_dims = flat_labels(model, args, kwargs, dims)
    dynamic_shapes = _dynamic_shapes(model, args, kwargs, flat_dims, max_sizes or {}) if dims else None
    with paused_gc():
        return _capture(model, args, kwargs, dims, flat_dims, dynamic_shapes, max_sizes, cache, per_block)


def _capture(model: nn.Module, args: tuple, kwargs: dict, dims: Any, flat_dims: list, dynamic_shapes: Any,
             max_sizes: Mapping[str, int] | None, cache: Any, per_block: bool) -> fx.GraphModule:
    cache = capture_cache.current() if cache is True else cache or None
    key = capture_key(model, args, kwargs, flat_dims if dims else None, max_sizes) if cache else None

    def exported() -> fx.GraphModule:
        return _export(model, args, kwargs, flat_dims if dims else None, dynamic_shapes)
    blocks = capture_cache.load(cache, key + ".blocks") if per_block and key else None
    run = replicate.run_from_record(model, graph_info(blocks).layer_run) if blocks is not None else None
    if run is None:       # no shallow export kept for this key (or one for no run): find the run
        blocks = None
        run = replicate.find_run(model) if per_block else None
    if run is not None:
        def exported_shallow() -> fx.GraphModule:
            with replicate.shallow(run):
                gm = exported()
            graph_info(gm).layer_run = run.record
            return gm
        whole = replicate.expand(blocks if blocks is not None else
                                 _cached(cache, key and key + ".blocks", exported_shallow), run, model)
        if whole is not None:
            return whole
    return _cached(cache, key, exported)


def _cached(cache: "capture_cache.CaptureCache | None", key: str | None,
            make: "Callable[[], fx.GraphModule]") -> fx.GraphModule:
    """The graph kept under ``key``, or ``make()``'s, kept."""
    if key:
        got = capture_cache.load(cache, key)
        if got is not None:
            return got
    gm = make()
    if key:
        capture_cache.store(cache, key, gm)
    return gm


def _export(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], flat_dims: list[dict[int, str]] | None,
            dynamic_shapes: Any) -> fx.GraphModule:
    """``torch.export`` of the model, annotated (see :func:`capture`)."""
    with module_tracker(model) as stack, training_config(model):
        try:
            with warnings.catch_warnings(), _quiet_export():
                warnings.simplefilter("ignore")
                # a model's own autograd.Functions keep their backward; library loops over data-sized
                # ranges trace their fixed-range equivalents (passes/library_equivalents.py)
                with opaque_functions(), equivalents(model), \
                        pinned_sizes_fail_fast(_by_name(model, args, kwargs, flat_dims)) if dynamic_shapes is not None \
                        else contextlib.nullcontext():
                    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except UnsupportedError:  # autopar's own refusal during the trace (a Function it cannot carry)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a CaptureError or InputMismatchError
            raise capture_error(model, args, exc, list(stack), kwargs) from exc
    gm = ep.graph_module
    aliases = _untie(gm, ep, model)
    number_ops(gm)
    _annotate(gm, ep, model, [*args, *kwargs.values()], flat_dims)
    ginfo = graph_info(gm)
    ginfo.param_aliases = aliases
    ginfo.constants = _lifted_constants(ep)
    ginfo.transient_buffers = set(dict(model.named_buffers())) - set(model.state_dict())
    ginfo.without_cache = hasattr(getattr(model, "config", None), "use_cache")   # traced with it off
    _check_dtypes(gm)
    log.info("capture: %d nodes, %d parameters, symbols %s%s", len(gm.graph.nodes),
             len(ginfo.param_fqns), sorted(ginfo.symbols), " (use_cache off)" if ginfo.without_cache else "")
    return gm


@contextmanager
def _quiet_export() -> Iterator[None]:
    """torch.export logs the graph it failed on (twice) before raising; autopar's error names
    the module and line instead. ``autopar -v`` (DEBUG logging) keeps torch's dumps."""
    if logging.getLogger("autopar").isEnabledFor(logging.DEBUG):
        yield
        return
    names = ("torch._dynamo", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
             "torch._subclasses.fake_tensor", "torch.fx.experimental.proxy_tensor")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    printed = io.StringIO()            # export prints the partial graph of a failure to stderr itself
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if printed.getvalue():
            log.debug("torch.export printed:\n%s", printed.getvalue())


def flat_labels(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
                dims: DimLabels | Mapping[str, Mapping[int, str]] | None) -> list[dict[int, str]]:
    """The dims labels per user input in call order (positional inputs, then keyword ones)."""
    n = len(args) + len(kwargs)
    if not dims:
        return [{} for _ in range(n)]
    if not isinstance(dims, Mapping):
        return [dict(d or {}) for d in dims] + [{} for _ in kwargs]
    names = _positional_names(model, len(args)) + list(kwargs)
    keys = [i if i in dims else name for i, name in enumerate(names)]
    unknown = sorted(map(str, set(dims) - set(keys)))
    if unknown:
        raise InputMismatchError(f"dims labels inputs the call does not pass: {unknown}", where="dims",
                                 expected=f"positions or names among {names}", got=str(sorted(map(str, dims))),
                                 fix="label only the inputs given in example_inputs / example_kwargs")
    return [dict(dims.get(key) or {}) for key in keys]


def _by_name(model: nn.Module, args: tuple, kwargs: Mapping[str, Any],
             flat_dims: list[dict[int, str]] | None) -> dict[str, dict[int, str]]:
    """Input name -> labelled dims (the names export's sources use)."""
    return dict(zip(_positional_names(model, len(args)) + list(kwargs), flat_dims or []))


def _positional_names(model: nn.Module, count: int) -> list[str]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(count)]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


def _untie(gm: fx.GraphModule, ep: torch.export.ExportedProgram, model: nn.Module) -> dict[str, str]:
    """One placeholder per tied tensor. torch.export gives every name of a tied parameter (an
    embedding shared with the output head) its own placeholder; autopar plans, stores and
    steps it once, under the first name ``named_parameters()`` gives. Returns alias -> name."""
    canonical: dict[str, str] = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        first: dict[int, str] = {}
        for name, t in named:
            canonical[name] = first.setdefault(id(t), name)
    holder: dict[str, fx.Node] = {}
    phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    aliases: dict[str, str] = {}
    specs = [s for s in ep.graph_signature.input_specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
    for spec in sorted(specs, key=lambda s: s.target != canonical.get(s.target, s.target)):
        name = canonical.get(spec.target, spec.target)
        node = phs[spec.arg.name]
        if name not in holder:
            holder[name] = node
            continue
        node.replace_all_uses_with(holder[name])
        gm.graph.erase_node(node)
        aliases[spec.target] = name
    if aliases:
        gm.recompile()
        log.info("capture: tied %s", ", ".join(f"{a} = {n}" for a, n in sorted(aliases.items())))
    return aliases


def _lifted_constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Tensors export lifts out of the model's code (``x[..., [-2]]`` makes an index tensor):
    part of the program, not inputs. Their placeholders are kind ``constant``; runtimes hold
    them as non-persistent buffers under these names."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.CUSTOM_OBJ:
            raise UnsupportedError("the model holds a script object autopar cannot place", where=str(spec.target),
                                   fix="keep only tensors, parameters and buffers on the model")
        if spec.kind == InputKind.CONSTANT_TENSOR:
            out[str(spec.target)] = ep.constants[spec.target].detach().clone()
    return out


def _check_inputs(model: nn.Module, args: tuple, dims: Any, kwargs: Mapping[str, Any]) -> None:
    if not isinstance(model, nn.Module):
        raise InputMismatchError("capture needs an nn.Module", got=type(model).__name__,
                                 fix="pass the model object itself, e.g. capture(MyModel(), (x,))")
    _check_real(model, args, kwargs)
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        got = [f"{len(args)} positional input(s): {', '.join(describe(a) for a in args)}"]
        if kwargs:
            got.append("keywords " + ", ".join(f"{k}={describe(v)}" for k, v in kwargs.items()))
        raise InputMismatchError(
            f"example inputs do not match {type(model).__name__}.forward: {exc}",
            where=source_of(model.forward),
            expected=f"forward{inspect.signature(model.forward)}",
            got="; ".join(got),
            fix="pass one example value per argument of forward (positional in example_inputs, by name in "
                "example_kwargs)") from None
    if dims is None or isinstance(dims, Mapping):
        return
    if len(dims) != len(args):
        raise InputMismatchError("dims must label each positional input (use {} for none)",
                                 expected=f"{len(args)} entries", got=f"{len(dims)}",
                                 fix="e.g. dims=({0: 'batch', 1: 'seq'},) for one token-id input; label "
                                     "keyword inputs by name: dims={'input_ids': {0: 'batch', 1: 'seq'}}")


def _check_labels(inputs: Sequence[Any], labels: Sequence[Mapping[int, str]]) -> None:
    for i, (arg, dims) in enumerate(zip(inputs, labels)):
        for d, name in dims.items():
            if not isinstance(arg, torch.Tensor) or d >= arg.dim():
                raise InputMismatchError(f"dims labels dim {d} of input {i} as {name!r}, which it lacks",
                                         got=describe(arg), fix="label only dims the input has")
            if arg.shape[d] < 2:
                raise InputMismatchError(
                    f"input {i} dim {d} ({name!r}) has example size {arg.shape[d]}; a symbolic size "
                    "needs an example of at least 2 (torch.export specializes sizes 0 and 1)",
                    fix=f"capture with {name} >= 2 and evaluate the formulas at {arg.shape[d]}")


def _check_real(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Complex parameters, buffers or inputs: autopar's sharding rules, reductions and
    optimizer pieces assume real numbers."""
    named = [(f"parameter {k}", t) for k, t in model.named_parameters()]
    named += [(f"buffer {k}", t) for k, t in model.named_buffers()]
    named += [(f"input {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    named += [(f"input {k}", a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
    for what, t in named:
        if t.is_complex():
            raise UnsupportedError(f"{what} is complex ({str(t.dtype).replace('torch.', '')}); autopar does not "
                                   "support complex dtypes", where=what, expected="real dtypes (fp32, fp64, bf16, "
                                   "fp16; integer buffers and inputs)", got=str(t.dtype),
                                   fix="keep real and imaginary parts as two real tensors (torch.view_as_real)")


# Ops whose tensor operands eager PyTorch requires to share one dtype.
# The value is how many leading operands must agree (None: all of them).
_SAME_DTYPE: dict[str, int | None] = {"linear": None, "matmul": None, "mm": None, "bmm": None, "addmm": None,
                                      "baddbmm": None, "conv1d": None, "conv2d": None, "conv3d": None,
                                      "convolution": None, "scaled_dot_product_attention": 3}


def _check_dtypes(gm: fx.GraphModule) -> None:
    """Refuse a graph in which a matmul-like op mixes dtypes: fake tensors let it through,
    but the model itself would fail on these inputs when it runs."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op != "call_function" or name not in _SAME_DTYPE:
            continue
        operands = [a for a in node.args if isinstance(a, fx.Node)][:_SAME_DTYPE[name]]
        vals = [a.meta.get("val") for a in operands]
        dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor)}
        if len(dtypes) > 1:
            stack = node.meta.get("nn_module_stack") or {}
            fqn = _clean_fqn(list(stack.values())[-1][0]) if stack else ""
            line = user_line(node.meta.get("stack_trace") or "")
            shown = ", ".join(f"{a.name}: {str(v.dtype).replace('torch.', '')}"
                              for a, v in zip(operands, vals) if isinstance(v, torch.Tensor))
            raise InputMismatchError(f"{name} in module {fqn or '<root>'} gets tensors of different dtypes",
                                     where=f"node {node.name}, module {fqn or '<root>'}" + (f", {line}" if line else ""),
                                     expected="one dtype for all its operands", got=shown,
                                     fix="pass example inputs of the dtype the model's parameters have (e.g. "
                                         "x.float()), or cast the model (model.to(dtype))")


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], labels: list[dict[int, str]],
                    max_sizes: Mapping[str, int]) -> Any:
    """torch.export's ``dynamic_shapes`` for the labelled dims: a tuple over positional inputs,
    or (with keyword inputs) a mapping from forward's parameter names, as export wants."""
    _check_labels([*args, *kwargs.values()], labels)
    named: dict[str, Dim] = {}

    def spec_of(entry: Mapping[int, str]) -> dict[int, Dim] | None:
        out = {}
        for d, name in entry.items():
            if name not in named:
                named[name] = Dim(name, min=2, max=max_sizes.get(name, 1 << 20))
            out[d] = named[name]
        return out or None
    specs = [spec_of(entry) for entry in labels]
    if not kwargs:
        return tuple(specs)
    by_value = {id(v): s for v, s in zip([*args, *kwargs.values()], specs)}
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    params = inspect.signature(model.forward).parameters
    out: dict[str, Any] = {}
    for name, value in bound.items():
        kind = params[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: by_value.get(id(v)) for k, v in value.items()}
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(by_value.get(id(v)) for v in value)
        else:
            out[name] = by_value.get(id(value))
    return out


def _annotate(gm: fx.GraphModule, ep: torch.export.ExportedProgram, model: nn.Module,
              args: list, dims: list[dict[int, str]] | None) -> None:
    """Give every node its NodeInfo and the graph its GraphInfo (names, symbols)."""
    ginfo = GraphInfo(symbols={}, example_sizes={})
    ginfo.module_types = {fqn: type(m).__name__ for fqn, m in model.named_modules()}
    kinds: dict[str, tuple[str, str | None]] = {}
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            kinds[name] = ("param", spec.target)
            ginfo.param_fqns[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            kinds[name] = ("buffer", spec.target)
            ginfo.buffer_fqns[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            kinds[name] = ("input", None)
            ginfo.input_names.append(name)
        else:
            kinds[name] = ("constant", spec.target)
    ginfo.input_constants = {i: spec.arg.value for i, spec in enumerate(
        s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT)
        if not isinstance(spec.arg, TensorArgument)}
    ginfo.symbols, ginfo.example_sizes, ginfo.export_symbols = _symbol_map(gm, ginfo.input_names, args, dims)
    ginfo.in_spec, ginfo.out_spec = ep.call_spec.in_spec, ep.call_spec.out_spec
    ginfo.output_targets = [(spec.kind.name, getattr(spec, "target", None)) for spec in ep.graph_signature.output_specs]
    gm.meta[META_KEY] = ginfo
    params = dict(model.named_parameters(remove_duplicate=False))
    for node in gm.graph.nodes:
        rec = _node_info(node, kinds, ginfo)
        if rec.kind == "param":
            rec.trainable = bool(params[rec.target_fqn].requires_grad) if rec.target_fqn in params else True
        elif rec.kind == "input":
            idx = ginfo.input_names.index(node.name) if node.name in ginfo.input_names else -1
            arg = args[idx] if 0 <= idx < len(args) else None
            rec.trainable = isinstance(arg, torch.Tensor) and arg.requires_grad
        set_info(node, rec)


def _node_info(node: fx.Node, kinds: dict, ginfo: GraphInfo) -> NodeInfo:
    if node.op == "placeholder":
        kind, target = kinds.get(node.name, ("input", None))
        fqn = target.rsplit(".", 1)[0] if target and "." in target else ""
        return NodeInfo(kind=kind, fqn=fqn, module_type=ginfo.module_types.get(fqn, ""), target_fqn=target)
    if node.op == "output":
        return NodeInfo(kind="output")
    stack = node.meta.get("nn_module_stack") or {}
    fqn, mtype = "", ginfo.module_types.get("", "")
    if stack:
        path, cls = list(stack.values())[-1]
        fqn = _clean_fqn(path)
        mtype = ginfo.module_types.get(fqn, cls.rsplit(".", 1)[-1] if isinstance(cls, str) else str(cls))
    return NodeInfo(kind="op", fqn=fqn, module_type=mtype)


def _clean_fqn(path: str) -> str:
    """nn_module_stack paths are fqns in current torch; older forms look like L['self'].h[0]."""
    if path.startswith("_empty_nn_module_stack"):
        return ""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def _symbol_map(gm: fx.GraphModule, input_names: list[str], args: tuple,
                dims: DimLabels | None) -> tuple[dict, dict[str, int], dict]:
    """Map export's internal symbols (s0, s1, ...) to autopar's named ones and rename them."""
    if not dims:
        return {}, {}, {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    rename: dict[sympy.Symbol, sympy.Symbol] = {}
    sizes: dict[str, int] = {}
    for name, arg, labels in zip(input_names, args, dims):
        val = placeholders[name].meta.get("val")
        for d, label in labels.items():
            size = val.shape[d]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                rename[size.node.expr] = symbol(label)
            sizes[label] = int(arg.shape[d])
    return {label: symbol(label) for label in sizes}, sizes, rename


def to_expr(size: Any, rename: Mapping[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression over autopar's named symbols."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return expr.xreplace(rename) if rename else expr
    return sympy.Integer(int(size))


def wrap_graph(gm: fx.GraphModule, *, params: Mapping[str, str] | None = None,
               trainable_inputs: Sequence[str] = ()) -> fx.GraphModule:
    """Give a hand-built GraphModule the records capture would: placeholders named in
    ``params`` (placeholder name -> fqn) are trainable parameters, the rest are inputs
    (trainable when named in ``trainable_inputs``). Placeholders need an example tensor
    in ``node.meta["val"]``; the shape pass propagates the rest."""
    params = dict(params or {})
    ginfo = GraphInfo(symbols={}, example_sizes={}, param_fqns=params)
    gm.meta[META_KEY] = ginfo
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params:
            fqn = params[node.name]
            rec = NodeInfo(kind="param", fqn=fqn.rsplit(".", 1)[0] if "." in fqn else "", target_fqn=fqn,
                           trainable=True)
        elif node.op == "placeholder":
            ginfo.input_names.append(node.name)
            rec = NodeInfo(kind="input", trainable=node.name in trainable_inputs)
        elif node.op == "output":
            rec = NodeInfo(kind="output")
        else:
            rec = NodeInfo(kind="op", made_by="hand")
        set_info(node, rec)
    return gm
