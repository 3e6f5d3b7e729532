"""parallelize's options grouped by the step that reads them (autopar/core/options.py).

The signature keeps the common options flat and takes the per-axis ones as ``options=``; each
keyword it took before still works, folded into its group, with one DeprecationWarning naming the
new spelling. (The multi-process suites use both spellings, so both build the same model.)
"""
from __future__ import annotations

import inspect
import warnings

import pytest

import autopar
from autopar.core.errors import ConfigError, InputMismatchError
from autopar.core.options import OLD_KEYWORDS, Options, collect, with_old_keywords

# each old keyword with a value other than its default
OLD_VALUES = {
    "placements": {"fc1.weight": "S(0)"}, "sequence_parallel": False, "dims": ({0: "batch"},), "sizes": {"batch": 8},
    "overlap": False, "bucket_bytes": 4096, "dp_mode": "local_sgd", "sync_params": False,
    "schedule": "1f1b", "microbatches": 4, "virtual_stages": 2, "loss_fn": len,
    "calibration": ("x",), "expert_placement": "contiguous", "capacity_factor": 1.5,
}


def test_the_signature_has_at_most_twelve_parameters() -> None:
    params = inspect.signature(autopar.parallelize).parameters
    assert len(params) <= 12, list(params)
    assert not set(params) & set(OLD_KEYWORDS), "an old keyword is still in the signature"
    assert {"mesh", "example_inputs", "plan", "zero_stage", "recompute", "mixed_precision", "memory_budget",
            "compile", "options"} <= set(params)


@pytest.mark.parametrize("old", sorted(OLD_KEYWORDS))
def test_every_old_keyword_warns_once_naming_its_new_spelling(old) -> None:
    cls, field = OLD_KEYWORDS[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InputMismatchError):     # reached the call's own checks: the keyword was taken
            autopar.parallelize("not a module", {"dp": 1}, (), **{old: OLD_VALUES[old]})
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert f"{old}= -> options={cls.__name__}({field}=...)" in str(deprecations[0].message)


@pytest.mark.parametrize("old", sorted(OLD_KEYWORDS))
def test_an_old_keyword_lands_in_its_group(old) -> None:
    cls, field = OLD_KEYWORDS[old]
    options, _ = with_old_keywords(None, {old: OLD_VALUES[old]})
    merged = collect(options)
    part = next(getattr(merged, a) for a in ("tensor", "data", "pipeline", "experts")
                if isinstance(getattr(merged, a), cls))
    assert getattr(part, field) == OLD_VALUES[old]
    assert merged.flat()[old] == OLD_VALUES[old]


def test_old_keywords_merge_with_options_given_and_clash_when_both_set_a_field() -> None:
    options, _ = with_old_keywords(autopar.PipelineOptions(schedule="zb"), {"microbatches": 4, "overlap": False})
    merged = collect(options)
    assert (merged.pipeline.schedule, merged.pipeline.microbatches, merged.data.overlap) == ("zb", 4, False)
    with pytest.raises(ConfigError, match="schedule"):
        with_old_keywords(autopar.PipelineOptions(schedule="zb"), {"schedule": "1f1b"})


def test_options_are_checked_on_construction() -> None:
    with pytest.raises(ConfigError, match="PipelineOptions.microbatches"):
        autopar.PipelineOptions(microbatches=0)
    with pytest.raises(ConfigError, match="DataOptions.overlap"):
        autopar.DataOptions(overlap=1)
    with pytest.raises(ConfigError, match="ExpertOptions.placement"):
        autopar.ExpertOptions(placement="random")
    with pytest.raises(ConfigError, match="ExpertOptions.dispatch_chunks"):
        autopar.ExpertOptions(dispatch_chunks=0)
    with pytest.raises(ConfigError, match="ExpertOptions.dispatch"):
        autopar.ExpertOptions(dispatch="three_hops")
    with pytest.raises(ConfigError, match="two PipelineOptions"):
        collect([autopar.PipelineOptions(), autopar.PipelineOptions(schedule="zb")])
    with pytest.raises(ConfigError, match="options= takes"):
        collect({"schedule": "zb"})
    assert collect(None) == Options()


def test_a_scaled_plan_spells_its_options_for_parallelize() -> None:
    scaled = autopar.ScaledPlan(saved=None, world=4, mesh={"pp": 2, "dp": 2}, micro_batch=1, microbatches=4,
                                options={"zero_stage": 1, "recompute": "none", "schedule": "1f1b", "microbatches": 4})
    kwargs = scaled.parallelize_kwargs()
    assert kwargs == {"zero_stage": 1, "recompute": "none",
                      "options": autopar.PipelineOptions(schedule="1f1b", microbatches=4)}
    assert set(kwargs) <= set(inspect.signature(autopar.parallelize).parameters)
