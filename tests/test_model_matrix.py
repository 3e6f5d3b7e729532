"""A sample of the model matrix (``bench/model_matrix.py`` runs all of it).

Every run draws ``SAMPLE`` cells (architecture x mode, ``tests/matrix_run.py``) at random from
those the last whole-matrix run recorded as exact or refused (``bench/model_matrix.json``), and
runs them in one world of two gloo ranks: a cell recorded exact must still be exact (losses and
the whole state dict within 1e-5 of one process, in float64), one recorded refused must still be
a typed refusal with a ``fix:``. The seed is printed; ``AUTOPAR_MATRIX_SEED`` replays a draw.
The cells the matrix records as broken are listed in ``bench/README.md``; they are not drawn.
The ``ALWAYS`` cells run every time, whatever the draw.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from autopar.runtime.launch import run_ranks
from tests.matrix_run import cells, run_cells

SAMPLE = 3
# cells every run keeps: DBRX (its expert loop over data-dependent experts, once refused in every
# mode), a mixture of experts on the zero-bubble schedule, and RoBERTa on the planner's pipeline
# (zero-bubble, a first stage that only makes position ids: its weights once got no gradient)
ALWAYS = [("dbrx", "tp"), ("qwen3_moe", "pp_zb"), ("roberta", "pp")]
RECORD = Path(__file__).resolve().parent.parent / "bench" / "model_matrix.json"


def _recorded() -> dict[tuple[str, str], str]:
    return {(r["arch"], r["mode"]): r["status"] for r in json.loads(RECORD.read_text())}


def _draw() -> list[tuple[str, str]]:
    seed = int(os.environ.get("AUTOPAR_MATRIX_SEED", random.randrange(1 << 30)))
    print(f"model matrix sample: AUTOPAR_MATRIX_SEED={seed}")
    rec = _recorded()
    pool = sorted(c for c in cells() if rec.get(c) in ("exact", "refused") and c not in ALWAYS)
    return ALWAYS + random.Random(seed).sample(pool, min(SAMPLE, len(pool)))


DRAWN = _draw()


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], dict]:
    rows = run_ranks(run_cells, 2, DRAWN, timeout_s=120 * len(DRAWN))[0]
    return {(r["arch"], r["mode"]): r for r in rows}


def test_the_record_covers_the_whole_matrix():
    rec = _recorded()
    assert sorted(rec) == sorted(cells()), sorted(set(cells()) ^ set(rec))
    assert len({a for a, _ in rec}) >= 40


@pytest.mark.parametrize("cell", DRAWN, ids=[f"{a}-{m}" for a, m in DRAWN])
def test_drawn_cell_keeps_its_recorded_outcome(results, cell):
    got, want = results[cell], _recorded().get(cell, "exact")
    if want == "exact":
        assert got["status"] == "exact", got
    else:
        assert got["status"] == "refused" and got.get("fix", "").startswith("fix:"), got
