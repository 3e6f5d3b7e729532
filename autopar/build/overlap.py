"""The overlap step: schedule the data axes' nodes of the whole graph (:func:`autopar.passes.dp_rewrite.schedule`):
each gradient bucket's reduction issued as soon as its gradients exist, each wait as late as
possible, ZeRO-3 gathers just ahead of first use (only those with ``overlap=False``).

It applies where the data step put the data axes into the graph (no pipeline); a pipeline's
data axes work per step between the stages' passes (:mod:`autopar.runtime.stage_dp`).
"""
from __future__ import annotations

from autopar.build.state import BuildState
from autopar.passes.dp_rewrite import schedule


def overlap_step(s: BuildState) -> None:
    if s.data_nodes:
        schedule(s.gm, overlap=s.plan.overlap)
