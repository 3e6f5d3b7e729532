"""The simulator prices what the runtime does (cost/hybrid.py, cost/op_cost.py, cost/compute.py).

One test per modelling error an audit found; each fails on the old pricing:

1. without a pipeline, gradient accumulation holds one micro-batch's activations, not all;
2. ZeRO-1/2's all-gather after the optimizer step is exposed, not hidden under backward;
3. ZeRO-1 reduce-scatters once, at the step (exposed), and nothing per micro-batch;
4. mixed precision reduces and keeps gradients in fp32 (4 bytes), parameters gathered in 16 bits;
5. materialized attention scores are held for backward (and freed by selective recompute);
   full recompute holds one block's working set once, not once per micro-batch in flight;
6. a column-parallel rank still reads the whole input, a row-parallel one writes a whole
   partial sum;
7. the tensor layout is solved at each micro-batch size;
8. GEMM and attention efficiency depend on shape and kernel; the zero-bubble split backward
   costs the same in both planners;

and the pipeline stages need not divide the layers. Mixture-of-experts pricing:
tests/test_cost_moe.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from autopar.cost.cluster import Cluster
from autopar.cost.compute import gemm_efficiency
from autopar.cost.hardware import load_hardware
from autopar.cost.hybrid import Config, ModelFacts, simulate
from autopar.cost.step_terms import stage_layers
from autopar.cost.op_cost import efficiencies, local_bytes, node_seconds
from autopar.cost.pp_sim import ZB_SPLIT_OVERHEAD
from autopar.core.errors import ConfigError
from autopar.core.meta import evaluate, info
from autopar.cli.workload import capture_workload, load_workload

A100 = "a100"


def _facts(*, hidden=512, layers=4, heads=8, vocab=4096, seq=256, dtype="bf16", attention="flash", real=None):
    w = load_workload("gpt", batch=1, seq=seq, overrides={"hidden": str(hidden), "layers": str(layers),
                                                          "heads": str(heads), "vocab": str(vocab),
                                                          "max_seq": str(seq)})
    return ModelFacts(capture_workload(w), seq=seq, dtype=dtype, attention=attention, layers=real)


@pytest.fixture(scope="module")
def facts():
    return _facts()


@pytest.fixture(scope="module")
def node8():
    return Cluster.from_spec("1x8", hardware=A100)


def _score(facts, cluster, batch, **kw):
    return simulate(facts, cluster, Config(**{"tp": 1, "pp": 1, "micro_batch": 1, **kw}), batch=batch)


# 1 -----------------------------------------------------------------------------------------------
def test_gradient_accumulation_holds_one_micro_batch(facts, node8):
    # pp == 1 runs each micro-batch's forward and backward in turn: 8 micro-batches hold what 1 does
    one = _score(facts, node8, 8, dp=8)
    eight = _score(facts, node8, 64, dp=8)
    assert eight.microbatches == 8 * one.microbatches
    assert eight.memory["activations"] == pytest.approx(one.memory["activations"])
    # a real pipeline (GPipe) does keep every micro-batch in flight
    g1 = _score(facts, node8, 8, dp=4, pp=2, schedule="gpipe")
    g8 = _score(facts, node8, 64, dp=4, pp=2, schedule="gpipe")
    assert g8.memory["activations"] > 6 * g1.memory["activations"]


# 2, 3 --------------------------------------------------------------------------------------------
def test_zero1_and_zero2_gathers_are_exposed_and_zero1_reduces_once(facts, node8):
    runs = {z: _score(facts, node8, 64, dp=8, zero_stage=z) for z in range(4)}
    z0, z1, z2 = runs[0], runs[1], runs[2]
    # ZeRO-1: one reduce-scatter and one all-gather per step, both after the last backward
    assert z1.exposed_comm_s == pytest.approx(z1.parts["dp_comm_s"])
    # ZeRO-0 and ZeRO-2 reduce every micro-batch (8 of them); ZeRO-1 once
    assert z0.parts["dp_comm_s"] > 4 * z1.parts["dp_comm_s"]
    # ZeRO-2: eight reduce-scatters (one per micro-batch) and one all-gather, ZeRO-1 one of each:
    # the reduce-scatters hide under backward, the all-gather after the step cannot
    reduce_scatter = (z2.parts["dp_comm_s"] - z1.parts["dp_comm_s"]) / 7
    all_gather = z1.parts["dp_comm_s"] - reduce_scatter
    assert all_gather > 0 and z2.exposed_comm_s >= all_gather * (1 - 1e-9)


# 4 -----------------------------------------------------------------------------------------------
def test_mixed_precision_gradients_are_fp32_in_memory_and_on_the_wire(node8):
    bf16, fp32 = _facts(dtype="bf16"), _facts(dtype="fp32")
    for z in range(4):
        b = _score(bf16, node8, 8, dp=8, zero_stage=z)
        f = _score(fp32, node8, 8, dp=8, zero_stage=z)
        if z != 1:    # ZeRO-1 keeps the whole compute-dtype gradients until the step reduces them
            assert b.memory["grads"] == pytest.approx(f.memory["grads"]), z
    # the reduction moves fp32 in both: ZeRO-0's all-reduce costs the same
    b0, f0 = (_score(x, node8, 8, dp=8) for x in (bf16, fp32))
    assert b0.parts["dp_comm_s"] == pytest.approx(f0.parts["dp_comm_s"])
    # while ZeRO-1/2's parameter all-gather moves half the bytes in bf16
    b1, f1 = (_score(x, node8, 8, dp=8, zero_stage=1) for x in (bf16, fp32))
    assert b1.parts["dp_comm_s"] < f1.parts["dp_comm_s"]


# 5 -----------------------------------------------------------------------------------------------
def test_materialized_scores_are_held_and_selective_recompute_frees_them(node8):
    seq = 512
    flash, mat = _facts(seq=seq), _facts(seq=seq, attention="materialized")
    f, m = (_score(x, node8, 8, dp=8) for x in (flash, mat))
    heads, layers = 8, 4
    # probabilities and dropout output (2 bytes each) and the 1-byte mask, per layer
    scores = 1 * heads * seq * seq
    assert m.memory["activations"] - f.memory["activations"] == pytest.approx(layers * scores * 5, rel=0.01)
    sel = _score(mat, node8, 8, dp=8, recompute="selective")
    assert sel.memory["activations"] == pytest.approx(f.memory["activations"], rel=0.02)
    assert sel.step_time_s > m.step_time_s      # the attention cores run again


def test_full_recompute_holds_one_working_set_whatever_is_in_flight(facts, node8):
    few = _score(facts, node8, 16, dp=4, pp=2, schedule="gpipe", recompute="full")
    many = _score(facts, node8, 64, dp=4, pp=2, schedule="gpipe", recompute="full")
    blk = facts.parts(1, 1, node8, (("pp", 2), ("dp", 4), ("tp", 1)))[0]["block"]
    # 4x the micro-batches in flight: 4x the held block inputs, the recomputed block's working set once
    for d in range(2):          # each pipeline rank
        a, b = (x.parts["device_memory_bytes"][d]["activations"] for x in (few, many))
        assert b - a == pytest.approx(3 * (a - blk.saved), rel=1e-6)


# 6 -----------------------------------------------------------------------------------------------
def test_split_ops_read_their_inputs_at_the_placement_they_need():
    from autopar.passes.sharding import strategies
    f = _facts()
    at = {"batch": 2, "seq": 256}
    fc = next(n for n in f.gm.graph.nodes if info(n).fqn and info(n).fqn.endswith("mlp.fc")
              and n.target is torch.ops.aten.linear.default)
    opts = {s.name: s for s in strategies(fc, 2, at)}
    whole = float(evaluate(info(fc).bytes_fwd, at))
    x, w = (float(evaluate(info(a).out_bytes, at)) for a in fc.args[:2])
    out = float(evaluate(info(fc).out_bytes, at))
    # column-parallel: the whole input, half the weight (and bias), half the output
    col = opts["colwise"]
    assert local_bytes(fc, at, col, 2) == pytest.approx(x + w / 2 + _bias(fc, at) / 2 + out / 2)
    # row-parallel: half the input and weight, the whole bias and a whole partial output
    row = opts["rowwise"]
    assert local_bytes(fc, at, row, 2) == pytest.approx(x / 2 + w / 2 + _bias(fc, at) + out)
    for s in (col, row):              # the old pricing scaled every byte by the work share
        assert local_bytes(fc, at, s, 2) > whole * s.work
    assert local_bytes(fc, at, None, 1) == pytest.approx(whole)


def _bias(node, at) -> float:
    return float(evaluate(info(node.args[2]).out_bytes, at)) if len(node.args) > 2 else 0.0


# 7 -----------------------------------------------------------------------------------------------
def test_the_tensor_layout_is_solved_at_each_micro_batch_size(facts, node8):
    axes = (("pp", 1), ("dp", 4), ("tp", 2))
    for mb in (1, 4):
        facts.parts(2, mb, node8, axes)
    solved = {k[1] for k in facts._solved if k[0] == 2}
    assert {1, 4} <= solved


# 8 -----------------------------------------------------------------------------------------------
def test_gemm_efficiency_follows_tile_and_wave_quantization():
    a100 = load_hardware(A100)
    big = gemm_efficiency(8192, 8192, 8192, a100)
    assert big == pytest.approx(a100.matmul_efficiency, rel=0.01)
    # 108 SMs: 108 tiles of 128x128 fill one wave, one more tile costs a second wave
    full = gemm_efficiency(128 * 108, 128, 4096, a100)
    spill = gemm_efficiency(128 * 109, 128, 4096, a100)
    assert spill < 0.6 * full
    # a tiny output over a long inner dimension: split-K and small tiles recover some, not all
    assert gemm_efficiency(64, 64, 65536, a100) < 0.2 * big
    # no SMs (a CPU): no quantization
    assert gemm_efficiency(7, 5, 3, load_hardware("cpu")) == load_hardware("cpu").matmul_efficiency


def test_attention_runs_at_the_devices_attention_efficiency(facts):
    a100 = load_hardware(A100)
    sdpa = next(n for n in facts.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    at = facts.sizes(1)
    assert efficiencies(sdpa, at, a100) == (a100.attention_efficiency, a100.attention_efficiency)
    f, _ = node_seconds(sdpa, at, a100, "bf16")
    flops = float(evaluate(info(sdpa).flops_fwd, at))
    assert f >= flops / (a100.peak("bf16") * a100.attention_efficiency)
    gemm = next(n for n in facts.gm.graph.nodes if n.target in (torch.ops.aten.linear.default,
                                                                torch.ops.aten.addmm.default))
    eff, _ = efficiencies(gemm, at, a100)
    assert eff is not None and eff <= a100.matmul_efficiency


def test_zero_bubble_charges_its_split_backward(facts, node8):
    one = _score(facts, node8, 32, dp=4, pp=2, schedule="1f1b")
    zb = _score(facts, node8, 32, dp=4, pp=2, schedule="zb")
    # E9: the overhead is the device profile's (a GPU's estimate, not the CPU's measured 35 %)
    split = node8.device.zb_split_overhead
    assert split < ZB_SPLIT_OVERHEAD
    assert sum(zb.parts["stage_bwd_s"]) == pytest.approx((1 + split) * sum(one.parts["stage_bwd_s"]))
    cpu = Cluster.from_spec("1x8", hardware="cpu")
    assert cpu.device.zb_split_overhead == ZB_SPLIT_OVERHEAD


# non-uniform stages ------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,stages,pre,post", [(7, 3, 0.0, 0.0), (10, 4, 1.5, 2.5), (9, 4, 0.2, 3.0),
                                                    (6, 6, 0.5, 0.5), (13, 5, 4.0, 0.0)])
def test_stage_layers_minimise_the_slowest_stage(layers, stages, pre, post):
    got = stage_layers(layers, stages, 1.0, pre, post)
    assert sum(got) == layers and min(got) >= 1

    def slowest(counts):
        return max(c + (pre if i == 0 else 0) + (post if i == stages - 1 else 0) for i, c in enumerate(counts))
    best = min(slowest(c) for c in itertools.product(range(1, layers + 1), repeat=stages) if sum(c) == layers)
    assert slowest(got) == pytest.approx(best)


def test_llama3_405b_layout_takes_a_layer_off_the_first_and_last_stage():
    # the head and embedding of a 126-layer model on 16 stages weigh about a layer: Meta's layout
    assert stage_layers(126, 16, 1.0, 0.1, 0.9) == [7] + [8] * 14 + [7]


def test_any_pipeline_degree_works_for_any_layer_count(node8):
    f = _facts(layers=2, real=7)
    s = simulate(f, node8, Config(dp=2, tp=1, pp=4, micro_batch=1), batch=8)
    assert s.parts["stage_layers"] and sum(s.parts["stage_layers"]) == 7 and len(s.parts["stage_layers"]) == 4
    s = simulate(f, node8, Config(dp=4, tp=1, pp=2, micro_batch=1, schedule="interleaved", virtual=3), batch=16)
    assert sum(s.parts["stage_layers"]) == 7 and len(s.parts["stage_layers"]) == 6


# Fidelity II: the costs that flipped the planner's choice ------------------------------------------
def test_data_axis_pays_one_latency_per_bucket(node8):
    # E2: the runtime cuts a rank's parameters into buckets (cost/dp_planner.bucket_bytes) and
    # issues one collective per bucket: each pays the axis's latency, not one per step
    from autopar.cost.comm import collective_time
    from autopar.cost.step_terms import DataBytes, bucket_count
    f = _facts(layers=2, real=64, hidden=1024, heads=16)
    big = Cluster.from_spec("32x8", hardware=A100)
    s = simulate(f, big, Config(dp=256, tp=1, pp=1, micro_batch=1, zero_stage=3), batch=512)
    numel = f.param_numel(1, {})
    held = numel["pre"] + numel["post"] + 64 * numel["block"]
    b = DataBytes.of(f, held, 0.0)
    axes = (("pp", 1), ("dp", 256), ("tp", 1))
    calls = bucket_count(big, axes, b)
    assert calls >= 4

    def coll(kind, nbytes, n):
        return n * collective_time(kind, nbytes / n, big, axes, "dp")
    m = s.microbatches
    assert s.parts["dp_comm_s"] == pytest.approx(m * (2 * coll("all_gather", b.params, calls)
                                                       + coll("reduce_scatter", b.grads, calls)), rel=1e-9)
    once = m * (2 * coll("all_gather", b.params, 1) + coll("reduce_scatter", b.grads, 1))
    latency = collective_time("all_gather", 0.0, big, axes, "dp")
    assert s.parts["dp_comm_s"] - once == pytest.approx(3 * m * (calls - 1) * latency, rel=1e-6)


def test_a_value_is_converted_once_for_all_its_readers():
    # E3: the tensor rewrite makes one conversion per (value, placement needed) and every reader
    # of that placement shares it (q, k, v of one normed input; gate and up): priced once
    from autopar.core.placement import REP, transition
    from autopar.cost.tp_solver import Pricer, SolverConfig
    from autopar.passes.sharding import is_decision, tensor_inputs
    w = load_workload("llama3-8b", batch=1, seq=2048, overrides={"layers": "2"})
    f = ModelFacts(capture_workload(w), seq=2048, dtype="bf16")
    node8 = Cluster.from_spec("1x8", hardware="h100")
    axes = (("pp", 1), ("dp", 1), ("tp", 8))
    parts, strategies = f.parts(8, 1, node8, axes)
    pricer = Pricer(f.gm, SolverConfig(n=8, cluster=node8, mesh_axes=axes, axis="tp", sizes=f.sizes(1), dtype="bf16"))
    width = 0.5 if f._captured_fp32 else 1.0
    pairs, readers = {}, 0
    for n in f.gm.graph.nodes:
        s = strategies.get(n.name)
        if not is_decision(n) or s is None:
            continue
        for j, arg in enumerate(tensor_inputs(n)):
            src = strategies.get(arg.name)
            if src is None or j >= len(s.inputs) or not src.outputs:
                continue
            t = pricer.convert(arg, 0, src.outputs[0], s.inputs[j]) * width
            if t > 0:
                readers += 1
                pairs[(arg, s.inputs[j])] = t
    assert readers > len(pairs) >= 2          # some values are read by several readers at one placement
    # a norm's output gathered for its fused projections (sequence parallel) is gathered again in
    # backward for the recomputed output (runtime/fused.py): one more gather, half the pair's price
    again = sum(t / 2 for (arg, need), t in pairs.items() if arg in f._regathered
                and transition(strategies[arg.name].outputs[0].value, need.value).kind == "all_gather")
    assert again > 0
    head = strategies[f.logits.name].outputs[0]      # the vocabulary-split logits, returned whole
    pairs[(f.logits, "output")] = pricer.convert(f.logits, 0, head, REP) * width
    total = sum(p.comm_fwd + p.comm_bwd for p in (parts["pre"], parts["post"])) + \
        f.captured_layers * (parts["block"].comm_fwd + parts["block"].comm_bwd)
    assert total == pytest.approx(sum(pairs.values()) + again, rel=1e-9)


def test_a_norm_split_along_its_own_dimension_is_priced_unfused():
    # E3b: where a layout splits a norm along the hidden dimension (memory_budget=1 splits every
    # weight that can), the runtime cannot fuse it (tests/test_fusion.py): the normalised rows
    # and the output the fused ops would recompute are kept, and no second gather is made
    from autopar.cost.tp_solver import SolverConfig, solve
    w = load_workload("llama3-8b", batch=1, seq=512, overrides={"layers": "2"})
    f = ModelFacts(capture_workload(w), seq=512, dtype="bf16")
    node2 = Cluster.from_spec("1x2", hardware="h100")
    axes = (("pp", 1), ("dp", 1), ("tp", 2))
    assert f._norm_unkept                      # the RMSNorms' rows and their outputs for q, k, v, gate, up
    default, planned = f.parts(2, 1, node2, axes)
    assert not any(f._norm_kept(n, planned.get(n.name)) for n in f._norm_unkept)     # fused: priced as such
    lean = solve(f.gm, SolverConfig(n=2, cluster=node2, mesh_axes=axes, axis="tp", sizes=f.sizes(1),
                                    dtype="bf16", memory_budget=1)).strategies
    split = [n for n in f._norm_unkept if f._norm_kept(n, lean.get(n.name))]
    assert len(split) == len(f._norm_unkept), [(n.name, lean.get(n.name)) for n in f._norm_unkept]
    at = f.sizes(1)
    width = 0.5 if f._captured_fp32 else 1.0
    back = sum(float(evaluate(info(n).fused_bytes, at)) * lean[n.name].work * width
               for n in split if f.where[n] == "block") / f.captured_layers
    assert back > 0

    def block_saved(kept_norms: bool) -> float:
        f._cache.clear()
        f._solved[(2, 1, node2.name, f.seq, False)] = lean
        keep = f._norm_unkept
        if not kept_norms:
            f._norm_unkept = set()
        try:
            return f.parts(2, 1, node2, axes)[0]["block"].saved
        finally:
            f._norm_unkept = keep
    assert block_saved(True) - block_saved(False) == pytest.approx(back, rel=1e-9)


def test_causal_attention_is_priced_at_the_pairs_it_computes(node8):
    # E1: a causal flash kernel skips the key blocks above the diagonal: about half the work
    # of full attention, in time and in model FLOPs (torch's flop counter counts it whole)
    seq, heads, hidden = 4096, 8, 512
    f = _facts(seq=seq, heads=heads, hidden=hidden)
    blk = f.parts(1, 1, node8, (("pp", 1), ("dp", 8), ("tp", 1)))[0]["block"]
    pairs = seq * (seq + 1) / 2
    fwd = 2 * heads * pairs * 2 * (hidden // heads)
    assert blk.attn_fwd_flops == pytest.approx(fwd, rel=1e-12)
    assert blk.attn_flops == pytest.approx(3 * fwd, rel=1e-12)
    dev = node8.device
    # (plus the kernel launch)
    assert blk.attn_fwd == pytest.approx(fwd / (dev.peak("bf16") * dev.attention_efficiency), rel=0.05)


def test_the_optimizer_step_moves_thirty_bytes_per_parameter(facts, node8):
    # E12: mixed-precision Adam reads the fp32 gradient, reads and writes the master and both
    # moments, and writes the 16-bit copy: 4 + 8 + 16 + 2 = 30 bytes per parameter (fp32: 28)
    from autopar.cost.step_terms import optimizer_bytes
    assert optimizer_bytes("bf16", 2) == 30 and optimizer_bytes("fp32", 2) == 28
    numel = facts.param_numel(1, {})
    held = numel["pre"] + numel["post"] + facts.layers * numel["block"]
    for z in (0, 1):
        s = _score(facts, node8, 8, dp=8, zero_stage=z)
        local = held / (8 if z else 1)
        dev = node8.device
        assert s.parts["optimizer_s"] == pytest.approx(30 * local / (dev.memory_bandwidth * dev.memory_efficiency), rel=1e-9)


def test_a_device_holds_a_reserve_beside_its_tensors(facts, node8):
    # E11: CUDA context and workspaces, each communicator's buffers, the allocator's slack: a
    # plan fits only with them (the old check compared the tensors alone with 80 GB)
    dev = node8.device
    for c, groups in ((dict(dp=8), 1), (dict(dp=2, tp=2, pp=2), 3), (dict(dp=1, tp=1, pp=1), 0)):
        s = _score(facts, node8, 8, **c)
        tensors = sum(v for k, v in s.memory.items() if k != "reserve")
        assert s.memory["reserve"] == pytest.approx(dev.reserve_bytes + groups * dev.comm_buffer_bytes
                                                    + dev.fragmentation * tensors, rel=1e-12)
        assert s.peak_memory_bytes == pytest.approx(tensors + s.memory["reserve"])
        assert s.memory["reserve"] > 0.7e9
        assert dev.sources["reserve_bytes"] and dev.sources["comm_buffer_bytes"]
        tight = simulate(facts, node8, Config(**{"tp": 1, "pp": 1, "micro_batch": 1, **c}), batch=8,
                         budget=tensors * 1.01)
        assert not tight.fits
    cpu = Cluster.from_spec("1x8", hardware="cpu")
    assert _score(facts, cpu, 8, dp=8).memory["reserve"] == 0.0


def test_hidden_communication_still_slows_compute(facts, node8):
    # E10: a collective hidden under backward holds SMs and HBM bandwidth: the device profile's
    # contention share of its time is charged to the step
    s = _score(facts, node8, 64, dp=8)          # ZeRO-0: all-reduces under each micro-batch's backward
    hidden = s.parts["dp_comm_s"] - s.parts["dp_exposed_s"]
    assert hidden > 0
    assert s.parts["contention_s"] == pytest.approx(node8.device.comm_contention * hidden, rel=1e-12)
    assert s.step_time_s == pytest.approx(s.parts["pipeline_s"] + s.exposed_comm_s + s.parts["optimizer_s"]
                                          + s.parts["contention_s"], rel=1e-12)
    assert 0 < node8.device.comm_contention < 1 and "SM" in node8.device.sources["comm_contention"]


def test_a_pipelines_stage_reductions_hide_under_the_later_backwards(facts, node8):
    # E8: each stage's gradients are reduced the moment its last backward ends
    # (runtime/stage_dp.py); with 4 stages per device the first three travel under the
    # cool-down's remaining backwards, and only what runs past the last one is exposed
    f = _facts(layers=2, real=16)
    one = _score(f, node8, 64, dp=4, pp=2, schedule="1f1b")
    assert one.exposed_comm_s == pytest.approx(one.parts["dp_comm_s"])      # one stage: all of it after
    inter = _score(f, node8, 64, dp=4, pp=2, schedule="interleaved", virtual=4)
    chunk = inter.parts["stage_bwd_s"][0]
    each = inter.parts["dp_comm_s"] / 4
    assert each < 2 * chunk                       # each reduction fits under the next group's backwards
    assert inter.exposed_comm_s == pytest.approx(each, rel=1e-6)
    z1 = _score(f, node8, 64, dp=4, pp=2, schedule="interleaved", virtual=4, zero_stage=1)
    assert z1.exposed_comm_s == pytest.approx(z1.parts["dp_comm_s"])        # ZeRO-1 reduces at the step


def test_the_loss_on_the_logits_is_timed_and_held(node8):
    # E7: a graph that returns logits leaves its loss to the caller, who computes it in fp32 on
    # the whole logits: the fp32 log-softmax output and the logits are held until backward,
    # and its passes over them are timed (small vocabulary against large: the gap is the loss's)
    seq, hidden = 256, 512
    small, big = _facts(vocab=1024, seq=seq, hidden=hidden), _facts(vocab=16384, seq=seq, hidden=hidden)
    assert small.logits is not None and big.logits is not None
    axes = (("pp", 1), ("dp", 8), ("tp", 1))
    ps, pb = small.parts(1, 1, node8, axes)[0]["post"], big.parts(1, 1, node8, axes)[0]["post"]
    graph_saved = lambda f: sum(float(evaluate(info(n).saved_bytes, f.sizes(1))) * 0.5 for n in f.gm.graph.nodes
                                if f.where.get(n) == "post" and n.op == "call_function")
    for f, p, vocab in ((small, ps, 1024), (big, pb, 16384)):
        assert p.saved - graph_saved(f) == pytest.approx((2 + 4) * seq * vocab, rel=1e-9)
    dev = node8.device
    bw = dev.memory_bandwidth * dev.memory_efficiency
    head = lambda f: sum(node_seconds(n, f.sizes(1), dev, "bf16", width=0.5)[0] for n in f.gm.graph.nodes
                         if f.where.get(n) == "post" and n.op == "call_function")
    loss_fwd = pb.fwd - head(big)
    assert loss_fwd == pytest.approx((6 + 12) * seq * 16384 / bw + dev.kernel_overhead_s * 2, rel=1e-6)
    # a model that returns its own loss has it in the graph already: nothing is added
    from autopar.cost.model_facts import logits_node as _logits
    from tests.conftest import analysed

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(8, 64)

        def forward(self, x):
            return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1).float(), x.new_zeros(
                x.shape[0] * x.shape[1], dtype=torch.long))
    gm = analysed(WithLoss(), (torch.randn(2, 4, 8),), ({0: "batch", 1: "seq"},))
    assert _logits(gm, 8) is None
    assert _logits(analysed(WithLoss().head, (torch.randn(2, 4, 8),), ({0: "batch", 1: "seq"},)), 8) is not None


def test_the_closed_form_holds_what_the_event_simulation_holds(node8):
    # the search's closed form must see the memory the exact scoring sees, or its finalists
    # all fail the budget and a fitting layout is never scored exactly
    f = _facts(layers=2, real=16)
    for batch, sched, v in ((16, "interleaved", 2), (32, "interleaved", 2), (16, "1f1b", 1), (16, "gpipe", 1),
                            (16, "zb", 1), (64, "zb", 1)):
        c = Config(dp=2, tp=1, pp=4, micro_batch=2, schedule=sched, virtual=v)
        fast, exact = (simulate(f, node8, c, batch=batch, fast=x) for x in (True, False))
        # never less (the closed form may be conservative for interleaved past m == p)
        assert fast.memory["activations"] >= 0.99 * exact.memory["activations"], (batch, sched)
        if batch // (c.dp * c.micro_batch) == c.pp or sched != "interleaved":
            assert fast.memory["activations"] == pytest.approx(exact.memory["activations"], rel=0.01), (batch, sched)


def test_materialized_attention_computes_the_whole_square(node8):
    # the two GEMMs of written-out attention compute every pair, masked or not
    seq, heads, hidden = 1024, 8, 512
    flash = _facts(seq=seq, heads=heads, hidden=hidden)
    mat = _facts(seq=seq, heads=heads, hidden=hidden, attention="materialized")
    axes = (("pp", 1), ("dp", 8), ("tp", 1))
    bf, bm = flash.parts(1, 1, node8, axes)[0]["block"], mat.parts(1, 1, node8, axes)[0]["block"]
    assert bm.attn_fwd_flops == pytest.approx(2 * heads * seq * seq * 2 * (hidden // heads), rel=1e-12)
    assert bm.attn_fwd_flops == pytest.approx(bf.attn_fwd_flops * 2 * seq / (seq + 1), rel=1e-12)


@pytest.mark.parametrize("p,v,m", [(4, 2, 4), (4, 2, 8), (2, 3, 2), (4, 4, 4), (8, 2, 16)])
def test_the_simulated_interleaved_order_is_the_runtimes(p, v, m):
    # the runtime runs torch's ScheduleInterleaved1F1B (runtime/pp.py): each device's order of
    # forwards and backwards is the simulator's. Torch warms device d up with 2(p-1-d) + (v-1)p
    # forwards even when m == p (Megatron-LM would run every forward first, holding all m)
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    from autopar.cost.pp_sim import interleaved_1f1b
    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches = v, p, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    ours = interleaved_1f1b(p, v, m)
    for d in range(p):
        sched.rank = d
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                  for a in sched._calculate_single_rank_operations(d) if a is not None]
        assert theirs == [(a.kind, a.stage, a.mb) for a in ours.programs[d]], d


def test_recomputing_the_first_k_layers_of_each_stage_is_priced_between_none_and_full(node8, monkeypatch):
    # recompute="layers:K" (runtime/recompute.regions: the first K layers of each stage's graph):
    # each stage re-runs K blocks' forward in backward and holds K block inputs instead of their
    # activations; K at least a stage's layers is full recomputation
    from autopar.cost.hybrid import recomputed
    from autopar.cost.plan_search import fewest_recomputed, search
    from autopar.core.plans import recompute_layers
    f = _facts(layers=2, real=8)
    base = dict(dp=4, tp=1, pp=2, micro_batch=1, schedule="1f1b")
    none, one, two, full = (simulate(f, node8, Config(**base, recompute=r), batch=8)
                            for r in ("none", "layers:1", "layers:2", "full"))
    blk = f.parts(1, 1, node8, (("pp", 2), ("dp", 4), ("tp", 1)))[0]["block"]
    assert one.parts["stage_bwd_s"][0] - none.parts["stage_bwd_s"][0] == pytest.approx(
        one.parts["block_fwd_s"] + blk.comm_fwd, rel=1e-9)
    held = none.parts["device_memory_bytes"][0]["activations"] - one.parts["device_memory_bytes"][0]["activations"]
    boundary = 1 * 256 * 512 * 2
    assert held == pytest.approx(2 * (blk.saved - boundary) - blk.saved, rel=1e-6)   # 2 in flight, less the working set
    assert none.step_time_s < one.step_time_s < two.step_time_s < full.step_time_s
    assert none.peak_memory_bytes > one.peak_memory_bytes > two.peak_memory_bytes > full.peak_memory_bytes
    same = simulate(f, node8, Config(**base, recompute="layers:4"), batch=8)       # 4 per stage: every layer
    assert same.step_time_s == pytest.approx(full.step_time_s) and same.peak_memory_bytes == full.peak_memory_bytes
    assert recomputed([3, 4], 1, 2, 2) == [(1, 1, 0), (0, 2, 0)]      # the part before's layer leads stage 0
    assert recomputed([3], 1, 2, 5) == [(1, 3, 1)]
    for bad in ("layers:0", "layers:x", "some", 3):
        with pytest.raises(ConfigError, match="recompute"):
            recompute_layers(bad)
    # the search scores the fewest layers per stage that fit where none does not and full does
    budget = (none.peak_memory_bytes + one.peak_memory_bytes) / 2
    part, tried = fewest_recomputed(f, node8, full, batch=8, budget=budget)
    assert part.config.recompute == "layers:1" and tried >= 1
    # and the search finds it: pp=4 (the other degrees filtered out), with a budget between what
    # none and the first layer of each stage recomputed need (full recomputation costs a third
    # more time than that)
    import autopar.cost.plan_search as ps
    big = _facts(layers=2, real=8, seq=2048, hidden=1024, vocab=512)
    four = dict(dp=2, tp=1, pp=4, micro_batch=1, schedule="1f1b")
    nb, ob = (simulate(big, node8, Config(**four, recompute=r), batch=8).peak_memory_bytes for r in ("none", "layers:1"))
    assert nb > ob
    every = ps.configurations
    monkeypatch.setattr(ps, "configurations", lambda *a, **k: (c for c in every(*a, **k) if c.pp == 4))
    best, _, _ = search(big, node8, batch=8, budget=(nb + ob) / 2, top=0, tp_exact=1, schedules=("1f1b",),
                        micro_batches=(1,), zero_stages=(0,), recomputes=("none", "full"))
    assert best is not None and best.config.recompute == "layers:1", best.config


def test_pointwise_recomputation_keeps_matmul_outputs_and_reruns_the_rest(node8):
    # recompute="pointwise" (runtime/recompute.py: torch's selective checkpoint keeping the
    # matmuls' and attention's outputs): a block holds its input and those outputs, and backward
    # runs its other ops again (norms, activations, casts: a small share of its time)
    f = _facts(layers=2, real=8)
    base = dict(dp=4, tp=1, pp=2, micro_batch=1, schedule="1f1b")
    none, point, full = (simulate(f, node8, Config(**base, recompute=r), batch=8) for r in ("none", "pointwise", "full"))
    blk = f.parts(1, 1, node8, (("pp", 2), ("dp", 4), ("tp", 1)))[0]["block"]
    from autopar.cost.model_facts import _is_kept
    kept = [n for n in f.gm.graph.nodes if n.op == "call_function" and _is_kept(n) and info(n).block_member in f.members]
    assert {str(n.target).split(".")[-2] for n in kept} >= {"linear", "scaled_dot_product_attention"}
    at = f.sizes(1)
    want = sum(float(evaluate(info(n).out_bytes, at)) + (float(evaluate(info(n).values[0].numel / info(n).values[0].shape[-1], at)) * 4
               if "scaled_dot" in str(n.target) else 0.0) for n in kept) / f.captured_layers
    width = 0.5 if f._captured_fp32 else 1.0
    assert blk.kept_saved == pytest.approx(want * width, rel=1e-9)
    assert 0 < blk.kept_fwd < blk.fwd
    assert point.parts["stage_bwd_s"][0] - none.parts["stage_bwd_s"][0] == pytest.approx(
        point.parts["stage_layers"][0] * (blk.fwd + blk.comm_fwd - blk.kept_fwd), rel=1e-9)
    assert none.step_time_s < point.step_time_s < full.step_time_s
    # a block keeps its input and every matmul's output: more than full recomputation, and (its
    # norms and MLP run fused, passes/fusion.py) more than this Llama keeps without recomputing
    assert point.peak_memory_bytes > full.peak_memory_bytes
    assert point.peak_memory_bytes > none.peak_memory_bytes
    assert point.hw_flops == pytest.approx(none.hw_flops) and none.hw_flops < full.hw_flops   # no matmul again
