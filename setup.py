"""Packaging: the package mapping comes from ``autopar/core/layout.py``, its one statement.

Everything else about the distribution is in ``pyproject.toml``."""
import os
import runpy

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_DIRS = runpy.run_path(os.path.join(HERE, "autopar", "core", "layout.py"))["PACKAGE_DIRS"]


def packages() -> dict[str, str]:
    """Every package under each mapped root (a folder with an ``__init__.py``), with its folder."""
    found = {}
    for name, rel in PACKAGE_DIRS.items():
        for folder, subdirs, files in os.walk(os.path.join(HERE, rel)):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "__")))
            if "__init__.py" not in files:
                subdirs[:] = []
                continue
            sub = os.path.relpath(folder, os.path.join(HERE, rel))
            dotted = name if sub == "." else f"{name}.{sub.replace(os.sep, '.')}"
            if dotted == name or dotted not in PACKAGE_DIRS:
                found[dotted] = os.path.relpath(folder, HERE)
    return found


setup(package_dir=packages(), packages=sorted(packages()))
