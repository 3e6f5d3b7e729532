"""Helpers the capture and analysis passes share: node naming and a pause of the cyclic
garbage collector. The node metadata record itself is :mod:`autopar.core.meta`."""
from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from typing import Iterator

import torch.fx as fx


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
