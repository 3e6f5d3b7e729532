"""What the benchmarks share: the common flags, ``--set`` overrides, the machine line and
one timed training step."""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch


def base_parser(doc: str, world_help: str = "world sizes (default 2 4)") -> argparse.ArgumentParser:
    """A parser with ``--world``, ``--steps`` and ``--warmup``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help=world_help)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant (default 2)")
    return ap


def overrides(items: list[str] | None, base: dict) -> dict:
    """``base`` with ``--set key=value`` items applied."""
    out = dict(base)
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes key=value, got {item!r}")
        out[key] = value
    return out


def machine_line() -> str:
    return (f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"gloo, 1 thread per rank")


def timed_step(module, opt, args: tuple, measure=None) -> tuple[list[float], float]:
    """One training step: ([forward, backward, optimizer, process CPU] seconds, loss). The CPU
    time counts every thread of the rank (gloo's included). Ranks are aligned by a barrier
    first. ``measure(module, opt)`` runs between opt.step() and zero_grad."""
    import torch.distributed as dist
    dist.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss = module(*args).logsumexp(-1).mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    if measure is not None:
        measure(module, opt)
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0], float(loss.detach())


def local_attn_forward(self, x: torch.Tensor) -> torch.Tensor:
    """GPTAttention.forward for torch's tensor parallelism: the local head count in the view,
    (b, s, -1) at the end (the zoo's forward reshapes to the whole hidden size)."""
    b, s, _ = x.shape
    q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))
