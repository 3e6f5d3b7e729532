"""Data-axis modes (``autopar/core/dp_mode.py``, ``runtime/data_modes.py``) on real gloo ranks.

Every parallel result is compared with a single-process reference in float64:

- the degenerate settings equal plain data parallelism (one process on the global batch,
  SGD with momentum): ``local_sgd`` with ``sync_every=1``, ``gossip`` on two ranks (a ring of two
  is fully connected) and on the ``full`` topology of four, ``async`` with ``staleness=0``,
  ``compressed`` top-k and rand-k keeping every entry;
- the others equal a simulation of what they mean, run in one process with one model copy per
  rank: ``local_sgd`` with warm-up and ``sync_every=2``, ``gossip`` on a ring of four ranks (the
  copies mixed by the ring's matrix), ``async`` with ``staleness=1`` (each step applies the
  previous step's averaged gradient; the first changes nothing); the ranks' parameters are
  gathered and compared copy by copy;
- ``local_sgd`` on ``dp 2 x tp 2`` with weights split on the tensor axis equals plain
  data parallelism.

On four ranks each mode also trains a regression with a known optimum (see
``test_every_mode_converges_near_allreduce``) and the bytes each rank sent are compared.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.runtime.launch import run_ranks

ROWS, FEATURES, STEPS, LR, MOMENTUM = 8, 6, 4, 0.1, 0.9
RTOL = 1e-11


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, hidden)
        self.down = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _data(dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, ROWS, FEATURES, generator=g, dtype=dtype)
    y = torch.randn(STEPS, ROWS, 1, generator=g, dtype=dtype)
    return x, y


def _model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# -- single-process references -------------------------------------------------------------------

def simulate(mode: dict, n: int) -> list[dict[str, torch.Tensor]]:
    """One model copy per rank, each trained on its share of every batch, combined as ``mode``
    says; the copies' parameters after STEPS steps."""
    x, y = _data()
    copies = [_model() for _ in range(n)]
    opts = [_sgd(c.parameters()) for c in copies]
    kind = mode["kind"]
    queue: list[list[torch.Tensor]] = []
    for t in range(STEPS):
        grads = []
        for r, c in enumerate(copies):
            c.zero_grad()
            share = slice(r * ROWS // n, (r + 1) * ROWS // n)
            _mse(c(x[t, share]), y[t, share]).backward()
            grads.append([p.grad.clone() for p in c.parameters()])
        mean = [sum(gs) / n for gs in zip(*grads)]
        if kind == "async":
            queue.append(mean)
            if t < mode["staleness"]:
                continue
            mean = queue.pop(0)
        local = kind in ("gossip", "local_sgd") and not (kind == "local_sgd" and t < mode.get("warmup", 0))
        with torch.no_grad():
            for r, (c, o) in enumerate(zip(copies, opts)):
                for p, g in zip(c.parameters(), grads[r] if local else mean):
                    p.grad = g.clone()
                o.step()
        step = t + 1
        if kind == "local_sgd" and step > mode.get("warmup", 0) and (step - mode.get("warmup", 0)) % mode["sync_every"] == 0:
            _mix(copies, torch.full((n, n), 1.0 / n, dtype=torch.float64))
        if kind == "gossip":
            from autopar.runtime.data_modes import mixing_matrix
            every = mode.get("global_every", 0)
            _mix(copies, torch.full((n, n), 1.0 / n, dtype=torch.float64) if every and step % every == 0
                 else mixing_matrix(mode["topology"], n))
    return [{k: v.detach().clone() for k, v in c.named_parameters()} for c in copies]


@torch.no_grad()
def _mix(copies: list[nn.Module], w: torch.Tensor) -> None:
    flats = torch.stack([torch.cat([p.reshape(-1) for p in c.parameters()]) for c in copies])
    mixed = w @ flats
    for c, flat in zip(copies, mixed):
        at = 0
        for p in c.parameters():
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()


# -- on the ranks --------------------------------------------------------------------------------

def _train(rank: int, world: int, mesh: dict, mode, placements=None) -> dict:
    dp = mesh.get("dp", 1)
    dp_rank = rank // mesh.get("tp", 1)
    x, y = _data()
    share = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    model = _model()
    pm = autopar.parallelize(model, mesh, (x[0, share],), dp_mode=mode, zero_stage=0, placements=placements)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    for t in range(STEPS):
        opt.zero_grad()
        _mse(pm(x[t, share]), y[t, share]).backward()
        opt.step()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in pm.state_dict().items()}
    local = {k: p.detach().clone() for k, p in pm.named_parameters()}
    rt = pm.dp_runtime
    return {"state": state, "local": local, "plan_mode": pm.plan.dp_mode,
            "sent": rt.modes.sent_bytes if rt.modes is not None else None}


def _cases2(rank: int, world: int, ckpt_dir: str) -> dict:
    out = {}
    for name, mode in CASES2.items():
        out[name] = _train(rank, world, {"dp": 2}, mode)
    for name, mode in RESUME.items():
        out[f"resume_{name}"] = _resume(rank, mode, f"{ckpt_dir}/{name}")
    return out


RESUME = {"local_sgd": {"kind": "local_sgd", "sync_every": 3},
          "topk": {"kind": "compressed", "compressor": "topk", "ratio": 0.3},
          "async": {"kind": "async", "staleness": 2}}


def _resume(rank: int, mode: dict, path: str) -> dict:
    """Two steps, a checkpoint, two more; then a fresh model loads the checkpoint and takes the
    same two steps: both must end with the same parameters, bit for bit."""
    x, y = _data()
    share = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)

    def build():
        pm = autopar.parallelize(_model(), {"dp": 2}, (x[0, share],), dp_mode=mode, zero_stage=0)
        return pm, autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=MOMENTUM)

    def steps(pm, opt, ts):
        for t in ts:
            opt.zero_grad()
            _mse(pm(x[t, share]), y[t, share]).backward()
            opt.step()

    pm, opt = build()
    steps(pm, opt, [0, 1])
    autopar.save(pm, opt, path, step=2)
    steps(pm, opt, [2, 3])
    again, again_opt = build()
    autopar.load(again, again_opt, path)
    steps(again, again_opt, [2, 3])
    plain = autopar.parallelize(_model(), {"dp": 2}, (x[0, share],), zero_stage=0)
    try:
        autopar.load(plain, autopar.optimizer(plain, torch.optim.SGD, lr=LR), path)
        refused = ""
    except autopar.CheckpointError as e:
        refused = str(e)
    return {"first": {k: p.detach().clone() for k, p in pm.named_parameters()},
            "resumed": {k: p.detach().clone() for k, p in again.named_parameters()}, "refused": refused}


CASES2 = {
    "allreduce": None,
    "local_sgd_h1": {"kind": "local_sgd", "sync_every": 1},
    "local_sgd_h2_warm": {"kind": "local_sgd", "sync_every": 2, "warmup": 1},
    "gossip_ring2": {"kind": "gossip", "topology": "ring"},
    "async_s0": {"kind": "async", "staleness": 0},
    "async_s1": {"kind": "async", "staleness": 1},
    "topk_all": {"kind": "compressed", "compressor": "topk", "ratio": 1.0},
    "randk_all": {"kind": "compressed", "compressor": "randk", "ratio": 1.0},
}


def _world(size: int) -> dict:
    if size == 2:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            return run_ranks(_cases2, 2, tmp, timeout_s=300)
    return run_ranks(_cases4, 4, timeout_s=300)


def _close(a: dict, b: dict, rtol: float = RTOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol, msg=lambda m: f"{k}: {m}")


EXACT2 = ["allreduce", "local_sgd_h1", "gossip_ring2", "async_s0", "topk_all", "randk_all"]


@pytest.mark.parametrize("case", EXACT2)
def test_degenerate_modes_equal_plain_data_parallelism(world2, case):
    ref = simulate({"kind": "allreduce"}, 1)[0]
    for rank in (0, 1):
        _close(world2[rank][case]["local"], ref)
    assert world2[0][case]["plan_mode"] == ({} if case == "allreduce" else autopar.DataMode(**CASES2[case]).to_dict())


@pytest.mark.parametrize("case", ["local_sgd_h2_warm", "async_s1"])
def test_modes_equal_their_simulation(world2, case):
    sims = simulate(CASES2[case], 2)
    for rank in (0, 1):
        _close(world2[rank][case]["local"], sims[rank])
    if case == "local_sgd_h2_warm":       # STEPS=4: warm-up, local, averaged, local: the copies differ
        assert not torch.equal(world2[0][case]["local"]["up.weight"], world2[1][case]["local"]["up.weight"])
    plain = simulate({"kind": "allreduce"}, 1)[0]
    assert (sims[0]["up.weight"] - plain["up.weight"]).abs().max() > 1e-4     # the mode changed training


@pytest.mark.parametrize("mode", sorted(RESUME))
def test_a_checkpoint_resumes_every_replica_and_the_mode_state_exactly(world2, mode):
    for rank in (0, 1):
        got = world2[rank][f"resume_{mode}"]
        _close(got["resumed"], got["first"], rtol=0)
        assert "data-axis replicas" in got["refused"]
    if mode == "local_sgd":       # saved between averages: the two replicas differed, and both came back
        assert not torch.equal(world2[0]["resume_local_sgd"]["first"]["up.weight"],
                               world2[1]["resume_local_sgd"]["first"]["up.weight"])


def test_bytes_sent_follow_the_mode(world2):
    full = world2[0]["async_s0"]["sent"]
    assert full > 0
    # ratio 1 top-k sends values and indices of every entry to the one other rank; all-reduce 2(n-1)/n
    assert world2[0]["topk_all"]["sent"] == pytest.approx(full * 12 / 8)
    # local SGD with sync_every=2 after one warm-up step: 1 gradient all-reduce + 1 parameter average
    assert world2[0]["local_sgd_h2_warm"]["sent"] == pytest.approx(full / STEPS * 2)


# -- four ranks ----------------------------------------------------------------------------------

CASES4 = {
    "gossip_full4": {"kind": "gossip", "topology": "full"},
    "gossip_ring4": {"kind": "gossip", "topology": "ring"},
    "gossip_grid4_pga": {"kind": "gossip", "topology": "grid", "global_every": 3},   # 2 x 2 torus: 2 neighbours
}
TP_EXACT = {   # on dp 2 x tp 2, each equal to plain data parallelism
    "gossip_tp": {"kind": "gossip", "topology": "ring"},
    "topk_tp": {"kind": "compressed", "compressor": "topk", "ratio": 1.0},
    "async_tp": {"kind": "async", "staleness": 0},
}
TP_SPLIT = {"up.weight": "S(0)", "up.bias": "S(0)", "down.weight": "S(1)"}
GPT = {"layers": 2, "hidden": 16, "heads": 2, "vocab": 32, "max_seq": 8}


def _pipeline(rank: int, sync_every: int) -> dict:
    """gpt on pp 2 x dp 2 under local SGD: per-step losses and this rank's stage parameters, with
    a single-process copy trained on the whole batch."""
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu").double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, GPT["vocab"], (STEPS, 4, 8), generator=g)
    target = torch.randint(0, GPT["vocab"], (STEPS, 4, 8), generator=g)
    share = slice(2 * (rank % 2), 2 * (rank % 2) + 2)
    loss = lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, -2), t.flatten())  # noqa: E731
    pm = autopar.parallelize(model, {"pp": 2, "dp": 2}, (ids[0, share],), loss_fn=loss, schedule="1f1b",
                             microbatches=2, zero_stage=0, dp_mode={"kind": "local_sgd", "sync_every": sync_every})
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    ref_opt = _sgd(ref.parameters())
    for t in range(STEPS):
        opt.zero_grad()
        pm.step(ids[t, share], target=target[t, share])
        opt.step()
        ref_opt.zero_grad()
        loss(ref(ids[t]), target[t]).backward()
        ref_opt.step()
    mine = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    return {"mine": mine, "ref": {k: v.detach() for k, v in ref.state_dict().items() if k in mine}}


def _cases4(rank: int, world: int) -> dict:
    out = {name: _train(rank, world, {"dp": 4}, mode) for name, mode in CASES4.items()}
    out["local_sgd_tp"] = _train(rank, world, {"dp": 2, "tp": 2}, {"kind": "local_sgd", "sync_every": 2},
                                 placements=TP_SPLIT)
    for name, mode in TP_EXACT.items():
        out[name] = _train(rank, world, {"dp": 2, "tp": 2}, mode, placements=TP_SPLIT)
    out["pp_h1"] = _pipeline(rank, 1)
    out["pp_h3"] = _pipeline(rank, 3)
    out["converge"] = _converge_all(rank, world)
    return out


def test_gossip_on_full_topology_equals_plain_data_parallelism(world4):
    ref = simulate({"kind": "allreduce"}, 1)[0]
    for rank in range(4):
        _close(world4[rank]["gossip_full4"]["local"], ref)


@pytest.mark.parametrize("case", ["gossip_ring4", "gossip_grid4_pga"])
def test_gossip_equals_its_mixing_simulation(world4, case):
    sims = simulate(CASES4[case], 4)
    for rank in range(4):
        _close(world4[rank][case]["local"], sims[rank])
    # rank 0 does not mix with rank 2 (ring) or rank 3 (2 x 2 torus) directly: they still differ
    far = 2 if case == "gossip_ring4" else 3
    gap = (world4[0][case]["local"]["up.weight"] - world4[far][case]["local"]["up.weight"]).abs().max()
    assert gap > 1e-4


def test_local_sgd_composes_with_a_split_tensor_axis(world4):
    sims = simulate({"kind": "local_sgd", "sync_every": 2}, 2)
    for rank in range(4):
        got = world4[rank]["local_sgd_tp"]
        assert got["local"]["up.weight"].shape == (4, FEATURES)       # split on tp: 8 rows / 2
        assert got["local"]["down.weight"].shape == (1, 4)
        _close(got["state"], sims[rank // 2])          # whole values, as the rank's dp copy holds them


@pytest.mark.parametrize("case", sorted(TP_EXACT))
def test_the_other_modes_compose_with_a_split_tensor_axis(world4, case):
    ref = simulate({"kind": "allreduce"}, 1)[0]
    for rank in range(4):
        got = world4[rank][case]
        assert got["local"]["up.weight"].shape == (4, FEATURES)
        _close(got["state"], ref)


def test_local_sgd_composes_with_a_pipeline(world4):
    for rank in range(4):
        _close(world4[rank]["pp_h1"]["mine"], world4[rank]["pp_h1"]["ref"], rtol=1e-10)
    # sync_every=3 after 4 steps: averaged at step 3, then one local step: the dp copies differ
    a, b = world4[0]["pp_h3"]["mine"], world4[1]["pp_h3"]["mine"]
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)


# -- convergence ---------------------------------------------------------------------------------
# A linear teacher y = x w* + noise (sd NOISE): the optimum's mean squared error is NOISE ** 2.
IN, PER_RANK, CONV_STEPS, CONV_LR, NOISE = 32, 8, 120, 0.1, 0.1
CONVERGE = {
    "allreduce": None,
    "local_sgd_h4": {"kind": "local_sgd", "sync_every": 4},
    "topk_10pct": {"kind": "compressed", "compressor": "topk", "ratio": 0.1},
    "randk_25pct": {"kind": "compressed", "compressor": "randk", "ratio": 0.25},
    "quantize_5": {"kind": "compressed", "compressor": "quantize", "levels": 5},
    "gossip_ring": {"kind": "gossip", "topology": "ring"},
    "gossip_grid": {"kind": "gossip", "topology": "grid"},
    "async_s1": {"kind": "async", "staleness": 1},
}


def _teacher(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, 1, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    x = torch.randn(n, IN, generator=g, dtype=torch.float64)
    return x, x @ w + NOISE * torch.randn(n, 1, generator=g, dtype=torch.float64)


def _converge(rank: int, world: int, mode) -> float:
    """Held-out mean squared error of the ranks' average model after CONV_STEPS steps."""
    torch.manual_seed(0)
    model = nn.Linear(IN, 1).double()
    x, y = _teacher(CONV_STEPS * PER_RANK * world, seed=7)
    x, y = x.view(CONV_STEPS, world, PER_RANK, IN), y.view(CONV_STEPS, world, PER_RANK, 1)
    pm = autopar.parallelize(model, {"dp": world}, (x[0, rank],), dp_mode=mode, zero_stage=0)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=CONV_LR)
    for t in range(CONV_STEPS):
        opt.zero_grad()
        _mse(pm(x[t, rank]), y[t, rank]).backward()
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in pm.parameters()])
    torch.distributed.all_reduce(w)       # the average model (what a final synchronisation gives)
    w /= world
    hx, hy = _teacher(2048, seed=8)
    return _mse(hx @ w[:IN].view(IN, 1) + w[IN:], hy).item()


def _converge_all(rank: int, world: int) -> dict:
    return {name: _converge(rank, world, mode) for name, mode in CONVERGE.items()}


def test_every_mode_converges_near_allreduce(world4):
    """Same data, steps and learning rate (plain SGD, lr 0.1, 120 steps of 8 rows per rank): each
    mode's held-out error is within 10 % of all-reduce's. Measured (float64, deterministic):
    all-reduce 0.01104 (the optimum is 0.0100), local_sgd H=4 +2.9 %, top-k 10 % +4.6 %,
    rand-k 25 % +1.4 %, quantize 5 levels -0.3 %, gossip ring +0.0 %, grid +0.4 %, async s=1
    +6.3 %: the margin leaves 1.6x the largest gap. Rand-k with error feedback at 10 % diverges at
    this learning rate (each entry is sent every 10 steps on average, a 10-step delay), which
    is why it runs at 25 % here."""
    got = world4[0]["converge"]
    assert all(r["converge"] == got for r in world4)        # the averaged model is the same everywhere
    base = got["allreduce"]
    assert NOISE ** 2 <= base < 1.15 * NOISE ** 2                # all-reduce itself reached the optimum
    for name, loss in got.items():
        assert loss <= 1.10 * base, f"{name}: {loss:.5f} vs all-reduce {base:.5f}"
