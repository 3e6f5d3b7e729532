"""A model's own ``torch.autograd.Function`` keeps its backward under every mesh.

``torch.export`` traces a Function's forward and would differentiate that, dropping the
user's backward: a straight-through estimator (``round`` forward, identity backward) got a
gradient of 0.0 on dp=2 and tp=2 where one process gets 0.94. Here three Functions whose
backward is *not* their forward's derivative (so the test fails if autopar differentiates the
forward) run in float64 on dp=2 (ZeRO-3), tp=2 (``memory_budget=1``: weights split, asserted)
and pp=2 (the planner's schedule), each compared with one process over 3 SGD-momentum steps:
loss, and every parameter after the steps. The model also holds a ``torch.no_grad()`` block
(a higher-order op whose body a pipeline stage must carry). One world of 2 ranks runs every case.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.core.errors import UnsupportedError
from autopar.passes.autograd_functions import calls
from autopar.runtime.launch import run_ranks

STEPS, TOL = 3, 1e-9


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: ``round`` forward (derivative 0), identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledGrad(torch.autograd.Function):
    """``x * k`` forward, gradient times ``k * k`` backward (not the derivative): saves a tensor
    and takes a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k * ctx.k + 0 * x, None


class SplitClamp(torch.autograd.Function):
    """Two outputs: ``clamp(x, -1, 1)`` and ``x.abs()``; backward passes both gradients through
    unclamped (not the derivative of clamp nor of abs)."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1), x.abs()

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 + g2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = RoundSTE.apply(self.a(x) * 3) / 3
        h = ScaledGrad.apply(torch.tanh(self.b(h)), 0.5)
        with torch.no_grad():        # a no_grad block: captured as a higher-order op with a body
            norm = h.abs().amax(dim=-1, keepdim=True) + 1
        lo, mag = SplitClamp.apply(h * 4 / norm)
        return self.c(lo + 0.1 * mag)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _reference() -> dict:
    model, (x, y) = _net(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _case(mesh: dict, **kw) -> dict:
    x, y = _data()
    rank = dist.get_rank()
    xs, ys = (x.chunk(2)[rank], y.chunk(2)[rank]) if "dp" in mesh else (x, y)
    if "pp" in mesh:
        kw["options"] = autopar.PipelineOptions(loss_fn=_loss)
    pm = autopar.parallelize(_net(), mesh, (xs,), **kw)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        if "pp" in mesh:
            loss = pm.step(xs, target=ys)
        else:
            loss = _loss(pm(xs), ys)
            loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if "dp" in mesh:
            dist.all_reduce(loss)
            loss /= 2
        losses.append(loss.item())
    graphs = [st.graph_module for st in pm.stages] if "pp" in mesh else [pm.graph_module]
    split = sum(1 for fqn, _ in pm.named_parameters() if str(pm.placement_of(fqn)).startswith("S(")) \
        if "tp" in mesh else None
    state = {k: _whole(v).detach().clone() for k, v in pm.state_dict().items()}
    return {"losses": losses, "params": state, "opaque": sum(len(calls(g)) for g in graphs), "split": split}


CASES = {"dp": ({"dp": 2}, dict(zero_stage=3)), "tp": ({"tp": 2}, dict(memory_budget=1)), "pp": ({"pp": 2}, {})}


def _phimoe():
    import transformers as T
    cfg = T.PhimoeConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=48, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         experts_implementation="batched_mm")      # grouped_mm has no float64 CPU kernel
    torch.manual_seed(0)
    return T.PhimoeForCausalLM(cfg).double()


def _phimoe_tp() -> dict:
    """PhiMoE's training router (sparsemixer) samples experts at random and backpropagates
    through its own Function (PhimoeMultiplier). Under tp=2 both ranks run the whole batch, so
    with the random stream seeded alike per step the draws match one process's exactly."""
    from tests import hf_tiny
    data = hf_tiny.batch(rows=4, seq=8)
    model = _phimoe()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, {"tp": 2}, example_kwargs=data, memory_budget=1)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    worst_loss = 0.0
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        loss = pm(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + step)
        want = ref(**data).loss
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst_loss = max(worst_loss, abs(loss.item() - want.item()) / abs(want.item()))
    sd = {k: _whole(v) for k, v in pm.state_dict().items()}
    worst = max(float((sd[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)) for k, v in ref.state_dict().items())
    return {"loss": worst_loss, "param": worst, "keys": set(sd) == set(ref.state_dict()),
            "opaque": len(calls(pm.graph_module)),
            "split": sum(1 for fqn, _ in pm.named_parameters() if str(pm.placement_of(fqn)).startswith("S("))}


def _all(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {"phimoe": _phimoe_tp()}
    for name, (mesh, kw) in CASES.items():
        try:
            out[name] = _case(mesh, **kw)
        except autopar.AutoparError as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_all, 2, str(tmp_path_factory.mktemp("autograd_function")), timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_custom_backward_is_kept(ranks, name):
    want = _reference()
    assert all("error" not in r[name] for r in ranks), [r[name].get("error") for r in ranks]
    # one opaque node per Function call: on every rank, or across the pipeline's stages
    opaque = [r[name]["opaque"] for r in ranks]
    assert (sum(opaque) if name == "pp" else min(opaque)) == 3, opaque
    for r in ranks:
        got = r[name]
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) <= TOL * abs(b), (got["losses"], want["losses"])
        # a pipeline rank holds its stages' parameters: the ranks together hold the model's
        params = {k: v for q in ranks for k, v in q[name]["params"].items()} if name == "pp" else got["params"]
        assert set(params) == set(want["params"])
        for k, v in want["params"].items():
            assert torch.allclose(params[k], v, rtol=TOL, atol=TOL), k
        if name == "tp":
            assert got["split"] >= 2, got["split"]     # weights really were split


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_phimoe_router_function_under_tp(ranks):
    for r in ranks:
        got = r["phimoe"]
        assert got["opaque"] >= 2, got         # PhimoeMultiplier, once per layer (twice: top-2)
        assert got["split"] >= 4 and got["keys"], got
        assert got["loss"] <= TOL and got["param"] <= 1e-9, got


def test_the_forward_alone_would_be_wrong():
    """The reference itself depends on the custom backwards: differentiating the forwards
    instead (what a plain trace does) changes the first step's gradient."""
    model, (x, y) = _net(), _data()
    _loss(model(x), y).backward()
    custom = model.a.weight.grad.clone()
    model.zero_grad()
    traced = torch.export.export(model, (x,), strict=False).module()
    _loss(traced(x), y).backward()
    plain = dict(traced.named_parameters())["a.weight"].grad
    assert custom.abs().sum() > 0 and plain.abs().sum() == 0     # round's derivative is zero


class _Keyword(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale=1.0):
        return x * scale

    @staticmethod
    def backward(ctx, g):
        return g, None


class _KeywordNet(nn.Module):
    def forward(self, x):
        return _Keyword.apply(x, scale=2.0)


def test_a_function_autopar_cannot_carry_is_refused_by_name():
    with pytest.raises(UnsupportedError, match="_Keyword") as err:
        autopar.plan(_KeywordNet(), {"tp": 2}, (torch.randn(4, 4),))
    assert "test_autograd_function.py" in str(err.value)
