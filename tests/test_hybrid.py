"""The hybrid simulator and the joint search (cost/hybrid.py), on meta-device models."""
from __future__ import annotations

import json
import math

import pytest

from autopar.cli import main
from autopar.cost.cluster import Cluster
from autopar.cost.hybrid import Config, ModelFacts, simulate
from autopar.cost.plan_search import configurations, search
from autopar.core.errors import ConfigError
from autopar.cli.workload import capture_workload, load_workload


def _facts(hidden: int, layers: int, heads: int, *, vocab: int = 51200, seq: int = 2048, attention="flash",
           dtype: str = "fp16"):
    w = load_workload("gpt", batch=1, seq=seq, overrides={"hidden": str(hidden), "layers": str(layers),
                                                          "heads": str(heads), "vocab": str(vocab),
                                                          "max_seq": str(seq)})
    return ModelFacts(capture_workload(w), seq=seq, dtype=dtype, attention=attention)


@pytest.fixture(scope="module")
def small():
    return _facts(1024, 8, 16, vocab=8192, seq=512)


def test_model_flops_match_the_closed_form(small):
    # Megatron's count: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)); recomputation adds a forward (96 B s l h^2 ...);
    # its attention term s/(6h) counts every query-key pair, a causal kernel the (s+1)/(2s) share below the diagonal
    B, s, l, h, V = 64, 512, 8, 1024, 8192
    c = Config(dp=4, tp=2, pp=1, micro_batch=2, recompute="full")
    score = simulate(small, Cluster.from_spec("1x8", hardware="a100"), c, batch=B)
    causal = (s + 1) / (2 * s)
    model = 72 * B * s * l * h * h * (1 + causal * s / (6 * h) + V / (12 * l * h))
    hw = 96 * B * s * l * h * h * (1 + causal * s / (6 * h) + V / (16 * l * h))
    assert score.model_flops == pytest.approx(model, rel=0.02)
    assert score.hw_flops == pytest.approx(hw, rel=0.02)


def test_recompute_trades_time_for_activation_memory(small):
    cl = Cluster.from_spec("1x8", hardware="a100")
    runs = {rc: simulate(small, cl, Config(dp=2, tp=2, pp=2, micro_batch=2, recompute=rc), batch=64)
            for rc in ("none", "full")}
    assert runs["full"].memory["activations"] < 0.5 * runs["none"].memory["activations"]
    assert runs["full"].step_time_s > runs["none"].step_time_s
    assert runs["full"].hw_flops > runs["none"].hw_flops == runs["none"].model_flops


def test_search_finds_the_brute_force_optimum(small):
    cl = Cluster.from_spec("1x8", hardware="a100")
    budget = 6e9
    best, others, scored = search(small, cl, batch=32, budget=budget, top=3)
    every = []
    for c in configurations(small, devices=8, batch=32, per_node=8):
        try:
            every.append(simulate(small, cl, c, batch=32, budget=budget))
        except ConfigError:
            continue
    fitting = [s for s in every if s.fits]
    assert best is not None and fitting
    assert best.step_time_s == pytest.approx(min(s.step_time_s for s in fitting), rel=1e-9)
    assert best.peak_memory_bytes <= budget
    assert len(others) == 3 and all(o.reason for o in others)
    assert scored <= len(every)            # pruned by the lower bound, never more


def test_the_162b_experiment_ranks_tp8_pp8_best():
    # Narayanan et al. 5.4.1: 162B GPT on 64 A100s, best of these five was (tp, pp) = (8, 8)
    facts = _facts(20480, 32, 128, attention="materialized")
    cl = Cluster.from_spec("8x8", hardware="a100")
    for batch in (32, 128):
        times = {}
        for tp, pp in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2)):
            times[tp, pp] = min(simulate(facts, cl, Config(dp=1, tp=tp, pp=pp, micro_batch=mb, recompute="full"),
                                         batch=batch).step_time_s for mb in (1, 2, 4))
        assert min(times, key=times.get) == (8, 8), (batch, times)


def test_plan_json_has_the_documented_keys(capsys):
    code = main(["plan", "--model", "gpt", "--set", "layers=4", "--set", "hidden=512", "--cluster", "2x4",
                 "--hardware", "h100", "--batch", "32", "--seq", "256", "--json", "--top", "3", "-q"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    for key in ("degrees", "zero_stage", "micro_batch_size", "microbatches", "schedule", "virtual_stages",
                "recompute", "predicted", "planner_time_s", "alternatives"):
        assert key in data
    assert set(data["degrees"]) == {"dp", "tp", "pp", "ep"}
    assert math.prod(data["degrees"].values()) == 8 and data["degrees"]["tp"] <= 4   # tp inside a node
    for key in ("step_time_s", "tflops_per_device", "hw_tflops_per_device", "mfu", "peak_memory_bytes",
                "bubble_fraction", "exposed_comm_s"):
        assert key in data["predicted"]
    assert all(a["reason"] for a in data["alternatives"])


def test_simulate_scores_a_fixed_configuration(capsys):
    code = main(["simulate", "--model", "gpt", "--set", "layers=4", "--set", "hidden=512", "--cluster", "2x4",
                 "--hardware", "a100", "--batch", "32", "--seq", "256", "--tp", "2", "--pp", "2",
                 "--micro-batch-size", "2", "--schedule", "1f1b", "--recompute", "full", "-q", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["degrees"] == {"dp": 2, "tp": 2, "pp": 2, "ep": 1} and data["recompute"] == "full"
    assert data["microbatches"] == 8 and data["predicted"]["step_time_s"] > 0


def test_too_big_for_the_cluster_names_the_smallest_that_fits(capsys):
    code = main(["plan", "--model", "gpt", "--set", "layers=8", "--set", "hidden=4096", "--cluster", "1x2",
                 "--hardware", "a100", "--batch", "16", "--seq", "1024", "--memory-budget", "4", "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fits in 4.0 GB per device" in err and "devices (whole nodes of 2) would fit" in err
    # the refusal names the leanest configuration of all, with what it needs (it named the least
    # memory among the fastest few, which could be far from the leanest)
    w = load_workload("gpt", batch=16, seq=1024, overrides={"layers": "8", "hidden": "4096"})
    facts = ModelFacts(capture_workload(w), seq=1024, dtype="bf16")      # the plan command's default dtype
    cluster = Cluster.from_spec("1x2", hardware="a100")
    least = min(simulate(facts, cluster, c, batch=16).peak_memory_bytes
                for c in configurations(facts, devices=2, batch=16, per_node=2))
    assert "the leanest, dp=" in err and f"needs {least / 1e9:.1f} GB" in err


def test_plan_report_and_timeline_are_written(capsys, tmp_path):
    import xml.etree.ElementTree as ET
    html, svg = tmp_path / "r.html", tmp_path / "t.svg"
    code = main(["plan", "--model", "gpt", "--set", "layers=4", "--set", "hidden=512", "--cluster", "2x4",
                 "--hardware", "h100", "--batch", "32", "--seq", "256", "--report", str(html), "--timeline", str(svg)])
    out = capsys.readouterr()
    assert code == 0 and "chosen: dp=" in out.out and "searching" in out.err
    page = html.read_text()
    assert "<svg" in page and "Alternatives" in page and "layer_norm" in page
    ET.parse(svg)


def test_train_runs_the_chosen_plan_and_matches_single_process(capsys):
    code = main(["train", "--ranks", "2", "--steps", "2", "--batch", "4", "--seq", "16",
                 "--set", "layers=2", "--set", "hidden=32"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "plan: dp=" in out and "largest relative difference" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 2


def _train_rows(out: str) -> dict[int, float]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0].isdigit():
            rows[int(parts[0])] = float(parts[1])
    return rows


def test_train_resumes_a_checkpoint_under_another_plan(capsys, tmp_path):
    small = ["--batch", "4", "--seq", "16", "--set", "layers=2", "--set", "hidden=32"]
    assert main(["train", "--ranks", "1", "--steps", "3", *small]) == 0
    straight = _train_rows(capsys.readouterr().out)
    assert main(["train", "--ranks", "2", "--steps", "2", "--save", str(tmp_path), "--save-every", "1", *small]) == 0
    capsys.readouterr()
    # --save-every 1: a checkpoint after step 1 as well, so a run killed in step 2 loses one step
    assert sorted(p.name for p in (tmp_path / "parallel").glob("step-*")) == ["step-00000001", "step-00000002"]
    # one rank now: another plan; the run goes on from step 2 as if never stopped
    assert main(["train", "--ranks", "1", "--steps", "1", "--resume", str(tmp_path), *small]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out
    resumed = _train_rows(out)
    assert list(resumed) == [2]
    assert abs(resumed[2] - straight[2]) <= 1e-5 * abs(straight[2])


def test_expert_parallelism_is_searched_for_moe_models():
    w = load_workload("moe", batch=1, seq=256, overrides={"layers": "2", "hidden": "256", "experts": "8"})
    facts = ModelFacts(capture_workload(w), seq=256, dtype="bf16")
    cl = Cluster.from_spec("1x8", hardware="h100")
    one, four = (simulate(facts, cl, Config(dp=8, tp=1, pp=1, micro_batch=1, ep=e), batch=16) for e in (1, 4))
    assert four.memory["params"] < one.memory["params"]          # each rank keeps 1/ep of the experts
    assert four.parts["ep_comm_per_block_s"] > 0 and "ep_comm_per_block_s" not in one.parts   # the all-to-alls
    eps = {c.ep for c in configurations(facts, devices=8, batch=16, per_node=8)}
    assert eps == {1, 2, 4, 8}
    with pytest.raises(ConfigError):
        simulate(facts, cl, Config(dp=2, tp=4, pp=1, micro_batch=1, ep=4), batch=16)   # ep must divide dp


def _zero_runs(facts, *, pp: int, batch: int, micro_batch: int = 1, dp: int = 2):
    cl = Cluster.from_spec(f"1x{dp * pp}", hardware="a100")
    return {z: simulate(facts, cl, Config(dp=dp, tp=1, pp=pp, micro_batch=micro_batch, zero_stage=z), batch=batch)
            for z in range(4)}


def test_zero_inside_a_pipeline_holds_whole_parameters_and_gradients(small):
    # runtime/stage_dp.py: gradients accumulate whole over the micro-batches under every ZeRO
    # stage, and ZeRO-3 keeps the whole parameters for the whole step; only optimizer state is
    # divided (the old pricing divided ZeRO-2/3's gradients and ZeRO-3's parameters by dp)
    runs = _zero_runs(small, pp=2, batch=32)
    zero = runs[0].memory
    for z in (1, 2, 3):
        mem = runs[z].memory
        assert mem["grads"] == pytest.approx(zero["grads"]), z
        assert mem["params"] == pytest.approx(zero["params"]), z      # fp16: ZeRO-3's pieces are the fp32 masters
        assert mem["optimizer"] == pytest.approx(zero["optimizer"] / 2), z
        assert mem["activations"] == pytest.approx(zero["activations"]), z


def test_zero3_pieces_sit_beside_the_whole_parameters_in_fp32():
    # in 32-bit the optimizer steps ZeRO-3's flat pieces themselves: 1/dp more than the whole
    facts = _facts(256, 4, 4, vocab=1024, seq=128, dtype="fp32")
    runs = _zero_runs(facts, pp=2, batch=16, micro_batch=2)
    assert runs[3].memory["params"] == pytest.approx(1.5 * runs[2].memory["params"])
    assert runs[3].memory["grads"] == pytest.approx(runs[2].memory["grads"])


def test_zero3_inside_a_pipeline_gathers_once_per_step(small):
    # one gather before the first micro-batch, one reduce-scatter after the last backward:
    # the data axis's time does not grow with the micro-batch count (it was 2 gathers each)
    few, many = (_zero_runs(small, pp=2, batch=b) for b in (8, 64))
    assert many[3].microbatches == 8 * few[3].microbatches
    for runs in (few, many):
        # ZeRO-1/2/3 all move one reduce-scatter and one all-gather of the stage per step, exposed
        assert runs[3].parts["dp_comm_s"] == pytest.approx(runs[2].parts["dp_comm_s"])
        assert runs[1].parts["dp_comm_s"] == pytest.approx(runs[2].parts["dp_comm_s"])
        # gradients are reduced in fp32 and parameters gathered in the compute dtype (bf16 here):
        # ZeRO-0's all-reduce moves 2 x 4 bytes a parameter, the others 4 + 2
        assert runs[0].parts["dp_comm_s"] > runs[3].parts["dp_comm_s"]
        for s in runs.values():
            assert s.exposed_comm_s == pytest.approx(s.parts["dp_comm_s"])
    assert many[3].parts["dp_comm_s"] == pytest.approx(few[3].parts["dp_comm_s"])
    assert many[3].exposed_comm_s == pytest.approx(few[3].exposed_comm_s)


def test_without_a_pipeline_zero_still_shards_and_gathers_per_micro_batch(small):
    # pp == 1: the lone stage's runtime gathers ZeRO-3 buckets for every micro-batch and keeps
    # only gradient (2/3) and parameter (3) pieces
    few, many = (_zero_runs(small, pp=1, batch=b) for b in (8, 64))
    assert many[3].parts["dp_comm_s"] > 4 * few[3].parts["dp_comm_s"]
    zero = few[0].memory
    assert few[2].memory["grads"] == pytest.approx(zero["grads"] / 2)
    # ZeRO-3 in 16-bit: its pieces are the fp32 masters (optimizer state); what it holds as
    # parameters is the gathered working set, two buckets (the one in use and the prefetched)
    assert few[3].memory["params"] < zero["params"] / 2
    assert few[3].memory["optimizer"] == pytest.approx(zero["optimizer"] / 2)


def test_simulate_prints_the_step_terms_and_takes_ep(capsys):
    base = ["simulate", "--model", "moe", "--set", "layers=2", "--cluster", "1x8", "--hardware", "h100",
            "--batch", "16", "--seq", "256", "-q"]
    assert main([*base, "--ep", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["degrees"]["ep"] == 2 and data["dtype"] == "bf16"      # plan's default dtype too
    assert main([*base, "--ep", "2"]) == 0
    text = capsys.readouterr().out
    assert "configuration: dp=8 tp=1 pp=1 ep=2 ZeRO-0" in text
    for term in ("pipeline (compute", "data axis:", "contention of hidden collectives", "optimizer step",
                 "memory per device (GB): params", "reserve"):
        assert term in text, term
    assert main([*base, "--ep", "3"]) != 0
    assert "ep=3 must divide" in capsys.readouterr().err


def test_eager_attention_cores_are_priced_as_run_again_in_backward():
    """The runtime checkpoints an eager attention core (here DeepSeek-V3's latent attention,
    whose queries and values differ in width) under every mode but whole-layer recomputation:
    backward runs its forward again. The simulator charges exactly that: the cores' forward
    seconds once per layer under none and selective, for the layers left whole under layers:K,
    and not again where the layer's own recomputation runs them (full, pointwise)."""
    import dataclasses
    overrides = {"num_hidden_layers": "3", "first_k_dense_replace": "1", "hidden_size": "128",
                 "intermediate_size": "256", "moe_intermediate_size": "32", "n_routed_experts": "4",
                 "num_experts_per_tok": "2", "n_group": "2", "topk_group": "1", "num_attention_heads": "4",
                 "num_key_value_heads": "4", "kv_lora_rank": "32", "q_lora_rank": "64", "qk_nope_head_dim": "32",
                 "qk_rope_head_dim": "16", "v_head_dim": "32", "vocab_size": "512"}
    facts = ModelFacts(capture_workload(load_workload("hf:deepseek-v3", batch=1, seq=256, overrides=overrides)),
                       seq=256, dtype="bf16")
    cl = Cluster.from_spec("1x8", hardware="h100")
    parts, _ = facts.parts(1, 1, cl, (("dp", 1),))
    pre, blk = parts["pre"], parts["block"]
    assert blk.core_fwd > 0 and pre.core_fwd > 0 and blk.core_fwd < 0.5 * blk.fwd
    real = facts.parts

    def without_cores(*a, **k):
        got, st = real(*a, **k)
        return {n: dataclasses.replace(p, core_fwd=0.0) for n, p in got.items()}, st
    extra = {}
    for rc in ("none", "selective", "layers:1", "full", "pointwise"):
        c = Config(dp=1, tp=1, pp=1, micro_batch=1, recompute=rc)
        with_ = simulate(facts, cl, c, batch=1).parts["stage_bwd_s"][0]
        facts.parts = without_cores
        extra[rc] = with_ - simulate(facts, cl, c, batch=1).parts["stage_bwd_s"][0]
        facts.parts = real
    every = 2 * blk.core_fwd + pre.core_fwd            # two MoE blocks and the dense layer before them
    assert extra["none"] == pytest.approx(every) and extra["selective"] == pytest.approx(every)
    # layers:1 recomputes the first layer of the part before whole: its core runs in that forward
    assert extra["layers:1"] == pytest.approx(2 * blk.core_fwd + pre.core_fwd * (1 - 1 / pre.layers))
    assert extra["full"] == 0 and extra["pointwise"] == 0


def test_selective_recomputation_of_a_flash_attention_is_priced_and_frees_nothing(small):
    """``selective`` checkpoints a fused attention kernel too: backward runs its forward again,
    and it frees nothing a flash kernel keeps. The simulator charges that forward once per layer
    and no memory, so ``none`` (which it ties with in memory) stays the cheaper choice."""
    cl = Cluster.from_spec("1x8", hardware="a100")
    parts, _ = small.parts(1, 1, cl, (("dp", 1),))
    blk = parts["block"]
    assert 0 < blk.attn_fwd <= blk.score_fwd
    runs = {rc: simulate(small, cl, Config(dp=1, tp=1, pp=1, micro_batch=1, recompute=rc), batch=1)
            for rc in ("none", "selective")}
    extra = runs["selective"].parts["stage_bwd_s"][0] - runs["none"].parts["stage_bwd_s"][0]
    assert extra == pytest.approx(8 * blk.score_fwd)            # 8 layers
    assert runs["selective"].memory["activations"] == runs["none"].memory["activations"]
