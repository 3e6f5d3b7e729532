"""The ``autopar`` command line: ``autopar.cli:main`` is the entry point.

- ``commands.py``: the parser and the ``models``, ``dump``, ``plan``, ``simulate`` commands;
- ``hybrid.py``: ``plan``'s joint search, its output and ``simulate``;
- ``train.py``, ``train_metrics.py``: ``autopar train`` and its table;
- ``calibrate.py``: ``autopar calibrate``;
- ``workload.py``: building the model a command names (zoo, file, Hugging Face config);
- ``dump.py``, ``report.py``: the graph listing and the HTML plan report;
- ``checks.py``: the flags' checks (meshes, counts, output files).
"""
from autopar.cli.checks import parse_mesh
from autopar.cli.commands import build_parser, main

__all__ = ["build_parser", "main", "parse_mesh"]

from autopar.core.lazy import submodules as _submodules  # noqa: E402

__getattr__ = _submodules(__name__)     # the other modules, imported on first use
