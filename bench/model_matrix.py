"""The whole model matrix: every architecture of ``tests/matrix_models.py`` x {tp, dp ZeRO-3,
pp with the planner's schedule, ep for mixtures of experts}, each cell trained on two gloo
ranks in float64 against one process (``tests/matrix_run.py`` says how a cell is judged).

    python bench/model_matrix.py                      # every cell; table into bench/README.md
    python bench/model_matrix.py --arch llama,gpt2    # some architectures (README untouched)
    python bench/model_matrix.py --json out.json      # also the raw rows
    python bench/model_matrix.py --arch t5 --update   # re-run some, merged into the recorded table

One world of two ranks runs an architecture's cells; a world that fails as a whole (a rank
died or hung) is rerun one cell per world, so that a cell that hangs is recorded as ``hang``
and the others keep their verdicts. Progress goes to stderr, one line per architecture.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autopar.core.errors import AutoparError            # noqa: E402
from autopar.runtime.launch import run_ranks            # noqa: E402
from tests.matrix_models import architectures           # noqa: E402
from tests.matrix_run import MODES, cells, run_cells    # noqa: E402

CELL_S = 240          # the longest one cell may take before its world counts as hung
BEGIN, END = "<!-- model-matrix:begin -->", "<!-- model-matrix:end -->"
RECORD = os.path.join(ROOT, "bench", "model_matrix.json")


def run_arch(todo: list[tuple[str, str]]) -> list[dict]:
    try:
        return run_ranks(run_cells, 2, todo, timeout_s=CELL_S * len(todo))[0]
    except AutoparError as exc:
        if len(todo) == 1:
            why = str(exc).splitlines()[0][:200]
            return [{"arch": todo[0][0], "mode": todo[0][1], "status": "hang" if "timed out" in why or "within" in why
                     else "crash", "detail": f"world failed: {why}"}]
        return [row for cell in todo for row in run_arch([cell])]


def table(rows: list[dict]) -> str:
    modes = list(MODES)
    by = {(r["arch"], r["mode"]): r for r in rows}
    lines = ["| architecture | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for arch in dict.fromkeys(r["arch"] for r in rows):
        cells = []
        for m in modes:
            r = by.get((arch, m))
            if r is None:
                cells.append("")
                continue
            text = r["status"]
            if r["status"] != "exact" and r.get("detail"):
                text += ": " + r["detail"].replace("|", "/")[:160]
            cells.append(text)
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", help="comma-separated architectures (default: all)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--update", action="store_true",
                    help="merge these rows into bench/model_matrix.json and rewrite the README table")
    a = ap.parse_args()
    names = a.arch.split(",") if a.arch else list(architectures())
    unknown = sorted(set(names) - set(architectures()))
    if unknown:
        sys.exit(f"unknown architectures {unknown}; known: {sorted(architectures())}")
    todo = [c for c in cells() if c[0] in names]
    start, rows = time.perf_counter(), []
    for arch in names:
        mine = [c for c in todo if c[0] == arch]
        t0 = time.perf_counter()
        got = run_arch(mine)
        rows += got
        print(f"{arch:18s} " + "  ".join(f"{r['mode']}={r['status']}" for r in got)
              + f"  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    took = time.perf_counter() - start
    counts = Counter(r["status"] for r in rows)
    load = os.getloadavg()
    summary = (f"{len(rows)} cells over {len(names)} architectures in {took / 60:.1f} min on "
               f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}; load "
               f"{load[0]:.1f} at the end), torch {__import__('torch').__version__}, transformers "
               f"{__import__('transformers').__version__}: "
               + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    print(summary)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.update:
        with open(RECORD) as f:
            old = [r for r in json.load(f) if r["arch"] not in names]
        merged = sorted(old + rows, key=lambda r: (list(architectures()).index(r["arch"]), list(MODES).index(r["mode"])))
        counts = Counter(r["status"] for r in merged)
        summary = (f"{len(merged)} cells over {len({r['arch'] for r in merged})} architectures; re-run here: "
                   f"{', '.join(names)} ({summary.split(': ')[0]}); in all: "
                   + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
        _write_readme(summary, table(merged), merged)
    elif not a.arch:
        _write_readme(summary, table(rows), rows)


def _write_readme(summary: str, text: str, rows: list[dict]) -> None:
    path = os.path.join(ROOT, "bench", "README.md")
    with open(path) as f:
        readme = f.read()
    block = f"{BEGIN}\n{summary}\n\n{text}\n{END}"
    if BEGIN in readme:
        head, rest = readme.split(BEGIN, 1)
        readme = head + block + rest.split(END, 1)[1]
    else:
        readme += "\n## Model matrix\n\n`python bench/model_matrix.py` (see its docstring).\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(readme)
    with open(RECORD, "w") as f:
        json.dump([{k: r.get(k) for k in ("arch", "mode", "status", "detail")} for r in rows], f, indent=0)


if __name__ == "__main__":
    main()
