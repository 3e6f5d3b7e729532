"""Expert-parallel rewrite: all-to-all exchanges around each MoE region's experts.

Reads the MoE pass's roles. In a region whose experts are stacked weights ``[E, ...]``,
every value that crosses from the dispatch side into the experts (the ``[E, C, h]`` token
buffer) goes through an ``autopar_ep_dispatch`` node, and every value that crosses from the
experts into the combine side goes through an ``autopar_ep_combine`` node
(:mod:`autopar.runtime.ep`). Between them the expert ops run on this rank's ``E/n``
experts and the rows of all ranks; the stacked weights are stored as this rank's experts
only. Experts written as ``E`` separate modules are recognised by the MoE pass but not
rewritten here (a clear error says so).
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from autopar.errors import ConfigError
from autopar.passes.meta import MoERegion, graph_info, info, set_info
from autopar.runtime.ep import autopar_ep_combine, autopar_ep_dispatch


def expert_regions(gm: fx.GraphModule) -> list[MoERegion]:
    """The MoE regions expert parallelism can split (stacked expert weights)."""
    regions = graph_info(gm).moe_regions
    if not regions:
        raise ConfigError("expert parallelism needs a mixture-of-experts layer, and the graph has none",
                          where="mesh axis ep",
                          fix="drop the ep axis, or check that the router's top-k picks between expert weights")
    phs = {info(n).target_fqn: n for n in gm.graph.nodes if n.op == "placeholder"}
    for r in regions:
        lead = {int(info(phs[f]).values[0].shape[0]) for f in r.expert_params
                if f in phs and len(info(phs[f]).values[0].shape) == 3}
        if lead != {r.num_experts}:
            raise ConfigError(f"the experts of {r.fqn or '<root>'} are not one stacked weight [E, ...]",
                              where=r.fqn or "<root>", expected="expert weights shaped [num_experts, ...]",
                              got=str(sorted(r.expert_params)[:4]),
                              fix="store the experts as stacked parameters (as the zoo's MoE does), or use tp")
    return regions


def ep_rewrite(gm: fx.GraphModule, rids: dict[str, int]) -> list[str]:
    """Insert the exchanges of every region (``rids``: region fqn -> runtime id). Returns the
    expert parameters (state_dict keys) now stored per owner."""
    experts: list[str] = []
    for region in expert_regions(gm):
        rid = rids[region.fqn]
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
        experts.extend(region.expert_params)
    gm.graph.lint()
    gm.recompile()
    return experts


__all__ = ["expert_regions", "ep_rewrite"]
