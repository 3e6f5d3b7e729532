"""Every ``autopar`` command in the README runs as written.

The test reads README.md, takes each fenced block's lines that start with ``autopar `` (a
trailing ``# comment`` dropped), and runs them in order through the CLI's ``main`` in a
scratch directory holding the repository's ``examples/``; each must exit 0. A block may be
preceded by an HTML comment ``<!-- readme-test: OLD => NEW; ... -->`` (invisible when the
README is rendered): the test runs that block's commands with those substitutions, for
sizes that would take minutes here, or a device this machine lacks. Substitutions that no
command of the block contains fail the test, so a stale marker is noticed.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!--\s*readme-test:(.*?)-->", re.S)


def blocks() -> list[tuple[int, list[str], list[tuple[str, str]]]]:
    """(line number, autopar commands, substitutions) per fenced block that has commands."""
    out, lines = [], (ROOT / "README.md").read_text().splitlines()
    inside, start, cmds, subs, pending = False, 0, [], [], []
    for i, line in enumerate(lines, 1):
        if line.startswith("```"):
            if inside and cmds:
                out.append((start, cmds, subs))
            inside, start, cmds = not inside, i, []
            if inside:                       # a block opens: the marker above it applies
                subs, pending = pending, []
            continue
        if inside and line.startswith("autopar "):
            cmds.append(line.split(" #")[0].strip())
        elif not inside and (m := MARK.search(line)):
            pending = [tuple(part.split("=>")) for part in m.group(1).split(";") if part.strip()]
            pending = [(a.strip(), b.strip()) for a, b in pending]
    return out


BLOCKS = blocks()


def test_the_readme_has_commands_to_run():
    assert sum(len(c) for _, c, _ in BLOCKS) >= 15


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{n}" for n, _, _ in BLOCKS])
def test_readme_block_runs(block, tmp_path, monkeypatch, capsys):
    from autopar.cli import main
    _, cmds, subs = block
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    used = set()
    for cmd in cmds:
        for old, new in subs:
            if old in cmd:
                cmd, _ = cmd.replace(old, new), used.add(old)
        code = main(shlex.split(cmd)[1:] + ["-q"] if "-q" not in cmd and _takes_quiet(cmd) else shlex.split(cmd)[1:])
        err = capsys.readouterr().err
        assert code in (0, None), f"{cmd}\nexit {code}\n{err[-2000:]}"
    assert used == {old for old, _ in subs}, f"readme-test substitutions never used: {set(dict(subs)) - used}"


def _takes_quiet(cmd: str) -> bool:
    return shlex.split(cmd)[1] in ("plan", "simulate", "dump")
