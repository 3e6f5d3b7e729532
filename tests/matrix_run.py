"""One cell of the model matrix: an architecture of ``tests/matrix_models.py`` trained on two
ranks in one mode, against one process.

Modes: ``tp`` (tp=2, ``memory_budget=1`` so that every weight that can split does, asserted),
``dp`` (dp=2, ZeRO-3), ``pp`` (pp=2, the planner's schedule and micro-batches), ``ep`` (ep=2,
mixtures of experts only). Each rank builds the model in float64 with the same seed, trains
three SGD-momentum steps on its share of a batch of 4 rows (dp, ep) or the whole batch (tp,
pp); rank 0 trains one process on the whole batch beside it and compares every step's loss
(averaged over the data ranks where each holds a share) and ``autopar.full_state_dict(pm)``:
the same keys, loading into a fresh model with ``strict=True``, every tensor within ``TOL``.

A cell ends as one of:

- ``exact``: all of that holds;
- ``mismatch``: a loss or a tensor differs by more than ``TOL`` (the worst is reported);
- ``incomplete``: the state dict lacks or adds keys, or does not load strictly;
- ``refused``: a typed ``AutoparError`` (its first line and ``fix:`` are kept);
- ``crash``: any other exception;
- ``unsplit``: tp split no weight (the cell tested nothing).

Used by ``tests/test_model_matrix.py`` (a sample) and ``bench/model_matrix.py`` (every cell).
"""
from __future__ import annotations

import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from tests.matrix_models import architectures, cast

STEPS, LR, ROWS, TOL = 3, 0.05, 4, 1e-5
DTYPE = torch.float64
MODES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    "tp": ({"tp": 2}, dict(memory_budget=1)),
    "dp": ({"dp": 2}, dict(zero_stage=3)),
    "pp": ({"pp": 2}, {}),
    "ep": ({"ep": 2}, {}),
}
# not a column of the matrix: pinned cells of tests/test_model_matrix.py
EXTRA_MODES = {"pp_zb": ({"pp": 2}, dict(schedule="zb"))}
SHARES = ("dp", "ep")        # modes whose ranks each hold a share of the batch


def cells() -> list[tuple[str, str]]:
    """Every (architecture, mode) of the matrix: ep only for mixtures of experts."""
    return [(name, mode) for name, e in architectures().items() for mode in MODES if mode != "ep" or e.moe]


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not b.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    # relative to the tensor's size, floored at 1e-6: a tensor whose true gradient is exactly zero
    # (a key projection's bias: softmax ignores it) holds only round-off, ~1e-17, on both sides
    err = ((a.to(b.dtype) - b).abs().max() / (b.abs().max() + 1e-6)).item()
    return err if err == err else float("inf")


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the whole batch: every step's loss and the state dict after the steps."""
    e = architectures()[name]
    model = e.build(DTYPE, 0)
    batch = cast(e.batch(ROWS, 1), DTYPE)
    opt, losses = _sgd(model.parameters()), []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _share(batch: dict, rank: int) -> dict:
    return {k: v.chunk(2)[rank] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _train(name: str, mode: str, rank: int) -> tuple[list[float], dict, int | None, Any]:
    import autopar
    e = architectures()[name]
    mesh, kw = {**MODES, **EXTRA_MODES}[mode]
    batch = cast(e.batch(ROWS, 1), DTYPE)
    mine = _share(batch, rank) if mode in SHARES else batch
    pm = autopar.parallelize(e.build(DTYPE, 0), mesh, example_kwargs=mine, **kw)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=LR, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        if "pp" in mesh:
            loss = pm.step(**mine)
        else:
            loss = pm(**mine).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().to(torch.float64).reshape(()))
    got = torch.stack(losses)
    if mode in SHARES:             # each rank's loss over its share: their mean is the batch's
        dist.all_reduce(got)
        got /= dist.get_world_size()
    split = None
    if mode == "tp":
        split = sum(1 for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S("))
    full = autopar.full_state_dict(pm)
    return got.tolist(), full, split, pm


def run_cell(name: str, mode: str) -> dict:
    """One cell on this rank (every rank of a world of 2 calls it): rank 0's dict has the verdict."""
    from autopar.core.errors import AutoparError
    rank = dist.get_rank()
    start = time.perf_counter()
    out: dict[str, Any] = {"arch": name, "mode": mode}
    try:
        losses, full, split, _ = _train(name, mode, rank)
    except AutoparError as exc:
        lines = str(exc).splitlines()
        fix = next((ln.strip() for ln in lines if ln.strip().startswith("fix:")), "")
        out.update(status="refused", detail=f"{type(exc).__name__}: {lines[0] if lines else ''}", fix=fix)
    except Exception as exc:        # noqa: BLE001 - an untyped crash is what the matrix records
        first = (str(exc).strip().splitlines() or [""])[0]
        where = traceback.extract_tb(exc.__traceback__)[-1]
        out.update(status="crash", detail=f"{type(exc).__name__}: {first[:300]} "
                                          f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
    else:
        if rank == 0:
            out.update(_verdict(name, losses, full, split))
        else:
            out.update(status="peer")
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _verdict(name: str, losses: list[float], full: dict, split: int | None) -> dict:
    want_losses, want = reference(name)
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, want_losses))
    missing, extra = sorted(set(want) - set(full)), sorted(set(full) - set(want))
    if missing or extra:
        return {"status": "incomplete", "detail": f"missing {missing[:4]}, extra {extra[:4]}", "loss_err": loss_err}
    fresh = architectures()[name].build(DTYPE, 7)
    try:
        fresh.load_state_dict(full, strict=True)
    except RuntimeError as exc:
        return {"status": "incomplete", "detail": f"strict load: {str(exc).splitlines()[0][:200]}"}
    errs = {k: _rel(full[k], v) for k, v in want.items()}
    worst = max(errs, key=errs.get)
    res = {"loss_err": loss_err, "param_err": errs[worst], "worst": worst}
    if split == 0:
        return {**res, "status": "unsplit", "detail": "tp split no weight"}
    if loss_err > TOL or errs[worst] > TOL:
        return {**res, "status": "mismatch", "detail": f"loss {loss_err:.1e}, {worst} {errs[worst]:.1e}"}
    return {**res, "status": "exact", "detail": "" if split is None else f"{split} weights split"}


def run_cells(rank: int, world: int, todo: list[tuple[str, str]]) -> list[dict]:
    """Every cell of ``todo`` in this world, in order (``runtime.launch.run_ranks`` target)."""
    torch.set_num_threads(1)
    return [run_cell(name, mode) for name, mode in todo]
