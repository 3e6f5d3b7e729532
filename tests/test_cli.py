"""The autopar CLI: dump in text/json/dot, user models, clear errors."""
from __future__ import annotations

import json
import textwrap

import pytest

from autopar.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dump_json_totals_and_nodes(capsys):
    code, out, err = run(capsys, "dump", "--model", "gpt", "--set", "layers=2", "--batch", "3", "--seq", "16",
                         "--format", "json")
    assert code == 0 and "[autopar]" in err  # progress goes to stderr, data to stdout
    data = json.loads(out)
    assert data["sizes"] == {"batch": 3, "seq": 16}
    assert data["totals"]["params"] == sum(m["params"] for m in data["modules"])
    assert data["totals"]["flops_fwd"] == sum(n["flops_fwd"] for n in data["nodes"])
    assert [len(c["members"]) for c in data["block_classes"]] == [2]
    linears = [n for n in data["nodes"] if n["op"] == "linear"]
    assert [n["fqn"] for n in linears].count("") == 1  # only the tied LM head runs in the root module
    assert all(sh[:2] == [3, 16] for n in linears for sh in n["shapes_at_size"])


def test_dump_text_is_one_line_per_node_with_summary(capsys):
    code, out, _ = run(capsys, "dump", "--model", "llama", "--set", "layers=2", "--batch", "2", "--seq", "8", "-q")
    assert code == 0
    assert "layers.0 ×2" in out and "parameters" in out and "FLOPs" in out
    assert "scaled_dot_product_attention" in out
    assert "formulas        forward FLOPs =" in out


def test_dump_dot_is_a_digraph(capsys):
    code, out, _ = run(capsys, "dump", "--model", "mlp", "--batch", "4", "--format", "dot", "-q")
    assert code == 0 and out.startswith('digraph "mlp"') and "->" in out and out.rstrip().endswith("}")


def test_dump_moe_marks_regions(capsys):
    code, out, _ = run(capsys, "dump", "--model", "moe", "--set", "layers=1", "--format", "json", "-q",
                       "--batch", "2", "--seq", "8")
    data = json.loads(out)
    from autopar import models
    cfg = models.get_config("moe")
    assert (data["moe_regions"][0]["num_experts"], data["moe_regions"][0]["top_k"]) == (cfg.experts, cfg.top_k)
    assert {n["moe_role"] for n in data["nodes"]} >= {"router", "dispatch", "expert", "combine"}


def test_user_model_file(tmp_path, capsys):
    f = tmp_path / "mine.py"
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(12, 5)
            def forward(self, x):
                return self.fc(x).relu()

        def make(batch, seq):
            return Net(), (torch.randn(batch, seq, 12),), ({0: "batch", 1: "seq"},)
    """))
    code, out, _ = run(capsys, "dump", "--model", f"{f}:make", "--batch", "4", "--seq", "3", "--format", "json", "-q")
    assert code == 0
    data = json.loads(out)
    assert data["totals"]["params"] == 65
    assert data["totals"]["flops_fwd"] == 2 * 4 * 3 * 12 * 5


@pytest.mark.parametrize("argv,needle", [
    (["dump", "--model", "gpt-9000"], "gpt-9000"),
    (["dump", "--model", "gpt", "--set", "colour=blue"], "colour"),
    (["dump", "--model", "gpt", "--set", "hidden"], "key=value"),
    (["dump", "--model", "gpt2-small", "--seq", "4096"], "max_seq"),
    (["dump", "--model", "nope.py:make"], "not found"),
    (["dump", "--model", "gpt", "--device", "nonsense"], "is not a device"),
    (["train", "--ranks", "1", "--steps", "2", "--save-every", "1"], "--save-every needs --save"),
    (["dump", "--model", "gpt", "--device", "cuda:99"], "--device cuda:99"),    # CPU torch, or too few GPUs
])
def test_bad_input_is_a_clear_error(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and "autopar: error:" in err and needle in err


def test_models_lists_the_zoo(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "gpt3-175b" in out and "mixtral-8x7b" in out


def test_calibrate_is_reachable_from_the_cli(capsys):
    with pytest.raises(SystemExit) as done:
        main(["calibrate", "--help"])
    assert done.value.code == 0
    assert "--quick" in capsys.readouterr().out
