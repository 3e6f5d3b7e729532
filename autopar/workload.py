"""Turn a model name (zoo) or ``path/to/file.py:factory`` into a model and example inputs."""
from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


from torch import nn

from autopar.errors import ConfigError
from autopar.passes.capture import capture
from autopar.passes.pipeline import analyze

import torch.fx as fx


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, the inputs to capture it with, and the sizes to evaluate formulas at."""

    name: str
    model: nn.Module
    args: tuple
    dims: tuple[dict[int, str], ...] | None
    sizes: dict[str, int]            # where to evaluate (the user's --batch/--seq)
    max_sizes: dict[str, int]


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
    model = models.build(config, device=device)
    ex_seq = 8 if not max_seq else max(2, min(8, max_seq))
    args, dims = models.example_inputs(model, 2, ex_seq, device=device)
    used = {name for d in dims for name in d.values()}
    sizes = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in used}
    return Workload(name=spec, model=model, args=args, dims=dims, sizes=sizes,
                    max_sizes={"seq": max_seq} if max_seq else {})


def _user_workload(spec: str, *, batch: int, seq: int) -> Workload:
    """``factory(batch=, seq=)`` returns a model, (model, inputs) or (model, inputs, dims)."""
    path_str, factory_name = spec.rsplit(":", 1)
    path = Path(path_str)
    if not path.is_file():
        raise ConfigError(f"model file {path_str!r} not found", where=spec,
                          fix="pass --model path/to/file.py:factory with an existing file")
    mod_spec = importlib.util.spec_from_file_location(f"autopar_user_{path.stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = module
    mod_spec.loader.exec_module(module)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"{path_str} has no callable {factory_name!r}", where=spec,
                          fix=f"define def {factory_name}(batch, seq): return model, example_inputs")
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    made = factory(**kwargs)
    model, args, dims = (made, None, None) if isinstance(made, nn.Module) else (tuple(made) + (None,))[:3]
    if args is None:
        raise ConfigError(f"{factory_name} returned only a model; autopar needs example inputs to capture it",
                          where=spec, fix=f"return (model, example_inputs) from {factory_name}")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    sizes: dict[str, int] = {}
    if dims:
        used = {name for d in dims for name in d.values()}
        sizes = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in used}
    return Workload(name=spec, model=model, args=args, dims=tuple(dims) if dims else None,
                    sizes=sizes, max_sizes={})


def capture_workload(w: Workload) -> fx.GraphModule:
    """Capture and analyse a workload."""
    gm = capture(w.model, w.args, dims=w.dims, max_sizes=w.max_sizes)
    return analyze(gm)


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set takes key=value, got {item!r}", got=item, fix="e.g. --set hidden=2304")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


