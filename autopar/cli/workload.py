"""Turn a model name (zoo) or ``path/to/file.py:factory`` into a model and example inputs, and
capture it: whole (:func:`capture_workload`), or with fewer layers for the planner's simulator
(:func:`capture_for_planning`)."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import math
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch import nn

from autopar.core.errors import ConfigError
from autopar.passes.capture import capture
from autopar.core.meta import BlockClass, graph_info
from autopar.passes.pipeline import analyze

if TYPE_CHECKING:
    from autopar.models.depth import Shrunk

log = logging.getLogger("autopar.cli.workload")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, the inputs to capture it with, and the sizes to evaluate formulas at."""

    name: str
    model: nn.Module
    args: tuple
    dims: tuple[dict[int, str], ...] | None
    sizes: dict[str, int]            # where to evaluate (the user's --batch/--seq)
    max_sizes: dict[str, int]
    config: Any = None               # the zoo or hf: config the model was built from (None: a user model)


def load_workload(spec: str, *, batch: int, seq: int, overrides: Mapping[str, str] | None = None,
                  device: str = "meta") -> Workload:
    """A zoo name (``gpt3-175b``) or ``file.py:factory``. Zoo models are captured at small
    example sizes with symbolic batch/seq and evaluated at ``batch``/``seq``."""
    if batch < 1 or seq < 1:
        raise ConfigError("batch and seq must be positive", got=f"batch={batch}, seq={seq}",
                          fix="pass --batch and --seq of at least 1")
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        return _user_workload(spec, batch=batch, seq=seq)
    from autopar import models
    config = models.get_config(spec, overrides)
    max_seq = int(getattr(config, "max_seq", 0) or 0)
    if max_seq and seq > max_seq:
        raise ConfigError(f"--seq {seq} is longer than {spec}'s max_seq {max_seq}", got=str(seq),
                          fix=f"use --seq <= {max_seq} or --set max_seq={seq}")
    model, args, dims = _built(config, device)
    used = {name for d in dims for name in d.values()}
    sizes = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in used}
    return Workload(name=spec, model=model, args=args, dims=dims, sizes=sizes,
                    max_sizes={"seq": max_seq} if max_seq else {}, config=config)


def _built(config: Any, device: Any) -> tuple[nn.Module, tuple, tuple[dict[int, str], ...]]:
    """A zoo or ``hf:`` config's model on ``device`` and its example inputs (batch 2, seq up to 8:
    small, symbolic sizes)."""
    from autopar import models
    model = models.build(config, device=device)
    max_seq = int(getattr(config, "max_seq", 0) or 0)
    ex_seq = 8 if not max_seq else max(2, min(8, max_seq))
    args, dims = models.example_inputs(model, 2, ex_seq, device=device)
    return model, args, dims


def _user_workload(spec: str, *, batch: int, seq: int) -> Workload:
    """``factory(batch=, seq=)`` returns a model, (model, inputs) or (model, inputs, dims)."""
    path_str, factory_name = spec.rsplit(":", 1)
    path = Path(path_str)
    if not path.is_file():
        raise ConfigError(f"model file {path_str!r} not found", where=spec,
                          fix="pass --model path/to/file.py:factory with an existing file")
    module = _import_user_file(path, spec)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"{path_str} has no callable {factory_name!r}", where=spec,
                          fix=f"define def {factory_name}(batch, seq): return model, example_inputs")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):        # a builtin or C callable: pass nothing
        params = {}
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    with _user_code(spec, path, f"calling {factory_name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"):
        made = factory(**kwargs)
    model, args, dims = _unpacked(made, spec, factory_name)
    if args is None:
        raise ConfigError(f"{factory_name} returned only a model; autopar needs example inputs to capture it",
                          where=spec, fix=f"return (model, example_inputs) from {factory_name}")
    if dims is not None and (not isinstance(dims, (tuple, list)) or not all(isinstance(d, dict) for d in dims)):
        raise ConfigError(f"{factory_name}'s dims are not one {{dim: name}} dict per input", where=spec,
                          got=repr(dims)[:80], fix='e.g. ({0: "batch", 1: "seq"},) for one [batch, seq] input')
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    sizes: dict[str, int] = {}
    if dims:
        used = {name for d in dims for name in d.values()}
        sizes = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in used}
    return Workload(name=spec, model=model, args=args, dims=tuple(dims) if dims else None,
                    sizes=sizes, max_sizes={})


def _import_user_file(path: Path, spec: str) -> Any:
    """Run the user's model file as a module; its errors (a syntax error, an exception, even
    ``sys.exit``) become ConfigErrors naming the file and line."""
    mod_spec = importlib.util.spec_from_file_location(f"autopar_user_{path.stem}", path)
    if mod_spec is None or mod_spec.loader is None:
        raise ConfigError(f"cannot load {path} as Python", where=spec, fix="pass a .py file: --model file.py:factory")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = module
    try:
        with _user_code(spec, path, "importing it"):
            mod_spec.loader.exec_module(module)
    except ConfigError:
        sys.modules.pop(mod_spec.name, None)
        raise
    return module


@contextlib.contextmanager
def _user_code(spec: str, path: Path, doing: str):
    """Turn whatever the user's code raises while ``doing`` into a ConfigError at its line
    (KeyboardInterrupt excepted: Ctrl-C still stops autopar)."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except SyntaxError as exc:
        raise ConfigError(f"the model file has a syntax error: {exc.msg}", where=f"{exc.filename}:{exc.lineno}",
                          got=(exc.text or "").strip()[:120] or None,
                          fix="fix the syntax error (python -m py_compile FILE shows it)") from exc
    except (Exception, SystemExit) as exc:   # noqa: BLE001 - the user's code: any failure is theirs
        line = next((f"{f.filename}:{f.lineno}" for f in reversed(traceback.extract_tb(exc.__traceback__))
                     if Path(f.filename).resolve() == path.resolve()), str(path))
        what = (f"the model file called sys.exit({exc.code!r}) while {doing}" if isinstance(exc, SystemExit)
                else f"the model file raised {type(exc).__name__} while {doing}: {exc}")
        raise ConfigError(what[:500], where=f"{spec} ({line})",
                          fix="make the factory return (model, example_inputs) without exiting or raising"
                          if isinstance(exc, SystemExit) else f"fix the error at {line}") from exc


def _unpacked(made: Any, spec: str, factory_name: str) -> tuple[nn.Module, Any, Any]:
    """``(model, args, dims)`` from what the factory returned: a model, or (model, inputs[, dims])."""
    if isinstance(made, nn.Module):
        return made, None, None
    parts = tuple(made) if isinstance(made, (tuple, list)) else None
    if not parts or len(parts) > 3 or not isinstance(parts[0], nn.Module):
        got = f"{type(made).__name__} {repr(made)[:60]}" if parts is None else \
            f"a {len(parts)}-item {type(made).__name__} starting with {type(parts[0]).__name__ if parts else 'nothing'}"
        raise ConfigError(f"{factory_name} did not return a model", where=spec,
                          expected="an nn.Module, or (model, example_inputs[, dims]) with model an nn.Module",
                          got=got, fix=f"return (model, example_inputs) from {factory_name}")
    return (parts + (None, None))[:3]


def capture_workload(w: Workload) -> fx.GraphModule:
    """Capture and analyse a workload."""
    gm = capture(w.model, w.args, dims=w.dims, max_sizes=w.max_sizes)
    return analyze(gm)


@dataclass(frozen=True)
class PlanningCapture:
    """A graph for the planner's simulator (:class:`~autopar.cost.hybrid.ModelFacts`).

    ``block_copies`` is the real model's number of copies of the graph's main (largest) block
    class when the graph holds fewer (pass it as ``ModelFacts(gm, ..., layers=block_copies)``),
    None when the graph is the whole model; ``layers`` / ``captured_layers``: the model's layers
    and how many of them the graph holds (None for a model without a layer count)."""

    gm: fx.GraphModule
    block_copies: int | None
    layers: int | None
    captured_layers: int | None

    def describe(self) -> str:
        """``4 of 126 layers, 310 nodes`` (or ``126 layers, ...``, or ``... nodes``) for progress lines."""
        nodes = f"{len(self.gm.graph.nodes)} nodes"
        if self.layers is None:
            return nodes
        if self.captured_layers == self.layers:
            return f"{self.layers} layers, {nodes}"
        return f"{self.captured_layers} of {self.layers} layers, {nodes}"


def capture_for_planning(w: Workload) -> PlanningCapture:
    """The workload captured for the planner's simulator: with fewer layers where that leaves
    its figures as the whole model's, else whole.

    A zoo or ``hf:`` transformer is built with its periodic run of layers cut to two periods
    (:func:`autopar.models.depth.shrink`; the layers before and after the run, and the model's
    ``--set`` overrides, as they are) and captured. The capture is used when its main block
    class is the kept run's layers (with, at most, layers kept as they are), and that class is
    also the main one of the whole model at its real count: then the parts before and after the
    class are the whole model's and every per-block figure is one copy's, so only the count
    differs (``GraphInfo.block_copies`` gives the tensor-axis solver the real count too). If
    the run's class would lose its place to other classes (deepseek-v3 with many dense layers),
    the run is kept longer once. Otherwise, and for a ``file.py:factory`` model, the whole model."""
    from autopar.models.depth import layer_count, shrink

    layers = layer_count(w.config) if w.config is not None else None
    periods = 2
    for _ in range(2):
        shrunk = shrink(w.config, periods) if layers else None
        if shrunk is None:
            break
        model, args, dims = _built(shrunk.config, w.args[0].device if w.args else "meta")
        small = dataclasses.replace(w, model=model, args=args, dims=dims, config=shrunk.config)
        gm = capture_workload(small)
        cls, copies, periods = _main_class(gm, model, shrunk)
        if cls is not None:
            graph_info(gm).block_copies = {cls.id: copies}
            log.info("captured %d of %d layers: %d copies of %s", len(shrunk.indices), layers, copies,
                     cls.module_type or cls.members[0])
            return PlanningCapture(gm=gm, block_copies=copies, layers=layers, captured_layers=len(shrunk.indices))
        if not periods:
            break
    log.info("capturing every layer of %s", w.name)
    return PlanningCapture(gm=capture_workload(w), block_copies=None, layers=layers, captured_layers=layers)


def _main_class(gm: fx.GraphModule, model: nn.Module, shrunk: Shrunk) -> tuple[BlockClass | None, int, int]:
    """``(class, real copies, 0)`` when the cut graph's main block class stands for the real
    model's (:func:`capture_for_planning`); ``(None, 0, periods)`` when the run needs ``periods``
    periods to stay the main class; ``(None, 0, 0)`` when cutting cannot work."""
    classes = graph_info(gm).block_classes
    product = {c.id: len(c.members) * c.nodes_per_member for c in classes}
    for fqns in _layer_lists(model, len(shrunk.indices)):
        run = set(fqns[shrunk.run_start:shrunk.run_start + shrunk.run_kept])
        cls = next((c for c in classes if run <= set(c.members)), None)
        if cls is None or not set(cls.members) <= set(fqns):
            continue
        outside = len(cls.members) - shrunk.run_kept        # kept layers in the class: the real model's
        copies = outside + shrunk.run_layers
        top = max((product[c.id] for c in classes if c is not cls), default=0)
        if copies * cls.nodes_per_member <= top:
            return None, 0, 0                                # not the real model's main class either
        if max(classes, key=lambda c: product[c.id]) is cls:
            return cls, copies, 0
        need = top // cls.nodes_per_member + 1 - outside     # run layers that make it the main class
        rem = shrunk.run_layers % shrunk.period
        return None, 0, max(1, math.ceil((need - rem) / shrunk.period))
    return None, 0, 0


def _layer_lists(model: nn.Module, n: int) -> list[list[str]]:
    """The module paths of every ``ModuleList`` of ``n`` modules (the layers among them)."""
    return [[f"{name}.{i}" for i in range(n)] for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) == n]


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set takes key=value, got {item!r}", got=item, fix="e.g. --set hidden=2304")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


