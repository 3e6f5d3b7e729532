"""``pm.train()`` / ``pm.eval()`` behave as on the original model, on dp, tp and pp, whatever mode
the model was captured in; ranks that call ``parallelize`` differently get one typed error.

One gloo world of 2 ranks runs every case (starting worlds is the slow part); each case returns
plain numbers the tests compare with the single-process model."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.core.errors import ConfigError, PeerFailureError
from autopar.runtime.launch import run_ranks

WIDTH = 16
SPLIT = {"blocks.0.fc.weight": "S(0)", "blocks.1.fc.weight": "S(0)", "head.weight": "S(1)"}


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.bn(self.fc(x))))


class Net(nn.Module):
    def __init__(self, p: float = 0.0, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(p) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Branchy(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if self.training else y      # a `self.training` branch that runs another op


def _net(p: float, mode: bool, cls=Net) -> nn.Module:
    torch.manual_seed(0)
    m = cls(p).double()
    with torch.no_grad():             # running statistics away from their initial 0 / 1
        for b in m.blocks:
            b.bn.running_mean.uniform_(-0.5, 0.5)
            b.bn.running_var.uniform_(0.5, 2.0)
    return m.train(mode)


def _batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(8, WIDTH, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _modes(rank: int, world: int) -> dict:
    out: dict = {}
    x = _batch()
    ref = _net(0.0, True)
    want_eval = _net(0.0, False)(x)
    want_train = _net(0.0, True)(x)                # batch statistics of the whole batch
    for label, mesh, share in (("tp", {"tp": 2}, x), ("dp", {"dp": 2}, x.chunk(2)[rank])):
        rows = slice(None) if label == "tp" else slice(4 * rank, 4 * rank + 4)
        for captured in (True, False):
            forced = {"placements": SPLIT} if label == "tp" else {}
            pm = autopar.parallelize(_net(0.0, captured), mesh, (share,), **forced)
            res = out.setdefault(f"{label}/{'train' if captured else 'eval'}", {})
            res["starts_in"] = pm.training
            pm.eval()
            res["eval"] = _rel(pm(share), want_eval[rows])
            res["eval_again"] = _rel(pm(share), want_eval[rows])
            pm.train()
            res["train"] = _rel(pm(share), want_train[rows])   # the whole batch's statistics, on dp too
            res["weights_split"] = label != "tp" or any(
                hasattr(v, "full_tensor") and v.to_local().shape != v.shape for v in pm.state_dict().values())
    # dropout: on after train(), off after eval(), whatever the capture mode
    for captured in (True, False):
        pm = autopar.parallelize(_net(0.5, captured), {"tp": 2}, (x,))
        pm.eval()            # first (train-mode calls move the running statistics)
        c, d = pm(x), pm(x)
        pm.train()
        a, b = pm(x), pm(x)
        twin = _net(0.5, True)
        twin(x), twin(x)        # the same running statistics as pm's after its two calls
        torch.manual_seed(7)
        seeded = pm(x)
        torch.manual_seed(7)    # the same masks as the model's, where dropout runs on whole values
        want = twin(x)
        out[f"dropout/{captured}"] = {"train_differs": not torch.equal(a, b), "eval_same": torch.equal(c, d),
                                      "eval": _rel(c, _net(0.5, False)(x)), "same_seed": _rel(seeded, want)}
    # a pipeline of the two blocks
    pm = autopar.parallelize(_net(0.0, True), {"pp": 2}, (x,), loss_fn=lambda o, t: (o - t).pow(2).mean(),
                             microbatches=1, schedule="gpipe")
    pm.eval()
    with torch.no_grad():
        try:
            pm.step(x, target=torch.zeros_like(x))
        except ConfigError as exc:
            out["pp_no_grad"] = str(exc)
    loss_eval = pm.step(x, target=torch.zeros_like(x))
    pm.zero_grad()
    pm.train()
    loss_train = pm.step(x, target=torch.zeros_like(x))
    out["pp"] = {"eval": loss_eval.item() if rank == 1 else None, "train": loss_train.item() if rank == 1 else None,
                 "want_eval": want_eval.pow(2).mean().item(), "want_train": want_train.pow(2).mean().item()}
    # a self.training branch: the other mode is refused with a typed error
    pm = autopar.parallelize(_net(0.0, True, Branchy), {"tp": 2}, (x,))
    try:
        pm.eval()
        out["branch"] = "switched"
    except ConfigError as exc:
        out["branch"] = str(exc)
    out["branch_train"] = _rel(pm(x), _net(0.0, True, Branchy)(x))
    # ranks that disagree: rank 1 asks for another ZeRO stage, then builds another model
    for case, kw in (("zero", {"zero_stage": rank}), ("model", {})):
        model = _net(0.0, True) if case == "zero" or rank == 0 else Net(0.0, blocks=3).double()
        t0 = time.monotonic()
        try:
            autopar.parallelize(model, {"dp": 2}, (x.chunk(2)[rank],), **kw)
            out[f"disagree/{case}"] = ("built", time.monotonic() - t0)
        except ConfigError as exc:
            out[f"disagree/{case}"] = (str(exc), time.monotonic() - t0)
    out.update(_data_axis(rank))
    out["hf"] = _hf_gpt2()
    out["state_dict_alone"] = _state_dict_alone(rank)
    dist.barrier()
    return out


def _hf_gpt2() -> dict:
    """A transformers GPT-2 with dropout everywhere, over tp=2, its model freed before the
    first switch (the other mode is captured from a structure-only copy)."""
    import copy
    import gc
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import hf_tiny
    model = hf_tiny.build("gpt2", torch.float64)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(model.config, key, 0.3)
    model = type(model)(model.config).double()
    ref = copy.deepcopy(model)
    data = hf_tiny.batch()
    pm = autopar.parallelize(model, {"tp": 2}, example_kwargs=data)
    del model
    gc.collect()
    pm.eval()
    ref.eval()
    eval_err = _rel(pm(**data).logits, ref(**data).logits)
    pm.train()
    ref.train()
    torch.manual_seed(3)
    a = pm(**data).logits
    torch.manual_seed(3)
    b = ref(**data).logits
    return {"eval": eval_err, "train_same_seed": _rel(a, b), "train_is_not_eval": _rel(a, ref.eval()(**data).logits)}


def _state_dict_alone(rank: int):
    """Under ZeRO-3 rank 0 calls state_dict() and rank 1 does not: rank 0 raises, it does not hang."""
    x = _batch()
    pm = autopar.parallelize(_net(0.0, True), {"dp": 2}, (x.chunk(2)[rank],), zero_stage=3)
    pm.collective_wait_s = 2.0
    if rank == 1:
        time.sleep(4.0)
        dist.all_reduce(torch.ones(1))      # the collective rank 0 gave up on: the group is whole again
        return None
    t0 = time.monotonic()
    try:
        pm.state_dict()
        return ("returned", time.monotonic() - t0)
    except PeerFailureError as exc:
        return (str(exc), time.monotonic() - t0)


def _train(pm_or_model, xs: list[torch.Tensor], lr: float = 0.1, steps: int = 3, opt=None) -> list[float]:
    """SGD-momentum steps on the mean over rows of the output squared; the losses."""
    losses = []
    for _ in range(steps):
        loss = sum(pm_or_model(x).pow(2).sum() for x in xs) / sum(x.shape[0] for x in xs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _data_axis(rank: int) -> dict:
    """BatchNorm statistics and uneven shares over dp=2, against one process on the global batch."""
    out = {}
    for label, rows in (("bn_even", (4, 4)), ("bn_uneven", (3, 2))):
        torch.manual_seed(3)
        x = torch.randn(sum(rows), WIDTH, dtype=torch.float64)
        mine = x[sum(rows[:rank]):sum(rows[:rank + 1])]
        ref = _net(0.0, True)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_losses = _train(ref, [x], opt=ref_opt)
        pm = autopar.parallelize(_net(0.0, True), {"dp": 2}, (mine,), zero_stage=rank * 0)
        opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
        first = pm(mine)
        want_first = _net(0.0, True)(x)[sum(rows[:rank]):sum(rows[:rank + 1])]
        pm.zero_grad()
        with torch.no_grad():      # undo that call's running-statistics update: both start alike
            for k, v in _net(0.0, True).state_dict().items():
                if "running" in k or "num_batches" in k:
                    dict(pm.named_buffers())[k].copy_(v)
        losses = []
        for _ in range(3):       # each rank's loss is the mean over its rows, as DDP users write it
            loss = pm(mine).pow(2).sum() / mine.shape[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in pm.state_dict().items()}
        want = ref.state_dict()
        out[label] = {"first": _rel(first, want_first),
                      "params": max(_rel(state[k], want[k]) for k in want if "running" not in k and "num_b" not in k),
                      "running": max(_rel(state[k], want[k]) for k in want if "running" in k),
                      "running_values": [state[k].tolist() for k in sorted(want) if "running" in k],
                      "ref_losses": ref_losses}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    torch.set_default_dtype(torch.float64)
    try:
        return run_ranks(_modes, 2, timeout_s=240)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("label", ["tp/train", "tp/eval", "dp/train", "dp/eval"])
def test_eval_and_train_match_the_model_whatever_the_capture_mode(results, label) -> None:
    for r in results:
        res = r[label]
        assert res["starts_in"] == label.endswith("train")
        assert res["eval"] < 1e-12 and res["eval_again"] < 1e-12, res
        assert res["train"] < 1e-12, res
        assert res["weights_split"]


@pytest.mark.parametrize("captured", [True, False])
def test_dropout_follows_the_mode(results, captured) -> None:
    for r in results:
        res = r[f"dropout/{captured}"]
        assert res["train_differs"] and res["eval_same"] and res["eval"] < 1e-12, res
        assert res["same_seed"] < 1e-12, res


def test_pipeline_modes(results) -> None:
    assert "cannot run under torch.no_grad()" in results[0]["pp_no_grad"]
    res = results[1]["pp"]
    assert abs(res["eval"] - res["want_eval"]) < 1e-12 * res["want_eval"]
    assert abs(res["train"] - res["want_train"]) < 1e-12 * res["want_train"]
    assert res["eval"] != pytest.approx(res["train"])


def test_a_training_branch_refuses_the_other_mode(results) -> None:
    for r in results:
        assert "cannot switch to eval mode" in r["branch"] and "self.training" in r["branch"], r["branch"]
        assert r["branch_train"] < 1e-12


@pytest.mark.parametrize("label", ["bn_even", "bn_uneven"])
def test_batch_norm_and_uneven_shares_match_one_process_on_the_global_batch(results, label) -> None:
    for r in results:
        res = r[label]
        assert res["first"] < 1e-12, res        # normalised by the global batch's statistics
        assert res["params"] < 1e-12, res       # after three SGD-momentum steps
        assert res["running"] < 1e-12, res
    assert results[0][label]["running_values"] == results[1][label]["running_values"]


@pytest.mark.parametrize("case", ["zero", "model"])
def test_disagreeing_ranks_get_one_typed_error(results, case) -> None:
    for r in results:
        msg, took = r[f"disagree/{case}"]
        assert "rank 1 called autopar.parallelize differently" in msg, msg
        assert ("zero_stage" if case == "zero" else "model") in msg.splitlines()[0]
        assert took < 10


def test_a_transformers_model_switches_modes_after_it_is_freed(results) -> None:
    for r in results:
        res = r["hf"]
        assert res["eval"] < 1e-12 and res["train_same_seed"] < 1e-12, res
        assert res["train_is_not_eval"] > 1e-3, res          # dropout is on again


def test_state_dict_under_zero3_on_one_rank_raises_instead_of_hanging(results) -> None:
    msg, took = results[0]["state_dict_alone"]
    assert "state_dict() under ZeRO-3 is collective" in msg and "fix:" in msg, msg
    assert took < 4.0


def test_only_a_model_that_can_depend_on_its_mode_is_captured_twice() -> None:
    from autopar import models
    from autopar.build.modes import mode_dependent
    assert not mode_dependent(models.build("gpt", {}, device="meta"))       # its code never reads the mode
    assert not mode_dependent(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert mode_dependent(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert mode_dependent(nn.Sequential(nn.BatchNorm1d(2)))
    assert mode_dependent(Branchy())                                        # this file mentions it
