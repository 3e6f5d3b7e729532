"""The house's rules, read from the code's own imports (DESIGN.md, "Layout").

Every autopar module's imports (module-level and inside functions) are read with ``ast`` and
checked against three rules:

- a module imports only from its own floor or below (``autopar.core.layout.FLOORS``: core,
  runtime, passes, cost, build, front door);
- no circle of imports joins modules of different packages;
- no private name (``_x``) is imported from another module.

The package mapping comes from ``autopar.core.layout`` — the same statement the build uses.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

from autopar.core import layout

REPO = pathlib.Path(__file__).resolve().parents[1]


def _modules() -> dict[str, pathlib.Path]:
    """Import name -> file, for every autopar module in the checkout."""
    mods: dict[str, pathlib.Path] = {}
    for pkg, rel in layout.PACKAGE_DIRS.items():
        root = REPO / rel
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") for p in parts):
                continue
            if pkg == "autopar" and parts and (REPO / layout.PACKAGE_DIRS.get(f"autopar.{parts[0]}", "\0")).is_dir():
                continue                                          # a mapped package under autopar/ (never today)
            name = ".".join((pkg, *parts))
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each autopar import in ``path``."""
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = base + (f".{node.module}" if node.module else "")
            else:
                target = node.module or ""
            if target != "autopar" and not target.startswith("autopar."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in mods:
                    out.append((sub, None, node.lineno))          # `from pkg import module`
                else:
                    out.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "autopar" or alias.name.startswith("autopar."):
                    out.append((alias.name, None, node.lineno))
    return out


def _graph() -> tuple[nx.DiGraph, list[tuple[str, str, str | None, int]]]:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    edges = []
    for name, path in mods.items():
        for target, imported, line in _imports(name, path, mods):
            if target == name:
                continue
            edges.append((name, target, imported, line))
            g.add_edge(name, target)
    return g, edges


def upward_imports() -> list[str]:
    _, edges = _graph()
    bad = []
    for src, dst, imported, line in edges:
        if layout.floor_of(dst) > layout.floor_of(src):
            up = layout.FLOORS[layout.floor_of(dst)][0]
            here = layout.FLOORS[layout.floor_of(src)][0]
            bad.append(f"{src}:{line} ({here}) imports {dst} ({up})")
    return sorted(set(bad))


def cross_package_circles() -> list[str]:
    graph, _ = _graph()
    mods = _modules()

    def package(m: str) -> str:
        return m if mods[m].name == "__init__.py" else m.rsplit(".", 1)[0]

    bad = []
    for scc in nx.strongly_connected_components(graph):
        if len(scc) > 1 and len({package(m) for m in scc}) > 1:
            cycle = nx.find_cycle(graph.subgraph(scc))
            bad.append(" -> ".join([a for a, _ in cycle] + [cycle[0][0]]))
    return sorted(bad)


def private_imports() -> list[str]:
    _, edges = _graph()
    return sorted({f"{src}:{line} imports {dst}.{imported}" for src, dst, imported, line in edges
                   if imported and imported.startswith("_") and not imported.startswith("__")})


def test_no_module_imports_from_a_higher_floor() -> None:
    bad = upward_imports()
    assert not bad, "imports that run back up the floors:\n  " + "\n  ".join(bad)


def test_no_circle_joins_modules_of_different_packages() -> None:
    bad = cross_package_circles()
    assert not bad, "import circles across packages:\n  " + "\n  ".join(bad)


def test_no_private_name_is_imported_across_modules() -> None:
    bad = private_imports()
    assert not bad, "private names imported from another module:\n  " + "\n  ".join(bad)


def test_the_checker_sees_a_planted_violation(tmp_path, monkeypatch) -> None:
    """The three checks fail on a tree that breaks them (so a green run means something)."""
    for pkg, rel in layout.PACKAGE_DIRS.items():
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "__init__.py").write_text("")
    (tmp_path / "autopar" / "core").mkdir()
    (tmp_path / "autopar" / "core" / "__init__.py").write_text("")
    (tmp_path / "autopar" / "core" / "low.py").write_text("from autopar.api import go\n")
    (tmp_path / "autopar" / "api.py").write_text("from autopar.core.low import _hidden\ndef go(): pass\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert upward_imports() == ["autopar.core.low:1 (core) imports autopar.api (front door)"]
    assert cross_package_circles() == ["autopar.api -> autopar.core.low -> autopar.api"] or \
        cross_package_circles() == ["autopar.core.low -> autopar.api -> autopar.core.low"]
    assert private_imports() == ["autopar.api:1 imports autopar.core.low._hidden"]


if __name__ == "__main__":
    for check in (upward_imports, cross_package_circles, private_imports):
        found = check()
        print(f"{check.__name__}: {len(found)}")
        for line in found:
            print("  " + line)
