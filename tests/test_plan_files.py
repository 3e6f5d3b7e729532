"""Plan files: versioned JSON, a model fingerprint, and a check against the model before
anything runs (no process group needed for the check)."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar import models
from autopar.core.errors import ConfigError
from autopar.core.plans import Plan


def _model(hidden: int = 32):
    m = models.build("gpt", {"layers": 2, "hidden": hidden, "heads": 4, "vocab": 64, "max_seq": 16}, device="meta")
    args, _ = models.example_inputs(m, 2, 8, device="meta")
    return m, args


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m, args = _model()
    plan = autopar.plan(m, {"tp": 2}, args)
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan.save(path)
    return plan, path


def test_plan_records_the_model_and_round_trips(saved):
    plan, path = saved
    m, _ = _model()
    assert plan.shapes == {k: list(p.shape) for k, p in m.named_parameters()}
    assert plan.fingerprint == Plan.fingerprint_of(plan.shapes) and len(plan.fingerprint) == 64
    again = Plan.load(path, model=m)
    assert again == plan


def test_a_plan_for_another_model_is_refused_naming_the_parameter(saved):
    plan, path = saved
    other, args = _model(hidden=64)
    with pytest.raises(ConfigError) as err:
        Plan.load(path, model=other)
    text = str(err.value)
    assert "another model" in text and "layers.0.attn.o_proj.bias is [64], the plan has [32]" in text
    assert "re-plan" in text
    with pytest.raises(ConfigError, match="another model"):   # parallelize checks before any collective
        autopar.parallelize(other, {"tp": 2}, args, plan=plan)


@pytest.mark.parametrize("text,needle", [("{not json", "not valid JSON"), ('{"version": 99}', "unknown version"),
                                          ('{"version": 3, "mesh": {"tp": 2}}', "missing or mistypes")])
def test_bad_plan_files_say_what_is_wrong(tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        Plan.load(path)


def test_a_missing_plan_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the plan file"):
        Plan.load(tmp_path / "nope.json")


def test_version_2_plans_still_read(saved):
    plan, _ = saved
    data = json.loads(plan.to_json())
    for key in ("shapes", "fingerprint", "pp_axis", "stage_starts", "schedule", "microbatches", "virtual_stages",
                "ep_axis", "expert_placement", "capacity_factor"):
        data.pop(key)
    data["version"] = 2
    data["nodes"] = {}          # older node names are refused (next test); placements still read
    old = Plan.from_json(json.dumps(data))
    assert old.params == plan.params and old.shapes == {}


def test_a_plan_naming_nodes_by_the_older_numbering_is_refused(saved, tmp_path):
    """Before version 4, node names were export's own numbering, which depends on the model's
    depth; such a plan's node names could point at other nodes now, so it is re-planned."""
    plan, path = saved
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["nodes"]
    old = tmp_path / "v3.json"
    old.write_text(json.dumps({**data, "version": 3}))
    with pytest.raises(autopar.PlanFileError, match="older autopar numbered"):
        Plan.load(old)
    old.write_text(json.dumps({**data, "version": 3, "nodes": {}}))
    assert Plan.load(old).nodes == {}
