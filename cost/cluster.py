"""Clusters (nodes x devices) and how a mesh axis's process groups map onto their links.

A mesh is an ordered list of axes ``[(name, size), ...]``; the LAST axis is innermost, i.e.
ranks that differ only in the last axis are contiguous (rank = row-major index). Ranks fill
nodes in order: rank r lives on node ``r // devices_per_node``.

Link figures are *bus bandwidths* in the nccl-tests sense (see :mod:`autopar.cost.comm`):
the per-device bandwidth that the ring formulas divide by.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Sequence

from autopar.cost.hardware import DeviceSpec, HardwareProfile, load_hardware, load_profile
from autopar.core.errors import ConfigError, MeshError

MeshAxes = Sequence[tuple[str, int]]
LinkKind = Literal["intra", "inter", "hierarchical"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One class of link as the alpha-beta model sees it.

    ``bandwidth``: bus bandwidth per device, bytes/s, one direction. ``base_latency_s``: fixed
    cost per collective call. ``hop_latency_s``: cost per ring step (the alpha of the formulas).
    ``source`` says where the figures come from.
    """

    bandwidth: float
    base_latency_s: float
    hop_latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ConfigError("link bandwidth must be positive", where="Link",
                              expected="> 0 bytes/s", got=repr(self.bandwidth))
        if self.base_latency_s < 0 or self.hop_latency_s < 0:
            raise ConfigError("link latencies must not be negative", where="Link",
                              expected=">= 0 s",
                              got=f"base={self.base_latency_s!r}, hop={self.hop_latency_s!r}")


@dataclass(frozen=True, kw_only=True)
class NodeLinks:
    """The links of one kind of node: inside the node and out through each device's NIC.

    ``intra_peak_bandwidth`` is the raw per-direction link figure (e.g. NVLink), kept for
    reference; costs use ``intra.bandwidth`` (the achievable all-reduce bus bandwidth).
    """

    intra: Link
    inter: Link
    intra_peak_bandwidth: float
    devices_per_node: int


_NCCL = "NCCL maintainers' nccl-tests all_reduce_perf busbw"
_LAT = ("assumption from NCCL's latency model (anchors/README.md): intra-node base ~7-14 us "
        "+ ~1-3 us per hop; inter-node hops a few us more")

# DGX A100: NVLink3 via NVSwitch, 12 links x 25 GB/s = 300 GB/s per direction per GPU
# (A100 datasheet: 600 GB/s bidirectional); 8x HDR 200 Gb/s ConnectX-6 per node = 25 GB/s
# raw per GPU, 24 GB/s achievable (anchors/hardware.csv).
_DGX_A100 = NodeLinks(
    intra=Link(bandwidth=230e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"{_NCCL} on DGX A100 (230 GB/s); latency: {_LAT}"),
    inter=Link(bandwidth=24e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"8x HDR 200 Gb/s NICs per DGX A100 node, 24 GB/s per GPU; latency: {_LAT}"),
    intra_peak_bandwidth=300e9, devices_per_node=8)
# DGX H100: NVLink4 via NVSwitch, 18 links = 450 GB/s per direction per GPU (900 GB/s
# bidirectional, H100 datasheet); 8x NDR 400 Gb/s ConnectX-7 per node = 50 GB/s raw per GPU.
_DGX_H100 = NodeLinks(
    intra=Link(bandwidth=370e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"{_NCCL} on DGX H100 (370 GB/s); latency: {_LAT}"),
    inter=Link(bandwidth=48e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"8x NDR 400 Gb/s NICs per DGX H100 node, 48 GB/s per GPU; latency: {_LAT}"),
    intra_peak_bandwidth=450e9, devices_per_node=8)
_CPU_EST = ("gloo over loopback as `autopar calibrate` measured it on a 2-core x86 VM (2026-11-25, world 2: "
            "150 us per ring step, bus bandwidth 1.3 GB/s all-gather to 2.9 GB/s all-reduce), plus 1 ms per "
            "call: what a collective costs a training step there when the ranks' compute and gloo's threads "
            "share the cores (bench/dp.py: 1.2 ms of step time per extra gradient bucket; bench/tp.py: "
            "1.5-2 ms per extra tensor-axis collective); 10 GbE between hosts; replace with `autopar "
            "calibrate` on your machines")
_CPU_HOST = NodeLinks(
    intra=Link(bandwidth=1.5e9, base_latency_s=1e-3, hop_latency_s=150e-6, source=_CPU_EST),
    inter=Link(bandwidth=1e9, base_latency_s=1e-3, hop_latency_s=150e-6, source=_CPU_EST),
    intra_peak_bandwidth=2e9, devices_per_node=1)


# Nodes of the other built-in devices. Where no nccl-tests figure is at hand, the achievable
# intra-node bus bandwidth is an ASSUMPTION stated in the source: ~80% of the per-direction
# NVLink/Infinity Fabric peak (the ratio the DGX A100 and DGX H100 rows above show: 77%, 82%),
# ~50% of the per-direction PCIe peak on PCIe-only nodes (rings cross the host bridge), and
# ~96% of a NIC's line rate (as above). `autopar calibrate` replaces them with measurements.
_BUSBW80 = "assumption: ~80% of the per-direction peak, as nccl-tests shows on DGX A100/H100"
_PCIE_BUSBW = ("assumption: ~50% of PCIe Gen4 x16's 32 GB/s per direction (64 GB/s bidirectional, "
               "datasheet), no NVLink, rings cross the host bridge")
_ETH_LAT = ("assumption: TCP/EFA over the instance's Ethernet, ~20 us per hop; measure with "
            "`autopar calibrate`")
# DGX-1 with V100 32GB: NVLink2 hybrid cube-mesh, 6 links x 25 GB/s = 150 GB/s per direction
# per GPU (V100 datasheet: 300 GB/s); 4x EDR 100 Gb/s InfiniBand per node = 6.25 GB/s per GPU.
_DGX1_V100 = NodeLinks(
    intra=Link(bandwidth=120e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"DGX-1 (V100) NVLink2 150 GB/s per direction; {_BUSBW80}; latency: {_LAT}"),
    inter=Link(bandwidth=6e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"NVIDIA DGX-1 datasheet (2018): 4x EDR 100 Gb/s InfiniBand per node, 6.25 GB/s raw "
                      f"per GPU, ~96% taken; latency: {_LAT}"),
    intra_peak_bandwidth=150e9, devices_per_node=8)
# DGX H200: the DGX H100's NVLink4/NVSwitch fabric (900 GB/s bidirectional per GPU) and NICs.
_DGX_H200 = NodeLinks(
    intra=Link(bandwidth=370e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"NVIDIA DGX H200 datasheet (2024): NVLink 900 GB/s (450 per direction) over the DGX "
                      f"H100's NVSwitch fabric, so its {_NCCL} (370 GB/s) is taken; latency: {_LAT}"),
    inter=Link(bandwidth=48e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"NVIDIA DGX H200 datasheet (2024): 8x ConnectX-7 400 Gb/s per node, 48 GB/s per GPU "
                      f"(as DGX H100); latency: {_LAT}"),
    intra_peak_bandwidth=450e9, devices_per_node=8)
# DGX B200: NVLink5, 1.8 TB/s bidirectional per GPU (14.4 TB/s per node); 8x 400 Gb/s NICs.
_DGX_B200 = NodeLinks(
    intra=Link(bandwidth=720e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"NVIDIA DGX B200 datasheet (2024): NVLink5 1.8 TB/s per GPU (900 GB/s per "
                      f"direction); {_BUSBW80}; latency: {_LAT}"),
    inter=Link(bandwidth=48e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"NVIDIA DGX B200 datasheet (2024): 8x ConnectX-7 400 Gb/s per node, 48 GB/s per GPU "
                      f"(as DGX H100); latency: {_LAT}"),
    intra_peak_bandwidth=900e9, devices_per_node=8)
# 8x MI300X platform: every GPU linked to the 7 others, 7 x 128 GB/s bidirectional Infinity
# Fabric = 896 GB/s aggregate, 448 GB/s per direction; 8x 400 Gb/s NICs (e.g. Azure ND MI300X v5).
_MI300X_NODE = NodeLinks(
    intra=Link(bandwidth=358e9, base_latency_s=10e-6, hop_latency_s=2e-6,
               source=f"AMD Instinct MI300X data sheet (2023): 7 Infinity Fabric links x 128 GB/s = 896 GB/s "
                      f"aggregate (448 per direction); {_BUSBW80} (RCCL); latency: {_LAT}"),
    inter=Link(bandwidth=48e9, base_latency_s=10e-6, hop_latency_s=5e-6,
               source=f"8x 400 Gb/s NICs per 8-GPU MI300X node (Microsoft Azure ND MI300X v5, 2024), 48 GB/s "
                      f"per GPU; latency: {_LAT}"),
    intra_peak_bandwidth=448e9, devices_per_node=8)


def _pcie_cloud_node(instance: str, nic_gbit: float, gpus: int) -> NodeLinks:
    """A PCIe Gen4 x16 node with no NVLink and one shared Ethernet/EFA NIC of ``nic_gbit``."""
    per_gpu = nic_gbit / 8 * 1e9 / gpus
    return NodeLinks(
        intra=Link(bandwidth=16e9, base_latency_s=10e-6, hop_latency_s=5e-6,
                   source=f"{instance}: {_PCIE_BUSBW}; latency: {_LAT}"),
        inter=Link(bandwidth=0.96 * per_gpu, base_latency_s=20e-6, hop_latency_s=20e-6,
                   source=f"{instance}: {nic_gbit:g} Gb/s network per instance shared by {gpus} GPUs "
                          f"({per_gpu / 1e9:.2f} GB/s each), ~96% taken; latency: {_ETH_LAT}"),
        intra_peak_bandwidth=32e9, devices_per_node=gpus)


_G5_A10G = _pcie_cloud_node("Amazon EC2 g5.48xlarge (8x A10G; AWS EC2 docs)", 100, 8)
_G6_L4 = _pcie_cloud_node("Amazon EC2 g6.48xlarge (8x L4; AWS EC2 docs)", 100, 8)
_G6E_L40S = _pcie_cloud_node("Amazon EC2 g6e.48xlarge (8x L40S; AWS EC2 G6e, 2024)", 400, 8)

BUILTIN_NODE_LINKS = {"a100-sxm-80gb": _DGX_A100, "h100-sxm-80gb": _DGX_H100, "cpu": _CPU_HOST,
                      "v100-sxm2-32gb": _DGX1_V100, "h200-sxm-141gb": _DGX_H200, "b200-180gb": _DGX_B200,
                      "mi300x-192gb": _MI300X_NODE, "a10g-24gb": _G5_A10G, "l4-24gb": _G6_L4,
                      "l40s-48gb": _G6E_L40S}


@dataclass(frozen=True, kw_only=True)
class AxisLinks:
    """How the process groups of one mesh axis sit on the cluster.

    ``members_per_node``: group members sharing a node (k). ``nodes_spanned``: nodes a group
    touches (m). ``kind``: ``intra`` (m == 1), ``inter`` (k == 1) or ``hierarchical``.
    ``regular`` is False when groups split unevenly over nodes (k and m are then worst cases).
    """

    axis: str
    size: int
    stride: int
    members_per_node: int
    nodes_spanned: int
    kind: LinkKind
    regular: bool = True


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` copies of ``device`` joined by ``intra``/``inter`` links."""

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra: Link
    inter: Link
    intra_peak_bandwidth: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        for what in ("nodes", "devices_per_node"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"cluster {what} must be a positive integer", where="Cluster",
                                  expected="an int >= 1", got=repr(value))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @classmethod
    def from_spec(cls, spec: str, *, hardware: str | Path | DeviceSpec = "h100") -> Cluster:
        """Parse ``"NODESxGPUS"`` (e.g. ``"4x8"``) on built-in hardware or a calibrated profile.

        A profile's measured link (nccl preferred, else gloo) is used for both intra- and
        inter-node links unless better figures are known; the source strings say so.
        """
        match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(spec))
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise ConfigError(f"malformed cluster spec {spec!r}", where="cluster",
                              expected="NODESxGPUS with positive integers, e.g. '4x8'",
                              got=repr(spec), fix="write nodes, an 'x', then devices per node")
        nodes, per_node = int(match[1]), int(match[2])
        device, links = _device_and_links(hardware)
        return cls(nodes=nodes, devices_per_node=per_node, device=device, intra=links.intra,
                   inter=links.inter, intra_peak_bandwidth=links.intra_peak_bandwidth,
                   name=f"{nodes}x{per_node} {device.name}")

    def axis_links(self, mesh_axes: MeshAxes, axis_name: str) -> AxisLinks:
        """How ``axis_name``'s groups in ``mesh_axes`` map to this cluster's links."""
        axes = validate_mesh(mesh_axes, self.world_size)
        return _axis_links(axes, axis_name, self.devices_per_node)

    def link_for(self, kind: Literal["intra", "inter"]) -> Link:
        return self.intra if kind == "intra" else self.inter


def _device_and_links(hardware: str | Path | DeviceSpec) -> tuple[DeviceSpec, NodeLinks]:
    text = str(hardware)
    if not isinstance(hardware, DeviceSpec) and (text.endswith(".json") or Path(text).is_file()):
        return _profile_links(load_profile(hardware))
    device = load_hardware(hardware)
    links = BUILTIN_NODE_LINKS.get(device.name, _CPU_HOST)
    return device, links


def _profile_links(profile: HardwareProfile) -> tuple[DeviceSpec, NodeLinks]:
    """Links from a calibrated profile: the measured backend stands in for both link kinds."""
    measured = profile.links.get("nccl") or profile.links.get("gloo")
    if measured is None:
        return profile.device, _CPU_HOST
    sizes = sorted({measured.world_size, *map(int, measured.by_group_size)})
    source = (f"measured by autopar calibrate ({measured.backend}, group sizes "
              f"{', '.join(map(str, sizes))}); used for intra- and inter-node links alike")
    link = Link(bandwidth=measured.bandwidth, base_latency_s=measured.base_latency_s,
                hop_latency_s=measured.alpha_s, source=source)
    return profile.device, NodeLinks(intra=link, inter=link, intra_peak_bandwidth=link.bandwidth,
                                     devices_per_node=1)


def validate_mesh(mesh_axes: MeshAxes,
                  world_size: int | None = None) -> tuple[tuple[str, int], ...]:
    """Check a mesh description and return it as a tuple of ``(name, size)`` pairs.

    Names must be unique non-empty strings, sizes positive ints, and (when ``world_size`` is
    given) the product of sizes must equal it.
    """
    try:
        axes = tuple((str(name), size) for name, size in mesh_axes)
    except (TypeError, ValueError):
        raise MeshError("mesh axes must be a list of (name, size) pairs", where="mesh",
                        expected="e.g. [('dp', 4), ('tp', 8)]", got=repr(mesh_axes)) from None
    names = [name for name, _ in axes]
    if not axes or len(set(names)) != len(names) or not all(names):
        raise MeshError("mesh axis names must be unique and non-empty", where="mesh",
                        got=repr(list(mesh_axes)), fix="rename the repeated or empty axis")
    for name, size in axes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name!r} has a bad size", where=f"mesh axis {name!r}",
                            expected="an int >= 1", got=repr(size))
    product = math.prod(size for _, size in axes)
    if world_size is not None and product != world_size:
        shown = " x ".join(f"{name}={size}" for name, size in axes)
        raise MeshError(f"mesh {shown} has {product} ranks but the cluster has {world_size}",
                        where="mesh", expected=f"product of axis sizes == {world_size}",
                        got=f"{product} ({shown})",
                        fix="change the axis sizes so their product is the world size")
    return axes


@lru_cache(maxsize=4096)
def _axis_links(axes: tuple[tuple[str, int], ...], axis_name: str,
                devices_per_node: int) -> AxisLinks:
    names = [name for name, _ in axes]
    if axis_name not in names:
        raise ConfigError(f"mesh has no axis {axis_name!r}", where="mesh",
                          expected=f"one of {names}", got=repr(axis_name))
    index = names.index(axis_name)
    size = axes[index][1]
    stride = math.prod(s for _, s in axes[index + 1:])
    world = math.prod(s for _, s in axes)
    if size * stride <= devices_per_node and devices_per_node % (size * stride) == 0:
        return AxisLinks(axis=axis_name, size=size, stride=stride, members_per_node=size,
                         nodes_spanned=1, kind="intra")
    if stride >= devices_per_node:
        return AxisLinks(axis=axis_name, size=size, stride=stride, members_per_node=1,
                         nodes_spanned=size, kind="inter" if size > 1 else "intra")
    return _mixed_axis(axis_name, size, stride, world, devices_per_node)


def _mixed_axis(axis: str, size: int, stride: int, world: int, per_node: int) -> AxisLinks:
    """Count members per node over every group of the axis (exact, also for ragged layouts)."""
    span = size * stride
    fewest_per_node, most_nodes, regular = size, 1, True
    for block in range(0, world, span):
        for offset in range(stride):
            counts = Counter((block + offset + i * stride) // per_node for i in range(size))
            per = set(counts.values())
            regular = regular and len(per) == 1
            fewest_per_node = min(fewest_per_node, min(per))
            most_nodes = max(most_nodes, len(counts))
    kind: LinkKind = ("intra" if most_nodes == 1 else
                      "inter" if fewest_per_node == 1 and regular else "hierarchical")
    return AxisLinks(axis=axis, size=size, stride=stride, members_per_node=fewest_per_node,
                     nodes_spanned=most_nodes, kind=kind, regular=regular)
