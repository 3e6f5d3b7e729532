"""The module :func:`autopar.parallelize` returns: one rank's share of the model.

It stores this rank's slice of every parameter under the original ``state_dict`` key,
runs the rewritten graph on the original inputs and returns the original (replicated)
outputs. ``state_dict()`` gives DTensors for split parameters (whole values on demand
with ``.full_tensor()``) and plain tensors for replicated ones; ``load_state_dict``
accepts whole tensors or DTensors and keeps this rank's slice.

Under data parallelism each data-axis rank is called with its own share of the batch
(as with DDP); gradients are averaged over the data axis. Under ZeRO-3 a parameter is
stored as this rank's flat piece (``runtime.dp``); ``state_dict()`` still returns the
whole tensor-axis-local value under the original key.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.utils import _pytree as pytree

from autopar.core.errors import InputMismatchError
from autopar.runtime import token_loss
from autopar.runtime.dp import DPRuntime, row_count_issue, row_weight, shard_range
from autopar.runtime.health import note_step, peer_errors
from autopar.runtime.ep import owned_rows, whole_experts
from autopar.core.mesh import names as mesh_names
from autopar.core.meta import evaluate, graph_info, info, ready
from autopar.core.placement import Shard, parse
from autopar.runtime.collectives import all_gather_start, all_gather_wait, c10d


class ParallelModule(nn.Module):
    """One rank's share of a model parallelized by autopar (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, placements: dict[str, str], tensors: dict[str, torch.Tensor],
                 trainable: dict[str, bool], mesh: DeviceMesh, plan: Any, dims: dict[str, tuple[int, int]],
                 dp: DPRuntime | Sequence[DPRuntime] | None = None) -> None:
        super().__init__()
        self._graph = [gm]                       # not a submodule: keeps state_dict keys original
        self._mesh = mesh
        self.plan = plan
        self._placements = {k: parse(v) for k, v in placements.items()}
        self._dims = dims                        # symbol -> (input index, dim)
        names = list(mesh_names(mesh))
        self._tp_dim = names.index(plan.tp_axis) if plan.tp_axis in names else None
        self._dp_dim = names.index(plan.dp_axis) if plan.dp_axis in names else None
        self._rank = mesh.get_local_rank(self._tp_dim) if self._tp_dim is not None else 0
        self._n = mesh.size(self._tp_dim) if self._tp_dim is not None else 1
        # the data axes' runtimes (several with experts: dense on dp x ep, experts on dp); not submodules
        self._dps = [dp] if isinstance(dp, DPRuntime) else list(dp or ())
        self._rt_of = {fqn: rt for rt in self._dps for fqn in rt.where}
        self._master_init: dict[str, torch.Tensor] = {}
        # how long state_dict() under ZeRO-3 waits for the other data-axis ranks before raising
        self.collective_wait_s = 60.0
        self.expert_rows: dict[str, Any] = {}    # expert fqn -> its EPRuntime, for stacked experts split by rows
        # a ModuleList of experts (this rank holds its own members) -> (its EPRuntime, each member's parameter names)
        self.expert_modules: dict[str, tuple[Any, tuple[str, ...]]] = {}
        ginfo = graph_info(gm)
        first = self._dps[0] if self._dps else None
        params = set(ginfo.param_fqns.values())
        for fqn, full in tensors.items():
            local = self._local(fqn, full)
            if fqn in params:
                rt = self._rt_of.get(fqn)
                if rt is not None and rt.stage == 3:
                    local = self._piece(local, rt)
                elif first is not None and first.mixed:
                    self._master_init[fqn] = local            # taken by the optimizer as its fp32 master
                    local = local.to(first.compute_dtype)
                p = nn.Parameter(local, requires_grad=trainable.get(fqn, True))
                set_tensor(self, fqn, p)
                if rt is not None and rt.stage == 3:
                    rt.shard_params[fqn] = p
            else:
                set_tensor(self, fqn, local, buffer=True, persistent=fqn not in ginfo.transient_buffers)
        for name, value in ginfo.constants.items():
            set_tensor(self, name, value.clone(), buffer=True, persistent=False)
        self._aliases = dict(ginfo.param_aliases)   # a tied name -> the name the graph uses
        for alias, name in self._aliases.items():
            if name in tensors:                      # the same Parameter under both names, as in the model
                set_tensor(self, alias, _get(self, name), buffer=name not in params)
                if name in self._placements:
                    self._placements[alias] = self._placements[name]
        self._order = [(n.op, info(n).kind, info(n).target_fqn) for n in gm.graph.nodes if n.op == "placeholder"]
        self._split_sizes = _split_sizes(gm)
        self._inputs = _input_specs(gm)
        self._register_state_dict_hook(_to_dtensors)
        self._register_load_state_dict_pre_hook(self._from_whole)
        widest = max(self._dps, key=lambda r: r.n, default=None)
        # a token-mean loss the model returns: over the global batch's real tokens (runtime/token_loss.py)
        self._token_losses = token_loss.prepare(gm) if widest is not None and widest.n > 1 else []
        ready(gm)                                # its code, generated once here rather than at the first step

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._graph[0]

    def train(self, mode: bool = True) -> "ParallelModule":
        """Switch the graph to ``mode`` as the original model would (dropout, BatchNorm, any
        op whose arguments depend on ``self.training``; autopar/build/modes.py), then the module."""
        source = graph_info(self.graph_module).mode_source
        if source is not None:
            source.switch([self.graph_module], mode, "ParallelModule.train")
        return super().train(mode)

    @property
    def dp_runtime(self) -> DPRuntime | None:
        """The (first) data axis's runtime, or None without a data axis."""
        return self._dps[0] if self._dps else None

    @property
    def dp_runtimes(self) -> list[DPRuntime]:
        return list(self._dps)

    @property
    def zero3(self) -> bool:
        return any(rt.stage == 3 for rt in self._dps)

    @property
    def dp_rank(self) -> int:
        """This rank's index on the data axis: which share of the batch it should be called with."""
        return self._mesh.get_local_rank(self._dp_dim) if self._dp_dim is not None else 0

    @property
    def dp_size(self) -> int:
        return self._mesh.size(self._dp_dim) if self._dp_dim is not None else 1

    def _piece(self, local: torch.Tensor, rt: DPRuntime) -> torch.Tensor:
        """This data-axis rank's flat, zero-padded piece of a tensor-axis-local value (ZeRO-3)."""
        flat = local.detach().reshape(-1)
        lo, hi = shard_range(flat.numel(), rt.n, rt.rank)
        out = flat.new_zeros(math.ceil(flat.numel() / rt.n))
        out[:hi - lo] = flat[lo:hi]
        return out

    def _whole_local(self, fqn: str, piece: torch.Tensor) -> torch.Tensor:
        """Gather a ZeRO-3 piece back into the tensor-axis-local value (a collective on the data axis)."""
        rt = self._rt_of[fqn]
        b, i = rt.where[fqn]
        bucket = rt.buckets[b]
        got = all_gather_wait(all_gather_start(piece.detach().contiguous(), rt.n, rt.group_name))
        return got.view(-1)[:bucket.numels[i]].view(bucket.shapes[i]).clone()

    def placement_of(self, fqn: str):
        return self._placements.get(fqn)

    def _local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a model tensor: a copy of its piece when split (so the whole one
        can be freed), else the model's own storage, as DDP keeps it: training this module
        updates the model's replicated parameters and buffers in place, and nothing is copied."""
        p = self._placements.get(fqn)
        if isinstance(p, Shard):
            return full.detach().chunk(self._n, p.dim)[self._rank].clone().contiguous()
        return full.detach()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        note_step()
        with peer_errors():
            return self._forward(args, kwargs)

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        gm = self.graph_module
        ginfo = graph_info(gm)
        flat = self._flatten(ginfo, args, kwargs)
        self._check_like_example(flat)
        self._check_sizes(flat)
        state = dict(self.named_parameters(remove_duplicate=False))
        state.update(dict(self.named_buffers(remove_duplicate=False)))
        inputs = iter(flat)
        call = [state[fqn] if kind in ("param", "buffer", "constant") else next(inputs) for _, kind, fqn in self._order]
        counting = self._row_count(flat)      # the ranks' rows, summed while forward runs
        with contextlib.ExitStack() as stack:
            for rt in self._dps:          # ZeRO-3: whole parameters autograd saves become tokens
                stack.enter_context(rt.saving())
            if self._dps and self._dps[0].mixed:
                stack.enter_context(torch.autocast(self._dps[0].device.type, dtype=self._dps[0].compute_dtype))
            outs = self._run(gm, call)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        weight = row_weight(counting[0], counting[1], counting[2]) if counting is not None else None
        losses = {}
        for pos, at in self._token_losses:
            if at is None:                # a sum-reduced loss
                if counting is not None:
                    losses[pos] = token_loss.global_sum(outs[pos], counting[1].data_n, counting[1].data_group)
            else:
                losses[pos] = (token_loss.global_mean(outs[pos], outs[at], counting[1].data_n, counting[1].data_group)
                               if counting is not None else token_loss.local_mean(outs[pos], outs[at]))
        counts = [at for _, at in self._token_losses if at is not None]
        if counts:
            outs = outs[:min(counts)]
        if weight is not None:
            outs = [o if i in losses else _weighted(o, weight) for i, o in enumerate(outs)]
        for pos, value in losses.items():
            outs[pos] = value
        user = []
        for (kind, target), value in zip(ginfo.output_targets, outs):
            if kind == "BUFFER_MUTATION" and target in state:
                with torch.no_grad():
                    state[target].copy_(value)
            else:
                user.append(value)
        return pytree.tree_unflatten(user, ginfo.out_spec) if ginfo.out_spec is not None else tuple(user)

    def _row_count(self, flat: list) -> tuple | None:
        """Uneven shares of the batch: the data axis averages gradients over ranks, which is the
        mean over rows only when every rank has as many. Each rank's gradients are weighted by
        ``rows * ranks / total rows`` (applied to the gradients reaching its outputs), so the
        average is the global batch's mean, as one process computes it. Returns (rows, runtime,
        the pending sum of rows) for :func:`~autopar.runtime.dp.row_weight` after forward; None
        without a data axis or gradients."""
        rt = max(self._dps, key=lambda r: r.data_n, default=None)
        if rt is None or rt.data_n == 1 or not torch.is_grad_enabled():
            return None
        where = self._dims.get("batch")
        if where is not None and where[0] < len(flat) and isinstance(flat[where[0]], torch.Tensor):
            rows = flat[where[0]].shape[where[1]]
        else:
            rows = next((t.shape[0] for t in flat if isinstance(t, torch.Tensor) and t.dim()), 1)
        return rows, rt, row_count_issue(rows, rt)

    def _flatten(self, ginfo: Any, args: tuple, kwargs: dict) -> list:
        """The call's leaves in the order the graph takes them: keyword inputs in the captured
        order (whatever order they come in), ``None`` ones dropped as at capture, and the
        non-tensor ones checked against the values the graph was specialised for."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        spec = ginfo.in_spec
        captured = list(spec.child(1).context) if spec is not None and spec.num_children == 2 else []
        if set(kwargs) == set(captured):
            kwargs = {k: kwargs[k] for k in captured}
        flat, got = pytree.tree_flatten((args, kwargs))
        if spec is not None and got != spec:
            names = f"keywords {captured}" if captured else "positional inputs only"
            raise InputMismatchError("inputs do not have the structure the model was captured with",
                                     where=type(self).__name__,
                                     expected=f"{spec.child(0).num_children} positional input(s), {names}",
                                     got=f"{len(args)} positional input(s), keywords {sorted(kwargs)}",
                                     fix="call the parallel model with the inputs it was parallelized with "
                                         "(example_inputs positionally, example_kwargs by name)")
        for i, value in ginfo.input_constants.items():
            if i < len(flat) and flat[i] != value:
                raise InputMismatchError(f"input {i} is {flat[i]!r}, but the graph was captured with {value!r}",
                                         where=f"{type(self).__name__}.forward, input {i}", expected=repr(value),
                                         got=repr(flat[i]), fix="pass the value the model was parallelized with, "
                                                                "or parallelize again with this one")
        return flat

    def _run(self, gm: fx.GraphModule, call: list) -> Any:
        """The graph, with the recomputation regions checkpointed (runtime/recompute.py); under
        ZeRO-3 the regions take the gathered whole parameters as tokens and gather them again
        when backward recomputes them."""
        where = getattr(self, "_recompute", None)
        compiled = getattr(self, "_compiled", None)
        if not where or (compiled is not None and getattr(self, "recompute", "none") == "none"):
            return compiled(*call) if compiled is not None else gm(*call)     # compiled: the compiler's own saved set
        from autopar.runtime.recompute import run
        return run(gm, call, where, [rt for rt in self._dps if rt.stage == 3], getattr(self, "recompute", "full"))

    def set_compile(self, backend: str | None) -> None:
        """Run the graph through ``torch.compile`` with ``backend`` (None: eagerly); see
        runtime/compiled.py."""
        from autopar.runtime.compiled import compile_graph
        self._compiled = compile_graph(self.graph_module, backend) if backend else None
        self.compiled = backend

    def set_recompute(self, mode: str, where: dict | None = None) -> None:
        """``none``, ``selective`` (attention cores), ``pointwise`` (every layer but its matmuls
        and attention), ``layers:K`` or ``full`` (every layer) recomputation;
        ``where`` (node -> region) when the regions were already found (the build's recompute step)."""
        from autopar.runtime.recompute import regions
        self._recompute = regions(self.graph_module, mode) if where is None else where
        self.recompute = mode

    def _check_like_example(self, flat: list) -> None:
        """Each tensor input has the example's dtype, rank and fixed sizes (symbolic ones may vary)."""
        for i, (x, want) in enumerate(zip(flat, self._inputs)):
            if want is None or not isinstance(x, torch.Tensor):
                continue
            dtype, shape = want
            if x.dtype == dtype and x.dim() == len(shape) and all(d is None or d == n for d, n in zip(shape, x.shape)):
                continue
            shown = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
            raise InputMismatchError(f"input {i} does not match the example the model was parallelized with",
                                     where=f"{type(self).__name__}.forward, input {i}",
                                     expected=f"{str(dtype).replace('torch.', '')} {shown} (* may vary)",
                                     got=f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}",
                                     fix="call the parallel model with inputs shaped like example_inputs, or "
                                         "parallelize again with these inputs")

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
        for name, (ep, suffixes) in self.expert_modules.items():   # the other ranks' expert members
            for e in set(range(ep.experts)) - set(ep.owned()):
                for suffix in suffixes:
                    state_dict.pop(f"{prefix}{name}.{e}.{suffix}", None)
        for key in list(state_dict):
            fqn = self._aliases.get(key[len(prefix):], key[len(prefix):])
            value = state_dict[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            ep = self.expert_rows.get(fqn)
            if ep is not None and isinstance(value, torch.Tensor) and value.shape[0] == ep.experts != ep.experts // ep.n:
                value = state_dict[key] = owned_rows(value, ep)      # a whole [E, ...]: this rank's experts
            p = self._placements.get(fqn)
            rt = self._rt_of.get(fqn)
            if isinstance(value, torch.Tensor) and rt is not None and rt.stage == 3:
                b, i = rt.where[fqn]
                if tuple(value.shape) != rt.buckets[b].shapes[i]:
                    value = self._local(fqn, value)
                state_dict[key] = self._piece(value, rt)
            elif isinstance(p, Shard) and isinstance(value, torch.Tensor):
                mine = dict(self.named_parameters()).get(fqn)
                if mine is not None and value.shape != mine.shape:
                    state_dict[key] = self._local(fqn, value)
            elif isinstance(value, torch.Tensor):
                state_dict[key] = value


def _to_dtensors(module: ParallelModule, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    from autopar.runtime.agreement import rendezvous
    for rt in module._dps:       # ZeRO-3 gathers below: a rank calling alone must not hang
        if rt.stage == 3 and rt.n > 1:
            rendezvous(rt.group_name, f"{type(module).__name__}.state_dict() under ZeRO-3", module.collective_wait_s)
    gathering = [*module.expert_rows.values(), *(e for e, _ in module.expert_modules.values())]
    for ep in {id(e): e for e in gathering if e.n > 1}.values():   # and the experts' gathers
        rendezvous(ep.group.group_name, f"{type(module).__name__}.state_dict() under expert parallelism",
                   module.collective_wait_s)
    for key in list(state_dict):
        fqn = module._aliases.get(key[len(prefix):], key[len(prefix):])
        rt = module._rt_of.get(fqn)
        if rt is not None and rt.stage == 3:
            state_dict[key] = module._whole_local(fqn, state_dict[key])
        ep = module.expert_rows.get(fqn)
        if ep is not None:                 # this rank's experts' rows -> the whole [E, ...] tensor
            state_dict[key] = whole_experts(state_dict[key].detach(), ep)
        p = module._placements.get(fqn)
        if isinstance(p, Shard) and module._tp_dim is not None:
            places = [DReplicate()] * module._mesh.ndim
            places[module._tp_dim] = DShard(p.dim)
            state_dict[key] = DTensor.from_local(state_dict[key], module._mesh, places, run_check=False)
    for name, (ep, suffixes) in module.expert_modules.items():   # every member of a ModuleList of experts
        for suffix in suffixes:
            mine = [state_dict[f"{prefix}{name}.{e}.{suffix}"].detach() for e in ep.owned()]
            if any(isinstance(t, DTensor) for t in mine):     # split on the tensor axis too: whole first
                mine = [t.full_tensor() if isinstance(t, DTensor) else t for t in mine]
            stacked = whole_experts(torch.stack(mine), ep)    # [E, ...] in expert order
            for e in range(ep.experts):
                state_dict[f"{prefix}{name}.{e}.{suffix}"] = stacked[e].clone()
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


def _input_specs(gm: fx.GraphModule) -> list[tuple[torch.dtype, tuple[int | None, ...]] | None]:
    """Per user input: its dtype and sizes (None where symbolic), from the captured example."""
    out: list[tuple[torch.dtype, tuple[int | None, ...]] | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or info(node).kind in ("param", "buffer", "constant"):
            continue
        vals = info(node).values
        if not vals:
            out.append(None)
            continue
        shape = tuple(None if sympy.sympify(d).free_symbols else int(d) for d in vals[0].shape)
        out.append((vals[0].dtype, shape))
    return out


def _get(root: nn.Module, fqn: str) -> torch.Tensor:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        mod = getattr(mod, part)
    return getattr(mod, leaf)


def _weighted(value: Any, weight: torch.Tensor) -> Any:
    """``value`` unchanged forward, its gradient times ``weight`` backward (floating tensors
    that need a gradient; anything else as it is)."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value = value.view_as(value)   # its own node: only the user's use of the output is weighted
        value.register_hook(lambda g: g * weight.to(g.dtype))
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_weighted(v, weight) for v in value)
    return value


def set_tensor(root: nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool = False, persistent: bool = True) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:                  # the holder modules, looked up in _modules (not __getattr__'s slow path)
        sub = mod._modules.get(part)
        if sub is None:
            sub = nn.Module()
            mod.add_module(part, sub)
        mod = sub
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        mod.register_parameter(leaf, value)


__all__ = ["ParallelModule", "DReplicate"]
