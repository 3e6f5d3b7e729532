"""Roofline time of one op on one device (Williams, Waterman & Patterson, "Roofline", CACM 2009).

    time = max(flops / (peak[dtype] * matmul_efficiency),
               bytes_moved / (memory_bandwidth * memory_efficiency))
           + kernel_overhead_s            (only if launch_overhead and the op does any work)

``flops`` counts multiply and add separately (a matmul of (m,k)@(k,n) is 2mkn FLOPs);
``bytes_moved`` is what the op reads from and writes to device memory. The per-kernel
overhead models the floor a tiny kernel cannot go under (launch + tail, a few us on a GPU;
dispatch on a CPU); it is an assumption listed in the device's ``sources``.
"""
from __future__ import annotations

import math

from autopar.cost.hardware import DeviceSpec, dtype_bytes
from autopar.core.errors import ConfigError


def _non_negative(value: float, what: str) -> None:
    if value < 0:
        raise ConfigError(f"{what} must not be negative", where="op_time", expected=">= 0",
                          got=repr(value))


def compute_time(flops: float, device: DeviceSpec, dtype: object = "bf16", *,
                 efficiency: float | None = None) -> float:
    """Seconds to execute ``flops`` at ``efficiency`` of the device's peak for ``dtype`` (default:
    its large-matmul ``matmul_efficiency``)."""
    _non_negative(flops, "flops")
    if not flops:
        return 0.0
    return flops / (device.peak(dtype) * (efficiency or device.matmul_efficiency))


def memory_time(bytes_moved: float, device: DeviceSpec) -> float:
    """Seconds to move ``bytes_moved`` through device memory at the achievable bandwidth."""
    _non_negative(bytes_moved, "bytes_moved")
    return bytes_moved / device.achievable_bandwidth() if bytes_moved else 0.0


def op_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: object = "bf16", *,
            launch_overhead: bool = True, efficiency: float | None = None) -> float:
    """Roofline seconds of one op: the slower of its compute and its memory traffic.

    ``efficiency``: the fraction of peak this op's compute reaches (:func:`gemm_efficiency`
    for a matmul of known shape); default the device's ``matmul_efficiency``. With
    ``launch_overhead`` (default) an op that does any work also pays
    ``device.kernel_overhead_s``; pass False for the pure roofline.
    """
    roof = max(compute_time(flops, device, dtype, efficiency=efficiency), memory_time(bytes_moved, device))
    if launch_overhead and (flops > 0 or bytes_moved > 0):
        roof += device.kernel_overhead_s
    return roof


# Output tiles a GEMM library picks from (NVIDIA, "Matrix Multiplication Background User's
# Guide", DU-09799-001, 2023, section 2.3: cuBLAS's 16-bit kernels tile the output in 256x128,
# 128x128, 128x64, 64x64 ... and larger tiles are the more efficient ones). A tile smaller than
# 128x128 is credited its operand reuse relative to 128x128: ``tm*tn / (tm + tn)`` FLOPs per
# element it loads, so 128x64 runs at 2/3 and 64x64 at 1/2 of a large tile's rate (an
# assumption of this model, not a measurement; `autopar calibrate` measures the large-GEMM rate).
GEMM_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64), (32, 32))


def _tile_rate(tm: int, tn: int) -> float:
    return min(1.0, (tm * tn / (tm + tn)) / 64.0)


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, *, batch: int = 1) -> float:
    """Fraction of dense peak an ``(m, k) @ (k, n)`` GEMM (``batch`` of them) reaches: the
    device's large-GEMM ``matmul_efficiency`` times the tile and wave quantization of its
    output (the same guide, section 3): the output is cut into tiles, the tiles run in waves of
    ``sm_count`` (one tile per SM), and every wave costs a full one. A GEMM with fewer tiles
    than SMs may also split ``k`` into up to 16 slices of at least 256 (split-K, as cuBLAS and
    CUTLASS do; the slices' final sum is not charged). The best tile (:data:`GEMM_TILES`, at
    its rate) and split are taken. A device without ``sm_count`` (a CPU) has no such loss. A
    thin inner dimension shows as memory traffic in the roofline, not here."""
    base = device.matmul_efficiency
    sms = device.sm_count
    if not sms or m < 1 or n < 1 or k < 1:
        return base
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (k // split < 256 or tiles * split > 2 * sms):
                break
            waves = math.ceil(tiles * split / sms)
            util = m * n * k * batch / (waves * sms * tm * tn * math.ceil(k / split))
            best = max(best, util * _tile_rate(tm, tn))
    return base * min(1.0, best)


def ridge_point(device: DeviceSpec, dtype: object = "bf16") -> float:
    """Arithmetic intensity (FLOP/byte) above which an op is compute-bound on ``device``."""
    return device.achievable_flops(dtype) / device.achievable_bandwidth()


def is_compute_bound(flops: float, bytes_moved: float, device: DeviceSpec,
                     dtype: object = "bf16") -> bool:
    """True if the op's compute time is at least its memory time."""
    return compute_time(flops, device, dtype) >= memory_time(bytes_moved, device)


def matmul_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of an (m, k) and a (k, n) matrix: 2*batch*m*n*k."""
    return 2.0 * batch * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype: object = "bf16", batch: int = 1) -> float:
    """Bytes a matmul reads (both operands) and writes (the result), each once."""
    return float(batch * (m * k + k * n + m * n) * dtype_bytes(dtype))


def matmul_time(m: int, n: int, k: int, device: DeviceSpec, dtype: object = "bf16", *,
                batch: int = 1, launch_overhead: bool = True) -> float:
    """Roofline seconds of an (m, k) @ (k, n) matmul (``batch`` of them)."""
    return op_time(matmul_flops(m, n, k, batch), matmul_bytes(m, n, k, dtype, batch), device,
                   dtype, launch_overhead=launch_overhead)


def elementwise_time(numel: int, device: DeviceSpec, dtype: object = "bf16", *, inputs: int = 1,
                     outputs: int = 1, flops_per_element: float = 1.0,
                     launch_overhead: bool = True) -> float:
    """Roofline seconds of an elementwise op over ``numel`` elements with ``inputs`` tensors
    read and ``outputs`` written (memory-bound on every realistic device)."""
    moved = float(numel * (inputs + outputs) * dtype_bytes(dtype))
    return op_time(numel * flops_per_element, moved, device, dtype,
                   launch_overhead=launch_overhead)
