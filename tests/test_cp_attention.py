"""Context-parallel attention (runtime/cp.py), all-gather, all-to-all and ring kinds, against one process.

Two gloo ranks each hold their load-balanced share of the sequence (chunks r and 2cp-1-r of
2cp). Queries, keys and values (float64, seeded alike on every rank) run through
each kind (``allgather_attention``, ``alltoall_attention``, ``ring_attention``) on the shares and through SDPA on the whole sequence with the same mask;
a weighted sum of the outputs is the loss (its weights split alike). This rank's output rows and
the gradients of its queries, keys and values must equal one process's at its positions within
1e-12: causal, full, a sliding window, packed documents (block-diagonal), grouped-query keys
(2 key heads for 4 query heads, and 1, which cp does not divide). The layout helpers are checked without ranks, cp up to 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError
from autopar.runtime import cp as cpa
from autopar.runtime.launch import run_ranks

B, H, S, D = 2, 4, 16, 8
CASES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window=5),
    "documents": dict(causal=True, docs=True),
    "gqa": dict(causal=True, kv_heads=2),
    "mqa": dict(causal=True, kv_heads=1),
}
KINDS = {"allgather": cpa.allgather_attention, "alltoall": cpa.alltoall_attention, "ring": cpa.ring_attention}


def _inputs(kv_heads: int, docs: bool):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    # packed documents: lengths 5, 7, 4 in row 0 and 9, 7 in row 1 (ids restart per row)
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7]) if docs else None
    return q, k, v, w, ids


def _reference(q, k, v, w, ids, causal, window):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(S)
    mask = cpa.attention_mask(pos, pos, causal, window, ids[:, None] if ids is not None else None,
                     ids[:, None] if ids is not None else None)
    rep = H // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                           v.repeat_interleave(rep, 1), attn_mask=mask)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _case(name: str, kind: str) -> float:
    opts = CASES[name]
    causal, window = opts["causal"], opts.get("window")
    q, k, v, w, ids = _inputs(opts.get("kv_heads", H), opts.get("docs", False))
    want = _reference(q, k, v, w, ids, causal, window)
    cp, rank = dist.get_world_size(), dist.get_rank()
    ql, kl, vl = (cpa.shard(t, 2, cp, rank).requires_grad_() for t in (q, k, v))
    out = KINDS[kind](ql, kl, vl, group=dist.group.WORLD, causal=causal, window=window,
                                  doc_ids=cpa.shard(ids, 1, cp, rank) if ids is not None else None)
    (out * cpa.shard(w, 2, cp, rank)).sum().backward()
    got = (out.detach(), ql.grad, kl.grad, vl.grad)
    return max((g - cpa.shard(r, 2, cp, rank)).abs().max().item() for g, r in zip(got, want))


def _all(rank: int, world: int) -> dict[tuple[str, str], float]:
    torch.set_num_threads(1)
    return {(kind, name): _case(name, kind) for kind in KINDS for name in CASES}


@pytest.fixture(scope="module")
def errors() -> list[dict[tuple[str, str], float]]:
    return run_ranks(_all, 2, timeout_s=300)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_attention_equals_one_process(errors, kind, name):
    for rank, errs in enumerate(errors):
        assert errs[kind, name] <= 1e-12, (rank, kind, name, errs[kind, name])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_layout_balances_and_covers_the_sequence(cp):
    seq = 8 * cp
    held = [cpa.positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))            # every position once
    work = [int((p + 1).sum()) for p in held]        # keys a causal query row sees
    assert len(set(work)) == 1, work                  # the same causal work on every rank
    x = torch.randn(3, seq, 5)
    assert torch.equal(cpa.unshard([cpa.shard(x, 1, cp, r) for r in range(cp)], 1), x)


def test_a_sequence_that_does_not_cut_is_refused():
    with pytest.raises(ConfigError, match="pad the sequence"):
        cpa.positions(10, 4, 0)
