"""Capture's errors: what failed, in which module and on which source line, and a fix.

:func:`module_tracker` keeps the stack of modules running while the model is traced;
:func:`capture_error` turns any failure of ``torch.export`` into a :class:`CaptureError` (the
model cannot be traced: data-dependent control flow, an unsupported construct) or an
:class:`InputMismatchError` (the model fails on its example inputs even when run eagerly),
naming the module and the user's source line.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from autopar.core.layout import package_roots
from autopar.core.errors import AutoparError, CaptureError, InputMismatchError
from autopar.passes.meta import training_config

_TORCH_DIR = os.path.dirname(torch.__file__)

@contextmanager
def module_tracker(model: nn.Module) -> Iterator[list[str]]:
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


def user_line(stack_trace: str) -> str:
    """``file:line: code`` of the innermost frame of a node's stack trace outside torch."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', stack_trace)
    for filename, lineno, code in reversed(frames):
        if not filename.startswith(_TORCH_DIR):
            return f"{filename}:{lineno}: {code.strip()}"
    return ""


def capture_error(model: nn.Module, args: tuple, exc: Exception, stack: list[str],
                   kwargs: Mapping[str, Any] | None = None) -> AutoparError:
    """A CaptureError naming the module and source line, or an InputMismatchError when the
    model itself fails on these inputs (eagerly, without torch.export)."""
    kwargs = dict(kwargs or {})
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    # a model on the meta device cannot run eagerly (library code may read values): export's error stands
    eager = None if is_tracing_limit(exc) or on_meta else eager_failure(model, args, kwargs)
    if eager is not None:
        exc, stack = eager
    fqn = stack[-1] if stack else ""
    mods = dict(model.named_modules())
    mod_name = f"{fqn or '<root>'} ({type(mods.get(fqn, model)).__name__})"
    frame = user_frame(exc)
    where = f"module {mod_name}"
    if frame is not None:
        line = linecache.getline(frame.filename, frame.lineno).strip()
        where += f", {frame.filename}:{frame.lineno}: {line}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if eager is not None:
        return InputMismatchError(
            f"the model fails on its example inputs: {type(exc).__name__}: {first[:300]}", where=where,
            expected=f"inputs {type(model).__name__}.forward{signature(model)} accepts (shapes, dtypes, devices)",
            got=", ".join(describe(a) for a in args),
            fix="pass example inputs the model runs on: check each input's shape and dtype against the line above")
    return CaptureError(
        f"torch.export could not capture the model: {type(exc).__name__}: {first[:300]}",
        where=where,
        fix=fix_hint(exc))


def is_tracing_limit(exc: Exception) -> bool:
    """A failure of tracing itself (data-dependent control flow, a size the model pins), not of the model."""
    msg = str(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"GuardOnDataDependentSymNode", "UserError", "Unsupported", "TorchRuntimeError"}) \
        or "data-dependent" in msg or "Constraints violated" in msg


def eager_failure(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[Exception, list[str]] | None:
    """Run the model eagerly (no grad, buffers and RNG restored): the exception and module stack
    it fails with, or None when it runs."""
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    with module_tracker(model) as stack:
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with training_config(model):
                    model(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the model itself
            return exc, list(stack)
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    if k in saved and not b.is_meta:
                        b.copy_(saved[k])
    return None


def signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and autopar: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = (*package_roots(), _TORCH_DIR)
    for fs in reversed(frames):
        if not fs.filename.startswith(ours) and not fs.filename.startswith("<"):
            return fs
    return None


def fix_hint(exc: Exception) -> str:
    msg = str(exc)
    if "Found <class" in msg and "output" in msg:
        return ("forward returns an object torch.export cannot flatten; return tensors, tuples, dicts or a "
                "transformers ModelOutput (an inference cache is never part of a training graph)")
    if "data-dependent" in msg or "GuardOnDataDependent" in type(exc).__name__ or ".item()" in msg:
        return ("the forward branches on or sizes by tensor values; rewrite it with shape-static "
                "ops (torch.where, masks, fixed capacities) so the graph does not depend on data")
    if "leaf Variable that requires grad is being used in an in-place operation" in msg:
        return ("forward changes a parameter in place, which autograd cannot differentiate: compute a new "
                "tensor instead (w = w * 0.5, not w.mul_(0.5)), or change the parameter outside forward under "
                "torch.no_grad()")
    if "Constraints violated" in msg or "specializ" in msg:
        return ("the model fixes a size that was marked symbolic; capture without dims=, or remove "
                "the code that pins that size")
    return ("make forward traceable by torch.export(strict=False): no data-dependent Python control "
            "flow, no calls torch cannot trace; see the line above")


def source_of(fn: Any) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


def describe(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        return f"Tensor{tuple(arg.shape)} {str(arg.dtype).replace('torch.', '')} on {arg.device}"
    return type(arg).__name__
