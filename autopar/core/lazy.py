"""Modules of a package imported when first reached as attributes (``autopar.cost.ep_planner``
without ``import autopar.cost.ep_planner``), so a package's ``__init__`` need not import them all
and ``import autopar`` stays cheap."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def submodules(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` on first use."""
    def __getattr__(name: str) -> Any:
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


__all__ = ["submodules"]
