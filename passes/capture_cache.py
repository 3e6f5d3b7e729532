"""The capture cache: a captured graph kept on disk (and in memory) under its capture key.

``torch.export`` is most of the set-up time of :func:`autopar.parallelize` (about 1 s for a
4-layer GPT on one CPU core, and growing with depth). A capture depends only on what
:func:`autopar.passes.capture_key.capture_key` hashes, so :func:`autopar.passes.capture.capture`
keeps each graph it makes here and reuses it for the same key: in the same process from
memory, in a later process (the next run of a training script, every rank of a job on one
host) from ``CaptureCache.directory``.

An entry is data, never code: a zlib-compressed JSON description of the graph (each node's
op, target, arguments, value shapes as formulas, source line and module path), autopar's
records, and the lifted constants' bytes, signed with an HMAC-SHA256 under a key only this user
can read (``.autopar-key-<uid>`` in the directory, mode 0600, made on first use). Loading
checks the signature before reading anything, then every node's target against a closed
vocabulary (``torch.ops`` operators and :data:`VOCABULARY`'s arithmetic; no getter, caller or
attribute access) before building anything, and rebuilds every value as a fake tensor over a
fresh ``ShapeEnv``: a corrupt, foreign or crafted file is a miss (with a warning), not a wrong
graph or code run. A graph holding anything outside that vocabulary is simply not cached.
Deleting the directory is always safe.

Configuration: ``AUTOPAR_CACHE_DIR`` (default ``$XDG_CACHE_HOME/autopar`` or
``~/.cache/autopar``; ``off`` disables the cache), read once, or :func:`set_capture_cache`.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import operator
import os
import stat
import tempfile
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils._sympy.functions as sym_fns
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.value_ranges import ValueRanges

from autopar.passes import autograd_functions
from autopar.core.meta import META_KEY, GraphInfo, NodeInfo, graph_info, graph_module, symbol

log = logging.getLogger("autopar.capture")

FORMAT = 2
_MEMORY_ENTRIES = 16
_MAX_TEXT = 1 << 30              # an entry's JSON, decompressed: a bound, not a size any graph reaches
_PROCESS_SECRET = os.urandom(32)  # signs what only this process keeps (a cache without a directory)


class _Uncacheable(Exception):
    """The graph holds something an entry cannot describe."""


@dataclass(frozen=True)
class CaptureCache:
    """Where captures are kept: ``directory`` (None: memory only) and at most ``max_bytes`` on
    disk (the least recently used entries are removed past it)."""

    directory: Path | None
    max_bytes: int = 2 << 30

    def path(self, key: str) -> Path | None:
        return self.directory / f"capture-{key}.json.z" if self.directory else None


_lock = threading.Lock()
_memory: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()    # key -> (entry, the secret it is signed with)
_configured: list[CaptureCache | None] = []
_secrets: dict[Path, bytes | None] = {}


class _Untrusted(Exception):
    """The directory's key cannot be trusted (another owner, readable by others, malformed)."""


def key_path(directory: Path) -> Path:
    """This user's signing key in ``directory`` (one per user: a directory a team shares holds
    several, and each user trusts only the entries signed with their own)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return directory / f".autopar-key-{uid}"


def secret(cache: CaptureCache) -> bytes | None:
    """The key entries on ``cache``'s disk are signed with: read from :func:`key_path`, made
    there (mode 0600) on first use. None when it cannot be trusted: the disk is then not used
    (said once), and the cache works from memory."""
    if cache.directory is None:
        return _PROCESS_SECRET
    where = cache.directory
    with _lock:
        if where in _secrets:
            return _secrets[where]
    try:
        got: bytes | None = _read_or_make_key(where)
    except (OSError, _Untrusted) as exc:
        log.warning("capture cache: the signing key %s cannot be used (%s); the cache on disk is off for this "
                    "process (fix: delete that file, or set AUTOPAR_CACHE_DIR to a directory of your own)",
                    key_path(where), exc)
        got = None
    with _lock:
        _secrets[where] = got
    return got


def _read_or_make_key(directory: Path) -> bytes:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = key_path(directory)
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autopar-key-", suffix=".tmp")     # mode 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(32).hex().encode())
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)           # atomic and exclusive: a rank racing us keeps its own or ours
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted("not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise _Untrusted(f"owned by uid {st.st_uid}, not this user")
        if st.st_mode & 0o077:
            raise _Untrusted(f"mode {stat.S_IMODE(st.st_mode):o}: others may read or write it (it must be 600)")
        raw = os.read(fd, 129)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise _Untrusted("not a key autopar wrote")
    return bytes.fromhex(text)


def default_directory() -> Path | None:
    """``AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``; None if off."""
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def set_capture_cache(directory: str | os.PathLike | None | bool = True) -> CaptureCache | None:
    """Use ``directory`` for the capture cache (True: the default directory; None or False:
    no cache at all, not even in memory). Returns the cache now in use."""
    with _lock:
        _configured[:] = [None if directory in (None, False) else
                          CaptureCache(default_directory() if directory is True else Path(directory))]
        _memory.clear()
        return _configured[0]


def current() -> CaptureCache | None:
    with _lock:
        if not _configured:
            _configured.append(CaptureCache(default_directory()))
        return _configured[0]


def load(cache: CaptureCache, key: str) -> fx.GraphModule | None:
    """The graph cached under ``key``, rebuilt; None on a miss."""
    with _lock:
        held = _memory.get(key)
        if held is not None:
            _memory.move_to_end(key)
    where = "memory"
    blob, signed = held if held is not None else (None, None)
    if blob is None:
        path = cache.path(key)
        if path is None or not path.is_file():
            return None
        signed = secret(cache)
        if signed is None:
            return None
        try:
            blob = path.read_bytes()
            os.utime(path)                  # least recently used is what eviction removes
        except OSError as exc:
            log.warning("capture cache: cannot read %s (%s); capturing", path, exc)
            return None
        where = str(path)
    try:
        gm = decode(blob, key, signed)
    except Exception as exc:  # noqa: BLE001 - any bad entry is a miss, said once
        log.warning("capture cache: entry %s is unusable (%s: %s); capturing again", where, type(exc).__name__, exc)
        return None
    _remember(key, blob, signed)
    log.info("capture: from the cache (%s), %d nodes", where if where == "memory" else "disk", len(gm.graph.nodes))
    return gm


def store(cache: CaptureCache, key: str, gm: fx.GraphModule) -> None:
    """Keep ``gm`` under ``key`` (in memory, and on disk when the cache has a directory)."""
    signed = secret(cache) if cache.directory is not None else _PROCESS_SECRET
    on_disk = signed is not None
    signed = signed or _PROCESS_SECRET
    try:
        blob = encode(gm, key, signed)
    except _Uncacheable as exc:
        log.info("capture cache: not cached (%s)", exc)
        return
    except Exception as exc:  # noqa: BLE001 - the cache never fails a capture that worked
        log.warning("capture cache: could not describe the graph (%s: %s); not cached", type(exc).__name__, exc)
        return
    try:
        same = _signature(decode(blob, key, signed)) == _signature(gm)
    except Exception as exc:  # noqa: BLE001 - a graph the entry cannot rebuild is not cached
        log.info("capture cache: not cached (the entry does not rebuild: %s: %s)", type(exc).__name__, exc)
        return
    if not same:
        log.info("capture cache: not cached (the rebuilt graph differs from the capture)")
        return
    _remember(key, blob, signed)
    path = cache.path(key)
    if path is None or not on_disk:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".capture-", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)              # atomic: a reader sees the whole entry or none
        _evict(cache)
    except OSError as exc:
        log.warning("capture cache: cannot write %s (%s); continuing without it", path, exc)


def _signature(gm: fx.GraphModule) -> list[Any]:
    """What must survive the round trip: per node its name, op, target, arguments, record and
    values (shapes and strides as formulas over the named sizes, dtype, device, requires_grad)."""
    ginfo = graph_info(gm)
    rename = ginfo.export_symbols

    def val(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(_named(s, rename) for s in v.shape), tuple(_named(s, rename) for s in v.stride()),
                    v.dtype, v.device, v.requires_grad)
        if isinstance(v, torch.SymInt):
            return ("symint", _named(v, rename))
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(val(x) for x in v))
        return v
    out: list[Any] = [(sorted(ginfo.symbols), ginfo.example_sizes, ginfo.param_fqns, ginfo.buffer_fqns,
                       ginfo.input_names, ginfo.in_spec, ginfo.out_spec, ginfo.output_targets, ginfo.param_aliases,
                       ginfo.input_constants, {k: (t.dtype, t.shape, t.tolist()) for k, t in ginfo.constants.items()},
                       ginfo.transient_buffers, ginfo.without_cache, ginfo.module_types, ginfo.layer_run)]
    for n in gm.graph.nodes:
        out.append((n.name, n.op, n.target, repr(n.args), repr(n.kwargs), n.meta.get(META_KEY),
                    val(n.meta.get("val")), n.meta.get("stack_trace")))
    return out


def _named(s: Any, rename: dict) -> Any:
    return s.node.expr.xreplace(rename) if isinstance(s, torch.SymInt) else int(s)


def _remember(key: str, blob: bytes, signed: bytes) -> None:
    with _lock:
        _memory[key] = (blob, signed)
        _memory.move_to_end(key)
        while len(_memory) > _MEMORY_ENTRIES:
            _memory.popitem(last=False)


def _evict(cache: CaptureCache) -> None:
    entries = []
    for p in cache.directory.glob("capture-*.json.z"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= cache.max_bytes:
            break
        p.unlink(missing_ok=True)
        total -= size


# ---- encoding ---------------------------------------------------------------------------

def encode(gm: fx.GraphModule, key: str, signed: bytes = _PROCESS_SECRET) -> bytes:
    """``gm`` (as :func:`capture` returns it) as an entry's bytes, signed with ``signed`` (an
    HMAC-SHA256 of the compressed description); raises ``_Uncacheable``."""
    env = _shape_env(gm)
    nodes = [_node(n) for n in gm.graph.nodes]
    syms: dict[str, Any] = {}
    if env is not None:
        for s, hint in env.backed_var_to_val.items():
            r = env.var_to_range.get(s)
            syms[str(s)] = [int(hint), _bound(r.lower if r else None), _bound(r.upper if r else None)]
    body = {"format": FORMAT, "key": key, "nodes": nodes, "symbols": syms, "graph": _graph_info(graph_info(gm))}
    packed = zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 1)
    return b"hmac-sha256 " + _mac(signed, packed).encode() + b"\n" + packed


def _mac(signed: bytes, packed: bytes) -> str:
    return hmac.new(signed, packed, hashlib.sha256).hexdigest()


def _shape_env(gm: fx.GraphModule) -> ShapeEnv | None:
    """The ShapeEnv the values' sizes live in (None for a static capture)."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        for s in (list(v.shape) + list(v.stride())) if isinstance(v, torch.Tensor) else [v]:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


def _bound(b: Any) -> int | None:
    """A finite integer range bound, or None for an unbounded side."""
    if isinstance(b, (int, sympy.Integer)) and not isinstance(b, bool):
        return int(b)
    return None


def _node(n: fx.Node) -> list[Any]:
    rec = n.meta.get(META_KEY)
    if not isinstance(rec, NodeInfo):
        raise _Uncacheable(f"node {n.name} has no autopar record")
    plain = NodeInfo(kind=rec.kind, fqn=rec.fqn, module_type=rec.module_type, target_fqn=rec.target_fqn,
                     trainable=rec.trainable)
    if rec != plain:
        raise _Uncacheable(f"node {n.name} carries analysis results")
    stack = n.meta.get("nn_module_stack")
    stack = [[k, str(p), c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}"]
             for k, (p, c) in stack.items()] if stack else None
    return [n.name, n.op, _target(n), _arg(n.args), _arg(n.kwargs), _val(n.meta.get("val")),
            n.meta.get("stack_trace"), stack, [rec.kind, rec.fqn, rec.module_type, rec.target_fqn, rec.trainable]]


# The only Python functions an entry may name (besides ``torch.ops`` operators): the arithmetic
# and comparisons export writes for sizes. No getter, caller or attribute access
# (``operator.attrgetter``, ``methodcaller``, ``call`` would reach any code).
_OPERATOR = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt",
             "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift", "getitem",
             "index", "truth")
_MATH = ("ceil", "floor", "trunc", "sqrt", "log", "log2", "exp", "isnan", "isinf", "isfinite")
_TORCH = ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite", "sym_sum")
VOCABULARY: dict[tuple[str, str], Any] = {
    **{("operator", n): getattr(operator, n) for n in _OPERATOR},
    **{("math", n): getattr(math, n) for n in _MATH if hasattr(math, n)},
    **{("torch", n): getattr(torch, n) for n in _TORCH if hasattr(torch, n)},
}


def _target(n: fx.Node) -> Any:
    t = n.target
    if n.op in ("placeholder", "output"):
        return t
    if n.op != "call_function":
        raise _Uncacheable(f"node {n.name} is a {n.op}")
    if isinstance(t, torch._ops.OpOverload):
        if autograd_functions.is_call(t):      # names a class this process registered: never from a file
            raise _Uncacheable(f"node {n.name} calls a model's own torch.autograd.Function")
        ns, name = t.name().split("::", 1)
        return ["op", ns, name.split(".")[0], t._overloadname]
    for (mod, name), f in VOCABULARY.items():
        if f is t:
            return ["py", mod, name]
    raise _Uncacheable(f"node {n.name} calls {t!r}")


_SCALAR_TYPES = {torch.dtype: "dtype", torch.device: "device", torch.layout: "layout",
                 torch.memory_format: "memory_format"}


def _arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return {"@": a.name}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return {"f": repr(a)}
    if isinstance(a, (list, tuple)):
        return {"L" if isinstance(a, list) else "T": [_arg(x) for x in a]}
    if isinstance(a, dict):
        if not all(isinstance(k, str) for k in a):
            raise _Uncacheable("an argument dict with non-string keys")
        return {"D": {k: _arg(v) for k, v in a.items()}}
    kind = _SCALAR_TYPES.get(type(a))
    if kind is None:
        raise _Uncacheable(f"an argument of type {type(a).__name__}")
    return {kind: str(a).replace("torch.", "")}


def _val(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"t": [_size(s) for s in v.shape], "s": [_size(s) for s in v.stride()],
                "d": str(v.dtype).replace("torch.", ""), "v": str(v.device), "g": bool(v.requires_grad)}
    if isinstance(v, torch.SymInt):
        return {"i": _expr(v.node.expr)}
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return {"f": repr(v)}
    if isinstance(v, (list, tuple)):
        return {"L" if isinstance(v, list) else "T": [_val(x) for x in v]}
    raise _Uncacheable(f"a value of type {type(v).__name__}")


def _size(s: Any) -> Any:
    return _expr(s.node.expr) if isinstance(s, torch.SymInt) else int(s)


def _functions() -> dict[str, type]:
    """The formula heads an entry may hold, by module and name: sympy's arithmetic and the
    integer functions torch's ShapeEnv builds (FloorDiv, Min, Mod, ...)."""
    heads = [sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min, sympy.Mod, sympy.floor, sympy.ceiling, sympy.Abs]
    heads += [obj for obj in vars(sym_fns).values()
              if isinstance(obj, type) and issubclass(obj, sympy.Basic) and obj.__module__ == sym_fns.__name__]
    return {f"{c.__module__}.{c.__name__}": c for c in heads}


_FUNCTIONS = _functions()


def _expr(e: sympy.Expr) -> Any:
    if isinstance(e, sympy.Symbol):
        return {"s": e.name}
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Rational):
        return {"q": [int(e.p), int(e.q)]}
    name = f"{type(e).__module__}.{type(e).__name__}"
    if _FUNCTIONS.get(name) is not type(e):
        raise _Uncacheable(f"a size formula with {name}")
    return {"F": name, "a": [_expr(x) for x in e.args]}


def _graph_info(g: GraphInfo) -> dict[str, Any]:
    spare = GraphInfo(symbols={}, example_sizes={})
    for f in ("block_classes", "block_copies", "moe_regions", "passes_run", "mode_source"):
        if getattr(g, f) != getattr(spare, f):
            raise _Uncacheable(f"the graph record's {f} is set")
    try:
        specs = [None if s is None else pytree.treespec_dumps(s) for s in (g.in_spec, g.out_spec)]
    except Exception as exc:  # noqa: BLE001 - an input/output type without a serialized name
        raise _Uncacheable(f"input/output structure: {exc}") from None
    known = {f.name for f in fields(GraphInfo)}
    handled = {"symbols", "example_sizes", "export_symbols", "param_fqns", "buffer_fqns", "input_names",
               "module_types", "in_spec", "out_spec", "output_targets", "param_aliases", "input_constants",
               "constants", "transient_buffers", "without_cache", "block_classes", "block_copies", "moe_regions",
               "passes_run", "mode_source", "layer_run"}
    if known != handled:                    # a new GraphInfo field must be taught to the cache
        raise _Uncacheable(f"graph record fields {sorted(known ^ handled)} are not described")
    return {"symbols": sorted(g.symbols), "example_sizes": g.example_sizes,
            "export_symbols": {str(k): str(v) for k, v in g.export_symbols.items()},
            "param_fqns": g.param_fqns, "buffer_fqns": g.buffer_fqns, "input_names": g.input_names,
            "module_types": g.module_types, "specs": specs, "output_targets": [list(t) for t in g.output_targets],
            "param_aliases": g.param_aliases,
            "input_constants": [[i, _arg(v)] for i, v in g.input_constants.items()],
            "constants": {k: _tensor_bytes(t) for k, t in g.constants.items()},
            "transient_buffers": sorted(g.transient_buffers), "without_cache": g.without_cache,
            "layer_run": None if g.layer_run is None else list(g.layer_run)}


def _tensor_bytes(t: torch.Tensor) -> dict[str, Any]:
    if t.device.type == "meta" or t.is_complex() or t.numel() > (1 << 22):
        raise _Uncacheable("a lifted constant that is meta, complex or large")
    data = t.detach().cpu().contiguous()
    raw = data.view(torch.uint8).numpy().tobytes() if data.dtype != torch.bool else data.to(torch.uint8).numpy().tobytes()
    return {"d": str(t.dtype).replace("torch.", ""), "t": list(t.shape), "b": base64.b64encode(raw).decode()}


# ---- decoding ---------------------------------------------------------------------------

def decode(blob: bytes, key: str, signed: bytes = _PROCESS_SECRET) -> fx.GraphModule:
    """Rebuild the graph an entry describes (raises on anything unexpected). Nothing in the
    entry is read before its signature checks against ``signed``: an entry another user (or
    a file planted by anyone without this user's key) wrote is refused unread."""
    head, _, packed = blob.partition(b"\n")
    kind, _, digest = head.partition(b" ")
    if kind != b"hmac-sha256" or not hmac.compare_digest(digest, _mac(signed, packed).encode()):
        raise ValueError("not signed with this user's key (written by someone else, by an older autopar, "
                         "or damaged)")
    inflate = zlib.decompressobj()
    text = inflate.decompress(packed, _MAX_TEXT)
    if inflate.unconsumed_tail:
        raise ValueError(f"the description is over {_MAX_TEXT} bytes")
    body = json.loads(text)
    if body.get("format") != FORMAT or body.get("key") != key:
        raise ValueError("another format or key")
    return _Rebuild(body).graph_module()


_NODE_OPS = ("placeholder", "call_function", "output")


class _Rebuild:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.env, allow_non_fake_inputs=True)
        self.syms: dict[str, sympy.Symbol] = {}
        self.hints: dict[sympy.Symbol, int] = {}
        self.symints: dict[sympy.Expr, torch.SymInt] = {}
        self.vals: dict[str, Any] = {}
        for name, (hint, lo, hi) in body["symbols"].items():
            s = self.env.create_symbol(hint, source=ConstantSource(f"autopar_cache_{name}"),
                                       dynamic_dim=DimDynamic.DYNAMIC)
            if not isinstance(s, sympy.Symbol):
                raise ValueError(f"symbol {name} specialized to {s}")
            self.env.var_to_range[s] = ValueRanges(lo if lo is not None else -sympy.oo,
                                                   hi if hi is not None else sympy.oo)
            self.syms[name] = s
            self.hints[s] = hint

    def graph_module(self) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        nodes = self.body["nodes"]
        for entry in nodes:
            if not isinstance(entry, list) or len(entry) != 9 or entry[1] not in _NODE_OPS:
                raise ValueError("a node record of another form")
        targets = [self._target(entry[1], entry[2]) for entry in nodes]    # all checked before anything is built
        with self.mode:
            for (name, op, _, args, kwargs, val, trace, stack, rec), target in zip(nodes, targets):
                node = graph.create_node(op, target, self._arg(args, env), self._arg(kwargs, env), name=name)
                if node.name != name:
                    raise ValueError(f"node {name} renamed {node.name}")
                env[name] = node
                node.meta["val"] = self._shared_val(val)
                if trace is not None:
                    node.meta["stack_trace"] = trace
                if stack is not None:
                    node.meta["nn_module_stack"] = {k: (p, c) for k, p, c in stack}
                kind, fqn, mtype, tfqn, trainable = rec
                node.meta[META_KEY] = NodeInfo(kind=kind, fqn=fqn, module_type=mtype, target_fqn=tfqn,
                                               trainable=trainable)
        gm = graph_module(graph)
        gm.shape_env = self.env
        gm.meta[META_KEY] = self._graph_info(self.body["graph"])
        return gm

    def _target(self, op: str, t: Any) -> Any:
        if op in ("placeholder", "output"):
            return str(t)
        if not isinstance(t, list) or not t:
            raise ValueError(f"target {t!r} is outside the cache's vocabulary")
        kind, *path = t
        if kind == "op":
            if len(path) != 3 or not all(isinstance(x, str) and x.isidentifier() for x in path):
                raise ValueError(f"target {t!r} is outside the cache's vocabulary")
            ns, name, overload = path
            found = getattr(getattr(getattr(torch.ops, ns), name), overload)
            if not isinstance(found, torch._ops.OpOverload):
                raise ValueError(f"{ns}::{name}.{overload} is not an operator")
            return found
        if kind == "py" and len(path) == 2 and all(isinstance(x, str) for x in path) \
                and tuple(path) in VOCABULARY:
            return VOCABULARY[tuple(path)]
        raise ValueError(f"target {t!r} is outside the cache's vocabulary")

    def _arg(self, a: Any, env: dict[str, fx.Node]) -> Any:
        if a is None or isinstance(a, (bool, int, str)):
            return a
        if isinstance(a, list):
            raise ValueError("bare list in an entry")
        (tag, x), = a.items()
        if tag == "@":
            return env[x]
        if tag == "f":
            return float(x)
        if tag in ("L", "T"):
            items = [self._arg(i, env) for i in x]
            return items if tag == "L" else tuple(items)
        if tag == "D":
            return {k: self._arg(v, env) for k, v in x.items()}
        if tag == "device":
            return torch.device(x)
        found = getattr(torch, x, None)
        if tag == "dtype" and isinstance(found, torch.dtype) or tag == "layout" and isinstance(found, torch.layout) \
                or tag == "memory_format" and isinstance(found, torch.memory_format):
            return found
        raise ValueError(f"argument {a!r} is outside the cache's vocabulary")

    def _shared_val(self, v: Any) -> Any:
        """One fake value per distinct description: the layers of a deep model repeat the same
        few shapes, and nothing in autopar reads a value's identity or storage."""
        if v is None or isinstance(v, (bool, int)):
            return v
        key = json.dumps(v, separators=(",", ":"))
        got = self.vals.get(key)
        if got is None:
            got = self.vals[key] = self._val(v)
        return got

    def _val(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int)):
            return v
        if "t" in v:
            x = v["t"]
            dtype = getattr(torch, v["d"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype {v['d']!r}")
            t = torch.empty_strided([self._size(s) for s in x], [self._size(s) for s in v["s"]], dtype=dtype,
                                    device=torch.device(v["v"]))
            return t.requires_grad_(True) if v["g"] else t
        (tag, x), = v.items()
        if tag == "i":
            return self._symint(self._expr(x))
        if tag == "f":
            return float(x)
        if tag in ("L", "T"):
            items = [self._val(i) for i in x]
            return items if tag == "L" else tuple(items)
        raise ValueError(f"value {v!r} is outside the cache's vocabulary")

    def _size(self, s: Any) -> Any:
        return s if isinstance(s, int) else self._symint(self._expr(s))

    def _symint(self, e: sympy.Expr) -> Any:
        if isinstance(e, sympy.Integer):
            return int(e)
        got = self.symints.get(e)
        if got is None:
            got = self.symints[e] = self.env.create_symintnode(e, hint=int(e.xreplace(self.hints)))
        return got

    def _expr(self, e: Any) -> sympy.Expr:
        if isinstance(e, int):
            return sympy.Integer(e)
        (tag, x), = ((k, v) for k, v in e.items() if k != "a")
        if tag == "s":
            if x not in self.syms:
                raise ValueError(f"unknown symbol {x}")
            return self.syms[x]
        if tag == "q":
            return sympy.Rational(*x)
        if tag == "F" and x in _FUNCTIONS:
            return _FUNCTIONS[x](*[self._expr(a) for a in e["a"]])
        raise ValueError(f"formula {e!r} is outside the cache's vocabulary")

    def _graph_info(self, g: dict[str, Any]) -> GraphInfo:
        in_spec, out_spec = (None if s is None else pytree.treespec_loads(s) for s in g["specs"])
        return GraphInfo(
            symbols={name: symbol(name) for name in g["symbols"]}, example_sizes=dict(g["example_sizes"]),
            export_symbols={self.syms[k]: symbol(v) for k, v in g["export_symbols"].items()},
            param_fqns=dict(g["param_fqns"]), buffer_fqns=dict(g["buffer_fqns"]), input_names=list(g["input_names"]),
            module_types=dict(g["module_types"]), in_spec=in_spec, out_spec=out_spec,
            output_targets=[tuple(t) for t in g["output_targets"]], param_aliases=dict(g["param_aliases"]),
            input_constants={int(i): self._arg(v, {}) for i, v in g["input_constants"]},
            constants={k: _from_bytes(t) for k, t in g["constants"].items()},
            transient_buffers=set(g["transient_buffers"]), without_cache=bool(g["without_cache"]),
            layer_run=_layer_run(g.get("layer_run")))


def _layer_run(r: Any) -> tuple[str, int, int, int] | None:
    if r is None:
        return None
    prefix, n, start, period = r
    if not isinstance(prefix, str) or not all(type(x) is int for x in (n, start, period)):
        raise ValueError(f"layer run {r!r}")
    return prefix, n, start, period


def _from_bytes(t: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, t["d"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {t['d']!r}")
    raw = bytearray(base64.b64decode(t["b"]))
    if dtype == torch.bool:
        return torch.frombuffer(raw, dtype=torch.uint8).to(torch.bool).reshape(t["t"]).clone()
    return torch.frombuffer(raw, dtype=dtype).reshape(t["t"]).clone() if raw else torch.empty(t["t"], dtype=dtype)


__all__ = ["CaptureCache", "current", "decode", "default_directory", "encode", "load", "set_capture_cache",
           "store"]
