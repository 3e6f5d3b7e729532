"""The same model with fewer layers: what the planner captures instead of every layer.

A transformer's layers are copies of a few *kinds* (dense or mixture-of-experts, sliding or
full attention) laid out in a pattern. :func:`layer_kinds` reads that pattern from the config
(one hashable kind per layer); :func:`shrink` finds its longest periodic *run* (layers
``a .. b-1`` repeating with period ``p``: deepseek-v3's 58 MoE layers after 3 dense ones,
``p = 1``; gemma2's alternating sliding and full layers, ``p = 2``) and keeps of it only a few
periods, two by default (plus the run's remainder, so the layers after it keep their phase),
every layer before and after the run as it is. Each kind of the run is then there at least
twice (the block detector, ``passes/blocks.py``, needs two copies to call layers a class), and
the part before and after the run is the real model's.

Kinds over-distinguish rather than under-distinguish: a rule like "every n-th layer is MoE"
becomes the layer index modulo n. A config field that looks like it varies layers
(``*layer*``, ``*period*``, ``*pattern*``, ...) but that this module does not know makes the
model unshrinkable (:func:`layer_kinds` returns None), so an unknown scheme costs time, never
correctness; and the shrunk config's own kinds must be the kept layers' kinds.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from autopar.core.errors import ConfigError
from autopar.passes.replicate import periodic_run
from . import hf
from .gpt import GPTConfig
from .llama import LlamaConfig

log = logging.getLogger("autopar.depth")

# HF config fields that make layer i of one kind or another, and how (value v, layer index i).
_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")   # i < v
_SUFFIX_KEYS = ("moe_layer_end_index",)                                                  # i > v
_PERIOD_KEYS = ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step", "no_rope_layer_interval",
                "attn_layer_period", "expert_layer_period", "moe_layer_interval", "sliding_window_pattern",
                "_sliding_window_pattern", "global_attn_every_n_layers")                  # i % v
_INDEX_KEYS = ("mlp_only_layers", "moe_layers")                                          # i in v
# Fields whose names look per-layer but say nothing about which layer is which kind (the
# offsets go with a period key above, whose i % v already tells every offset apart).
_NEUTRAL_KEYS = frozenset({
    "num_hidden_layers", "layer_norm_eps", "layer_norm_epsilon", "layerdrop", "qk_layernorm",
    "do_layer_norm_before", "layer_norm_elementwise_affine", "apply_residual_connection_post_layernorm",
    "num_nextn_predict_layers", "rope_interleave", "attn_layer_offset", "expert_layer_offset"})
_SUSPECT = re.compile(r"layer|sparse_step|period|interval|interleave|pattern|every_n|_idxs|_ids$|freq|dense|index")


@dataclass(frozen=True)
class Shrunk:
    """A model config with fewer layers, and where its layers come from.

    The shrunk model's layers are the real model's ``indices``; of them, positions
    ``run_start .. run_start + run_kept - 1`` stand for the real model's ``run_layers`` layers
    of the periodic run (the other kept layers are the real model's, in place)."""

    config: Any
    indices: tuple[int, ...]
    layers: int                       # the real model's layer count
    run_start: int
    run_kept: int
    run_layers: int
    period: int


def layer_count(config: Any) -> int | None:
    """Layers of a zoo transformer (``layers``) or a ``transformers`` config (``num_hidden_layers``);
    None for anything else (a zoo MLP, a composite config)."""
    if isinstance(config, (GPTConfig, LlamaConfig)):
        return config.layers
    if isinstance(config, hf.HFConfig):
        n = getattr(config.config, "num_hidden_layers", None)
        return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def layer_kinds(config: Any) -> list[Hashable] | None:
    """One kind per layer (module docstring); None when the config's pattern is not understood."""
    n = layer_count(config)
    if n is None:
        return None
    if not isinstance(config, hf.HFConfig):
        return [()] * n                   # the zoo's transformers: every layer alike
    return _hf_kinds(config.config, n)


def config_layer_kinds(config: Any, n: int) -> list[Hashable] | None:
    """One kind per layer of a ``transformers`` config with ``n`` layers (None when its
    pattern is not understood): what :mod:`autopar.passes.replicate` trusts too."""
    return _hf_kinds(config, n)


def _hf_kinds(config: Any, n: int) -> list[Hashable] | None:
    fields = config.to_dict()
    count_key = (getattr(config, "attribute_map", None) or {}).get("num_hidden_layers", "num_hidden_layers")
    lists = _per_layer_lists(fields, n)
    known = set(_PREFIX_KEYS + _SUFFIX_KEYS + _PERIOD_KEYS + _INDEX_KEYS) | _NEUTRAL_KEYS | set(lists) | {count_key}
    known.add("max_window_layers")        # a prefix rule below, or already in layer_types
    unknown = [k for k, v in fields.items()
               if _SUSPECT.search(k) and k not in known and v is not None and v is not False]
    if unknown:
        log.info("layer pattern not understood (%s): capturing every layer", ", ".join(unknown))
        return None
    rules: list[tuple[str, Any]] = []
    prefix_keys = _PREFIX_KEYS + (() if "layer_types" in lists else ("max_window_layers",))
    for keys, rule in ((prefix_keys, "prefix"), (_SUFFIX_KEYS, "suffix"), (_PERIOD_KEYS, "period"),
                       (_INDEX_KEYS, "index")):
        for k in keys:
            v = fields.get(k)
            if v is None or v is False:
                continue
            if not _valid_rule(rule, v):
                log.info("layer pattern field %s=%r not understood: capturing every layer", k, v)
                return None
            rules.append((rule, v))
    return [tuple([_hashable(fields[k][i]) for k in lists] + [_apply_rule(rule, v, i) for rule, v in rules])
            for i in range(n)]


def _valid_rule(rule: str, v: Any) -> bool:
    if rule == "index":
        return isinstance(v, (list, tuple)) and all(isinstance(i, int) for i in v)
    return isinstance(v, int) and not isinstance(v, bool) and (rule != "period" or v >= 1)


def _apply_rule(rule: str, v: Any, i: int) -> Hashable:
    """Layer ``i``'s value under one rule: what tells its layers apart (module docstring)."""
    if rule == "prefix":
        return i < v
    if rule == "suffix":
        return i > v
    if rule == "period":
        return i % v
    return i in v


def _per_layer_lists(fields: dict[str, Any], n: int) -> list[str]:
    """Fields holding one value per layer (``layer_types``, ``mlp_layer_types``, ...)."""
    return [k for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == n and k not in _INDEX_KEYS]


def _hashable(v: Any) -> Hashable:
    return repr(v) if isinstance(v, (list, dict)) else v


def shrink(config: Any, periods: int = 2) -> Shrunk | None:
    """``config`` with its periodic run cut to ``periods`` periods (module docstring); None when
    the pattern is not understood, the cut saves no layer, or the shrunk config's layers are not
    the kinds it should have."""
    kinds = layer_kinds(config)
    if kinds is None or not kinds:
        return None
    n = len(kinds)
    a, b, p = periodic_run(kinds)
    kept = periods * p + (b - a) % p
    if kept >= b - a:
        return None
    indices = tuple([*range(a + kept), *range(b, n)])
    try:
        small = _with_layers(config, indices, n)
    except ConfigError as exc:
        log.info("cannot build %d of %d layers (%s): capturing every layer", len(indices), n, exc)
        return None
    if layer_kinds(small) != [kinds[i] for i in indices]:
        log.info("the %d-layer config does not keep the layer pattern: capturing every layer", len(indices))
        return None
    return Shrunk(config=small, indices=indices, layers=n, run_start=a, run_kept=kept, run_layers=b - a, period=p)


def _with_layers(config: Any, indices: tuple[int, ...], n: int) -> Any:
    """``config`` with only the layers ``indices`` (per-layer fields cut to match)."""
    if not isinstance(config, hf.HFConfig):
        return dataclasses.replace(config, layers=len(indices))
    fields = config.config.to_dict()
    over: dict[str, Any] = {"num_hidden_layers": len(indices)}
    for k in _per_layer_lists(fields, n):
        over[k] = [fields[k][i] for i in indices]
    for k in _INDEX_KEYS:
        if isinstance(fields.get(k), (list, tuple)):
            old = set(fields[k])
            over[k] = [j for j, i in enumerate(indices) if i in old]
    for k in (*_PREFIX_KEYS, *_SUFFIX_KEYS, "max_window_layers"):   # thresholds move with the layers
        v = fields.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            moved = sum(i <= v for i in indices) - 1 if k in _SUFFIX_KEYS else sum(i < v for i in indices)
            if moved != v:
                over[k] = moved
    return hf.with_overrides(config, over)


__all__ = ["Shrunk", "config_layer_kinds", "layer_count", "layer_kinds", "periodic_run", "shrink"]


def model_layer_kinds(model: Any) -> tuple[list[Any], bool] | None:
    """One kind per layer of a zoo model or a ``transformers`` one, read from its config, and
    whether it is a ``transformers`` one; None for any other model (the capture's layer-run
    search, :func:`autopar.passes.replicate.find_run`, asks this: ``autopar/__init__.py``
    registers it)."""
    import sys
    cfg = getattr(model, "config", None)
    if isinstance(cfg, (GPTConfig, LlamaConfig)):
        return layer_kinds(cfg), False
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(cfg, tf.PretrainedConfig):
        return None
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    kinds = config_layer_kinds(cfg, n)
    return (kinds, True) if kinds is not None else None
