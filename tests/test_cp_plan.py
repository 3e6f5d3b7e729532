"""The context axis in the planner: the simulator's pricing (cost/hybrid.py, cost/cp_planner.py),
the search (cost/plan_search.py) and the commands (``autopar plan``, ``autopar simulate --cp``).

- splitting the sequence over cp divides what a rank keeps for backward by cp (to 10 %) and
  leaves the model's FLOPs as they are (attention's work moves, it does not shrink);
- each kind is priced as it runs: all-gather moves the whole keys and values, all-to-all needs cp
  to divide the heads, a ring step that fits under a block's attention shows nothing;
- the search offers cp only where each rank keeps 4,096 tokens; ``autopar plan`` at a long
  sequence picks cp > 1 and says why; ``autopar simulate --cp N --cp-kind K`` scores one layout.
"""
from __future__ import annotations

import json

import pytest

from autopar.cli.commands import main
from autopar.cli.workload import capture_workload, load_workload
from autopar.core.errors import ConfigError
from autopar.cost.cluster import Cluster
from autopar.cost.cp_planner import AttentionShape, choose_kind, kind_cost
from autopar.cost.hybrid import Config, ModelFacts, simulate
from autopar.cost.plan_search import configurations

SEQ = 16384
SMALL = ["--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=256",
         "--set", f"max_seq={SEQ}"]


@pytest.fixture(scope="module")
def facts():
    w = load_workload("llama", batch=1, seq=SEQ, overrides={"layers": "2", "hidden": "256", "heads": "8",
                                                           "vocab": "512", "max_seq": str(SEQ)})
    return ModelFacts(capture_workload(w), seq=SEQ, dtype="bf16")


def test_cp_divides_activations_and_keeps_model_flops(facts):
    node = Cluster.from_spec("1x8", hardware="h100")
    one = simulate(facts, node, Config(dp=8, tp=1, pp=1, micro_batch=1), batch=8)
    for cp in (2, 4, 8):
        got = simulate(facts, node, Config(dp=8 // cp, tp=1, pp=1, micro_batch=1, cp=cp, cp_kind="ring"), batch=8)
        ratio = got.memory["activations"] / one.memory["activations"]
        assert abs(ratio * cp - 1) < 0.1, (cp, ratio)
        assert got.model_flops == pytest.approx(one.model_flops, rel=1e-6)
        assert got.config.cp_kind == "ring" and got.config.degrees()["cp"] == cp
        assert got.parts["cp_comm_per_block_s"] > 0
    with pytest.raises(ConfigError, match="multiple"):          # the sequence must cut into 2 cp chunks
        simulate(facts, node, Config(dp=1, tp=1, pp=1, micro_batch=1, cp=3), batch=8)


def test_recomputation_on_a_context_axis_is_priced_as_it_runs(facts):
    """A fused attention on a cp axis is the axis's attention, which ``selective`` does not re-run
    (runtime/recompute.py re-runs fused attention kernels and score ops; the rewrite replaced the
    kernel): there selective costs what none costs, while at cp=1 it re-runs the kernel.
    ``pointwise`` keeps every attention kernel's output, the extra key pairs' too, so what it
    re-runs per rank (this rank's tokens' other ops, and the exchanges) costs less at cp=2 than
    the whole sequence's at cp=1, though cp=2's attention is dearer."""
    node = Cluster.from_spec("1x8", hardware="h100")

    def run(cp: int, recompute: str):
        return simulate(facts, node, Config(dp=8 // cp, tp=1, pp=1, micro_batch=1, cp=cp, recompute=recompute,
                                            cp_kind="ring" if cp > 1 else None), batch=8)
    for cp in (2, 4):
        assert run(cp, "selective").step_time_s == pytest.approx(run(cp, "none").step_time_s, rel=1e-12)
    assert run(1, "selective").step_time_s > run(1, "none").step_time_s
    redo = {cp: sum(run(cp, "pointwise").parts["stage_bwd_s"]) - sum(run(cp, "none").parts["stage_bwd_s"])
            for cp in (1, 2)}
    assert 0 < redo[2] < redo[1], redo


def test_each_kind_is_priced_as_it_runs():
    node = Cluster.from_spec("2x8", hardware="h100")
    axes = (("dp", 2), ("cp", 8))
    gqa = AttentionShape(batch=1, heads=32, kv_heads=8, seq=131072, head_dim=128)
    gather = kind_cost("allgather", gqa, 8, node, axes)
    assert gather.sent_bytes == pytest.approx(2 * 8 * 131072 * 128 * 2 * 7 / 8)   # k and v of the whole sequence
    assert kind_cost("alltoall", AttentionShape(1, 12, 12, 8192, 64), 8, node, axes).refused   # 8 does not divide 12
    # a long block's attention hides a ring step entirely: only the backward's steps show
    ring = kind_cost("ring", gqa, 8, node, axes)
    assert ring.comm_fwd_s == 0.0 and ring.comm_bwd_s > 0
    short = kind_cost("ring", AttentionShape(1, 32, 8, 1024, 128), 8, node, axes)
    assert short.comm_fwd_s > 0                                        # a short one does not
    best, totals = choose_kind([gqa], 8, node, axes)
    assert totals[best] == min(totals.values())


def test_the_search_offers_cp_only_for_long_sequences(facts):
    cps = {c.cp for c in configurations(facts, devices=8, batch=8, per_node=8)}
    assert cps == {1, 2, 4}                                            # 16384 / 4096
    short = load_workload("llama", batch=1, seq=2048, overrides={"layers": "2", "hidden": "64", "heads": "4",
                                                                "vocab": "256", "max_seq": "2048"})
    short_facts = ModelFacts(capture_workload(short), seq=2048, dtype="bf16")
    assert {c.cp for c in configurations(short_facts, devices=8, batch=8, per_node=8)} == {1}


def test_plan_picks_cp_and_says_why(capsys):
    code = main(["plan", "--model", "llama", *SMALL, "--cluster", "1x4", "--hardware", "h100", "--batch", "2",
                 "--seq", str(SEQ), "-q"])
    out = capsys.readouterr().out
    assert code == 0
    chosen = next(line for line in out.splitlines() if line.startswith("chosen:"))
    assert " cp=" in chosen, chosen
    assert "context parallelism: cp=" in out and "without it the best layout" in out


def test_simulate_takes_cp_and_its_kind(capsys):
    args = ["simulate", "--model", "llama", *SMALL, "--cluster", "1x4", "--hardware", "h100", "--batch", "2",
            "--seq", str(SEQ), "--json", "--cp", "2", "--dp", "2"]
    assert main([*args, "--cp-kind", "allgather"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["degrees"]["cp"] == 2 and data["cp_kind"] == "allgather"
    assert main([*args]) == 0                                          # no kind: the cheapest
    assert json.loads(capsys.readouterr().out)["cp_kind"] in ("ring", "allgather", "alltoall")
    assert main([*args[:-4], "--cp-kind", "ring"]) != 0                # a kind without a context axis
    assert "--cp-kind needs a context axis" in capsys.readouterr().err
