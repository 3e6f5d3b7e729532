"""Early refusal of a symbolic-size capture the model's code pins.

torch.export checks the labelled sizes' guards only when its trace ends: a model whose code
reads a size's value (Mamba 2's scan pads the sequence to a multiple of its chunk size and
branches on the remainder) is traced whole with every shape a modular formula, seconds of
symbolic algebra, and then refused. :func:`pinned_sizes_fail_fast` watches each guard as the
trace adds it; the first one that fails for some size inside the labelled range (tried at
the range's low end, around the example size and at a few larger values) is a guard export
would refuse at the end, so the capture stops there with the same error. The caller's
fixed-size fallback then runs without the wasted trace.

The check only ever stops a capture that export would refuse: a guard is taken as pinning
only when a concrete size inside the range falsifies it.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Iterator

import sympy
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, ShapeEnv


@contextmanager
def pinned_sizes_fail_fast(labels: Mapping[str, Mapping[int, str]]) -> Iterator[None]:
    """Within the block, a guard on the labelled input sizes that some size in their range
    falsifies raises ``ConstraintViolationError`` at once (as export would at its end).
    ``labels``: input name -> dim -> label, for the message."""
    original = getattr(ShapeEnv, "_log_guard", None)
    if original is None:           # another torch: the trace runs to export's own check
        yield
        return
    ranges: dict[int, dict[sympy.Symbol, tuple[int, int]]] = {}

    def watched(self: ShapeEnv, prefix: str, g: sympy.Basic, forcing_spec: bool) -> None:
        seen = ranges.setdefault(id(self), {})
        for s in getattr(g, "free_symbols", ()):
            if s not in seen and s in self.var_to_sources:
                seen[s] = _bounds(self.var_to_range.get(s))
        if prefix == "eval" and not self.prefer_deferred_runtime_asserts_over_guards:
            _check(self, g, seen, labels)
        original(self, prefix, g, forcing_spec)

    ShapeEnv._log_guard = watched
    try:
        yield
    finally:
        ShapeEnv._log_guard = original


def _bounds(r: object) -> tuple[int, int] | None:
    """A symbol's range as integers (an unbounded end: 2**20, autopar's default bound)."""
    try:
        lo = int(r.lower) if r.lower.is_finite else 2
        hi = int(r.upper) if r.upper.is_finite else 1 << 20
    except (AttributeError, TypeError, ValueError):
        return None
    return max(lo, 2), hi


def _check(env: ShapeEnv, g: sympy.Basic, ranges: dict[sympy.Symbol, tuple[int, int]],
           labels: Mapping[str, Mapping[int, str]]) -> None:
    free = getattr(g, "free_symbols", set())
    if not free or any(ranges.get(s) is None for s in free):
        return
    # export makes one symbol per input dim, and equal labels equal only at its end: symbols
    # with the same example size move together here. That tries a subset of the sizes the
    # labels allow (any two labels may be equal), so a failure found is one export finds too.
    groups: dict[object, list[sympy.Symbol]] = {}
    for s in sorted(free, key=str):
        groups.setdefault(env.backed_var_to_val.get(s, s), []).append(s)
    keys = list(groups)
    bounds = [(max(ranges[s][0] for s in groups[k]), min(ranges[s][1] for s in groups[k])) for k in keys]
    values = [_samples(b, k) for b, k in zip(bounds, keys)]
    for combo in itertools.islice(itertools.product(*values), 256):
        at = {s: sympy.Integer(v) for k, v in zip(keys, combo) for s in groups[k]}
        try:
            holds = g.xreplace(at)
        except Exception:  # noqa: BLE001 - a formula sympy cannot evaluate: leave it to export
            return
        if holds is sympy.false:
            name = {s: _label(env.var_to_sources[s][0].name, labels) for s in free}
            named = g.xreplace({s: sympy.Symbol(n, integer=True, positive=True) for s, n in name.items()})
            where = ", ".join(f"{name[groups[k][0]]}={v}" for k, v in zip(keys, combo))
            raise ConstraintViolationError(
                f"Constraints violated ({', '.join(sorted(set(name.values())))})! The model's code adds the guard "
                f"{named}, which fails at {where} inside the labelled range: it fixes that size (or its remainder)")


def _label(source: str, labels: Mapping[str, Mapping[int, str]]) -> str:
    """The label of an input dim export names ``L['input_ids'].size()[1]``, else that name."""
    m = re.fullmatch(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]", source)
    return (labels.get(m.group(1), {}).get(int(m.group(2))) if m else None) or source


def _samples(bounds: tuple[int, int], hint: object) -> list[int]:
    lo, hi = bounds
    picks = {lo, lo + 1, lo + 2, lo + 3, 2 * lo + 1, 97, 1000, 4099, hi}
    if isinstance(hint, int) or getattr(hint, "is_integer", False):
        h = int(hint)
        picks |= {h - 1, h + 1, 2 * h, 2 * h + 1, 3 * h + 1}
    return sorted(v for v in picks if lo <= v <= hi)
