"""Cost model: hardware constants, mesh-to-link mapping, collective formulas, roofline."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from autopar.cost import comm
from autopar.cost.cluster import Cluster, Link, validate_mesh
from autopar.cost.compute import is_compute_bound, matmul_time, op_time, ridge_point
from autopar.cost.hardware import DeviceSpec, load_hardware
from autopar.core.errors import ConfigError

ANCHORS = Path(__file__).resolve().parents[1] / "bench" / "anchors" / "hardware.csv"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


# --- hardware ---------------------------------------------------------------------------------

def _anchor_rows() -> list[dict[str, str]]:
    if not ANCHORS.is_file():
        pytest.skip(f"{ANCHORS} is absent")
    with ANCHORS.open() as handle:
        return list(csv.DictReader(handle))


def test_constants_match_anchor_csv() -> None:
    for row in _anchor_rows():
        device = load_hardware(row["name"])
        cluster = Cluster.from_spec(f"1x{row['gpus_per_node']}", hardware=row["name"])
        assert device.peak("bf16") == pytest.approx(float(row["bf16_dense_tflops"]) * 1e12)
        assert device.memory_bytes == pytest.approx(float(row["hbm_gb"]) * 1e9)
        assert device.memory_bandwidth == pytest.approx(float(row["hbm_tb_per_s"]) * 1e12)
        assert cluster.intra_peak_bandwidth == pytest.approx(
            float(row["nvlink_gb_per_s_per_dir"]) * 1e9)
        assert cluster.intra.bandwidth == pytest.approx(
            float(row["nccl_intra_node_allreduce_busbw_gb_per_s"]) * 1e9)
        assert cluster.inter.bandwidth == pytest.approx(float(row["nic_gb_per_s_per_gpu"]) * 1e9)
        assert cluster.devices_per_node == int(row["gpus_per_node"])


def test_builtin_devices_cite_every_constant() -> None:
    for name in ("a100", "h100", "cpu"):
        device = load_hardware(name)
        for key in device.peak_flops:
            assert device.sources[f"peak_flops.{key}"]
        for key in ("memory_bytes", "memory_bandwidth", "matmul_efficiency", "memory_efficiency"):
            assert device.sources[key]
    assert "estimate" in load_hardware("cpu").sources["peak_flops.fp32"]
    a100 = load_hardware("a100")
    assert a100.peak("fp32") == 19.5e12 and a100.peak("tf32") == 156e12
    assert a100.peak("torch.bfloat16") == a100.peak("bf16") == a100.peak("fp16")


def test_aliases_resolve_to_builtins() -> None:
    assert load_hardware("a100").name == "a100-sxm-80gb"
    assert load_hardware("H100").name == "h100-sxm-80gb"
    assert load_hardware(load_hardware("cpu")) is load_hardware("cpu")


def test_unknown_hardware_names_value_and_choices() -> None:
    with pytest.raises(ConfigError) as info:
        load_hardware("tpu-v9")
    assert "tpu-v9" in str(info.value) and "h100" in str(info.value)


def test_missing_profile_path_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.json"):
        load_hardware(tmp_path / "nope.json")


def test_device_spec_validates() -> None:
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        DeviceSpec(name="x", peak_flops={"fp32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e9,
                   matmul_efficiency=1.5, memory_efficiency=0.5)
    with pytest.raises(ConfigError, match="int8"):
        load_hardware("a100").peak("int8")


# --- cluster and mesh -------------------------------------------------------------------------

def test_from_spec_parses_nodes_and_devices() -> None:
    cluster = Cluster.from_spec("4x8", hardware="h100")
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (4, 8, 32)
    assert cluster.device.name == "h100-sxm-80gb"


@pytest.mark.parametrize("spec", ["4x", "x8", "4by8", "0x8", "4x8x2", ""])
def test_malformed_spec_is_config_error(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        Cluster.from_spec(spec, hardware="a100")
    assert repr(spec) in str(info.value)


def test_mesh_product_must_equal_world_size() -> None:
    cluster = Cluster.from_spec("4x8", hardware="a100")
    with pytest.raises(ConfigError) as info:
        cluster.axis_links([("dp", 3), ("tp", 8)], "tp")
    assert "24" in str(info.value) and "32" in str(info.value)
    with pytest.raises(ConfigError, match="'pp'"):
        cluster.axis_links([("dp", 4), ("tp", 8)], "pp")
    with pytest.raises(ConfigError, match="unique"):
        validate_mesh([("dp", 4), ("dp", 8)], 32)


def test_axis_links_dp_inter_tp_intra() -> None:
    cluster = Cluster.from_spec("4x8", hardware="a100")
    mesh = [("dp", 4), ("tp", 8)]
    tp, dp = cluster.axis_links(mesh, "tp"), cluster.axis_links(mesh, "dp")
    assert (tp.kind, tp.members_per_node, tp.nodes_spanned, tp.stride) == ("intra", 8, 1, 1)
    assert (dp.kind, dp.members_per_node, dp.nodes_spanned, dp.stride) == ("inter", 1, 4, 8)


def test_axis_links_mixed_is_hierarchical() -> None:
    cluster = Cluster.from_spec("4x8", hardware="a100")
    mesh = [("dp", 2), ("tp", 16)]
    tp, dp = cluster.axis_links(mesh, "tp"), cluster.axis_links(mesh, "dp")
    assert (tp.kind, tp.members_per_node, tp.nodes_spanned) == ("hierarchical", 8, 2)
    assert (dp.kind, dp.members_per_node, dp.nodes_spanned) == ("inter", 1, 2)
    three = cluster.axis_links([("dp", 2), ("pp", 4), ("tp", 4)], "pp")
    assert (three.kind, three.members_per_node, three.nodes_spanned) == ("hierarchical", 2, 2)
    inner = cluster.axis_links([("dp", 8), ("tp", 2), ("ep", 2)], "tp")
    assert (inner.kind, inner.stride) == ("intra", 2)


# --- collectives ------------------------------------------------------------------------------

def test_closed_form_values() -> None:
    bw, alpha, size = 100e9, 5e-6, 1e9
    assert comm.all_reduce(size, 8, bw, alpha) == pytest.approx(2 * 7 / 8 * 0.01 + 14 * alpha)
    assert comm.all_gather(size, 4, bw, alpha) == pytest.approx(3 / 4 * 0.01 + 3 * alpha)
    assert comm.reduce_scatter(size, 4, bw, alpha) == pytest.approx(3 / 4 * 0.01 + 3 * alpha)
    assert comm.all_to_all(size, 2, bw, alpha) == pytest.approx(0.5 * 0.01 + alpha)
    assert comm.send_recv(size, bw, alpha) == pytest.approx(0.01 + alpha)
    assert comm.broadcast(size, 4, bw, alpha, base=1e-5) == pytest.approx(0.01 + 3 * alpha + 1e-5)
    # all-reduce == reduce-scatter + all-gather on the same ring
    assert comm.all_reduce(size, 8, bw, alpha) == pytest.approx(
        comm.reduce_scatter(size, 8, bw, alpha) + comm.all_gather(size, 8, bw, alpha))


def test_busbw_convention_reproduces_nccl_tests_algbw() -> None:
    # nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n for all_reduce.
    cluster = Cluster.from_spec("1x8", hardware="a100")
    size = 8e9  # large enough that latency is negligible
    seconds = comm.collective_time("all_reduce", size, cluster, [("tp", 8)], "tp")
    busbw = size / seconds * 2 * 7 / 8
    assert busbw == pytest.approx(230e9, rel=1e-3)


def test_group_of_one_costs_nothing() -> None:
    cluster = Cluster.from_spec("2x8", hardware="h100")
    for kind in KINDS:
        assert comm.collective_time(kind, 1e9, cluster, [("dp", 16), ("tp", 1)], "tp") == 0.0
        assert comm.flat_time(kind, 1e9, 1, cluster.intra) == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mesh,axis", [([("dp", 4), ("tp", 8)], "tp"),
                                       ([("dp", 4), ("tp", 8)], "dp"),
                                       ([("dp", 2), ("tp", 16)], "tp")])
def test_monotone_in_bytes(kind: str, mesh: list[tuple[str, int]], axis: str) -> None:
    cluster = Cluster.from_spec("4x8", hardware="a100")
    times = [comm.collective_time(kind, 2.0**p, cluster, mesh, axis) for p in range(0, 34, 3)]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times[0] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_intra_cheaper_than_hierarchical_cheaper_than_inter(kind: str) -> None:
    cluster = Cluster.from_spec("4x8", hardware="h100")
    for size in (1e3, 1e6, 1e9):
        intra = comm.flat_time(kind, size, 16, cluster.intra)
        inter = comm.flat_time(kind, size, 16, cluster.inter)
        mixed = comm.hierarchical_time(kind, size, 8, 2, cluster.intra, cluster.inter)
        assert intra < inter
        assert mixed <= inter * (1 + 1e-12)
    # Bandwidth-bound, two levels sit between the pure links. (Latency-bound, two short rings
    # take fewer steps than one flat 16-ring, so small messages may beat the flat intra ring.)
    size = 1e10
    mixed = comm.hierarchical_time(kind, size, 8, 2, cluster.intra, cluster.inter)
    assert comm.flat_time(kind, size, 16, cluster.intra) < mixed
    assert mixed <= comm.flat_time(kind, size, 16, cluster.inter) * (1 + 1e-12)


def test_axis_placement_drives_cost() -> None:
    cluster = Cluster.from_spec("4x8", hardware="a100")
    size = 256e6
    tp_fast = comm.collective_time("all_reduce", size, cluster, [("dp", 4), ("tp", 8)], "tp")
    tp_slow = comm.collective_time("all_reduce", size, cluster, [("tp", 8), ("dp", 4)], "tp")
    assert tp_fast < tp_slow
    # hierarchical all-reduce: intra RS + inter AR on the 1/8 shard + intra AG, one base latency
    mixed = comm.collective_time("all_reduce", size, cluster, [("dp", 2), ("tp", 16)], "tp")
    intra, inter = cluster.intra, cluster.inter
    expected = (intra.base_latency_s + 2 * 7 * intra.hop_latency_s
                + 2 * 7 / 8 * size / intra.bandwidth
                + 2 * inter.hop_latency_s + size / 8 / inter.bandwidth)
    assert mixed == pytest.approx(expected)


def test_bad_collective_inputs() -> None:
    cluster = Cluster.from_spec("1x8", hardware="a100")
    with pytest.raises(ConfigError, match="'gossip'"):
        comm.collective_time("gossip", 1e6, cluster, [("tp", 8)], "tp")
    with pytest.raises(ConfigError, match="-1"):
        comm.collective_time("all_reduce", -1, cluster, [("tp", 8)], "tp")
    assert comm.canonical_kind("p2p") == "send_recv"


def test_link_validation() -> None:
    with pytest.raises(ConfigError):
        Link(bandwidth=0.0, base_latency_s=0.0, hop_latency_s=0.0)


# --- roofline ---------------------------------------------------------------------------------

def test_compute_bound_matmul() -> None:
    h100 = load_hardware("h100")
    flops, moved = 2 * 8192.0**3, 3 * 8192.0**2 * 2
    assert is_compute_bound(flops, moved, h100, "bf16")
    expected = flops / (989.4e12 * h100.matmul_efficiency)
    assert op_time(flops, moved, h100, "bf16", launch_overhead=False) == pytest.approx(expected)
    assert matmul_time(8192, 8192, 8192, h100, "bf16",
                       launch_overhead=False) == pytest.approx(expected)


def test_memory_bound_elementwise() -> None:
    a100 = load_hardware("a100")
    numel = 2**28
    flops, moved = float(numel), 3.0 * numel * 2
    assert not is_compute_bound(flops, moved, a100, "bf16")
    expected = moved / (2.039e12 * a100.memory_efficiency)
    assert op_time(flops, moved, a100, "bf16", launch_overhead=False) == pytest.approx(expected)
    assert op_time(flops, moved, a100, "bf16") == pytest.approx(expected + a100.kernel_overhead_s)
    assert flops / moved < ridge_point(a100, "bf16")


def test_fp32_is_slower_than_bf16_on_a100() -> None:
    a100 = load_hardware("a100")
    assert math.isclose(op_time(1e12, 0, a100, "fp32") / op_time(1e12, 0, a100, "bf16"),
                        312 / 19.5, rel_tol=1e-3)
    assert op_time(0, 0, a100) == 0.0
    with pytest.raises(ConfigError):
        op_time(-1.0, 0.0, a100)
