"""The build's step list (autopar/build/steps.py) is what runs.

Every parallelize call goes through ``BUILD_STEPS``. In a real two-rank gloo world, a GPT is
parallelized over ``dp=2`` with the list as it is (the loss and the parameters after an SGD step
must equal one process on the whole batch), then with each step dropped and with each step moved
to the front: each such list must fail with an AutoparInternalError naming the step. A list
without the data and overlap steps whose own checks are satisfied runs, and then its parameters
must differ from the single process's (each rank steps on its own half of the batch): the data
step is what averages the gradients. A pipeline (``pp=2``) and an expert mesh (``ep=2``) without
their own step fail naming it too.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.build import steps as build_steps
from autopar.core.errors import AutoparInternalError
from autopar.runtime.launch import run_ranks

GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
MOE = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16, experts=4, top_k=2)
NAMES = [s.name for s in build_steps.BUILD_STEPS]


def test_each_step_reads_only_steps_listed_before_it() -> None:
    for i, step in enumerate(build_steps.BUILD_STEPS):
        assert set(step.needs) <= set(NAMES[:i]), (step.name, step.needs)
    assert NAMES[0] == "mesh" and NAMES[-1] == "module" and len(set(NAMES)) == len(NAMES)
    assert {"tensor", "experts", "pipeline", "recompute", "data", "overlap"} <= set(NAMES)


def _without(*names: str) -> list:
    return [s for s in build_steps.BUILD_STEPS if s.name not in names]


def _moved_first(name: str) -> list:
    step = next(s for s in build_steps.BUILD_STEPS if s.name == name)
    return [step, *_without(name)]


def _error(lst: list, build) -> str:
    """The AutoparInternalError text parallelize raises under step list ``lst`` ('' if none)."""
    saved = build_steps.BUILD_STEPS[:]
    build_steps.BUILD_STEPS[:] = lst
    try:
        build()
    except AutoparInternalError as exc:
        return str(exc)
    finally:
        build_steps.BUILD_STEPS[:] = saved
    return ""


def _gpt(rank: int):
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 4, 8, device="cpu")
    return model, args[0], args[0].chunk(2)[rank]


def _trained(pm, local) -> tuple[float, dict[str, torch.Tensor]]:
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    loss = pm(local).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in pm.state_dict().items()}


def _ranks(rank: int, world: int) -> dict:
    out: dict = {}
    model, whole, local = _gpt(rank)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_loss = ref(whole).float().logsumexp(-1).mean()
    ref_loss.backward()
    ref_opt.step()
    out["ref"] = (ref_loss.item(), {k: v.detach().clone() for k, v in ref.state_dict().items()})

    def dense():
        return autopar.parallelize(copy.deepcopy(model), {"dp": 2}, (local,), zero_stage=0)

    pm = dense()
    loss, params = _trained(pm, local)
    out["full"] = (torch.tensor(loss), params)
    out["dropped"] = {n: _error(_without(n), dense) for n in NAMES}
    out["moved"] = {n: _error(_moved_first(n), dense) for n in NAMES[1:]}
    # the needs satisfied by hand: a list without the data axis runs, and computes something else
    nodata = [dataclasses.replace(s, needs=tuple(x for x in s.needs if x not in ("data", "overlap")))
              for s in _without("data", "overlap")]
    saved = build_steps.BUILD_STEPS[:]
    build_steps.BUILD_STEPS[:] = nodata
    try:
        _, out["nodata"] = _trained(dense(), local)
    finally:
        build_steps.BUILD_STEPS[:] = saved
    mean = out["full"][0]
    dist.all_reduce(mean)             # the mean over the halves is the whole batch's mean
    out["full"] = (mean.item() / world, out["full"][1])

    def pipeline():
        return autopar.parallelize(copy.deepcopy(model), {"pp": 2}, (whole,), options=autopar.PipelineOptions(
            schedule="gpipe", microbatches=2, loss_fn=lambda o, t: o.float().mean()))
    out["pp"] = _error(_without("pipeline"), pipeline)
    torch.manual_seed(0)
    moe = models.build("moe", MOE, device="cpu")
    moe_args, _ = models.example_inputs(moe, 4, 8, device="cpu")
    out["ep"] = _error(_without("experts"), lambda: autopar.parallelize(moe, {"ep": 2}, (moe_args[0].chunk(2)[rank],)))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 2, timeout_s=300)


def test_the_listed_steps_build_what_one_process_computes(results) -> None:
    for r in results:
        ref_loss, ref_params = r["ref"]
        loss, params = r["full"]
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert params.keys() == ref_params.keys()
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", NAMES)
def test_a_list_without_a_step_fails_naming_it(results, name) -> None:
    for r in results:
        assert f"'{name}'" in r["dropped"][name], r["dropped"][name]


@pytest.mark.parametrize("name", NAMES[1:])
def test_a_step_moved_before_what_it_reads_fails_naming_it(results, name) -> None:
    for r in results:
        assert f"'{name}'" in r["moved"][name], r["moved"][name]


def test_without_the_data_step_the_ranks_step_on_their_own_rows(results) -> None:
    for r in results:
        _, ref_params = r["ref"]
        differ = [k for k in ref_params if not torch.allclose(r["nodata"][k], ref_params[k], rtol=1e-5, atol=1e-6)]
        assert differ, "without the data step the parameters still match: the data step is not what averages"


def test_pipeline_and_expert_builds_fail_without_their_step(results) -> None:
    for r in results:
        assert "'pipeline'" in r["pp"], r["pp"]
        assert "'experts'" in r["ep"], r["ep"]
