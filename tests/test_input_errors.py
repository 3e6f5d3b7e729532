"""Every bad input gets a typed error: plan files read strictly (PlanFileError naming the
field), and every bad command line exits 2 with a message and a fix, never a traceback, an
exit 0 that did nothing, or a runaway computation."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from autopar.cli import main
from autopar.core.saved_plan import SavedPlan
from autopar.cost.pp_sim import StageCosts, make, simulate
from autopar.core.errors import PlanFileError
from autopar.core.plans import Plan

TINY = ["--model", "gpt", "--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "vocab=64",
        "--seq", "16", "-q"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _refused(capsys, *argv: str, needle: str = "") -> str:
    code, err = _cli(capsys, *argv)
    assert code == 2, err
    assert "autopar: error:" in err and "fix:" in err and "Traceback" not in err, err
    assert needle in err, err
    return err


# ---- plan files ------------------------------------------------------------------------------

def _plan_json() -> dict:
    """A small valid parallelize plan file's object."""
    return json.loads(Plan(mesh={"tp": 2}, tp_axis="tp", params={"w": "S(0)"},
                           nodes={}, model="m").to_json())


def _saved_json() -> dict:
    return {"format": "autopar plan", "version": 1, "model": "gpt", "overrides": {}, "cluster": "1x8",
            "hardware": "h100", "devices": 8, "batch": 16, "seq": 128, "dtype": "bf16",
            "config": {"dp": 2, "tp": 2, "pp": 2, "micro_batch": 2, "schedule": "1f1b", "virtual": 1,
                       "recompute": "none", "zero_stage": 1, "ep": 1},
            "microbatches": 4, "predicted": {"step_time_s": 1.0}}


def test_plan_files_read_as_given_are_valid():
    assert Plan.from_json(json.dumps(_plan_json())).tp == 2
    assert SavedPlan.from_json(json.dumps(_saved_json())).config.dp == 2


@pytest.mark.parametrize("load", [Plan.load, SavedPlan.load], ids=["Plan", "SavedPlan"])
def test_a_non_utf8_plan_file_is_a_plan_file_error(tmp_path, load):
    path = tmp_path / "p.json"
    path.write_bytes(b'{"version": 3, "model": "\xff\xfe"}')
    with pytest.raises(PlanFileError, match="not UTF-8"):
        load(path)


@pytest.mark.parametrize("read", [Plan.from_json, SavedPlan.from_json], ids=["Plan", "SavedPlan"])
def test_deeply_nested_json_is_a_plan_file_error(read):
    for depth in (100, 100_000):      # within the parser's reach, and beyond it
        with pytest.raises(PlanFileError, match="nests too deep"):
            read('{"version": 3, "predicted": ' + "[" * depth + "]" * depth + "}")


@pytest.mark.parametrize("value,needle", [("Infinity", "not a JSON number"), ("NaN", "not a JSON number"),
                                          ("1e999", "zero_stage"),
                                          ("1.7", "zero_stage"), ("true", "zero_stage"), ("1.0", "zero_stage"),
                                          ('"1"', "zero_stage"), ("9" * 5000, "not valid JSON")])
def test_zero_stage_must_be_an_integer_0_to_3(value, needle):
    text = json.dumps(_plan_json()).replace('"zero_stage": 0', f'"zero_stage": {value}')
    with pytest.raises(PlanFileError, match=needle):
        Plan.from_json(text)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["mesh"].update(tp=2.7), "mesh.tp"),
    (lambda d: d["mesh"].update(tp=True), "mesh.tp"),
    (lambda d: d["mesh"].update(tp=0), "mesh.tp"),
    (lambda d: d.update(microbatches=2.0), "microbatches"),
    (lambda d: d.update(virtual_stages=-1), "virtual_stages"),
    (lambda d: d.update(bucket_bytes=False), "bucket_bytes"),
    (lambda d: d.update(overlap=1), "overlap"),
    (lambda d: d.update(capacity_factor=-1.0), "capacity_factor"),
    (lambda d: d.update(schedule="2f2b"), "schedule"),
    (lambda d: d.update(params={"w": 3}), "params.w"),
    (lambda d: d.update(nodes={"n": {"name": "x", "inputs": [], "outputs": [], "work": "much"}}), "nodes.n.work"),
    (lambda d: d.update(shapes={"w": [4, 2.5]}), "shapes.w[]"),
])
def test_plan_fields_are_checked_strictly(edit, field):
    data = _plan_json()
    edit(data)
    with pytest.raises(PlanFileError) as err:
        Plan.from_json(json.dumps(data))
    assert f"field {field}" in err.value.where and err.value.fix


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(microbatches=2**40), "microbatches"),
    (lambda d: d.update(devices=2**40), "devices"),
    (lambda d: d["predicted"].update(mfu="<1e999>"), "predicted.mfu"),     # parses as inf
    (lambda d: d.update(dtype="fp8"), "dtype"),
])
def test_saved_plan_fields_are_checked_strictly(edit, field):
    data = _saved_json()
    edit(data)
    with pytest.raises(PlanFileError) as err:
        SavedPlan.from_json(json.dumps(data).replace('"<1e999>"', "1e999"))
    assert f"field {field}" in err.value.where


@pytest.mark.parametrize("read,data,key,near", [
    (Plan.from_json, lambda: {**_plan_json(), "zero_stag": 1}, "zero_stag", "zero_stage"),
    (Plan.from_json, lambda: {**_plan_json(), "nodes": {"n": {"name": "x", "inputs": [], "output": []}}},
     "nodes.n.output", "nodes.n.outputs"),
    (SavedPlan.from_json, lambda: {**_saved_json(), "microbatch": 4}, "microbatch", "microbatches"),
    (SavedPlan.from_json, lambda: {**_saved_json(), "config": {**_saved_json()["config"], "recompte": "full"}},
     "config.recompte", "config.recompute"),
])
def test_unknown_plan_fields_are_refused_naming_the_nearest(read, data, key, near):
    with pytest.raises(PlanFileError) as err:
        read(json.dumps(data()))
    assert f"unknown field {key}" in err.value.what and f"did you mean {near}?" in err.value.what


def test_train_refuses_a_plan_file_field_by_name(capsys, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_saved_json(), "dp": 2.7}))
    _refused(capsys, "train", "--plan", str(path), needle="unknown field dp")


# ---- model factories -----------------------------------------------------------------------

FACTORIES = {
    "raises": ("def make(batch, seq):\n    raise RuntimeError('boom')\n", "RuntimeError while calling make"),
    "syntax": ("def make(batch, seq)\n    return 1\n", "syntax error"),
    "not_a_module": ("def make(batch, seq):\n    return 42\n", "did not return a model"),
    "exits": ("import sys\ndef make(batch, seq):\n    sys.exit(0)\n", "sys.exit(0)"),
    "exits_on_import": ("import sys\nsys.exit(0)\n", "sys.exit(0) while importing"),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_a_broken_model_factory_is_an_error_not_a_traceback(capsys, tmp_path, name):
    source, needle = FACTORIES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    err = _refused(capsys, "dump", "--model", f"{path}:make", "--batch", "2", "--seq", "4", "-q", needle=needle)
    assert f"{name}.py" in err          # names the user's file (and line, where there is one)


# ---- output paths ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["dump", "--model", "mlp", "--out", "{missing}/x.txt"],
    ["dump", "--model", "mlp", "--out", "{dir}"],
    ["plan", *TINY, "--cluster", "1x2", "--batch", "4", "--report", "{missing}/r.html"],
    ["plan", *TINY, "--cluster", "1x2", "--batch", "4", "--timeline", "{dir}"],
    ["plan", *TINY, "--cluster", "1x2", "--batch", "4", "--save-plan", "{missing}/p.json"],
    ["simulate", *TINY, "--cluster", "1x2", "--batch", "4", "--timeline", "{missing}/t.svg"],
], ids=["dump-out-missing", "dump-out-dir", "report-missing", "timeline-dir", "save-plan-missing", "simulate"])
def test_bad_output_paths_are_refused_before_any_work(capsys, tmp_path, argv):
    argv = [a.format(missing=tmp_path / "no" / "such", dir=tmp_path) for a in argv]
    err = _refused(capsys, *argv)
    assert "directory does not exist" in err or "names a directory" in err
    assert not (tmp_path / "no").exists()


def test_calibrate_refuses_a_missing_directory_and_creates_none(capsys, tmp_path):
    target = tmp_path / "not" / "there" / "x.json"
    _refused(capsys, "calibrate", "--quick", "--out", str(target), needle="does not exist")
    assert not (tmp_path / "not").exists()


# ---- numbers and degrees ---------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["simulate", *TINY, "--cluster", "1x2", "--batch", "4", "--tp", "0"], "--tp must be at least 1"),
    (["simulate", *TINY, "--cluster", "1x2", "--batch", "4", "--micro-batch-size", "-2"], "--micro-batch-size"),
    (["plan", *TINY, "--cluster", "1x2", "--batch", "4", "--pp", "0"], "--pp must be at least 1"),
    (["train", "--ranks", "0"], "--ranks must be at least 1"),
    (["train", "--steps", "-1"], "--steps must be at least 1"),
    (["train", "--steps", "0"], "--steps must be at least 1"),
])
def test_counts_must_be_positive(capsys, argv, needle):
    _refused(capsys, *argv, needle=needle)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-3", "lots"])
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_memory_budget_must_be_finite_and_positive(capsys, command, value):
    err = _refused(capsys, command, *TINY, "--cluster", "1x2", "--batch", "4", f"--memory-budget={value}",
                   needle="--memory-budget must be a finite positive number")
    assert "nan GB" not in err


def test_tp_is_exact_in_the_joint_search(capsys):
    err = _refused(capsys, "plan", *TINY, "--cluster", "1x8", "--batch", "8", "--tp", "3",
                   needle="--tp 3 does not divide the 8 devices")
    assert "exact tensor-parallel degree" in err
    assert main(["plan", *TINY, "--cluster", "1x6", "--batch", "6", "--tp", "3", "--json", "--top", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["degrees"]["tp"] == 3          # honoured, not a cap


def test_a_cluster_the_batch_cannot_use_says_so(capsys):
    err = _refused(capsys, "plan", *TINY, "--cluster", "100000x8", "--batch", "8",
                   needle="no layout uses all 800000 devices for a global batch of 8")
    assert "does not fit" not in err and "multiple of 50000" in err


def test_a_cluster_beyond_2_to_the_20_devices_is_refused(capsys):
    _refused(capsys, "plan", *TINY, "--cluster", "999999999x8", "--batch", "8", needle="at most 1048576 devices")


# ---- resource exhaustion ---------------------------------------------------------------------

def test_an_absurd_batch_is_refused_fast_and_small():
    """One subprocess: the refusal's own wall time and the process's peak RSS (imports included)."""
    code = textwrap.dedent("""
        import resource, time
        from autopar.cli import main
        t = time.perf_counter()
        rc = main(["plan", "--model", "gpt", "--cluster", "1x8", "--batch", "99999999999999999999", "--seq", "128",
                   "-q"])
        print(rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    rc, seconds, rss_kb = done.stdout.split()
    assert int(rc) == 2 and "2^31 - 1" in done.stderr and "fix:" in done.stderr, done.stderr
    assert float(seconds) < 5 and int(rss_kb) < 1 << 20, (seconds, rss_kb)


def test_the_largest_batch_allowed_plans_in_bounded_time(capsys):
    """2^30 samples: 2^27 micro-batches per replica, priced by the closed form, not 2^27 events."""
    import time
    t = time.perf_counter()
    assert main(["plan", *TINY, "--cluster", "1x8", "--batch", str(2**30), "--json", "--top", "0"]) == 0
    assert time.perf_counter() - t < 20
    assert json.loads(capsys.readouterr().out)["batch"] == 2**30


@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("gpipe", 3, 1), ("zb", 4, 1), ("interleaved", 2, 2),
                                      ("interleaved", 4, 2)])
def test_the_long_pipeline_closed_form_agrees_with_the_event_simulation(name, p, v):
    from autopar.cost.pp_steady import run as run_long
    costs = StageCosts.uniform(p * v, 1.0, 2.0, p2p=0.1, act=3.0)
    for m in (400, 4 * 131):                     # beyond the event budget (256): both paths run
        want, got = simulate(make(name, p, m, v), costs), run_long(name, p, m, v, costs)
        assert got.extended_to == m and want.extended_to is None
        assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
        assert got.bubble_fraction == pytest.approx(want.bubble_fraction, rel=1e-6, abs=1e-12)
        assert got.busy_s == pytest.approx(want.busy_s, rel=1e-9)
        assert got.peak_activation_bytes == pytest.approx(want.peak_activation_bytes, rel=1e-9)
        assert got.peak_inflight == want.peak_inflight


def test_the_long_pipeline_costs_the_same_at_any_micro_batch_count():
    from autopar.cost.pp_steady import run as run_long
    costs = StageCosts.uniform(8, 1.0, 2.0)
    r = run_long("1f1b", 8, 10**15, 1, costs)
    assert r.step_time_s == pytest.approx((10**15 + 7) * 3.0, rel=1e-12) and r.events == ()


def test_train_refuses_a_model_without_tokens_by_name(capsys):
    _refused(capsys, "train", "--model", "mlp", "--ranks", "2", "--steps", "1", needle="'mlp' takes no tokens")


def test_train_refuses_a_model_file_with_a_typed_error(capsys, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch\ndef factory():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    _refused(capsys, "train", "--model", f"{path}:factory", "--ranks", "2", "--steps", "1",
             needle="autopar train builds zoo models")
