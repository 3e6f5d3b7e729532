"""The example scripts, run as a user runs them: ``torchrun`` with 2 gloo ranks.

``train_hf.py`` trains 3 steps under ``--mesh tp=2`` with a checkpoint at step 2, then is
resumed from that checkpoint under a cluster plan file (pp=2 x dp=2 on 4 devices, scaled to
the 2 ranks: two pipeline stages): the resumed step 3 must reproduce the first run's step-3
loss (same data rows, same learning rate, restored AdamW state; another layout, so to
round-off); resumed again under ``--mesh dp=2`` with more ``--steps``, it keeps the saved global
batch (2 rows per share) and schedule length, says so, and step 3 is again the first run's.
``train_moe.py`` trains 3 steps with its experts over ``ep=2``. Every step's loss
must be finite, and training must lower it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def torchrun(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def _plan_file(path: Path) -> Path:
    path.write_text(json.dumps({
        "format": "autopar plan", "version": 1, "model": "gpt", "overrides": {}, "cluster": "1x4", "hardware": "h100",
        "devices": 4, "batch": 8, "seq": 32, "dtype": "fp32", "microbatches": 2,
        "config": {"dp": 2, "tp": 1, "pp": 2, "micro_batch": 2, "schedule": "1f1b", "virtual": 1,
                   "recompute": "none", "zero_stage": 1, "ep": 1}}))
    return path


def test_train_hf_checkpoints_and_resumes_under_another_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = torchrun("train_hf.py", "--mesh", "tp=2", "--steps", "3", "--ckpt-dir", str(ckpt), "--ckpt-every", "2",
                   "--log-jsonl", str(tmp_path / "first.jsonl"), cwd=tmp_path)
    first = losses(tmp_path / "first.jsonl")
    assert sorted(first) == [1, 2, 3] and first[3] < first[1], out
    assert "saved" in out and (ckpt / "step-00000002").is_dir()
    assert (ckpt / "LATEST").read_text().strip() == "step-00000003"
    shutil.rmtree(ckpt / "step-00000003")             # as if the run had died after step 2
    (ckpt / "LATEST").write_text("step-00000002\n")
    plan = _plan_file(tmp_path / "plan.json")
    out = torchrun("train_hf.py", "--plan", str(plan), "--steps", "3", "--ckpt-dir", str(ckpt), "--resume",
                   "--log-jsonl", str(tmp_path / "resumed.jsonl"), cwd=tmp_path)
    assert "resumed from" in out and "at step 2" in out, out
    assert "mesh pp=2" in out and "pp 2 -> 2, dp 2 -> 1" in out, out      # the plan, scaled, said so
    resumed = losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3]
    assert resumed[3] == pytest.approx(first[3], rel=1e-5), (resumed, first)
    # on dp=2 (two data shares where the saved run had one) and asking for more steps: the run keeps its
    # global batch and its schedule's length, says so, and step 3 is still the first run's step 3
    shutil.rmtree(ckpt / "step-00000003", ignore_errors=True)
    (ckpt / "LATEST").write_text("step-00000002\n")
    out = torchrun("train_hf.py", "--mesh", "dp=2", "--steps", "4", "--ckpt-dir", str(ckpt), "--resume",
                   "--log-jsonl", str(tmp_path / "wider.jsonl"), cwd=tmp_path)
    assert "keeping the saved run's global batch of 4 rows per step: 2 data share(s) of 2 rows" in out, out
    assert "schedule keeps the length it was saved with (3 steps)" in out, out
    assert "resuming changes the run" in out                 # autopar.load's own warning, on rank 0
    wider = losses(tmp_path / "wider.jsonl")
    assert sorted(wider) == [3, 4]
    assert wider[3] == pytest.approx(first[3], rel=1e-5), (wider, first)


def test_train_moe_trains_its_experts_over_an_expert_axis(tmp_path):
    out = torchrun("train_moe.py", "--mesh", "ep=2", "--steps", "3", "--log-jsonl", str(tmp_path / "moe.jsonl"),
                   cwd=tmp_path)
    got = losses(tmp_path / "moe.jsonl")
    assert sorted(got) == [1, 2, 3] and got[3] < got[1], out
    assert "2 share(s)" in out, out
