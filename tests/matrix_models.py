"""Tiny random-init ``transformers`` models for the model matrix (``tests/test_model_matrix.py``
and ``bench/model_matrix.py``): one entry per architecture, each built as the library builds it,
with a training batch for which one forward returns ``out.loss``.

Every config keeps the library's defaults except the sizes (2 layers, hidden 32, 4 heads, 2 kv
heads where the architecture has them, intermediate 48, vocabulary 64, 64 positions; 4 experts,
top-2, for mixtures of experts), the token ids (bos 0, eos 1, pad 2, so that all lie inside the
vocabulary) and the few settings that would make a training step random or unrunnable on a CPU in
float64: dropout of every kind is 0, random routing noise is 0, experts run transformers'
``batched_mm`` (its default ``grouped_mm`` has no float64 CPU kernel), and state-space layers run
their pure-torch path. An entry's ``notes`` gives the reason for any other setting.

``Entry.build(dtype, seed)`` seeds ``torch`` and builds the model, so equal seeds give equal
weights. ``Entry.batch(rows, seed)`` draws the inputs from their own generator: token ids in
``[3, 64)`` (no special token by chance), floating inputs (pixels, audio) in float32, which every
wider dtype holds exactly; ``cast`` moves them to the model's dtype.

In float64 a model is not float64 throughout: transformers computes some steps in float32 (the
causal-LM loss's ``logits.float()``, RMS norms, rotary tables, router softmaxes, Mamba's scan
inputs), so such a model rounds to float32 there; BERT, RoBERTa, ViT, ResNet, Whisper and CLIP do not.

Importing this module does not import ``transformers``; each build does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from tests.hf_tiny import VOCAB

Batch = dict[str, Any]      # tensors, and CLIP's ``return_loss=True``

SEQ = 8                     # tokens per row (longer than the sliding windows below: 4)
IMAGE = 32                  # pixels a side; ViT and CLIP cut 8 x 8 patches
LABELS = 4                  # classes of the classifiers
_IDS = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
_EXPERTS = dict(num_experts_per_tok=2, experts_implementation="batched_mm")
_OWN_EXPERTS = "its own experts code (experts_implementation has no effect)"

KINDS = ("causal_lm", "moe", "encoder", "seq2seq", "vision", "audio", "ssm", "multimodal")

# Architectures the matrix asks for that this transformers cannot run here (float64 forward and
# backward on a CPU), with the reason: none in 5.24.0.
UNAVAILABLE: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One architecture: ``build(dtype, seed)`` -> model; ``batch(rows, seed)`` -> the keyword
    inputs of one training forward whose output has ``.loss``; ``kind`` one of ``KINDS``."""
    name: str
    build: Callable[[torch.dtype, int], torch.nn.Module]
    batch: Callable[[int, int], Batch]
    kind: str
    moe: bool = False
    notes: str = ""


def cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """The batch with its floating tensors in ``dtype`` (token ids and flags unchanged)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in batch.items()}


# -- configs ------------------------------------------------------------------------------------

def _lm(**extra: Any) -> dict[str, Any]:
    """The Llama-style field names most decoders share."""
    base = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, max_position_embeddings=64, **_IDS)
    return {**base, **extra}


def _builder(model: str, config: str, **fields: Any) -> Callable[[torch.dtype, int], torch.nn.Module]:
    """``build(dtype, seed)`` for ``transformers.<model>(transformers.<config>(**fields))``."""
    def build(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
        import transformers
        cfg = getattr(transformers, config)(**fields)
        torch.manual_seed(seed)
        return getattr(transformers, model)(cfg).to(dtype)
    return build


# -- batches ------------------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(rows: int, seq: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, seq), generator=g)


def _lm_batch(rows: int, seed: int) -> Batch:
    """Token ids and the same ids as labels (the model shifts them)."""
    ids = _ids(rows, SEQ, _gen(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_batch(rows: int, seed: int) -> Batch:
    """Source ids and shorter target ids (the model shifts the labels right for the decoder)."""
    g = _gen(seed)
    return {"input_ids": _ids(rows, SEQ, g), "labels": _ids(rows, SEQ - 2, g)}


def _image_batch(rows: int, seed: int) -> Batch:
    g = _gen(seed)
    return {"pixel_values": torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, LABELS, (rows,), generator=g)}


def _clip_batch(rows: int, seed: int) -> Batch:
    """Captions end in eos (CLIP pools the text at the first eos) and pair with images row by row."""
    g = _gen(seed)
    ids = _ids(rows, SEQ, g)
    ids[:, -1] = 1
    return {"input_ids": ids, "pixel_values": torch.randn(rows, 3, IMAGE, IMAGE, generator=g),
            "return_loss": True}


MEL_BINS, AUDIO_POSITIONS = 8, 8     # Whisper: 8 mel bins, 2 * 8 = 16 frames (its conv halves them)


def _whisper_batch(rows: int, seed: int) -> Batch:
    g = _gen(seed)
    return {"input_features": torch.randn(rows, MEL_BINS, 2 * AUDIO_POSITIONS, generator=g),
            "labels": _ids(rows, SEQ - 2, g)}


WAVE = 64                            # wav2vec2: samples per row; two stride-2 convs leave 15 frames


def _ctc_batch(rows: int, seed: int) -> Batch:
    g = _gen(seed)
    return {"input_values": torch.randn(rows, WAVE, generator=g), "labels": _ids(rows, 6, g)}


# -- the catalogue ------------------------------------------------------------------------------

def _causal(name: str, model: str, config: str, notes: str = "", kind: str = "causal_lm",
            moe: bool = False, **fields: Any) -> Entry:
    return Entry(name, _builder(model, config, **fields), _lm_batch, kind, moe, notes)


# Where the default pattern would make both layers sliding-window ones: one of each kind.
_SWA = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
_MIXED = "layer 0 sliding window 4 (< sequence), layer 1 full attention"


def _dense_lms() -> list[Entry]:
    gemma = dict(head_dim=8, query_pre_attn_scalar=8)
    return [
        _causal("llama", "LlamaForCausalLM", "LlamaConfig", **_lm()),
        _causal("mistral", "MistralForCausalLM", "MistralConfig", "sliding window 4 < sequence",
                **_lm(sliding_window=4)),
        _causal("qwen2", "Qwen2ForCausalLM", "Qwen2Config", **_lm()),
        _causal("qwen3", "Qwen3ForCausalLM", "Qwen3Config", **_lm(head_dim=8)),
        _causal("gemma", "GemmaForCausalLM", "GemmaConfig", **_lm(head_dim=8)),
        _causal("gemma2", "Gemma2ForCausalLM", "Gemma2Config", _MIXED + " (its default)",
                **_lm(**gemma, sliding_window=4)),
        _causal("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "text-only; " + _MIXED, **_lm(**gemma, **_SWA)),
        _causal("phi3", "Phi3ForCausalLM", "Phi3Config", **_lm()),
        _causal("phi", "PhiForCausalLM", "PhiConfig", **_lm()),
        _causal("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2, hidden_size=32,
                num_attention_heads=4, intermediate_size=48, max_position_embeddings=64, **_IDS),
        _causal("gpt2", "GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=32, n_head=4, n_inner=48,
                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_IDS),
        _causal("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", "multi-query attention (default)",
                n_layer=2, n_embd=32, n_head=4, n_inner=48, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, **_IDS),
        _causal("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig", "local attention window 4 < sequence",
                num_layers=2, hidden_size=32, num_heads=4, intermediate_size=48, max_position_embeddings=64,
                attention_types=[[["global", "local"], 1]], window_size=4, embed_dropout=0.0,
                attention_dropout=0.0, resid_dropout=0.0, **_IDS),
        _causal("gptj", "GPTJForCausalLM", "GPTJConfig", "rotary on 4 of each head's 8 dims", n_layer=2,
                n_embd=32, n_head=4, n_inner=48, n_positions=64, rotary_dim=4, **_IDS),
        _causal("codegen", "CodeGenForCausalLM", "CodeGenConfig", "rotary on 4 of each head's 8 dims",
                n_layer=2, n_embd=32, n_head=4, n_inner=48, n_positions=64, n_ctx=64, rotary_dim=4, **_IDS),
        _causal("opt", "OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, **_IDS),
        _causal("falcon", "FalconForCausalLM", "FalconConfig", num_hidden_layers=2, hidden_size=32,
                num_attention_heads=4, **_IDS),
        _causal("bloom", "BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=32, n_head=4, **_IDS),
        _causal("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", **_lm()),
        _causal("granite", "GraniteForCausalLM", "GraniteConfig", **_lm()),
        _causal("stablelm", "StableLmForCausalLM", "StableLmConfig", **_lm()),
        _causal("cohere", "CohereForCausalLM", "CohereConfig", **_lm()),
        _causal("cohere2", "Cohere2ForCausalLM", "Cohere2Config", _MIXED, **_lm(**_SWA)),
        _causal("olmo", "OlmoForCausalLM", "OlmoConfig", **_lm()),
        _causal("olmo2", "Olmo2ForCausalLM", "Olmo2Config", **_lm()),
        _causal("olmo3", "Olmo3ForCausalLM", "Olmo3Config", _MIXED, **_lm(**_SWA)),
        _causal("glm", "GlmForCausalLM", "GlmConfig", **_lm(head_dim=8)),
        _causal("glm4", "Glm4ForCausalLM", "Glm4Config", **_lm(head_dim=8)),
        _causal("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", "no_rope_layer_interval 2: layer 1 has no rope",
                **_lm(no_rope_layer_interval=2)),
        _causal("persimmon", "PersimmonForCausalLM", "PersimmonConfig", "no kv heads (multi-head)",
                num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, **_IDS),
        _causal("nemotron", "NemotronForCausalLM", "NemotronConfig", **_lm()),
        _causal("helium", "HeliumForCausalLM", "HeliumConfig", **_lm(head_dim=8)),
        _causal("exaone4", "Exaone4ForCausalLM", "Exaone4Config", _MIXED + " (sliding_window_pattern 2)",
                **_lm(sliding_window=4, sliding_window_pattern=2)),
        _causal("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config", **_lm(head_dim=8)),
        _causal("seed_oss", "SeedOssForCausalLM", "SeedOssConfig",
                **_lm(head_dim=8, attention_dropout=0.0, residual_dropout=0.0)),
        _causal("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config",
                **_lm(head_dim=8, eod_token_id=1)),
        _causal("ministral", "MinistralForCausalLM", "MinistralConfig", _MIXED, **_lm(head_dim=8, **_SWA)),
        _causal("apertus", "ApertusForCausalLM", "ApertusConfig", **_lm()),
        _causal("arcee", "ArceeForCausalLM", "ArceeConfig", **_lm()),
        _causal("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                "multi-head latent attention; first_k_dense_replace = layers: no MoE layer",
                **_lm(num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=24,
                      n_routed_experts=4, n_group=2, topk_group=1, **_EXPERTS)),
    ]


def _moe_lms() -> list[Entry]:
    def moe(name: str, model: str, config: str, notes: str = "", **fields: Any) -> Entry:
        return _causal(name, model, config, notes, kind="moe", moe=True, **fields)
    return [
        moe("mixtral", "MixtralForCausalLM", "MixtralConfig", **_lm(num_local_experts=4, **_EXPERTS)),
        moe("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "shared expert; every layer sparse",
            **_lm(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                  decoder_sparse_step=1, **_EXPERTS)),
        moe("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "every layer sparse",
            **_lm(head_dim=8, num_experts=4, moe_intermediate_size=24, decoder_sparse_step=1, **_EXPERTS)),
        moe("olmoe", "OlmoeForCausalLM", "OlmoeConfig", **_lm(num_experts=4, **_EXPERTS)),
        moe("deepseek_v3_moe", "DeepseekV3ForCausalLM", "DeepseekV3Config",
            "first_k_dense_replace 0: both layers MoE (one shared expert, 2 groups of 2, top group 1)",
            **_lm(num_key_value_heads=4, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=24,
                  n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, **_EXPERTS)),
        moe("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", **_lm(num_local_experts=4, **_EXPERTS)),
        moe("llama4", "Llama4ForCausalLM", "Llama4TextConfig",
            "text-only; every layer MoE with a shared expert; " + _OWN_EXPERTS,
            **_lm(head_dim=8, intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, **_EXPERTS)),
        moe("gpt_oss", "GptOssForCausalLM", "GptOssConfig", "attention sinks; " + _MIXED + " (its default)",
            **_lm(head_dim=8, num_local_experts=4, sliding_window=4, **_EXPERTS)),
        moe("phimoe", "PhimoeForCausalLM", "PhimoeConfig",
            "router_jitter_noise 0: sparsemixer's training draws (Gumbel) then keep only the top expert each "
            "time, so routing is deterministic; its multipliers are then exactly 1, so the router's gradient is 0",
            **_lm(num_local_experts=4, router_jitter_noise=0.0, input_jitter_noise=0.0, **_EXPERTS)),
        moe("jetmoe", "JetMoeForCausalLM", "JetMoeConfig",
            "mixture of attention heads too: 2 kv heads x top-2 = 4 query heads; " + _OWN_EXPERTS,
            num_hidden_layers=2, hidden_size=32, num_key_value_heads=2, kv_channels=8, intermediate_size=48,
            max_position_embeddings=64, num_local_experts=4, **_EXPERTS, **_IDS),
        moe("dbrx", "DbrxForCausalLM", "DbrxConfig",
            "attn_config: clip_qkv 8 (as the released model; None fails in torch.clamp) and rope_theta (read "
            "there, though not a field of DbrxAttentionConfig; the rotary embedding uses rope_parameters' 10000); "
            + _OWN_EXPERTS,
            d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
            experts_implementation="batched_mm", **_IDS),
        moe("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
            "multi-head latent attention; layer 0 dense, layer 1 MoE",
            **_lm(num_key_value_heads=4, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=24,
                  n_routed_experts=4, n_shared_experts=1, **_EXPERTS)),
        moe("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", "every layer MoE",
            **_lm(head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=24, moe_layer_start_index=0,
                  experts_implementation="batched_mm")),
        moe("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config",
            **_lm(head_dim=8, num_experts=4, moe_topk=2, eod_token_id=1, experts_implementation="batched_mm")),
        moe("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig", "layer 0 dense, layer 1 MoE",
            **_lm(head_dim=8, n_routed_experts=4, moe_intermediate_size=24, first_k_dense_replace=1,
                  n_group=1, topk_group=1, **_EXPERTS)),
        moe("flex_olmo", "FlexOlmoForCausalLM", "FlexOlmoConfig", **_lm(num_experts=4, **_EXPERTS)),
    ]


def _ssms() -> list[Entry]:
    ssm = dict(num_hidden_layers=2, hidden_size=32, expand=2, conv_kernel=4, **_IDS)
    return [
        _causal("mamba", "MambaForCausalLM", "MambaConfig", "pure-torch sequential scan (no CUDA kernels)",
                kind="ssm", state_size=8, **ssm),
        _causal("falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig",
                "pure-torch sequential scan (no CUDA kernels)", kind="ssm", state_size=8, **ssm),
        _causal("mamba2", "Mamba2ForCausalLM", "Mamba2Config",
                "pure-torch chunked scan: 4 heads x 16 = expand x hidden; chunk 4 < sequence", kind="ssm",
                num_heads=4, head_dim=16, n_groups=1, state_size=8, chunk_size=4, **ssm),
        _causal("jamba", "JambaForCausalLM", "JambaConfig",
                "layer 0 mamba + dense MLP, layer 1 attention + MoE; pure-torch mamba path", kind="ssm", moe=True,
                **_lm(num_experts=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, **_EXPERTS)),
    ]


def _encoders() -> list[Entry]:
    bert = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                vocab_size=VOCAB, pad_token_id=2)
    return [
        Entry("bert", _builder("BertForMaskedLM", "BertConfig", **bert), _lm_batch, "encoder",
              notes="masked LM; labels are the inputs (every position predicted)"),
        Entry("roberta", _builder("RobertaForMaskedLM", "RobertaConfig", **bert, bos_token_id=0, eos_token_id=1),
              _lm_batch, "encoder", notes="masked LM; positions count from pad + 1"),
        Entry("modernbert", _builder("ModernBertForMaskedLM", "ModernBertConfig", num_hidden_layers=2,
                                     hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                     max_position_embeddings=64, cls_token_id=0, sep_token_id=1,
                                     global_attn_every_n_layers=2, local_attention=4, **_IDS),
              _lm_batch, "encoder", notes="masked LM; layer 0 global, layer 1 local attention (window 4)"),
    ]


def _seq2seqs() -> list[Entry]:
    return [
        Entry("t5", _builder("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8,
                             d_ff=48, num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                             pad_token_id=2, eos_token_id=1),
              _seq2seq_batch, "seq2seq"),
        Entry("bart", _builder("BartForConditionalGeneration", "BartConfig", d_model=32, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0,
                               decoder_start_token_id=0, forced_eos_token_id=1, **_IDS),
              _seq2seq_batch, "seq2seq"),
    ]


def _vision() -> list[Entry]:
    return [
        Entry("vit", _builder("ViTForImageClassification", "ViTConfig", num_hidden_layers=2, hidden_size=32,
                              num_attention_heads=4, intermediate_size=48, image_size=IMAGE, patch_size=8,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=LABELS),
              _image_batch, "vision"),
        Entry("resnet", _builder("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                                 hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=LABELS),
              _image_batch, "vision",
              notes="batch norm: train mode normalizes by batch statistics and updates running buffers"),
    ]


def _audio() -> list[Entry]:
    return [
        Entry("whisper", _builder("WhisperForConditionalGeneration", "WhisperConfig", num_mel_bins=MEL_BINS,
                                  max_source_positions=AUDIO_POSITIONS, max_target_positions=64, d_model=32,
                                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                                  decoder_start_token_id=0, **_IDS),
              _whisper_batch, "audio",
              notes=f"input_features [rows, {MEL_BINS} mel bins, {2 * AUDIO_POSITIONS} frames]; labels shifted "
                    "into decoder inputs"),
        Entry("wav2vec2", _builder("Wav2Vec2ForCTC", "Wav2Vec2Config", num_hidden_layers=2, hidden_size=32,
                                   num_attention_heads=4, intermediate_size=48, conv_dim=(16, 16),
                                   conv_stride=(2, 2), conv_kernel=(3, 3), num_conv_pos_embeddings=4,
                                   num_conv_pos_embedding_groups=4, hidden_dropout=0.0, activation_dropout=0.0,
                                   attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                                   mask_time_prob=0.0, **_IDS),
              _ctc_batch, "audio",
              notes="CTC on raw samples, summed over rows (the default reduction); layerdrop and SpecAugment "
                    "time masks (random in training) off"),
    ]


def _multimodal() -> list[Entry]:
    text = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, **_IDS)
    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                  image_size=IMAGE, patch_size=8)
    return [
        Entry("clip", _builder("CLIPModel", "CLIPConfig", text_config=text, vision_config=vision, projection_dim=32),
              _clip_batch, "multimodal", notes="contrastive loss (return_loss=True); captions end in eos"),
    ]


def architectures() -> dict[str, Entry]:
    """name -> entry, for every architecture of the matrix."""
    entries = _dense_lms() + _moe_lms() + _ssms() + _encoders() + _seq2seqs() + _vision() + _audio() \
        + _multimodal()
    return {e.name: e for e in entries}
