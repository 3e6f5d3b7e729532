"""Capture: an unmodified ``nn.Module`` into an ATen-level ``torch.fx.GraphModule``.

Reads the model and its example inputs; writes a graph whose every node carries a
:class:`~autopar.passes.meta.NodeInfo` (module path, kind, original parameter/buffer
name) and a :class:`~autopar.passes.meta.GraphInfo` with the named size symbols.

The capture is ``torch.export.export(strict=False)`` in its training IR (``aten.linear``,
``aten.scaled_dot_product_attention`` stay whole). Dims the caller labels (``batch``,
``seq``) are exported as dynamic, so every shape downstream is a formula in them.
Works on the ``meta`` device: nothing is allocated.
"""
from __future__ import annotations

import inspect
import os
import linecache
import logging
import re
import traceback
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Iterator

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind

import autopar
from autopar.errors import AutoparError, CaptureError, InputMismatchError, UnsupportedError
from autopar.passes.meta import META_KEY, GraphInfo, NodeInfo, graph_info, set_info, symbol

log = logging.getLogger("autopar.capture")

DimLabels = Sequence[Mapping[int, str]]

_TORCH_DIR = os.path.dirname(torch.__file__)


def capture(model: nn.Module, example_inputs: Any, *, dims: DimLabels | None = None,
            max_sizes: Mapping[str, int] | None = None) -> fx.GraphModule:
    """Capture ``model`` called on ``example_inputs`` into an annotated ATen graph.

    ``dims`` labels, per positional input, the dims that are symbolic sizes, e.g.
    ``({0: "batch", 1: "seq"},)``; the same name on several inputs is one size. Without
    it the capture is static (every size an integer). ``max_sizes`` bounds a symbol's
    range (default 2**20). A model that cannot be captured raises :class:`CaptureError`
    naming the module and source line that failed.
    """
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    _check_inputs(model, args, dims)
    dynamic_shapes = _dynamic_shapes(dims, max_sizes or {}) if dims else None
    with _module_tracker(model) as stack:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a CaptureError or InputMismatchError
            raise _capture_error(model, args, exc, list(stack)) from exc
    gm = ep.graph_module
    _annotate(gm, ep, model, args, dims)
    _check_dtypes(gm)
    ginfo = graph_info(gm)
    log.info("capture: %d nodes, %d parameters, symbols %s", len(gm.graph.nodes),
             len(ginfo.param_fqns), sorted(ginfo.symbols))
    return gm


def _check_inputs(model: nn.Module, args: tuple, dims: DimLabels | None) -> None:
    if not isinstance(model, nn.Module):
        raise InputMismatchError("capture needs an nn.Module", got=type(model).__name__,
                                 fix="pass the model object itself, e.g. capture(MyModel(), (x,))")
    _check_real(model, args)
    try:
        inspect.signature(model.forward).bind(*args)
    except TypeError as exc:
        raise InputMismatchError(
            f"example inputs do not match {type(model).__name__}.forward: {exc}",
            where=_source_of(model.forward),
            expected=f"forward{inspect.signature(model.forward)}",
            got=f"{len(args)} positional input(s): {', '.join(_describe(a) for a in args)}",
            fix="pass a tuple with one example value per positional argument of forward") from None
    if dims is None:
        return
    if len(dims) != len(args):
        raise InputMismatchError("dims must label each positional input (use {} for none)",
                                 expected=f"{len(args)} entries", got=f"{len(dims)}",
                                 fix="e.g. dims=({0: 'batch', 1: 'seq'},) for one token-id input")
    for i, (arg, labels) in enumerate(zip(args, dims)):
        for d, name in labels.items():
            if not isinstance(arg, torch.Tensor) or d >= arg.dim():
                raise InputMismatchError(f"dims labels dim {d} of input {i} as {name!r}, which it lacks",
                                         got=_describe(arg), fix="label only dims the input has")
            if arg.shape[d] < 2:
                raise InputMismatchError(
                    f"input {i} dim {d} ({name!r}) has example size {arg.shape[d]}; a symbolic size "
                    "needs an example of at least 2 (torch.export specializes sizes 0 and 1)",
                    fix=f"capture with {name} >= 2 and evaluate the formulas at {arg.shape[d]}")


def _check_real(model: nn.Module, args: tuple) -> None:
    """Complex parameters, buffers or inputs: autopar's sharding rules, reductions and
    optimizer pieces assume real numbers."""
    named = [(f"parameter {k}", t) for k, t in model.named_parameters()]
    named += [(f"buffer {k}", t) for k, t in model.named_buffers()]
    named += [(f"input {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
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
            line = _user_line(node.meta.get("stack_trace") or "")
            shown = ", ".join(f"{a.name}: {str(v.dtype).replace('torch.', '')}"
                              for a, v in zip(operands, vals) if isinstance(v, torch.Tensor))
            raise InputMismatchError(f"{name} in module {fqn or '<root>'} gets tensors of different dtypes",
                                     where=f"node {node.name}, module {fqn or '<root>'}" + (f", {line}" if line else ""),
                                     expected="one dtype for all its operands", got=shown,
                                     fix="pass example inputs of the dtype the model's parameters have (e.g. "
                                         "x.float()), or cast the model (model.to(dtype))")


def _dynamic_shapes(dims: DimLabels, max_sizes: Mapping[str, int]) -> tuple:
    named: dict[str, Dim] = {}
    spec = []
    for labels in dims:
        entry = {}
        for d, name in labels.items():
            if name not in named:
                named[name] = Dim(name, min=2, max=max_sizes.get(name, 1 << 20))
            entry[d] = named[name]
        spec.append(entry or None)
    return tuple(spec)


def _annotate(gm: fx.GraphModule, ep: torch.export.ExportedProgram, model: nn.Module,
              args: tuple, dims: DimLabels | None) -> None:
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


# ---- errors ---------------------------------------------------------------------------

@contextmanager
def _module_tracker(model: nn.Module) -> Iterator[list[str]]:
    """Keep the stack of module fqns being run, so a failure can name its module."""
    stack: list[str] = []
    handles = []

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    for fqn, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, fqn=fqn: stack.append(fqn) and None))
        handles.append(mod.register_forward_hook(pop))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _user_line(stack_trace: str) -> str:
    """``file:line: code`` of the innermost frame of a node's stack trace outside torch."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', stack_trace)
    for filename, lineno, code in reversed(frames):
        if not filename.startswith(_TORCH_DIR):
            return f"{filename}:{lineno}: {code.strip()}"
    return ""


def _capture_error(model: nn.Module, args: tuple, exc: Exception, stack: list[str]) -> AutoparError:
    """A CaptureError naming the module and source line, or an InputMismatchError when the
    model itself fails on these inputs (eagerly, without torch.export)."""
    eager = None if _is_tracing_limit(exc) else _eager_failure(model, args)
    if eager is not None:
        exc, stack = eager
    fqn = stack[-1] if stack else ""
    mods = dict(model.named_modules())
    mod_name = f"{fqn or '<root>'} ({type(mods.get(fqn, model)).__name__})"
    frame = _user_frame(exc)
    where = f"module {mod_name}"
    if frame is not None:
        line = linecache.getline(frame.filename, frame.lineno).strip()
        where += f", {frame.filename}:{frame.lineno}: {line}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if eager is not None:
        return InputMismatchError(
            f"the model fails on its example inputs: {type(exc).__name__}: {first[:300]}", where=where,
            expected=f"inputs {type(model).__name__}.forward{_signature(model)} accepts (shapes, dtypes, devices)",
            got=", ".join(_describe(a) for a in args),
            fix="pass example inputs the model runs on: check each input's shape and dtype against the line above")
    return CaptureError(
        f"torch.export could not capture the model: {type(exc).__name__}: {first[:300]}",
        where=where,
        fix=_fix_hint(exc))


def _is_tracing_limit(exc: Exception) -> bool:
    """A failure of tracing itself (data-dependent control flow, a size the model pins), not of the model."""
    msg = str(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"GuardOnDataDependentSymNode", "UserError", "Unsupported", "TorchRuntimeError"}) \
        or "data-dependent" in msg or "Constraints violated" in msg


def _eager_failure(model: nn.Module, args: tuple) -> tuple[Exception, list[str]] | None:
    """Run the model eagerly (no grad, buffers and RNG restored): the exception and module stack
    it fails with, or None when it runs."""
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    with _module_tracker(model) as stack:
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of the model itself
            return exc, list(stack)
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    if k in saved and not b.is_meta:
                        b.copy_(saved[k])
    return None


def _signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and autopar: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = (os.path.dirname(__file__), os.path.dirname(autopar.__file__), _TORCH_DIR)
    for fs in reversed(frames):
        if not fs.filename.startswith(ours) and not fs.filename.startswith("<"):
            return fs
    return None


def _fix_hint(exc: Exception) -> str:
    msg = str(exc)
    if "data-dependent" in msg or "GuardOnDataDependent" in type(exc).__name__ or ".item()" in msg:
        return ("the forward branches on or sizes by tensor values; rewrite it with shape-static "
                "ops (torch.where, masks, fixed capacities) so the graph does not depend on data")
    if "Constraints violated" in msg or "specializ" in msg:
        return ("the model fixes a size that was marked symbolic; capture without dims=, or remove "
                "the code that pins that size")
    return ("make forward traceable by torch.export(strict=False): no data-dependent Python control "
            "flow, no calls torch cannot trace; see the line above")


def _source_of(fn: Any) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


def _describe(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        return f"Tensor{tuple(arg.shape)} {str(arg.dtype).replace('torch.', '')} on {arg.device}"
    return type(arg).__name__


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
