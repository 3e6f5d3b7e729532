"""Hugging Face ``transformers`` causal LMs built from their config alone: no download, no weights.

``hf:SPEC`` names a model three ways, tried in this order:

1. a directory (absolute, or relative to the working directory) holding a ``config.json``,
   or the ``config.json`` file itself;
2. a config shipped with autopar under ``autopar/models/configs/`` (``hf:llama3-405b``);
3. a ``model_type`` of ``transformers`` (``hf:llama``, ``hf:mixtral``): the library's default config.

The model is ``AutoModelForCausalLM.from_config`` built under ``torch.device(device)`` (meta by
default: nothing is allocated), with ``use_cache=False``; its parameter names are the library's,
so they match the published checkpoints. Overrides (``--set key=value``) change config fields;
values are converted to the type of the field's current value, and the config is rebuilt from
the original settings plus the overrides, so derived fields (``head_dim``, ``layer_types``) follow.

Mixture-of-experts layers: the library's default experts forward loops over the experts that
received tokens (data-dependent, so it cannot be captured), so autopar registers and selects a
static-shape one, ``autopar_capacity``: tokens are dispatched into per-expert buffers of
``capacity = ceil(CAPACITY_FACTOR * tokens * top_k / experts)`` rows (tokens over capacity are
dropped, as in the zoo's :class:`~autopar.models.moe.MoELayer`) and each expert is a batched matmul
against the stacked ``[E, ...]`` weights. ``--set experts_implementation=grouped_mm`` (dropless)
captures too, but autopar has no FLOP rule for ``aten._grouped_mm`` yet, so its expert matmuls are
priced at zero; the library's ``eager`` loop cannot be captured.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.core.errors import ConfigError, UnsupportedError
from .moe import expert_capacity

HF_PREFIX = "hf:"
CONFIGS_DIR = Path(__file__).with_name("configs")
CAPACITY_FACTOR = 1.25
EXPERTS_IMPLEMENTATION = "autopar_capacity"

# The zoo's short keys, accepted where the config has the field they stand for.
_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size",), "layers": ("num_hidden_layers",), "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",), "ffn": ("intermediate_size",), "vocab": ("vocab_size",),
    "max_seq": ("max_position_embeddings",), "top_k": ("num_experts_per_tok",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
}
# Keys autopar reads itself rather than the config class.
_AUTOPAR_KEYS = ("experts_implementation",)
# Keys that describe the file, not the model: not overridable.
_FIXED_KEYS = ("model_type", "transformers_version", "architectures", "_name_or_path", "auto_map")


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """A ``transformers`` config plus where it came from and the settings that rebuild it."""

    name: str                          # what followed ``hf:``
    source: str                        # the config.json read, or "transformers defaults"
    model_type: str
    settings: Mapping[str, Any]        # config.json contents (or {}) with overrides applied
    experts_implementation: str = EXPERTS_IMPLEMENTATION
    config: Any = field(compare=False, repr=False)   # the transformers PretrainedConfig

    @property
    def vocab(self) -> int:
        """Vocabulary size (input ids are drawn below it)."""
        return int(self.config.vocab_size)

    @property
    def max_seq(self) -> int:
        """Longest sequence the position encoding is configured for (0: unbounded)."""
        return _max_positions(self.config)


def is_hf_spec(name: object) -> bool:
    """True for ``hf:...`` model names."""
    return isinstance(name, str) and name.startswith(HF_PREFIX)


def shipped_configs() -> list[str]:
    """Names of the config directories shipped under ``autopar/models/configs/``."""
    if not CONFIGS_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in CONFIGS_DIR.glob("*/config.json"))


def load_config(spec: str, overrides: Mapping[str, Any] | None = None) -> HFConfig:
    """The config ``hf:SPEC`` names (see the module docstring), with ``overrides`` applied."""
    name = spec[len(HF_PREFIX):] if is_hf_spec(spec) else spec
    _transformers()
    path = _config_path(name)
    if path is not None:
        settings, model_type, source = _read_config_json(path, spec)
    else:
        model_type, settings, source = _model_type(name, spec), {}, "transformers defaults"
    base = HFConfig(name=name, source=source, model_type=model_type, settings=settings,
                    config=_make_config(model_type, settings, spec))
    return with_overrides(base, overrides)


def with_overrides(cfg: HFConfig, overrides: Mapping[str, Any] | None) -> HFConfig:
    """``cfg`` with fields overridden; a key the config lacks raises ConfigError naming close ones."""
    if not overrides:
        return cfg
    current = {**cfg.config.to_dict(), **cfg.settings}
    attribute_map = dict(getattr(cfg.config, "attribute_map", {}) or {})
    settings, impl = dict(cfg.settings), cfg.experts_implementation
    where = f"hf:{cfg.name} ({cfg.source})"
    for raw_key, value in overrides.items():
        key = _canonical_key(str(raw_key).strip(), current, attribute_map, where)
        if key == "experts_implementation":
            impl = str(value)
            continue
        settings[key] = _convert(key, value, current.get(key), where)
    return HFConfig(name=cfg.name, source=cfg.source, model_type=cfg.model_type, settings=settings,
                    experts_implementation=impl, config=_make_config(cfg.model_type, settings, where))


def build_model(cfg: HFConfig, *, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on ``device`` (meta: no memory), caches off."""
    transformers = _transformers()
    config = _make_config(cfg.model_type, cfg.settings, cfg.name)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=False, experts_implementation=cfg.experts_implementation)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"transformers cannot build a causal LM from hf:{cfg.name}: {exc}",
                          where=cfg.source, expected="a model_type with an AutoModelForCausalLM class",
                          got=cfg.model_type, fix="pick a decoder model type (llama, mixtral, qwen2, gemma2, ...) "
                          "or fix the config fields the message names") from exc
    model.config.use_cache = False
    return model


def example_inputs(config: Any, batch: int, seq: int, *, device: str | torch.device = "meta"
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, str], ...]]:
    """``input_ids`` ``[batch, seq]`` for a ``transformers`` config (or :class:`HFConfig`)."""
    config = config.config if isinstance(config, HFConfig) else config
    max_seq = _max_positions(config)
    if max_seq and seq > max_seq:
        raise ConfigError(f"seq {seq} exceeds the model's max_position_embeddings {max_seq}",
                          where="example_inputs", expected=f"seq <= {max_seq}", got=str(seq),
                          fix="use a shorter seq or --set max_position_embeddings=N")
    idx = torch.randint(0, int(config.vocab_size), (batch, seq), device=device, dtype=torch.long)
    return (idx,), ({0: "batch", 1: "seq"},)


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` model (its ``.config`` is a PretrainedConfig)."""
    cfg = getattr(model, "config", None)
    return cfg is not None and type(cfg).__module__.startswith("transformers.")


def param_count(cfg: HFConfig) -> int:
    """Parameters of the built model, a tied embedding/head counted once."""
    return param_counts(cfg)[0]


def active_param_count(cfg: HFConfig) -> int:
    """Parameters a token passes through: routed experts count ``top_k / experts`` (shared ones fully)."""
    return param_counts(cfg)[1]


def param_counts(cfg: HFConfig) -> tuple[int, int]:
    """(total, active per token) of the model built on the meta device; tied parameters count once.

    Routed experts are the parameters of a module named ``experts`` with a ``num_experts``
    attribute (the library's stacked-expert modules); they count ``top_k / num_experts``.
    """
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    active = total
    top_k = getattr(cfg.config, "num_experts_per_tok", None)
    for fqn, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if fqn.rsplit(".", 1)[-1] == "experts" and top_k and experts:
            routed = sum(p.numel() for p in module.parameters())
            active -= routed - routed * top_k // experts
    return total, active


def _transformers():
    """The ``transformers`` module, with autopar's static-shape experts forward registered."""
    try:
        import transformers
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:
        raise UnsupportedError("hf: models need the transformers library", where="--model hf:...",
                               got=str(exc), fix="pip install 'transformers>=5'") from exc
    if EXPERTS_IMPLEMENTATION not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, capacity_experts_forward)
    return transformers


def _config_path(name: str) -> Path | None:
    """The config.json ``name`` points at (a path, or a shipped config's name), or None."""
    for candidate in (Path(name), CONFIGS_DIR / name):
        if candidate.is_dir() and (candidate / "config.json").is_file():
            return candidate / "config.json"
        if candidate.is_file() and candidate.name.endswith(".json"):
            return candidate
    if Path(name).is_dir():
        raise ConfigError(f"directory {name!r} holds no config.json", where=f"hf:{name}",
                          fix="point hf: at a directory with a transformers config.json")
    return None


def _read_config_json(path: Path, spec: str) -> tuple[dict[str, Any], str, str]:
    """(settings, model_type, source) from a config.json."""
    try:
        settings = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", where=spec, fix="write a valid JSON config.json") from exc
    if not isinstance(settings, dict) or not isinstance(settings.get("model_type"), str):
        raise ConfigError(f"{path} has no \"model_type\"", where=spec, expected='e.g. "model_type": "llama"',
                          fix="add the model_type field transformers uses to pick the architecture")
    model_type = settings["model_type"]
    _model_type(model_type, str(path))
    return {k: v for k, v in settings.items() if k not in _FIXED_KEYS}, model_type, str(path)


def _model_type(name: str, where: str) -> str:
    """``name`` if it is a model_type transformers knows, else ConfigError with close matches."""
    from transformers import CONFIG_MAPPING
    if name in CONFIG_MAPPING:
        return name
    shipped = shipped_configs()
    close = difflib.get_close_matches(name, [*shipped, *CONFIG_MAPPING.keys()], n=5, cutoff=0.5)
    raise ConfigError(f"hf:{name} is neither a directory with a config.json, a shipped config, nor a "
                      "transformers model_type", where=where,
                      expected=f"a path, one of the shipped configs ({', '.join(shipped)}), or a model_type"
                               + (f"; close: {', '.join(close)}" if close else ""),
                      got=repr(name), fix="e.g. --model hf:llama3-8b, hf:path/to/dir or hf:mixtral")


def _make_config(model_type: str, settings: Mapping[str, Any], where: str) -> Any:
    """``AutoConfig.for_model(model_type, **settings)`` with ``use_cache=False``."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.for_model(model_type, **{**settings, "use_cache": False})
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"transformers rejects the {model_type} config: {exc}", where=where,
                          fix="change the --set overrides (or config.json fields) the message names") from exc
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        # transformers accepts this and fails later inside attention, far from the cause.
        raise ConfigError(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})",
                          where=where, expected="grouped-query attention: heads % kv_heads == 0",
                          got=f"num_attention_heads={heads}, num_key_value_heads={kv_heads}",
                          fix="--set num_key_value_heads=N with N dividing num_attention_heads")
    return config


def _canonical_key(key: str, current: Mapping[str, Any], attribute_map: Mapping[str, str], where: str) -> str:
    """The config field a user key names (itself, an attribute_map alias, or a zoo short key)."""
    if key in _AUTOPAR_KEYS:
        return key
    if key in attribute_map:
        return attribute_map[key]
    if key in current and key not in _FIXED_KEYS:
        return key
    for target in _ALIASES.get(key, ()):
        if target in current:
            return target
    from transformers import PretrainedConfig
    generic = set(PretrainedConfig().to_dict())
    valid = sorted(k for k in current if k not in _FIXED_KEYS and not k.startswith("_"))
    close = difflib.get_close_matches(key, [*valid, *attribute_map, *_AUTOPAR_KEYS], n=5, cutoff=0.5)
    raise ConfigError(f"unknown config key {key!r}", where=where,
                      expected=(f"did you mean {', '.join(close)}? " if close else "")
                               + f"model keys: {', '.join(k for k in valid if k not in generic)} "
                               "(and the generic PretrainedConfig keys)",
                      got=repr(key), fix="use a field of the model's config.json")


def _convert(key: str, value: Any, current: Any, where: str) -> Any:
    """``value`` (a CLI string or a Python value) as the type of the field's current value."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if isinstance(current, bool):
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("not a boolean")
            return lowered in ("true", "1", "yes")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, str):
            return text
        if isinstance(current, (list, dict)):
            parsed = json.loads(text)
            if not isinstance(parsed, type(current)):
                raise ValueError(f"not a JSON {type(current).__name__}")
            return parsed
    except (ValueError, json.JSONDecodeError) as exc:
        typ = type(current).__name__
        raise ConfigError(f"override {key}={value!r} is not a valid {typ}", where=where, expected=typ,
                          got=repr(value), fix=f"pass a value like {key}={json.dumps(current)}") from exc
    try:  # the field is None (unset): a JSON literal if it parses, else the string
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _max_positions(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def capacity_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Static-shape experts forward for ``transformers`` stacked-expert modules.

    ``hidden_states`` ``[T, h]``; ``top_k_index`` / ``top_k_weights`` ``[T, k]`` from the router.
    Rows are choice-major (every token's 1st choice takes a buffer place before any 2nd choice);
    a row past its expert's capacity is dropped (weight 0). Each expert runs as one batched
    matmul over its ``[capacity, h]`` buffer, so shapes depend only on ``T``.
    """
    tokens, hidden = hidden_states.shape
    top_k, experts = top_k_index.shape[-1], self.num_experts
    capacity = expert_capacity(tokens, experts, top_k, CAPACITY_FACTOR)
    expert = top_k_index.t().reshape(-1)
    weight = top_k_weights.t().reshape(-1).to(hidden_states.dtype)
    onehot = (expert.unsqueeze(-1) == torch.arange(experts, device=expert.device)).long()
    position = (torch.cumsum(onehot, dim=0) * onehot).sum(dim=-1) - 1
    keep = (position < capacity).to(hidden_states.dtype)
    position = position * keep.long()
    src = hidden_states.repeat(top_k, 1) * keep.unsqueeze(-1)
    buf = hidden_states.new_zeros(experts, capacity, hidden).index_put((expert, position), src, accumulate=True)
    if self.has_gate:
        up = _expert_linear(self, buf, self.gate_up_proj, getattr(self, "gate_up_proj_bias", None))
        act = self._apply_gate(up)
    else:
        act = self.act_fn(_expert_linear(self, buf, self.up_proj, getattr(self, "up_proj_bias", None)))
    out = _expert_linear(self, act, self.down_proj, getattr(self, "down_proj_bias", None))
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    picked = out[expert, position] * (weight * keep).unsqueeze(-1)
    return picked.view(top_k, tokens, hidden).sum(dim=0).to(hidden_states.dtype)


def _expert_linear(module: nn.Module, buf: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``[E, C, in] @ weight`` for weights stored ``[E, out, in]`` (or ``[E, in, out]`` transposed)."""
    out = torch.bmm(buf, weight if module.is_transposed else weight.transpose(1, 2))
    if module.has_bias and bias is not None:
        out = out + bias.unsqueeze(1)
    return out
