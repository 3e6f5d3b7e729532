"""Named model configs, override parsing, meta-device building, example inputs, param counts."""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Union

import torch
from torch import nn

from autopar.core.errors import ConfigError
from . import hf
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import MLP, MLPConfig
from .moe import MoE, MoEConfig

ModelConfig = Union[GPTConfig, LlamaConfig, MoEConfig, MLPConfig, hf.HFConfig]
Override = Union[str, int, float]

_LLAMA3 = dict(kv_heads=8, vocab=128256, rope_theta=500000.0, norm_eps=1e-5)
_MIXTRAL = dict(kv_heads=8, experts=8, top_k=2, capacity_factor=1.25, rope_theta=1e6, norm_eps=1e-5)

_NAMED: dict[str, tuple[type, dict[str, Any]]] = {
    "gpt": (GPTConfig, {}),
    "llama": (LlamaConfig, {}),
    "moe": (MoEConfig, {}),
    "mlp": (MLPConfig, {}),
    "gpt2-small": (GPTConfig, dict(hidden=768, layers=12, heads=12, vocab=50257, max_seq=1024)),
    "gpt3-175b": (GPTConfig, dict(hidden=12288, layers=96, heads=96, vocab=50257, max_seq=2048)),
    "llama3-8b": (LlamaConfig, dict(_LLAMA3, hidden=4096, layers=32, heads=32, ffn=14336,
                                    max_seq=8192)),
    "llama3-70b": (LlamaConfig, dict(_LLAMA3, hidden=8192, layers=80, heads=64, ffn=28672,
                                     max_seq=8192)),
    "llama3-405b": (LlamaConfig, dict(_LLAMA3, hidden=16384, layers=126, heads=128, ffn=53248,
                                      max_seq=131072)),
    "mixtral-8x7b": (MoEConfig, dict(_MIXTRAL, hidden=4096, layers=32, heads=32, ffn=14336,
                                     vocab=32000, max_seq=32768)),
    "mixtral-8x22b": (MoEConfig, dict(_MIXTRAL, hidden=6144, layers=56, heads=48, ffn=16384,
                                      vocab=32768, max_seq=65536)),
}

MODEL_NAMES: tuple[str, ...] = tuple(_NAMED)

# Generic short keys that map onto a differently named field of one family.
_ALIASES: dict[type, dict[str, str]] = {MLPConfig: {"hidden": "width", "layers": "depth"}}

_MODEL_CLASSES: tuple[tuple[type, type[nn.Module]], ...] = (
    (MoEConfig, MoE), (LlamaConfig, Llama), (GPTConfig, GPT), (MLPConfig, MLP),
)


def list_models() -> list[str]:
    """Every zoo name :func:`get_config` and :func:`build` accept (``hf:`` names aside)."""
    return list(MODEL_NAMES)


def list_hf_configs() -> list[str]:
    """The ``hf:NAME`` configs shipped with autopar (``autopar/models/configs/NAME/config.json``)."""
    return [hf.HF_PREFIX + name for name in hf.shipped_configs()]


def _convert(cls: type, key: str, value: Override) -> Any:
    """Convert one override value (possibly a CLI string) to the type of field ``key``."""
    typ = typing.get_type_hints(cls)[key]
    where = f"{cls.__name__}.{key}"
    try:
        if isinstance(value, bool):
            raise ValueError("booleans are not accepted")
        if typ is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError("not an integer")
                return int(value)
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if typ is float:
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"override {key}={value!r} is not a valid {typ.__name__}", where=where,
                          expected=typ.__name__, got=repr(value), fix=f"pass e.g. {key}=4") from exc
    return value


def _apply_overrides(cls: type, base: Mapping[str, Any], overrides: Mapping[str, Override] | None,
                     where: str) -> Any:
    """Build ``cls(**base, **converted overrides)``, raising ConfigError on any bad key/value."""
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = dict(base)
    for raw_key, value in (overrides or {}).items():
        key = str(raw_key).strip().replace("-", "_")
        key = _ALIASES.get(cls, {}).get(key, key)
        if key not in valid:
            raise ConfigError(f"unknown override key {raw_key!r} for {cls.__name__}", where=where,
                              expected=f"one of {', '.join(valid)}", got=repr(raw_key),
                              fix="use one of the listed keys")
        kwargs[key] = _convert(cls, key, value)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"invalid model config: {exc}", where=where,
                          fix="change the overrides so the config is consistent") from exc


def get_config(name: str, overrides: Mapping[str, Override] | None = None) -> ModelConfig:
    """The config dataclass of the named model, with ``overrides`` (short field keys) applied.

    ``hf:SPEC`` names a Hugging Face config (a directory, a shipped config or a model_type;
    see :mod:`autopar.models.hf`) and returns an :class:`~autopar.models.hf.HFConfig`.
    """
    if hf.is_hf_spec(name):
        return hf.load_config(name, overrides)
    if name not in _NAMED:
        raise ConfigError(f"unknown model {name!r}", where="model name",
                          expected=f"one of {', '.join(MODEL_NAMES)}", got=repr(name),
                          fix="pick one of the listed model names")
    cls, base = _NAMED[name]
    return _apply_overrides(cls, base, overrides, where=f"model {name!r}")


def _resolve(name_or_config: str | ModelConfig, overrides: Mapping[str, Override] | None
             ) -> ModelConfig:
    """A config from a name or an existing config, with overrides applied."""
    if isinstance(name_or_config, str):
        return get_config(name_or_config, overrides)
    if isinstance(name_or_config, hf.HFConfig):
        return hf.with_overrides(name_or_config, overrides)
    if not dataclasses.is_dataclass(name_or_config) or isinstance(name_or_config, type):
        raise ConfigError("expected a model name or a model config", where="model",
                          expected="str or one of GPTConfig, LlamaConfig, MoEConfig, MLPConfig, HFConfig",
                          got=type(name_or_config).__name__)
    if not overrides:
        return name_or_config
    cls = type(name_or_config)
    base = {f.name: getattr(name_or_config, f.name) for f in dataclasses.fields(cls)}
    return _apply_overrides(cls, base, overrides, where=cls.__name__)


def _model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The nn.Module class that implements a config."""
    for cfg_cls, model_cls in _MODEL_CLASSES:
        if isinstance(cfg, cfg_cls):
            return model_cls
    raise ConfigError("unsupported model config", where="model",
                      expected="GPTConfig, LlamaConfig, MoEConfig or MLPConfig",
                      got=type(cfg).__name__)


def build(name_or_config: str | ModelConfig, overrides: Mapping[str, Override] | None = None, *,
          device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Instantiate a model on ``device`` (``meta`` by default: no memory is allocated)."""
    cfg = _resolve(name_or_config, overrides)
    if isinstance(cfg, hf.HFConfig):
        return hf.build_model(cfg, device=device, dtype=dtype)
    with torch.device(device):
        model = _model_class(cfg)(cfg)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model


def example_inputs(model_or_name: nn.Module | str | ModelConfig, batch: int, seq: int, *,
                   device: str | torch.device = "meta",
                   overrides: Mapping[str, Override] | None = None,
                   dtype: torch.dtype | None = None,
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, str], ...]]:
    """Example positional args for ``forward`` and, per arg, its symbolic dims (``batch``/``seq``).

    ``dtype`` applies to float inputs (the MLP's); it defaults to the model's parameter dtype.
    """
    if isinstance(model_or_name, nn.Module) and hf.is_hf_model(model_or_name):
        return hf.example_inputs(model_or_name.config, batch, seq, device=device)
    if isinstance(model_or_name, nn.Module):
        cfg = getattr(model_or_name, "config", None)
        if cfg is None:
            raise ConfigError("model has no .config", where=type(model_or_name).__name__,
                              fix="pass a model built by autopar.models.build, or its name")
        if dtype is None:
            dtype = next(model_or_name.parameters()).dtype
    else:
        cfg = _resolve(model_or_name, overrides)
    if isinstance(cfg, hf.HFConfig):
        return hf.example_inputs(cfg, batch, seq, device=device)
    if isinstance(cfg, MLPConfig):
        x = torch.randn(batch, cfg.width, device=device, dtype=dtype or torch.float32)
        return (x,), ({0: "batch"},)
    if seq > cfg.max_seq:
        raise ConfigError(f"seq {seq} exceeds the model's max_seq {cfg.max_seq}",
                          where="example_inputs", expected=f"seq <= {cfg.max_seq}", got=str(seq),
                          fix="use a shorter seq or override max_seq")
    idx = torch.randint(0, cfg.vocab, (batch, seq), device=device, dtype=torch.long)
    return (idx,), ({0: "batch", 1: "seq"},)


def _llama_counts(cfg: LlamaConfig) -> tuple[int, int, int]:
    """(embedding + head + final norm, per-layer non-MLP params, per-layer MLP params)."""
    h, d = cfg.hidden, cfg.head_dim
    outer = 2 * cfg.vocab * h + h
    attn = 2 * h * cfg.heads * d + 2 * h * cfg.kv_heads * d + 2 * h
    return outer, attn, 3 * h * cfg.ffn


def param_count(config: ModelConfig | str) -> int:
    """Analytic number of parameters of the model ``build(config)`` makes (``hf:`` models:
    counted on the meta-device model, a tied embedding and head once)."""
    cfg = _resolve(config, None)
    if isinstance(cfg, hf.HFConfig):
        return hf.param_count(cfg)
    if isinstance(cfg, MLPConfig):
        return cfg.depth * (cfg.width * cfg.width + cfg.width)
    if isinstance(cfg, GPTConfig):
        h, f = cfg.hidden, cfg.ffn_dim
        block = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return cfg.vocab * h + cfg.max_seq * h + cfg.layers * block + 2 * h
    outer, attn, mlp = _llama_counts(cfg)
    if isinstance(cfg, MoEConfig):
        mlp = cfg.experts * mlp + cfg.hidden * cfg.experts
    return outer + cfg.layers * (attn + mlp)


def active_param_count(config: ModelConfig | str) -> int:
    """Parameters used per token: for MoE only ``top_k`` of the experts count (router included)."""
    cfg = _resolve(config, None)
    if isinstance(cfg, hf.HFConfig):
        return hf.active_param_count(cfg)
    if not isinstance(cfg, MoEConfig):
        return param_count(cfg)
    outer, attn, mlp = _llama_counts(cfg)
    mlp = cfg.top_k * mlp + cfg.hidden * cfg.experts
    return outer + cfg.layers * (attn + mlp)
