"""GPU smoke run: every parallelism that runs at world size 1, on the machine's GPU, beside the
planner's prediction for the same model and batch on that GPU.

    python bench/gpu_smoke.py                 # on a GPU machine: NCCL, one rank
    python bench/gpu_smoke.py --out smoke/    # also writes smoke/profile.json (autopar calibrate)

At world size 1 (NCCL on a GPU, gloo on a CPU) it builds a GPT with ``autopar.parallelize``
under each case below, trains ``--steps`` AdamW steps and, beside the same model trained
without autopar, reports the largest loss difference, the median step time, model TFLOP/s and
MFU against the device's peak for the compute dtype, and the simulator's predicted step time
and MFU for that configuration (``cost/hybrid.py`` on one device of the matching built-in
profile). Cases: a data axis of one at ZeRO 0-3 in fp32, bf16 and fp16 (with dynamic loss
scaling), full and selective recomputation, a mixture-of-experts model on an expert axis
of one, a tensor axis and a pipeline axis of one, and ``torch.compile`` (inductor) on the data
and tensor axes. Then ``autopar calibrate`` measures the device and writes a hardware profile.

Without a GPU it runs the same cases on the CPU with a small model (so the harness cannot rot)
and says which parts it skipped: the CUDA timings, MFU against a GPU datasheet, and the GPU
calibration. Nothing here is part of the test suite.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import autopar
from autopar import models

# torch.cuda.get_device_name() substrings -> the built-in profile that prices that GPU
GPU_PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"), ("L40S", "l40s"),
                ("L4", "l4"), ("A10G", "a10g"), ("V100", "v100"), ("MI300X", "mi300x"))
GPU_MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000, "max_seq": 1024}
CPU_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "max_seq": 64}


def cases(gpu: bool) -> list[dict]:
    precisions = (None, "bf16", "fp16")
    out = [{"zero_stage": z, "mixed_precision": p} for z in (0, 1, 2, 3) for p in precisions]
    out += [{"zero_stage": 0, "mixed_precision": "bf16" if gpu else None, "recompute": r} for r in ("full", "selective")]
    out.append({"zero_stage": 0, "mixed_precision": "bf16" if gpu else None, "moe": True})
    half = "bf16" if gpu else None
    out += [{"zero_stage": 0, "mixed_precision": half, "mesh": {"tp": 1}},
            {"zero_stage": 0, "mixed_precision": half, "mesh": {"pp": 1}},
            {"zero_stage": 0, "mixed_precision": half, "compile": True},
            {"zero_stage": 3, "mixed_precision": half, "compile": True},
            {"zero_stage": 0, "mixed_precision": half, "mesh": {"tp": 1}, "compile": True}]
    return out


def profile_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return next((p for key, p in GPU_PROFILES if key in name), "h100")


def predicted(name: str, over: dict, case: dict, batch: int, seq: int, hardware: str):
    """The simulator's Score for this case on one device of ``hardware`` (None if it cannot)."""
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import Config, ModelFacts, simulate
    from autopar.cli.workload import capture_for_planning, load_workload
    dtype = case.get("mixed_precision") or "fp32"
    try:
        w = load_workload(name, batch=batch, seq=seq, overrides={k: str(v) for k, v in over.items()})
        planned = capture_for_planning(w)
        facts = ModelFacts(planned.gm, seq=seq, dtype=dtype, layers=planned.block_copies)
        c = Config(dp=1, tp=1, pp=1, micro_batch=batch, zero_stage=case["zero_stage"],
                   recompute=case.get("recompute", "none"))
        return simulate(facts, Cluster.from_spec("1x1", hardware=hardware), c, batch=batch)
    except autopar.AutoparError as exc:
        print(f"  (no prediction: {exc.what if hasattr(exc, 'what') else exc})", flush=True)
        return None


def run_case(case: dict, device: torch.device, args) -> dict:
    name = "moe" if case.get("moe") else "gpt"
    over = dict(GPU_MODEL if device.type == "cuda" else CPU_MODEL)
    if name == "moe":
        over.update(experts=4, top_k=2, capacity_factor=4.0)
    torch.manual_seed(0)
    model = models.build(name, over, device="cpu").to(device)
    ref = copy.deepcopy(model)
    batch, seq = args.batch, args.seq
    x = torch.randint(0, over["vocab"], (batch, seq), device=device)
    y = torch.randint(0, over["vocab"], (batch, seq), device=device)
    loss_fn = torch.nn.functional.cross_entropy
    mesh = {"ep": 1} if case.get("moe") else case.get("mesh", {"dp": 1})
    pipe = "pp" in mesh
    flat_loss = lambda logits, t: loss_fn(logits.float().flatten(0, 1), t.flatten())  # noqa: E731
    extra = {"options": autopar.PipelineOptions(loss_fn=flat_loss)} if pipe else {}
    pm = autopar.parallelize(model, mesh, (x,), zero_stage=case["zero_stage"], compile=case.get("compile", False),
                             mixed_precision=case.get("mixed_precision"), recompute=case.get("recompute", "none"),
                             **extra)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    times, worst = [], 0.0
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if pipe:
            loss = pm.step(x, target=y)          # the schedule runs forward and backward
        else:
            loss = flat_loss(pm(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        want = loss_fn(ref(x).flatten(0, 1), y.flatten())
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - want.item()) / abs(want.item()))
    step = statistics.median(times[2:] if len(times) > 2 else times)   # compiled: first steps compile
    hw = profile_name(device)
    score = predicted(name, over, case, batch, seq, hw)
    out = {"case": _label(case), "loss_diff": worst, "step_s": step, "pred_s": None, "tflops": None, "mfu": None,
           "pred_mfu": None, "skipped": getattr(getattr(opt, "scaler", None), "skipped", 0)}
    if score is not None:
        from autopar.cost.hardware import load_hardware
        tflops = score.model_flops / step / 1e12
        out.update(pred_s=score.step_time_s, tflops=tflops, pred_mfu=score.mfu,
                   mfu=tflops * 1e12 / load_hardware(hw).peak(case.get("mixed_precision") or "fp32"))
    return out


def _label(case: dict) -> str:
    axis = "moe ep=1" if case.get("moe") else ",".join(f"{k}={v}" for k, v in case.get("mesh", {"dp": 1}).items())
    return (axis + f" ZeRO-{case['zero_stage']} " + (case.get("mixed_precision") or "fp32")
            + (f" recompute {case['recompute']}" if "recompute" in case else "")
            + (" compiled" if case.get("compile") else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=None, help="default 8 on a GPU, 4 on a CPU")
    ap.add_argument("--seq", type=int, default=None, help="default 1024 on a GPU, 32 on a CPU")
    ap.add_argument("--only", help="run only the cases whose label contains this text (e.g. 'pp=1')")
    ap.add_argument("--out", help="a directory for the calibrated profile (profile.json)")
    args = ap.parse_args()
    autopar.init_distributed()           # nccl and cuda:LOCAL_RANK with a GPU, gloo without; world size 1
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    args.batch = args.batch or (8 if gpu else 4)
    args.seq = args.seq or (1024 if gpu else 32)
    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    print(f"gpu_smoke on {where} ({'nccl' if gpu else 'gloo'}, world 1), priced as {profile_name(device)}; "
          f"batch {args.batch} x seq {args.seq}, {args.steps} AdamW steps per case", flush=True)
    if not gpu:
        print("no GPU: CPU mode with a small model; skipped: CUDA timings, MFU against a GPU datasheet, GPU "
              "calibration", flush=True)
    rows = []
    for case in cases(gpu):
        if args.only and args.only not in _label(case):
            continue
        try:
            rows.append(run_case(case, device, args))
        except Exception as exc:          # noqa: BLE001 - a smoke run reports every case, then fails
            rows.append({"case": _label(case), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
        print(_row(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "autopar", "calibrate", "--device", "cuda" if gpu else "cpu",
               "--out", os.path.join(args.out, "profile.json")] + ([] if gpu else ["--quick"])
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"calibrate: exit {done.returncode}, {os.path.join(args.out, 'profile.json')}"
              + ("" if done.returncode == 0 else f": {done.stderr.strip().splitlines()[-1:]}"), flush=True)
        if done.returncode == 0:
            _efficiencies(os.path.join(args.out, "profile.json"), profile_name(device))
    bad = [r for r in rows if "error" in r or r["loss_diff"] > (5e-2 if "16" in r["case"] else 1e-4)]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases ran and matched the plain model")
    return 1 if bad else 0


def _efficiencies(path: str, hw: str) -> None:
    """The calibrated rates as fractions of the datasheet figures the built-in profile ``hw``
    cites, beside the efficiencies that profile assumes."""
    import json

    from autopar.cost.hardware import load_hardware
    spec, m = load_hardware(hw), json.loads(Path(path).read_text())["measurements"]
    for dtype, rates in sorted(m["matmul_flops_per_s"].items()):
        try:
            peak = spec.peak(dtype)
        except autopar.AutoparError:
            continue
        sizes = "  ".join(f"n={n}: {r / 1e12:.1f}" for n, r in rates.items())
        print(f"  matmul {dtype:<5} TFLOP/s {sizes}  best {max(rates.values()) / peak:.1%} of {spec.name} peak "
              f"(profile assumes {spec.matmul_efficiency:.0%})", flush=True)
    for dtype, rate in sorted(m["attention_flops_per_s"].items()):
        print(f"  attention {dtype:<5} {rate / 1e12:.1f} TFLOP/s = {rate / spec.peak(dtype):.1%} of peak "
              f"(profile assumes {spec.attention_efficiency:.0%})", flush=True)
    bw = m["copy_bandwidth"]
    print(f"  copy bandwidth {bw / 1e9:.0f} GB/s = {bw / spec.memory_bandwidth:.1%} of the datasheet's "
          f"(profile assumes {spec.memory_efficiency:.0%}); kernel overhead {m['kernel_overhead_s'] * 1e6:.1f} us "
          f"(profile {spec.kernel_overhead_s * 1e6:.1f} us)", flush=True)


def _row(r: dict) -> str:
    if "error" in r:
        return f"  {r['case']:<34} ERROR {r['error']}"
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (f"  {r['case']:<34} loss diff {r['loss_diff']:.1e}  step {r['step_s'] * 1e3:8.2f} ms  "
            f"pred {num(r['pred_s'] and r['pred_s'] * 1e3, '8.2f')} ms  TFLOP/s {num(r['tflops'], '.3g')}  "
            f"MFU {num(r['mfu'] and 100 * r['mfu'], '.1f')}% (pred {num(r['pred_mfu'] and 100 * r['pred_mfu'], '.1f')}%)"
            + (f"  fp16 skipped {r['skipped']}" if r.get("skipped") else ""))


if __name__ == "__main__":
    sys.exit(main())
