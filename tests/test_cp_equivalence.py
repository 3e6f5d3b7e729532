"""Context parallelism through ``autopar.parallelize``: ``transformers`` models trained on a ``cp``
axis against one process on the global batch.

Each case builds a tiny library model in float64, cuts the global batch with
``autopar.data.shard`` (each rank its load-balanced tokens of every row, and its rows on a dp
axis), trains three SGD-momentum steps with the model's own loss and compares the loss of every
step and every parameter after the steps with one process's (``use_cache=False`` there, as
autopar captures: with the cache on, ``transformers`` ignores packed position ids).

Models and what they exercise: Llama (rotary, grouped-query keys), Qwen2 (q/k/v biases),
Mistral with a sliding window (4) shorter than the sequence (16), Gemma 2 (written-out attention
with soft-capping, alternating sliding layers), GPT-2 (learned positions), Mixtral (experts on an
ep axis beside cp) and a hand-written model whose written-out attention is all float64. Kinds:
ring, all-gather, all-to-all, and the cost model's pick where none is given; cp = 2 and 4; cp x tp
(weights asserted split), dp x cp with ZeRO-3, cp x ep (experts asserted split), pp x cp (the
pipeline's own schedule); recomputation of whole layers (``full``, ``layers:1``, ``pointwise``;
each context-axis attention asserted inside a recomputed layer, as many layers as asked); a
padded batch (attention mask with zeros, padded labels) and a packed one (position ids
restarting per document).

Tolerances: parameters within 1e-10 (float64), except where ``transformers`` computes in float32
inside the layers, 1e-8: Gemma 2 (its eager attention takes the softmax in float32) and cp x tp
(the RMSNorm runs in float32 and the tensor axis sums its input in another order; the tensor
axis alone gives the same 1e-9, see test_ep_hf.py), so a value summed in another order can round to
a neighbouring float32. The loss within 2e-6 relative (``transformers`` computes it from float32 logits).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.runtime import cp as cp_runtime
from autopar.runtime.launch import run_ranks
from tests import hf_tiny

STEPS, SEQ, ROWS = 3, 16, 4
PARAM_TOL, PARAM_TOL_F32, LOSS_RTOL = 1e-10, 1e-8, 2e-6

# name -> (world, architecture, mesh, kind (None: the cost model's), batch form, parallelize keywords)
CASES = {
    "llama-allgather": (2, "llama", {"cp": 2}, "allgather", "plain", {}),
    "qwen2-ring": (2, "qwen2", {"cp": 2}, "ring", "plain", {}),
    "mistral-window-alltoall": (2, "mistral", {"cp": 2}, "alltoall", "plain", {}),
    "gemma2-softcap": (2, "gemma2", {"cp": 2}, None, "plain", {}),
    "gpt2-ring": (2, "gpt2", {"cp": 2}, "ring", "plain", {}),
    "llama-padded-ring": (2, "llama", {"cp": 2}, "ring", "padded", {}),
    "mistral-packed": (2, "mistral", {"cp": 2}, None, "packed", {}),
    "pooled-classifier": (2, "pooled", {"cp": 2}, "ring", "classes", {}),
    "llama-cp4-ring": (4, "llama", {"cp": 4}, "ring", "plain", {}),
    "qwen2-cp4-alltoall": (4, "qwen2", {"cp": 4}, "alltoall", "packed", {}),
    "mistral-dp-cp-zero3": (4, "mistral", {"dp": 2, "cp": 2}, "allgather", "padded", dict(zero_stage=3)),
    "llama-cp-tp": (4, "llama", {"cp": 2, "tp": 2}, None, "plain", dict(memory_budget=1)),
    "mixtral-cp-ep": (4, "mixtral", {"cp": 2, "ep": 2}, "ring", "plain", {}),
    "llama-pp-cp-padded": (4, "llama", {"pp": 2, "cp": 2}, None, "padded", {}),
    "gpt2-pp-cp-packed-alltoall": (4, "gpt2", {"pp": 2, "cp": 2}, "alltoall", "packed", {}),
    "llama-allgather-full": (2, "llama", {"cp": 2}, "allgather", "plain", dict(recompute="full")),
    "qwen2-alltoall-layers1": (2, "qwen2", {"cp": 2}, "alltoall", "padded", dict(recompute="layers:1")),
    "gpt2-ring-pointwise": (2, "gpt2", {"cp": 2}, "ring", "plain", dict(recompute="pointwise")),
}


class PooledClassifier(nn.Module):
    """Causal attention, then the mean over the sequence fed to a classifier: a sum over the
    sequence read as a whole value, which the rewrite must compute on the whole sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.head = nn.Embedding(hf_tiny.VOCAB, 32), nn.Linear(32, 96), nn.Linear(32, 5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (u.view(b, t, 4, 8).transpose(1, 2) for u in self.qkv(x).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32)
        return nn.functional.cross_entropy(self.head(torch.tanh(x + y).mean(1)), labels)


def _model(arch: str) -> nn.Module:
    if arch == "pooled":
        return PooledClassifier().to(torch.float64)
    return hf_tiny.build(arch, torch.float64)


def _batch(form: str) -> dict[str, torch.Tensor]:
    data = hf_tiny.batch(rows=ROWS, seq=SEQ)
    data["labels"][0, :5] = -100                      # a row with fewer real tokens
    if form == "padded":
        mask = torch.ones_like(data["input_ids"])
        mask[1, -6:] = 0
        mask[2, -3:] = 0
        data["attention_mask"] = mask
        data["labels"] = data["labels"].masked_fill(mask == 0, -100)
    if form == "classes":                             # one class per row
        data["labels"] = torch.arange(ROWS) % 5
    if form == "packed":                              # documents of 5, 7 and 4 tokens in every row
        pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(SEQ - 12)])
        data["position_ids"] = pos.expand(ROWS, SEQ).clone()
    return data


def _loss(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _reference(arch: str, form: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, data = _model(arch), _batch(form)
    extra = {} if arch == "pooled" else {"use_cache": False}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model(**data, **extra))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _case(name: str) -> dict:
    _, arch, mesh, kind, form, kw = CASES[name]
    losses, want = _reference(arch, form)
    part = autopar.data.shard(_batch(form), mesh)
    options = [autopar.ContextOptions(kind=kind)] if kind is not None else None
    pm = autopar.parallelize(_model(arch), mesh, example_kwargs=part, options=options, **kw)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    got = []
    for _ in range(STEPS):
        if "pp" in mesh:               # the pipeline's own schedule (the planner's) runs forward and backward
            loss = pm.step(**part)
        else:
            loss = _loss(pm(**part))
            loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    state = pm.state_dict()
    regions = getattr(pm, "_recompute", None) or {}
    attention = [n for n in pm.graph_module.graph.nodes if n.target is cp_runtime.graph_attention] \
        if "pp" not in mesh else []
    err = 0.0
    for k, v in want.items():
        t = state[k].full_tensor() if hasattr(state[k], "full_tensor") else state[k]
        if v.is_floating_point():
            err = max(err, (t - v).abs().max().item())
    return {"kind": pm.plan.cp_kind, "losses": got, "want_losses": losses, "param_err": err,
            "keys": sorted(state) == sorted(want), "tokens": part["input_ids"].shape[1],
            "split": sorted(f for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S(")),
            "experts": sorted(getattr(pm, "expert_storage", {}) or {}),
            "held": {f: tuple(p.shape) for f, p in pm.named_parameters()}, "rank": dist.get_rank(),
            "regions": len(set(regions.values())), "attention": len(attention),
            "attention_recomputed": sum(n in regions for n in attention)}


def _cases(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _case(name) for name, case in CASES.items() if case[0] == world}


def _world(size: int) -> list[dict]:
    return run_ranks(_cases, size, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_cp_trains_as_one_process(world2, world4, name):
    size, arch, mesh, kind, _, _ = CASES[name]
    ranks = [r[name] for r in (world2 if size == 2 else world4)]
    tol = PARAM_TOL_F32 if arch == "gemma2" or "tp" in mesh else PARAM_TOL
    for r in ranks:
        assert r["tokens"] == SEQ // mesh["cp"], r["tokens"]          # each rank held its share of the sequence
        assert r["keys"], "state_dict keys differ from the model's"
        if kind is not None:
            assert r["kind"] == kind, r["kind"]
        for a, b in zip(r["losses"], r["want_losses"]):
            assert abs(a - b) <= LOSS_RTOL * abs(b), (r["rank"], r["losses"], r["want_losses"])
        assert r["param_err"] <= tol, (r["rank"], r["param_err"])
        if "tp" in mesh:
            assert len(r["split"]) >= 4, r["split"]                   # weights really were split
        if "ep" in mesh:
            assert r["experts"], "no expert was split over ep"
        recompute = CASES[name][5].get("recompute")
        if recompute in ("full", "pointwise"):          # every layer re-runs, its cp attention with it
            assert r["regions"] == 2 and r["attention_recomputed"] == r["attention"] == 2, r
        elif recompute == "layers:1":
            assert r["regions"] == 1 and r["attention_recomputed"] == 1 and r["attention"] == 2, r
    if arch == "gemma2":                                           # written-out attention runs as all-gather
        assert ranks[0]["kind"] == "allgather", ranks[0]["kind"]
    if "ep" in mesh:                                               # each ep rank holds other experts
        held = [r["held"] for r in ranks]
        expert = ranks[0]["experts"][0]
        assert held[0][expert] != hf_tiny.build(arch).state_dict()[expert].shape or \
            len({str(h) for h in held}) > 1, held[0][expert]


def test_cp_refusals(fake_world):
    """Axes out of order, ContextOptions without a cp axis, and a sequence that does not cut into
    2 x cp chunks are typed errors before anything runs."""
    fake_world(4)
    model, data = hf_tiny.build("llama"), hf_tiny.batch(rows=4, seq=SEQ)
    with pytest.raises(autopar.MeshError, match="order"):
        autopar.parallelize(model, {"cp": 2, "dp": 2}, example_kwargs=data)
    with pytest.raises(autopar.ConfigError, match="cp_kind"):
        autopar.parallelize(model, {"dp": 4}, example_kwargs=data, options=autopar.ContextOptions(kind="ring"))
    with pytest.raises(autopar.ConfigError, match="kind"):
        autopar.ContextOptions(kind="tree")
    with pytest.raises(autopar.InputMismatchError, match="chunks"):
        autopar.data.shard(hf_tiny.batch(rows=4, seq=10), {"cp": 4}, rank=0)
    got = autopar.data.shard(data, {"dp": 2, "cp": 2}, rank=3)        # dp share 1, cp share 1
    assert got["input_ids"].tolist() == data["input_ids"][2:, [4, 5, 6, 7, 8, 9, 10, 11]].tolist()


def _across(rank: int, world: int, root: str) -> dict:
    """Train Llama two SGD-momentum steps on cp=2 and save; load the checkpoint under dp=2 (no
    context axis) and under cp=2 with another kind, and train one more step on each."""
    import autopar.checkpoint  # noqa: F401 - autopar.save / autopar.load
    torch.set_num_threads(1)
    data = _batch("plain")
    out = {}
    pm = autopar.parallelize(_model("llama"), {"cp": 2}, example_kwargs=autopar.data.shard(data, {"cp": 2}),
                             options=autopar.ContextOptions(kind="ring"))
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    part = autopar.data.shard(data, {"cp": 2})
    for _ in range(2):
        pm(**part).loss.backward()
        opt.step()
        opt.zero_grad()
    autopar.save(pm, opt, root, step=2)
    from autopar.core.plans import Plan
    plan = Plan.from_json(pm.plan.to_json())                     # the plan, saved and read back, re-applies
    again = autopar.parallelize(_model("llama"), {"cp": 2}, example_kwargs=part, plan=plan)
    out["reapplied"] = (plan.cp_axis, plan.cp_kind, again.plan.cp_kind)
    for name, mesh, kind in (("dp", {"dp": 2}, None), ("cp-allgather", {"cp": 2}, "allgather")):
        part = autopar.data.shard(data, mesh)
        pm2 = autopar.parallelize(hf_tiny.build("llama", torch.float64, seed=7), mesh, example_kwargs=part,
                                  options=autopar.ContextOptions(kind=kind) if kind else None)
        opt2 = autopar.optimizer(pm2, torch.optim.SGD, lr=0.1, momentum=0.9)
        autopar.load(pm2, opt2, root)
        pm2(**part).loss.backward()
        opt2.step()
        out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                     for k, v in pm2.state_dict().items()}
    return out


def test_a_checkpoint_loads_across_cp_degrees(tmp_path):
    """Saved on cp=2 (ring), loaded on dp=2 and on cp=2 (all-gather): the third step lands where
    one process's third step does (momentum buffers restored), within 1e-10. The plan with its
    context axis, saved as JSON and read back, re-applies with its kind."""
    model, data = _model("llama"), _batch("plain")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(**data, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    ranks = run_ranks(_across, 2, str(tmp_path / "ckpt"), timeout_s=600)
    for r in ranks:
        assert r.pop("reapplied") == ("cp", "ring", "ring")
        for name, got in r.items():
            assert sorted(got) == sorted(want), name
            err = max((got[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point())
            assert err <= PARAM_TOL, (name, err)
