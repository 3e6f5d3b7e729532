"""The overlap scheduling pass moves issue and wait positions and changes no result."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import models
from autopar.build.prepare import planned_graph
from autopar.runtime.dp import grad_reduce_issue, grad_reduce_wait, param_gather_issue, param_gather_wait
from autopar.runtime.launch import run_ranks

GPT = dict(layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
WIDE = dict(layers=2, hidden=128, heads=4, vocab=64, max_seq=16)   # its matrices are over 64 KiB, checksummed one by one
BUCKET = 6000   # several buckets on this model
STEPS = 2       # the second AdamW step runs on the moments the first left
TRAIN_STAGES = (0, 2, 3)


def _graph(stage: int, overlap: bool):
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    args, _ = models.example_inputs(model, 2, 8, device="cpu")
    gm, _ = planned_graph(model, {"dp": 2}, args, after="schedule", zero_stage=stage, overlap=overlap,
                          bucket_bytes=BUCKET)
    nodes = list(gm.graph.nodes)
    return nodes, {n: i for i, n in enumerate(nodes)}


def _first_reader(node, pos) -> int:
    items = [u for u in node.users if u.target is operator.getitem]
    return min(pos[r] for g in items for r in g.users)


@pytest.mark.parametrize("stage", [0, 2])
def test_gradient_reductions_are_issued_before_first_use_only_with_overlap(stage):
    off_nodes, off = _graph(stage, overlap=False)
    on_nodes, on = _graph(stage, overlap=True)
    issues_off = [n for n in off_nodes if n.target is grad_reduce_issue]
    issues_on = [n for n in on_nodes if n.target is grad_reduce_issue]
    assert len(issues_on) == len(issues_off) >= 3
    for n in issues_off:     # unscheduled: every issue right after its wait at the top of forward
        wait = n.args[2]
        assert wait.target is grad_reduce_wait and off[n] == off[wait] + 1
        assert off[n] < min(i for m, i in off.items() if m.op == "call_function" and m.target not in (
            grad_reduce_issue, grad_reduce_wait, operator.getitem)) + 1
    first_compute = min(i for m, i in on.items() if m.op == "call_function" and m.target not in (
        grad_reduce_issue, grad_reduce_wait, operator.getitem))
    moved = 0
    for n in issues_on:      # scheduled: just before the bucket's first reader (so backward issues it early)
        first = _first_reader(n, on)
        # only other buckets' issues (first read by the same node) may sit in between
        assert on[n] < first and all(on_nodes[i].target in (operator.getitem, grad_reduce_issue)
                                     for i in range(on[n] + 1, first))
        moved += on[n] > first_compute
    assert moved >= len(issues_on) // 2, "the schedule left the issues at the top"
    waits_on = [n for n in on_nodes if n.target is grad_reduce_wait]
    assert max(on[w] for w in waits_on) < min(on[n] for n in issues_on), "waits stay at the top (end of backward)"


def test_zero3_gathers_are_prefetched_one_bucket_ahead_only_with_overlap():
    off_nodes, off = _graph(3, overlap=False)
    on_nodes, on = _graph(3, overlap=True)
    waits_on = [n for n in on_nodes if n.target is param_gather_wait]
    waits_off = [n for n in off_nodes if n.target is param_gather_wait]
    assert len(waits_on) == len(waits_off) >= 3
    for w in waits_off:       # unscheduled: issue right before its wait, just before first use
        assert off[w.args[2]] == off[w] - 1
    ahead = 0
    for k, w in enumerate(waits_on):
        issue = w.args[2]
        assert issue.target is param_gather_issue
        assert on[w] < _first_reader(w, on)
        if k:
            prev = waits_on[k - 1]
            # issued after the previous bucket's wait, before that bucket's first use
            assert on[prev] < on[issue] <= _first_reader(prev, on)
            ahead += on[w] - on[issue] > 1
    assert ahead >= 1, "no gather was issued ahead of its wait"


def _train(rank: int, world: int, stage: int, overlap: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.build("gpt", GPT, device="cpu")
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, 4, 8, device="cpu")
    local = tuple(a.chunk(world)[dist.get_rank()] for a in args)
    pm = autopar.parallelize(model, {"dp": world}, local, zero_stage=stage, overlap=overlap, bucket_bytes=BUCKET)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = pm(*local).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in pm.state_dict().items()}}


def _synced(rank: int, seed: int, nudge: bool) -> dict:
    """parallelize a GPT built with ``seed`` (rank 1 moving one weight by one ulp with
    ``nudge``), counting the broadcasts that sync_params sends; the state the rank ends with."""
    torch.manual_seed(seed)
    model = models.build("gpt", WIDE, device="cpu")
    if nudge and rank == 1:
        with torch.no_grad():
            w = model.get_parameter("layers.1.mlp.fc.weight")
            w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    args, _ = models.example_inputs(model, 2, 8, device="cpu")
    sent = []
    real = dist.broadcast

    def counting(tensor, *a, **k):
        sent.append(tuple(tensor.shape))
        return real(tensor, *a, **k)

    dist.broadcast = counting
    try:
        pm = autopar.parallelize(model, {"dp": 2}, args)
    finally:
        dist.broadcast = real
    return {"sent": sent, "state": {k: v.clone() for k, v in pm.state_dict().items()}}


SYNC_CASES = {"seeded apart": (None, False), "one ulp apart": (0, True), "equal": (0, False)}


def _both(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    out: dict = {stage: (_train(rank, world, stage, True), _train(rank, world, stage, False)) for stage in stages}
    out["sync"] = {name: _synced(rank, rank if seed is None else seed, nudge)
                   for name, (seed, nudge) in SYNC_CASES.items()}
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    """One world of two ranks trains every stage with overlap on and off (and checks sync_params)."""
    return run_ranks(_both, 2, TRAIN_STAGES, timeout_s=600)


def test_checksums_see_any_changed_word_and_moved_values():
    """autopar.runtime.agreement.checksums: flipping any one bit of any word (the sign bit included)
    changes both sums; swapping two different values, in one row or one column, changes one;
    the sums are those of exact integer arithmetic modulo 2**64."""
    from autopar.runtime.agreement import _PERIOD as P, checksums
    x = torch.randn(2 * P * 3 + 5, generator=torch.Generator().manual_seed(0))   # 3 rows of words, a rest and a tail
    ref = checksums(x)
    words = x.view(torch.int32)
    for pos in (0, 1, 2 * P - 1, 2 * P, 4 * P + 1, 6 * P, 6 * P + 3, x.numel() - 1):
        for bit in (0, 7, 22, 30, 31):
            y = x.clone()
            y.view(torch.int32)[pos] = words[pos] ^ (1 << bit) if bit < 31 else words[pos] ^ -(1 << 31)
            got = checksums(y)
            assert (got != ref).all(), f"flipping bit {bit} of element {pos} went unseen: {got} vs {ref}"
    for a, b in ((0, 3), (0, 2 * P), (1, 4 * P + 1), (5, 777), (10, 6 * P + 1)):   # same row, same column, ...
        y = x.clone()
        y[a], y[b] = x[b], x[a]
        assert (checksums(y) != ref).any(), f"swapping elements {a} and {b} went unseen"
    assert torch.equal(checksums(x.clone()), ref)
    assert checksums(torch.ones(3, dtype=torch.bool)).shape == (2,)
    w = x[:-1].view(torch.int64).tolist()                # the definition, in Python integers
    by_col = sum((2 * (k % P) + 1) * v for k, v in enumerate(w))
    by_both = sum((2 * (k // P) + 1) * (2 * (k % P) + 1) * v for k, v in enumerate(w))
    tail = x[-1:].view(torch.uint8).tolist()
    by_col += sum((2 * j + 1) * v for j, v in enumerate(tail))
    by_both += sum((2 * (len(w) // P + 1) + 1) * (2 * j + 1) * v for j, v in enumerate(tail))
    wrap = lambda v: (v + 2 ** 63) % 2 ** 64 - 2 ** 63
    assert ref.tolist() == [wrap(by_col), wrap(by_both)]


@pytest.mark.parametrize("name", list(SYNC_CASES))
def test_every_rank_takes_rank0_weights_sending_only_what_differs(world2, name):
    """sync_params: ranks seeded apart, or one weight one ulp apart, end with rank 0's values;
    only the tensors whose checksums differ travel (none when the ranks already agree)."""
    from autopar.runtime.agreement import _SMALL
    torch.manual_seed(0)
    want = models.build("gpt", WIDE, device="cpu").state_dict()
    torch.manual_seed(1)
    other = models.build("gpt", WIDE, device="cpu").state_dict()
    ranks = [r["sync"][name] for r in world2]
    for rank, got in enumerate(ranks):
        assert sorted(got["state"]) == sorted(want)
        for k, v in got["state"].items():
            assert torch.equal(v, want[k]), f"{name}: rank {rank}'s {k} is not rank 0's"
    sent = ranks[0]["sent"]
    assert sent == ranks[1]["sent"], "the ranks broadcast different tensors"
    if name == "equal":
        assert sent == []
    elif name == "one ulp apart":
        assert sent == [tuple(want["layers.1.mlp.fc.weight"].shape)]
    else:     # the random matrices one by one, and the small tensors (embeddings here) as one group
        small = [k for k, v in want.items() if v.numel() * v.element_size() < _SMALL]
        assert small and any(not torch.equal(want[k], other[k]) for k in small)
        assert sent == [tuple(v.shape) for k, v in want.items() if k in small or not torch.equal(v, other[k])]


@pytest.mark.parametrize("stage", TRAIN_STAGES)
def test_overlap_on_and_off_train_identically(world2, stage):
    for on, off in (by_stage[stage] for by_stage in world2):
        assert len(on["losses"]) == STEPS
        assert on["losses"] == off["losses"]
        for k, v in on["state"].items():
            assert torch.equal(v, off["state"][k]), f"{k} differs between overlap on and off"


@pytest.mark.parametrize("zero", ["0", "3"])
def test_dump_after_schedule_shows_buckets_for_a_tied_embedding_model(capsys, zero):
    """gpt2-small ties its embedding to the LM head: that bucket's first and last uses are
    the first and last ops, and the prefetch order must still be valid."""
    from autopar.cli import main
    code = main(["dump", "--model", "gpt2-small", "--set", "layers=2", "--batch", "2", "--seq", "16",
                 "--mesh", "dp=2,tp=2", "--after", "schedule", "--zero", zero, "-q", "--summary"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("schedule dp.b")]
    assert code == 0 and len(rows) >= 3 and f"ZeRO-{zero}" in out
    assert all(("forward issue" if zero == "3" else "forward position") in r for r in rows)
