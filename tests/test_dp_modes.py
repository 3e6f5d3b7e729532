"""Data-axis modes (``autopar/dp_mode.py``, ``runtime/data_modes.py``) on real gloo ranks.

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
import torch.distributed as dist
from torch import nn

import autopar
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
            _mix(copies, mixing_matrix(mode["topology"], n))
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
    state = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    local = {k: p.detach().clone() for k, p in pm.named_parameters()}
    rt = pm.dp_runtime
    return {"state": state, "local": local, "plan_mode": pm.plan.dp_mode,
            "sent": rt.modes.sent_bytes if rt.modes is not None else None}


def _cases2(rank: int, world: int) -> dict:
    out = {}
    for name, mode in CASES2.items():
        out[name] = _train(rank, world, {"dp": 2}, mode)
    return out


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
        return run_ranks(_cases2, 2, timeout_s=300)
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


def test_bytes_sent_follow_the_mode(world2):
    full = world2[0]["async_s0"]["sent"]
    assert full > 0
    # ratio 1 top-k sends values and indices of every entry to the one other rank; all-reduce 2(n-1)/n
    assert world2[0]["topk_all"]["sent"] == pytest.approx(full * 12 / 8)
    # local SGD with sync_every=2 after one warm-up step: 1 gradient all-reduce + 1 parameter average
    assert world2[0]["local_sgd_h2_warm"]["sent"] == pytest.approx(full / STEPS * 2)


def _cases4(rank: int, world: int) -> dict:
    return {}
