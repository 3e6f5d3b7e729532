"""``autopar dump --after split`` and ``autopar plan --pp N --timeline``."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from autopar.cli import main

SMALL_GPT = ["--model", "gpt", "--set", "layers=4", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=256"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dump_after_split_marks_every_op_with_its_stage(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, "--batch", "8", "--seq", "16", "--mesh", "pp=2",
                       "--after", "split", "--format", "json", "-q", "--schedule", "1f1b", "--microbatches", "4")
    assert code == 0
    data = json.loads(out)
    par = data["parallel"]
    assert par["after"] == "split" and par["pipeline"]["schedule"] == "1f1b" and par["pipeline"]["microbatches"] == 4
    stages = [n["stage"] for n in data["nodes"] if "stage" in n]
    assert set(stages) == {0, 1} and stages == sorted(stages)          # contiguous in graph order
    assert [r["stage"] for r in par["stages"]] == [0, 1]
    first = {r["first"] for r in par["stages"]}
    assert {n["name"] for n in data["nodes"] if n.get("stage") is not None} >= first
    # parameters are not on a stage line of their own: they go wherever they are read
    assert all("stage" not in n for n in data["nodes"] if n["kind"] == "param")


def test_dump_split_text_has_the_stage_table(capsys):
    code, out, _ = run(capsys, "dump", *SMALL_GPT, "--batch", "8", "--seq", "16", "--mesh", "pp=2,tp=2", "-q")
    assert code == 0
    assert "pipeline        pp=2" in out
    assert sum(line.startswith("stage ") for line in out.splitlines()) >= 2


def test_plan_pp_writes_the_timeline(capsys, tmp_path):
    svg = tmp_path / "t.svg"
    code, out, err = run(capsys, "plan", "--model", "gpt2-small", "--cluster", "1x8", "--hardware", "a100",
                         "--batch", "16", "--seq", "512", "--pp", "4", "--timeline", str(svg), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["degrees"] == {"dp": 2, "tp": 1, "pp": 4, "ep": 1}     # the one schema of every --pp
    assert data["schedule"] in ("gpipe", "1f1b", "interleaved", "zb")
    pred = data["predicted"]
    assert 0 <= pred["bubble_fraction"] < 1 and pred["step_time_s"] > 0
    assert len(data["stages"]) == 4 * data["virtual_stages"]
    root = ET.parse(svg).getroot()
    text = "".join(root.itertext())
    assert all(f"d{i}" in text for i in range(4))


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--pp", "1", "--model", "gpt", "--cluster", "1x2", "--batch", "4", "--seq", "16", "--timeline",
      "x.svg"], "--pp"),
    (["dump", *SMALL_GPT, "--mesh", "tp=2", "--after", "split"], "pp axis"),
    (["dump", *SMALL_GPT, "--mesh", "tp=2,pp=2"], "pp, then dp"),
])
def test_pipeline_cli_errors(capsys, argv, needle):
    code, out, err = run(capsys, *argv, "-q")
    assert code != 0 and needle in (out + err)
