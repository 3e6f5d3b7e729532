"""Every placement transition on real gloo ranks: ``torch.ops.autopar.redistribute`` must
carry a known whole tensor from any placement to any other, in forward (values) and in
backward (gradients), exactly.

A case places the whole tensor as ``src`` (``Partial``: random integer pieces that sum to
it), redistributes, and rebuilds a whole tensor from every rank's result as ``dst`` says
(concatenate shards, sum partials, and check a replicated value is the same on every rank).
Backward feeds a whole gradient placed as ``dst.grad`` and rebuilds the input's gradient as
``src.grad`` says. Data is integer-valued, so every sum is exact in every dtype and results
compare with ``torch.equal``. One world per size runs every case inside its ranks and
gathers all results with one collective at the end (starting a world is the slow part).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 - before any functional collective

import autopar.runtime.collectives  # noqa: F401 - registers torch.ops.autopar.redistribute
from autopar.core.placement import NONE, Partial, Placement, Replicate, Shard, Spec, comm_bytes, transition
from autopar.runtime.launch import run_ranks

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def shapes(n: int) -> list[tuple[int, ...]]:
    """1-d, 2-d and 3-d shapes with dims of size n*k, plus one dim that cannot be split."""
    return [(3 * n,), (2 * n, n), (n, 1, 2 * n), (n, 2 * n, 3)]


def specs(shape: tuple[int, ...], n: int) -> list[Spec]:
    """Every value placement with every gradient placement it may have, sharding only the
    dims that ``n`` divides; ``S(-1)`` too."""
    out = [Spec.parse("R"), Spec.parse("R/gP"), Spec.parse("P")]
    out += [Spec.parse(f"S({d})") for d in range(len(shape)) if shape[d] % n == 0]
    if shape[-1] % n == 0:
        out.append(Spec.parse("S(-1)"))
    return out


# ---- placing a whole tensor and rebuilding it from placed pieces, independently of autopar ----

def place(whole: torch.Tensor, p: Placement, rank: int, n: int, gen: torch.Generator, strided: bool) -> torch.Tensor:
    """This rank's piece of ``whole`` placed ``p``; ``gen`` is seeded alike on all ranks."""
    if isinstance(p, Shard):
        piece = whole.chunk(n, p.dim)[rank]
    elif isinstance(p, Partial):
        pieces = [torch.randint(-8, 9, whole.shape, generator=gen).to(whole.dtype) for _ in range(n - 1)]
        pieces.append(whole - sum(pieces))
        piece = pieces[rank]
    else:
        piece = whole
    return non_contiguous(piece) if strided else piece.clone()


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values, laid out with a stride of 2 in the last dim."""
    out = torch.zeros(t.shape + (2,), dtype=t.dtype)[..., 0]
    out.copy_(t)
    return out


def rebuild(pieces: list[torch.Tensor], p: Placement) -> tuple[torch.Tensor | None, str]:
    """(the whole tensor, "") from every rank's piece placed ``p``, or (None, what is wrong)."""
    if isinstance(p, Partial):
        return torch.stack(pieces).sum(0), ""   # integer-valued: exact in any order
    if isinstance(p, Shard):
        return torch.cat(pieces, dim=p.dim), ""
    same = all(q.shape == pieces[0].shape and torch.equal(q, pieces[0]) for q in pieces)
    return (pieces[0], "") if same else (None, "replicated tensor differs between ranks")


# ---- the cases ----

@dataclass
class Case:
    """One redistribute: its name, and per direction (placement, expected whole)."""

    name: str
    checks: list[tuple[str, Placement, torch.Tensor]] = field(default_factory=list)


def run_case(rank: int, n: int, shape: tuple[int, ...], dtype: torch.dtype, src: Spec, dst: Spec,
             strided: bool, seed: int) -> tuple[Case, list[torch.Tensor], list[str]]:
    """Forward and backward of one redistribute on this rank: the case, this rank's
    (output, input gradient) and what already went wrong locally."""
    gen = torch.Generator().manual_seed(seed)
    value = torch.randint(-8, 9, shape, generator=gen).to(dtype)
    grad = torch.randint(-8, 9, shape, generator=gen).to(dtype)
    group = dist.group.WORLD.group_name
    x = place(value, src.value, rank, n, gen, strided).requires_grad_(True)
    upstream = place(grad, dst.grad, rank, n, gen, strided)
    out = torch.ops.autopar.redistribute(x, _spell(src), _spell(dst), group, n)
    out.backward(upstream)
    case = Case(f"{_spell(src)} -> {_spell(dst)} {shape} {dtype} {'strided' if strided else 'contiguous'}",
                [("forward", dst.value, value), ("backward", src.grad, grad)])
    fake = torch.ops.autopar.redistribute(x.detach().to("meta"), _spell(src), _spell(dst), group, n)
    problems = [] if fake.shape == out.shape else [f"meta shape {tuple(fake.shape)} != real {tuple(out.shape)}"]
    return case, [out.detach(), x.grad], problems


def _spell(s: Spec) -> str:
    return f"{s.value}/g{s.grad}"


def every_case(rank: int, n: int, dtypes: tuple[torch.dtype, ...]) -> list[str]:
    """Run every (shape, dtype, src, dst) case on this rank, contiguous and strided inputs
    in turn, then gather all the results once and rebuild each whole tensor; the failures,
    named (rank 0 reports)."""
    cases, mine, failures = [], [], []
    for shape in shapes(n):
        choices = specs(shape, n)
        for dtype in dtypes:
            for src in choices:
                for dst in choices:
                    case, tensors, problems = run_case(rank, n, shape, dtype, src, dst, len(cases) % 2 == 1,
                                                       seed=len(cases))
                    cases.append(case)
                    mine.append(tensors)
                    failures += [f"{case.name}: {p}" for p in problems]
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine)   # one collective for all the checks
    for i, case in enumerate(cases):
        for j, (direction, placement, whole) in enumerate(case.checks):
            got, why = rebuild([everyone[r][i][j] for r in range(n)], placement)
            if why or got.shape != whole.shape or got.dtype != whole.dtype or not torch.equal(got, whole):
                failures.append(f"{case.name}: {direction} {why or 'differs from the whole tensor'}")
    return failures if rank == 0 else []


def _rank_cases(rank: int, world: int, dtypes: tuple[torch.dtype, ...]) -> list[str]:
    return every_case(rank, world, dtypes)


# Every dtype on 2 ranks; 4 ranks (4 processes on a small CPU box are slow) check the
# rank-slot arithmetic for n > 2 in one dtype: the dtype does not change any step's logic.
@pytest.mark.parametrize("world,dtypes", [(2, DTYPES), (4, (torch.float32,))], ids=["2", "4"])
def test_every_transition_is_exact_on_real_ranks(world, dtypes):
    failures = run_ranks(_rank_cases, world, dtypes, timeout_s=120.0)[0]
    assert not failures, f"{len(failures)} failing cases, e.g.:\n" + "\n".join(failures[:20])


# ---- the table, without ranks ----

def test_shard_to_partial_is_local():
    step = transition(Shard(1), Partial())
    assert step.kind == "pad" and step.src_dim == 1 and not step.is_comm
    assert comm_bytes(step, 1e6, 4) == 0.0
    assert comm_bytes(transition(Shard(1), Replicate()), 1e6, 4) == 1e6


def test_negative_dims_resolve_against_ndim():
    assert transition(Shard(-1), Shard(2), ndim=3) == NONE
    assert transition(Shard(-1), Shard(0), ndim=3).src_dim == 2
    assert transition(Replicate(), Shard(-2), ndim=3).dst_dim == 1
