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

from autopar.cost.hardware import DeviceSpec, dtype_bytes
from autopar.errors import ConfigError


def _non_negative(value: float, what: str) -> None:
    if value < 0:
        raise ConfigError(f"{what} must not be negative", where="op_time", expected=">= 0",
                          got=repr(value))


def compute_time(flops: float, device: DeviceSpec, dtype: object = "bf16") -> float:
    """Seconds to execute ``flops`` at the device's achievable matmul rate for ``dtype``."""
    _non_negative(flops, "flops")
    return flops / device.achievable_flops(dtype) if flops else 0.0


def memory_time(bytes_moved: float, device: DeviceSpec) -> float:
    """Seconds to move ``bytes_moved`` through device memory at the achievable bandwidth."""
    _non_negative(bytes_moved, "bytes_moved")
    return bytes_moved / device.achievable_bandwidth() if bytes_moved else 0.0


def op_time(flops: float, bytes_moved: float, device: DeviceSpec, dtype: object = "bf16", *,
            launch_overhead: bool = True) -> float:
    """Roofline seconds of one op: the slower of its compute and its memory traffic.

    With ``launch_overhead`` (default) an op that does any work also pays
    ``device.kernel_overhead_s``; pass False for the pure roofline.
    """
    roof = max(compute_time(flops, device, dtype), memory_time(bytes_moved, device))
    if launch_overhead and (flops > 0 or bytes_moved > 0):
        roof += device.kernel_overhead_s
    return roof


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
