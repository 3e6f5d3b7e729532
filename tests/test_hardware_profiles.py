"""Built-in hardware profiles: V100, A10G, L4, L40S, A100, H100, H200, B200, MI300X (and cpu).

Every datasheet number cites its source, tensor figures are dense, a dtype a device has no
path for is refused with a ConfigError naming both, every device has node links of its own,
and ``autopar plan`` / ``autopar simulate`` take the new names.
"""
from __future__ import annotations

import json
import re

import pytest

from autopar.cli import workload
from autopar.cli import main
from autopar.cost.cluster import BUILTIN_NODE_LINKS, Cluster
from autopar.cost.hardware import ALIASES, BUILTIN_DEVICES, SHORT_NAMES, DeviceSpec, load_hardware
from autopar.core.errors import AutoparError, ConfigError

GPUS = [name for name, spec in BUILTIN_DEVICES.items() if spec.sm_count > 0]
NEW = ("v100", "a10g", "l4", "l40s", "h200", "b200", "mi300x")
TENSOR = ("tf32", "bf16", "fp16", "fp8")
# Expected figures, read off the datasheets the sources name (dense; 1e12 FLOP/s, GB, TB/s).
SHEET = {
    "v100": ({"fp32": 15.7, "fp16": 125}, 32, 0.9, 80),
    "a10g": ({"fp32": 35, "tf32": 35, "bf16": 70, "fp16": 70}, 24, 0.6, 80),
    "l4": ({"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5}, 24, 0.3, 58),
    "l40s": ({"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733}, 48, 0.864, 142),
    "h200": ({"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, 141, 4.8, 132),
    "b200": ({"fp32": 75, "tf32": 1125, "bf16": 2250, "fp16": 2250, "fp8": 4500}, 180, 8.0, 148),
    "mi300x": ({"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}, 192, 5.3, 304),
}


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


_CAPTURES: dict = {}


@pytest.fixture
def one_capture(monkeypatch):
    """The CLI runs below differ only in --hardware (and --dtype): the model's graph is the same,
    so it is captured once (torch.export is most of a run's time) and shared."""
    real = workload.capture_for_planning

    def cached(w):
        key = (w.name, repr(w.config), tuple(sorted(w.max_sizes.items())))
        if key not in _CAPTURES:
            _CAPTURES[key] = real(w)
        return _CAPTURES[key]
    monkeypatch.setattr(workload, "capture_for_planning", cached)


@pytest.mark.parametrize("name", sorted({*BUILTIN_DEVICES, *ALIASES, *SHORT_NAMES}))
def test_every_builtin_name_loads_with_its_own_node(name: str) -> None:
    device = load_hardware(name)
    assert isinstance(device, DeviceSpec) and device.name in BUILTIN_DEVICES
    assert load_hardware(name.upper()) is device
    assert device.name in BUILTIN_NODE_LINKS
    cluster = Cluster.from_spec("2x8", hardware=name)
    assert cluster.device is device and cluster.world_size == 16
    for link in (cluster.intra, cluster.inter):
        assert link.source and link.bandwidth > 0
    if device.sm_count:   # a GPU: never the cpu host's gloo-over-loopback links
        assert cluster.intra.bandwidth >= 16e9 and cluster.inter.bandwidth >= 1e9
        assert cluster.intra_peak_bandwidth >= cluster.intra.bandwidth
        assert BUILTIN_NODE_LINKS[device.name].devices_per_node == 8


@pytest.mark.parametrize("short", NEW)
def test_new_profiles_match_their_datasheets(short: str) -> None:
    device = load_hardware(short)
    peaks, memory_gb, bandwidth_tb, sms = SHEET[short]
    assert {k: v / 1e12 for k, v in device.peak_flops.items()} == pytest.approx(peaks)
    assert device.memory_bytes == pytest.approx(memory_gb * 1e9)
    assert device.memory_bandwidth == pytest.approx(bandwidth_tb * 1e12)
    assert device.sm_count == sms


@pytest.mark.parametrize("name", GPUS)
def test_every_datasheet_number_has_a_source(name: str) -> None:
    device = BUILTIN_DEVICES[name]
    keys = [f"peak_flops.{k}" for k in device.peak_flops]
    keys += ["memory_bytes", "memory_bandwidth", "sm_count", "matmul_efficiency", "memory_efficiency",
             "kernel_overhead_s", "attention_efficiency"]
    for key in keys:
        assert device.sources.get(key, "").strip(), f"{name}: no source for {key}"
    if name in {load_hardware(s).name for s in NEW}:
        for key in [f"peak_flops.{k}" for k in device.peak_flops] + ["memory_bytes", "memory_bandwidth"]:
            assert re.search(r"20[12]\d", device.sources[key]), f"{name}: {key} names no datasheet year"
        for key in (f"peak_flops.{k}" for k in TENSOR if k in device.peak_flops):
            assert "dense" in device.sources[key], f"{name}: {key} does not say it is the dense figure"
        for key in ("matmul_efficiency", "memory_efficiency", "attention_efficiency", "kernel_overhead_s"):
            src = device.sources[key]
            assert "assumption" in src or "measured by `autopar calibrate`" in src, \
                f"{name}: {key} is neither stated as an assumption nor as measured"


@pytest.mark.parametrize("name", GPUS)
def test_peaks_are_ordered_sanely(name: str) -> None:
    peak = BUILTIN_DEVICES[name].peak_flops
    assert peak["fp16"] > peak["fp32"]
    if "bf16" in peak:
        assert peak["bf16"] == peak["fp16"] and peak["bf16"] >= peak.get("tf32", 0) >= 0
        assert peak.get("tf32", peak["fp32"]) >= peak["fp32"]
    if "fp8" in peak:
        assert peak["fp8"] > peak["bf16"]
    device = BUILTIN_DEVICES[name]
    assert 0 < device.attention_efficiency <= device.matmul_efficiency <= 1


@pytest.mark.parametrize(("short", "dtype"), [("v100", "bf16"), ("v100", "tf32"), ("v100", "fp8"),
                                              ("v100", "torch.bfloat16"), ("a10g", "fp8"), ("a100", "fp8")])
def test_a_missing_dtype_is_a_config_error_naming_device_and_dtype(short: str, dtype: str) -> None:
    device = load_hardware(short)
    with pytest.raises(ConfigError) as info:
        device.peak(dtype)
    assert isinstance(info.value, AutoparError)
    text = str(info.value)
    key = dtype.removeprefix("torch.").replace("bfloat16", "bf16")
    assert device.name in text and repr(key) in text
    # the reason travels with the profile's JSON (sources), so a copy refuses it the same way
    copy = DeviceSpec.from_dict(device.to_dict())
    with pytest.raises(ConfigError, match=re.escape(device.name)):
        copy.peak(dtype)




def test_unknown_hardware_lists_the_new_names() -> None:
    with pytest.raises(ConfigError) as info:
        load_hardware("tpu-v9")
    for short in NEW:
        assert short in str(info.value)


def test_node_figures_follow_the_platforms() -> None:
    b200 = Cluster.from_spec("2x8", hardware="b200")
    h200 = Cluster.from_spec("2x8", hardware="h200")
    mi300x = Cluster.from_spec("2x8", hardware="mi300x")
    l4 = Cluster.from_spec("2x8", hardware="l4")
    assert b200.intra_peak_bandwidth == 900e9 and h200.intra_peak_bandwidth == 450e9   # NVLink 5 / 4
    assert mi300x.intra_peak_bandwidth == 448e9                      # 7 x 64 GB/s each way
    assert b200.intra.bandwidth > h200.intra.bandwidth > l4.intra.bandwidth
    assert h200.inter.bandwidth == b200.inter.bandwidth == 48e9      # 8x 400 Gb/s per node
    assert "g6.48xlarge" in l4.inter.source and l4.inter.bandwidth < h200.inter.bandwidth
    for cluster in (b200, h200, mi300x, l4):
        assert "assumption" in cluster.intra.source or "nccl-tests" in cluster.intra.source


@pytest.mark.parametrize("short", ["h200", "mi300x"])
def test_autopar_plan_runs_on_the_new_hardware(capsys, one_capture, short: str) -> None:
    rc, out, err = _run(capsys, ["plan", "--model", "gpt", "--cluster", "1x8", "--hardware", short,
                                 "--batch", "16", "--seq", "128", "--dtype", "bf16", "--json", "-q"])
    assert rc == 0, err
    data = json.loads(out)
    assert data["cluster"] == f"1x8 {load_hardware(short).name}" and data["devices"] == 8
    assert data["predicted"]["step_time_s"] > 0 and data["fits"]


_SIMULATE = ["simulate", "--model", "gpt", "--cluster", "1x8", "--batch", "64", "--seq", "1024", "--zero", "1", "-q",
             "--json"]


def test_b200_steps_faster_than_v100_for_the_same_config(capsys, one_capture) -> None:
    steps = {}
    for short in ("v100", "b200"):
        rc, out, err = _run(capsys, [*_SIMULATE, "--hardware", short, "--dtype", "fp16"])
        assert rc == 0, err
        data = json.loads(out)
        assert data["degrees"]["dp"] == 8 and data["zero_stage"] == 1 and data["dtype"] == "fp16"
        steps[short] = data["predicted"]["step_time_s"]
    assert 0 < steps["b200"] < steps["v100"] / 2, steps


def test_v100_refuses_bf16_on_the_command_line_too(capsys, one_capture) -> None:
    with pytest.raises(ConfigError, match="no bf16 tensor cores"):
        load_hardware("v100").peak("bf16")
    rc, out, err = _run(capsys, [*_SIMULATE, "--hardware", "v100", "--dtype", "bf16"])
    assert rc == 2 and not out
    assert "v100-sxm2-32gb" in err and "'bf16'" in err and "no bf16 tensor cores" in err
    assert "Traceback" not in err


def test_h200_efficiencies_are_the_measured_profiles():
    """The H200's matmul and memory efficiencies come from a calibration run on an H200 that
    ships with the package: the built-in entry and the measured file must agree, and the file
    loads as a profile (``--hardware path``)."""
    from pathlib import Path

    import autopar.cost as cost

    path = Path(cost.__file__).parent / "profiles" / "h200-sxm-141gb.measured.json"
    measured = load_hardware(path)
    builtin = load_hardware("h200")
    assert measured.name == "h200-sxm-141gb (calibrated)"
    assert builtin.matmul_efficiency == pytest.approx(measured.matmul_efficiency, abs=0.005)
    assert builtin.memory_efficiency == pytest.approx(measured.memory_efficiency, abs=0.005)
    assert "h200-sxm-141gb.measured.json" in builtin.sources["matmul_efficiency"]
    assert measured.peak("bf16") == builtin.peak("bf16")
