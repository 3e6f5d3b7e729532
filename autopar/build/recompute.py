"""The recompute step: which runs of each graph's nodes re-run in backward
(:mod:`autopar.runtime.recompute`: ``selective``, the attention cores; ``full``, every layer;
``layers:K``, the first K layers of each pipeline stage, of the model without one).

Regions are taken over the model's own ops, before the data step adds its nodes (the runtime
runs a data-axis node that lands inside a region just before it). With a pipeline each of this
rank's stages gets its share of the whole model's layers; without one the whole graph's regions
wait on the state for the module step.
"""
from __future__ import annotations

from autopar.build.state import BuildState
from autopar.core.plans import recompute_layers
from autopar.runtime.recompute import layer_members, regions


def recompute_step(s: BuildState) -> None:
    mode = s.request.recompute
    if s.request.pipelined:
        layers = layer_members(s.gm) if mode in ("full", "pointwise") or recompute_layers(mode) else ()
        for st in s.stages:
            st.set_recompute(mode, layers)      # "none": the eager attention cores only
        return
    s.regions = regions(s.gm, mode)
