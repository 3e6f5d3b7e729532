"""The data-parallel planner: ZeRO memory formulas, bucket size, dp communication and overlap,
the choice of dp x tp x stage under a memory budget, and ``autopar plan``."""
from __future__ import annotations

import json
import re

import pytest

from autopar.cli import main
from autopar.cost.cluster import Cluster, Link
from autopar.cost.comm import collective_time
from autopar.cost.dp_planner import (BUCKET_MAX, BUCKET_MIN, bucket_bytes, dp_comm_time, exposed_comm,
                                     memory_split, plan_dp)
from autopar.cost.hardware import load_hardware
from autopar.core.errors import ConfigError

T, F, N = 1000, 200, 4          # trainable and frozen elements per rank, dp degree


def _split(stage: int, mixed: str | None = None, **kw) -> tuple[float, float, float]:
    m = memory_split(trainable_numel=T, frozen_numel=F, dp=N, zero_stage=stage, mixed_precision=mixed, **kw)
    return m.params, m.grads, m.optimizer


# ---------------------------------------------------------------- memory formulas

@pytest.mark.parametrize("stage, expected", [
    (0, (4 * 1200, 4 * 1000, 8 * 1000)),        # p(T+F), 4T, 4KT with K = 2 (AdamW)
    (1, (4 * 1200, 4 * 1000, 8 * 1000 / 4)),    # optimizer sharded
    (2, (4 * 1200, 4 * 1000 / 4, 8 * 1000 / 4)),  # + gradients
    (3, (4 * 1200 / 4, 4 * 1000 / 4, 8 * 1000 / 4)),  # + parameters
])
def test_fp32_adamw_split_per_stage(stage, expected):
    assert _split(stage) == pytest.approx(expected)


@pytest.mark.parametrize("stage, expected", [
    (0, (2 * 1200, 4 * 1000, 12 * 1000)),                  # bf16 params, fp32 grads, masters + 2 moments
    (1, (2 * 1200, 2 * 1000 + 4 * 1000 / 4, 12 * 1000 / 4)),  # bf16 grads + the fp32 shard
    (2, (2 * 1200, 4 * 1000 / 4, 12 * 1000 / 4)),
    (3, (4 * 1200 / 4, 4 * 1000 / 4, 8 * 1000 / 4)),       # fp32 shards are params and masters
])
def test_bf16_adamw_split_per_stage(stage, expected):
    assert _split(stage, "bf16") == pytest.approx(expected)
    assert _split(stage, "fp16") == pytest.approx(expected)


def test_zero_paper_bytes_per_parameter():
    def per_param(stage, mixed, dp=1):
        return memory_split(trainable_numel=1, dp=dp, zero_stage=stage, mixed_precision=mixed).total
    # The ZeRO paper counts 16 bytes/param for mixed-precision Adam (2 + 2 + 12). Our runtime
    # reduces and keeps gradients in fp32, so stage 0 holds 2 (bf16 params) + 4 (fp32 grads)
    # + 12 (fp32 master + two moments) = 18 bytes per parameter.
    assert per_param(0, "bf16") == 18
    assert per_param(0, None) == 16                     # fp32 Adam: 4 + 4 + 8
    assert per_param(3, "bf16", dp=8) == pytest.approx(16 / 8)   # everything sharded: 16/N
    sgd = memory_split(trainable_numel=1, dp=1, zero_stage=0, optimizer="sgd")
    momentum = memory_split(trainable_numel=1, dp=1, zero_stage=0, optimizer="sgd_momentum")
    assert (sgd.optimizer, momentum.optimizer) == (0, 4)


@pytest.mark.parametrize("mixed", [None, "bf16"])
@pytest.mark.parametrize("frozen", [0, 300])
def test_each_stage_needs_strictly_less_memory(mixed, frozen):
    for dp in (2, 4, 64):
        totals = [memory_split(trainable_numel=T, frozen_numel=frozen, dp=dp, zero_stage=s, mixed_precision=mixed,
                               activation_bytes=123.0, buffer_bytes=7.0).total for s in range(4)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, (dp, totals)
    # With one data-parallel rank there is nothing to shard.
    flat = {memory_split(trainable_numel=T, dp=1, zero_stage=s).total for s in range(4)}
    assert len(flat) == 1


def test_split_as_dict_and_total():
    m = memory_split(trainable_numel=T, dp=2, zero_stage=1, activation_bytes=10.0, buffer_bytes=5.0)
    d = m.as_dict()
    assert set(d) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert d["total"] == m.total == m.params + m.grads + m.optimizer + 15.0


@pytest.mark.parametrize("kw", [dict(zero_stage=4), dict(dp=0), dict(optimizer="lion"),
                                dict(mixed_precision="fp8")])
def test_bad_inputs_are_config_errors(kw):
    args = dict(trainable_numel=T, dp=2, zero_stage=1) | kw
    with pytest.raises(ConfigError) as exc:
        memory_split(**args)
    assert exc.value.where and exc.value.got


# ---------------------------------------------------------------- buckets and communication

def _cluster(bandwidth: float, hop: float, base: float = 0.0) -> Cluster:
    link = Link(bandwidth=bandwidth, base_latency_s=base, hop_latency_s=hop)
    return Cluster(nodes=1, devices_per_node=8, device=load_hardware("a100"), intra=link, inter=link)


def test_bucket_grows_with_latency_times_bandwidth_within_the_clamp():
    axes, total = (("dp", 8), ("tp", 1)), 2e9
    sizes = [bucket_bytes(_cluster(bw, hop), axes, "dp", total)
             for bw, hop in ((10e9, 1e-6), (10e9, 4e-6), (40e9, 4e-6), (100e9, 8e-6))]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert all(BUCKET_MIN <= s <= BUCKET_MAX for s in sizes)
    # At the chosen size the latency paid over all buckets equals the last bucket's transfer,
    # which is where their sum is smallest.
    c, b = _cluster(40e9, 4e-6), sizes[2]
    latency = collective_time("all_reduce", 0, c, axes, "dp")
    transfer = collective_time("all_reduce", b, c, axes, "dp") - latency
    assert latency * total / b == pytest.approx(transfer, rel=1e-3)
    cost = [latency * total / x + transfer * x / b for x in (b / 2, b, 2 * b)]
    assert cost[1] < cost[0] and cost[1] < cost[2]
    assert bucket_bytes(_cluster(1e12, 1e-3), axes, "dp", total) == BUCKET_MAX
    assert bucket_bytes(_cluster(1e8, 1e-7), axes, "dp", total) == BUCKET_MIN
    assert bucket_bytes(_cluster(1e12, 1e-3), axes, "dp", 3 * BUCKET_MIN) == 3 * BUCKET_MIN   # one bucket
    assert bucket_bytes(_cluster(1e9, 1e-5), (("dp", 1), ("tp", 8)), "dp", total) == BUCKET_MIN   # no data axis


def test_dp_comm_time_per_stage():
    c, axes, bucket = Cluster.from_spec("1x8", hardware="a100"), (("dp", 8), ("tp", 1)), 10 * 2**20
    grads = 25.5 * 2**20                     # two full buckets and a half one

    def ct(kind, nbytes):
        return collective_time(kind, nbytes, c, axes, "dp")

    s0 = dp_comm_time(grads, dp=8, zero_stage=0, cluster=c, mesh_axes=axes, axis="dp", bucket=bucket)
    assert s0["all_reduce"] == pytest.approx(2 * ct("all_reduce", bucket) + ct("all_reduce", 5.5 * 2**20))
    assert s0["reduce_scatter"] == s0["all_gather"] == 0 and s0["total"] == s0["all_reduce"]
    s2 = dp_comm_time(grads, dp=8, zero_stage=2, cluster=c, mesh_axes=axes, axis="dp", bucket=bucket)
    s1 = dp_comm_time(grads, dp=8, zero_stage=1, cluster=c, mesh_axes=axes, axis="dp", bucket=bucket)
    s3 = dp_comm_time(grads, dp=8, zero_stage=3, cluster=c, mesh_axes=axes, axis="dp", bucket=bucket)
    assert s1 == s2 and s2["all_reduce"] == 0 and s2["reduce_scatter"] > 0
    assert s3["all_gather"] == pytest.approx(2 * s2["all_gather"])          # forward and backward
    assert s3["total"] == pytest.approx(s3["reduce_scatter"] + s3["all_gather"])
    one = dp_comm_time(grads, dp=1, zero_stage=3, cluster=c, mesh_axes=(("dp", 1), ("tp", 8)), axis="dp",
                       bucket=bucket)
    assert one["total"] == 0


def test_exposed_communication():
    comm = {"all_reduce": 10.0, "reduce_scatter": 6.0, "all_gather": 4.0, "total": 20.0}
    # Hidden under backward except the last bucket; what backward cannot cover shows.
    assert exposed_comm(comm, zero_stage=0, fwd_compute_s=5, bwd_compute_s=20, last_reduce_s=1) == 1
    assert exposed_comm(comm, zero_stage=0, fwd_compute_s=5, bwd_compute_s=4, last_reduce_s=1) == 5 + 1
    assert exposed_comm(comm, zero_stage=1, fwd_compute_s=5, bwd_compute_s=20, last_reduce_s=1) == 10
    assert exposed_comm(comm, zero_stage=2, fwd_compute_s=5, bwd_compute_s=20, last_reduce_s=1) == 1 + 4
    # Stage 3: forward gathers (2) under forward except the first; backward: gathers + reduce (8).
    assert exposed_comm(comm, zero_stage=3, fwd_compute_s=5, bwd_compute_s=20, last_reduce_s=1,
                        first_gather_s=0.5) == 0.5 + 1
    assert exposed_comm(comm, zero_stage=3, fwd_compute_s=1, bwd_compute_s=3, last_reduce_s=1,
                        first_gather_s=0.5) == pytest.approx(0.5 + 0.5 + (8 - 1 - 3) + 1)


# ---------------------------------------------------------------- planner

@pytest.fixture(scope="module")
def small_gpt():
    from autopar.cli.workload import capture_workload, load_workload
    w = load_workload("gpt", batch=8, seq=128, overrides={"layers": "2"})
    return capture_workload(w), w.sizes


@pytest.fixture(scope="module")
def cluster():
    return Cluster.from_spec("1x4", hardware="a100")


def _plan(small_gpt, cluster, budget, **kw):
    gm, sizes = small_gpt
    return plan_dp(gm, cluster=cluster, devices=4, batch=8, sizes=sizes, memory_budget=budget, **kw)


def test_plan_picks_the_fastest_feasible(small_gpt, cluster):
    r = _plan(small_gpt, cluster, None)
    assert r.best is not None and r.best.fits and r.memory_budget == 80e9
    assert r.best.dp * r.best.tp == 4 and r.best.dp * r.best.micro_batch == 8
    assert r.best.step_time_s == pytest.approx(r.best.compute_s + r.best.tp_comm_s + r.best.exposed_comm_s)
    assert len(r.alternatives) == 3 * 4 - 1                  # tp 1, 2, 4 x stages 0-3, less the best
    assert all(a.step_time_s >= r.best.step_time_s for a in r.alternatives)
    assert all(a.reason.startswith(("slower by", "same step time")) for a in r.alternatives)
    times = [a.step_time_s for a in r.alternatives]
    assert times == sorted(times)
    d = r.best.as_dict()
    assert d["degrees"] == {"dp": r.best.dp, "tp": r.best.tp}
    assert set(d["predicted"]["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers",
                                                   "total"}


def test_tight_budget_picks_a_higher_zero_stage(small_gpt, cluster):
    loose = _plan(small_gpt, cluster, None, tp_degrees=(1,))
    by_stage = {c.zero_stage: c.memory.total for c in [loose.best, *loose.alternatives]}
    tight = _plan(small_gpt, cluster, (by_stage[0] + by_stage[3]) / 2, tp_degrees=(1,))
    assert tight.best is not None and tight.best.zero_stage > loose.best.zero_stage
    assert tight.best.memory.total <= tight.memory_budget
    lost = [a for a in tight.alternatives if not a.fits]
    assert lost and all(re.fullmatch(r"does not fit: needs [\d.]+ GB, budget [\d.]+ GB", a.reason) for a in lost)


def test_impossible_budget_reports_what_would_fit(small_gpt, cluster):
    loose = _plan(small_gpt, cluster, None)
    leanest = min(c.memory.total for c in [loose.best, *loose.alternatives])
    r = _plan(small_gpt, cluster, 0.75 * leanest)
    assert r.best is None and not any(a.fits for a in r.alternatives)
    assert r.smallest_devices is not None and r.smallest_devices > 4
    assert r.largest_micro_batch is not None and 0 <= r.largest_micro_batch < 8
    # The reported device count does fit when planned for.
    bigger = Cluster.from_spec(f"{r.smallest_devices // 4}x4", hardware="a100")
    gm, sizes = small_gpt
    again = plan_dp(gm, cluster=bigger, devices=r.smallest_devices, batch=8, sizes=sizes,
                    memory_budget=0.75 * leanest)
    assert again.best is not None
    hopeless = _plan(small_gpt, cluster, 1e3)
    assert hopeless.best is None and hopeless.smallest_devices is None and hopeless.largest_micro_batch == 0


def test_batch_that_splits_nowhere_is_a_config_error(small_gpt, cluster):
    gm, sizes = small_gpt
    with pytest.raises(ConfigError, match="does not split"):
        plan_dp(gm, cluster=cluster, devices=4, batch=3, sizes=sizes, memory_budget=None, tp_degrees=(1, 2))


# ---------------------------------------------------------------- CLI

_CLI = ["plan", "--pp", "1", "--model", "gpt", "--set", "layers=2", "--cluster", "1x4", "--hardware", "a100",
        "--batch", "8", "--seq", "128", "--dtype", "fp32"]


def test_cli_plan_json(capsys):
    code = main([*_CLI, "--json", "--top", "3", "-q"])
    out = capsys.readouterr()
    assert code == 0, out.err
    data = json.loads(out.out)
    assert {"degrees", "zero_stage", "micro_batch_size", "predicted", "memory_budget_bytes", "planner_time_s",
            "alternatives"} <= set(data)
    assert data["degrees"]["dp"] * data["degrees"]["tp"] == 4
    assert {"step_time_s", "exposed_comm_s", "memory_bytes"} <= set(data["predicted"])
    assert set(data["predicted"]["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers",
                                                      "total"}
    assert len(data["alternatives"]) == 3
    assert all({"degrees", "zero_stage", "micro_batch_size", "predicted", "reason"} <= set(a)
               for a in data["alternatives"])


def test_cli_plan_text(capsys):
    code = main([*_CLI, "--dtype", "bf16", "--zero", "auto", "--tp", "auto"])
    out = capsys.readouterr()
    assert code == 0 and "[autopar]" in out.err
    assert "chosen: dp=" in out.out and "memory per device (GB)" in out.out and "alternatives" in out.out


def test_cli_plan_infeasible_exits_2_naming_what_fits(capsys):
    code = main([*_CLI, "--memory-budget", "0.012", "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"(\d+) devices would fit global batch 8", err), err
    assert "per-rank batch" in err
    # a budget under 1 GB is printed with the digits that tell it apart, not as 0.0
    assert "fits in 0.012 GB per device" in err and "0.0 GB" not in err, err
