"""Expert-parallel rewrite: all-to-all exchanges around each MoE region's experts.

Reads the MoE pass's roles and regions. :func:`plan_regions` says how each region is split:

- ``capacity``: experts stacked ``[E, ...]`` behind a fixed-capacity token buffer
  ``[E, C, h]`` (the zoo's MoE). Every value that crosses from the dispatch side into the
  experts goes through an ``autopar_ep_dispatch`` node and every value that crosses from the
  experts into the combine side through an ``autopar_ep_combine`` node
  (:mod:`autopar.runtime.ep`); between them the expert ops run on this rank's ``E/n`` experts
  and the rows of all ranks.
- ``dropless``: every routed token is computed (transformers' Mixtral, Qwen-MoE, OLMoE,
  DeepSeek; a Python loop over expert modules). The nodes that compute the layer's output
  from the tokens and the routing top-k (:mod:`autopar.passes.ep_dropless`) become one
  ``autopar_ep_moe`` node: an all-to-all with variable splits to the experts' owners, the
  owner's experts, and back.
- ``dense``: anything else. It runs as written on every rank (each rank holds every expert:
  correct, only not split), and the reason is kept for the one-line warning.

Each rank stores its experts only: the rows of the stacked weights it owns, or the modules
of the experts it owns (the others' parameters leave its graph).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from autopar.core.errors import AutoparInternalError, ConfigError
from autopar.passes.ep_dropless import DroplessLayer, LocalExperts, Unsupported, find_dropless
from autopar.core.meta import MoERegion, graph_info, info, set_info
from autopar.runtime.ep import DroplessMoE, EPRuntime, autopar_ep_combine, autopar_ep_dispatch, autopar_ep_moe


@dataclass
class RegionPlan:
    """How one MoE region is split over the expert axis."""

    region: MoERegion
    kind: Literal["capacity", "dropless", "dense"]
    layer: DroplessLayer | None = None
    reason: str = ""                  # why a region runs dense


def expert_regions(gm: fx.GraphModule) -> list[MoERegion]:
    """The graph's MoE regions (a ConfigError when it has none: an ep axis needs one)."""
    regions = graph_info(gm).moe_regions
    if not regions:
        topks = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default)
        named = sorted({f.rsplit(".", 1)[0] for f in graph_info(gm).param_fqns if "expert" in f.lower()})
        got = (f"{topks} topk op(s), none choosing between expert weights"
               + (f"; parameters named like experts under {', '.join(named[:3])}{' ...' if len(named) > 3 else ''}"
                  " (routed some other way: argmax, sampling)" if named else ""))
        raise ConfigError("expert parallelism needs a mixture-of-experts layer autopar recognises, and it "
                          "recognised none: a layer is found from a topk over a learned gate whose indices pick "
                          "the expert weights", where="mesh axis ep", got=got,
                          fix="drop the ep axis (tensor and data axes run the model as it is), or route with "
                              "torch.topk over the gate's scores")
    return regions


def plan_regions(gm: fx.GraphModule) -> list[RegionPlan]:
    """Each region's kind (module docstring)."""
    out = []
    for r in expert_regions(gm):
        if r.capacity is not None and _stacked(gm, r):
            out.append(RegionPlan(r, "capacity"))
            continue
        try:
            out.append(RegionPlan(r, "dropless", layer=find_dropless(gm, r)))
        except Unsupported as exc:
            out.append(RegionPlan(r, "dense", reason=str(exc)))
    return out


def _stacked(gm: fx.GraphModule, r: MoERegion) -> bool:
    phs = {info(n).target_fqn: n for n in gm.graph.nodes if n.op == "placeholder"}
    lead = {int(info(phs[f]).values[0].shape[0]) for f in r.expert_params
            if f in phs and len(info(phs[f]).values[0].shape) == 3}
    return lead == {r.num_experts}


def ep_rewrite(gm: fx.GraphModule, plans: list[RegionPlan], runtimes: dict[str, EPRuntime]) -> dict[str, str]:
    """Rewrite every capacity and dropless region (``runtimes``: region fqn -> its expert
    axis and placement). Returns how each kept expert parameter is stored on this rank:
    ``"rows"`` (the owned rows of a stacked weight) or ``"whole"`` (an owned expert's own)."""
    stored: dict[str, str] = {}
    for plan in plans:
        if plan.kind == "capacity":
            _rewrite_capacity(gm, plan.region, runtimes[plan.region.fqn].id)
            stored.update({f: "rows" for f in plan.region.expert_params})
        elif plan.kind == "dropless":
            stored.update(_rewrite_dropless(gm, plan.layer, runtimes[plan.region.fqn]))
    gm.graph.lint()
    gm.recompile()
    return stored


def _rewrite_capacity(gm: fx.GraphModule, region: MoERegion, rid: int) -> None:
    nodes = [n for n in gm.graph.nodes if info(n).moe_region == region.fqn and n.op == "call_function"]
    expert = {n for n in nodes if info(n).moe_role == "expert"}
    into = [n for n in gm.graph.nodes if n not in expert and info(n).kind != "param"
            and any(u in expert for u in n.users)]
    out_of = [n for n in expert if any(u not in expert for u in n.users)]
    if not into or not out_of:
        raise ConfigError(f"could not find where tokens enter and leave the experts of {region.fqn}",
                          where=region.fqn, fix="use tp for this model's experts")
    for n, fn, users in [(n, autopar_ep_dispatch, [u for u in n.users if u in expert]) for n in into] + \
                        [(n, autopar_ep_combine, [u for u in n.users if u not in expert]) for n in out_of]:
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(fn, (n, rid))
        rec = dataclasses.replace(info(n), made_by="ep_rewrite", flops_fwd=0, flops_bwd=0,
                                  saved_bytes=0, moe_role="dispatch" if fn is autopar_ep_dispatch else "combine")
        set_info(new, rec)
        for u in users:
            u.replace_input_with(n, new)


def _rewrite_dropless(gm: fx.GraphModule, layer: DroplessLayer, rt: EPRuntime) -> dict[str, str]:
    """One ``autopar_ep_moe`` node in place of the layer's replaced nodes."""
    experts = LocalExperts(layer, rt.owned())
    phs = {info(n).target_fqn: n for n in gm.graph.nodes if n.op == "placeholder"}
    moe = DroplessMoE(rt, experts, out_dtype=info(layer.y).values[0].dtype)
    with gm.graph.inserting_before(layer.y):
        new = gm.graph.call_function(autopar_ep_moe, (layer.x, layer.ids, layer.weights,
                                                      [phs[f] for f in experts.param_order], moe.id))
    set_info(new, dataclasses.replace(info(layer.y), made_by="ep_rewrite", moe_role="combine"))
    layer.y.replace_all_uses_with(new)
    for n in reversed(layer.side):
        gm.graph.erase_node(n)
    for n in reversed(layer.replaced):
        if not n.users:
            gm.graph.erase_node(n)
    leftover = [n.name for n in layer.replaced if not getattr(n, "_erased", False) and info(n).values]
    if leftover:
        raise AutoparInternalError(f"ep_rewrite: nodes of {layer.region.fqn} still used after the rewrite: "
                                   f"{leftover[:4]}")
    for f in layer.params:                       # experts this rank does not own leave its graph
        if f not in experts.param_order and not phs[f].users:
            gm.graph.erase_node(phs[f])
    return {f: "rows" if layer.stacked else "whole" for f in experts.param_order}


__all__ = ["RegionPlan", "expert_regions", "plan_regions", "ep_rewrite"]
