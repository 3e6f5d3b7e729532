"""The module :func:`autopar.parallelize` returns: one rank's share of the model.

It stores this rank's slice of every parameter under the original ``state_dict`` key,
runs the rewritten graph on the original inputs and returns the original (replicated)
outputs. ``state_dict()`` gives DTensors for split parameters (whole values on demand
with ``.full_tensor()``) and plain tensors for replicated ones; ``load_state_dict``
accepts whole tensors or DTensors and keeps this rank's slice.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.utils import _pytree as pytree

from autopar.errors import InputMismatchError
from autopar.passes.meta import evaluate, graph_info, info
from autopar.placement import Shard, parse


class ParallelModule(nn.Module):
    """One rank's share of a model parallelized by autopar (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, placements: dict[str, str], tensors: dict[str, torch.Tensor],
                 trainable: dict[str, bool], mesh: DeviceMesh, plan: Any, dims: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self._graph = [gm]                       # not a submodule: keeps state_dict keys original
        self._mesh = mesh
        self.plan = plan
        self._placements = {k: parse(v) for k, v in placements.items()}
        self._dims = dims                        # symbol -> (input index, dim)
        self._rank = mesh.get_local_rank(0)
        self._n = mesh.size(0)
        ginfo = graph_info(gm)
        for fqn, full in tensors.items():
            local = self._local(fqn, full)
            if fqn in ginfo.param_fqns.values():
                _set(self, fqn, nn.Parameter(local, requires_grad=trainable.get(fqn, True)))
            else:
                _set(self, fqn, local, buffer=True)
        self._order = [(n.op, info(n).kind, info(n).target_fqn) for n in gm.graph.nodes if n.op == "placeholder"]
        self._split_sizes = _split_sizes(gm)
        self._register_state_dict_hook(_to_dtensors)
        self._register_load_state_dict_pre_hook(self._from_whole)

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._graph[0]

    def placement_of(self, fqn: str):
        return self._placements.get(fqn)

    def _local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        p = self._placements.get(fqn)
        if isinstance(p, Shard):
            return full.detach().chunk(self._n, p.dim)[self._rank].clone().contiguous()
        return full.detach().clone()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gm = self.graph_module
        ginfo = graph_info(gm)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if ginfo.in_spec is not None and spec != ginfo.in_spec:
            raise InputMismatchError("inputs do not have the structure the model was captured with",
                                     where=type(self).__name__, expected=str(ginfo.in_spec), got=str(spec),
                                     fix="call the parallel model exactly as the original one was called in "
                                         "example_inputs")
        self._check_sizes(flat)
        state = dict(self.named_parameters())
        state.update(dict(self.named_buffers()))
        inputs = iter(flat)
        call = [state[fqn] if kind in ("param", "buffer") else next(inputs) for _, kind, fqn in self._order]
        outs = gm(*call)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        user = []
        for (kind, target), value in zip(ginfo.output_targets, outs):
            if kind == "BUFFER_MUTATION" and target in state:
                with torch.no_grad():
                    state[target].copy_(value)
            else:
                user.append(value)
        return pytree.tree_unflatten(user, ginfo.out_spec) if ginfo.out_spec is not None else tuple(user)

    def _check_sizes(self, flat: list) -> None:
        """Dims the plan splits must divide by the axis size at the sizes given now."""
        if not self._split_sizes:
            return
        sizes = {}
        for name, (i, d) in self._dims.items():
            if i < len(flat) and isinstance(flat[i], torch.Tensor) and d < flat[i].dim():
                sizes[name] = int(flat[i].shape[d])
        for expr, where in self._split_sizes:
            if expr.free_symbols and all(str(s) in sizes for s in expr.free_symbols):
                value = evaluate(expr, sizes)
                if value % self._n:
                    raise InputMismatchError(
                        f"a dim the plan splits {self._n} ways has size {value} here", where=where,
                        expected=f"a multiple of {self._n} ({expr})", got=str(sizes),
                        fix=f"pad the inputs so {expr} divides by {self._n}, or plan with these sizes")

    def _from_whole(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for key in list(state_dict):
            fqn = key[len(prefix):]
            value = state_dict[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            p = self._placements.get(fqn)
            if isinstance(p, Shard) and isinstance(value, torch.Tensor):
                mine = dict(self.named_parameters()).get(fqn)
                if mine is not None and value.shape != mine.shape:
                    state_dict[key] = self._local(fqn, value)
            elif isinstance(value, torch.Tensor):
                state_dict[key] = value


def _to_dtensors(module: ParallelModule, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    for key in list(state_dict):
        p = module._placements.get(key[len(prefix):])
        if isinstance(p, Shard):
            state_dict[key] = DTensor.from_local(state_dict[key], module._mesh, [DShard(p.dim)], run_check=False)
    return state_dict


def _split_sizes(gm: fx.GraphModule) -> list[tuple[sympy.Expr, str]]:
    out, seen = [], set()
    for node in gm.graph.nodes:
        rec = info(node) if "autopar" in node.meta else None
        if rec is None or not rec.placement or not rec.values:
            continue
        first = rec.placement.split(",")[0].split("/")[0]
        if first.startswith("S("):
            dim = int(first[2:-1])
            expr = sympy.sympify(rec.values[0].shape[dim])
            if expr.free_symbols and expr not in seen:
                seen.add(expr)
                out.append((expr, f"node {node.name} ({rec.fqn or '<root>'})"))
    return out


def _set(root: nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool = False) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if buffer:
        mod.register_buffer(leaf, value)
    else:
        mod.register_parameter(leaf, value)


__all__ = ["ParallelModule", "DReplicate"]
