"""Activation recomputation under ZeRO-3 (runtime/recompute.py with runtime/dp.py) on real gloo ranks.

Cases: dp 2 with ``full`` and with ``selective`` recomputation, and a dp 2 x tp 2 mesh with
``full`` (a memory budget makes the solver split weights on the tensor axis), each in float32
and float64, with small buckets so a layer's parameters come in several gathers. Each rank
trains its parallel copy on its share of the batch for three SGD (momentum) steps next to a
single-process copy trained on the whole batch: the loss of each step and every parameter
after the steps must match, within 1e-5 relative in float32 and 1e-10 in float64.

Each step also checks what recomputation under ZeRO-3 must do:

- backward runs forward ops again (every layer's layer norms under ``full``, its attention
  under ``selective``), counted with a dispatch mode around ``backward()``;
- between forward and backward no whole parameter a gather made is alive (weak references to
  every one), and the checkpointed regions keep only activations: on the dp mesh under
  ``full``, exactly each layer's input (``recompute.HELD``), so a gather placed inside a layer
  does not cut its region;
- backward gathered the parameters again and unpacked every token forward left, once.

One world per mesh size: a mesh must cover the whole process group.
"""
from __future__ import annotations

import collections
import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar import models
from autopar.core.placement import Shard
from autopar.runtime import dp as dp_module
from autopar.runtime import recompute as rc
from autopar.runtime.launch import run_ranks

OVER = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "max_seq": 16}
BATCH, SEQ, STEPS, LR = 4, 8, 3, 0.05
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
CASES = {   # world -> cases: (mesh, recompute mode)
    2: [({"dp": 2}, "full"), ({"dp": 2}, "selective"), ({"dp": 2}, "layers:1"), ({"dp": 2}, "pointwise")],
    4: [({"dp": 2, "tp": 2}, "full"), ({"dp": 2, "tp": 2}, "pointwise")],
}


class _OpCount(TorchDispatchMode):
    """How many times each aten op ran (by name) while active."""

    inside = [0]          # > 0 while a checkpointed region runs (runtime/recompute._run_region)

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        if _OpCount.inside[0]:
            self.seen["region:" + func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _marked(run_region):
    def marked(*args, **kwargs):
        _OpCount.inside[0] += 1
        try:
            return run_region(*args, **kwargs)
        finally:
            _OpCount.inside[0] -= 1
    return marked


def _recomputed(seen: collections.Counter, mode: str, projections: int) -> int:
    """How many layers' forward ops ``mode`` checkpoints ran again during backward: layer norms
    (two a layer) under ``full``, ``pointwise`` and ``layers:K``, less the one the fused
    projections of each norm run to recompute its output (``projections``: runtime/fused.py),
    the attention op under ``selective``."""
    if mode != "selective":
        return (seen["native_layer_norm"] - projections) // 2
    return sum(k for name, k in seen.items() if "scaled_dot_product" in name and "backward" not in name)


def _loss(out: torch.Tensor) -> torch.Tensor:
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(2))
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to ``b``'s scale (0 where both are all zeros)."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def _whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _train(mesh: dict, mode: str, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = models.build("gpt", OVER, device="cpu").to(dtype)
    for fqn, p in model.named_parameters():
        # Attention is invariant to a constant added to every key: the key bias's gradient is
        # exactly zero, and only rounding noise would move it. Frozen (a frozen parameter
        # inside the checkpointed layers, too).
        if fqn.endswith("k_proj.bias"):
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, BATCH, SEQ, device="cpu")
    init = copy.deepcopy(ref.state_dict())
    dp = mesh["dp"]
    local = tuple(a.chunk(dp)[dist.get_rank() // mesh.get("tp", 1)] for a in args)
    budget = 0.75 * 16 * sum(p.numel() for p in model.parameters()) if "tp" in mesh else None  # forces a split
    pm = autopar.parallelize(model, mesh, local, zero_stage=3, recompute=mode, bucket_bytes=2048,
                             memory_budget=budget)
    from autopar.runtime.fused import autopar_norm_linear, autopar_norm_project
    # the norms whose output fused projections read: backward recomputes each once
    nodes = pm.graph_module.graph.nodes
    projections = len({n.args[0] for n in nodes if n.target is autopar_norm_linear}) \
        + sum(n.target is autopar_norm_project for n in nodes)
    rt = pm.dp_runtime
    fulls: list[weakref.ref] = []
    unpacked = [0]
    register, whole = rt.register_full, rt.whole_for_backward

    def note(bucket, tensors):     # every whole parameter a forward gather makes
        fulls.extend(weakref.ref(t) for t in tensors)
        register(bucket, tensors)

    def count(token):              # every token backward hands back
        unpacked[0] += 1
        return whole(token)
    rt.register_full, rt.whole_for_backward = note, count
    started = [0]
    start = dp_module.all_gather_start

    def gather(*args):             # every data-axis gather issued (however it travels)
        started[0] += 1
        return start(*args)
    dp_module.all_gather_start = gather
    run_region = rc._run_region
    rc._run_region = _marked(run_region)

    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    r = {"loss": 0.0, "alive": 0, "tokens": [], "unpacked": [], "gathers": [], "recomputed": [], "held": [],
         "split": [k for k in pm.state_dict() if isinstance(pm.placement_of(k), Shard)]}
    for _ in range(STEPS):
        fulls.clear()
        rc.HELD.clear()
        unpacked[0] = 0
        with _OpCount() as fwd_ops:
            loss = _loss(pm(*local))
        gc.collect()
        r["alive"] += sum(w() is not None for w in fulls)
        r["held"].append(sum(rc.HELD.values()))
        r["tokens"].append(sum(b.saved for b in rt.buckets))
        started[0] = 0
        with _OpCount() as ops:
            loss.backward()
        r["recomputed"].append(_recomputed(ops.seen, mode, projections))
        r["mm"] = (fwd_ops.seen["region:addmm"], ops.seen["addmm"])
        r["gathers"].append(started[0])
        r["unpacked"].append(unpacked[0])
        opt.step()
        opt.zero_grad()
        for d in range(dp):          # the single-process step sees the whole batch
            want = _loss(ref(*(a.chunk(dp)[d] for a in args)))
            (want / dp).backward()
            if d == pm.dp_rank:
                r["loss"] = max(r["loss"], abs(loss.item() - want.item()) / abs(want.item()))
        ref_opt.step()
        ref_opt.zero_grad()
    dp_module.all_gather_start = start
    rc._run_region = run_region
    sd, ref_sd = pm.state_dict(), ref.state_dict()
    r["param"] = max(_rel(_whole(sd[k]), v) for k, v in ref_sd.items())
    r["moved"] = max(_rel(v, init[k]) for k, v in ref_sd.items())
    # under full recomputation a region keeps only its layer's input, [batch, seq, hidden]
    r["layer_inputs"] = OVER["layers"] * local[0].numel() * OVER["hidden"] * dtype.itemsize
    return r


def _cases(rank: int, world: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    return [{**_train(mesh, mode, dtype), "mesh": mesh, "mode": mode, "dtype": dtype}
            for mesh, mode in cases for dtype in (torch.float32, torch.float64)]


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"world{w}")
def results(request) -> list[dict]:
    world = request.param
    by_rank = run_ranks(_cases, world, CASES[world], timeout_s=600)
    return [dict(r, rank=rank) for rank, rs in enumerate(by_rank) for r in rs]


def test_recompute_under_zero3_matches_single_process(results):
    for r in results:
        what = f"rank {r['rank']} {r['mesh']} recompute={r['mode']} {r['dtype']}"
        tol = RTOL[r["dtype"]]
        assert r["moved"] > 1e3 * tol, f"{what}: training did not move the parameters"
        assert r["loss"] <= tol, f"{what}: loss differs by {r['loss']:.2e} relative"
        assert r["param"] <= tol, f"{what}: parameters differ by {r['param']:.2e} relative"
        if "tp" in r["mesh"]:
            assert r["split"], f"{what}: no weight is split on the tensor axis"


def test_pointwise_recomputation_runs_no_matmul_again(results):
    """``pointwise`` keeps the matmuls' outputs: backward runs no forward matmul again (a linear
    with a bias runs as ``addmm`` in forward only; its gradients are plain ``mm``), where ``full``
    runs the checkpointed layers' again."""
    by = {(r["rank"], str(r["mesh"]), r["mode"], r["dtype"]): r for r in results}
    pairs = [(by[k], by[(k[0], k[1], "full", k[3])]) for k in by if k[2] == "pointwise"]
    assert pairs
    for point, full in pairs:
        assert point["mm"][0] > 0 and point["mm"][1] == 0 and full["mm"][1] > 0, (point["mm"], full["mm"])


def test_recompute_under_zero3_gathers_again_and_holds_no_whole_parameter(results):
    for r in results:
        what = f"rank {r['rank']} {r['mesh']} recompute={r['mode']} {r['dtype']}"
        want = int(r["mode"][len("layers:"):]) if r["mode"].startswith("layers:") else OVER["layers"]
        assert r["recomputed"] == [want] * STEPS, f"{what}: backward recomputed {r['recomputed']}, not {want}"
        assert r["alive"] == 0, f"{what}: {r['alive']} whole parameters outlived forward"
        assert all(t > 0 for t in r["tokens"]) and r["unpacked"] == r["tokens"], \
            f"{what}: tokens saved in forward {r['tokens']}, unpacked in backward {r['unpacked']}"
        assert all(g > 0 for g in r["gathers"]), f"{what}: backward gathered nothing"
        if r["mode"] != "selective" and "tp" not in r["mesh"]:   # tensor-axis conversions still cut layers
            held = r["layer_inputs"] * want // OVER["layers"]
            assert r["held"] == [held] * STEPS, f"{what}: regions held {r['held']} bytes"
