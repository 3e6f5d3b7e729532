"""Every ``python`` block of the README runs as pasted.

The first block (analysis on the meta device) runs in this process. The others are what one
rank runs under ``torchrun --nproc-per-node 2`` (each says so on its first line): they run one after another in a single
2-rank gloo world (worlds are the slow part), each in a fresh namespace, in a directory the
two ranks share (for ``plan.json`` and ``ckpt/``). The world is already up, so a block's own
``dist.init_process_group(...)`` call is passed over; everything else runs as written. A block that
asks for a tensor axis must really split weights: no block may log "the plan splits no parameter".
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def _run_blocks(rank: int, world: int, blocks: list[str], where: str) -> list:
    import logging

    import torch.distributed as dist
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else real_init(*a, **k)
    os.chdir(where)
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
    keep = Keep(level=logging.WARNING)
    logging.getLogger("autopar").addHandler(keep)
    done = []
    try:
        for code in blocks:
            said.clear()
            exec(compile(code, "README.md python block", "exec"), {"__name__": "__readme__"})
            dist.barrier()
            done.append((code.splitlines()[1], [m for m in said if "splits no parameter" in m]))
    finally:
        dist.init_process_group = real_init
        logging.getLogger("autopar").removeHandler(keep)
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
    assert all(b.startswith("# torchrun --nproc-per-node 2") for b in blocks), "each block says how to launch it"
    done = run_ranks(_run_blocks, 2, blocks, str(tmp_path), timeout_s=600)
    assert [d[0] for d in done[0]] == [d[0] for d in done[1]] == [b.splitlines()[1] for b in blocks]
    replicated = [(line, said) for line, said in done[0] + done[1] if said]
    assert not replicated, replicated            # an example that asks for tp really splits
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "ckpt" / "LATEST").is_file()
