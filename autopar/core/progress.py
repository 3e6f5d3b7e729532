"""A one-line progress bar on stderr, for long CLI work (training steps, the planner's search).

::

    for c in progress(configurations, what="search"):
        ...
    with progress(48, what="training steps") as bar:
        bar.set(done)              # or bar.update(n)

It draws only when its stream (stderr by default) is a terminal and autopar is not quiet;
otherwise it writes nothing at all, so piped output, logs and tests see no bar. Quiet is what
``-q`` sets: the CLI runs a ``-q`` command with the ``autopar`` logger at ERROR
(``autopar.cli._run_quietly``; ``autopar train -q`` does the same), so a bar is drawn only
while that logger still shows warnings. On a terminal the bar is redrawn at most every
:data:`REDRAW_S` seconds with ``\\r``, erased when the work ends, and replaced by one summary
line when the work took over :data:`SUMMARY_AFTER_S` seconds. No dependency (no tqdm).
"""
from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

REDRAW_S = 0.1            # at most this often
SUMMARY_AFTER_S = 2.0     # work longer than this leaves one line behind on the terminal
_SPIN = "|/-\\"


def quiet() -> bool:
    """Has the user asked for quiet (``-q``)? The ``autopar`` logger then shows no warnings."""
    return not logging.getLogger("autopar").isEnabledFor(logging.WARNING)


def shows(stream: TextIO | None = None) -> bool:
    """Would a bar be drawn on ``stream`` (default stderr): a terminal, and not quiet."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError, OSError):    # closed or not a file
        tty = False
    return tty and not quiet()


class Progress:
    """A bar over ``total`` units (None: unknown, a counter with a spinner). Iterate it when it
    wraps an iterable; else call :meth:`update` / :meth:`set`, and :meth:`close` (or use it as a
    context manager)."""

    def __init__(self, iterable: Iterable[Any] | None, total: int | None, what: str, *,
                 stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.iterable, self.total, self.what = iterable, total, what
        self.stream = sys.stderr if stream is None else stream
        self.enabled = shows(self.stream) if enabled is None else bool(enabled)
        self.done = 0
        self.start = time.perf_counter()
        self._drawn_at = -1.0
        self._first: tuple[float, int] | None = None    # (when, done) at the first unit done: the rate's start
        self._width = 0
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this progress bar counts a total; call update() instead of iterating it")
        try:
            self.set(0)
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.set(self.done + n)

    def set(self, done: int) -> None:
        self.done = done
        if self._first is None and done > 0:
            self._first = (time.perf_counter(), done)
        if self.enabled and not self._closed:
            now = time.perf_counter()
            if self._drawn_at < 0 or now - self._drawn_at >= REDRAW_S or done == self.total:
                self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The bar as drawn: ``what [#####-----] 12/48 25% 3.1s``, fitted to the terminal."""
        elapsed = (time.perf_counter() if now is None else now) - self.start
        cols = shutil.get_terminal_size((80, 24)).columns - 1
        if self.total:
            frac = min(max(self.done / self.total, 0.0), 1.0)
            tail = f" {self.done}/{self.total} {100 * frac:3.0f}% {elapsed:.1f}s"
            if 0 < frac < 1:
                tail += f" eta {self._eta(elapsed, now):.0f}s"
            room = max(cols - len(self.what) - len(tail) - 3, 0)
            width = min(room, 30)
            bar = f" [{'#' * round(width * frac)}{'-' * (width - round(width * frac))}]" if width >= 5 else ""
            text = f"{self.what}{bar}{tail}"
        else:
            text = f"{self.what} {_SPIN[self.done % len(_SPIN)]} {self.done} {elapsed:.1f}s"
        return text[:cols]

    def _eta(self, elapsed: float, now: float | None) -> float:
        """Seconds left: at the rate since the first unit was done (the first unit often carries
        the setup), else at the rate since the start."""
        left = self.total - self.done
        if self._first is not None and self.done > self._first[1]:
            when, done = self._first
            return left * ((time.perf_counter() if now is None else now) - when) / (self.done - done)
        return left * elapsed / max(self.done, 1)

    def _draw(self, now: float) -> None:
        text = self.line(now)
        self._write("\r" + text + " " * max(self._width - len(text), 0))
        self._width = len(text)
        self._drawn_at = now

    def close(self) -> None:
        """Erase the bar; leave one line saying what was done when it took over
        :data:`SUMMARY_AFTER_S`. Nothing at all when not drawing."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if self._width:
            self._write("\r" + " " * self._width + "\r")
        if elapsed > SUMMARY_AFTER_S:
            count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
            self._write(f"{self.what}: {count} in {elapsed:.1f}s\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):       # a closed terminal: stop drawing, never fail the work
            self.enabled = False


# -- set-up stages ----------------------------------------------------------------------------
#: what each set-up stage is called where users read it
STAGE_WORDS = {"capture": "capture and analysis", "plan": "plan", "tensor": "tensor rewrite",
               "weights": "weights from rank 0", "experts": "expert placement", "pipeline": "pipeline stages",
               "recompute": "recompute", "data": "data-axis buckets", "overlap": "overlap", "module": "runtime module",
               "first step": "first step"}
_STAGE_HOOKS: list[Callable[[str, float], None]] = []
_stage_log = logging.getLogger("autopar.setup")
_reported = 0.0


def reported_seconds() -> float:
    """The seconds of every set-up stage said so far in this process (a stage that holds
    others subtracts theirs)."""
    return _reported


def setup_stage(name: str, seconds: float) -> None:
    """Say that set-up stage ``name`` (a key of :data:`STAGE_WORDS`) ended after ``seconds``:
    to the hooks :func:`on_setup_stage` added, and to the ``autopar.setup`` logger at INFO (so
    ``logging.getLogger("autopar.setup").setLevel(logging.INFO)`` shows the stages of any
    ``autopar.parallelize``)."""
    global _reported
    _reported += seconds
    words = STAGE_WORDS.get(name, name)
    _stage_log.info("set-up: %s %.2fs", words, seconds)
    for hook in list(_STAGE_HOOKS):
        hook(words, seconds)


@contextmanager
def on_setup_stage(hook: Callable[[str, float], None]) -> Iterator[None]:
    """Call ``hook(words, seconds)`` as each set-up stage ends, inside the block."""
    _STAGE_HOOKS.append(hook)
    try:
        yield
    finally:
        _STAGE_HOOKS.remove(hook)


def progress(iterable_or_total: Iterable[Any] | int | None, what: str = "working", *,
             stream: TextIO | None = None, enabled: bool | None = None) -> Progress:
    """A :class:`Progress` over an iterable (iterate the result; its ``len`` is the total when
    it has one) or over a count (``int``; None for an unknown count). ``enabled``: force the
    bar on or off (default: :func:`shows` of ``stream``)."""
    if iterable_or_total is None or isinstance(iterable_or_total, int):
        return Progress(None, iterable_or_total, what, stream=stream, enabled=enabled)
    try:
        total = len(iterable_or_total)          # type: ignore[arg-type]
    except TypeError:
        total = None
    return Progress(iterable_or_total, total, what, stream=stream, enabled=enabled)


__all__ = ["Progress", "STAGE_WORDS", "on_setup_stage", "progress", "quiet", "reported_seconds", "setup_stage", "shows"]
