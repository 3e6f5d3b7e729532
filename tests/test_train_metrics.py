"""``autopar train``'s measured-beside-predicted columns, its ``--log-jsonl`` file, and the
progress bar (``autopar/core/progress.py``). One small training run is shared by the asserts."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import time
import sys

import pytest

from autopar.core import progress as progress_mod
from autopar.cli import main
from autopar.core.progress import progress, shows
from autopar.cli.train import _with_progress
from autopar.cli.train_metrics import COLUMNS, step_record, peak_memory_bytes

STEP_FIELDS = {"step", "loss", "reference_loss", "step_s", "tokens_per_s", "tflops_per_rank", "mfu",
               "peak_memory_bytes", "predicted_step_s", "predicted_peak_memory_bytes"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "log.jsonl"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--ranks", "2", "--steps", "2", "--seq", "16", "--log-jsonl", str(path),
                     "--tensorboard", str(path.parent / "tb")])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return code, out.getvalue(), err.getvalue(), lines


def step_table(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["step", "parallel", "loss"])
    rows = []
    for line in lines[head + 1:]:
        if not line.split() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return lines[head], rows


def _num(cell: str) -> float:
    return float(cell.rstrip("x%"))


def test_the_table_has_measured_beside_predicted(run):
    code, out, err, _ = run
    assert code == 0, out + err
    header, rows = step_table(out)
    for name, _ in COLUMNS:
        assert name in header
    assert len(rows) == 2 and [r[0] for r in rows] == ["0", "1"]
    for r in rows:
        assert len(r) == 13
        # step ms, pred ms, x pred, tokens/s, TFLOP/s/rank, MFU, peak MB, pred MB, x pred
        figures = [_num(c) for c in r[4:]]
        assert all(math.isfinite(v) and v > 0 for v in figures), r
        assert r[9].endswith("%") and r[6].endswith("x") and r[12].endswith("x")
        assert _num(r[6]) == pytest.approx(_num(r[4]) / _num(r[5]), rel=0.02)      # measured / predicted
    assert "MFU: model FLOPs per step" in out and "each rank's peak: 100 GFLOP/s fp32, the cpu hardware profile's" in out
    assert "predicted: the simulator" in out and "max RSS" in out
    assert out.rstrip().splitlines()[-1].startswith("largest relative difference")


def test_jsonl_has_a_config_line_then_one_line_per_step(run):
    _, out, _, lines = run
    config, steps = lines[0], lines[1:]
    assert config["kind"] == "config" and config["world"] == 2 and config["steps"] == 2
    assert config["hardware"] == "cpu" and config["tokens_per_step"] == config["batch"] * config["seq"] == 8 * 16
    assert config["model_flops_per_step"] > 0 and config["peak_flops_per_rank"] == 100e9
    assert config["predicted"]["step_s"] > 0 and config["predicted"]["peak_memory_bytes"] > 0
    assert [s["kind"] for s in steps] == ["step", "step"] and [s["step"] for s in steps] == [0, 1]
    _, rows = step_table(out)
    for s, row in zip(steps, rows):
        assert STEP_FIELDS <= set(s)
        assert all(isinstance(s[k], (int, float)) and math.isfinite(s[k]) for k in STEP_FIELDS)
        assert s["step_s"] > 0 and s["peak_memory_bytes"] > 0
        assert s["predicted_step_s"] == config["predicted"]["step_s"]
        assert s["predicted_peak_memory_bytes"] == config["predicted"]["peak_memory_bytes"]
        assert f"{s['loss']:.6f}" == row[1] and f"{s['step_s'] * 1e3:.1f}" == row[4]


def test_mfu_is_achieved_over_peak(run):
    _, _, _, lines = run
    config = lines[0]
    for s in lines[1:]:
        assert s["tokens_per_s"] == pytest.approx(config["tokens_per_step"] / s["step_s"])
        assert s["tflops_per_rank"] == pytest.approx(config["model_flops_per_step"] / s["step_s"] / 2 / 1e12)
        assert s["mfu"] == pytest.approx(s["tflops_per_rank"] * 1e12 / config["peak_flops_per_rank"])
        assert s["step_vs_predicted"] == pytest.approx(s["step_s"] / s["predicted_step_s"])
        assert s["memory_vs_predicted"] == pytest.approx(s["peak_memory_bytes"] / s["predicted_peak_memory_bytes"])


def test_set_up_says_its_stages_as_it_goes(run):
    _, _, err, _ = run
    said = [line.split("set-up: ")[1] for line in err.splitlines() if line.startswith("[autopar] set-up: ")]
    names = [s.rsplit(" ", 1)[0] for s in said]
    assert names[:2] == ["capture and analysis", "plan"] and names[-1] == "first step", said


def test_tensorboard_gets_what_jsonl_gets(run, tmp_path_factory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, _, _, lines = run
    steps = [line for line in lines if line["kind"] == "step"]
    board = EventAccumulator(str(next(tmp_path_factory.getbasetemp().glob("train*/tb"))))
    board.Reload()
    for key in ("loss", "reference_loss", "step_s", "mfu", "peak_memory_bytes"):
        got = [(e.step, e.value) for e in board.Scalars(f"train/{key}")]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in steps], key


def test_tensorboard_without_the_package_is_a_typed_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)      # as if not installed
    assert main(["train", "--steps", "1", "--tensorboard", str(tmp_path)]) == 2
    assert "pip install 'autopar[tensorboard]'" in capsys.readouterr().err


def test_no_bar_when_stderr_is_not_a_terminal(run):
    _, _, err, _ = run
    assert "\r" not in err and "training 2 steps" not in err


def test_log_every_averages_the_steps_since_the_row_before():
    ctx = {"every": 2, "world": 2, "tokens": 100, "model_flops": 4e12, "peak_flops": 1e12,
           "predicted_step_s": 0.5, "predicted_peak_memory_bytes": 1e6, "dtype": "fp32"}
    r = step_record(7, [(2.0, 2.1, 1.0, 10), (1.5, 1.6, 3.0, 30)], ctx)
    assert (r["step"], r["loss"], r["reference_loss"], r["steps_averaged"]) == (7, 1.5, 1.6, 2)
    assert r["step_s"] == 2.0 and r["tokens_per_s"] == 50 and r["peak_memory_bytes"] == 30
    assert r["tflops_per_rank"] == 1.0 and r["mfu"] == 1.0 and r["step_vs_predicted"] == 4.0


def test_log_jsonl_is_checked_before_any_work(tmp_path, capsys):
    assert main(["train", "--steps", "1", "--log-jsonl", str(tmp_path / "missing" / "log.jsonl")]) == 2
    assert "--log-jsonl" in capsys.readouterr().err
    assert main(["train", "--steps", "1", "--log-jsonl", str(tmp_path)]) == 2


def test_peak_memory_is_the_processes_max_rss():
    assert peak_memory_bytes("cpu") > 10 * 2**20         # a Python process with torch holds far more


# --- the progress bar -----------------------------------------------------------------------

class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_silent_when_not_a_terminal():
    stream = io.StringIO()
    assert not shows(stream)
    assert list(progress(range(5), what="work", stream=stream)) == list(range(5))
    with progress(3, what="work", stream=stream) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


def test_the_bar_draws_on_a_terminal():
    stream = FakeTTY()
    assert shows(stream)
    assert list(progress(range(4), what="work", stream=stream)) == list(range(4))
    text = stream.getvalue()
    assert text.startswith("\r") and "work [" in text and "4/4 100%" in text
    assert text.endswith("\r") and "\n" not in text        # erased at the end: a short job leaves nothing
    stream = FakeTTY()
    for _ in progress(iter(range(3)), what="count", stream=stream):    # no length: a counter
        pass
    assert stream.getvalue().startswith("\rcount | 0 ") and stream.getvalue().endswith("\r")


def test_a_long_job_leaves_one_line(monkeypatch):
    monkeypatch.setattr(progress_mod, "SUMMARY_AFTER_S", 0.0)
    stream = FakeTTY()
    with progress(2, what="work", stream=stream) as bar:
        bar.set(2)
    assert stream.getvalue().endswith("work: 2/2 in 0.0s\n")


def test_quiet_silences_the_bar():
    autopar_log = logging.getLogger("autopar")
    level = autopar_log.level
    autopar_log.setLevel(logging.ERROR)          # what -q does
    try:
        stream = FakeTTY()
        assert not shows(stream)
        list(progress(range(3), what="work", stream=stream))
        assert stream.getvalue() == ""
    finally:
        autopar_log.setLevel(level)


def test_train_draws_its_steps_from_ranks_ticks(monkeypatch):
    # the launcher side of `autopar train`: rank 0 appends a byte per step to a file it polls
    stream = FakeTTY()
    monkeypatch.setattr("sys.stderr", stream)

    def ranks(tick, stages):
        assert tick is not None and os.path.exists(tick) and os.path.exists(stages)
        with open(stages, "a") as f:                # set-up stages first: the bar says where set-up is
            f.write("plan\t0.50\n")
        time.sleep(0.5)
        for _ in range(3):
            with open(tick, "ab") as f:
                f.write(b".")
        return "done"
    assert _with_progress(3, ranks) == "done"
    drawn = stream.getvalue()
    assert "set-up: plan done" in drawn and drawn.index("set-up: plan done") < drawn.index("training 3 steps")
    assert "3/3 100%" in drawn
    monkeypatch.setattr("sys.stderr", io.StringIO())
    tick, stages = _with_progress(3, lambda tick, stages: (tick, stages))     # no terminal: no bar, no tick file
    assert tick is None and stages is not None
    autopar_log = logging.getLogger("autopar")
    level = autopar_log.level
    autopar_log.setLevel(logging.ERROR)                                          # -q: nothing at all
    try:
        assert _with_progress(3, lambda tick, stages: (tick, stages)) == (None, None)
    finally:
        autopar_log.setLevel(level)
