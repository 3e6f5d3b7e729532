"""A model's own ``torch.autograd.Function``s keep their backward.

``torch.export`` traces a Function's forward into plain aten ops and drops its backward: a
straight-through estimator (``round`` forward, identity backward) would be differentiated as
``round`` (gradient zero), silently. While autopar captures a model, :func:`opaque_functions`
routes every call of a Function defined outside torch through one operator,
``autopar::autograd_function``, so the captured graph holds one opaque node per call. When the
graph runs, that operator calls the Function itself: its forward computes the outputs and
autograd records its own backward, exactly as in the user's process.

The node names the Function by a key into this process's registry (filled by the capture
that saw it; a graph holding one is never written to the capture cache, so no file names code
to run) and carries its non-tensor arguments as JSON (numbers, strings, booleans, None, and
lists of them); any other argument, or keyword arguments, is refused with an
:class:`UnsupportedError` naming the Function and where it is defined. The planner treats the
node as an op without a split rule: its inputs are made whole (replicated) before it runs.
"""
from __future__ import annotations

import inspect
import json
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.autograd.function import Function

from autopar.core.errors import UnsupportedError

_LIB = torch.library.Library("autopar", "FRAGMENT")
_LIB.define("autograd_function(str key, str spec, Tensor[] tensors) -> Tensor[]")

_REGISTRY: dict[str, type] = {}          # key -> the Function class (this process)
_SINGLE: dict[str, bool] = {}            # key -> its forward returns one tensor (not a tuple)
_LOCK = threading.Lock()
_ORIGINAL_APPLY = Function.apply.__func__


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def where(cls: type) -> str:
    """``file:line`` of a Function's definition (or its qualified name)."""
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return _key(cls)


def _encode(cls: type, args: tuple, kwargs: dict) -> tuple[str, list[torch.Tensor]]:
    """The JSON spec of ``args`` (tensors by position in the returned list)."""
    if kwargs:
        raise UnsupportedError(f"torch.autograd.Function {cls.__qualname__} is called with keyword arguments",
                               where=where(cls), got=", ".join(sorted(kwargs)),
                               fix="pass them positionally to .apply(...)")
    tensors: list[torch.Tensor] = []

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            return {"tensor": len(tensors) - 1}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        if isinstance(a, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in a):
            return {"list": list(a), "tuple": isinstance(a, tuple)}
        raise UnsupportedError(f"torch.autograd.Function {cls.__qualname__} takes an argument autopar cannot "
                               "carry in a graph", where=where(cls), got=type(a).__name__,
                               expected="tensors, numbers, strings, booleans, None, or lists of them",
                               fix="pass that value through the Function's class or module instead of .apply()")
    return json.dumps([one(a) for a in args]), tensors


def _decode(spec: str, tensors: list[torch.Tensor]) -> list[Any]:
    def one(a: Any) -> Any:
        if isinstance(a, dict):
            if "tensor" in a:
                return tensors[a["tensor"]]
            return tuple(a["list"]) if a["tuple"] else list(a["list"])
        return a
    return [one(a) for a in json.loads(spec)]


def _lookup(key: str) -> type:
    cls = _REGISTRY.get(key)
    if cls is None:
        raise UnsupportedError(f"the graph calls torch.autograd.Function {key}, which this process never captured",
                               where="autopar::autograd_function",
                               fix="capture the model in this process (parallelize it here) before running the graph")
    return cls


def _as_list(out: Any) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise UnsupportedError("a torch.autograd.Function returns something other than tensors",
                               where="autopar::autograd_function",
                               got=", ".join(type(o).__name__ for o in outs),
                               fix="return tensors only from forward()")
    return outs


def _run(key: str, spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    cls = _lookup(key)
    out = _ORIGINAL_APPLY(cls, *_decode(spec, list(tensors)))
    _SINGLE.setdefault(key, not isinstance(out, (tuple, list)))
    return _as_list(out)


def _autograd(key: str, spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Autograd kernel: the Function's own apply, which records its own backward."""
    return _run(key, spec, tensors)


def _plain(key: str, spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Below autograd (no gradient needed): the forward alone."""
    with torch.no_grad():
        return [o.clone() if o._base is not None else o for o in _run(key, spec, tensors)]


def _fake(key: str, spec: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Shapes for tracing: the forward on fake tensors (no graph recorded below the tracer)."""
    with torch.no_grad():
        return [o.clone() for o in _run(key, spec, tensors)]


_LIB.impl("autograd_function", _autograd, "Autograd")
_LIB.impl("autograd_function", _plain, "CompositeExplicitAutograd")
torch.library.register_fake("autopar::autograd_function", _fake, lib=_LIB)

OP = torch.ops.autopar.autograd_function.default


def _user_function(cls: type) -> bool:
    """A Function the model defines (torch's own keep tracing through: export knows them)."""
    module = getattr(cls, "__module__", "") or ""
    return not (module == "torch" or module.startswith("torch."))


def _patched_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    if not _user_function(cls):
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    key = _key(cls)
    spec, tensors = _encode(cls, args, kwargs)
    with _LOCK:
        known = _REGISTRY.setdefault(key, cls)
    if known is not cls:
        raise UnsupportedError(f"two torch.autograd.Functions share the name {key}", where=where(cls),
                               fix="give each Function class its own name in its module")
    outs = OP(key, spec, tensors)
    if key not in _SINGLE:      # the fake kernel ran the forward and learned its structure
        _SINGLE[key] = len(outs) == 1
    return outs[0] if _SINGLE[key] else tuple(outs)


@contextmanager
def opaque_functions() -> Iterator[None]:
    """While capturing: each user Function's call becomes one ``autopar::autograd_function`` node."""
    previous = Function.__dict__["apply"]
    Function.apply = classmethod(_patched_apply)
    try:
        yield
    finally:
        Function.apply = previous


def calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's opaque Function calls."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_call(n.target)]


def is_call(target: object) -> bool:
    """Whether an fx target is the opaque Function operator (compared by name: a graph copied
    through torch's passes may hold another OpOverload object of the same operator)."""
    return isinstance(target, torch._ops.OpOverload) and target.name() == "autopar::autograd_function"


__all__ = ["OP", "calls", "is_call", "opaque_functions", "where"]
