"""A model's own token-mean loss over the global batch under dp, with uneven padding.

Labels padded with -100 leave the two ranks different numbers of real tokens (rank 0: 27,
rank 1: 9 of 32). One process computes the mean over the global batch's 36 real tokens;
averaging the ranks' own means (what DDP gives) weighs rank 1's tokens three times too much.
Each case trains three SGD-momentum steps in float64 on dp=2 beside one process on the whole
batch: every step's loss (the same on both ranks) and the whole state dict afterwards must
match. The cases: a ``transformers`` Llama given ``labels`` (default options), the same under
ZeRO-3, a ``transformers`` Mixtral on ep=2 (the expert axis is a data axis for the batch),
Llama on pp=2 with the planner's schedule and micro-batches (they hold different numbers of
real tokens; the whole state compared on rank 0), the same returning logits with a
``loss_fn`` that ignores -100 (traced once to find its token count), a plain module
calling ``F.cross_entropy`` with its own ``ignore_index``, and the same with
``reduction="sum"`` (the global sum is the ranks' sums; their gradients are not averaged
away). Without gradients a rank gets its own rows' loss (no exchange, so one rank may
evaluate alone).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

STEPS, TOL = 3, 1e-9
PAD = {0: 1, 1: 6}         # rank -> padded positions at the end of each of its two rows (of 8)


def _data() -> dict:
    data = hf_tiny.batch(rows=4, seq=8)
    for rank, pad in PAD.items():
        data["labels"][2 * rank:2 * rank + 2, 8 - pad:] = -100
    return data


class Tagger(torch.nn.Module):
    """Token classification with its own loss (ignore_index=7 marks padding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(hf_tiny.VOCAB, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=7), logits


class SumTagger(Tagger):
    """The same with a summed loss: over the global batch, the sum of every rank's."""

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=7, reduction="sum"), logits


def _tagger_data() -> dict:
    data = _data()
    data["labels"] = torch.where(data["labels"] == -100, 7, data["labels"] % 5)
    return data


def _mixtral() -> torch.nn.Module:
    """A transformers Mixtral given labels (dropless routing: each token's experts as in one process)."""
    import transformers
    from tests.test_ep_hf import _config
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("mixtral", "batched_mm"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.double()


CASES = {     # name -> (model, batch, mesh, options)
    "llama": (lambda: hf_tiny.build("llama", torch.float64), _data, {"dp": 2}, {}),
    "llama_zero3": (lambda: hf_tiny.build("llama", torch.float64), _data, {"dp": 2}, dict(zero_stage=3)),
    "tagger": (lambda: Tagger().double(), _tagger_data, {"dp": 2}, dict(zero_stage=3)),
    "tagger_sum": (lambda: SumTagger().double(), _tagger_data, {"dp": 2}, {}),
    "mixtral_ep": (_mixtral, _data, {"ep": 2}, {}),
    "llama_pp": (lambda: hf_tiny.build("llama", torch.float64), _data, {"pp": 2}, {}),
    "logits_pp_loss_fn": (lambda: hf_tiny.Logits(hf_tiny.build("llama", torch.float64)), _data, {"pp": 2},
                          dict(loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))),
}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out[0]


def _train(model, data, opt, step) -> list[float]:
    losses = []
    for _ in range(STEPS):
        loss = _loss(step(model, data))
        if loss.requires_grad:          # a pipeline's step ran backward itself
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _call(model, data, kw):
    """One training forward: the model's own loss, or the loss_fn on its logits."""
    fn = kw.get("loss_fn")
    if fn is None:
        return model(**data)
    return (fn(model(data["input_ids"]), data["labels"]),)


def _case(name: str) -> dict:
    rank = dist.get_rank()
    build, data_of, mesh, kw = CASES[name]
    data = data_of()
    piped = "pp" in mesh
    mine = data if piped else {k: v[2 * rank:2 * rank + 2] for k, v in data.items()}
    if "loss_fn" in kw:
        pm = autopar.parallelize(build(), mesh, (mine["input_ids"],), **kw)
    else:
        pm = autopar.parallelize(build(), mesh, example_kwargs=mine, **kw)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    alone = None
    if not piped:
        with torch.no_grad():
            alone = _loss(pm(**mine)).item()           # this rank's own mean, no exchange
    if "loss_fn" in kw:
        step = lambda m, d: (m.step(d["input_ids"], target=d["labels"]),)       # noqa: E731
    else:
        step = (lambda m, d: (m.step(**d),)) if piped else (lambda m, d: m(**d))
    losses = _train(pm, mine, opt, step)
    if piped:       # the whole state on rank 0 (each pipeline rank holds its stages' part)
        state = autopar.full_state_dict(pm)
        return {"losses": losses, "alone": alone, "state": state, "microbatches": pm.microbatches,
                "schedule": pm.schedule_name}
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in pm.state_dict().items()}
    return {"losses": losses, "alone": alone, "state": state}


def _all(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _case(name) for name in CASES}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_all, 2, timeout_s=400)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(CASES))
def test_token_mean_loss_is_the_global_batchs(ranks, name):
    build, data_of, _, kw = CASES[name]
    data = data_of()
    ref = build()
    with torch.no_grad():
        own = [_loss(_call(ref, {k: v[2 * r:2 * r + 2] for k, v in data.items()}, kw)).item() for r in PAD]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = _train(ref, data, opt, lambda m, d: _call(m, d, kw))
    # the padding matters: the ranks' average of their own means is not the global mean
    assert abs(sum(own) / 2 - want[0]) > 1e-3, (own, want[0])
    for r, got in enumerate(ranks):
        got = got[name]
        if got["alone"] is not None:
            assert got["alone"] == pytest.approx(own[r], rel=1e-6, abs=0)
        if "microbatches" in got:      # the planner's split puts the padding unevenly on micro-batches
            assert got["microbatches"] > 1, got["microbatches"]
        # transformers computes its loss in float32 (logits.float()) even for a float64 model
        assert got["losses"] == pytest.approx(want, rel=1e-6, abs=0), (got["losses"], want)
        ref_state = ref.state_dict()
        if not got["state"] and r > 0:
            continue
        assert sorted(got["state"]) == sorted(ref_state)
        worst = max(_rel(got["state"][k], ref_state[k]) for k in ref_state if ref_state[k].is_floating_point())
        assert worst < TOL, worst
