"""cost/dp_modes.py prices the data-axis modes (bytes, calls, seconds, topology-aware gossip) on
the planner's own model, and ``autopar plan`` offers them beside the chosen plan, never in it."""
from __future__ import annotations

import json
import math

import pytest

from autopar.cli import main
from autopar.cost.cluster import Cluster
from autopar.cost.dp_modes import (PUBLISHED_RESNET50, RESNET50_NUMEL, label, price_modes, resnet50_prediction,
                                   worth_showing)
from autopar.cost.hybrid import Config
from autopar.cost.comm import collective_time
from autopar.cost.step_terms import DataBytes, bucket_count, data_collective, lone_stage_data_axis
from autopar.core.dp_mode import DataMode
from autopar.core.errors import ConfigError

A100 = Cluster.from_spec("32x8", hardware="a100")
NUMEL = 10_000_000


def by_label(prices):
    return {label(p.mode): p for p in prices}


def price(numel=NUMEL, dp=256, cluster=A100, **kw):
    kw.setdefault("step_compute_s", 0.1)
    return by_label(price_modes(numel, dp, cluster, **kw))


@pytest.mark.parametrize("dp,tp,pp", [(256, 1, 1), (32, 8, 1), (64, 4, 1), (16, 8, 2), (8, 1, 32), (2, 2, 64)])
def test_allreduce_price_is_the_planners_data_axis_all_reduce(dp, tp, pp):
    c = Config(dp=dp, tp=tp, pp=pp, micro_batch=1)
    axes = (("pp", pp), ("dp", dp), ("tp", tp))
    ar = price(dp=dp, inner=tp)["allreduce"]
    # one call per bucket, as the runtime cuts them
    b = DataBytes(grads=4.0 * NUMEL, params=4.0 * NUMEL, expert_grads=0.0, expert_params=0.0)
    calls = bucket_count(A100, axes, b)
    assert calls > 1 and ar.collectives_per_step == calls
    assert ar.comm_s == pytest.approx(data_collective("all_reduce", 4.0 * NUMEL, 0.0, c, A100, axes, calls),
                                      rel=1e-12)
    assert ar.comm_s > 0 and ar.exposed_s == ar.comm_s      # no planner figure given: all of it exposed
    # without a pipeline the runtime reduces every micro-batch's backward: m exchanges per step
    if pp == 1:
        total, _ = lone_stage_data_axis(c, A100, axes, b, 3, 0.0, 0.0)
        assert price(dp=dp, inner=tp, exchanges_per_step=3)["allreduce"].comm_s == pytest.approx(total, rel=1e-12)


def test_bytes_per_step_follow_the_runtimes_accounting():
    n, dp = 1000, 4
    p = price(numel=n, dp=dp, modes=[DataMode("compressed", compressor="topk", ratio=1.0),
                                     DataMode("compressed", compressor="randk", ratio=0.01),
                                     DataMode("compressed", compressor="quantize", levels=5)])
    assert p["allreduce"].bytes_per_step == 2 * 3 / 4 * 4 * n             # ring all-reduce of fp32 entries
    assert p["compressed(topk, ratio=1)"].bytes_per_step == 3 * 8 * n     # all-gather of value + int32 index
    assert p["compressed(randk, ratio=0.01)"].bytes_per_step == 2 * 3 / 4 * 4 * 10
    # all-reduces of an int8 level each (4 ranks x 5 levels fit) and of an fp32 scale per 512 entries
    assert p["compressed(quantize, levels=5)"].bytes_per_step == 2 * 3 / 4 * (n + 4 * 2)
    assert p["compressed(topk, ratio=1)"].collectives_per_step == 2 and p["allreduce"].collectives_per_step == 1
    # top-k of everything over 256 ranks all-gathers far more than all-reduce moves: it must not look cheaper
    big = price(modes=[DataMode("compressed", compressor="topk", ratio=1.0)])
    assert big["compressed(topk, ratio=1)"].comm_s > 50 * big["allreduce"].comm_s


def test_local_sgd_sends_a_quarter_every_step_at_h4():
    p = price(modes=[DataMode("local_sgd", sync_every=4), DataMode("local_sgd", sync_every=16)])
    ar = p["allreduce"]
    assert p["local_sgd(sync_every=4)"].bytes_per_step == pytest.approx(ar.bytes_per_step / 4, rel=1e-12)
    # the parameters are averaged as one flat tensor: one call (the gradients go in buckets)
    one = collective_time("all_reduce", 4.0 * NUMEL, A100, (("pp", 1), ("dp", 256), ("tp", 1)), "dp")
    assert p["local_sgd(sync_every=4)"].comm_s == pytest.approx(one / 4, rel=1e-12)
    assert p["local_sgd(sync_every=16)"].collectives_per_step == 1 / 16
    assert p["local_sgd(sync_every=4)"].saving_s == pytest.approx(ar.comm_s - one / 4, rel=1e-12)


def test_gossip_ring_bytes_do_not_grow_with_dp_while_allreduce_tends_to_twice():
    ring = DataMode("gossip", topology="ring")
    rows = [price(dp=dp, modes=[ring]) for dp in (4, 8, 64, 256)]
    assert {r["gossip(topology=ring)"].bytes_per_step for r in rows} == {2 * 4.0 * NUMEL}
    ar = [r["allreduce"].bytes_per_step / (4.0 * NUMEL) for r in rows]
    assert ar == sorted(ar) and ar[0] == 1.5 and 1.99 < ar[-1] < 2.0


def test_gossip_is_priced_per_link_on_the_layout():
    one_node = Cluster.from_spec("1x8", hardware="a100")
    nbytes = 4.0 * NUMEL
    inside = price(dp=8, cluster=one_node, modes=[DataMode("gossip")])["gossip(topology=ring)"]
    assert inside.per_link_bytes == {"intra": 2 * nbytes, "inter": 0.0}
    i = one_node.intra
    assert inside.comm_s == pytest.approx(i.base_latency_s + 2 * (i.hop_latency_s + nbytes / i.bandwidth))
    # 256 ranks on 32 nodes: the ranks at a node's edge send one of their two messages through the NIC
    across = price(modes=[DataMode("gossip"), DataMode("gossip", topology="exponential")])
    ring = across["gossip(topology=ring)"]
    assert ring.per_link_bytes == {"intra": nbytes, "inter": nbytes}
    e = A100.inter
    assert ring.comm_s == pytest.approx(e.base_latency_s + e.hop_latency_s + nbytes / e.bandwidth)
    assert ring.exposed_s == ring.comm_s         # averaged after the optimizer step: nothing hides it
    expo = across["gossip(topology=exponential)"]
    assert expo.collectives_per_step == 15 and expo.per_link_bytes["inter"] > 4 * nbytes
    assert expo.comm_s > 4 * ring.comm_s
    # tp=8 puts every data-axis neighbour on another node
    tp8 = price(dp=32, inner=8, modes=[DataMode("gossip")])["gossip(topology=ring)"]
    assert tp8.per_link_bytes == {"intra": 0.0, "inter": 2 * nbytes}
    # a global average every 4th step replaces a quarter of the rounds
    mixed = price(modes=[DataMode("gossip", global_every=4)])["gossip(topology=ring, global_every=4)"]
    one = collective_time("all_reduce", nbytes, A100, (("pp", 1), ("dp", 256), ("tp", 1)), "dp")
    assert mixed.comm_s == pytest.approx((3 * ring.comm_s + one) / 4)   # the global round: one flat tensor


def test_async_hides_its_all_reduce_under_staleness_steps_of_compute():
    ar = price(step_compute_s=0.0)["allreduce"].comm_s
    for s, compute in ((1, ar / 4), (2, ar / 4), (1, 2 * ar)):
        a = price(step_compute_s=compute, modes=[DataMode("async", staleness=s)])[f"async(staleness={s})"]
        assert a.comm_s == ar and a.exposed_s == pytest.approx(max(0.0, ar - s * compute))


def test_saving_is_against_the_planners_exposed_all_reduce_and_the_threshold():
    p = price(allreduce_exposed_s=0.0, modes=[DataMode("local_sgd", sync_every=4),
                                               DataMode("compressed", compressor="randk")])
    assert p["allreduce"].exposed_s == 0.0
    assert p["compressed(randk, ratio=0.01)"].exposed_s == 0.0     # exposed in all-reduce's proportion
    assert p["local_sgd(sync_every=4)"].saving_s < 0                 # its average is never hidden
    assert not any(worth_showing(x, 1.0) for x in p.values())
    q = price(allreduce_exposed_s=0.05, modes=[DataMode("local_sgd", sync_every=16)])["local_sgd(sync_every=16)"]
    assert q.saving_s == pytest.approx(0.05 - q.exposed_s)
    assert worth_showing(q, 10 * q.saving_s / 1.5) and not worth_showing(q, 10 * q.saving_s / 0.9)


def test_bad_layouts_are_config_errors():
    with pytest.raises(ConfigError, match="does not divide"):
        price_modes(NUMEL, 3, A100, step_compute_s=0.0)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        price_modes(NUMEL, 8, A100, step_compute_s=0.0, ranks_per_node=7)
    assert price_modes(NUMEL, 1, A100, step_compute_s=0.0)[1].comm_s == 0.0


def test_resnet50_prediction_is_the_model_not_a_fit():
    r = resnet50_prediction()
    v100 = Cluster.from_spec("32x8", hardware="v100")
    nbytes = 4.0 * RESNET50_NUMEL
    assert r["devices"] == 256 and r["published"] == PUBLISHED_RESNET50
    e = v100.inter
    assert r["gossip_ring_s"] == pytest.approx(e.base_latency_s + e.hop_latency_s + nbytes / e.bandwidth)
    axes = (("pp", 1), ("dp", 256), ("tp", 1))
    calls = bucket_count(v100, axes, DataBytes(grads=nbytes, params=nbytes, expert_grads=0.0, expert_params=0.0))
    assert r["allreduce_s"] == pytest.approx(data_collective("all_reduce", nbytes, 0.0, Config(dp=256, tp=1, pp=1,
                                             micro_batch=1), v100, axes, calls))
    assert r["gossip_exponential_s"] > r["gossip_ring_s"] > 0


PLAN = ("plan", "--model", "gpt2-small", "--cluster", "32x8", "--hardware", "a100", "--batch", "256", "--seq",
        "1024", "-q")


def test_plan_shows_the_data_axis_modes_and_never_chooses_one(capsys, tmp_path):
    assert main(list(PLAN)) == 0
    text = capsys.readouterr().out
    section = [ln for ln in text.splitlines() if ln.startswith("data-axis modes")]
    assert len(section) == 1 and "never chosen" in section[0]
    assert ("none would shorten the step by more than 10 %" in section[0]) or section[0].endswith("):")
    saved = tmp_path / "plan.json"
    assert main([*PLAN, "--json", "--save-plan", str(saved)]) == 0
    data = json.loads(capsys.readouterr().out)
    alt = data["dp_mode_alternatives"]
    assert alt["dp"] == data["degrees"]["dp"] and alt["threshold"] == 0.1 and alt["grad_numel"] > 1e7
    labels = {p["label"] for p in alt["priced"]}
    assert {"local_sgd(sync_every=4)", "gossip(topology=ring)", "compressed(topk, ratio=0.01)",
            "async(staleness=1)"} <= labels
    step = data["predicted"]["step_time_s"]
    assert all(p["saving_s"] > 0.1 * step for p in alt["shown"])
    assert all(p["saving_s"] <= 0.1 * step for p in alt["priced"] if p["label"] not in
               {s["label"] for s in alt["shown"]})
    assert alt["allreduce"]["exposed_s"] == data["predicted"]["exposed_comm_s"]
    assert "dp_mode" not in saved.read_text()


def test_plan_section_lists_the_winners(tmp_path):
    """The section's text and JSON on a chosen plan with a slow data axis (no capture: a Score)."""
    import argparse

    from autopar.cli.hybrid import PlanOutcome, dp_mode_alternatives, dp_mode_text
    from autopar.cost.hybrid import Score
    l4 = Cluster.from_spec("32x8", hardware="l4")
    c = Config(dp=256, tp=1, pp=1, micro_batch=1)
    ar = price(cluster=l4)["allreduce"].comm_s
    best = Score(config=c, step_time_s=2 * ar, microbatches=1, model_flops=1.0, hw_flops=1.0, tflops_per_device=1.0,
                 hw_tflops_per_device=1.0, mfu=0.1, peak_memory_bytes=1.0, memory={}, bubble_fraction=0.0,
                 exposed_comm_s=ar, fits=True)
    out = PlanOutcome(mode="auto", search="", best=best, others=[], planner_s=0.0, scored=1, budget=1.0,
                      dp_grad_numel=NUMEL)
    args = argparse.Namespace(dtype="fp32")
    data = dp_mode_alternatives(args, l4, out)
    shown = [p["label"] for p in data["shown"]]
    assert "local_sgd(sync_every=16)" in shown and "gossip(topology=exponential)" not in shown
    assert data["none_why"] == "" and out.best.config == c
    lines = dp_mode_text(data)
    assert len(lines) == 2 + len(shown)
    rest = [p["label"] for p in data["priced"] if p["label"] not in shown]
    assert lines[-1].startswith("  the others, per step") and all(label in lines[-1] for label in rest)
    first = data["shown"][0]
    assert lines[1].startswith(f"  {first['label']}: data-axis communication ")
    assert f"{-100 * first['step_saving_fraction']:+.0f} % step" in lines[1]
    assert lines[1].endswith("convergence cost not modelled")
    # experts and pipelines: only the modes that compose are offered
    piped = PlanOutcome(mode="auto", search="", best=Score(**{**best.__dict__, "config": Config(
        dp=128, tp=1, pp=2, micro_batch=1)}), others=[], planner_s=0.0, scored=1, budget=1.0, dp_grad_numel=NUMEL)
    assert {p["mode"]["kind"] for p in dp_mode_alternatives(args, l4, piped)["priced"]} == {"local_sgd"}
    assert math.isclose(data["step_time_s"], 2 * ar)


SMALL = ["plan", "--model", "gpt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=256",
         "--cluster", "1x4", "--batch", "8", "--seq", "32", "--top", "1", "-q", "--json"]


@pytest.mark.parametrize("pp", ["1", "2"])
def test_every_plan_mode_has_the_section(capsys, pp):
    assert main([*SMALL, "--pp", pp]) == 0
    alt = json.loads(capsys.readouterr().out)["dp_mode_alternatives"]
    if pp == "2":     # the pipeline planner does not price the data axis: said, not guessed
        assert alt["priced"] == [] and "--pp N" in alt["none_why"]
    else:
        assert alt["dp"] == 1 or alt["priced"]
