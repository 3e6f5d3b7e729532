"""What the build steps share: the request (what :func:`autopar.parallelize` was asked, already
checked) and one mutable :class:`BuildState` the steps fill in, in order.

Each field says which step writes it; a step reads only fields of steps before it
(``autopar/build/steps.py`` checks that the list runs them in that order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopar.core.dp_mode import ALLREDUCE, DataMode
from autopar.core.mesh import has_axis
from autopar.core.options import Options
from autopar.core.plans import Plan


@dataclass(frozen=True, kw_only=True)
class BuildRequest:
    """One ``parallelize`` call, checked by the front door: the model, its example inputs, the
    mesh as given, a plan to apply (or None to find one) and every option."""

    model: nn.Module
    mesh: Any
    args: tuple
    kwargs: dict[str, Any]
    plan: Plan | None = None
    hardware: str | None = None
    memory_budget: float | None = None
    zero_stage: int | None = None
    recompute: str = "none"
    mixed_precision: str | None = None
    options: Options = Options()
    dp_mode: DataMode = ALLREDUCE

    @property
    def pipelined(self) -> bool:
        """A pipeline axis, in the mesh or the plan."""
        return has_axis(self.mesh, "pp") or (self.plan is not None and self.plan.pp_axis is not None)

    @property
    def expert_axis(self) -> bool:
        """An expert axis, in the mesh or the plan (with a pipeline too: the steps test
        :attr:`pipelined` first, and inside a pipeline the experts are placed in order)."""
        return has_axis(self.mesh, "ep") or (self.plan is not None and self.plan.ep_axis is not None)


@dataclass(kw_only=True)
class BuildState:
    """Filled in by the steps, in the order of ``BUILD_STEPS``."""

    request: BuildRequest
    ran: list[str] = field(default_factory=list)       # the steps that ran, in order

    # mesh: the axes and this rank's place on them; the plan's settings where a plan is applied
    axes: tuple[tuple[str, int], ...] = ()
    sizes: dict[str, int] = field(default_factory=dict)
    mesh: Any = None                        # the DeviceMesh over the whole process group
    names: list[str] = field(default_factory=list)
    node_layout: tuple[int, int] | None = None   # (nodes, ranks per node) when regular (runtime/nodes.py)
    spans: dict[str, int] = field(default_factory=dict)   # tp / ep axis -> the most nodes one of its groups touches
    device: torch.device | None = None
    schedule: str | None = None             # pipeline settings: given, or the plan's
    microbatches: int | None = None
    virtual_stages: int | None = None
    zero_stage: int | None = None
    mixed_precision: str | None = None
    capacity_factor: float | None = None

    # schedule (pipeline): the batch is captured at one micro-batch
    capture_args: tuple = ()
    capture_kwargs: dict[str, Any] = field(default_factory=dict)
    capture_dims: Any = None

    # tensor: the whole graph, captured and rewritten for the tensor axis
    gm: fx.GraphModule | None = None
    plan: Plan | None = None                # the plan applied (completed by the later steps)
    placements: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, Any] = field(default_factory=dict)

    # weights: the model's tensors by state_dict key (every rank with rank 0's values)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    trainable: dict[str, bool] = field(default_factory=dict)

    # experts
    experts: dict[str, tuple[str, Any]] = field(default_factory=dict)   # fqn -> (how stored, what this rank owns)
    expert_runtimes: dict[str, Any] = field(default_factory=dict)
    expert_placements: dict[str, Any] = field(default_factory=dict)

    # context: the kind of context-parallel attention the rewrite used (None: no cp axis)
    cp_kind: str | None = None

    # pipeline
    stages: list[Any] = field(default_factory=list)        # this rank's StageModules
    stage_graphs: list[Any] = field(default_factory=list)  # every stage's graph
    pipeline_plan: Any = None
    loss_fn: Any = None
    own_loss: bool = False
    token_counter: Any = None      # the real-token count of a model's own token-mean loss (pipelines)
    shared_groups: dict[str, Any] = field(default_factory=dict)
    sent: dict[str, torch.dtype] = field(default_factory=dict)
    constant_inputs: dict[int, Any] = field(default_factory=dict)   # position -> a non-tensor input's value

    # recompute: node -> region of the whole graph (without a pipeline; stages keep their own)
    regions: dict[fx.Node, int] = field(default_factory=dict)

    # data: the data axes' runtimes, the fp32 gradient accumulators and masters (mixed precision)
    data: list[Any] = field(default_factory=list)
    grads: Any = None
    master_init: dict[str, torch.Tensor] = field(default_factory=dict)
    data_nodes: bool = False                # the data axes are nodes of the whole graph (to schedule)

    # module: what parallelize returns
    module: Any = None
    _cluster: Any = None

    def cluster(self) -> Any:
        """The simulated cluster the build prices with: this process group's devices, of the
        request's hardware (default: h100 with CUDA, else the cpu profile)."""
        if self._cluster is None:
            import math

            from autopar.cost.cluster import Cluster
            hardware = self.request.hardware or ("h100" if torch.cuda.is_available() else "cpu")
            self._cluster = Cluster.from_spec(f"1x{math.prod(self.sizes.values())}", hardware=hardware)
        return self._cluster

    def graphs(self) -> list[fx.GraphModule]:
        """The graphs the steps rewrite: each of this rank's stages, or the whole graph."""
        if self.stages:
            return [st.graph_module for st in self.stages]
        return [self.gm] if self.gm is not None else []

    @property
    def tp(self) -> int:
        return self.sizes.get("tp", 1)

    @property
    def ep(self) -> int:
        return self.sizes.get("ep", 1)

    def group(self, axis: str) -> tuple[Any, int]:
        """(process group, this rank's index) of mesh axis ``axis``."""
        d = self.names.index(axis)
        return self.mesh.get_group(d), self.mesh.get_local_rank(d)
