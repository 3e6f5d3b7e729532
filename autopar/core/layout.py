"""Where autopar's packages live: the one statement of the package mapping.

The repository keeps the design card's top level — ``autopar/``, ``passes/``, ``cost/``,
``runtime/`` — and installs the last three as ``autopar.passes``, ``autopar.cost`` and
``autopar.runtime``. ``setup.py`` builds its ``package_dir`` from :data:`PACKAGE_DIRS`, and
everything that needs to know which files are autopar's own (the capture cache key, the
user-frame finder of capture errors, the fault reporter's "outside autopar" test, the
layering test) asks :func:`package_roots`. This file imports nothing, so the build can read
it without torch installed.
"""
from __future__ import annotations

import os

#: import name -> directory in a checkout, relative to the repository root.
PACKAGE_DIRS: dict[str, str] = {
    "autopar": "autopar",
    "autopar.passes": "passes",
    "autopar.cost": "cost",
    "autopar.runtime": "runtime",
}

#: Floors, lowest first: a module imports only from its own floor or below (DESIGN.md, "Layout").
#: Each entry is (floor name, import-name prefixes); a module takes the first floor whose prefix
#: it matches, and every other ``autopar`` module is the front door.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("autopar.core",)),
    ("runtime", ("autopar.runtime",)),
    ("passes", ("autopar.passes",)),
    ("cost", ("autopar.cost",)),
    ("build", ("autopar.build",)),
    ("front door", ("autopar",)),
)


def floor_of(module: str) -> int:
    """The floor index of ``module`` (an ``autopar`` import name) in :data:`FLOORS`."""
    for i, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise ValueError(f"{module!r} is not an autopar module")


def package_roots() -> tuple[str, ...]:
    """The directories holding autopar's top-level packages as this process sees them: one
    ``autopar/`` directory for an installed wheel, or ``autopar/``, ``passes/``, ``cost/`` and
    ``runtime/`` of a checkout (an editable install)."""
    autopar_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = os.path.dirname(autopar_dir)
    roots = []
    for name, rel in PACKAGE_DIRS.items():
        installed = os.path.join(autopar_dir, *name.split(".")[1:])
        beside = os.path.join(checkout, rel)
        for d in (installed, beside):
            if os.path.isfile(os.path.join(d, "__init__.py")):
                roots.append(d)
                break
    return tuple(dict.fromkeys(roots))
