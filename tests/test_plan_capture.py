"""The planner's capture with fewer layers (autopar.cli.workload.capture_for_planning): the
simulator's figures from it, told the real layer count, equal those from the whole model."""
from __future__ import annotations

import functools

import pytest

from autopar.cost.cluster import Cluster
from autopar.cost.hybrid import Config, ModelFacts, simulate
from autopar.models import depth, get_config
from autopar.core.meta import graph_info
from autopar.cli.workload import capture_for_planning, capture_workload, load_workload

GPT = {"layers": "4", "hidden": "64", "heads": "4", "vocab": "256", "max_seq": "512"}
LLAMA = {"layers": "3", "hidden": "64", "heads": "4", "kv_heads": "2", "ffn": "128", "vocab": "256",
         "max_seq": "512"}
MOE = {**LLAMA, "layers": "4", "experts": "4", "top_k": "2"}
# deepseek-v3 (MLA, routed and shared experts) with 2 dense layers (3 in the real model) kept as they
# are, then 3 MoE layers (58 in the real model) cut to 2
DEEPSEEK = {"num_hidden_layers": "5", "first_k_dense_replace": "2", "hidden_size": "64", "num_attention_heads": "4",
            "num_key_value_heads": "4", "q_lora_rank": "32", "kv_lora_rank": "16", "qk_nope_head_dim": "8",
            "qk_rope_head_dim": "8", "v_head_dim": "8", "intermediate_size": "128", "moe_intermediate_size": "32",
            "n_routed_experts": "4", "num_experts_per_tok": "2", "n_group": "2", "topk_group": "1",
            "vocab_size": "256", "max_position_embeddings": "512"}
# gemma2's alternating sliding / full attention layers (layer_types), soft-capping, tied head
GEMMA2 = {"num_hidden_layers": "6", "hidden_size": "64", "num_attention_heads": "4", "num_key_value_heads": "2",
          "head_dim": "16", "query_pre_attn_scalar": "16", "intermediate_size": "128", "vocab_size": "256",
          "sliding_window": "64", "max_position_embeddings": "512"}

SEQ, BATCH = 512, 64
CLUSTER = Cluster.from_spec("2x8", hardware="h100")
THREE = Cluster.from_spec("3x8", hardware="h100")             # for pp=3
DENSE = [Config(dp=16, tp=1, pp=1, micro_batch=1),
         Config(dp=4, tp=4, pp=1, micro_batch=2, zero_stage=3, recompute="selective"),
         Config(dp=2, tp=4, pp=2, micro_batch=2, zero_stage=1, recompute="full"),
         Config(dp=4, tp=2, pp=2, micro_batch=1, schedule="interleaved", virtual=2, zero_stage=2)]
EXPERTS = [Config(dp=16, tp=1, pp=1, micro_batch=1, ep=2, zero_stage=1),
           Config(dp=8, tp=1, pp=2, micro_batch=1, ep=4, recompute="full", schedule="zb")]


@functools.lru_cache(maxsize=None)
def _both(spec: str, overrides: tuple):
    """(facts of the whole capture, facts of the planning capture, the planning capture)."""
    w = load_workload(spec, batch=BATCH, seq=SEQ, overrides=dict(overrides))
    planned = capture_for_planning(w)
    full = ModelFacts(capture_workload(w), seq=SEQ, dtype="bf16")
    cut = ModelFacts(planned.gm, seq=SEQ, dtype="bf16", layers=planned.block_copies)
    return full, cut, planned


def _same(full: ModelFacts, cut: ModelFacts, configs: list[Config], cluster: Cluster = CLUSTER) -> None:
    assert cut.layers == full.layers and cut.captured_layers < full.captured_layers
    for c in configs:
        a, b = simulate(full, cluster, c, batch=BATCH), simulate(cut, cluster, c, batch=BATCH)
        for field in ("step_time_s", "peak_memory_bytes", "model_flops", "hw_flops", "mfu", "bubble_fraction",
                      "exposed_comm_s", "microbatches"):
            assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-9, abs=1e-12), (c, field)
        assert b.memory == pytest.approx(a.memory, rel=1e-9), c


@pytest.mark.parametrize("spec,overrides,configs", [
    ("gpt", GPT, DENSE),
    # one tensor layout per graph at most: a solve on the whole graph costs a second or so
    ("llama", LLAMA, DENSE[:2]),
    ("moe", MOE, EXPERTS),
], ids=["gpt", "llama", "moe"])
def test_zoo_simulation_from_fewer_layers_is_exact(spec, overrides, configs):
    full, cut, planned = _both(spec, tuple(overrides.items()))
    assert planned.captured_layers == 2 and planned.block_copies == int(overrides["layers"])
    _same(full, cut, configs)


def test_deepseek_v3_dense_layers_kept_moe_layers_cut():
    full, cut, planned = _both("hf:deepseek-v3", tuple(DEEPSEEK.items()))
    assert (planned.captured_layers, planned.layers, planned.block_copies) == (4, 5, 3)   # 2 dense + 2 of 3 MoE
    assert cut.experts == full.experts == 4
    # tp=1: the tensor solver on MLA and the router takes seconds (tp > 1 is the zoo tests')
    _same(full, cut, [Config(dp=16, tp=1, pp=1, micro_batch=1, ep=4, recompute="selective", zero_stage=2)])
    _same(full, cut, [Config(dp=8, tp=1, pp=3, micro_batch=2, ep=2, zero_stage=1, recompute="full")], THREE)


def test_gemma2_alternating_layers_kept_in_pairs():
    # tp=4 splits this embedding on hidden: the all-gather into the first layer happens once, on
    # the part before, however many copies the capture counts
    full, cut, planned = _both("hf:gemma2-27b", tuple(GEMMA2.items()))
    assert (planned.captured_layers, planned.block_copies) == (4, 6)
    _same(full, cut, [Config(dp=16, tp=1, pp=1, micro_batch=2, recompute="selective"),
                      Config(dp=4, tp=4, pp=1, micro_batch=1)])


def test_the_planning_capture_holds_fewer_layers(tmp_path):
    full, _, planned = _both("gpt", tuple(GPT.items()))
    (cls,) = graph_info(planned.gm).block_classes
    assert cls.members == ("layers.0", "layers.1") and planned.block_copies == 4
    assert graph_info(planned.gm).block_copies == {cls.id: 4}
    assert len(graph_info(full.gm).block_classes[0].members) == 4
    assert planned.describe() == f"2 of 4 layers, {len(planned.gm.graph.nodes)} nodes"
    assert len(planned.gm.graph.nodes) < 0.6 * len(full.gm.graph.nodes)
    # a user's model file cannot be shrunk: the whole model
    (tmp_path / "m.py").write_text("import torch\nfrom autopar import models\n"
                                   "def factory(batch, seq):\n"
                                   "    m = models.build('gpt', {'layers': 3, 'hidden': 32, 'heads': 2, 'vocab': 64})\n"
                                   "    return m, models.example_inputs(m, batch, seq)[0], ({0: 'batch', 1: 'seq'},)\n")
    user = capture_for_planning(load_workload(f"{tmp_path / 'm.py'}:factory", batch=2, seq=8))
    assert user.block_copies is None and user.layers is None
    assert len(graph_info(user.gm).block_classes[0].members) == 3


@pytest.mark.parametrize("name,kept,copies", [
    ("llama3-405b", 2, 126),                  # the zoo: every layer alike
    ("hf:deepseek-v3", 5, 58),                # 3 dense layers kept, 58 MoE layers cut to 2
    ("hf:gemma2-27b", 4, 46),                 # sliding / full pairs
    ("hf:qwen1.5-moe-a2.7b", 2, 24),          # every layer MoE (decoder_sparse_step 1, no mlp_only_layers)
])
def test_the_shipped_configs_shrink_by_their_layer_pattern(name, kept, copies):
    shrunk = depth.shrink(get_config(name))
    assert len(shrunk.indices) == kept and shrunk.run_layers == copies
    assert depth.layer_kinds(shrunk.config) == [depth.layer_kinds(get_config(name))[i] for i in shrunk.indices]


def test_layer_patterns_it_cannot_read_capture_every_layer():
    # an every-other-layer MoE (qwen's decoder_sparse_step=2) shrinks to 2 periods plus the odd layer
    qwen = get_config("hf:qwen1.5-moe-a2.7b", {"decoder_sparse_step": "2", "mlp_only_layers": "[0]"})
    assert depth.periodic_run(depth.layer_kinds(qwen)) == (1, 24, 2)
    # a field that looks per-layer but that the rules do not know: no shrinking
    assert depth.layer_kinds(get_config("hf:gpt2", {"scale_attn_by_inverse_layer_idx": "true"})) is None
    assert depth.shrink(get_config("mlp")) is None
