"""Pipeline runtime: per-stage modules run by ``torch.distributed.pipelining`` schedules.

:class:`StageModule` runs one stage's graph (from :func:`autopar.passes.pp_split.split_stages`)
with the stage's parameters stored under their original ``state_dict`` keys (tensor-axis
local slices when the graph was rewritten for a tensor axis). :class:`PipelineModule` is what
:func:`autopar.parallelize` returns for a mesh with a ``pp`` axis: it holds this rank's stage
(or ``v`` stages, stage ``s`` on pipeline rank ``s % p``; DualPipeV: two in a V, its paired
forwards and backwards run at once, runtime/pp_overlap.py) and trains with :meth:`PipelineModule.step`:

    loss = pm.step(inputs, target=targets)   # every rank, the same call; returns the loss

A step splits the (data-axis-local) batch into micro-batches, runs the schedule (forward and
backward of every micro-batch; ``loss_fn(output, target_chunk)`` on the last stage, gradients
scaled by 1/micro-batches so they are those of the mean loss), then sums the gradients of
parameters held by several stages (a tied embedding and head) over the pipeline axis and
averages every gradient over the data axis. The loss returned on every rank is the mean of
the micro-batch losses. ``local_state_dict()`` holds this rank's parameters and buffers under the
original keys (the union over pipeline ranks is the whole model's); ``state_dict()`` is the whole
model's on every rank (a collective, through the functions :func:`autopar.parallelize` sets in
``whole_state``), and ``load_state_dict`` takes a whole one.

Under mixed precision (``compute_dtype`` bf16 or fp16) the stages hold 16-bit parameters and
run forward (and the loss) under autocast; activations and their gradients travel between
stages in the dtype autocast gives them (16-bit, but fp32 for what autocast keeps in fp32); each
micro-batch's 16-bit gradients are added into fp32 accumulators (:class:`~autopar.runtime.
main_grads.MainGrads`), which the data axis reduces and the optimizer steps fp32 masters with.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.core.errors import ConfigError, InputMismatchError
from autopar.core.meta import META_KEY, StageGraph, evaluate, graph_info, info
from autopar.core.mesh import stage_device
from autopar.core.placement import Shard, Spec, parse
from autopar.runtime.collectives import c10d
from autopar.runtime.dp import row_weight
from autopar.runtime.health import note_step, peer_errors
from autopar.runtime.main_grads import MainGrads
from autopar.runtime.pp_overlap import PairRunner
from autopar.runtime.pp_stage import PipeStage, scale_once
from autopar.runtime.stage_dp import StageDataAxis
from autopar.runtime.tp_module import set_tensor

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zb": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}
MULTI = ("interleaved", "zb", "dualpipev")   # schedules that take a list of stages


class StageModule(nn.Module):
    """One pipeline stage: its graph and its parameters under their original keys."""

    def __init__(self, sg: StageGraph, tensors: dict[str, torch.Tensor], trainable: dict[str, bool],
                 placements: dict[str, str], tp_rank: int, tp_n: int, input_names: Sequence[str] = (),
                 shared: dict[str, nn.Parameter] | None = None, constants: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.index = sg.index
        self._graph = [sg.gm]            # not a submodule: keeps state_dict keys original
        self._order = sg.order
        self._inputs = list(sg.inputs)
        self._user_inputs = list(input_names)   # stage 0: the model's tensor input names, in call order
        self._constants = dict(constants or {})  # stage 0: its non-tensor inputs, fixed by the capture
        self.outputs = list(sg.outputs)
        self.is_last = False             # set by PipelineModule
        self.compute_dtype: torch.dtype | None = None    # mixed precision: the 16-bit dtype (to_compute_dtype)
        self._device_type = "cpu"
        self._sent: dict[str, torch.dtype] = {}          # mixed precision: crossing value -> its wire dtype
        self._state: dict[str, torch.Tensor] | None = None
        self._recompute: dict[fx.Node, int] = {}
        ginfo = graph_info(sg.gm)
        self.transient = {fqn for kind, fqn in sg.order if kind == "constant" or fqn in ginfo.transient_buffers}
        for kind, fqn in sg.order:
            if kind == "constant":       # a tensor the model's code made: part of the program
                set_tensor(self, fqn, ginfo.constants[fqn].clone(), buffer=True, persistent=False)
                continue
            if kind not in ("param", "buffer"):
                continue
            if shared and fqn in shared:    # also held by another stage on this rank: the same Parameter
                set_tensor(self, fqn, shared[fqn])
                continue
            local = _local(tensors[fqn], placements.get(fqn, "R"), tp_rank, tp_n)
            if kind == "param":
                set_tensor(self, fqn, nn.Parameter(local, requires_grad=trainable.get(fqn, True)))
            else:
                set_tensor(self, fqn, local, buffer=True, persistent=fqn not in ginfo.transient_buffers)
        # received values the stage writes in place (its own buffers, BatchNorm's counter, are written as they are)
        self._mutated = [i for i in _mutated_inputs(sg.gm) if sg.order[i][0] == "act"]

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._graph[0]

    def set_compile(self, backend: str | None) -> None:
        """Run this stage's graph through ``torch.compile`` (runtime/compiled.py)."""
        from autopar.runtime.compiled import compile_graph
        self._compiled = compile_graph(self.graph_module, backend) if backend else None

    def set_recompute(self, mode: str, layers: Sequence[str] = ()) -> None:
        """Checkpoint this stage's ``layers`` (full, pointwise; layers:K the first K) or attention cores."""
        from autopar.runtime.recompute import regions
        self._recompute = regions(self.graph_module, mode, list(layers))
        self.recompute = mode

    def to_compute_dtype(self, dtype: torch.dtype, device_type: str,
                         sent: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
        """Mixed precision: floating-point parameters held in ``dtype`` (identity kept), forward
        under autocast; a value crossing stages travels in ``sent[its name]`` (else ``dtype``).
        Returns the parameters' values before (the fp32 masters' start). The graph must hold no
        dtype checks (:func:`autopar.passes.autocast.drop_dtype_checks`)."""
        self.compute_dtype, self._device_type = dtype, device_type
        sent = dict(sent or {})
        self._sent = {name: sent.get(name, dtype) for name in self.outputs}
        self._sent.update({name: sent.get(name, dtype) for kind, name in self._order if kind == "act"})
        before = {}
        for fqn, p in self.named_parameters():
            if p.is_floating_point() and p.dtype != dtype:
                if p.numel():
                    before[fqn] = p.data
                p.data = p.data.to(dtype)
        self._state = None
        return before

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype under mixed precision, else nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype)

    def _apply(self, fn, recurse: bool = True):  # .to() and friends replace the tensors
        self._state = None
        return super()._apply(fn, recurse)

    def forward(self, *args: torch.Tensor) -> Any:
        state = self._state
        if state is None:   # parameters and buffers keep their identity (optimizers update in place)
            state = dict(self.named_parameters(remove_duplicate=False))
            state.update(dict(self.named_buffers()))
            self._state = state
        if self._user_inputs:            # stage 0 gets the model's inputs; keep the ones it reads
            if len(args) != len(self._user_inputs):
                raise InputMismatchError("the pipeline's first stage got the wrong number of inputs",
                                         where="PipelineModule.step", expected=str(len(self._user_inputs)),
                                         got=str(len(args)), fix="call step() with the model's inputs")
            by_name = {**dict(zip(self._user_inputs, args)), **self._constants}
            acts = iter(by_name[n] for n in self._inputs)
        else:
            acts = iter(args)
        call = [state[key] if kind in ("param", "buffer", "constant") else next(acts) for kind, key in self._order]
        for i in self._mutated:          # a received activation is a leaf the schedule owns: write a copy
            call[i] = call[i].clone()
        with self.autocast():
            if self._recompute and (getattr(self, "_compiled", None) is None or self.recompute != "none"):
                from autopar.runtime.recompute import run
                outs = run(self.graph_module, call, self._recompute, mode=self.recompute)
            elif getattr(self, "_compiled", None) is not None:
                outs = self._compiled(*call)
            else:
                outs = self.graph_module(*call)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        if self.compute_dtype is not None and not self.is_last:   # each in the dtype the receiver expects
            outs = tuple(o.to(self._sent[name]) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o, name in zip(outs, self.outputs))
        outs = tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in outs)  # sends need it
        if self.is_last:                 # the schedule concatenates the last stage's micro-batch outputs
            outs = tuple(o.reshape(1) if isinstance(o, torch.Tensor) and o.dim() == 0 else o for o in outs)
        return outs[0] if len(outs) == 1 else outs


    def io_examples(self, tp_n: int, device: torch.device,
                    user_args: tuple | None = None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Empty tensors shaped like one micro-batch's inputs and outputs of this stage (the
        tensor-axis-local shapes), so the schedule needs no shape-inference pass."""
        phs = {n.name: n for n in self.graph_module.graph.nodes if n.op == "placeholder"}
        sent = self._sent           # mixed precision: the dtypes activations travel in
        if user_args is not None:
            ins = tuple(torch.empty_like(a, device=device) for a in user_args if isinstance(a, torch.Tensor))
        else:
            ins = tuple(_example(phs[name], tp_n, device, sent.get(name))
                        for kind, name in self._order if kind == "act")
        out_node = next(n for n in self.graph_module.graph.nodes if n.op == "output")
        outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
        outs = tuple(_example(n, tp_n, device, sent.get(name))
                     for n, name in zip(outs, self.outputs))
        if self.is_last:
            outs = tuple(o.reshape(1) if o.dim() == 0 else o for o in outs)
        return ins, outs


def _mutated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the placeholders an op of ``gm`` writes in place (``relu_`` on a received
    activation): the stage runs those on a copy."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, ph in enumerate(phs):
        for user in ph.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                continue
            for arg, value in zip(schema.arguments, user.args):
                if value is ph and arg.alias_info is not None and arg.alias_info.is_write:
                    out.append(i)
    return sorted(set(out))


def _size(d: Any, gm: fx.GraphModule) -> int:
    """One recorded dim: a number, or a formula of the sizes captured (a context axis's sequence)."""
    return int(evaluate(d, dict(getattr(gm.meta.get(META_KEY), "example_sizes", None) or {})))


def _example(node: fx.Node, tp_n: int, device: torch.device, sent: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor like ``node``'s value on this rank (floating-point ones in ``sent`` if given)."""
    rec = info(node)
    value = rec.values[0]
    shape = [_size(d, node.graph.owning_module) for d in value.shape]
    text = (rec.placement or "R").split(",")[0]
    try:
        placement = Spec.parse(text).value
    except ConfigError:
        placement = None
    if isinstance(placement, Shard) and tp_n > 1:
        shape[placement.dim] //= tp_n
    dtype = sent if sent is not None and value.dtype.is_floating_point else value.dtype
    out = torch.empty(shape, dtype=dtype, device=device)
    # the schedule makes received activations require grad as their examples do
    return out.requires_grad_(rec.requires_grad and value.dtype.is_floating_point)


def _local(full: torch.Tensor, placement: str, rank: int, n: int) -> torch.Tensor:
    p = parse(placement)
    if isinstance(p, Shard) and n > 1:
        return full.detach().chunk(n, p.dim)[rank].clone().contiguous()
    return full.detach().clone()


class PipelineModule(nn.Module):
    """This rank's pipeline stage(s) and the schedule that trains them (module docstring)."""

    def __init__(self, stages: list[StageModule], *, plan: Any, schedule: str, microbatches: int,
                 num_stages: int, loss_fn: Callable, pp_group: dist.ProcessGroup, pp_rank: int, pp_size: int,
                 data: Sequence[StageDataAxis], shared: dict[str, dist.ProcessGroup],
                 device: torch.device,
                 examples: list[tuple[tuple, tuple]] | None = None, keyword_names: Sequence[str] = (),
                 own_loss: bool = False, grads: MainGrads | None = None,
                 master_init: Mapping[str, torch.Tensor] | None = None,
                 constant_inputs: Mapping[int, Any] | None = None, loss_dtype: torch.dtype | None = None,
                 token_counter: fx.GraphModule | None = None) -> None:
        super().__init__()
        from torch.distributed import pipelining

        self.plan = plan
        self.mode_source = None          # switches the stages between train and eval (autopar/build/modes.py)
        self.schedule_name = schedule
        self.microbatches = microbatches
        self._stages = stages            # not submodules: the parameters are registered below
        self._pp = (pp_group, pp_rank, pp_size)
        self._data = list(data)          # the data axes (runtime/stage_dp.py); not submodules
        self._loss_fn = loss_fn
        self._own_loss = own_loss
        self.keyword_names = list(keyword_names)
        # position -> value of each non-tensor input (a flag such as return_loss=True): the capture
        # fixed it, and torch's schedule moves tensors only, so step() checks it and holds it back
        self._constant_inputs = dict(constant_inputs or {})
        self._num_stages = num_stages
        self._device = device
        self._shared = dict(shared)      # parameter -> the group of pipeline ranks holding a copy
        # mixed precision: the fp32 gradient accumulators, and the fp32 values the optimizer's masters start from
        self.main_grads = grads
        self._master_init = dict(master_init or {})
        self.compute_dtype = next((st.compute_dtype for st in stages if st.compute_dtype is not None), None)
        self.loss_scaler = None          # fp16: set by the optimizer (runtime/loss_scale.py), read by _Autocast
        pieces = {f: q for d in self._data for f, q in d.pieces.items()}
        for st in stages:
            for fqn, p in st.named_parameters(remove_duplicate=False):
                set_tensor(self, fqn, pieces.get(fqn, p))     # ZeRO-3: the module holds (and steps) pieces
            for fqn, b in st.named_buffers():
                set_tensor(self, fqn, b, buffer=True, persistent=fqn not in st.transient)
        for st in stages:
            st.is_last = st.index == num_stages - 1
        examples = examples or [(None, None)] * len(stages)
        collect = self._collect if grads is not None else None
        self._pipe_stages = [PipeStage(st, st.index, num_stages, device, input_args=ins, output_args=outs,
                                    group=pp_group, on_last_backward=self._stage_done, on_backward=collect)
                             for st, (ins, outs) in zip(stages, examples)]
        scale_once(self._pipe_stages)     # a parameter two of them hold is scaled by the lower one
        # this rank's own entries (its stages'), before the hooks below make ZeRO-3 pieces whole
        self._local_keys = frozenset(nn.Module.state_dict(self, keep_vars=True))
        # set by autopar.parallelize (autopar/checkpoint/full.py): the whole state dict on every
        # rank, and loading one; state_dict() and load_state_dict() use them when set
        self.whole_state: tuple[Callable, Callable] | None = None
        self.collective_wait_s = 60.0    # how long state_dict() waits for the other ranks before raising
        if pieces:
            self._register_state_dict_hook(_whole_pieces)
            self._register_load_state_dict_pre_hook(self._to_pieces)
        cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
        floats = [p.dtype for st in stages for p in st.parameters() if p.dtype.is_floating_point]
        # every pipeline rank agrees on the loss's dtype (fp32, or fp64 for a float64 model): the
        # whole model's (``loss_dtype``), which a rank whose stages hold no parameter cannot see
        self._loss_dtype = loss_dtype or torch.promote_types(torch.float32, floats[0] if floats else torch.float32)
        # the loss runs under autocast, as the stages do (mixed precision), weighted by this data
        # rank's rows (uneven shares) and scaled (fp16)
        self._row_weight: torch.Tensor | None = None
        # a model's own token-mean loss: each micro-batch's real tokens (runtime/token_loss.py)
        self._token_counter = token_counter
        self._count_target = False        # the counter reads the target (a loss_fn's), not the inputs
        self._last_outputs = next((outs for st, (_, outs) in zip(stages, examples) if st.is_last), None)
        self._token_weights, self._token_counts, self._token_calls = None, None, 0
        loss_fn = _Autocast(loss_fn, next(st for st in stages), self)
        self._first = any(st.index == 0 for st in stages)
        self._last = any(st.index == num_stages - 1 for st in stages)
        self._schedule = cls(self._pipe_stages if schedule in MULTI else self._pipe_stages[0],
                             n_microbatches=microbatches, loss_fn=loss_fn)
        self.pair_runner = PairRunner.register(self._schedule) if schedule == "dualpipev" else None

    @property
    def stages(self) -> list[StageModule]:
        return list(self._stages)

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the optimizer steps (fp32 under mixed precision)."""
        return self._loss_dtype

    @property
    def mixed(self) -> bool:
        """Mixed precision: 16-bit stage parameters, fp32 gradient accumulators and masters."""
        return self.main_grads is not None

    def train(self, mode: bool = True) -> "PipelineModule":
        """Switch this rank's stages (not submodules) and the module to ``mode``, as on the
        original model; a mode the capture could not express raises (autopar/build/modes.py)."""
        if self.mode_source is not None:
            self.mode_source.switch([st.graph_module for st in self._stages], mode, "PipelineModule.train")
        for st in self._stages:
            st.train(mode)
        return super().train(mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.main_grads is not None:
            self.main_grads.clear()

    def _collect(self, index: int) -> None:
        """After a backward computation of stage ``index``: its 16-bit gradients into fp32."""
        st = next(st for st in self._stages if st.index == index)
        self.main_grads.collect(st.named_parameters())

    @property
    def pp_rank(self) -> int:
        return self._pp[1]

    @property
    def data_axes(self) -> list[StageDataAxis]:
        return list(self._data)

    @property
    def dp_runtimes(self) -> list:
        """Each data axis's bucket layout and ZeRO stage (what :func:`autopar.optimizer` and
        checkpoints read): none, one, or with experts two (dense on dp x ep, experts on dp)."""
        return [d.rt for d in self._data]

    def _stage_done(self, index: int) -> None:
        for d in self._data:
            d.stage_done(index)

    def _axis_of(self, fqn: str) -> StageDataAxis | None:
        return next((d for d in self._data if fqn in d.pieces), None)

    def _to_pieces(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for key in list(state_dict):
            fqn = key[len(prefix):]
            value, data = state_dict[key], self._axis_of(fqn)
            if data is not None and isinstance(value, torch.Tensor) and value.shape != data.pieces[fqn].shape:
                state_dict[key] = data.piece_of(value)

    def local_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This rank's stages' entries under the original keys, as this rank holds them (a ZeRO-3
        piece made whole on the tensor axis; a tensor-axis shard as this rank's part)."""
        return nn.Module.state_dict(self, keep_vars=keep_vars)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The whole model's state dict on every rank (a collective: a rank calling alone gets a
        PeerFailureError after ``collective_wait_s``); :meth:`local_state_dict` is this rank's part."""
        if self.whole_state is None or args:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        from autopar.runtime.agreement import rendezvous
        rendezvous(dist.group.WORLD.group_name, "PipelineModule.state_dict()", self.collective_wait_s)
        out = destination if destination is not None else {}
        out.update((prefix + key, value) for key, value in self.whole_state[0](self, keep_vars).items())
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Takes the whole model's state dict (each rank copies its boxes of it) or this rank's own."""
        if self.whole_state is not None and not set(state_dict) <= self._local_keys:
            return self.whole_state[1](self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    def placement_of(self, fqn: str):
        """How a parameter is stored on the tensor axis (``Replicate`` without one)."""
        return parse(self.plan.params.get(fqn, "R"))

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one batch; returns the mean micro-batch loss (every rank).
        Keyword inputs (``pm.step(**batch)``) go where the model takes them; a model that
        computes its own loss (given ``labels``) needs no ``target``."""
        note_step()
        with peer_errors():
            return self._step(inputs, target, kwargs)

    def _step(self, inputs: tuple, target: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
        packed = [i for i, x in enumerate(inputs) if isinstance(x, (tuple, list))]
        if packed:
            raise InputMismatchError("pm.step takes the model's inputs as separate arguments, not packed in a "
                                     "tuple or list", where="PipelineModule.step",
                                     got=f"argument {packed[0]} is a {type(inputs[packed[0]]).__name__}",
                                     fix="unpack them: pm.step(*inputs, target=y) (pm.step(x, target=y) for one "
                                         "input), or pass keyword inputs as pm.step(**batch)")
        if not torch.is_grad_enabled():
            raise ConfigError("a pipeline step runs forward and backward: it cannot run under torch.no_grad()",
                              where="PipelineModule.step",
                              fix="call pm.step outside no_grad (after pm.eval() it runs in eval mode; "
                                  "call pm.zero_grad() after an evaluation step)")
        if target is None and not self._own_loss:
            raise ConfigError("a pipeline step needs the target", where="PipelineModule.step",
                              fix="call pm.step(inputs, target=targets) on every rank")
        every = (*inputs, *self._keyword_inputs(kwargs))
        inputs = self._tensor_inputs(every)
        for t in (*inputs, target):
            if isinstance(t, torch.Tensor) and t.shape[0] % self.microbatches:
                raise InputMismatchError(f"batch of {t.shape[0]} does not split into {self.microbatches} micro-batches",
                                         where="PipelineModule.step", expected=f"a multiple of {self.microbatches}",
                                         got=str(tuple(t.shape)), fix="pass a batch the plan's micro-batch count divides")
        losses: list[torch.Tensor] = []
        args = inputs if self._first else ()
        tgt = target if self._last else None
        if self._last and target is None:   # the model's own loss: the schedule still splits a target
            rows = next(t.shape[0] for t in inputs if isinstance(t, torch.Tensor)) if inputs else self.microbatches
            tgt = torch.zeros(rows, device=self._device)
        widest = max((d.rt for d in self._data), key=lambda rt: rt.n, default=None)
        if widest is not None and widest.n > 1:      # uneven shares of the batch over the data axis
            rows = next((t.shape[0] for t in (*inputs, target) if isinstance(t, torch.Tensor)), 1)
            self._row_weight = row_weight(rows, widest)
        if self._last and not self._own_loss and self._last_outputs is not None and isinstance(target, torch.Tensor):
            self._trace_loss_fn(target)
        if self._token_counter is not None and self._last:
            self._weigh_tokens((target,) if self._count_target else every, widest)
        for data in self._data:
            data.begin_step()
        self._schedule.step(*args, target=tgt, losses=losses)
        self._sync_grads()
        pp_group, _, _ = self._pp
        if losses and self._token_weights is not None:     # the global batch's token mean
            n, mine = self._token_counts
            total = (torch.stack([x.detach().to(torch.float64) for x in losses]) * mine).sum()
            if widest is not None and widest.n > 1:
                total = c10d.wait_tensor(c10d.all_reduce(total, "sum", widest.group_name))
            loss = total / n
        else:
            loss = torch.stack([x.detach() for x in losses]).mean() if losses else torch.zeros((), device=self._device)
        self._token_weights = None
        loss = loss.to(self._loss_dtype)
        if self._pp[2] > 1:   # the last stage's loss to every pipeline rank (DualPipeV's V: rank 0's)
            v = "v" if self.schedule_name == "dualpipev" else "loop"
            src = dist.get_global_rank(pp_group, stage_device(self._num_stages - 1, self._pp[2], v))
            dist.broadcast(loss, src=src, group=pp_group)
        return loss

    def _trace_loss_fn(self, target: torch.Tensor) -> None:
        """Once: is the user's ``loss_fn`` a token-mean loss (runtime/token_loss.py)? Traced on
        zeros shaped like a micro-batch's output and the first micro-batch's target."""
        from autopar.runtime.token_loss import loss_fn_counter
        outs = tuple(torch.zeros_like(o) for o in self._last_outputs)
        example = outs[0] if len(outs) == 1 else outs
        self._token_counter = loss_fn_counter(self._loss_fn, example, target.tensor_split(self.microbatches)[0])
        self._count_target = True
        self._last_outputs = None

    def _weigh_tokens(self, every: tuple, widest) -> None:
        """A model's own token-mean loss: count each micro-batch's real tokens on its inputs (the
        model's own steps from ``labels`` to the loss's targets), sum them over the data axis,
        and weight micro-batch ``m``'s gradient by ``count_m x micro-batches x data ranks /
        global count``: the schedule averages the micro-batches and the data axis the ranks, so
        the gradient is the global batch's token mean's, as one process computes it."""
        m = self.microbatches
        chunks = [tuple(v.tensor_split(m)[i] if isinstance(v, torch.Tensor) else v for v in every) for i in range(m)]
        mine = torch.stack([self._token_counter(*c).to(torch.float64) for c in chunks]).to(self._device)
        empty = [i for i, c in enumerate(mine.tolist()) if c == 0]
        if empty:
            raise InputMismatchError(f"micro-batch {empty[0]} of {m} holds no real token (every label is the "
                                     "ignore index): its mean loss is 0/0", where="PipelineModule.step",
                                     expected="at least one real token in every micro-batch",
                                     got=f"real tokens per micro-batch: {[int(c) for c in mine.tolist()]}",
                                     fix="drop or refill all-padding rows, or order the batch so every "
                                         "micro-batch holds real tokens")
        n = mine.sum()
        ranks = widest.n if widest is not None and widest.n > 1 else 1
        if ranks > 1:
            n = c10d.wait_tensor(c10d.all_reduce(n, "sum", widest.group_name))
        self._token_counts = (n, mine)
        self._token_weights = list(mine * (m * ranks) / n)
        self._token_calls = 0

    def next_loss_weight(self) -> torch.Tensor | None:
        """The weight of the micro-batch whose loss the schedule computes now (they come in order)."""
        if self._token_weights is None:
            return self._row_weight
        w = self._token_weights[self._token_calls % len(self._token_weights)]
        self._token_calls += 1
        return w

    def _tensor_inputs(self, inputs: tuple) -> tuple:
        """The step's inputs without the non-tensor ones, each checked against the value the model
        was parallelized with (the graph holds that value)."""
        if not self._constant_inputs:
            return inputs
        names = [f"input {i}" for i in range(len(inputs) - len(self.keyword_names))] + self.keyword_names
        for i, want in self._constant_inputs.items():
            got = inputs[i] if i < len(inputs) else None
            if type(got) is not type(want) or got != want:
                name = names[i] if i < len(names) else f"input {i}"
                raise InputMismatchError(f"{name} differs from the value the model was parallelized with, which "
                                         "its pipeline stages hold", where="PipelineModule.step", expected=repr(want),
                                         got=repr(got), fix="pass the same value, or parallelize again with this one")
        return tuple(v for i, v in enumerate(inputs) if i not in self._constant_inputs)

    def _keyword_inputs(self, kwargs: dict[str, Any]) -> list[Any]:
        """The keyword inputs in the order the model was captured with."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if set(kwargs) != set(self.keyword_names):
            raise InputMismatchError("the step's keyword inputs differ from the ones the model was parallelized with",
                                     where="PipelineModule.step", expected=str(self.keyword_names),
                                     got=str(sorted(kwargs)), fix="call pm.step(**batch) with the keys of "
                                                                  "example_kwargs")
        return [kwargs[k] for k in self.keyword_names]

    def _sync_grads(self) -> None:
        """Sum the gradients of parameters several pipeline ranks hold, then finish the data
        axis (its stage buckets left when each stage's backward ended)."""
        params = {}
        for st in self._stages:
            params.update(st.named_parameters(remove_duplicate=False))
        for fqn in sorted(self._shared):   # a tied weight: sum its copies' gradients (fp32 ones if mixed)
            p = params[fqn]
            if self.main_grads is not None:
                if self.main_grads.get(fqn) is None:
                    self.main_grads.set(fqn, torch.zeros(p.shape, dtype=self.main_grads.dtype, device=p.device))
                dist.all_reduce(self.main_grads.get(fqn), group=self._shared[fqn])
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._shared[fqn])
        for data in self._data:
            data.end_step()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("a pipelined model is trained with step(), not called", where="PipelineModule",
                          fix="loss = pm.step(inputs, target=targets); then optimizer.step()")


class _Autocast:
    """The loss function, run under the stages' autocast (mixed precision); its gradient is
    weighted by this data rank's share of the rows (uneven shares, ``runtime/dp.py:row_weight``);
    under fp16 its result goes through the pipeline's loss scaler, so backward starts from the
    scale."""

    def __init__(self, fn: Callable, stage: StageModule, pipeline: "PipelineModule") -> None:
        self.fn, self.stage, self.pipeline = fn, stage, pipeline

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.stage.autocast():
            loss = self.fn(*args, **kwargs)
        if isinstance(loss, torch.Tensor) and loss._is_view():
            loss = loss.clone()      # the zero-bubble schedule detaches the loss in place, which a view refuses
        weight = self.pipeline.next_loss_weight()
        if weight is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(lambda g: g * weight.to(g.dtype))
        scaler = self.pipeline.loss_scaler
        return loss if scaler is None else scaler.scale_outputs(loss, alias=False)


def _whole_pieces(module: PipelineModule, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """ZeRO-3: ``state_dict()`` holds whole (tensor-axis-local) values, gathered from the pieces."""
    for key in list(state_dict):
        data = module._axis_of(key[len(prefix):])
        if data is not None:
            state_dict[key] = data.whole_local(key[len(prefix):], state_dict[key])
    return state_dict


def stage_inputs_of(gm: fx.GraphModule) -> list[str]:
    """The model's user-input placeholder names, in call order."""
    return [n.name for n in gm.graph.nodes if n.op == "placeholder" and info(n).kind not in ("param", "buffer", "constant")]


__all__ = ["StageModule", "PipelineModule", "SCHEDULE_CLASSES", "stage_inputs_of"]
