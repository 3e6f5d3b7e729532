"""The build corridor: the steps that turn a plan into this rank's parallel module, in order.

The rewrite twin of ``passes/pipeline.py:ANALYSIS_PASSES``. Every build — any mesh, with or
without a plan — runs this one list top to bottom; a step whose axis the mesh does not have
does nothing (and says so in the log). Each step names the steps whose results it reads
(``needs``): :func:`run_steps` refuses to run a step before them, so a list that drops or
reorders a step fails at that step's door, with its name. After each step that rewrites graphs,
each graph is linted and every op node must still carry its autopar record.

The pipeline step cuts the whole graph into stages; the steps after it (recompute, data,
overlap) then work on this rank's stages instead of the whole graph (``BuildState.graphs``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from autopar.build.context import context_step
from autopar.build.data import data_step
from autopar.build.experts import capacity_step, experts_step
from autopar.build.module import module_step
from autopar.build.overlap import overlap_step
from autopar.build.pipeline import pipeline_step, schedule_step
from autopar.build.recompute import recompute_step
from autopar.build.state import BuildState
from autopar.build.tensor import tensor_step
from autopar.build.world import mesh_step, weights_step
from autopar.core.errors import AutoparInternalError
from autopar.core.meta import META_KEY
from autopar.core.progress import reported_seconds, setup_stage

log = logging.getLogger("autopar.build")


@dataclass(frozen=True)
class Step:
    """One build step: its name, what it does to the state, why it stands where it does, the
    steps whose results it reads, and whether it rewrites graphs (checked after it)."""

    name: str
    run: Callable[[BuildState], None]
    reason: str
    needs: tuple[str, ...] = ()
    rewrites: bool = False


BUILD_STEPS: list[Step] = [
    Step("mesh", mesh_step, "every step reads the axes, this rank's place on them and the plan's settings"),
    Step("schedule", schedule_step, "a pipeline captures one micro-batch: its count comes first (pipeline only)",
         needs=("mesh",)),
    Step("capacity", capacity_step, "an MoE capacity override must be on the modules before they are captured",
         needs=("mesh",)),
    Step("tensor", tensor_step, "on the whole graph, so the solver sees every op; experts pinned whole with an ep axis",
         needs=("mesh", "schedule", "capacity"), rewrites=True),
    Step("weights", weights_step, "every rank takes rank 0's values before anything reads them",
         needs=("mesh",)),
    Step("experts", experts_step, "after the tensor rewrite, whose collectives stay outside the exchanged experts; "
         "checks each MoE layer on the real weights", needs=("tensor", "weights"), rewrites=True),
    Step("context", context_step, "after the tensor rewrite (attention on this rank's heads), on the whole graph: "
         "each rank's tokens of the sequence", needs=("tensor", "weights", "experts"), rewrites=True),
    Step("pipeline", pipeline_step, "after every rewrite that changes the ops, so the cuts price what each rank runs",
         needs=("tensor", "weights", "experts", "context"), rewrites=True),
    Step("recompute", recompute_step, "per graph (per stage with a pipeline), over the model's own ops",
         needs=("pipeline",)),
    Step("data", data_step, "buckets follow the parameters each graph (or stage) holds: dense over dp x ep, "
         "experts over dp", needs=("pipeline", "recompute"), rewrites=True),
    Step("overlap", overlap_step, "after the data axis's nodes exist: each issue early, each wait late",
         needs=("data",), rewrites=True),
    Step("module", module_step, "last: the runtime module over what the steps made", needs=("recompute", "overlap")),
]


def run_steps(state: BuildState, steps: list[Step] | None = None) -> BuildState:
    """Run ``steps`` (default :data:`BUILD_STEPS`) on ``state`` in order, checking between them."""
    steps = BUILD_STEPS if steps is None else steps
    for step in steps:
        missing = [n for n in step.needs if n not in state.ran]
        if missing:
            raise AutoparInternalError(f"build step {step.name!r} reads the results of step(s) {missing}, which "
                                       f"have not run before it: the step list (autopar/build/steps.py) is out of "
                                       f"order or incomplete")
        start, reported = time.perf_counter(), reported_seconds()
        step.run(state)
        state.ran.append(step.name)
        if step.rewrites:
            check_graphs(state, after=step.name)
        if step.name not in ("mesh", "schedule", "capacity"):     # instant: not worth a line
            inner = reported_seconds() - reported     # its capture and plan, said as they ended
            setup_stage(step.name, time.perf_counter() - start - inner)
        log.debug("step %-9s %6.3fs", step.name, time.perf_counter() - start)
    if state.module is None:
        raise AutoparInternalError("the build made no module: the step list (autopar/build/steps.py) lacks its "
                                   "last step, 'module'")
    return state


def check_graphs(state: BuildState, *, after: str) -> None:
    """Each graph the build holds lints and every op node keeps its autopar record."""
    for gm in state.graphs():
        try:
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001 - re-raised with the step's name
            raise AutoparInternalError(f"graph failed lint after build step {after!r}: {exc}") from exc
        for node in gm.graph.nodes:
            if node.op == "call_function" and META_KEY not in node.meta:
                raise AutoparInternalError(f"node {node.name!r} has no autopar record after build step {after!r}")
