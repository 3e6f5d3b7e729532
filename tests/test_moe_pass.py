"""MoE regions: router, dispatch, experts and combine found from the graph."""
from __future__ import annotations

import torch
from torch import nn

from autopar import models
from autopar.models.moe import expert_capacity
from autopar.core.meta import evaluate, graph_info, info
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


def test_expert_parallelism_plans_each_region():
    """Fixed capacity (the zoo) keeps its buffer exchange; experts that every token runs,
    masked by the routing weights, are not routed: that region runs dense, with the reason;
    a model without MoE layers has nothing for an ep axis to split."""
    from autopar.core.errors import ConfigError
    from autopar.passes.ep_rewrite import plan_regions
    import pytest

    model = models.build("moe", {"layers": 1, "experts": 4, "top_k": 2}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    assert [p.kind for p in plan_regions(analysed(model, args, dims))] == ["capacity"]
    (masked,) = plan_regions(analysed(Wrapper(), (torch.randn(5, 8),)))
    assert masked.kind == "dense" and "top-k" in masked.reason
    model = models.build("llama", {"layers": 1}, device="meta")
    args, dims = models.example_inputs(model, 2, 8)
    with pytest.raises(ConfigError, match="recognised none"):
        plan_regions(analysed(model, args, dims))


class GroupRouted(nn.Module):
    """DeepSeek-style: sigmoid scores, a top-k over expert groups then over the chosen
    groups' experts, weights gathered from the scores; a shared expert every token runs;
    the routed experts either a ModuleList run in a Python loop or stacked [E, ...] weights
    gathered per row (transformers' batched_mm)."""

    def __init__(self, h: int = 8, e: int = 4, stacked: bool = False) -> None:
        super().__init__()
        self.e, self.stacked = e, stacked
        self.gate = nn.Linear(h, e, bias=False)
        self.shared = nn.Sequential(nn.Linear(h, 2 * h), nn.SiLU(), nn.Linear(2 * h, h))
        if stacked:
            self.w1 = nn.Parameter(torch.randn(e, 2 * h, h) * 0.3)
            self.w2 = nn.Parameter(torch.randn(e, h, 2 * h) * 0.3)
        else:
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h))
                                         for _ in range(e))

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        groups = scores.view(-1, 2, self.e // 2).topk(1, dim=-1).values.sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(1, dim=-1).indices, 1.0)
        masked = scores.masked_fill(~keep.repeat_interleave(self.e // 2, dim=1).bool(), 0.0)
        idx = masked.topk(2, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        if self.stacked:
            rows = x.repeat_interleave(2, dim=0)
            flat = idx.reshape(-1)
            hid = torch.relu(torch.bmm(self.w1[flat], rows.unsqueeze(-1))).squeeze(-1)
            out = torch.bmm(self.w2[flat], hid.unsqueeze(-1)).squeeze(-1)
            routed = (out * w.reshape(-1, 1)).view(-1, 2, x.shape[-1]).sum(1)
        else:
            routed = torch.zeros_like(x)
            for i, ex in enumerate(self.experts):
                tok, slot = torch.where(idx == i)
                routed = routed.index_add(0, tok, ex(x[tok]) * w[tok, slot, None])
        return routed + self.shared(x)


def test_group_routed_experts_with_a_shared_expert_are_dropless():
    from autopar.passes.ep_dropless import check_dropless
    from autopar.passes.ep_rewrite import plan_regions

    for stacked in (False, True):
        torch.manual_seed(0)
        model = GroupRouted(stacked=stacked)
        gm = analysed(model, (torch.randn(12, 8),))
        (r,) = graph_info(gm).moe_regions
        assert r.num_experts == 4 and r.top_k == 2 and r.router_weight == "gate.weight"
        assert not any(p.startswith("shared.") for p in r.expert_params)      # the shared expert is dense
        shared = [n for n in gm.graph.nodes if info(n).fqn.startswith("shared")]
        assert shared and all(info(n).moe_role is None for n in shared)
        (plan,) = plan_regions(gm)
        assert plan.kind == "dropless" and plan.layer.stacked == stacked
        assert len(plan.layer.chains) == (1 if stacked else 4)
        assert check_dropless(gm, plan.layer, dict(model.named_parameters())) < 1e-5
