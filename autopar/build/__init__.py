"""The corridor from a plan to this rank's parallel module.

Every :func:`autopar.parallelize` call, whatever its mesh, runs the one step list of
``steps.py`` (:data:`~autopar.build.steps.BUILD_STEPS`) over one :class:`~autopar.build.state.BuildState`:

======== =============== =====================================================================
step     file            what it does
======== =============== =====================================================================
mesh     ``world.py``    the axes, this rank's place on them, a plan's settings
schedule ``pipeline.py`` a pipeline's schedule and micro-batch count (so one micro-batch is captured)
capacity ``experts.py``  an MoE capacity override, set before the capture
tensor   ``tensor.py``   capture, plan (or take the plan's) and rewrite the tensor axis
weights  ``world.py``    every rank takes rank 0's weights
experts  ``experts.py``  split the MoE layers' experts over ``ep`` and rewrite them for the exchange
pipeline ``pipeline.py`` cut the graph into stages and make this rank's stage modules
recompute``recompute.py`` the regions re-run in backward, per graph or per stage
data     ``data.py``     the data axes (buckets, ZeRO), mixed precision's fp32 masters
overlap  ``overlap.py``  schedule the data axes' nodes to overlap with compute
module   ``module.py``   the ParallelModule or PipelineModule over what the steps made
======== =============== =====================================================================

A step whose axis the mesh does not have does nothing; after the pipeline step the later ones
work on this rank's stages. ``prepare.py`` holds the capture and tensor-planning helpers the
front door shares (``autopar.plan``, ``autopar dump``), ``checks.py`` the checks of a plan
against a model, ``modes.py`` the train/eval mode switch of a captured graph.
"""
from __future__ import annotations

from typing import Any

from autopar.build.state import BuildRequest, BuildState
from autopar.build.steps import BUILD_STEPS, Step, run_steps


def build(request: BuildRequest) -> Any:
    """This rank's parallel module for ``request`` (every step of :data:`BUILD_STEPS`, in order)."""
    return run_steps(BuildState(request=request)).module


__all__ = ["BUILD_STEPS", "BuildRequest", "BuildState", "Step", "build", "run_steps"]

from autopar.core.lazy import submodules as _submodules  # noqa: E402

__getattr__ = _submodules(__name__)     # the other modules, imported on first use
