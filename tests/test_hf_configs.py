"""``hf:`` models: Hugging Face configs built on the meta device (no weights), the shipped
configs against their published parameter counts, ``--set`` overrides, clear errors, and the
static-shape experts forward against the library's own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopar import models
from autopar.cli import main
from autopar.core.errors import ConfigError
from autopar.models import hf

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]

# Published parameter counts (total, active per token or None), with their sources.
PUBLISHED = {
    # Llama 3 8B / 70B model cards (meta-llama/Meta-Llama-3-{8B,70B}): 8.03B, 70.6B.
    "llama3-8b": (8.03e9, None),
    "llama3-70b": (70.6e9, None),
    # Llama 3.1 405B model card (meta-llama/Llama-3.1-405B) and "The Llama 3 Herd of Models": 405.9B.
    "llama3-405b": (405.9e9, None),
    # Mistral AI, "Mixtral of experts" blog (Dec 2023): 46.7B total, 12.9B used per token.
    "mixtral-8x7b": (46.7e9, 12.9e9),
    # Mixtral-8x22B-v0.1 model card: 140.6B (the blog rounds to 141B total, 39B active).
    "mixtral-8x22b": (140.6e9, 39e9),
    # Qwen1.5-MoE-A2.7B model card / Qwen blog (Mar 2024): 14.3B total, 2.7B activated.
    "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9),
    # DeepSeek-V3 Technical Report (arXiv:2412.19437): 671B total, 37B activated (MTP module excluded).
    "deepseek-v3": (671e9, 37e9),
    # Gemma 2 27B model card (google/gemma-2-27b) and Gemma 2 report (arXiv:2408.00118): 27.2B.
    "gemma2-27b": (27.2e9, None),
}

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
        "tie_word_embeddings": False}


def _write(tmp_path: Path, settings: dict, name: str = "tiny") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_published_config_is_shipped():
    assert hf.shipped_configs() == sorted(PUBLISHED)
    assert (hf.CONFIGS_DIR / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_builds_on_meta_with_the_published_count(name):
    cfg = models.get_config(f"hf:{name}")
    model = models.build(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.config.use_cache is False
    total, active = hf.param_counts(cfg)
    published_total, published_active = PUBLISHED[name]
    assert abs(total - published_total) / published_total < 0.01, total
    if published_active is not None:  # rounded to 2-3 digits where published
        assert abs(active - published_active) / published_active < 0.03, active
    else:
        assert active == total


def test_hf_llama3_405b_counts_like_the_zoo():
    # Both untie the output head: 405,853,388,800 parameters each.
    hf_count, zoo_count = models.param_count("hf:llama3-405b"), models.param_count("llama3-405b")
    assert hf_count == zoo_count == 405_853_388_800


def test_tied_embedding_counts_once():
    cfg = models.get_config("hf:gemma2-27b")
    model = models.build(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tied = model.lm_head.weight.numel()
    assert hf.param_count(cfg) == sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False)) - tied


def test_path_relative_to_cwd_and_shipped_name_agree(monkeypatch):
    monkeypatch.chdir(REPO)
    by_path = models.get_config("hf:autopar/models/configs/llama3-405b")
    by_file = models.get_config("hf:autopar/models/configs/llama3-405b/config.json")
    by_name = models.get_config("hf:llama3-405b")
    assert by_path.settings == by_file.settings == by_name.settings
    assert by_name.model_type == "llama" and by_name.max_seq == 131072 and by_name.vocab == 128256


def test_model_type_gives_the_library_default_with_overrides():
    cfg = models.get_config("hf:mixtral", {"num_hidden_layers": "2", "experts": "4", "layers": 3})
    from transformers import MixtralConfig
    assert cfg.model_type == "mixtral" and cfg.source == "transformers defaults"
    assert cfg.config.num_hidden_layers == 3 and cfg.config.num_local_experts == 4
    assert cfg.config.hidden_size == MixtralConfig().hidden_size


def test_overrides_convert_by_the_fields_type_and_rebuild_derived_fields():
    cfg = models.get_config("hf:llama3-8b", {"hidden_size": "1024", "rms_norm_eps": "1e-6",
                                             "tie_word_embeddings": "true", "hidden_act": "gelu",
                                             "pad_token_id": "0"})
    c = cfg.config
    assert (c.hidden_size, c.rms_norm_eps, c.tie_word_embeddings, c.hidden_act, c.pad_token_id) == \
        (1024, 1e-6, True, "gelu", 0)
    assert c.head_dim == 1024 // 32  # derived from the overridden hidden size, not kept at 128
    assert c.use_cache is False
    again = models.get_config(f"hf:{cfg.source}")
    assert again.config.hidden_size == 4096  # the file is not changed


def test_unknown_key_names_the_close_valid_ones():
    with pytest.raises(ConfigError) as err:
        models.get_config("hf:llama", {"num_hiden_layers": "2"})
    text = str(err.value)
    assert "unknown config key 'num_hiden_layers'" in text and "did you mean num_hidden_layers" in text
    assert "intermediate_size" in text and "fix:" in text


@pytest.mark.parametrize("overrides, message", [
    ({"num_hidden_layers": "two"}, "not a valid int"),
    ({"tie_word_embeddings": "maybe"}, "not a valid bool"),
    ({"rms_norm_eps": "small"}, "not a valid float"),
])
def test_bad_override_value_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        models.get_config("hf:llama", overrides)


def test_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(8\) must divide num_attention_heads \(4\)"):
        models.get_config("hf:mixtral", {"num_attention_heads": 4})


def test_bad_specs_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="close: llama3-8b"):
        models.get_config("hf:lama3-8b")
    with pytest.raises(ConfigError, match="holds no config.json"):
        models.get_config(f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match="no \"model_type\""):
        models.get_config(f"hf:{_write(tmp_path, {'hidden_size': 64}, 'untyped')}")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read"):
        models.get_config(f"hf:{tmp_path / 'broken.json'}")


def test_cli_dump_of_a_config_dir(capsys, tmp_path):
    directory = _write(tmp_path, TINY)
    want = models.param_count(f"hf:{directory}")
    code, out, _ = run(capsys, "dump", "--model", f"hf:{directory}", "--batch", "2", "--seq", "8", "--summary", "-q")
    assert code == 0
    assert f"parameters      {want / 1e3:.2f}K ({want:,})" in out
    assert "2 × LlamaDecoderLayer" in out and "at batch=2, seq=8" in out


def test_cli_dump_set_overrides_and_bad_key(capsys, tmp_path):
    directory = _write(tmp_path, TINY)
    code, out, _ = run(capsys, "dump", "--model", f"hf:{directory}", "--set", "num_hidden_layers=3",
                       "--set", "tie_word_embeddings=true", "--batch", "2", "--seq", "8", "--summary", "-q")
    assert code == 0 and "3 × LlamaDecoderLayer" in out
    tied = models.param_count(f"hf:{directory}") + 96 * 64 * 3 + 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 - 128 * 64
    assert f"({tied:,})" in out  # one more layer, and the head tied to the embedding: counted once
    code, out, err = run(capsys, "dump", "--model", f"hf:{directory}", "--set", "num_layers=3", "--summary", "-q")
    assert code == 2 and out == ""
    assert "autopar: error: unknown config key 'num_layers'" in err and "did you mean" in err
    assert "Traceback" not in err


def test_cli_dump_counts_gemma2_tied_head_once(capsys):
    overrides = {"num_hidden_layers": "2", "hidden_size": "64", "intermediate_size": "96", "vocab_size": "100",
                 "num_attention_heads": "4", "num_key_value_heads": "2", "head_dim": "16"}
    want = models.param_count(models.get_config("hf:gemma2", overrides))
    sets = [arg for k, v in overrides.items() for arg in ("--set", f"{k}={v}")]
    code, out, _ = run(capsys, "dump", "--model", "hf:gemma2", *sets, "--batch", "2", "--seq", "8", "--summary", "-q")
    assert code == 0 and f"({want:,})" in out
    head = next(line for line in out.splitlines() if line.startswith("lm_head"))
    assert head.split()[2] == "0"  # the head's weight is the embedding's, counted there


def test_cli_dump_seq_past_max_positions(capsys, tmp_path):
    directory = _write(tmp_path, TINY)
    code, _, err = run(capsys, "dump", "--model", f"hf:{directory}", "--seq", "65", "--summary", "-q")
    assert code == 2 and "max_seq 64" in err


def test_cli_dump_moe_regions_of_a_tiny_mixtral(capsys):
    sets = [arg for kv in ("layers=2", "hidden=64", "ffn=96", "vocab=128", "experts=4", "heads=4", "kv_heads=2")
            for arg in ("--set", kv)]  # the zoo's short keys, mapped onto Mixtral's fields
    code, out, _ = run(capsys, "dump", "--model", "hf:mixtral", *sets, "--batch", "2", "--seq", "8", "--summary", "-q")
    assert code == 0
    assert "MoE regions     2 (first model.layers.0.mlp): 4 experts, top-2" in out


def _moe_pair(model_type: str, **sizes) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny random model twice: the library's eager experts and autopar's capacity dispatch."""
    cfg = models.get_config(f"hf:{model_type}", {"num_hidden_layers": 1, "hidden_size": 32, "vocab_size": 64,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2, **sizes})
    torch.manual_seed(0)
    ours = models.build(cfg, device="cpu")
    ref = models.build(hf.with_overrides(cfg, {"experts_implementation": "eager"}), device="cpu")
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("model_type, sizes", [
    ("mixtral", {"intermediate_size": 48, "num_local_experts": 4}),
    ("qwen2_moe", {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 48, "num_experts": 6}),
])
def test_capacity_experts_match_the_library_when_nothing_is_dropped(monkeypatch, model_type, sizes):
    monkeypatch.setattr(hf, "CAPACITY_FACTOR", 8.0)  # capacity >= every token: no drops
    ours, ref = _moe_pair(model_type, **sizes)
    idx = torch.randint(0, 64, (2, 8))
    out, want = ours(idx).logits, ref(idx).logits
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
