"""fp16 dynamic loss scaling (runtime/loss_scale.py) on real gloo ranks.

One world of 2 ranks runs every case (starting worlds is the slow part); each test reads its
case's results. The model is a small MLP whose first weight ``w`` is used as ``x @ w`` with its
row 0 zero and input feature 0 zero, so row 0 never moves; feeding a huge feature 0 on one step
makes only row 0's gradient overflow in fp16 (the forward does not change). Where that row is
held by one rank only (ZeRO-2: rank 0's flat piece; a pipeline: stage 0 on rank 0) the other
rank finds every gradient of its own finite and still skips the step: the decision is one
for the whole world.

Underflow: the loss is multiplied by ``TINY`` (1e-7): the gradient reaching the model's output
is about 6e-9 per unit of error, under 3e-8 (half fp16's smallest subnormal: fp16 rounds it to
zero), so without scaling every gradient backward makes is exactly zero (asserted) and training
does not move; scaled by 2**16 it is about 4e-4, and fp16 training follows the fp32 reference
(the same model, loss and SGD in one process) within ``LOSS_TOL`` (2e-3) relative, room for
fp16 matmuls over a few steps (measured: under 1e-4).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.core.errors import CheckpointError, ConfigError
from autopar.runtime.launch import run_ranks
from autopar.runtime.loss_scale import GOOD_STEPS_KEY, SCALE_KEY, LossScale

TINY, LR = 1e-7, 0.2
LOSS_TOL = 2e-3
STEPS = 6
BAD_X = 3e4          # feature 0 on the overflow step (fp16 holds it; its weight gradient overflows)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16) * 0.5)
        with torch.no_grad():
            self.w[0].zero_()              # feature 0 reaches nothing in forward
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.relu(x @ self.w))))


class _Loss:
    """``factor * mse`` on the fp32 output (the dp cases' loss, and the pipeline's ``loss_fn``)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.factor * F.mse_loss(out.float(), target)


def _data(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 4, generator=g)
    x[:, 0] = 0
    return x, torch.tanh(x @ torch.randn(4, 4, generator=g))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _pending_grads(pm, opt) -> list[torch.Tensor]:
    """Where this rank's gradients are before ``opt.step()``: fp32 accumulators, reduced sinks
    (pieces under ZeRO-2), or what autograd left on the parameters."""
    main = getattr(pm, "main_grads", None)
    return [*(main.grads.values() if main is not None else ()), *(g for rt in opt.rts for g in rt.sinks.values()),
            *(p.grad for p in pm.parameters() if p.grad is not None)]


def _masters(opt) -> dict[str, torch.Tensor]:
    return {f: m.detach().clone() for f, m in opt.masters.items()}


def _dp_underflow(scale: LossScale) -> dict:
    """dp=2, ZeRO-0, loss * TINY: losses per step, and whether any gradient was nonzero."""
    x, y = _data()
    r = dist.get_rank()
    xs, ys = x.chunk(2)[r], y.chunk(2)[r]
    pm = autopar.parallelize(_net(), {"dp": 2}, (xs,), zero_stage=0, mixed_precision="fp16")
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR / TINY, loss_scale=scale)
    loss_fn, losses, nonzero, dtypes = _Loss(TINY), [], False, set()
    for _ in range(STEPS):
        out = pm(xs)
        dtypes.add(out.dtype)
        loss = loss_fn(out, ys)
        loss.backward()
        nonzero |= any(bool(g.ne(0).any()) for g in _pending_grads(pm, opt))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "nonzero": nonzero, "scale": opt.scaler.scale, "out": dtypes,
            "held": {p.dtype for p in pm.parameters()}}


def _reference(bad_step: int | None = None) -> list[list[float]]:
    """fp32, one process: each step's loss on each rank's share (a skipped step does not update)."""
    model = _net()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=LR / TINY)
    out = []
    for step in range(STEPS):
        out.append([_Loss(TINY)(model(xs), ys).item() for xs, ys in zip(x.chunk(2), y.chunk(2))])
        if step != bad_step:
            _Loss(TINY)(model(x), y).backward()
            opt.step()
        opt.zero_grad()
    return out


def _dp_overflow(root: str) -> dict:
    """dp=2, ZeRO-2, SGD-momentum; step 1 overflows on rank 1's input only. Then growth, then
    the scaler's state through opt.state_dict() and through autopar.save / autopar.load."""
    x, y = _data()
    r = dist.get_rank()
    xs, ys = x.chunk(2)[r], y.chunk(2)[r]
    config = LossScale(init=2.0 ** 10, growth=4.0, interval=3)
    pm = autopar.parallelize(_net(), {"dp": 2}, (xs,), zero_stage=2, mixed_precision="fp16")
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9, loss_scale=config)
    history, skip = [], {}
    for step in range(STEPS):
        xb = xs.clone()
        if step == 1 and r == 1:
            xb[:, 0] = BAD_X
        F.mse_loss(pm(xb), ys).backward()
        if step == 1:
            skip["local_finite"] = all(bool(g.isfinite().all()) for g in _pending_grads(pm, opt))
            skip["masters"] = _masters(opt)
            skip["momentum"] = {id(m): s["momentum_buffer"].clone() for m, s in opt.state.items()}
            skip["held"] = {f: p.detach().clone() for f, p in pm.named_parameters()}
        opt.step()
        opt.zero_grad()
        if step == 1:
            skip["masters_same"] = all(torch.equal(m, skip["masters"][f]) for f, m in _masters(opt).items())
            skip["momentum_same"] = all(torch.equal(s["momentum_buffer"], skip["momentum"][id(m)])
                                        for m, s in opt.state.items())
            skip["held_same"] = all(torch.equal(p, skip["held"][f]) for f, p in pm.named_parameters())
            del skip["masters"], skip["momentum"], skip["held"]
            after_skip = _masters(opt)
        history.append((opt.scaler.scale, opt.scaler.good_steps, opt.scaler.skipped))
    moved = any(not torch.equal(m, after_skip[f]) for f, m in _masters(opt).items())
    sd = opt.state_dict()
    fresh = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9, loss_scale=config)
    before_load = fresh.scaler.state_dict()
    fresh.load_state_dict(sd)
    out = {"history": history, "skip": skip, "moved": moved,
           "saved": opt.scaler.state_dict(), "in_state_dict": [{k: g[k] for k in (SCALE_KEY, GOOD_STEPS_KEY)}
                                                               for g in sd["param_groups"]],
           "fresh": before_load, "loaded": fresh.scaler.state_dict()}
    try:      # a checkpoint failure (both ranks agree on it) fails the round-trip test alone
        autopar.save(pm, opt, root, step=STEPS)
        third = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9, loss_scale=config)
        autopar.load(pm, third, root)
        out["checkpointed"] = third.scaler.state_dict()
        F.mse_loss(pm(xs), ys).backward()      # and training goes on from the restored state
        third.step()
        out["after_load_step"] = third.scaler.state_dict()
    except CheckpointError as e:
        out["checkpoint_error"] = str(e)
    return out


def _pp(bad_step: int) -> dict:
    """pp=2 (no data axis; the zero-bubble schedule, whose split backward ``detach_()``es the
    loss), loss * TINY: follows the fp32 reference; at ``bad_step`` a huge
    feature 0 overflows stage 0's weight gradient, on rank 0 only. The scale starts at 2**30
    so that, with the loss times TINY, scaled gradients are O(1) and BAD_X times one overflows."""
    x, y = _data()
    loss_fn = _Loss(TINY)
    pm = autopar.parallelize(_net(), {"pp": 2}, (x,), mixed_precision="fp16", loss_fn=loss_fn,
                             schedule="zb", microbatches=2)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR / TINY, loss_scale=LossScale(init=2.0 ** 30))
    losses, out = [], {"holds_w": any("w" == f for st in pm.stages for f, _ in st.named_parameters())}
    for step in range(STEPS):
        xb = x.clone()
        if step == bad_step:
            xb[:, 0] = BAD_X
        losses.append(pm.step(xb, target=y).item())
        if step == bad_step:
            out["local_finite"] = all(bool(g.isfinite().all()) for g in _pending_grads(pm, opt))
            before = _masters(opt)
        opt.step()
        opt.zero_grad()
        if step == bad_step:
            out["masters_same"] = all(torch.equal(m, before[f]) for f, m in _masters(opt).items())
            out["scale_after_skip"] = opt.scaler.scale
    return {**out, "losses": losses, "scale": opt.scaler.scale, "skipped": opt.scaler.skipped}


def _bf16() -> dict:
    """bf16 is untouched: no scaler, outputs in bf16, and loss_scale= refused, not ignored."""
    x, _ = _data()
    xs = x.chunk(2)[dist.get_rank()]
    pm = autopar.parallelize(_net(), {"dp": 2}, (xs,), mixed_precision="bf16")
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
    try:
        autopar.optimizer(pm, torch.optim.SGD, lr=0.1, loss_scale=LossScale())
        refused = None
    except ConfigError as e:
        refused = str(e)
    return {"scaler": opt.scaler, "out": pm(xs).dtype, "refused": refused}


HF_STEPS = 20


def _hf_norms(fp16: bool) -> dict:
    """A ``transformers`` Llama trained on its own loss (``out.loss``, labels given) for
    HF_STEPS SGD steps: dp=2 (each rank half the batch) in fp16 at the default initial scale
    2**16, or one process in fp32; each step's clip norm (``autopar.clip_grad_norm_`` /
    torch's)."""
    from tests import hf_tiny
    model, data = hf_tiny.build("llama"), hf_tiny.batch(rows=4, seq=8)
    if not fp16:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        norms = []
        for _ in range(HF_STEPS):
            model(**data).loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
            opt.step()
            opt.zero_grad()
        return {"norms": norms}
    half = {k: v.chunk(2)[dist.get_rank()] for k, v in data.items()}
    pm = autopar.parallelize(model, {"dp": 2}, example_kwargs=half, mixed_precision="fp16")
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.05)
    norms = []
    for _ in range(HF_STEPS):
        pm(**half).loss.backward()
        norms.append(autopar.clip_grad_norm_(pm, opt, 1e9).item())
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "skipped": opt.scaler.skipped, "scale": opt.scaler.scale}


def _all(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    return {"scaled": _dp_underflow(LossScale()), "unscaled": _dp_underflow(LossScale(init=1.0, growth=1.0)),
            "pp": _pp(bad_step=2), "bf16": _bf16(), "overflow": _dp_overflow(os.path.join(root, "ckpt")),
            "hf": _hf_norms(fp16=True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_all, 2, str(tmp_path_factory.mktemp("loss_scale")), timeout_s=300)


def test_fp16_underflow_is_rescued_by_scaling(ranks):
    ref = _reference()
    for rank, r in enumerate(ranks):
        scaled, unscaled = r["scaled"], r["unscaled"]
        # without scaling every fp16 gradient flushed to zero: the loss never moved
        assert not unscaled["nonzero"] and len(set(unscaled["losses"])) == 1, unscaled["losses"]
        assert scaled["nonzero"]
        for got, want in zip(scaled["losses"], ref):
            assert abs(got - want[rank]) <= LOSS_TOL * want[rank], (scaled["losses"], ref)
        assert ref[-1][rank] < 0.8 * ref[0][rank]       # the reference did learn (by about 25 %)
        assert scaled["scale"] == 2.0 ** 16               # no overflow, no growth within 2000 steps
        assert scaled["out"] == {torch.float32} and scaled["held"] == {torch.float16}


def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks):
    finite = [r["overflow"]["skip"]["local_finite"] for r in ranks]
    assert finite == [False, True], finite      # only rank 0 holds the overflowing piece (ZeRO-2)
    for r in ranks:
        skip = r["overflow"]["skip"]
        assert skip["masters_same"] and skip["momentum_same"] and skip["held_same"], skip
        assert r["overflow"]["history"][:2] == [(2.0 ** 10, 1, 0), (2.0 ** 9, 0, 1)]
        assert r["overflow"]["moved"]               # training went on after the skip
    assert ranks[0]["overflow"]["history"] == ranks[1]["overflow"]["history"]


def test_scale_grows_after_interval_good_steps(ranks):
    for r in ranks:      # after the skip: 2**9, then x4 after three good steps
        assert r["overflow"]["history"][2:] == [(2.0 ** 9, 1, 1), (2.0 ** 9, 2, 1), (2.0 ** 11, 0, 1),
                                                (2.0 ** 11, 1, 1)]


def test_scale_state_round_trips(ranks):
    for r in ranks:
        o = r["overflow"]
        want = {SCALE_KEY: 2.0 ** 11, GOOD_STEPS_KEY: 1}
        assert o["saved"] == want and o["fresh"] == {SCALE_KEY: 2.0 ** 10, GOOD_STEPS_KEY: 0}
        assert o["in_state_dict"] == [want]          # opt.state_dict() carries it
        assert o["loaded"] == want                   # opt.load_state_dict()
        assert "checkpoint_error" not in o, o["checkpoint_error"]
        assert o["checkpointed"] == want             # autopar.save / autopar.load
        assert o["after_load_step"] == {SCALE_KEY: 2.0 ** 11, GOOD_STEPS_KEY: 2}   # and it goes on from there


def test_pipeline_scales_its_loss_and_skips_together(ranks):
    bad = 2
    ref = _reference(bad_step=bad)
    assert [r["pp"]["holds_w"] for r in ranks] == [True, False]
    assert [r["pp"]["local_finite"] for r in ranks] == [False, True]
    for r in ranks:
        p = r["pp"]
        assert p["masters_same"] and p["scale_after_skip"] == 2.0 ** 29 and p["skipped"] == 1
        for got, want in zip(p["losses"], ref):
            whole = (want[0] + want[1]) / 2
            assert abs(got - whole) <= LOSS_TOL * whole, (p["losses"], ref)


def test_fp16_scales_a_models_own_loss_once(ranks):
    """A model that returns its own loss (``out.loss``, computed from logits the model also
    returns) is scaled once: the clip norm is the fp32 run's, not the scale times it, and no
    step overflows at the initial scale (before: norm exactly 2**16 x, 7 of 10 steps skipped)."""
    want = _hf_norms(fp16=False)["norms"]
    for r in ranks:
        got = r["hf"]
        assert got["skipped"] == 0 and got["scale"] == 2.0 ** 16, got
        drift = " ".join(f"{a / b - 1:+.1e}" for a, b in zip(got["norms"], want))
        # the first nine steps within 1e-3 (measured: under 2.1e-4); where the norm jumps (steps
        # 10-13) fp16 round-off (parameters held in fp16) moves the trajectory by up to 10 %
        assert all(abs(g - w) <= 1e-3 * w for g, w in zip(got["norms"][:9], want)), drift
        assert all(abs(g - w) <= 0.2 * w for g, w in zip(got["norms"], want)), drift


def test_bf16_has_no_scaler_and_refuses_loss_scale(ranks):
    for r in ranks:
        assert r["bf16"]["scaler"] is None and r["bf16"]["out"] == torch.bfloat16
        assert "only under mixed_precision='fp16'" in r["bf16"]["refused"]


def test_loss_scale_options_are_checked():
    with pytest.raises(ConfigError, match="LossScale.growth"):
        LossScale(growth=0.5)
    with pytest.raises(ConfigError, match="LossScale.interval"):
        LossScale(interval=0)
