"""Tiny random-init ``transformers`` causal LMs, built as the library builds them (default
``use_cache``, tied embeddings where the architecture ties them), for equivalence tests.

Each config keeps the library's defaults except the sizes (and the few token ids that must
lie inside the tiny vocabulary); dropout, where an architecture has it on by default, is set
to 0 so that one process and several ranks draw no random masks (train/eval mode handling
is tested on its own).
"""
from __future__ import annotations

import torch

VOCAB = 64
_IDS = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _llama_like(**extra):
    base = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, max_position_embeddings=64, **_IDS)
    return {**base, **extra}


def configs():
    """architecture -> (model class, config)."""
    import transformers as T
    return {
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(**_llama_like())),
        "mistral": (T.MistralForCausalLM, T.MistralConfig(**_llama_like(sliding_window=4))),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(**_llama_like())),
        "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config(**_llama_like(head_dim=8))),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config(**_llama_like(head_dim=8, query_pre_attn_scalar=8,
                                                                      sliding_window=4))),
        "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig(**_llama_like(head_dim=8, query_pre_attn_scalar=8,
                                                                          sliding_window=4))),
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config(**_llama_like())),
        "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                            intermediate_size=48, max_position_embeddings=64, **_IDS)),
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attn_pdrop=0.0, **_IDS)),
        "opt": (T.OPTForCausalLM, T.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=48,
                                              max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                                              **_IDS)),
        "falcon": (T.FalconForCausalLM, T.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                       **_IDS)),
        "bloom": (T.BloomForCausalLM, T.BloomConfig(n_layer=2, hidden_size=32, n_head=4, **_IDS)),
        # encoder-decoder; one embedding tied to both stacks and the head; use_cache on in each stack's config
        "t5": (T.T5ForConditionalGeneration, T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                        pad_token_id=2, eos_token_id=1)),
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig(**_llama_like(num_local_experts=4, num_experts_per_tok=2,
                                                                       experts_implementation="batched_mm"))),
        # multi-head latent attention (keys assembled by writing into slices of a new tensor); dense layers
        "deepseek_v3": (T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
            **_llama_like(num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=24,
                          n_routed_experts=4, n_group=2, topk_group=1))),
    }


def build(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, layers: int | None = None) -> torch.nn.Module:
    """The architecture's tiny model, deterministic weights, in ``dtype`` (with ``layers``
    layers instead of 2: the config rebuilt, so per-layer fields follow)."""
    cls, cfg = configs()[arch]
    if layers is not None:
        fields = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
        cfg = type(cfg)(**{**fields, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    return cls(cfg).to(dtype)


def batch(rows: int = 4, seq: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """A training batch as users pass one: token ids and labels (the model shifts them)."""
    ids = torch.randint(3, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def train_parallel(model: torch.nn.Module, mesh: dict, part: dict[str, torch.Tensor], steps: int, **kw):
    """``autopar.parallelize`` the model on ``mesh`` and train ``steps`` SGD-momentum steps (lr 0.1,
    momentum 0.9) on ``part`` with the model's own loss (``pm.step`` in a pipeline); the module."""
    import autopar
    pm = autopar.parallelize(model, mesh, example_kwargs=part, **kw)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    for _ in range(steps):
        if "pp" in mesh:
            pm.step(**part)
        else:
            pm(**part).loss.backward()
        opt.step()
        opt.zero_grad()
    return pm


class Logits(torch.nn.Module):
    """Calls a library model as users do and returns its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits
