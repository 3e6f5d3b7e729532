"""The key of a capture: everything that decides the graph ``torch.export`` would make.

:func:`capture_key` hashes (SHA-256) a canonical description of
- the model's structure: every module's fqn and class, its plain attributes (numbers,
  strings, configs, functions by their code and closure, tensors that are not parameters
  by their contents), its hooks and its train/eval flag; every parameter and buffer by
  name, shape, dtype, device (type and index: the graph holds ``cuda:1``, so each rank of a
  node that shares the directory has its own entry), ``requires_grad``, persistence and which
  names share a tensor;
- the call: each input's shape, dtype, device and ``requires_grad`` (non-tensor inputs by
  value), keyword names, the symbolic-size labels and their bounds;
- the code that runs: the source of every file that defines a class in the model and of the
  modules those files use outside the Python installation (the user's code, autopar itself,
  editable installs), the code of what a module without a file defines (a notebook's
  ``__main__``), and the versions of Python, torch and ``transformers``;
- torch's global state that tracing reads: default dtype, grad mode, autocast.

Anything it cannot describe faithfully (an object with no ``__dict__``, a cycle deeper than
it walks) makes the model *unkeyable*: :func:`capture_key` returns None and the capture
runs without the cache. The key errs toward missing: a change it cannot see is a cache miss,
never a wrong graph. What it cannot see: code reached only through ``site-packages``
libraries other than torch and ``transformers`` (their versions are not in the key) and
state read from files or the environment during ``forward``.
"""
from __future__ import annotations

import enum
from functools import partial as functools_partial
import hashlib
import json
import logging
import os
import sys
import sysconfig
import types
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autopar.core.layout import package_roots

log = logging.getLogger("autopar.capture")

_MAX_DEPTH = 8
_SKIP_MODULE_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_NO_HOOKS = ["list", []]          # what _value gives an empty hook dict's values


class Unkeyable(Exception):
    """The model holds something the key cannot describe faithfully."""


def capture_key(model: nn.Module, args: tuple, kwargs: Mapping[str, Any], dims: Any,
                max_sizes: Mapping[str, int] | None) -> str | None:
    """The SHA-256 key of capturing ``model`` on these inputs, or None if it is unkeyable."""
    try:
        desc = {
            "format": 1,
            "versions": _versions(),
            "torch_state": _torch_state(),
            "model": describe_module(model),
            "inputs": [_input(a) for a in args],
            "kwargs": {k: _input(v) for k, v in kwargs.items()},
            "dims": _value(dims, (), 0),
            "max_sizes": _value(dict(max_sizes or {}), (), 0),
            "code": _code_files(model),
        }
    except Unkeyable as exc:
        log.info("capture cache: %s; capturing without the cache", exc)
        return None
    blob = json.dumps(desc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _input(a: Any) -> Any:
    """An input by what tracing sees of it: a tensor's shape and type (its values are fake
    during export), anything else by value."""
    if isinstance(a, torch.Tensor):
        return ["tensor", list(a.shape), list(a.stride()), str(a.dtype), str(a.device), a.requires_grad]
    if isinstance(a, (list, tuple)):
        return [type(a).__name__, [_input(x) for x in a]]
    if isinstance(a, Mapping):
        return ["mapping", sorted([repr(k), _input(v)] for k, v in a.items())]
    return _value(a, {}, 0)


def _versions() -> dict[str, str]:
    out = {"python": sys.version, "torch": torch.__version__}
    tf = sys.modules.get("transformers")
    if tf is not None:
        out["transformers"] = str(getattr(tf, "__version__", "?"))
    return out


def _torch_state() -> dict[str, Any]:
    return {"default_dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "autocast_cpu": torch.is_autocast_enabled("cpu"),
            "autocast_cpu_dtype": str(torch.get_autocast_dtype("cpu")),
            "autocast_cuda": torch.is_autocast_enabled("cuda"),
            "autocast_cuda_dtype": str(torch.get_autocast_dtype("cuda"))}


def describe_module(model: nn.Module, ignore: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The model's modules (fqn, class, attributes but those named in ``ignore``), parameters
    and buffers."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules(remove_duplicate=False)}
    modules = []
    for fqn, m in model.named_modules(remove_duplicate=False):
        attrs = {k: _NO_HOOKS if not v and type(v) is OrderedDict and "hook" in k else   # most modules' hook dicts
                 _value(list(v.values()) if "hook" in k and (type(v) is OrderedDict or isinstance(v, Mapping))
                        else v, fqn_of, 0, where=f"{fqn or '<root>'}.{k}")   # hook dicts: keyed by process-wide counters
                 for k, v in sorted(m.__dict__.items()) if k not in _SKIP_MODULE_ATTRS and k not in ignore}
        modules.append([fqn, _qualname(type(m)), attrs, sorted(m._non_persistent_buffers_set)])
    first: dict[int, str] = {}
    params = [[name, list(p.shape), str(p.dtype), str(p.device), p.requires_grad, type(p).__name__,
               first.setdefault(id(p), name)] for name, p in model.named_parameters(remove_duplicate=False)]
    buffers = [[name, list(b.shape), str(b.dtype), str(b.device), first.setdefault(id(b), name)]
               for name, b in model.named_buffers(remove_duplicate=False)]
    return {"modules": modules, "params": params, "buffers": buffers}


def _value(v: Any, fqn_of: Mapping[int, str], depth: int, where: str = "input") -> Any:
    """A JSON-able description of ``v`` that differs whenever ``v`` would trace differently."""
    if depth > _MAX_DEPTH:
        raise Unkeyable(f"{where} nests deeper than {_MAX_DEPTH} levels")
    d = depth + 1
    kind = type(v)             # the common exact types first: a module holds thousands of them
    if v is None or kind is bool or kind is str:
        return v
    if kind is int or kind is float:
        return [kind.__name__, repr(v)]
    if kind is list or kind is tuple:
        return [kind.__name__, [_value(x, fqn_of, d, where) for x in v]]
    if kind is dict or kind is OrderedDict:
        return [_qualname(kind), sorted([repr(k), _value(x, fqn_of, d, f"{where}[{k!r}]")] for k, x in v.items())]
    if isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float)):
        return [type(v).__name__, repr(v)]
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
        return [type(v).__name__, str(v)]
    if isinstance(v, enum.Enum):
        return ["enum", _qualname(type(v)), repr(v.value)]
    if isinstance(v, nn.Module):
        if id(v) in fqn_of:
            return ["module", fqn_of[id(v)]]
        return ["foreign module", _qualname(type(v)),
                {k: _value(x, fqn_of, d, f"{where}.{k}") for k, x in sorted(v.__dict__.items())}]
    if isinstance(v, torch.Tensor):
        return _tensor(v)
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_value(x, fqn_of, d, where) for x in v]]
    if isinstance(v, (set, frozenset)):
        return [type(v).__name__, sorted(json.dumps(_value(x, fqn_of, d, where), default=str) for x in v)]
    if isinstance(v, Mapping):
        return [_qualname(type(v)), sorted([repr(k), _value(x, fqn_of, d, f"{where}[{k!r}]")] for k, x in v.items())]
    if isinstance(v, type):
        return ["type", _qualname(v)]
    if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools_partial)):
        return _callable(v, fqn_of, d, where)
    if isinstance(v, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return ["op", str(v)]
    state = getattr(v, "__dict__", None)
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())]
    if state is None and not slots:
        raise Unkeyable(f"{where} is a {_qualname(type(v))} with no attributes to describe")
    out = {k: _value(x, fqn_of, d, f"{where}.{k}") for k, x in sorted((state or {}).items())}
    for s in slots:
        if hasattr(v, s) and s not in ("__dict__", "__weakref__"):
            out[s] = _value(getattr(v, s), fqn_of, d, f"{where}.{s}")
    return ["object", _qualname(type(v)), out]


def _callable(f: Any, fqn_of: Mapping[int, str], depth: int, where: str) -> Any:
    if isinstance(f, functools_partial):
        return ["partial", _value(f.func, fqn_of, depth, where), _value(list(f.args), fqn_of, depth, where),
                _value(dict(f.keywords), fqn_of, depth, where)]
    if isinstance(f, types.MethodType):
        owner = f.__self__
        me = ["module", fqn_of[id(owner)]] if id(owner) in fqn_of else ["object", _qualname(type(owner))]
        return ["method", me, _callable(f.__func__, fqn_of, depth, where)]
    code = getattr(f, "__code__", None)
    if code is None:                                   # a builtin: its name says what it is
        return ["builtin", getattr(f, "__module__", None), getattr(f, "__qualname__", repr(f))]
    cells = [c.cell_contents for c in (f.__closure__ or ()) if _cell_set(c)]
    return ["function", f.__module__, f.__qualname__, _code(code),
            _value(list(f.__defaults__ or ()), fqn_of, depth, where),
            _value(cells, fqn_of, depth, f"{where} (closure)")]


def _cell_set(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _code(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    for c in code.co_consts:
        h.update((_code(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()


def _tensor(t: torch.Tensor) -> list[Any]:
    head = ["tensor", list(t.shape), list(t.stride()), str(t.dtype), str(t.device), t.requires_grad]
    if t.device.type == "meta":
        return head
    data = t.detach().cpu().contiguous()
    if data.is_complex() or data.dtype == torch.bool:
        data = data.to(torch.uint8) if data.dtype == torch.bool else torch.view_as_real(data)
    return head + [hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- the code that runs ------------------------------------------------------------------

_FILE_HASHES: dict[str, tuple[int, int, str]] = {}


def _library_dirs() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {os.path.join(p, "") for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def _code_files(model: nn.Module) -> dict[str, str]:
    """SHA-256 of the source files whose code the capture can run: each file that defines a
    class of the model (or a base), the modules those files use, transitively, while they lie
    outside the Python installation, and every file of autopar itself."""
    library = _library_dirs()
    files: set[str] = set(_autopar_files())
    fileless: dict[str, str] = {}
    todo = [sys.modules.get(cls.__module__) for kind in {type(m) for m in model.modules()} for cls in kind.__mro__]
    seen: set[int] = set()
    while todo:
        mod = todo.pop()
        if mod is None or id(mod) in seen:
            continue
        seen.add(id(mod))
        f = getattr(mod, "__file__", None)
        if not f:                         # a notebook's __main__: the code of what it defines
            fileless[f"<module {mod.__name__}>"] = _module_code(mod)
        elif os.path.realpath(f).startswith(library):
            files.add(f)
            continue                      # installed code: its package's version is in the key
        else:
            files.add(f)
        for v in list(vars(mod).values()):
            if isinstance(v, types.ModuleType):
                todo.append(v)
            elif isinstance(v, (type, types.FunctionType)):
                todo.append(sys.modules.get(getattr(v, "__module__", None) or ""))
    return {**{f: _file_hash(f) for f in sorted(files)}, **fileless}


def _module_code(mod: types.ModuleType) -> str:
    """A digest of the code of the functions and classes a module without a file defines (a
    notebook's cells redefine them in place)."""
    h = hashlib.sha256()
    for name, v in sorted(vars(mod).items(), key=lambda kv: kv[0]):
        if isinstance(v, types.FunctionType) and v.__module__ == mod.__name__:
            h.update(f"{name}:{_code(v.__code__)}".encode())
        elif isinstance(v, type) and v.__module__ == mod.__name__:
            for attr, f in sorted(vars(v).items(), key=lambda kv: kv[0]):
                f = getattr(f, "__func__", getattr(f, "fget", f))
                if isinstance(f, types.FunctionType):
                    h.update(f"{name}.{attr}:{_code(f.__code__)}".encode())
    return h.hexdigest()


_AUTOPAR_FILES: list[str] = []


def _autopar_files() -> list[str]:
    if not _AUTOPAR_FILES:
        for root in package_roots():
            for d, _, names in os.walk(root):
                _AUTOPAR_FILES.extend(os.path.join(d, n) for n in names if n.endswith(".py"))
    return _AUTOPAR_FILES


def _file_hash(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    known = _FILE_HASHES.get(path)
    if known and known[:2] == (st.st_mtime_ns, st.st_size):
        return known[2]
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    _FILE_HASHES[path] = (st.st_mtime_ns, st.st_size, digest)
    return digest


__all__ = ["Unkeyable", "capture_key"]
