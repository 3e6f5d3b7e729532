"""Checks of autopar's command-line values, made before any work: every bad value is a
:class:`~autopar.core.errors.ConfigError` with a fix (``autopar`` prints it and exits 2).

Limits, and why:

* ``--batch``, ``--seq`` and other counts: at most :data:`MAX_SIZE` = 2^31 - 1. A batch or a
  sequence is a tensor dimension; past int32 it overflows the 32-bit indexing of many GPU
  kernels and NCCL's int element counts, and no training run comes near it (Llama 3 405B:
  global batch 16M *tokens*, i.e. 4096 sequences of 4096).
* ``--cluster``: at most :data:`MAX_DEVICES` = 2^20 devices, ten times the largest clusters
  built; the planner's search enumerates divisors of the device count.
* ``--microbatches`` (with ``--pp N``): at most :data:`MAX_EVENT_MICROBATCHES` = 4096; that
  path event-simulates every micro-batch (published pipelines run at most a few hundred).
* numbers (``--memory-budget``): finite and positive (``nan``, ``inf``, ``0`` are refused).
* output files (``--out``, ``--report``, ``--timeline``, ``--save-plan``): the parent directory
  must exist (nothing is created) and the path must not be a directory.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from autopar.core.errors import ConfigError

MAX_SIZE = 2**31 - 1
MAX_DEVICES = 2**20
MAX_EVENT_MICROBATCHES = 4096


def count(flag: str, *, low: int = 1, high: int = MAX_SIZE, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for an integer flag in ``[low, high]`` (a ConfigError otherwise,
    which ``autopar``'s main prints with its fix)."""
    def parse(text: str) -> int:
        return bounded_int(text, flag, low=low, high=high, why=why)
    parse.__name__ = "integer"      # argparse names the type in its own messages
    return parse


def bounded_int(text: str, flag: str, *, low: int = 1, high: int = MAX_SIZE, why: str = "") -> int:
    """``text`` as an integer in ``[low, high]``; a ConfigError saying the limit and why otherwise."""
    t = str(text).strip()
    digits = t[1:] if t[:1] in "+-" else t
    if not digits.isdigit() or not digits.isascii() or len(digits) > 30:
        raise ConfigError(f"{flag} takes an integer", where=flag, expected=f"an integer {low}..{high}",
                          got=repr(text)[:60], fix=f"e.g. {flag} {max(low, 1)}")
    value = int(t)
    if value < low:
        raise ConfigError(f"{flag} must be at least {low}", where=flag, expected=f"an integer {low}..{high}",
                          got=str(value), fix=f"e.g. {flag} {max(low, 1)}")
    if value > high:
        raise ConfigError(f"{flag} {value} is more than autopar plans for", where=flag,
                          expected=f"at most {high}" + (f" ({why})" if why else _why(high)), got=str(value),
                          fix=f"pass {flag} of at most {high}")
    return value


def _why(high: int) -> str:
    return " (2^31 - 1: a tensor dimension or count past int32 overflows GPU kernels' and NCCL's " \
           "32-bit indexing)" if high == MAX_SIZE else ""


def gb_text(nbytes: float) -> str:
    """Bytes as GB for a message: one decimal from 1 GB up, three significant digits below (a
    12 MB budget reads 0.012, not 0.0)."""
    g = nbytes / 1e9
    return f"{g:.1f}" if g >= 1 else f"{g:.3g}"


def gigabytes(flag: str) -> Callable[[str], float]:
    """An argparse ``type=`` for a finite, positive number (decimal GB)."""
    def parse(text: str) -> float:
        return positive_number(text, flag, unit="GB")
    parse.__name__ = "number"
    return parse


def positive_number(text: str, flag: str, *, unit: str = "") -> float:
    """``text`` as a finite number > 0; a ConfigError otherwise (``nan``, ``inf``, ``0``, ``-1``)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a finite positive number", where=flag,
                          expected=f"a number > 0{' in ' + unit if unit else ''}", got=repr(text)[:60],
                          fix=f"e.g. {flag} 80")
    return value


def device(text: str, flag: str = "--device") -> str:
    """A device this torch can build on: ``meta``, ``cpu``, or an accelerator it was built with
    and sees (``cuda``, ``cuda:1``, ``mps``)."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"{flag} {text!r} is not a device", where=flag, expected="meta, cpu, cuda or cuda:N",
                          got=text, fix=f"e.g. {flag} cpu (or {flag} meta: builds allocating nothing)") from exc
    if dev.type in ("meta", "cpu"):
        return text
    module = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
    available = getattr(module, "is_available", lambda: False)()
    if not available:
        raise ConfigError(f"{flag} {text}: this torch ({torch.__version__}) has no usable {dev.type} device",
                          where=flag, got=f"torch.{dev.type}.is_available() is False",
                          fix=f"use {flag} cpu or {flag} meta here, or run on a machine with a {dev.type} device "
                              "and a torch built for it")
    count_of = getattr(module, "device_count", None)
    if dev.index is not None and count_of is not None and dev.index >= count_of():
        raise ConfigError(f"{flag} {text}: there are {count_of()} {dev.type} devices", where=flag,
                          got=text, fix=f"use an index below {count_of()}")
    return text


def output_file(path: str | None, flag: str) -> None:
    """Refuse an output path whose directory does not exist (it is not created) or which is a
    directory, before any work is done."""
    if path is None:
        return
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty", where=flag, expected="a file path", got=repr(path),
                          fix=f"e.g. {flag} out{Path(str(path)).suffix or '.txt'}")
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir() or str(path).endswith(os.sep):
        raise ConfigError(f"{flag} names a directory, not a file", where=flag, got=str(path),
                          fix=f"name a file in it, e.g. {flag} {p / ('out' + (p.suffix or '.txt'))}")
    if not parent.is_dir():
        raise ConfigError(f"{flag}'s directory does not exist", where=flag, expected="a file in an existing "
                          "directory (autopar creates no directories)", got=str(parent),
                          fix=f"create it first (mkdir -p {parent}) or pick another path")


def write_text(path: str, text: str, flag: str) -> None:
    """Write ``text`` to ``path``; an OSError (permission, a full disk) is a ConfigError."""
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {flag}: {exc.strerror or exc}", where=flag, got=str(path),
                          fix="pass a path in a writable directory") from exc


def writing(flag: str, path: str, write: Callable[[], object]) -> None:
    """Run ``write`` (which writes ``path``), turning an OSError into a ConfigError naming ``flag``."""
    try:
        write()
    except OSError as exc:
        raise ConfigError(f"cannot write {flag}: {exc.strerror or exc}", where=flag, got=str(path),
                          fix="pass a path in a writable directory") from exc


def cluster(spec: str, hardware: str):
    """``Cluster.from_spec`` with at most :data:`MAX_DEVICES` devices."""
    from autopar.cost.cluster import Cluster
    c = Cluster.from_spec(spec, hardware=hardware)
    if c.world_size > MAX_DEVICES:
        raise ConfigError(f"--cluster {spec} has {c.world_size} devices, more than autopar plans for",
                          where="--cluster", expected=f"at most {MAX_DEVICES} devices (2^20, ten times the "
                          "largest clusters built)", got=spec, fix="plan for fewer nodes, e.g. --cluster 128x8")
    return c


def parse_mesh(spec: str) -> dict[str, int]:
    """``"tp=4"`` or ``"name=size[,name=size]"`` -> ``{"tp": 4}`` (the API checks what is supported)."""
    mesh: dict[str, int] = {}
    for item in spec.split(","):
        name, eq, size = item.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name or not size.isdigit():
            raise ConfigError(f"--mesh takes name=size[,name=size], got {spec!r}", where="--mesh", got=spec,
                              fix="e.g. --mesh tp=4")
        if name in mesh:
            raise ConfigError(f"--mesh names axis {name!r} twice", where="--mesh", got=spec,
                              fix="name each mesh axis once, e.g. --mesh tp=4")
        mesh[name] = int(size)
    return mesh
