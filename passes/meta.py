"""Helpers the capture and analysis passes share: node naming, a pause of the cyclic garbage
collector, and a model's inference-cache switch (a training graph has no cache). The node
metadata record itself is :mod:`autopar.core.meta`."""
from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from typing import Any, Iterator

import torch.fx as fx
from torch import nn


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while the block runs: capture and analysis allocate many
    small objects that all live on, so the collector's scans of them are wasted (a third of
    a 32-layer model's set-up)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_NUMBERED = re.compile(r"^(.*?)(?:_(\d+))?$")


def name_stem(name: str) -> str:
    """``linear_12`` -> ``linear``."""
    return _NUMBERED.match(name).group(1)


def _reserved(name: str) -> bool:
    import builtins
    import keyword
    from torch.fx import graph as fx_graph
    return keyword.iskeyword(name) or hasattr(builtins, name) or name in getattr(fx_graph, "_illegal_names", {})


def number_ops(gm: fx.GraphModule | fx.Graph) -> bool:
    """Name the op nodes ``<stem>``, ``<stem>_1``, ... per stem in graph order (the stem is
    export's: ``linear``, ``sym_size_int``). Export numbers nodes as it traces, dropped ones
    included, so its numbers depend on how deep the model is; these depend only on the graph.
    False (names left as they are) if a new name would be a placeholder's."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    ops = [n for n in graph.nodes if n.op == "call_function"]
    count: dict[str, int] = {}
    names = []
    for n in ops:
        stem = name_stem(n.name)
        k = count.get(stem, 1 if _reserved(stem) else 0)    # never a bare builtin's name (``slice``)
        count[stem] = k + 1
        names.append(f"{stem}_{k}" if k else stem)
    if {n.name for n in graph.nodes if n.op != "call_function"} & set(names):
        return False
    space = graph._graph_namespace         # set directly: the namespace still holds dropped nodes' names
    for n, name in zip(ops, names):
        n.name = name
        space._used_names.add(name)
        space._obj_to_name[n] = name
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    return True


def cache_configs(model: nn.Module) -> list[Any]:
    """The distinct configs with ``use_cache`` on, of the model and its submodules (an
    encoder-decoder keeps a copy per stack)."""
    out: dict[int, Any] = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if getattr(cfg, "use_cache", False) is True:
            out.setdefault(id(cfg), cfg)
    return list(out.values())


def uses_cache(model: nn.Module) -> bool:
    """Does the model keep an inference cache it would return (``config.use_cache``)?"""
    return bool(cache_configs(model))


@contextmanager
def training_config(model: nn.Module) -> Iterator[None]:
    """``config.use_cache`` off while the model is traced: a training graph has no cache."""
    configs = cache_configs(model)
    for cfg in configs:
        cfg.use_cache = False
    try:
        yield
    finally:
        for cfg in configs:
            cfg.use_cache = True
