"""Checkpoints written under one plan load under any other, exactly.

The matrix: a Mixtral-style MoE model (capacity high enough that no token is dropped, so
every plan computes the same function) trains two AdamW steps under each of dp=2 ZeRO-0,
dp=2 ZeRO-3, tp=2, pp=2, ep=2 and a single process with no process group, and saves with
``autopar.save``. Each plan (and dp=4 ZeRO-2, another world size) then loads every one of
those checkpoints into a freshly built, differently initialised model and optimizer.

Checked against an independent reader (``torch.distributed.checkpoint.format_utils``'s
``dcp_to_torch_save``, which assembles whole tensors from the stored pieces) and through
the runtimes' own ``state_dict()`` paths: every parameter and every optimizer state tensor
a rank holds is bit-identical to the saved whole tensor's matching part. Then each loaded
run trains a third step, whose loss must equal the uninterrupted single-process run's
third-step loss within 1e-5 relative.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.core.placement import Shard
from autopar.runtime.launch import run_ranks
from autopar.runtime.optim import ShardedOptimizer

MOE = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": 16, "experts": 4, "top_k": 2,
       "capacity_factor": 4.0}
BATCH, SEQ, LR = 4, 8, 1e-2
RTOL = 1e-5

# name -> (mesh, parallelize options); None: one process, no process group
PLANS = {
    "dp2-zero3": ({"dp": 2}, {"zero_stage": 3}),
    "tp2": ({"tp": 2}, {"tensor_split": True}),
    "pp2": ({"pp": 2}, {"schedule": "1f1b", "microbatches": 2}),
    "pp2-dp2-zero3": ({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 3}),
    "pp2-ep2-zero1": ({"pp": 2, "ep": 2}, {"schedule": "1f1b", "microbatches": 2, "zero_stage": 1}),
    "ep2": ({"ep": 2}, {}),
    "single": (None, {}),
}
LOAD_ONLY = {"dp4-zero2": ({"dp": 4}, {"zero_stage": 2})}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return models.build("moe", MOE, device="cpu")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, MOE["vocab"], (BATCH, SEQ), generator=g),
            torch.randint(0, MOE["vocab"], (BATCH, SEQ), generator=g))


def _shares(mesh: dict | None) -> int:
    """How many ways the global batch is split (each rank of dp and ep takes its own share)."""
    return 1 if mesh is None else mesh.get("dp", 1) * mesh.get("ep", 1)


def _share(mesh: dict | None) -> int:
    """This rank's share of the batch: its place on the dp and ep axes (ranks row-major)."""
    if mesh is None:
        return 0
    coord, r = {}, dist.get_rank()
    for name in reversed(list(mesh)):
        coord[name], r = r % mesh[name], r // mesh[name]
    return coord.get("dp", 0) * mesh.get("ep", 1) + coord.get("ep", 0)


def _build(mesh: dict | None, opts: dict, seed: int):
    model = _model(seed)
    if mesh is None:
        return "single", model, torch.optim.AdamW(model.parameters(), lr=LR)
    x, _ = _batch(0)
    local = x.chunk(_shares(mesh))[_share(mesh)]
    opts = dict(opts)
    if opts.pop("tensor_split", False):   # make the solver split this tiny model's weights
        opts["memory_budget"] = 0.75 * 16 * sum(p.numel() for p in model.parameters())
    if "pp" in mesh:
        opts["loss_fn"] = _loss
    pm = autopar.parallelize(model, mesh, (local,), **opts)
    return "pp" if "pp" in mesh else "ep" if "ep" in mesh else "parallel", pm, \
        autopar.optimizer(pm, torch.optim.AdamW, lr=LR)


def _train_step(kind: str, mesh: dict | None, pm, opt, step: int) -> float:
    x, y = _batch(step)
    n, i = _shares(mesh), _share(mesh)
    x, y = x.chunk(n)[i], y.chunk(n)[i]
    if kind == "pp":
        loss = pm.step(x, target=y)
    else:
        loss = _loss(pm(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _held(kind: str, pm, opt) -> dict:
    """What this rank holds, through the runtime's own state_dict paths:
    key -> (tensor, how it maps onto the whole: ("whole",) | ("chunk", dim, i, n) | ("rows", [experts]))."""
    out = {}
    owned = {}
    if kind == "ep":
        from autopar.core.meta import graph_info
        for region in graph_info(pm.graph_module).moe_regions:
            for f in region.expert_params:
                owned[f] = list(pm.ep_runtimes[region.fqn].owned())
    if kind == "pp":
        owned = {f: list(o) for f, o in pm.expert_owned.items()}

    def where(fqn: str, t: torch.Tensor):
        if fqn in owned:
            return ("rows", owned[fqn])
        if kind == "parallel" and isinstance(pm.placement_of(fqn), Shard) and pm._n > 1:
            return ("chunk", pm.placement_of(fqn).dim, pm._rank, pm._n)
        return ("whole",)

    for fqn, v in pm.state_dict().items():
        if hasattr(v, "full_tensor"):   # a tensor-axis DTensor: assembled whole by torch
            out[f"model/{fqn}"] = (v.full_tensor().detach().clone(), ("whole",))
        elif kind in ("ep", "pp"):      # experts gathered from every ep rank, every stage's entries: whole
            out[f"model/{fqn}"] = (v.detach().clone(), ("whole",))
        else:
            out[f"model/{fqn}"] = (v.detach().clone(), where(fqn, v))
    sd = opt.state_dict()
    if isinstance(opt, ShardedOptimizer):
        named = sd["state"]                           # keyed by name, whole tensor-axis-local values
    else:
        inner = getattr(opt, "optimizer", opt)
        names = {id(p): f for f, p in pm.named_parameters()}
        order = [names[id(p)] for g in inner.param_groups for p in g["params"]]
        named = {order[k]: s for k, s in sd["state"].items()}
    for fqn, state in named.items():
        for name, v in state.items():
            out[f"optim/{fqn}/{name}"] = (v.detach().clone(), ("whole",) if v.dim() == 0 else where(fqn, v))
    return out


def _save_phase(rank: int, world: int, name: str, root: str) -> list[float]:
    mesh, opts = PLANS[name]
    kind, pm, opt = _build(mesh, opts, seed=0)
    losses = [_train_step(kind, mesh, pm, opt, s) for s in range(2)]
    autopar.save(pm, opt, os.path.join(root, name), step=2)
    return losses


def _load_phase(rank: int, world: int, name: str, root: str, sources: list[str]) -> dict:
    mesh, opts = {**PLANS, **LOAD_ONLY}[name]
    kind, pm, opt = _build(mesh, opts, seed=7)     # another initialisation: the load must replace it all
    out = {}
    for src in sources:
        info = autopar.load(pm, opt, os.path.join(root, src))
        assert info["step"] == 2
        held = _held(kind, pm, opt)
        loss = _train_step(kind, mesh, pm, opt, 2)
        out[src] = {"held": held, "loss": loss, "share": _share(mesh), "shares": _shares(mesh)}
    return out


def _whole_saved(path: str, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dest = tmp_path / f"{os.path.basename(path)}.pt"
    dcp_to_torch_save(autopar.checkpoint.latest(path), dest)
    return torch.load(dest, weights_only=False)


def _expected(whole: torch.Tensor, how: tuple) -> torch.Tensor:
    if how[0] == "chunk":
        _, dim, i, n = how
        return whole.chunk(n, dim)[i]
    if how[0] == "rows":
        return whole[how[1]]
    return whole


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    for name, (mesh, _) in PLANS.items():
        if mesh is None:
            _save_phase(0, 1, name, root)
        else:
            run_ranks(_save_phase, _world(mesh), name, root, timeout_s=300)
    # the uninterrupted run: three single-process steps
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [_train_step("single", None, model, opt, s) for s in range(3)]
    return root, losses


def _world(mesh: dict) -> int:
    n = 1
    for v in mesh.values():
        n *= v
    return n


@pytest.mark.parametrize("dst", [*PLANS, *LOAD_ONLY])
def test_checkpoint_loads_under_every_plan(saved, dst, tmp_path):
    root, ref_losses = saved
    sources = list(PLANS)
    mesh = {**PLANS, **LOAD_ONLY}[dst][0]
    if mesh is None:
        results = [_load_phase(0, 1, dst, root, sources)]
    else:
        results = run_ranks(_load_phase, _world(mesh), dst, root, sources, timeout_s=300)
    for src in sources:
        whole = _whole_saved(os.path.join(root, src), tmp_path)
        checked = 0
        for r in results:
            for key, (t, how) in r[src]["held"].items():
                assert key in whole, f"{src} -> {dst}: {key} not in the checkpoint"
                want = _expected(whole[key], how)
                assert t.dtype == want.dtype and torch.equal(t, want), f"{src} -> {dst}: {key} differs"
                checked += 1
        assert checked > 0
        hows = {how[0] for r in results for _, how in r[src]["held"].values()}
        if dst == "tp2":
            assert "chunk" in hows          # the tensor axis really splits weights here
        if dst == "ep2":
            assert "rows" in hows           # and each expert lives on one rank
        keys = {k for r in results for k in r[src]["held"]}
        assert {k for k in whole if k.startswith("model/")} <= keys, f"{src} -> {dst}: parameters not loaded"
        shares = {r[src]["share"]: r[src]["loss"] for r in results}
        loss = sum(shares.values()) / len(shares)
        assert abs(loss - ref_losses[2]) <= RTOL * abs(ref_losses[2]), (src, dst, loss, ref_losses[2])


def test_a_checkpoint_for_another_model_is_refused(saved):
    root, _ = saved
    other = models.build("moe", {**MOE, "hidden": 48}, device="cpu")
    with pytest.raises(autopar.CheckpointError) as err:
        autopar.load(other, torch.optim.AdamW(other.parameters()), os.path.join(root, "single"))
    assert "embed" in str(err.value) and "fix:" in str(err.value)
    with pytest.raises(autopar.CheckpointError, match="no checkpoint"):
        autopar.load(other, None, os.path.join(root, "nothing-here"))


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    import autopar
    from autopar import models
    torch.manual_seed(0)
    model = models.build("moe", {cfg!r}, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    autopar.save(model, opt, sys.argv[1], step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real = dcp.FileSystemWriter.write_data
    def dying(self, plan, planner):
        fut = real(self, plan, planner)
        fut.wait()
        os.kill(os.getpid(), signal.SIGKILL)     # the data is half written, nothing is committed
    dcp.FileSystemWriter.write_data = dying
    autopar.save(model, opt, sys.argv[1], step=2)
""")


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_SAVE.format(cfg=MOE))
    root = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (root / "step-00000002").exists()           # the interrupted save left its partial directory
    torch.manual_seed(0)
    want = models.build("moe", MOE, device="cpu")
    model = models.build("moe", {**MOE}, device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    info = autopar.load(model, torch.optim.AdamW(model.parameters(), lr=1e-2), root)
    assert info["step"] == 1 and info["path"].name == "step-00000001"
    for (k, a), b in zip(want.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_saving_over_the_current_checkpoint_is_refused(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    autopar.save(model, opt, tmp_path, step=5)
    with pytest.raises(autopar.CheckpointError, match="current checkpoint"):
        autopar.save(model, opt, tmp_path, step=5)


def _mixed_phase(rank: int, world: int, root: str, mode: str) -> dict:
    """dp=2 ZeRO-1 in bf16: its fp32 masters are what is saved and what a load restores."""
    from autopar.runtime.dp import shard_range
    model = _model(0 if mode == "save" else 7)
    x, y = _batch(0)
    pm = autopar.parallelize(model, {"dp": 2}, (x.chunk(2)[rank],), zero_stage=1, mixed_precision="bf16")
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=LR)
    if mode == "save":
        for s in range(2):
            _train_step("parallel", {"dp": 2}, pm, opt, s)
        autopar.save(pm, opt, root, step=2)
    else:
        autopar.load(pm, opt, root)
    named = dict(pm.named_parameters())
    out = {}
    for fqn, m in opt.masters.items():
        lo, hi = shard_range(named[fqn].numel(), 2, rank)
        out[fqn] = (lo, hi, m.detach().clone(), named[fqn].detach().clone())
    return out


def test_mixed_precision_checkpoints_hold_the_fp32_masters(tmp_path):
    saved = run_ranks(_mixed_phase, 2, str(tmp_path / "bf16"), "save", timeout_s=300)
    single = _model(3)
    autopar.load(single, torch.optim.AdamW(single.parameters()), tmp_path / "bf16")
    params = dict(single.named_parameters())
    for r in saved:
        for fqn, (lo, hi, master, _) in r.items():
            assert master.dtype == torch.float32
            assert torch.equal(params[fqn].detach().reshape(-1)[lo:hi], master), fqn
    # and back: a single-process fp32 checkpoint restores the masters, the bf16 copies follow
    opt = torch.optim.AdamW(single.parameters(), lr=LR)
    _train_step("single", None, single, opt, 0)
    autopar.save(single, opt, tmp_path / "fp32", step=1)
    loaded = run_ranks(_mixed_phase, 2, str(tmp_path / "fp32"), "load", timeout_s=300)
    params = dict(single.named_parameters())
    for r in loaded:
        for fqn, (lo, hi, master, param) in r.items():
            want = params[fqn].detach()
            assert torch.equal(master, want.reshape(-1)[lo:hi]), fqn
            assert param.dtype == torch.bfloat16 and torch.equal(param, want.to(torch.bfloat16)), fqn
