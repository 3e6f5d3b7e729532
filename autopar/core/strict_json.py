"""Strict reading of the JSON files a user may hand-edit (the plan files of autopar.core.plans and
autopar.cli.hybrid): every failure is a :class:`~autopar.core.errors.PlanFileError` naming the
file and field, never a UnicodeDecodeError, RecursionError, OverflowError or a silent cast.

* :func:`read_text`: the file as UTF-8 text, at most :data:`MAX_FILE_BYTES`;
* :func:`parse`: the JSON value (no ``NaN`` / ``Infinity``, nesting at most :data:`MAX_DEPTH`);
* :func:`reject_unknown`: an unknown key names the nearest valid one (a typo is not ignored);
* :func:`integer`, :func:`number`, :func:`text`, :func:`choice`, :func:`flag`: one field of one
  type, where a bool is not an int, a float is not an int, and a number is finite and in range.
"""
from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from autopar.core.errors import PlanFileError

# A 405B-parameter model's parallelize plan (one entry per parameter and per graph node) is a
# few MB; 64 MB is far beyond any plan autopar writes and small enough to read at once.
MAX_FILE_BYTES = 64 << 20
# autopar's plan files nest 4 levels (plan -> nodes -> node -> inputs); 32 leaves room for
# whatever a model records under "predicted" and stops a hostile file long before Python's
# recursion limit.
MAX_DEPTH = 32


def read_text(path: str | Path, *, where: str, fix: str) -> str:
    """The file's text; a PlanFileError when it cannot be read, is too big, or is not UTF-8."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise PlanFileError(f"the plan file is {size / 2**20:.0f} MiB, more than any plan autopar writes",
                                where=where, expected=f"at most {MAX_FILE_BYTES >> 20} MiB", got=f"{size} bytes",
                                fix=fix)
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise PlanFileError(f"cannot read the plan file: {exc}", where=where, fix=fix) from exc
    except UnicodeDecodeError as exc:
        raise PlanFileError("the plan file is not UTF-8 text", where=where, expected="a JSON text file",
                            got=f"byte {exc.object[exc.start:exc.start + 1]!r} at offset {exc.start}",
                            fix=fix) from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (plan numbers are finite)")


def parse(text: str, *, where: str, fix: str) -> Any:
    """The JSON value of ``text``; a PlanFileError on anything but strict, finite JSON nested at
    most :data:`MAX_DEPTH` deep."""
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"the plan is not valid JSON: {exc}", where=where, fix=fix) from exc
    except RecursionError as exc:
        raise PlanFileError("the plan nests too deep to be a plan", where=where,
                            expected=f"JSON nested at most {MAX_DEPTH} levels", got="deeper than Python can parse",
                            fix=fix) from exc
    except ValueError as exc:        # NaN / Infinity, or an integer of more than 4300 digits
        raise PlanFileError(f"the plan is not valid JSON: {exc}", where=where, fix=fix) from exc
    deepest = depth(data)
    if deepest > MAX_DEPTH:
        raise PlanFileError("the plan nests too deep to be a plan", where=where,
                            expected=f"JSON nested at most {MAX_DEPTH} levels", got=f"{deepest} levels", fix=fix)
    return data


def depth(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        todo.extend((x, d + 1) for x in items)
    return deepest


def reject_unknown(data: dict, allowed: Iterable[str], *, where: str, fix: str, prefix: str = "") -> None:
    """A PlanFileError naming the first key of ``data`` not in ``allowed``, and the nearest
    allowed name (difflib) when there is one."""
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            raise PlanFileError(f"the plan has an unknown field {prefix}{key}"
                                + (f" (did you mean {prefix}{near[0]}?)" if near else ""),
                                where=f"{where}, field {prefix}{key}", expected="one of " + ", ".join(allowed),
                                got=repr(key)[:80], fix=f"rename it to {prefix}{near[0]}" if near else
                                f"remove it ({fix})")


def _bad(key: str, expected: str, value: Any, where: str, fix: str, *, typed: bool = False) -> PlanFileError:
    """The error for a field of the wrong type (or, ``typed``, of the right type out of range)."""
    what = "the plan has an invalid field" if typed else "the plan is missing or mistypes a field"
    return PlanFileError(f"{what}: {key} is not {expected}",
                         where=f"{where}, field {key}", expected=expected,
                         got=f"{repr(value)[:80]} ({type(value).__name__})", fix=fix)


def integer(value: Any, key: str, *, where: str, fix: str, low: int = 0, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool, not a float) in ``[low, high]``."""
    if type(value) is not int or value < low or (high is not None and value > high):
        expected = f"an integer {low}..{high}" if high is not None else f"an integer >= {low}"
        raise _bad(key, expected, value, where, fix, typed=type(value) is int)
    return value


def number(value: Any, key: str, *, where: str, fix: str, low: float = 0.0, high: float | None = None,
           above: bool = False) -> float:
    """``value`` if it is a finite int or float (not a bool) >= ``low`` (> ``low`` with ``above``)
    and at most ``high``."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if above else value >= low) and (high is None or value <= high))
    if not ok:
        expected = f"a finite number {'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high else "")
        raise _bad(key, expected, value, where, fix, typed=type(value) in (int, float))
    return value


def text(value: Any, key: str, *, where: str, fix: str, optional: bool = False, empty: bool = True) -> str | None:
    """``value`` if it is a string (or None with ``optional``; non-empty unless ``empty``)."""
    if (value is None and optional) or (isinstance(value, str) and (empty or value)):
        return value
    raise _bad(key, ("a string" if empty else "a non-empty string") + (" or null" if optional else ""),
               value, where, fix)


def choice(value: Any, key: str, allowed: tuple, *, where: str, fix: str) -> Any:
    """``value`` if it is one of ``allowed`` (compared by type too: ``True`` is not ``1``)."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise _bad(key, "one of " + ", ".join(map(repr, allowed)), value, where, fix,
                   typed=any(type(value) is type(a) for a in allowed))
    return value


def flag(value: Any, key: str, *, where: str, fix: str) -> bool:
    """``value`` if it is true or false."""
    if type(value) is not bool:
        raise _bad(key, "true or false", value, where, fix)
    return value


def mapping(value: Any, key: str, *, where: str, fix: str) -> dict:
    """``value`` if it is a JSON object."""
    if not isinstance(value, dict):
        raise _bad(key, "a JSON object", value, where, fix)
    return value


def array(value: Any, key: str, *, where: str, fix: str) -> list:
    """``value`` if it is a JSON array."""
    if not isinstance(value, list):
        raise _bad(key, "a JSON array", value, where, fix)
    return value
