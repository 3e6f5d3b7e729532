"""Device constants for the cost model: peak FLOP/s, memory size and bandwidth, efficiencies.

Every number carries its source in :attr:`DeviceSpec.sources`. Datasheet figures are facts;
the *efficiency* factors (what fraction of a peak a real kernel reaches) are not in any
datasheet: they are stated assumptions that ``autopar calibrate`` replaces with
measurements on the machine it runs on (see :mod:`autopar.cost.calibrate`).

Units: FLOP/s, bytes, bytes/s, seconds. "GB" and "TB" below are decimal (1e9, 1e12), as in
NVIDIA's and AMD's datasheets. Tensor-core figures are DENSE: where a datasheet gives only the
2:4-sparsity figure, the source says so and the value is half of it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autopar.core.errors import ConfigError

PROFILE_FORMAT = "autopar.hardware-profile"
PROFILE_VERSION = 1

# Canonical dtype keys of DeviceSpec.peak_flops and the spellings accepted for each.
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}
_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def canonical_dtype(dtype: object) -> str:
    """Return the canonical key (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``) of a dtype.

    Accepts those keys, common spellings (``bfloat16``, ``half``) and ``torch.dtype`` objects.
    """
    text = str(dtype).lower().removeprefix("torch.")
    if text not in _DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {dtype!r}", where="dtype",
                          expected=", ".join(sorted(set(_DTYPE_ALIASES))), got=repr(dtype),
                          fix="use one of the expected dtype names or a torch.dtype")
    return _DTYPE_ALIASES[text]


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of ``dtype`` (tf32 is stored as fp32: 4 bytes)."""
    return _DTYPE_BYTES[canonical_dtype(dtype)]


def _positive(value: float, what: str, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{what} must be a positive number", where=where, expected="> 0",
                          got=repr(value), fix=f"set {what} to a positive value")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or CPU) as the cost model sees it.

    ``peak_flops`` maps canonical dtype keys to dense peak FLOP/s. Achievable rates are
    ``peak_flops[dtype] * matmul_efficiency`` and ``memory_bandwidth * memory_efficiency``.
    ``kernel_overhead_s`` is a fixed cost per launched kernel (see
    :func:`autopar.cost.compute.op_time`). ``sources`` says where each constant comes from,
    keyed by field name (and ``peak_flops.<dtype>``); ``absent.<dtype>`` says why a device has no
    figure for a dtype (e.g. V100 has no bf16 tensor cores), and :meth:`peak` quotes it.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bytes: float
    memory_bandwidth: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead_s: float = 0.0
    # streaming multiprocessors (0: not a GPU, no tile/wave quantization of GEMMs) and the
    # fraction of peak a fused (flash) attention kernel reaches (0: ``matmul_efficiency``)
    sm_count: int = 0
    attention_efficiency: float = 0.0
    # what a training process holds beside its tensors and what running beside compute costs
    # (defaults: a GPU under PyTorch and NCCL; :data:`RUNTIME_NOTES` gives each one's source)
    reserve_bytes: float = 0.75e9          # CUDA context, cuBLAS/cuDNN workspaces
    comm_buffer_bytes: float = 0.25e9      # per communicator (process group) a rank belongs to
    fragmentation: float = 0.05            # of the bytes allocated: the caching allocator's slack
    comm_contention: float = 0.15          # of a hidden collective's time: compute slowed beside it
    zb_split_overhead: float = 0.10        # zero-bubble's split backward over one whole backward
    sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        where = f"DeviceSpec {self.name!r}"
        if not self.name:
            raise ConfigError("a device needs a name", where=where, got=repr(self.name))
        if not self.peak_flops:
            raise ConfigError("a device needs at least one peak FLOP/s figure", where=where,
                              expected="peak_flops like {'fp32': 1e12}", got=repr(self.peak_flops))
        flops = {}
        for key, value in self.peak_flops.items():
            _positive(value, f"peak_flops[{key!r}]", where)
            flops[canonical_dtype(key)] = float(value)
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        _positive(self.memory_bytes, "memory_bytes", where)
        _positive(self.memory_bandwidth, "memory_bandwidth", where)
        for what in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, what)
            _positive(value, what, where)
            if value > 1:
                raise ConfigError(f"{what} is a fraction of peak", where=where,
                                  expected="0 < value <= 1", got=repr(value))
        if self.kernel_overhead_s < 0:
            raise ConfigError("kernel_overhead_s must not be negative", where=where,
                              expected=">= 0", got=repr(self.kernel_overhead_s))
        if not isinstance(self.sm_count, int) or isinstance(self.sm_count, bool) or self.sm_count < 0:
            raise ConfigError("sm_count must be a whole number >= 0", where=where, got=repr(self.sm_count))
        if not (0 <= self.attention_efficiency <= 1):
            raise ConfigError("attention_efficiency is a fraction of peak", where=where,
                              expected="0 (use matmul_efficiency) or 0 < value <= 1",
                              got=repr(self.attention_efficiency))
        if not self.attention_efficiency:
            object.__setattr__(self, "attention_efficiency", self.matmul_efficiency)
        for what in ("reserve_bytes", "comm_buffer_bytes"):
            if getattr(self, what) < 0:
                raise ConfigError(f"{what} must not be negative", where=where, expected=">= 0",
                                  got=repr(getattr(self, what)))
        for what in ("fragmentation", "comm_contention", "zb_split_overhead"):
            if not (0 <= getattr(self, what) <= 1):
                raise ConfigError(f"{what} is a fraction", where=where, expected="0 <= value <= 1",
                                  got=repr(getattr(self, what)))
        notes = {k: v for k, v in RUNTIME_NOTES.items() if k not in self.sources}
        if notes:
            object.__setattr__(self, "sources", MappingProxyType({**self.sources, **notes}))

    def peak(self, dtype: object) -> float:
        """Dense peak FLOP/s for ``dtype``; a ConfigError if the device has no figure for it."""
        key = canonical_dtype(dtype)
        if key not in self.peak_flops:
            why = self.sources.get(f"absent.{key}")
            raise ConfigError(f"device {self.name!r} has no peak FLOP/s for dtype {key!r}"
                              + (f" ({why})" if why else ""),
                              where=f"hardware {self.name!r}, dtype {key!r}",
                              expected=", ".join(self.peak_flops), got=key,
                              fix="use a dtype this device lists (--dtype in the CLI, mixed_precision= "
                                  "in the API), or add the dtype to a hardware profile")
        return self.peak_flops[key]

    def achievable_flops(self, dtype: object) -> float:
        """FLOP/s a large matmul reaches: peak times ``matmul_efficiency``."""
        return self.peak(dtype) * self.matmul_efficiency

    def achievable_bandwidth(self) -> float:
        """Bytes/s a large streaming kernel reaches: peak times ``memory_efficiency``."""
        return self.memory_bandwidth * self.memory_efficiency

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reverses it."""
        return {"name": self.name, "peak_flops": dict(self.peak_flops),
                "memory_bytes": self.memory_bytes, "memory_bandwidth": self.memory_bandwidth,
                "matmul_efficiency": self.matmul_efficiency,
                "memory_efficiency": self.memory_efficiency,
                "kernel_overhead_s": self.kernel_overhead_s, "sm_count": self.sm_count,
                "attention_efficiency": self.attention_efficiency, "reserve_bytes": self.reserve_bytes,
                "comm_buffer_bytes": self.comm_buffer_bytes, "fragmentation": self.fragmentation,
                "comm_contention": self.comm_contention, "zb_split_overhead": self.zb_split_overhead,
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "hardware profile") -> DeviceSpec:
        """Build a DeviceSpec from :meth:`to_dict` output, with a ConfigError on missing keys."""
        required = ("name", "peak_flops", "memory_bytes", "memory_bandwidth",
                    "matmul_efficiency", "memory_efficiency")
        missing = [key for key in required if key not in data]
        if missing:
            raise ConfigError("device entry is missing keys", where=where,
                              expected=", ".join(required), got=f"missing {missing}",
                              fix="regenerate the profile with `autopar calibrate --out FILE`")
        return cls(**{key: data[key] for key in (*required, "kernel_overhead_s", "sm_count", "attention_efficiency",
                                                 *RUNTIME_NOTES, "sources") if key in data})


# Where the runtime constants of a GPU entry come from (estimates until `autopar calibrate`
# measures them on the device; a profile may give its own, with its own source).
RUNTIME_NOTES: Mapping[str, str] = MappingProxyType({
    "reserve_bytes": "estimate: a CUDA context with lazy module loading takes about 0.5 GB, cuBLAS and cuDNN "
                     "workspaces about 0.25 GB more (torch.cuda.mem_get_info after the first step minus "
                     "memory_allocated; `autopar calibrate` measures it)",
    "comm_buffer_bytes": "estimate: NCCL allocates its protocol buffers (NCCL_BUFFSIZE 4 MiB for the simple "
                         "protocol, smaller LL/LL128 ones) per channel and peer; with up to 32 channels over "
                         "NVLink about 0.25 GB per communicator",
    "fragmentation": "estimate: PyTorch's caching allocator keeps a few percent of what it hands out in "
                     "partly used blocks (PYTORCH_CUDA_ALLOC_CONF=expandable_segments lowers it); 5 % taken",
    "comm_contention": "estimate: an NCCL collective runs on 16-32 channels, one thread block (SM) each, and "
                       "shares HBM bandwidth: compute beside it loses about that share of the 108-132 SMs; "
                       "0.15 of the collective's time is charged to the step even when it is hidden",
    "zb_split_overhead": "estimate: torch's zero-bubble schedules run autograd twice per micro-batch (input "
                         "gradients, then weight gradients); on a GPU the second pass re-reads the saved "
                         "activations and launches its GEMMs separately, about 10 % (on the 2-core CPU "
                         "bench/pp.py measures 35 %: the CPU profile carries that)"})


# --- built-in devices -------------------------------------------------------------------------

_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB column"
_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM column, dense (no sparsity)"
_EFF_NOTE = ("assumption, not in any datasheet: large bf16/fp16 GEMMs in cuBLAS typically reach "
             "{pct} of dense peak; `autopar calibrate` measures it")
_MEM_NOTE = ("assumption: large device-to-device copies typically reach ~85% of HBM peak "
             "(STREAM-like); `autopar calibrate` measures it")
_LAUNCH_NOTE = "assumption: ~3 us minimum time per CUDA kernel (launch + tail); calibrate to refine"
_TILE_NOTE = ("GEMM tile and wave quantization over the SMs (NVIDIA, Matrix Multiplication Background "
              "User's Guide, 2023); matmul_efficiency is then a large, well-tiled GEMM's")

A100_SXM_80GB = DeviceSpec(
    name="a100-sxm-80gb",
    # fp32 is the non-tensor-core 19.5 TFLOP/s: PyTorch runs fp32 matmuls without TF32 by
    # default (torch.backends.cuda.matmul.allow_tf32 = False since 1.12). TF32 is listed apart.
    peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    memory_bytes=80e9, memory_bandwidth=2.039e12,
    matmul_efficiency=0.70, memory_efficiency=0.85, kernel_overhead_s=3e-6,
    sm_count=108, attention_efficiency=0.55,
    sources={"peak_flops.fp32": f"{_A100_SHEET}: FP32 19.5 TFLOPS (non-tensor)",
             "sm_count": f"NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs; {_TILE_NOTE}",
             "attention_efficiency": "Dao, FlashAttention-2 (arXiv:2307.08691, 2023): 50-73 % of A100 peak in "
                                     "forward, less in backward; 0.55 taken for both passes",
             "peak_flops.tf32": f"{_A100_SHEET}: TF32 Tensor Core 156 TFLOPS",
             "peak_flops.bf16": f"{_A100_SHEET}: BFLOAT16 Tensor Core 312 TFLOPS",
             "peak_flops.fp16": f"{_A100_SHEET}: FP16 Tensor Core 312 TFLOPS",
             "memory_bytes": f"{_A100_SHEET}: 80GB HBM2e (decimal GB; usable is a little less)",
             "memory_bandwidth": f"{_A100_SHEET}: 2,039 GB/s",
             "matmul_efficiency": _EFF_NOTE.format(pct="~65-75%"),
             "memory_efficiency": _MEM_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

H100_SXM_80GB = DeviceSpec(
    name="h100-sxm-80gb",
    # The datasheet's headline tensor figures assume 2:4 sparsity; these are the dense halves.
    peak_flops={"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                "fp8": 1978.9e12},
    memory_bytes=80e9, memory_bandwidth=3.35e12,
    matmul_efficiency=0.65, memory_efficiency=0.85, kernel_overhead_s=3e-6,
    sm_count=132, attention_efficiency=0.40,
    sources={"peak_flops.fp32": f"{_H100_SHEET}: FP32 67 TFLOPS (non-tensor)",
             "sm_count": f"NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5); {_TILE_NOTE}",
             "attention_efficiency": "Shah et al., FlashAttention-3 (arXiv:2407.08608, 2024): FlashAttention-2 "
                                     "reaches about 35 % of H100 peak, FlashAttention-3 up to 75 %; 0.40 taken "
                                     "for what PyTorch's fused attention reaches",
             "peak_flops.tf32": f"{_H100_SHEET}: TF32 Tensor Core 989 TFLOPS sparse / 2",
             "peak_flops.bf16": f"{_H100_SHEET}: BFLOAT16 Tensor Core 1,979 TFLOPS sparse / 2",
             "peak_flops.fp16": f"{_H100_SHEET}: FP16 Tensor Core 1,979 TFLOPS sparse / 2",
             "peak_flops.fp8": f"{_H100_SHEET}: FP8 Tensor Core 3,958 TFLOPS sparse / 2",
             "memory_bytes": f"{_H100_SHEET}: 80GB HBM3",
             "memory_bandwidth": f"{_H100_SHEET}: 3.35 TB/s",
             "matmul_efficiency": _EFF_NOTE.format(pct="~60-70% (power/clock limited)"),
             "memory_efficiency": _MEM_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

# The devices below follow the same rules: every datasheet number cites its sheet; "fp32" is
# the rate of PyTorch's default fp32 matmul (no TF32: torch.backends.cuda.matmul.allow_tf32 is
# False), so on NVIDIA GPUs the non-tensor FP32 figure; a dtype a device has no fast path for
# is absent (peak() then refuses it, quoting ``absent.<dtype>``); efficiencies are assumptions.
_GDDR_NOTE = ("assumption: large device-to-device copies typically reach ~80% of GDDR6 peak; "
              "`autopar calibrate` measures it")
_RUNTIME_SMS = ("multiprocessor count the CUDA runtime reports for this part "
                "(torch.cuda.get_device_properties(...).multi_processor_count); not on the datasheet")


def _sparse_half(sheet: str, what: str, sparse: str) -> str:
    return f"{sheet}: {what} {sparse} with sparsity / 2 (dense)"


_V100_SHEET = "NVIDIA Tesla V100 GPU datasheet (2020), V100 SXM2 column"
V100_SXM2_32GB = DeviceSpec(
    name="v100-sxm2-32gb",
    # Volta's tensor cores take fp16 only: no bf16, no tf32, no fp8 path exists on this part.
    peak_flops={"fp32": 15.7e12, "fp16": 125e12},
    memory_bytes=32e9, memory_bandwidth=900e9,
    matmul_efficiency=0.70, memory_efficiency=0.85, kernel_overhead_s=3e-6,
    sm_count=80, attention_efficiency=0.35,
    sources={"peak_flops.fp32": f"{_V100_SHEET}: single-precision 15.7 TFLOPS",
             "peak_flops.fp16": f"{_V100_SHEET}: Tensor Performance 125 TFLOPS (fp16 inputs, dense)",
             "absent.bf16": "V100 (Volta) has no bf16 tensor cores",
             "absent.tf32": "V100 (Volta) has no TF32 tensor cores; fp32 matmuls run at the fp32 rate",
             "absent.fp8": "V100 (Volta) has no fp8 tensor cores",
             "memory_bytes": f"{_V100_SHEET}: 32 GB HBM2",
             "memory_bandwidth": f"{_V100_SHEET}: 900 GB/s",
             "sm_count": f"NVIDIA Tesla V100 GPU Architecture whitepaper (2017): 80 SMs; {_TILE_NOTE}",
             "attention_efficiency": "assumption: FlashAttention-2 needs Ampere or newer, so PyTorch's fused "
                                     "attention on Volta is the memory-efficient kernel; 0.35 of fp16 peak taken",
             "matmul_efficiency": _EFF_NOTE.format(pct="~65-75% (fp16 tensor cores)"),
             "memory_efficiency": _MEM_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

_A10G_SHEET = ("NVIDIA A10G as specified for Amazon EC2 G5 instances (AWS, 2021; no public NVIDIA datasheet), "
               "figures as tabulated in Baseten, 'NVIDIA A10 vs A10G for ML model inference' (2023)")
A10G_24GB = DeviceSpec(
    name="a10g-24gb",
    # GA102 variant made for AWS: tensor rate with fp32 accumulation is half the A10's (125 TF).
    peak_flops={"fp32": 35e12, "tf32": 35e12, "bf16": 70e12, "fp16": 70e12},
    memory_bytes=24e9, memory_bandwidth=600e9,
    matmul_efficiency=0.70, memory_efficiency=0.80, kernel_overhead_s=3e-6,
    sm_count=80, attention_efficiency=0.50,
    sources={"peak_flops.fp32": f"{_A10G_SHEET}: FP32 35 TFLOPS",
             "peak_flops.tf32": f"{_A10G_SHEET}: TF32 Tensor Core 35 TFLOPS (dense)",
             "peak_flops.bf16": f"{_A10G_SHEET}: BF16 Tensor Core 70 TFLOPS (dense)",
             "peak_flops.fp16": f"{_A10G_SHEET}: FP16 Tensor Core 70 TFLOPS (dense)",
             "absent.fp8": "A10G (Ampere GA102) has no fp8 tensor cores",
             "memory_bytes": f"{_A10G_SHEET}: 24 GB GDDR6",
             "memory_bandwidth": f"{_A10G_SHEET}: 600 GB/s",
             "sm_count": f"80 SMs (10,240 CUDA cores / 128 per SM), the {_RUNTIME_SMS}; {_TILE_NOTE}",
             "attention_efficiency": "assumption: FlashAttention-2 on Ampere reaches 50-73 % of peak forward "
                                     "(Dao, arXiv:2307.08691, 2023, on A100), less in backward; 0.50 taken",
             "matmul_efficiency": _EFF_NOTE.format(pct="~65-75%"),
             "memory_efficiency": _GDDR_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

_L4_SHEET = "NVIDIA L4 Tensor Core GPU datasheet (2023)"
L4_24GB = DeviceSpec(
    name="l4-24gb",
    peak_flops={"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12},
    memory_bytes=24e9, memory_bandwidth=300e9,
    matmul_efficiency=0.55, memory_efficiency=0.80, kernel_overhead_s=3e-6,
    sm_count=58, attention_efficiency=0.45,
    sources={"peak_flops.fp32": f"{_L4_SHEET}: FP32 30.3 TFLOPS",
             "peak_flops.tf32": _sparse_half(_L4_SHEET, "TF32 Tensor Core", "120 TFLOPS"),
             "peak_flops.bf16": _sparse_half(_L4_SHEET, "BFLOAT16 Tensor Core", "242 TFLOPS"),
             "peak_flops.fp16": _sparse_half(_L4_SHEET, "FP16 Tensor Core", "242 TFLOPS"),
             "peak_flops.fp8": _sparse_half(_L4_SHEET, "FP8 Tensor Core", "485 TFLOPS"),
             "memory_bytes": f"{_L4_SHEET}: 24 GB GDDR6",
             "memory_bandwidth": f"{_L4_SHEET}: 300 GB/s",
             "sm_count": f"58 SMs (7,424 CUDA cores / 128 per SM), the {_RUNTIME_SMS}; {_TILE_NOTE}",
             "attention_efficiency": "assumption: 0.45 of peak for PyTorch's fused attention, below "
                                     "matmul_efficiency as on the A100 and H100 entries",
             "matmul_efficiency": _EFF_NOTE.format(pct="~50-60% (72 W board power caps the clocks)"),
             "memory_efficiency": _GDDR_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

_L40S_SHEET = "NVIDIA L40S GPU datasheet (2023), dense column (the sparse one is twice it)"
L40S_48GB = DeviceSpec(
    name="l40s-48gb",
    peak_flops={"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12},
    memory_bytes=48e9, memory_bandwidth=864e9,
    matmul_efficiency=0.60, memory_efficiency=0.80, kernel_overhead_s=3e-6,
    sm_count=142, attention_efficiency=0.45,
    sources={"peak_flops.fp32": f"{_L40S_SHEET}: FP32 91.6 TFLOPS",
             "peak_flops.tf32": f"{_L40S_SHEET}: TF32 Tensor Core 183 TFLOPS",
             "peak_flops.bf16": f"{_L40S_SHEET}: BFLOAT16 Tensor Core 362.05 TFLOPS",
             "peak_flops.fp16": f"{_L40S_SHEET}: FP16 Tensor Core 362.05 TFLOPS",
             "peak_flops.fp8": f"{_L40S_SHEET}: FP8 Tensor Core 733 TFLOPS",
             "memory_bytes": f"{_L40S_SHEET}: 48 GB GDDR6 with ECC",
             "memory_bandwidth": f"{_L40S_SHEET}: 864 GB/s",
             "sm_count": f"{_L40S_SHEET}: 18,176 CUDA cores = 142 SMs of 128 (142 RT cores, one per SM); "
                         f"{_TILE_NOTE}",
             "attention_efficiency": "assumption: 0.45 of peak for PyTorch's fused attention, below "
                                     "matmul_efficiency as on the A100 and H100 entries",
             "matmul_efficiency": _EFF_NOTE.format(pct="~55-65% (350 W board power caps the clocks)"),
             "memory_efficiency": _GDDR_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column"
_H200_MEASURED = ("measured by `autopar calibrate` on one H200 SXM (torch 2.11.0+cu130, 2026-11-27; "
                  "cost/profiles/h200-sxm-141gb.measured.json)")
H200_SXM_141GB = DeviceSpec(
    name="h200-sxm-141gb",
    # Same GH100 compute as H100 SXM; the datasheet's tensor figures assume 2:4 sparsity.
    peak_flops={"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                "fp8": 1978.9e12},
    memory_bytes=141e9, memory_bandwidth=4.8e12,
    matmul_efficiency=0.79, memory_efficiency=0.86, kernel_overhead_s=3e-6,
    sm_count=132, attention_efficiency=0.40,
    sources={"peak_flops.fp32": f"{_H200_SHEET}: FP32 67 TFLOPS (non-tensor)",
             "peak_flops.tf32": _sparse_half(_H200_SHEET, "TF32 Tensor Core", "989 TFLOPS"),
             "peak_flops.bf16": _sparse_half(_H200_SHEET, "BFLOAT16 Tensor Core", "1,979 TFLOPS"),
             "peak_flops.fp16": _sparse_half(_H200_SHEET, "FP16 Tensor Core", "1,979 TFLOPS"),
             "peak_flops.fp8": _sparse_half(_H200_SHEET, "FP8 Tensor Core", "3,958 TFLOPS"),
             "memory_bytes": f"{_H200_SHEET}: 141 GB HBM3e",
             "memory_bandwidth": f"{_H200_SHEET}: 4.8 TB/s",
             "sm_count": f"NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs on the "
                         f"SXM5 part, which the H200 shares; {_TILE_NOTE}",
             "attention_efficiency": "assumption: as for H100 SXM (same compute die): FlashAttention-2 "
                                     "reaches about 35 % of peak (Shah et al., arXiv:2407.08608, 2024); 0.40 taken. "
                                     f"{_H200_MEASURED}: causal bf16 [4, 16, 4096, 128] forward + backward 855.6 "
                                     "TFLOP/s counting every query-key pair, 427.8 counting the pairs a causal "
                                     "kernel computes (as the flop pass counts them now) = 43.2 % of peak",
             "matmul_efficiency": f"{_H200_MEASURED}: best bf16 GEMM 785.3 TFLOP/s at n=8192 (727.0 at 4096, "
                                  "416.6 at 2048) = 79.4 % of dense peak; fp16 754.0 (76.2 %)",
             "memory_efficiency": f"{_H200_MEASURED}: device copy 4,147 GB/s (read + write) = 86.4 % of 4.8 TB/s",
             "kernel_overhead_s": _LAUNCH_NOTE + f"; {_H200_MEASURED} timed 7.2 us per eager one-element add "
                                  "(Python dispatch included)"})

_B200_SHEET = ("NVIDIA DGX B200 / HGX B200 datasheets (2024): 8-GPU totals / 8, tensor figures "
               "with sparsity / 2 (dense)")
B200_180GB = DeviceSpec(
    name="b200-180gb",
    peak_flops={"fp32": 75e12, "tf32": 1.125e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    memory_bytes=180e9, memory_bandwidth=8e12,
    matmul_efficiency=0.60, memory_efficiency=0.85, kernel_overhead_s=3e-6,
    sm_count=148, attention_efficiency=0.40,
    sources={"peak_flops.fp32": f"{_B200_SHEET}: FP32 600 TFLOPS per 8 GPUs (non-tensor)",
             "peak_flops.tf32": f"{_B200_SHEET}: TF32 Tensor Core 18 PFLOPS per 8 GPUs",
             "peak_flops.bf16": f"{_B200_SHEET}: FP16/BF16 Tensor Core 36 PFLOPS per 8 GPUs",
             "peak_flops.fp16": f"{_B200_SHEET}: FP16/BF16 Tensor Core 36 PFLOPS per 8 GPUs",
             "peak_flops.fp8": f"{_B200_SHEET}: FP8 Tensor Core 72 PFLOPS per 8 GPUs",
             "memory_bytes": f"{_B200_SHEET}: 1,440 GB HBM3e per 8 GPUs (180 GB each as exposed)",
             "memory_bandwidth": f"{_B200_SHEET}: 64 TB/s per 8 GPUs",
             "sm_count": f"148 SMs, the {_RUNTIME_SMS}; {_TILE_NOTE}",
             "attention_efficiency": "assumption: 0.40 of peak for PyTorch's fused attention, as on H100",
             "matmul_efficiency": _EFF_NOTE.format(pct="~55-65% (younger kernels than Hopper's)"),
             "memory_efficiency": _MEM_NOTE, "kernel_overhead_s": _LAUNCH_NOTE})

_MI300X_SHEET = "AMD Instinct MI300X accelerator data sheet (2023), dense figures"
MI300X_192GB = DeviceSpec(
    name="mi300x-192gb",
    # fp32: the MATRIX fp32 rate, which rocBLAS/hipBLASLt fp32 GEMMs use (vector fp32: 81.7 TF).
    peak_flops={"fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12,
                "fp8": 2614.9e12},
    memory_bytes=192e9, memory_bandwidth=5.3e12,
    matmul_efficiency=0.50, memory_efficiency=0.85, kernel_overhead_s=5e-6,
    sm_count=304, attention_efficiency=0.30,
    sources={"peak_flops.fp32": f"{_MI300X_SHEET}: peak FP32 matrix 163.4 TFLOPS (vector 81.7)",
             "peak_flops.tf32": f"{_MI300X_SHEET}: peak TF32 matrix 653.7 TFLOPS",
             "peak_flops.bf16": f"{_MI300X_SHEET}: peak BF16 1,307.4 TFLOPS",
             "peak_flops.fp16": f"{_MI300X_SHEET}: peak FP16 1,307.4 TFLOPS",
             "peak_flops.fp8": f"{_MI300X_SHEET}: peak FP8 2,614.9 TFLOPS",
             "memory_bytes": f"{_MI300X_SHEET}: 192 GB HBM3",
             "memory_bandwidth": f"{_MI300X_SHEET}: 5.3 TB/s peak",
             "sm_count": f"{_MI300X_SHEET}: 304 compute units, counted as SMs for tile/wave quantization",
             "attention_efficiency": "assumption: 0.30 of peak for PyTorch's fused attention on ROCm",
             "matmul_efficiency": ("assumption, not in any datasheet: large bf16 GEMMs in hipBLASLt reach "
                                   "~45-55% of dense peak; `autopar calibrate` measures it"),
             "memory_efficiency": _MEM_NOTE,
             "kernel_overhead_s": "assumption: ~5 us minimum per HIP kernel (launch + tail); calibrate to refine"})

_CPU_NOTE = ("estimate for a small multi-core x86 host, not measured: run `autopar calibrate "
             "--out profile.json` and pass that file as the hardware to replace it")
CPU_DEFAULT = DeviceSpec(
    name="cpu",
    peak_flops={"fp32": 100e9, "bf16": 50e9, "fp16": 20e9},
    memory_bytes=16e9, memory_bandwidth=20e9,
    matmul_efficiency=0.5, memory_efficiency=0.7, kernel_overhead_s=5e-6,
    # no device context or communicator buffers to speak of; gloo's threads share the cores, and
    # torch's split backward measured 35 % over a whole one here (bench/pp.py: 135 ms vs 101 ms)
    reserve_bytes=0.0, comm_buffer_bytes=0.0, fragmentation=0.0, comm_contention=0.0, zb_split_overhead=0.35,
    sources={**{key: _CPU_NOTE for key in ("peak_flops.fp32", "peak_flops.bf16", "peak_flops.fp16",
                                           "memory_bytes", "memory_bandwidth", "matmul_efficiency",
                                           "memory_efficiency", "kernel_overhead_s")},
             "reserve_bytes": "none counted on a CPU host", "comm_buffer_bytes": "none counted on a CPU host",
             "fragmentation": "none counted on a CPU host",
             "comm_contention": "not modelled on a CPU host (gloo's threads share the cores)",
             "zb_split_overhead": "measured on this project's 2-core CPU: bench/pp.py, 135 ms vs 101 ms per "
                                  "1F1B-sized step"})

BUILTIN_DEVICES: Mapping[str, DeviceSpec] = MappingProxyType(
    {spec.name: spec for spec in (A100_SXM_80GB, H100_SXM_80GB, V100_SXM2_32GB, A10G_24GB, L4_24GB,
                                  L40S_48GB, H200_SXM_141GB, B200_180GB, MI300X_192GB, CPU_DEFAULT)})
ALIASES: Mapping[str, str] = MappingProxyType({
    "a100": "a100-sxm-80gb", "a100-80gb": "a100-sxm-80gb",
    "h100": "h100-sxm-80gb", "h100-80gb": "h100-sxm-80gb",
    "v100": "v100-sxm2-32gb", "v100-32gb": "v100-sxm2-32gb",
    "a10g": "a10g-24gb", "l4": "l4-24gb", "l40s": "l40s-48gb",
    "h200": "h200-sxm-141gb", "h200-141gb": "h200-sxm-141gb",
    "b200": "b200-180gb", "mi300x": "mi300x-192gb"})
# The short names, in the order the CLI's help lists them.
SHORT_NAMES: tuple[str, ...] = ("v100", "a10g", "l4", "l40s", "a100", "h100", "h200", "b200", "mi300x", "cpu")


# --- calibrated profiles ----------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """Measured alpha-beta figures of one communication backend (e.g. gloo, nccl).

    ``alpha_s`` is the latency per ring step and ``bandwidth`` the bus bandwidth (bytes/s) in
    the sense of :mod:`autopar.cost.comm`; ``collectives`` keeps the per-collective fits.
    ``base_latency_s``: the fixed cost per call, separated from ``alpha_s`` when the all-reduce
    was timed at two group sizes (``by_group_size`` keeps each size's fits); 0 when only one
    size was timed (the whole intercept then goes to the ring steps).
    """

    backend: str
    world_size: int
    alpha_s: float
    bandwidth: float
    collectives: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    base_latency_s: float = 0.0
    by_group_size: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        where = f"link profile {self.backend!r}"
        _positive(self.bandwidth, "bandwidth", where)
        if self.alpha_s < 0 or self.world_size < 2 or self.base_latency_s < 0:
            raise ConfigError("bad link profile", where=where,
                              expected="alpha_s >= 0, base_latency_s >= 0 and world_size >= 2",
                              got=f"alpha_s={self.alpha_s!r}, base_latency_s={self.base_latency_s!r}, "
                                  f"world_size={self.world_size!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "world_size": self.world_size, "alpha_s": self.alpha_s,
                "bandwidth": self.bandwidth, "collectives": dict(self.collectives),
                "base_latency_s": self.base_latency_s, "by_group_size": dict(self.by_group_size)}


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What ``autopar calibrate`` writes: a device, measured links, raw measurements, notes."""

    device: DeviceSpec
    links: Mapping[str, LinkProfile] = field(default_factory=dict, hash=False)
    measurements: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        object.__setattr__(self, "notes", tuple(self.notes))

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                "device": self.device.to_dict(),
                "links": {name: link.to_dict() for name, link in self.links.items()},
                "measurements": dict(self.measurements), "notes": list(self.notes)}

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON and return its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *,
                  where: str = "hardware profile") -> HardwareProfile:
        """Build a profile from :meth:`to_dict` output, with a ConfigError on a bad layout."""
        if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
            raise ConfigError("not an autopar hardware profile", where=where,
                              expected=f"format {PROFILE_FORMAT!r} version {PROFILE_VERSION}",
                              got=f"format {data.get('format')!r} version {data.get('version')!r}",
                              fix="regenerate it with `autopar calibrate --out FILE`")
        try:
            raw_links = dict(data.get("links", {}))
            links = {name: LinkProfile(**entry) for name, entry in raw_links.items()}
            device = DeviceSpec.from_dict(data["device"], where=where)
        except (KeyError, TypeError) as exc:
            raise ConfigError("hardware profile has a malformed device or link entry", where=where,
                              got=f"{type(exc).__name__}: {exc}",
                              fix="regenerate it with `autopar calibrate --out FILE`") from None
        return cls(device=device, links=links,
                   measurements=dict(data.get("measurements", {})),
                   notes=tuple(data.get("notes", ())))


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a JSON profile written by ``autopar calibrate``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hardware profile {str(path)!r} does not exist", where=str(path),
                          fix="check the path, or run `autopar calibrate --out FILE`") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"hardware profile {str(path)!r} is not valid JSON", where=str(path),
                          got=str(exc), fix="regenerate it with `autopar calibrate`") from None
    if not isinstance(data, dict):
        raise ConfigError("hardware profile must be a JSON object", where=str(path),
                          got=type(data).__name__)
    return HardwareProfile.from_dict(data, where=str(path))


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).is_file()


def load_hardware(name_or_path: str | Path | DeviceSpec) -> DeviceSpec:
    """A DeviceSpec from a built-in name (``a100``, ``h100-sxm-80gb``, ``cpu``, ...) or a
    path to a JSON profile written by ``autopar calibrate``. A DeviceSpec passes through."""
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    if isinstance(name_or_path, Path) or _looks_like_path(str(name_or_path)):
        return load_profile(name_or_path).device
    key = str(name_or_path).strip().lower()
    key = ALIASES.get(key, key)
    if key in BUILTIN_DEVICES:
        return BUILTIN_DEVICES[key]
    choices = sorted({*BUILTIN_DEVICES, *ALIASES})
    raise ConfigError(f"unknown hardware {str(name_or_path)!r}", where="hardware",
                      expected=f"one of {', '.join(choices)}, or a path to a .json profile",
                      got=repr(str(name_or_path)),
                      fix="pick a built-in name or run `autopar calibrate --out FILE`")
