"""Model zoo: plain ``nn.Module`` GPT, LLaMA, Mixtral-style MoE and MLP, plus a registry;
``hf:`` names build Hugging Face ``transformers`` models from a config (:mod:`.hf`)."""
from __future__ import annotations

from .gpt import GPT, GPTConfig
from .hf import HFConfig
from .llama import Llama, LlamaConfig, RMSNorm
from .mlp import MLP, MLPConfig
from .moe import MoE, MoEConfig, MoELayer, expert_capacity
from .registry import (
    MODEL_NAMES,
    active_param_count,
    build,
    example_inputs,
    get_config,
    list_hf_configs,
    list_models,
    param_count,
)

__all__ = [
    "GPT", "GPTConfig", "Llama", "LlamaConfig", "RMSNorm", "MLP", "MLPConfig",
    "HFConfig", "MoE", "MoEConfig", "MoELayer", "expert_capacity", "MODEL_NAMES",
    "active_param_count", "build", "example_inputs", "get_config", "list_hf_configs", "list_models", "param_count",
]

from autopar.core.lazy import submodules as _submodules  # noqa: E402

__getattr__ = _submodules(__name__)     # the other modules, imported on first use
