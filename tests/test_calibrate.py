"""Calibration: the alpha-beta fit, and a real quick run (2 gloo ranks) whose profile loads back."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cost import calibrate as cal
from autopar.cli import calibrate as calibrate_cmd
from autopar.cost import comm
from autopar.cost.cluster import Cluster
from autopar.cost.hardware import DeviceSpec, load_hardware, load_profile
from autopar.core.errors import ConfigError


def test_fit_recovers_exact_line() -> None:
    points = [[x, 20e-6 + x / 5e9] for x in (4e3, 6.4e4, 1e6, 4e6)]
    intercept, slope = cal.fit_alpha_beta(points)
    assert intercept == pytest.approx(20e-6, rel=1e-6)
    assert slope == pytest.approx(1 / 5e9, rel=1e-6)


def test_fit_never_returns_negative_latency_or_bandwidth() -> None:
    intercept, slope = cal.fit_alpha_beta([[1e3, 1e-7], [1e6, 1e-3], [2e6, 2.2e-3]])
    assert intercept >= 0 and slope > 0
    intercept, slope = cal.fit_alpha_beta([[1e3, 5e-5], [1e6, 4e-5]])  # noise: falling times
    assert intercept == 0 and slope > 0


@pytest.mark.parametrize("kind", cal.KINDS)
def test_link_fit_inverts_the_comm_formulas(kind: str) -> None:
    alpha, bw, world = 30e-6, 3e9, 2
    formula = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
               "reduce_scatter": comm.reduce_scatter, "all_to_all": comm.all_to_all}[kind]
    points = [[x, formula(x, world, bw, alpha)] for x in (4096, 65536, 2**20, 2**22)]
    fit = cal.link_fit(kind, world, points)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["bandwidth"] == pytest.approx(bw, rel=1e-6)


def test_unknown_device_is_config_error() -> None:
    with pytest.raises(ConfigError, match="'tpu'"):
        cal.calibrate("tpu", quick=True)
    assert calibrate_cmd.main(["--device", "tpu", "--quick"]) == 2


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    profile = cal.calibrate("cpu", out=str(out), quick=True)
    return out, profile


def test_quick_run_writes_a_loadable_profile(quick_profile: tuple[Path, dict]) -> None:
    out, profile = quick_profile
    assert json.loads(out.read_text()) == json.loads(json.dumps(profile))
    device = load_hardware(str(out))
    assert isinstance(device, DeviceSpec) and device.name.startswith("cpu")
    assert device.peak("fp32") > 0 and device.memory_bandwidth > 0
    assert "measured" in device.sources["peak_flops.fp32"]
    assert profile["measurements"]["seconds"] < 60
    # the attention kernel's rate becomes the profile's attention efficiency (a CPU has no SMs)
    rate = profile["measurements"]["attention_flops_per_s"]["fp32"]
    assert device.attention_efficiency == pytest.approx(min(1.0, rate / device.peak("fp32")))
    assert "attention" in device.sources["attention_efficiency"] and device.sm_count == 0
    # the zero-bubble split overhead is measured (a CPU host has no reserve counted)
    split = profile["measurements"]["split_backward_overhead"]
    assert 0 <= split <= 1 and device.zb_split_overhead == pytest.approx(split)
    assert "measured" in device.sources["zb_split_overhead"]
    assert device.reserve_bytes == 0 and profile["measurements"]["reserve_bytes"] is None


def test_quick_run_measures_gloo_collectives(quick_profile: tuple[Path, dict]) -> None:
    out, _ = quick_profile
    gloo = load_profile(out).links["gloo"]
    assert gloo.world_size == 2 and gloo.bandwidth > 0 and gloo.alpha_s >= 0
    assert set(gloo.collectives) == set(cal.KINDS)
    for fit in gloo.collectives.values():
        assert fit["bandwidth"] > 0 and len(fit["points"]) >= 2
        assert all(seconds > 0 for _, seconds in fit["points"])


def test_profile_drives_a_cluster(quick_profile: tuple[Path, dict]) -> None:
    out, _ = quick_profile
    cluster = Cluster.from_spec("1x2", hardware=str(out))
    assert cluster.intra.bandwidth == load_profile(out).links["gloo"].bandwidth
    seconds = comm.collective_time("all_reduce", 2**20, cluster, [("dp", 2)], "dp")
    assert 0 < seconds < 1


def test_bad_profile_is_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not an autopar hardware profile"):
        load_hardware(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hardware(str(bad))


def test_gpu_names_find_their_datasheet_profile():
    from autopar.cost.calibrate import _datasheet_for
    found = {name: (_datasheet_for(name).name if _datasheet_for(name) else None) for name in (
        "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA L4", "NVIDIA A10G",
        "Tesla V100-SXM2-32GB", "AMD Instinct MI300X", "NVIDIA B200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
        "NVIDIA GeForce RTX 4090")}
    assert found == {"NVIDIA H200": "h200-sxm-141gb", "NVIDIA H100 80GB HBM3": "h100-sxm-80gb",
                     "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb", "NVIDIA L40S": "l40s-48gb", "NVIDIA L4": "l4-24gb",
                     "NVIDIA A10G": "a10g-24gb", "Tesla V100-SXM2-32GB": "v100-sxm2-32gb",
                     "AMD Instinct MI300X": "mi300x-192gb", "NVIDIA B200": "b200-180gb",
                     # other parts than the datasheet's: measured rates become their peaks
                     "NVIDIA H100 PCIe": None, "NVIDIA H100 NVL": None, "NVIDIA GeForce RTX 4090": None}


def test_dtype_rates_too_far_apart_are_said():
    from autopar.cost.calibrate import PLAUSIBLE_RATIO, implausible_rates
    assert implausible_rates({"fp32": 50e9, "bf16": 700e9}, quick=False) is None           # an H200's 14x
    note = implausible_rates({"fp32": 2e9, "bf16": 400e9}, quick=True)
    assert note and "200x faster than fp32" in note and "rerun without --quick" in note
    assert implausible_rates({"fp32": 1e9, "bf16": PLAUSIBLE_RATIO * 1e9 * 1.01}, quick=False)


def test_two_group_sizes_separate_the_call_cost_from_the_ring_steps() -> None:
    # all-reduce intercepts base + 2(n-1) alpha at n = 2, 4 and 8
    base, alpha = 30e-6, 5e-6
    got = cal.split_latency({n: base + 2 * (n - 1) * alpha for n in (2, 4, 8)})
    assert got == pytest.approx((base, alpha))
    assert cal.split_latency({2: 40e-6}) == pytest.approx((0.0, 20e-6))     # one size: all to the steps
    assert cal.split_latency({2: 40e-6, 4: 30e-6}) == (pytest.approx(35e-6), 0.0)   # noise: clamped


def test_a_profile_with_a_base_latency_prices_it_per_call(tmp_path: Path) -> None:
    from autopar.cost.hardware import HardwareProfile, LinkProfile
    link = LinkProfile(backend="gloo", world_size=2, alpha_s=5e-6, bandwidth=1e9, base_latency_s=30e-6,
                       by_group_size={"4": {}})
    path = HardwareProfile(device=load_hardware("cpu"), links={"gloo": link}).save(tmp_path / "p.json")
    cluster = Cluster.from_spec("1x4", hardware=str(path))
    assert cluster.intra.base_latency_s == 30e-6 and "group sizes 2, 4" in cluster.intra.source
    assert comm.collective_time("all_reduce", 0, cluster, [("dp", 4)], "dp") == pytest.approx(30e-6 + 6 * 5e-6)
