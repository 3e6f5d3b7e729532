"""``autopar calibrate``: measure this machine and write a hardware profile.

Measures, on the machine it runs on:

- matmul throughput (fp32, bf16, fp16 where they run) over a few square sizes, best of
  several timed runs after warm-up (CUDA is synchronized around each timing);
- causal attention (``scaled_dot_product_attention``) forward + backward throughput, which
  becomes the profile's ``attention_efficiency``; on a GPU its SM count (the GEMM model's
  wave quantization, :func:`autopar.cost.compute.gemm_efficiency`);
- memory bandwidth from a large device-to-device copy (counted as read + write);
- per-kernel overhead from a stream of tiny in-place adds;
- zero-bubble's split backward against one whole backward on a two-layer block
  (``zb_split_overhead``), and on a GPU the bytes the process holds beside its tensors
  (``reserve_bytes``: CUDA context and library workspaces);
- collective latency and bandwidth of all_reduce, all_gather, reduce_scatter and all_to_all at
  group size 2, and (a full run) at 4 and on a GPU machine 8 where it has the devices: gloo on
  CPU always, NCCL when at least 2 CUDA devices exist; two sizes separate the fixed cost per
  call from the cost per ring step. Ranks are
  started from a forkserver with torch preloaded and meet on 127.0.0.1 at a free port.
  Per collective, ``time = a + b * bytes`` is fitted by least squares (relative error) and
  inverted through :func:`autopar.cost.comm.ring_coefficients` into a per-step latency alpha
  and a bus bandwidth, the quantities :mod:`autopar.cost.comm` uses.

The JSON profile it writes loads with :func:`autopar.cost.hardware.load_hardware` and
``Cluster.from_spec("1xN", hardware=PATH)``. Bytes follow :mod:`autopar.cost.comm`.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Callable, Sequence

import torch

from autopar.cost.comm import ring_coefficients
from autopar.cost.hardware import (BUILTIN_DEVICES, DeviceSpec, HardwareProfile, LinkProfile,
                                   canonical_dtype)
from autopar.core.errors import ConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _log(message: str) -> None:
    print(f"[autopar calibrate] {message}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
              repeats: int = 5, inner: int = 1) -> float:
    """Best (minimum) seconds per call of ``fn`` over ``repeats`` timings of ``inner`` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def measure_matmul(device: torch.device, dtype: str, sizes: Sequence[int],
                   repeats: int) -> dict[str, float] | None:
    """Best FLOP/s of square matmuls per size (``{"512": flops_per_s}``); None if unsupported.

    Stops growing the size once one product takes longer than 0.3 s (slow CPU dtypes).
    """
    results: dict[str, float] = {}
    for size in sizes:
        try:
            a = torch.randn(size, size, device=device).to(_DTYPES[dtype])
            b = torch.randn(size, size, device=device).to(_DTYPES[dtype])
            seconds = best_time(lambda: torch.mm(a, b), device, warmup=1, repeats=repeats)
        except (RuntimeError, TypeError) as exc:  # dtype not implemented on this device
            _log(f"matmul {dtype}: skipped ({str(exc).splitlines()[0][:80]})")
            return None
        results[str(size)] = 2.0 * size**3 / seconds
        _log(f"matmul {dtype} {size}x{size}: {results[str(size)] / 1e9:.1f} GFLOP/s")
        if seconds > 0.3:
            break
    return results


def measure_attention(device: torch.device, dtype: str, shape: Sequence[int], repeats: int) -> float | None:
    """FLOP/s of causal ``scaled_dot_product_attention`` forward plus backward on ``[b, heads,
    s, d]`` tensors, counted as the flop pass counts it (forward 4·b·heads·d per query-key pair
    at or below the diagonal, s(s+1)/2 of them; backward twice that); None if it does not run."""
    b, h, n, d = shape
    try:
        q, k, v = (torch.randn(b, h, n, d, device=device).to(_DTYPES[dtype]).requires_grad_() for _ in range(3))
        grad = torch.randn(b, h, n, d, device=device).to(_DTYPES[dtype])

        def step() -> None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        seconds = best_time(step, device, warmup=1, repeats=repeats)
    except (RuntimeError, TypeError) as exc:
        _log(f"attention {dtype}: skipped ({str(exc).splitlines()[0][:80]})")
        return None
    rate = 3 * 4.0 * b * h * (n * (n + 1) / 2) * d / seconds
    _log(f"attention {dtype} [{b}, {h}, {n}, {d}] forward + backward: {rate / 1e9:.1f} GFLOP/s")
    return rate


def measure_memory(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), device, warmup=1, repeats=repeats)
    bandwidth = 2.0 * src.numel() * 4 / seconds
    _log(f"memory copy {nbytes / 2**20:.0f} MiB: {bandwidth / 1e9:.1f} GB/s")
    return bandwidth


def measure_kernel_overhead(device: torch.device, count: int) -> float:
    """Seconds per tiny kernel (a one-element in-place add), launch included."""
    x = torch.zeros(1, device=device)
    overhead = best_time(lambda: x.add_(1.0), device, warmup=10, repeats=3, inner=count)
    _log(f"kernel overhead: {overhead * 1e6:.2f} us")
    return overhead


def measure_split_backward(device: torch.device, width: int, rows: int, repeats: int) -> float:
    """Zero-bubble's split backward over one whole backward (``zb_split_overhead``), on a block of
    two linear layers around a GELU (``rows x width`` activations): the whole backward is one
    ``autograd.grad`` for the input and the weights; the split one, as torch's zero-bubble
    schedules run it, takes the input's gradient first (keeping the graph) and the weights'
    after. Clamped to [0, 1]."""
    x = torch.randn(rows, width, device=device, requires_grad=True)
    w1 = torch.randn(4 * width, width, device=device, requires_grad=True)
    w2 = torch.randn(width, 4 * width, device=device, requires_grad=True)
    grad = torch.randn(rows, width, device=device)

    def forward() -> torch.Tensor:
        return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1)), w2)

    def whole() -> None:
        torch.autograd.grad(forward(), (x, w1, w2), grad)

    def split() -> None:
        out = forward()
        torch.autograd.grad(out, (x,), grad, retain_graph=True)
        torch.autograd.grad(out, (w1, w2), grad)
    fwd = best_time(forward, device, warmup=1, repeats=repeats)
    one, two = (best_time(f, device, warmup=1, repeats=repeats) - fwd for f in (whole, split))
    overhead = min(1.0, max(0.0, two / max(one, 1e-12) - 1))
    _log(f"split backward (zero-bubble) over a whole one: +{100 * overhead:.1f} %")
    return overhead


def measure_reserve(device: torch.device) -> float | None:
    """Bytes a GPU process holds beside its tensors once CUDA, cuBLAS and a matmul ran: the
    device's used memory (``mem_get_info``) less what the caching allocator reserved; None on
    a CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(1024, 1024, device=device)
    torch.mm(a, a)
    _sync(device)
    free, total = torch.cuda.mem_get_info(device)
    reserve = float(total - free - torch.cuda.memory_reserved(device))
    _log(f"process reserve (context, workspaces): {reserve / 1e9:.2f} GB")
    return max(0.0, reserve)


# --- collectives ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _collective_call(kind: str, nbytes: int, device: torch.device,
                     world: int) -> Callable[[], object]:
    import torch.distributed as dist
    numel = max(world, nbytes // 4 // world * world)  # fp32, divisible by the group size
    big = torch.ones(numel, device=device)
    small = torch.ones(numel // world, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(big),
             "all_gather": lambda: gather(big, small),
             "reduce_scatter": lambda: scatter(small, big),
             "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(big), big)}
    return calls[kind]


def _collective_worker(rank: int, world: int, backend: str, port: int, sizes: list[int],
                       repeats: int, queue: Any) -> None:
    """One rank: time every collective at every size; rank 0 reports ``{kind: [[b, s]]}``."""
    import torch.distributed as dist
    try:
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        points: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
        for kind in KINDS:
            for nbytes in sizes:
                call = _collective_call(kind, nbytes, device, world)
                dist.barrier()
                seconds = best_time(call, device, warmup=2, repeats=repeats, inner=3)
                points[kind].append([float(nbytes), seconds])
        dist.barrier()
        if rank == 0:
            queue.put(("ok", points))
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which skips this backend with a note
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def measure_collectives(backend: str, sizes: Sequence[int], repeats: int, *,
                        world: int = 2, timeout_s: float = 120.0) -> dict[str, list[list[float]]]:
    """Run ``world`` ranks of ``backend`` from a torch-preloaded forkserver and collect timings."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_worker,
                         args=(rank, world, backend, port, list(sizes), repeats, queue),
                         daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        status, payload = queue.get(timeout=timeout_s)
    except Exception:
        status, payload = "error", f"no result within {timeout_s:.0f} s"
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    if status != "ok":
        raise RuntimeError(f"{backend} collectives failed: {payload}")
    return payload


def fit_alpha_beta(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Least-squares ``time = a + b * bytes`` minimizing relative error; returns ``(a, b)``.

    Weights are 1/time^2 so the small (latency) and large (bandwidth) sizes count alike.
    ``a`` is clamped at 0; ``b`` falls back to the largest message's time/bytes if <= 0.
    """
    if len(points) < 2:
        raise ValueError("need at least two (bytes, seconds) points to fit")
    w = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    sxy = sum(wi * (x - mx) * (t - my) for wi, (x, t) in zip(w, points))
    slope = sxy / sxx if sxx > 0 else 0.0
    if slope <= 0:
        x_max, t_max = max(points, key=lambda point: point[0])
        return 0.0, t_max / max(x_max, 1.0)
    intercept = my - slope * mx
    if intercept < 0:  # refit through the origin
        num = sum(wi * x * t for wi, (x, t) in zip(w, points))
        slope = num / sum(wi * x * x for wi, (x, _) in zip(w, points))
        intercept = 0.0
    return intercept, slope


def link_fit(kind: str, world: int, points: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Per-step alpha (s) and bus bandwidth (bytes/s) of ``kind`` from its timings."""
    intercept, slope = fit_alpha_beta(points)
    steps, volume = ring_coefficients(kind, world)
    return {"alpha_s": intercept / steps, "bandwidth": volume / slope, "intercept_s": intercept,
            "seconds_per_byte": slope, "points": [list(p) for p in points]}


def _link_profile(backend: str, timed: dict[int, dict[str, list[list[float]]]]) -> LinkProfile:
    """The link figures from timings at group size 2 and any larger sizes: bandwidth from the
    size-2 all-reduce's bus bandwidth (as :mod:`autopar.cost.comm` uses it); with a second
    size, the all-reduce's intercept ``base + 2(n-1) alpha`` at both sizes separates the fixed
    cost per call from the cost per ring step (``split_latency``)."""
    by_size = {n: {kind: link_fit(kind, n, pts) for kind, pts in points.items()} for n, points in timed.items()}
    for n, fits in by_size.items():
        for kind, fit in fits.items():
            _log(f"{backend} {kind} at {n}: alpha {fit['alpha_s'] * 1e6:.1f} us/step, "
                 f"bus bandwidth {fit['bandwidth'] / 1e9:.2f} GB/s")
    main = by_size[2]["all_reduce"]  # the all-reduce busbw is the link figure, as in comm.py
    base, alpha = split_latency({n: fits["all_reduce"]["intercept_s"] for n, fits in by_size.items()})
    if len(by_size) > 1:
        _log(f"{backend}: {base * 1e6:.1f} us per call + {alpha * 1e6:.1f} us per ring step")
    return LinkProfile(backend=backend, world_size=2, alpha_s=alpha, bandwidth=main["bandwidth"],
                       collectives=by_size[2], base_latency_s=base,
                       by_group_size={str(n): fits for n, fits in by_size.items() if n != 2})


def split_latency(intercepts: dict[int, float]) -> tuple[float, float]:
    """``(base, alpha)`` from all-reduce intercepts at group sizes ``n`` (``base + 2(n-1)
    alpha``), least squares over the sizes, both clamped at 0; one size: ``(0, intercept /
    steps)``."""
    if len(intercepts) == 1:
        (n, t), = intercepts.items()
        return 0.0, t / ring_coefficients("all_reduce", n)[0]
    xs = {n: ring_coefficients("all_reduce", n)[0] for n in intercepts}
    mx = sum(xs.values()) / len(xs)
    my = sum(intercepts.values()) / len(xs)
    sxx = sum((x - mx) ** 2 for x in xs.values())
    alpha = max(0.0, sum((xs[n] - mx) * (t - my) for n, t in intercepts.items()) / sxx)
    base = max(0.0, my - alpha * mx)
    return base, alpha


# --- device spec from measurements ------------------------------------------------------------

def _resolve_device(device: str) -> torch.device:
    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(text)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown calibration device {device!r}", where="--device",
                          expected="auto, cpu, cuda or cuda:N", got=repr(device))
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA was asked for but is not available", where="--device",
                          expected="a machine with a CUDA GPU", got=repr(device),
                          fix="use --device cpu or --device auto")
    return resolved


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return BUILTIN_DEVICES["cpu"].memory_bytes


# GPU names as the runtime reports them -> the built-in datasheet profile (first match wins:
# H200 before H100, L40S before L4). PCIe and NVL H100s have other peaks than the SXM sheet.
_SHEETS = (("H200", "h200-sxm-141gb"), ("H100", "h100-sxm-80gb"), ("A100", "a100-sxm-80gb"),
           ("B200", "b200-180gb"), ("L40S", "l40s-48gb"), ("L4", "l4-24gb"), ("A10G", "a10g-24gb"),
           ("V100", "v100-sxm2-32gb"), ("MI300X", "mi300x-192gb"))
_OTHER_PARTS = ("H100 PCIE", "H100-PCIE", "H100 NVL")


def _datasheet_for(device_name: str) -> DeviceSpec | None:
    """The built-in profile whose datasheet describes this GPU, or None (an unknown part)."""
    upper = device_name.upper()
    if any(part in upper for part in _OTHER_PARTS):
        return None
    for marker, key in _SHEETS:
        if marker in upper:
            return BUILTIN_DEVICES[key]
    return None


def build_device_spec(device: torch.device, flops: dict[str, float], bandwidth: float,
                      overhead: float, attention: dict[str, float] | None = None, *,
                      split: float | None = None, reserve: float | None = None) -> DeviceSpec:
    """A DeviceSpec from measurements.

    On a GPU with a built-in datasheet profile (:data:`_SHEETS`) the datasheet peaks stay and the measured rates
    become efficiencies (clamped to 1). Elsewhere the best measured rate *is* the peak and
    the efficiencies are 1: the figures are achievable rates, not datasheet ones. The
    attention rate (``attention``, FLOP/s by dtype) becomes ``attention_efficiency`` against
    the same peak, and a GPU's SM count is read from the runtime. ``split`` (zero-bubble's
    split-backward overhead) and ``reserve`` (a GPU process's bytes beside its tensors) replace
    the profile's estimates where measured; the communicator buffers, allocator slack and
    contention stay the built-in estimates (their sources say so).
    """
    runtime: dict[str, Any] = {}
    measured_note = "measured by autopar calibrate on this machine"
    if split is not None:
        runtime["zb_split_overhead"] = split
    if reserve is not None:
        runtime["reserve_bytes"] = reserve
    runtime_sources = {k: f"{measured_note}" + (": split vs whole backward of a two-layer MLP block"
                                                if k == "zb_split_overhead" else
                                                ": used device memory less the allocator's reserve after a matmul")
                       for k in runtime}
    measured = "measured by autopar calibrate on this machine"
    sm_count = 0
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        memory, sm_count = float(props.total_memory), int(props.multi_processor_count)
    else:
        name, memory = "cpu", _host_memory_bytes()
    sheet = _datasheet_for(name) if device.type == "cuda" else None
    sources = {"memory_bytes": f"{measured} (total reported by the runtime)",
               "kernel_overhead_s": f"{measured} (tiny in-place add)"}
    attention = attention or {}
    if sm_count:
        sources["sm_count"] = f"{measured} (the runtime's multiprocessor count)"
    if sheet is not None:
        key = next(k for k in ("bf16", "fp16", "fp32") if k in flops and k in sheet.peak_flops)   # V100: fp16
        eff = min(1.0, flops[key] / sheet.peak(key))
        mem_eff = min(1.0, bandwidth / sheet.memory_bandwidth)
        sources.update(sheet.sources)
        sources["matmul_efficiency"] = f"{measured}: best {key} matmul / datasheet peak"
        sources["memory_efficiency"] = f"{measured}: copy bandwidth / datasheet peak"
        att = min(1.0, attention[key] / sheet.peak(key)) if key in attention else sheet.attention_efficiency
        if key in attention:
            sources["attention_efficiency"] = f"{measured}: causal {key} attention forward + backward / datasheet peak"
        return DeviceSpec(name=f"{sheet.name} (calibrated)", peak_flops=dict(sheet.peak_flops),
                          memory_bytes=memory, memory_bandwidth=sheet.memory_bandwidth,
                          matmul_efficiency=eff, memory_efficiency=mem_eff,
                          kernel_overhead_s=overhead, sm_count=sm_count or sheet.sm_count,
                          attention_efficiency=att, sources={**sources, **runtime_sources}, **runtime)
    for key in flops:
        sources[f"peak_flops.{key}"] = f"{measured}: best {key} matmul rate (so efficiency 1)"
    sources["memory_bandwidth"] = f"{measured}: copy bandwidth (so efficiency 1)"
    sources["matmul_efficiency"] = sources["memory_efficiency"] = "1.0: peaks are measured rates"
    key = "fp32" if "fp32" in flops else next(iter(flops))
    att = min(1.0, attention[key] / flops[key]) if key in attention else 0.0
    if att:
        sources["attention_efficiency"] = f"{measured}: causal {key} attention forward + backward / best {key} matmul"
    if device.type != "cuda":        # a CPU host: no context or communicator buffers counted, no SM contention
        runtime = {"reserve_bytes": 0.0, "comm_buffer_bytes": 0.0, "fragmentation": 0.0, "comm_contention": 0.0,
                   **runtime}
        runtime_sources = {**{k: "none counted on a CPU host" for k in runtime}, **runtime_sources}
    return DeviceSpec(name=f"{name} (calibrated)", peak_flops=flops, memory_bytes=memory,
                      memory_bandwidth=bandwidth, matmul_efficiency=1.0, memory_efficiency=1.0,
                      kernel_overhead_s=overhead, sm_count=sm_count, attention_efficiency=att,
                      sources={**sources, **runtime_sources}, **runtime)


# --- entry points -----------------------------------------------------------------------------

def _plan(device: torch.device, quick: bool) -> dict[str, Any]:
    gpu = device.type == "cuda"
    if quick:
        return {"matmul_sizes": [1024, 4096] if gpu else [256, 512], "repeats": 3,
                "attention_shape": [2, 16, 1024, 128] if gpu else [1, 4, 128, 32],
                "split_block": [1024, 4096] if gpu else [128, 256],
                "memory_bytes": (256 if gpu else 32) * 2**20, "overhead_count": 200,
                "message_sizes": [2**12, 2**16, 2**20, 2**22], "comm_repeats": 3, "group_sizes": [2]}
    return {"matmul_sizes": [2048, 4096, 8192] if gpu else [512, 1024, 2048], "repeats": 10,
            "attention_shape": [4, 16, 4096, 128] if gpu else [1, 8, 512, 64],
            "split_block": [4096, 8192] if gpu else [256, 1024],
            "memory_bytes": (1024 if gpu else 256) * 2**20, "overhead_count": 2000,
            "message_sizes": [2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26],
            "comm_repeats": 5, "group_sizes": [2, 4, 8] if gpu else [2, 4]}


def _measure_links(device: torch.device, plan: dict[str, Any],
                   notes: list[str]) -> dict[str, LinkProfile]:
    links: dict[str, LinkProfile] = {}
    backends = ["gloo"]
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        backends.append("nccl")
    else:
        notes.append(f"nccl skipped: needs >= 2 CUDA devices, found "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        _log(notes[-1])
    for backend in backends:
        sizes = [n for n in plan["group_sizes"]
                 if backend == "gloo" or n <= torch.cuda.device_count()]
        timed: dict[int, dict[str, list[list[float]]]] = {}
        for n in sizes:
            _log(f"{backend}: timing {', '.join(KINDS)} at group size {n} ...")
            try:
                timed[n] = measure_collectives(backend, plan["message_sizes"], plan["comm_repeats"], world=n)
            except RuntimeError as exc:
                notes.append(f"{backend} at group size {n} skipped: {exc}")
                _log(notes[-1])
        if 2 in timed:
            links[backend] = _link_profile(backend, timed)
    return links


def _warm_up(device: torch.device, size: int, seconds: float = 0.2) -> None:
    """Matmuls until ``seconds`` have passed, untimed: the first products of a process start
    thread pools and allocators, and timed they read as a device several times slower."""
    a = torch.randn(size, size, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)
    _sync(device)


#: dtypes whose matmul rates differ by more than this are reported as suspect
PLAUSIBLE_RATIO = 30.0


def implausible_rates(flops: dict[str, float], quick: bool) -> str | None:
    """A note when one dtype's matmul rate is over :data:`PLAUSIBLE_RATIO` times another's (on an
    H200 bf16 is ~14x fp32 without TF32; more is a timing artefact or a missing fast path)."""
    if len(flops) < 2:
        return None
    fast, slow = max(flops, key=flops.get), min(flops, key=flops.get)
    ratio = flops[fast] / max(flops[slow], 1e-30)
    if ratio <= PLAUSIBLE_RATIO:
        return None
    return (f"matmul {fast} measured {ratio:.0f}x faster than {slow} ({flops[fast] / 1e9:.1f} vs "
            f"{flops[slow] / 1e9:.1f} GFLOP/s), more than a device's dtypes differ: {slow} has no fast path "
            "here, or the timing is noise" + (" (a --quick run's sizes are small: rerun without --quick)" if quick
                                             else "") + "; the planner uses these rates as measured")


def calibrate(device: str = "auto", *, out: str | None = None, quick: bool = False) -> dict:
    """Measure this machine and return (and, with ``out``, write) a hardware profile dict.

    ``device``: ``auto`` (CUDA if present, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
    ``quick``: small sizes and few repeats (well under 20 s on a 2-core CPU).
    """
    started = time.perf_counter()
    target = _resolve_device(device)
    plan = _plan(target, quick)
    _log(f"device {target}, {'quick' if quick else 'full'} run, torch {torch.__version__}")
    flops: dict[str, float] = {}
    matmul: dict[str, dict[str, float]] = {}
    _warm_up(target, max(plan["matmul_sizes"]))
    for dtype in _DTYPES:
        rates = measure_matmul(target, dtype, plan["matmul_sizes"], plan["repeats"])
        if rates:
            matmul[dtype], flops[canonical_dtype(dtype)] = rates, max(rates.values())
    odd = implausible_rates(flops, quick)
    attention: dict[str, float] = {}
    for dtype in ("bf16", "fp32") if target.type == "cuda" else ("fp32",):
        rate = measure_attention(target, dtype, plan["attention_shape"], plan["repeats"])
        if rate:
            attention[canonical_dtype(dtype)] = rate
    bandwidth = measure_memory(target, plan["memory_bytes"], plan["repeats"])
    overhead = measure_kernel_overhead(target, plan["overhead_count"])
    width, rows = plan["split_block"]
    split = measure_split_backward(target, width, rows, plan["repeats"])
    reserve = measure_reserve(target)
    notes: list[str] = [odd] if odd else []
    if odd:
        _log("NOTE: " + odd)
    links = _measure_links(target, plan, notes)
    spec = build_device_spec(target, flops, bandwidth, overhead, attention, split=split, reserve=reserve)
    measurements = {"matmul_flops_per_s": matmul, "attention_flops_per_s": attention, "copy_bandwidth": bandwidth,
                    "kernel_overhead_s": overhead, "split_backward_overhead": split, "reserve_bytes": reserve,
                    "plan": plan, "quick": quick,
                    "torch": torch.__version__, "host": socket.gethostname(),
                    "seconds": round(time.perf_counter() - started, 3)}
    profile = HardwareProfile(device=spec, links=links, measurements=measurements, notes=notes)
    if out is not None:
        path = profile.save(out)
        _log(f"wrote {path} ({measurements['seconds']:.1f} s)")
    return profile.to_dict()
