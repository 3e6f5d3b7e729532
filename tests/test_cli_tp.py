"""``autopar dump --mesh tp=N --after plan|rewrite``: strategies, placements and inserted collectives."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main, parse_mesh
from autopar.core.errors import ConfigError
from autopar.core.placement import COLLECTIVE_KINDS, LOCAL_KINDS

STEP_KINDS = set(COLLECTIVE_KINDS + LOCAL_KINDS)
SMALL_GPT = ["--model", "gpt", "--set", "layers=2", "--set", "hidden=128", "--set", "heads=4", "--set", "vocab=256"]
# sizes at which the built-in CPU profile splits SMALL_GPT over tp=2 (at --seq 16 a collective
# costs more than the matmuls it would halve, and the plan replicates everything)
SPLIT_SIZES = ["--batch", "8", "--seq", "128"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rewrite_json_has_collectives_and_placements(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, *SPLIT_SIZES, "--mesh", "tp=2",
                       "--after", "rewrite", "--format", "json", "-q")
    assert code == 0
    data = json.loads(out)
    assert data["parallel"]["mesh"] == {"tp": 2} and data["parallel"]["after"] == "rewrite"
    inserted = [n for n in data["nodes"] if "collective" in n]
    assert inserted, "the rewrite inserted no collective"
    for n in inserted:
        c = n["collective"]
        assert set(c) == {"axis", "forward", "backward", "src", "dst", "bytes", "time_fwd_s", "time_bwd_s"}
        assert c["axis"] == "tp" and c["forward"] in STEP_KINDS and c["backward"] in STEP_KINDS
        assert isinstance(c["time_fwd_s"], float) and isinstance(c["time_bwd_s"], float)
        assert c["time_fwd_s"] >= 0 and c["time_bwd_s"] >= 0 and c["bytes"] >= 0
        assert n["op"] == "autopar.redistribute" and n["placement"] == c["dst"]
    assert any(n["collective"]["forward"] in {"all_reduce", "all_gather", "reduce_scatter"} for n in inserted)
    assert all("placement" in n for n in data["nodes"] if "strategy" in n)
    assert any("strategy" in n for n in data["nodes"])
    summary = data["collectives"]
    assert summary["count"] == len(inserted) and summary["axes"] == ["tp"]
    assert sum(summary["forward"].values()) == sum(summary["backward"].values()) == len(inserted)
    assert summary["time_fwd_s"] == pytest.approx(sum(n["collective"]["time_fwd_s"] for n in inserted))
    assert summary["time_bwd_s"] == pytest.approx(sum(n["collective"]["time_bwd_s"] for n in inserted))


def test_plan_text_shows_colwise_and_rowwise_for_gpt2_small(capsys):
    code, out, _ = run(capsys, "dump", "--model", "gpt2-small", "--batch", "8", "--seq", "1024", "--mesh", "tp=4",
                       "--after", "plan", "-q")
    assert code == 0
    header = out.splitlines()[1]
    assert "placement" in header and "strategy" in header
    assert "colwise" in out and "rowwise" in out
    assert "plan            tp=4: predicted step" in out
    assert "collectives     " not in out  # planned, not rewritten: nothing inserted yet


def test_rewrite_text_lists_collectives_and_summary(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, *SPLIT_SIZES, "--mesh", "tp=2",
                       "--after", "rewrite", "-q")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("redistribute")]
    assert rows and all("tp: " in r and " / " in r and " fwd " in r and " bwd " in r for r in rows)
    assert "collectives     " in out and "comm time       forward" in out


def test_mesh_alone_means_after_plan(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, "--mesh", "tp=2", "--format", "json", "--summary", "-q")
    assert code == 0
    data = json.loads(out)
    assert data["parallel"]["after"] == "plan" and "collectives" not in data


def test_plain_dump_has_no_parallel_fields(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, "--format", "json", "-q")
    data = json.loads(out)
    assert code == 0 and "parallel" not in data and "collectives" not in data
    assert not any({"placement", "strategy", "collective"} & set(n) for n in data["nodes"])
    code, out, _ = run(capsys, "dump", *SMALL_GPT, "-q")
    assert code == 0 and "placement" not in out.splitlines()[1]


def test_after_without_mesh_is_a_config_error(capsys):
    code, out, err = run(capsys, "dump", *SMALL_GPT, "--after", "rewrite")
    assert code == 2 and out == ""
    assert "autopar: error:" in err and "--mesh" in err


@pytest.mark.parametrize("mesh,needle", [("tp", "name=size"), ("tp=x", "name=size"), ("tp=2,dp=2", "outer"), ("tp=2,pp=2", "pipeline"),
                                         ("tp=2,tp=2", "twice")])
def test_bad_mesh_is_a_clear_error(capsys, mesh, needle):
    code, _, err = run(capsys, "dump", *SMALL_GPT, "--mesh", mesh, "-q")
    assert code == 2 and "autopar: error:" in err and needle in err


def test_parse_mesh():
    assert parse_mesh("tp=4") == {"tp": 4}
    assert parse_mesh("tp=2, dp=3") == {"tp": 2, "dp": 3}
    with pytest.raises(ConfigError):
        parse_mesh("tp=")


@pytest.mark.parametrize("choice", ["on", "off"])
def test_sequence_parallel_flag_decides_where_the_norms_run(capsys, choice):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, *SPLIT_SIZES, "--mesh", "tp=2", "--format", "json",
                       "--sequence-parallel", choice, "-q")
    assert code == 0
    norms = [n for n in json.loads(out)["nodes"] if n.get("op") == "layer_norm"]
    assert len(norms) == 5                      # ln1, ln2 of 2 layers and ln_f
    split = [n for n in norms if n["placement"].startswith("S(1)")]   # [batch, seq, hidden]: a sequence slice
    assert len(split) == (5 if choice == "on" else 0), [n["placement"] for n in norms]


def test_sequence_parallel_flag_needs_a_tensor_axis(capsys):
    code, _, err = run(capsys, "dump", *SMALL_GPT, "--mesh", "dp=2", "--sequence-parallel", "off")
    assert code == 2 and "--sequence-parallel off needs a tensor axis" in err and "--mesh tp=2" in err
    for where in (["--mesh", "pp=2"], []):       # a pipeline without tp, or no mesh: refused, not dropped
        code, _, err = run(capsys, "dump", *SMALL_GPT, *where, "--sequence-parallel", "on")
        assert code == 2 and "--sequence-parallel on needs a tensor axis" in err, err
