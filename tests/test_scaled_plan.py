"""A cluster plan (``autopar plan --save-plan``) scaled to the ranks at hand: which axes keep
their degree, what goes with a dropped axis, and the options parallelize gets."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar.core.saved_plan import SavedPlan
from autopar.scaled_plan import is_saved_plan_file, merge_options


def _saved(dp=32, tp=4, pp=8, ep=1, micro=1, m=48, zero=1, schedule="interleaved", virtual=4, dtype="fp16",
           recompute="none") -> SavedPlan:
    return SavedPlan.from_dict({
        "format": "autopar plan", "version": 1, "model": "gpt3-175b", "overrides": {}, "cluster": "128x8",
        "hardware": "a100", "devices": dp * tp * pp, "batch": dp * micro * m, "seq": 2048, "dtype": dtype,
        "config": {"dp": dp, "tp": tp, "pp": pp, "micro_batch": micro, "schedule": schedule, "virtual": virtual,
                   "recompute": recompute, "zero_stage": zero, "ep": ep},
        "microbatches": m, "predicted": {"step_time_s": 19.3}})


def test_the_plan_as_it_is_on_its_own_device_count():
    s = autopar.scale_plan(_saved(), world=1024)
    assert s.mesh == {"pp": 8, "dp": 32, "tp": 4} and not s.notes
    assert s.options == {"zero_stage": 1, "recompute": "none", "mixed_precision": "fp16", "schedule": "interleaved",
                         "microbatches": 48, "virtual_stages": 4}
    assert s.batch == 1536


def test_fewer_ranks_keep_the_model_parallel_axes_first():
    s = autopar.scale_plan(_saved(), world=8)            # tp 4 stays, pp takes the 2 left, no data axis
    assert s.mesh == {"pp": 2, "tp": 4}
    assert s.options["zero_stage"] == 0 and s.options["virtual_stages"] == 4
    assert any("tp 4 -> 4, pp 8 -> 2, dp 32 -> 1" in n for n in s.notes)
    assert any("ZeRO-1 -> ZeRO-0" in n for n in s.notes)
    assert s.batch == 48 and "global batch 48" in s.describe()
    s = autopar.scale_plan(_saved(), world=2)             # tp 2 of the planned 4: a divisor of it
    assert s.mesh == {"tp": 2} and "schedule" not in s.options
    assert any("yours to accumulate" in n for n in s.notes)
    s = autopar.scale_plan(_saved(tp=8, pp=1, dp=2, schedule="1f1b", virtual=1), world=12)
    assert s.mesh == {"dp": 3, "tp": 4}                   # 4 divides both the planned 8 and the 12 ranks


def test_an_expert_axis_stays_inside_the_data_axis_and_interleaving_needs_its_multiple():
    s = autopar.scale_plan(_saved(dp=8, tp=1, pp=1, ep=4, schedule="1f1b", virtual=1, m=2), world=4)
    assert s.mesh == {"ep": 4} and s.shares == 4
    s = autopar.scale_plan(_saved(dp=1, tp=1, pp=4, m=8, virtual=2, zero=0), world=4)
    assert s.options["schedule"] == "interleaved"
    s = autopar.scale_plan(_saved(dp=1, tp=1, pp=8, m=6, virtual=2, zero=0), world=4)
    assert s.mesh == {"pp": 4} and s.options["schedule"] == "1f1b" and "virtual_stages" not in s.options


def test_options_that_contradict_the_plan_are_refused(tmp_path):
    s = autopar.scale_plan(_saved(), world=8)
    mesh, opts = merge_options(s, None, {"zero_stage": None, "recompute": "none"})
    assert mesh == {"pp": 2, "tp": 4} and opts["schedule"] == "interleaved"
    with pytest.raises(autopar.ConfigError, match="recompute= differs"):
        merge_options(s, None, {"recompute": "full"})
    with pytest.raises(autopar.ConfigError, match="mesh differs"):
        merge_options(s, {"dp": 8}, {})
    path = tmp_path / "plan.json"
    path.write_text(_saved().to_json())
    assert is_saved_plan_file(path) and not is_saved_plan_file(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"version": 3, "mesh": {}}))
    assert not is_saved_plan_file(tmp_path / "other.json")
    with pytest.raises(autopar.ConfigError, match="positive integer"):
        autopar.scale_plan(path, world=0)


def test_parallelize_without_a_mesh_or_a_plan_says_what_to_pass():
    import torch
    with pytest.raises(autopar.ConfigError, match="mesh or a plan"):
        autopar.parallelize(torch.nn.Linear(2, 2))
