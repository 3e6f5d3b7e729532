"""The simulator prices mixture-of-experts layers as the runtime runs them (cost/hybrid.py,
cost/model_facts.py, runtime/ep.py): model FLOPs on routed tokens (capacity padding is hardware
work only); the dropless layer's routed pairs, its two overlapped token chunks and its two-hop
exchange across nodes; DualPipeV's paired halves hiding each other's exchanges; expert tensor
parallelism beside an expert axis. Split from
tests/test_cost_fidelity.py; the same fixtures."""
from __future__ import annotations

import pytest

from autopar.cli.workload import capture_workload, load_workload
from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate, info
from autopar.cost.cluster import Cluster
from autopar.cost.hybrid import Config, ModelFacts, simulate

A100 = "a100"


@pytest.fixture(scope="module")
def node8():
    return Cluster.from_spec("1x8", hardware=A100)


def _score(facts, cluster, batch, **kw):
    return simulate(facts, cluster, Config(**{"tp": 1, "pp": 1, "micro_batch": 1, **kw}), batch=batch)


def test_model_flops_count_routed_tokens_not_capacity_padding(node8):
    # E4 (in part): the experts run on experts x capacity slots (capacity factor 1.25: a fifth
    # of them padding); model FLOPs and MFU count the routed tokens' work, hardware FLOPs all
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "2"})
    f = ModelFacts(capture_workload(w), seq=1024, dtype="bf16")
    (region, *_) = f._regions.values()
    at = f.sizes(1)
    slots = float(evaluate(region.capacity, at)) * region.num_experts
    share = 1024 * region.top_k / slots
    assert 0.75 < share < 0.85                       # capacity factor 1.25
    expert = sum(float(evaluate(info(n).flops_fwd, at)) + float(evaluate(info(n).flops_bwd, at))
                 for n in f.gm.graph.nodes if info(n).moe_role == "expert")
    s = _score(f, node8, 8, dp=8)
    assert s.hw_flops - s.model_flops == pytest.approx(8 * expert * (1 - share), rel=1e-9)
    assert s.mfu == pytest.approx(s.model_flops / s.step_time_s / 8 / node8.device.peak("bf16"), rel=1e-9)


def test_dropless_routing_computes_and_sends_only_routed_tokens(node8):
    # E4: the runtime's dropless layer (runtime/ep.py) sends each routed (token, expert) pair
    # once; priced so, the experts' time and the exchange shrink by the routed share and the
    # model FLOPs equal the capacity pricing's routed count
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "2"})
    gm = capture_workload(w)
    cap, drop = (ModelFacts(gm, seq=1024, dtype="bf16", moe_routing=r) for r in ("capacity", "dropless"))
    axes = (("pp", 1), ("dp", 8), ("tp", 1))
    bc, bd = cap.parts(1, 1, node8, axes)[0]["block"], drop.parts(1, 1, node8, axes)[0]["block"]
    (region, *_) = cap._regions.values()
    share = 1024 * region.top_k / (float(evaluate(region.capacity, cap.sizes(1))) * region.num_experts)
    assert bd.a2a_bytes == pytest.approx(share * bc.a2a_bytes, rel=1e-9)
    assert bd.expert_fwd == pytest.approx(share * bc.expert_fwd, rel=1e-9) and bd.padding_flops == 0
    sc, sd = (simulate(f, node8, Config(dp=8, tp=1, pp=1, micro_batch=1, ep=4), batch=8) for f in (cap, drop))
    assert sd.model_flops == pytest.approx(sc.model_flops, rel=1e-9) and sd.hw_flops < sc.hw_flops
    assert sd.step_time_s < sc.step_time_s
    with pytest.raises(ConfigError, match="routing"):
        ModelFacts(gm, seq=1024, moe_routing="tokens")


def test_expert_tensor_parallelism_splits_the_experts_work_beside_an_expert_axis(node8):
    # MoE layouts: beside an expert axis (no pipeline) the build lets the tensor axis split the
    # fixed-capacity experts off their expert dim (passes/moe.expert_tensor_pin): each tensor
    # rank computes and holds 1/tp of its experts, not the whole experts for the whole batch
    w = load_workload("moe", batch=1, seq=1024, overrides={"layers": "2", "hidden": "512", "experts": "8"})
    f = ModelFacts(capture_workload(w), seq=1024, dtype="bf16")
    axes = (("pp", 1), ("dp", 2), ("tp", 4))
    blk = f.parts(4, 1, node8, axes, expert_axis=True)[0]["block"]
    assert blk.expert_fwd < 0.5 * blk.expert_fwd1          # split over the 4 tensor ranks
    s = simulate(f, node8, Config(dp=2, tp=4, pp=1, micro_batch=1, ep=2), batch=8)
    numel = f.param_numel(4, f.parts(4, 1, node8, axes, expert_axis=True)[1])
    assert numel["expert"] < 0.5 * numel["expert_whole"]
    whole_pp = simulate(f, node8, Config(dp=2, tp=2, pp=2, micro_batch=1, ep=2), batch=8)   # inside a pipeline: whole
    assert s.memory["params"] < whole_pp.memory["params"]


def test_the_expert_table_offers_expert_tensor_parallelism_beside_ep(node8):
    # autopar plan --pp 1's expert choices (cost/ep_planner.py): with ep, tp inside the experts
    # is offered where the runtime runs it (fixed-capacity layers), and it divides their compute
    from autopar.cost.ep_planner import plan_experts
    w = load_workload("moe", batch=1, seq=256, overrides={"layers": "2", "hidden": "256", "experts": "8"})
    gm = capture_workload(w)
    choices = plan_experts(gm, cluster=node8, dp=4, tp=2, sizes={"batch": 2, "seq": 256})
    by = {(c.ep, c.tp_inside): c for c in choices}
    assert (2, True) in by and (4, True) in by
    assert by[(2, True)].compute_s == pytest.approx(by[(2, False)].compute_s / 2)
    assert by[(2, True)].state_bytes == pytest.approx(by[(2, False)].state_bytes / 2)


def test_a_dropless_exchange_overlaps_its_experts_in_chunks(node8):
    # E4: the runtime's dropless layer (runtime/ep.DroplessMoE) sends its tokens in two chunks
    # whose exchanges travel while the other chunk's experts compute; priced by the same order
    # (every dispatch first, each combine after its chunk's experts, one link)
    from autopar.core.options import DISPATCH_CHUNKS, ExpertOptions
    from autopar.cost.hybrid import overlapped_exchange
    from autopar.runtime.ep import EPRuntime
    assert DISPATCH_CHUNKS == 2 == ExpertOptions().dispatch_chunks
    assert EPRuntime.__dataclass_fields__["chunks"].default == DISPATCH_CHUNKS
    assert overlapped_exchange(1.0, 4.0, 1) == pytest.approx(2.0)       # one chunk: both exposed
    assert overlapped_exchange(1.0, 4.0, 2) == pytest.approx(2.0)       # half of each hidden
    assert overlapped_exchange(1.0, 8.0, 2) == pytest.approx(2.0)       # pieces of 1 at either end
    assert overlapped_exchange(0.5, 4.0, 2) == pytest.approx(1.0)
    assert overlapped_exchange(4.0, 1.0, 2) == pytest.approx(15.0)      # link-bound: the link's 16 s less the work
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "2"})
    gm = capture_workload(w)
    cap, drop = (ModelFacts(gm, seq=1024, dtype="bf16", moe_routing=r) for r in ("capacity", "dropless"))
    axes = (("pp", 1), ("dp", 8), ("tp", 1))
    bd = drop.parts(1, 1, node8, axes)[0]["block"]
    c = Config(dp=8, tp=1, pp=1, micro_batch=1, ep=4)
    s = simulate(drop, node8, c, batch=8)
    from autopar.cost.comm import collective_time
    ep_axes = (("pp", 1), ("dp", 2), ("ep", 4), ("tp", 1))
    whole = collective_time("all_to_all", bd.a2a_bytes, node8, ep_axes, "ep")
    assert s.parts["ep_comm_per_block_s"] < 4 * whole                  # not all four exchanges exposed
    piece = collective_time("all_to_all", bd.a2a_bytes / 2, node8, ep_axes, "ep")
    counts = collective_time("all_to_all", 8.0 * 4 * 2, node8, ep_axes, "ep")
    want = sum(counts + overlapped_exchange(piece, x, 2) + node8.device.comm_contention
               * (4 * piece - overlapped_exchange(piece, x, 2)) for x in (bd.expert_fwd, bd.expert_bwd))
    assert s.parts["ep_comm_per_block_s"] == pytest.approx(want, rel=1e-9)
    sc = simulate(cap, node8, c, batch=8)                              # capacity layers: exposed
    bc = cap.parts(1, 1, node8, axes)[0]["block"]
    assert sc.parts["ep_comm_per_block_s"] == pytest.approx(
        4 * collective_time("all_to_all", bc.a2a_bytes, node8, ep_axes, "ep"), rel=1e-9)


def test_an_expert_axis_across_nodes_is_priced_in_two_hops():
    # E4: across nodes the runtime's dropless layer takes two hops (ExpertOptions.dispatch="auto",
    # runtime/ep.DroplessMoE._two_hop): a token crosses once to each node its experts are on,
    # then its pairs go to their owners inside the node; a routing limited to fewer nodes
    # (DeepSeek-V3's) sends fewer rows across
    from autopar.cost.comm import flat_time
    from autopar.cost.hybrid import nodes_reached, overlapped_exchange
    assert nodes_reached(2, 2, 1) == pytest.approx(1.0)                 # both experts on one node
    assert nodes_reached(8, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    assert nodes_reached(8, 8, 4) == pytest.approx(4 * (1 - 0.75 ** 8))
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "2", "experts": "16"})
    gm = capture_workload(w)
    free, limited = (ModelFacts(gm, seq=1024, dtype="bf16", moe_routing="dropless", moe_node_limit=lim)
                     for lim in (None, 1))
    two = Cluster.from_spec("2x8", hardware=A100)
    c = Config(dp=16, tp=1, pp=1, micro_batch=1, ep=16)
    sf, sl = (simulate(f, two, c, batch=16) for f in (free, limited))
    assert sl.parts["ep_comm_per_block_s"] < sf.parts["ep_comm_per_block_s"]
    blk = free.parts(1, 1, two, (("pp", 1), ("dp", 1), ("ep", 16), ("tp", 1)))[0]["block"]
    assert blk.top_k == 2
    piece = flat_time("all_to_all", blk.a2a_bytes / 2 * nodes_reached(2, 2) / 2, 2, two.inter)
    meta = 2 * (3 * flat_time("all_to_all", 16.0, 2, two.inter) + flat_time("all_to_all", 64.0, 8, two.intra))
    on_node = 4 * flat_time("all_to_all", blk.a2a_bytes / 2, 8, two.intra)
    want = 0.0
    for x in (blk.expert_fwd, blk.expert_bwd):
        shown = overlapped_exchange(piece, x + on_node, 2)
        want += meta + on_node + shown + two.device.comm_contention * (4 * piece - shown)
    assert sf.parts["ep_comm_per_block_s"] == pytest.approx(want, rel=1e-9)
    one_node = simulate(free, Cluster.from_spec("1x16", hardware=A100), c, batch=16)   # one node: one hop
    assert one_node.parts["ep_comm_per_block_s"] != pytest.approx(want, rel=1e-3)
    with pytest.raises(ConfigError, match="node"):
        ModelFacts(gm, seq=1024, moe_routing="dropless", moe_node_limit=0)


def test_dualpipev_hides_paired_exchanges_under_the_other_halfs_compute(node8):
    # issue 37, the overlapped dispatch: DualPipeV's steady state runs one micro-batch's forward
    # beside another's backward (runtime/pp_overlap.py); the pairs' expert exchanges travel
    # under the partner's compute, still slowing it by comm_contention; unpaired actions and a
    # model without experts hide nothing
    from autopar.cost.pp_dualpipe import dualpipe_v
    from autopar.cost.pp_sim import StageCosts
    from autopar.cost.pp_sim import simulate as run
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "4"})
    facts = ModelFacts(capture_workload(w), seq=1024, dtype="bf16", moe_routing="dropless")
    c = Config(dp=4, tp=1, pp=2, micro_batch=1, ep=4, schedule="dualpipev", virtual=2, recompute="full")
    s = simulate(facts, node8, c, batch=16)
    p = s.parts
    plain = run(dualpipe_v(2, 4), StageCosts(tuple(p["stage_fwd_s"]), tuple(p["stage_bwd_s"]), p2p_s=p["p2p_s"]))
    assert s.parts["pipeline_s"] < plain.step_time_s                    # the pairs hid something
    ep = p["ep_comm_per_block_s"]
    pairs = sum(a.kind == "F" for a in dualpipe_v(2, 4).overlapped)     # pairs per step, over every device
    ceiling = pairs * 2 * max(p["stage_layers"]) * ep                   # a pair hides at most both halves' exchanges
    assert plain.step_time_s - s.parts["pipeline_s"] < ceiling * (1 - node8.device.comm_contention) + 1e-12
    dense = load_workload("llama3-8b", batch=1, seq=1024, overrides={"layers": "4"})
    dfacts = ModelFacts(capture_workload(dense), seq=1024, dtype="bf16")
    d = simulate(dfacts, node8, Config(dp=4, tp=1, pp=2, micro_batch=1, schedule="dualpipev", virtual=2), batch=16)
    q = d.parts
    same = run(dualpipe_v(2, 4), StageCosts(tuple(q["stage_fwd_s"]), tuple(q["stage_bwd_s"]), p2p_s=q["p2p_s"]))
    assert q["pipeline_s"] == pytest.approx(same.step_time_s, rel=1e-12)  # nothing to hide
    for bad in ({"tp": 2, "dp": 2, "ep": 2}, {"zero_stage": 3}):        # what the two threads cannot run
        kw = {"dp": 4, "tp": 1, "pp": 2, "micro_batch": 1, "ep": 4, "schedule": "dualpipev", "virtual": 2, **bad}
        with pytest.raises(ConfigError, match="dualpipev"):
            simulate(facts, node8, Config(**kw), batch=16)


def test_a_tensor_axis_beside_the_expert_axis_is_folded_into_it(node8, monkeypatch):
    # issue 37, EP beyond the data axis: dropless layers deal their experts over ep x tp (the
    # runtime's ExpertOptions.fold="auto"); each tensor rank computes and sends its share of the
    # tokens, and the outputs (backward: the tokens' gradients) are gathered over tp, exposed
    from dataclasses import replace
    from autopar.cost.comm import collective_time
    from autopar.cost.hybrid import _with_experts, expert_fold
    w = load_workload("mixtral-8x7b", batch=1, seq=1024, overrides={"layers": "2", "experts": "16"})
    gm = capture_workload(w)
    drop, cap = (ModelFacts(gm, seq=1024, dtype="bf16", moe_routing=r) for r in ("dropless", "capacity"))
    c = Config(dp=2, tp=4, pp=1, micro_batch=1, ep=2)
    assert expert_fold(drop, c) == 4 and expert_fold(cap, c) == 1                  # dropless only
    assert expert_fold(drop, replace(c, dp=4, tp=2, ep=4)) == 2
    assert expert_fold(drop, Config(dp=1, tp=8, pp=1, micro_batch=1, ep=1)) == 1   # no expert axis: no fold
    axes = (("pp", 1), ("dp", 2), ("tp", 4))
    blk = drop.parts(4, 1, node8, axes, expert_axis=True)[0]["block"]
    whole, folded = (_with_experts(blk, c, node8, "dropless", None, t) for t in (1, 4))
    assert folded.expert_fwd == pytest.approx(whole.expert_fwd / 4) and folded.a2a_bytes == pytest.approx(blk.a2a_bytes / 4)
    assert folded.fwd == pytest.approx(whole.fwd - 0.75 * whole.expert_fwd)      # no tensor rank repeats another
    gather = collective_time("all_gather", blk.a2a_bytes / blk.top_k, node8, (("pp", 1), ("dp", 1), ("ep", 2), ("tp", 4)),
                             "tp")
    assert gather > 0 and folded.comm_fwd > blk.comm_fwd + gather                  # gather + the exchange
    from autopar.cost import hybrid
    s_fold = simulate(drop, node8, c, batch=8)
    monkeypatch.setattr(hybrid, "expert_fold", lambda facts, config: 1)           # as ExpertOptions(fold="off")
    s_off = simulate(drop, node8, c, batch=8)
    assert s_fold.memory["params"] < s_off.memory["params"]                        # 1/8 of the experts a rank, not 1/2
    assert s_fold.parts["block_fwd_s"] < s_off.parts["block_fwd_s"]
