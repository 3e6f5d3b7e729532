"""The wheel holds the design card's layout (autopar/core, build, passes, cost, runtime, cli,
checkpoint) installed under ``autopar``, and works installed (not editable): the engine's
modules import and the command line runs from it, outside the checkout."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, check=True, capture_output=True, text=True,
                   timeout=300)


def test_the_wheel_holds_every_package_and_runs_installed(tmp_path) -> None:
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(REPO), cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("autopar-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("core", "build", "passes", "cost", "runtime", "cli", "checkpoint", "models"):
        assert f"autopar/{package}/__init__.py" in names, package
    assert any(n.startswith("autopar/models/configs/") and n.endswith("config.json") for n in names)
    assert not [n for n in names if not n.startswith("autopar")], "files outside the autopar package"
    target = tmp_path / "site"
    _pip("install", "--no-deps", "-q", "--target", str(target), str(wheel), cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import autopar, autopar.passes.meta, autopar.cost.hybrid, autopar.runtime.pp\n"
            "from autopar.core.layout import package_roots\n"
            "print(autopar.__file__); print(package_roots())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.startswith(str(target / "autopar")), out
    assert str(REPO) not in out, out
    cli = subprocess.run([sys.executable, "-m", "autopar", "models"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and "gpt" in cli.stdout, cli.stderr


def test_import_autopar_leaves_the_engine_unimported():
    """``import autopar`` (and ``autopar --help``'s parser) import torch and the errors only:
    the capture, planner and sympy come with the first name that needs them."""
    import subprocess
    import sys
    code = ("import sys, autopar, autopar.cli; autopar.cli.build_parser()\n"
            "heavy = [m for m in ('sympy', 'torch._dynamo', 'autopar.passes.capture', 'autopar.api', "
            "'autopar.runtime.tp_module', 'transformers') if m in sys.modules]\n"
            "print(heavy); autopar.parallelize; print('autopar.api' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout
