"""Every ``python`` block of the README runs as pasted.

The first block (analysis on the meta device) runs in this process. The others are what one
rank runs under ``torchrun --nproc-per-node 2``: they run one after another in a single
2-rank gloo world (worlds are the slow part), each in a fresh namespace, in a directory the
two ranks share (for ``plan.json`` and ``ckpt/``). The world is already up, so a block's own
``dist.init_process_group(...)`` call is passed over; everything else runs as written.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def _run_blocks(rank: int, world: int, blocks: list[str], where: str) -> list[str]:
    import torch.distributed as dist
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else real_init(*a, **k)
    os.chdir(where)
    done = []
    try:
        for code in blocks:
            exec(compile(code, "README.md python block", "exec"), {"__name__": "__readme__"})
            dist.barrier()
            done.append(code.splitlines()[0])
    finally:
        dist.init_process_group = real_init
    return done


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 6 and all("import" in b for b in BLOCKS), "every block imports what it uses"


def test_the_single_process_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "init_process_group" not in BLOCKS[0] and "init_distributed" not in BLOCKS[0]
    exec(compile(BLOCKS[0], "README.md python block", "exec"), {"__name__": "__readme__"})


def test_the_distributed_blocks_run_on_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    from autopar.runtime.launch import run_ranks
    blocks = BLOCKS[1:]
    done = run_ranks(_run_blocks, 2, blocks, str(tmp_path), timeout_s=400)
    assert done[0] == done[1] == [b.splitlines()[0] for b in blocks]
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "ckpt" / "LATEST").is_file()
