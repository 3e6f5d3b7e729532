"""DualPipeV: two stages a rank in a V, one micro-batch's forward run beside another's backward.

Real gloo processes. pp=2 (GPT, tied embedding and head: both on rank 0 in the V, so one
Parameter two stages scale; Llama) and pp=2 x ep=2 (``transformers`` Mixtral and DeepSeek-V3,
dropless experts whose exchanges the paired forward sends on second groups), each trained
against one process on the whole batch, float64. The pairs must really run: the forward half on
the worker thread, its expert exchanges on the second groups. The schedule's order is torch's
(asked of torch by cost/pp_dualpipe.dualpipe_v and compared here with what the runtime ran), and the
build refuses what the two threads could not run exactly.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core.errors import UnsupportedError
from autopar.cost.pp_dualpipe import dualpipe_v
from autopar.cost.pp_sim import StageCosts, make, simulate
from autopar.runtime.launch import run_ranks
from autopar.runtime.pp_overlap import SECOND_LANE_CALLS, PairRunner
from tests import test_pp_equivalence as pp_eq
from tests.test_ep_hf import TOL, _pipelined

DENSE = [("gpt", {**pp_eq.SMALL["gpt"], "layers": 4}, {"pp": 2}, "dualpipev", 4, 2, 8, 8),
         ("llama", {**pp_eq.SMALL["llama"], "layers": 6}, {"pp": 2}, "dualpipev", 6, 2, 12, 8),
         # recomputed in the backward half while the forward half runs checkpointed layers
         ("llama", {**pp_eq.SMALL["llama"], "layers": 4}, {"pp": 2}, "dualpipev", 4, 2, 8, 8, "full")]


def _dense(rank: int, world: int) -> dict:
    PairRunner.record = []
    out = pp_eq._all(rank, world, DENSE)
    return {"cases": out, "events": PairRunner.record}


def _experts(rank: int, world: int) -> dict:
    PairRunner.record, SECOND_LANE_CALLS[0] = [], 0
    got = _pipelined(rank, world, "dualpipev", 4)
    return {"models": got, "events": PairRunner.record, "second_lane": SECOND_LANE_CALLS[0]}


@pytest.fixture(scope="module")
def dense():
    return run_ranks(_dense, 2, timeout_s=600)


@pytest.fixture(scope="module")
def experts():
    return run_ranks(_experts, 4, timeout_s=600)


def _pairs_ran_at_once(events: list) -> None:
    forwards = [e for e in events if e[1] == "F"]
    backwards = [e for e in events if e[1] == "B"]
    assert forwards and len(forwards) == len(backwards)
    assert all(e[4].startswith("autopar-pp-forward") for e in forwards)       # the worker thread
    assert not any(e[4].startswith("autopar-pp-forward") for e in backwards)  # the caller's


@pytest.mark.parametrize("i", range(len(DENSE)), ids=[c[0] + (f"-{c[8]}" if len(c) > 8 else "") for c in DENSE])
def test_dualpipev_matches_single_process(dense, i):
    """Losses, every parameter after three AdamW steps and the whole state dict, as one process;
    rank 0 holds stages 0 and 3 (the V), rank 1 stages 1 and 2."""
    results = [r["cases"][i] for r in dense]
    pp_eq._check(results, {"pp": 2})
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]
    assert all(r["schedule"] == "dualpipev" for r in results)
    if len(DENSE[i]) > 8:
        assert all(r["checkpointed"] > 0 for r in results)


def test_dualpipev_pairs_run_on_two_threads(dense):
    for r in dense:
        _pairs_ran_at_once(r["events"])


def test_dualpipev_experts_exchange_on_second_groups_and_train_as_one_process(experts):
    """pp=2 x ep=2, Mixtral and DeepSeek-V3 (float64): two SGD-momentum steps equal to one process;
    each rank holds half of every layer's experts; the paired forwards' exchanges went to the
    second groups (on the ranks whose paired forwards hold an MoE layer)."""
    for r in experts:
        for name, got in r["models"].items():
            assert got["loss_err"] <= TOL[torch.float64] and got["param_err"] <= TOL[torch.float64], (name, got)
            assert got["split"] == [2] and got["pairs"] > 0, (name, got)
        _pairs_ran_at_once(r["events"])
    # a rank whose paired forwards hold an MoE layer sends those exchanges on the second groups
    assert sum(r["second_lane"] for r in experts) > 0, [r["second_lane"] for r in experts]


def test_simulated_order_is_torchs_and_hides_the_paired_exchanges():
    """cost/pp_sim's DualPipeV programs hold each F, B and W once on its V device; the pairs'
    F and B are marked; a stage cost's overlap_s shortens the step by what the pairs hide."""
    for p, m in ((2, 4), (4, 8), (4, 12)):
        s = dualpipe_v(p, m)
        s.validate()
        assert all(s.device_of(a.stage) == d for d, prog in enumerate(s.programs) for a in prog)
        assert s.overlapped and {a.kind for a in s.overlapped} == {"F", "B"}
        plain = simulate(s, StageCosts.uniform(2 * p, 1.0, 2.0, w=1.0)).step_time_s
        hidden = simulate(s, StageCosts((1.0,) * 2 * p, (2.0,) * 2 * p, (1.0,) * 2 * p, overlap_s=0.25)).step_time_s
        assert hidden < plain
    assert make("dualpipev", 4, 8, 2).programs == dualpipe_v(4, 8).programs


def _refused(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
                                  for _ in range(4)])
    try:
        autopar.parallelize(model, {"pp": 2}, (torch.randn(8, 8),), loss_fn=torch.nn.functional.mse_loss,
                            schedule="dualpipev", microbatches=4)
    except UnsupportedError as exc:
        return str(exc)
    return ""


def test_dualpipev_refuses_random_ops_in_training():
    for msg in run_ranks(_refused, 2, timeout_s=300):
        assert "random ops" in msg and "schedule='zb'" in msg, msg
