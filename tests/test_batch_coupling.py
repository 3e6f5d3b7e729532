"""Models whose ops pair samples of the batch: refused when the batch is split, or the
approximation taken by name.

The analysis (``passes/batch_coupling.py``) on captured graphs: a contrastive loss (``a @ b.T``
over the batch), a softmax across samples and batch centering (``h - h.mean(0)``) are found,
each at its op; a per-sample model with attention, norms and a loss plus an auxiliary loss, a
``transformers`` Llama and ResNet (BatchNorm: synchronised, not a pairing) are not;
``transformers`` CLIP (its contrastive loss) is. In a real two-rank gloo world the contrastive
model is refused on dp=2 and on pp=2 with the planner's micro-batches (UnsupportedError offering
``DataOptions(cross_sample="local")``); with that option dp=2 trains exactly as one process
does on the loss it names, the mean over ranks of each rank's own contrastive loss, in float64
after three SGD-momentum steps.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.build.prepare import capture_model
from autopar.core.errors import UnsupportedError
from autopar.passes.batch_coupling import batch_coupling
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

ROWS, STEPS = 8, 3


class Contrastive(torch.nn.Module):
    """Two towers, every row of one scored against every row of the other (CLIP's loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(5, 8)

    def forward(self, x, y):
        ea, eb = F.normalize(self.a(x), dim=-1), F.normalize(self.b(y), dim=-1)
        logits = ea @ eb.t() * 4.0
        return F.cross_entropy(logits, torch.arange(x.shape[0]))


class BatchSoftmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 4)

    def forward(self, x):
        return torch.softmax(self.a(x), dim=0).pow(2).sum()


class Centered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 4)

    def forward(self, x):
        h = self.a(x)
        return torch.tanh(h - h.mean(0, keepdim=True)).pow(2).mean()


class PerSample(torch.nn.Module):
    """Attention over positions, norms, a softmax over features, a loss and an auxiliary loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(hf_tiny.VOCAB, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids, labels):
        h = self.norm(self.emb(ids))                          # [B, S, 8]
        att = torch.softmax(h @ h.transpose(1, 2), dim=-1)    # [B, S, S]: positions of one sample
        h = h + att @ h
        logits = self.head(h)
        aux = logits.float().pow(2).mean(dim=(0, 1)).sum() * 0.01
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + aux


def _capture(model, *args, **kwargs):
    return capture_model(model.double(), args, None, kwargs or None)


def _x(rows: int = ROWS, width: int = 6) -> torch.Tensor:
    return torch.randn(rows, width, dtype=torch.float64, generator=torch.Generator().manual_seed(width))


@pytest.mark.parametrize("model, op", [(Contrastive, "matmul"), (BatchSoftmax, "softmax"), (Centered, "sub")])
def test_pairings_are_found_at_their_op(model, op):
    args = (_x(), _x(width=5)) if model is Contrastive else (_x(),)
    found = batch_coupling(_capture(model(), *args))
    assert len(found) >= 1, found
    assert op in found[0].op, [str(f) for f in found]


def test_per_sample_models_have_none():
    ids = torch.randint(0, hf_tiny.VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    assert batch_coupling(_capture(PerSample(), ids, ids % 5)) == []
    data = hf_tiny.batch(rows=4, seq=8)
    assert batch_coupling(_capture(hf_tiny.build("llama", torch.float64), **data)) == []


def test_transformers_clip_and_resnet():
    from tests.matrix_models import architectures
    arch = architectures()
    clip = {k: v for k, v in arch["clip"].batch(4, 0).items()}
    clip["pixel_values"] = clip["pixel_values"].double()
    found = batch_coupling(_capture(arch["clip"].build(torch.float64, 7), **clip))
    assert [f.op for f in found] == ["aten.matmul.default"], [str(f) for f in found]
    image = arch["resnet"].batch(4, 0)
    image["pixel_values"] = image["pixel_values"].double()
    assert batch_coupling(_capture(arch["resnet"].build(torch.float64, 7), **image)) == []


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    return _x(), _x(width=5)


def _world(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    x, y = _pair()
    out: dict = {}
    for name, mesh in (("dp", {"dp": 2}), ("pp", {"pp": 2})):
        try:
            autopar.parallelize(Contrastive().double(), mesh, (x, y))
        except UnsupportedError as exc:
            out[name] = str(exc)
    mine = (x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
    pm = autopar.parallelize(Contrastive().double(), {"dp": 2}, mine,
                             options=autopar.DataOptions(cross_sample="local"))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.5, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        loss = pm(*mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["local"] = {"losses": losses, "state": {k: v.clone() for k, v in pm.state_dict().items()}}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_world, 2, timeout_s=300)


@pytest.mark.parametrize("mesh", ["dp", "pp"])
def test_split_batch_is_refused(ranks, mesh):
    for got in ranks:
        text = got.get(mesh, "")
        assert "pairs samples" in text and "cross_sample='local'" in text, text
        assert "aten.mm" in text or "aten.matmul" in text, text


def test_local_pairs_train_as_named(ranks):
    """cross_sample='local': the loss is the mean of each rank's own contrastive loss (each
    returns it: the token-mean exchange makes a mean loss the global batch's)."""
    x, y = _pair()
    ref = Contrastive().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    want_losses, whole = [], copy.deepcopy(ref)
    for _ in range(STEPS):
        parts = [ref(x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]) for r in range(2)]
        loss = sum(parts) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
    for r, got in enumerate(ranks):
        got = got["local"]
        # the model's own mean loss comes back as the global batch's mean: both ranks' own
        assert got["losses"] == pytest.approx(want_losses, rel=1e-9, abs=0)
        for k, v in ref.state_dict().items():
            assert torch.allclose(got["state"][k], v, rtol=1e-9, atol=1e-12), k
    # the approximation is real: the whole batch's pairs train to other weights
    opt = torch.optim.SGD(whole.parameters(), lr=0.5, momentum=0.9)
    for _ in range(STEPS):
        whole(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert not torch.allclose(whole.a.weight, ref.a.weight, rtol=1e-4)
