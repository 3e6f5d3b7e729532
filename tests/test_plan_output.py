"""One output contract for ``autopar plan`` whatever ``--pp`` (auto, 1, N): the same text
header and alternatives columns, the same ``--json`` keys, ``--report`` and ``--save-plan`` for
every mode; ``autopar dump --format dot`` folds repeated blocks; ``dump --mesh`` says what
hardware it priced with."""
from __future__ import annotations

import json
import re

import pytest

from autopar.cli import main
from autopar.core.saved_plan import SavedPlan

# small enough that each plan runs in about a second on 2 CPU cores
PLAN = ["plan", "--model", "gpt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=256",
        "--cluster", "1x4", "--batch", "8", "--seq", "32", "--top", "3", "-q"]
MODES = ["auto", "1", "2"]
HEADER = [r"^autopar plan: gpt on 1x4 \S+ \(4 devices\), global batch 8, seq 32, bf16, adamw; --pp \S+: .+ in "
          r"\d+\.\d\ds$",
          r"^chosen: dp=\d+ tp=\d+ pp=\d+ .*ZeRO-\d, micro-batch \d+ x \d+, .*, recompute \w+$",
          r"^  predicted step time \S+: \d+\.\d model TFLOP/s per device \(\d+\.\d with recomputation\), "
          r"MFU \d+\.\d%, bubble \d\.\d{3}, exposed communication \S+$",
          r"^  memory per device \(GB\): params \S+  grads \S+  optimizer \S+  activations \S+  reserve \S+  total \S+ "
          r"\(budget \S+\)$"]
COLUMNS = ["dp", "cp", "tp", "pp", "ep", "ZeRO", "mb", "sched", "v", "recompute", "step", "memory", "why", "not"]


def plan(capsys, pp: str, *extra: str) -> str:
    code = main([*PLAN, "--pp", pp, *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.parametrize("pp", MODES)
def test_every_mode_prints_the_same_header_and_alternative_columns(capsys, pp):
    lines = plan(capsys, pp).splitlines()
    for pattern, line in zip(HEADER, lines):
        assert re.match(pattern, line), (pattern, line)
    at = next(i for i, line in enumerate(lines) if line.startswith("alternatives (top "))
    assert lines[at + 1].split() == COLUMNS
    rows = lines[at + 2:]
    assert rows and (rows[0].startswith("  (none") or len(rows[0].split()) > len(COLUMNS) - 2)
    assert "notes:" in lines
    if pp == "2":
        assert "chosen: dp=2 tp=1 pp=2" in lines[1]
        assert sum(line.startswith("  stage ") for line in lines) >= 2


def test_every_mode_has_the_same_json_keys(capsys):
    keys, shapes = {}, {}
    for pp in MODES:
        data = json.loads(plan(capsys, pp, "--json"))
        keys[pp] = set(data)
        shapes[pp] = (set(data["degrees"]), set(data["predicted"]) >= {"step_time_s", "tflops_per_device", "mfu",
                                                                        "peak_memory_bytes", "memory_bytes",
                                                                        "bubble_fraction", "exposed_comm_s"})
        assert data["pp_mode"] == pp and data["planner_time_s"] > 0
        assert all(set(a) >= {"degrees", "zero_stage", "micro_batch_size", "schedule", "recompute", "predicted",
                              "reason"} for a in data["alternatives"])
        assert data["batch"] == (data["degrees"]["dp"] * data["micro_batch_size"] * data["microbatches"])
    assert keys["auto"] == keys["1"] == keys["2"]
    assert keys["auto"] >= {"degrees", "zero_stage", "micro_batch_size", "microbatches", "schedule", "virtual_stages",
                            "recompute", "predicted", "alternatives", "planner_time_s", "memory_budget_bytes",
                            "stages", "notes"}
    assert all(s == ({"dp", "tp", "pp", "ep"}, True) for s in shapes.values()), shapes


@pytest.mark.parametrize("pp", MODES)
def test_report_and_save_plan_for_every_mode(capsys, tmp_path, pp):
    html, saved = tmp_path / "plan.html", tmp_path / "plan.json"
    text = plan(capsys, pp, "--report", str(html), "--save-plan", str(saved))
    page = html.read_text()
    shown = re.search(r"planner time</th><td>([^<]+)</td>", page).group(1)
    assert shown != "0 us" and float(shown.split()[0]) > 0, shown
    assert "<th>expert parallel</th>" in page and "Alternatives" in page
    notes = [line[4:] for line in text.splitlines() if line.startswith("  - ")]
    assert notes and all(n.replace("'", "&#x27;").replace('"', "&quot;") in page for n in notes)
    p = SavedPlan.load(saved)           # what `autopar train --plan` reads
    chosen = re.search(r"^chosen: dp=(\d+) tp=(\d+) pp=(\d+)", text, re.M).groups()
    assert (p.config.dp, p.config.tp, p.config.pp) == tuple(map(int, chosen))
    if pp == "2":                      # per-stage memory: each stage's device, in the stage map
        assert page.count("<td>from ") >= 2


# ---- dump --format dot folds repeated blocks -----------------------------------------------

DUMP = ["dump", "--model", "gpt", "--set", "layers=4", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=256",
        "--batch", "2", "--seq", "16", "-q"]


def valid_dot(text: str) -> tuple[set[str], list[tuple[str, str]]]:
    """Declared nodes and edges of a dot text; assert it is well formed enough for Graphviz."""
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    depth = 0
    for ch in re.sub(r'"[^"]*"', '""', text):       # braces outside quoted strings balance
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    nodes = set(re.findall(r'^\s*"([^"]+)" \[label=', text, re.M))
    edges = re.findall(r'^\s*"([^"]+)" -> "([^"]+)";$', text, re.M)
    assert edges and all(a in nodes and b in nodes for a, b in edges), [e for e in edges if not set(e) <= nodes]
    return nodes, edges


def test_dot_folds_repeated_blocks_unless_unfold(capsys):
    assert main([*DUMP, "--format", "dot"]) == 0
    folded = capsys.readouterr().out
    assert main([*DUMP, "--format", "dot", "--unfold"]) == 0
    unfolded = capsys.readouterr().out
    nodes, edges = valid_dot(folded)
    all_nodes, _ = valid_dot(unfolded)
    assert "layers.0 ×4" in folded and "×" not in unfolded
    assert len(nodes) * 3 < len(all_nodes), (len(nodes), len(all_nodes))
    block = next(n for n in nodes if f'"{n}" [label="layers.0 ×4' in folded)
    assert any(b == block for _, b in edges) and any(a == block for a, _ in edges)   # edges in and out kept


# ---- dump --mesh: one hardware for every mesh, and it says which ---------------------------

@pytest.mark.parametrize("mesh", ["tp=2", "pp=2"])
def test_dump_mesh_says_the_hardware_it_priced_with(capsys, mesh):
    assert main([*DUMP, "--mesh", mesh, "--summary", "--hardware", "a100"]) == 0
    out = capsys.readouterr().out
    assert "hardware        priced for a100" in out
    assert main([*DUMP, "--mesh", mesh, "--format", "json", "--summary", "--hardware", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["hardware"] == "cpu"
