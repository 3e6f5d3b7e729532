"""MoE regions: router, dispatch, experts and combine found from the graph."""
from __future__ import annotations

import torch
from torch import nn

from autopar import models
from autopar.models.moe import expert_capacity
from autopar.passes.meta import evaluate, graph_info, info
from tests.conftest import analysed


def test_zoo_moe_regions_roles_and_capacity():
    model = models.build("moe", {"layers": 2, "experts": 4, "top_k": 2, "capacity_factor": 1.25}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    gm = analysed(model, args, dims)
    regions = graph_info(gm).moe_regions
    assert len(regions) == 2
    r = regions[0]
    assert (r.num_experts, r.top_k) == (4, 2)
    assert r.router_weight.endswith("weight") and len(r.expert_params) == 3
    for batch, seq in ((1, 7), (3, 16)):
        assert evaluate(r.capacity, {"batch": batch, "seq": seq}) == expert_capacity(batch * seq, 4, 2, 1.25)
    roles = {}
    for n in gm.graph.nodes:
        if info(n).moe_region == r.fqn:
            roles.setdefault(info(n).moe_role, []).append(n)
    assert set(roles) == {"router", "dispatch", "expert", "combine"}
    assert any(n.target is torch.ops.aten.topk.default for n in roles["router"])
    assert any(n.target is torch.ops.aten.linear.default for n in roles["router"])
    assert sum(n.target is torch.ops.aten.bmm.default for n in roles["expert"]) == 3
    # dense layers (attention) are not part of any region
    attn = [n for n in gm.graph.nodes if ".attn" in info(n).fqn]
    assert attn and all(info(n).moe_role is None for n in attn)


class ListMoE(nn.Module):
    """Experts as a ModuleList, dense compute masked by routing weights (no stacked weight)."""

    def __init__(self, h: int = 8, e: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h))
                                     for _ in range(e))

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), 1, dim=-1)
        onehot = torch.nn.functional.one_hot(idx[..., 0], len(self.experts)).to(x.dtype) * w
        return sum(onehot[..., i:i + 1] * ex(x) for i, ex in enumerate(self.experts))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = ListMoE()

    def forward(self, x):
        return self.moe(self.inp(x))


def test_module_list_experts_are_a_region_too():
    gm = analysed(Wrapper(), (torch.randn(5, 8),))
    (r,) = graph_info(gm).moe_regions
    assert r.fqn == "moe" and r.num_experts == 3 and r.top_k == 1 and r.capacity is None
    assert r.router_weight == "moe.gate.weight"
    assert all(p.startswith("moe.experts.") for p in r.expert_params)
    assert all(info(n).moe_role is None for n in gm.graph.nodes if info(n).fqn == "inp")


def test_dense_model_has_no_regions():
    model = models.build("llama", {"layers": 1}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    assert graph_info(analysed(model, args, dims)).moe_regions == []


def test_expert_parallelism_refuses_what_it_cannot_split():
    from autopar.errors import ConfigError
    from autopar.passes.ep_rewrite import expert_regions
    import pytest

    with pytest.raises(ConfigError, match="not one stacked weight"):
        expert_regions(analysed(Wrapper(), (torch.randn(5, 8),)))
    model = models.build("llama", {"layers": 1}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    with pytest.raises(ConfigError, match="has none"):
        expert_regions(analysed(model, args, dims))
