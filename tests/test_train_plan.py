"""``autopar plan --save-plan`` and ``autopar train --plan``: the plan file round trip, its
validation, the scaling to local ranks, and one run of a saved plan checked against one process."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.core.saved_plan import PLAN_FILE_FORMAT, SavedPlan
from autopar.cost.hybrid import Config
from autopar.core.errors import ConfigError, PlanFileError
from autopar.cli.train import runtime_mesh, scale_down, small_overrides, _cfg


def _saved(c: Config, microbatches: int, model: str = "gpt", dtype: str = "bf16") -> SavedPlan:
    return SavedPlan(model=model, overrides={}, cluster="8x8", hardware="h100", devices=c.dp * c.tp * c.pp,
                     batch=c.dp * c.micro_batch * microbatches, seq=1024, dtype=dtype, config=c,
                     microbatches=microbatches, predicted={"step_time_s": 1.5, "mfu": 0.4})


GPT3 = Config(dp=32, tp=4, pp=8, micro_batch=1, schedule="interleaved", virtual=2, zero_stage=2)


# --- the plan file ---------------------------------------------------------------------------

def test_save_plan_writes_what_plan_chose_and_reads_back(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code = main(["plan", "--model", "gpt", "--set", "layers=4", "--set", "hidden=512", "--cluster", "2x4",
                 "--hardware", "h100", "--batch", "32", "--seq", "256", "--json", "--top", "1", "-q",
                 "--save-plan", str(path)])
    assert code == 0
    shown = json.loads(capsys.readouterr().out)
    data = json.loads(path.read_text())
    assert data["format"] == PLAN_FILE_FORMAT and data["version"] == 1
    assert (data["model"], data["cluster"], data["hardware"], data["batch"], data["seq"]) == \
        ("gpt", "2x4", "h100", 32, 256)
    assert data["overrides"] == {"layers": "4", "hidden": "512"}
    assert set(data["config"]) == {"dp", "tp", "pp", "ep", "micro_batch", "schedule", "virtual", "recompute",
                                   "zero_stage"}
    assert {k: data["config"][k] for k in ("dp", "tp", "pp", "ep")} == shown["degrees"]
    assert data["config"]["zero_stage"] == shown["zero_stage"] and data["microbatches"] == shown["microbatches"]
    assert data["predicted"]["step_time_s"] == pytest.approx(shown["predicted"]["step_time_s"])
    saved = SavedPlan.load(path)
    assert saved.to_dict() == data and isinstance(saved.config, Config)


def test_plan_text_says_where_the_plan_went(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(["plan", "--model", "gpt", "--set", "layers=4", "--set", "hidden=512", "--cluster", "1x4",
                 "--hardware", "a100", "--batch", "16", "--seq", "256", "-q", "--save-plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"saved to {path}" in out and "autopar train --plan" in out and "prediction only" not in out


def test_save_plan_works_with_a_fixed_pp_too(capsys, tmp_path):
    # --save-plan is written in every --pp mode (`autopar plan --help`: "any --pp")
    code = main(["plan", "--model", "gpt", "--cluster", "1x4", "--batch", "8", "--seq", "64", "--pp", "1", "-q",
                 "--save-plan", str(tmp_path / "p.json")])
    assert code == 0 and "saved to" in capsys.readouterr().out
    saved = SavedPlan.load(tmp_path / "p.json")
    assert saved.config.pp == 1 and saved.config.dp * saved.config.tp == 4


def test_round_trip_keeps_every_config_field():
    saved = _saved(GPT3, 48)
    again = SavedPlan.from_json(saved.to_json())
    assert again == saved and again.config == GPT3


def _broken(edit) -> str:
    data = _saved(GPT3, 48).to_dict()
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["config"].pop("zero_stage"), "config.zero_stage"),
    (lambda d: d["config"].update(dp=32.0), "config.dp"),            # a float is not an int
    (lambda d: d["config"].update(tp=True), "config.tp"),            # nor is a bool
    (lambda d: d["config"].update(pp="8"), "config.pp"),
    (lambda d: d["config"].update(micro_batch=0), "config.micro_batch"),
    (lambda d: d["config"].update(zero_stage=4), "config.zero_stage"),
    (lambda d: d["config"].update(schedule="1f2b"), "config.schedule"),
    (lambda d: d["config"].update(recompute=None), "config.recompute"),
    (lambda d: d.pop("model"), "model"),
    (lambda d: d.update(microbatches=48.0), "microbatches"),
    (lambda d: d.update(batch=False), "batch"),
    (lambda d: d.update(config=[1, 2]), "config"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(version="1"), "version"),
    (lambda d: d["predicted"].update(mfu="high"), "predicted.mfu"),
    (lambda d: d["overrides"].update(hidden=[64]), "overrides"),
    (lambda d: d.pop("format"), "format"),
])
def test_bad_fields_are_named(edit, field):
    with pytest.raises(PlanFileError) as err:
        SavedPlan.from_json(_broken(edit), where="plan file p.json")
    assert f"field {field}" in err.value.where and err.value.fix


@pytest.mark.parametrize("edit, what", [
    (lambda d: d.update(devices=512), "device count"),
    (lambda d: d["config"].update(ep=3), "ep does not divide dp"),
    (lambda d: d.update(batch=1000), "global batch"),
])
def test_degrees_must_agree(edit, what):
    with pytest.raises(PlanFileError, match=what):
        SavedPlan.from_json(_broken(edit))


def test_unreadable_files_are_plan_file_errors(tmp_path):
    with pytest.raises(PlanFileError, match="cannot read"):
        SavedPlan.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        SavedPlan.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(PlanFileError, match="not a JSON object"):
        SavedPlan.load(tmp_path / "list.json")
    (tmp_path / "pplan.json").write_text(json.dumps({"version": 3, "mesh": {"tp": 2}, "nodes": {}}))
    with pytest.raises(PlanFileError) as err:
        SavedPlan.load(tmp_path / "pplan.json")
    assert "parallelize" in err.value.fix


def test_train_reports_a_bad_plan_file_without_a_traceback(capsys, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(_broken(lambda d: d["config"].update(dp=2.5)))
    assert main(["train", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "autopar: error:" in err and "config.dp" in err and "Traceback" not in err


# --- scaling a plan to the local ranks -------------------------------------------------------

def test_gpt3_on_eight_ranks_is_pp_dp_tp_two_each():
    scaled, notes = scale_down(GPT3, 8)
    assert (scaled.pp, scaled.dp, scaled.tp, scaled.ep) == (2, 2, 2, 1)
    assert (scaled.zero_stage, scaled.schedule, scaled.virtual, scaled.recompute, scaled.micro_batch) == \
        (2, "interleaved", 2, "none", 1)
    assert notes == ["pp 8 -> 2", "dp 32 -> 2", "tp 4 -> 2"]
    assert runtime_mesh(_cfg(scaled)) == {"pp": 2, "dp": 2, "tp": 2}


def test_axes_get_ranks_in_pp_dp_tp_order():
    scaled, notes = scale_down(GPT3, 4)
    assert (scaled.pp, scaled.dp, scaled.tp) == (2, 2, 1) and notes[-1] == "tp 4 -> 1 (no ranks left)"
    scaled, _ = scale_down(GPT3, 2)
    assert (scaled.pp, scaled.dp, scaled.tp, scaled.zero_stage) == (2, 1, 1, 0)    # ZeRO needs the data axis
    scaled, notes = scale_down(GPT3, 1)
    assert (scaled.pp, scaled.dp, scaled.tp, scaled.schedule, scaled.virtual) == (1, 1, 1, "gpipe", 1)
    assert any("schedule goes with the pipeline" in n for n in notes)
    scaled, _ = scale_down(GPT3, 6)                     # not a power of two: the rest stays idle
    assert scaled.pp * scaled.dp * scaled.tp == 4


def test_axes_the_plan_does_not_split_stay_unsplit():
    scaled, notes = scale_down(Config(dp=64, tp=1, pp=1, micro_batch=4, zero_stage=3, recompute="full"), 8)
    assert (scaled.pp, scaled.dp, scaled.tp, scaled.zero_stage, scaled.recompute) == (1, 2, 1, 3, "full")
    assert notes == ["dp 64 -> 2"]


def test_experts_stay_split():
    scaled, notes = scale_down(Config(dp=16, tp=2, pp=4, micro_batch=1, ep=8, zero_stage=1), 8)
    assert (scaled.pp, scaled.dp, scaled.tp, scaled.ep) == (2, 2, 2, 2)
    assert "ep 8 -> 2 (over both data replicas)" in notes
    assert runtime_mesh(_cfg(scaled)) == {"pp": 2, "ep": 2, "tp": 2}
    scaled, _ = scale_down(Config(dp=8, tp=1, pp=1, micro_batch=1, ep=8), 1)
    assert scaled.ep == 1


def test_bad_rank_counts_are_config_errors():
    for ranks in (0, 2.0, True):
        with pytest.raises(ConfigError):
            scale_down(GPT3, ranks)


def test_small_model_keeps_the_family():
    over = small_overrides("gpt3-175b", {}, stages=4, seq=32)
    assert over == {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn": 256, "max_seq": 32}
    assert small_overrides("gpt", {}, stages=6, seq=16)["layers"] == 6
    mix = small_overrides("mixtral-8x7b", {"experts": "4"}, stages=2, seq=32)
    assert mix["kv_heads"] == 2 and mix["experts"] == "4" and "top_k" not in mix
    with pytest.raises(ConfigError, match="zoo models"):
        small_overrides("hf:llama", {}, stages=2, seq=32)


# --- one saved plan trained on local ranks ----------------------------------------------------

def test_train_plan_runs_the_scaled_structure_and_matches_single_process(capsys, tmp_path):
    # a 64-device plan with pp, dp and tp: on 4 ranks pp=2 x dp=2, tp left out for want of ranks
    # (an fp32 plan: it trains in fp32 and must match a float32 process to round-off)
    path = tmp_path / "plan.json"
    _saved(Config(dp=8, tp=2, pp=4, micro_batch=2, schedule="1f1b"), 4, dtype="fp32").save(path)
    code = main(["train", "--plan", str(path), "--ranks", "4", "--steps", "2", "--seq", "16", "--set", "layers=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "scaled: dp=2 tp=1 pp=2 ZeRO-0, micro-batch 2 x 4, 1f1b schedule" in out
    assert "(mesh pp=2 x dp=2)" in out and "tp 2 -> 1 (no ranks left)" in out
    assert "global batch 16 = 2 data replicas x 4 micro-batches x 2" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all(len(r) == 13 for r in rows)     # losses, then measured beside predicted
    assert "predicted here: step" in out and "on 1x4 cpu" in out
    worst = float(out.split("largest relative difference")[1].split()[0])
    assert worst < 1e-5 and "precision:" not in out


def test_a_16_bit_plan_trains_in_16_bits(capsys, tmp_path):
    # the plan's precision is built: bf16 compute with fp32 masters, beside a float32 reference
    path = tmp_path / "plan.json"
    _saved(Config(dp=8, tp=1, pp=2, micro_batch=1, schedule="1f1b"), 2, dtype="bf16").save(path)
    code = main(["train", "--plan", str(path), "--ranks", "4", "--steps", "1", "--seq", "8", "--set", "layers=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "precision: bf16 compute with fp32 master weights" in out
    worst = float(out.split("largest relative difference")[1].split()[0])
    assert 1e-7 < worst < 5e-2        # bf16 rounding shows, and stays rounding
