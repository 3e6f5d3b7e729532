"""Who to blame when a collective fails: the ranks' records judged, and where a rank is.

The records (heartbeats and end records, written by :class:`autopar.runtime.health.Monitor`)
are plain dicts; :func:`judge` is a pure function of them, so every rule can be tested
without processes. Also here: which exceptions are a collective failing because of another
rank (:func:`looks_like_peer_failure`), and where a rank's main thread is. The exit codes
and the timeout variable are documented in :mod:`autopar.runtime.health`.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.errors import PeerFailureError
from autopar.core.layout import package_roots

__all__ = ["DEFAULT_TIMEOUT_S", "EXIT_PEER_FAILED", "EXIT_STALLED", "TIMEOUT_ENV", "Diagnosis", "alive", "is_timeout",
           "judge", "last_user_frame", "looks_like_peer_failure", "main_thread_at", "main_thread_stack", "node_id",
           "one_line", "same_node"]

TIMEOUT_ENV = "AUTOPAR_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
EXIT_PEER_FAILED = 3
EXIT_STALLED = 4

# Text of an exception raised in a collective because another rank failed or stalled.
_PEER_MARKS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Timed out waiting",
               "NCCL communicator was aborted", "Watchdog caught collective operation timeout",
               "caused pair closure")
_TIMEOUT_MARKS = ("Timed out", "timed out", "Timeout", "timeout")


@dataclass(frozen=True)
class Diagnosis:
    """The rank a failed collective is blamed on (``rank`` None: no single rank) and why.

    ``kind``: raised | died | hung | exited | stalled | unreachable | unknown.
    """

    kind: str
    rank: int | None
    step: int | None
    detail: str

    def what(self) -> str:
        who, at = f"rank {self.rank}", f" at step {self.step}" if self.step is not None else ""
        return {
            "raised": f"{who} failed{at} ({self.detail})",
            "died": f"{who} died{at} ({self.detail})",
            "hung": f"{who} hung{at} ({self.detail})",
            "exited": f"{who} exited normally{at} while this rank was in a collective ({self.detail})",
            "stalled": f"{who} stalled{at}: it never joined the collective ({self.detail})",
            "unreachable": f"{who if self.rank is not None else 'the store'} is unreachable ({self.detail})",
        }.get(self.kind, f"a collective failed and no single rank is to blame ({self.detail})")

    def fix(self) -> str:
        return {
            "raised": f"see rank {self.rank}'s traceback: that is the error; this rank only stopped because of it",
            "died": f"find why rank {self.rank}'s process ended: a signal, the out-of-memory killer "
                    "(dmesg), a crash in native code, os._exit",
            "hung": f"rank {self.rank}'s process stopped running Python (SIGSTOP, a native call holding the GIL); "
                    "py-spy dump --pid shows where",
            "exited": "every rank must run the same collectives: give every rank the same number of steps/batches",
            "stalled": f"rank {self.rank} printed its stack (exit code {EXIT_STALLED}); if its step is just slow, "
                       f"raise the timeout ({TIMEOUT_ENV} or init_distributed(timeout_s=...))",
            "unreachable": "the rank hosting the store most likely died: look at its log first",
        }.get(self.kind, "look at every rank's log for the first error; if every rank timed out, they called "
                         "different collectives or the step takes longer than the timeout")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "step": self.step, "detail": self.detail}


def judge(me: int, beats: dict[int, dict | None], ends: dict[int, dict | None], ages: dict[int, float], *,
          local: set[int], gone: set[int], stale_s: float, settled: bool) -> Diagnosis | None:
    """Blame a rank from the ranks' records: a pure function (the module docstring of
    :mod:`autopar.runtime.health` gives the rules in words). None: nothing to say yet.

    ``beats``/``ends``: each rank's heartbeat and end record (None: none). ``ages``: seconds
    since each rank's heartbeat last changed, as this rank has watched it. ``local``: the
    ranks on this node; ``gone``: those of them whose process has ended. ``settled``: a
    collective timed out and the other ranks have had ``stale_s`` to record theirs.
    """
    others = [r for r in sorted(beats) if r != me]

    def first(ranks: list[int]) -> int:
        return min(ranks, key=lambda r: ((ends[r] or beats[r] or {}).get("step", 0), r))

    def where(r: int) -> str:
        return (beats[r] or {}).get("where", "?")

    raised = [r for r in others if (ends[r] or {}).get("kind") == "raised"]
    if raised:
        r = first(raised)
        return Diagnosis("raised", r, ends[r].get("step"), ends[r].get("error", "?"))
    live = [r for r in others if beats[r] and (ends[r] is None or ends[r].get("kind") == "timeout")]
    if dead := [r for r in live if r in gone]:
        r = first(dead)
        return Diagnosis("died", r, beats[r]["step"], f"its process {beats[r]['pid']} is gone: killed, crashed "
                         f"or os._exit; last at {where(r)}")
    if stale := [r for r in live if ages.get(r, 0.0) > stale_s]:
        r = first(stale)
        return Diagnosis("hung" if r in local else "died", r, beats[r]["step"],
                         f"its heartbeat stopped {ages[r]:.0f} s ago; last at {where(r)}")
    if exited := [r for r in others if (ends[r] or {}).get("kind") == "exited"]:
        r = first(exited)
        return Diagnosis("exited", r, ends[r].get("step"), f"last at {where(r)}")
    blamed = [ends[r]["blame"] for r in others if (ends[r] or {}).get("blame", {}).get("rank") not in (None, me)]
    if blamed:
        b = min(blamed, key=lambda b: (b["step"] or 0, b["rank"]))
        return Diagnosis(b["kind"], b["rank"], b["step"], b["detail"])
    if settled:
        if waiting := [r for r in live if ends[r] is None]:
            r = first(waiting)
            return Diagnosis("stalled", r, beats[r]["step"], f"it is alive, last at {where(r)}")
        return Diagnosis("unknown", None, None, "every rank timed out in a collective")
    return None


def same_node(beat: dict, node: str) -> bool:
    """Whether the rank that wrote this heartbeat runs on node (see node_id)."""
    return beat.get("node") == node


def alive(pid: int) -> bool:
    """Whether process pid (on this node) still runs: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def node_id() -> str:
    """This host and pid namespace: pids are comparable only between equal node ids."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}/{ns}"


def _internal_dirs() -> tuple[str, ...]:
    """torch's and autopar's own directories (:func:`autopar.core.layout.package_roots`)."""
    return (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, *(d + os.sep for d in package_roots()))


_INTERNAL = _internal_dirs()


def _internal(filename: str) -> bool:
    return filename.startswith("<") or os.path.abspath(filename).startswith(_INTERNAL)


def main_thread_at() -> str:
    """The innermost line of the calling thread outside torch and autopar ("train.py:40 in main").

    Only the main thread calls it (at each step, ``health.note_step``): on CPython 3.11 walking
    another thread's frames (``sys._current_frames()`` then ``f_back``) while that thread runs
    can crash the process, which is how the heartbeat thread used to learn this."""
    frame = sys._getframe(1)
    inner = frame
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or inner
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def main_thread_stack() -> str:
    """The main thread's stack, formatted as in a traceback."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"



def last_user_frame(exc: BaseException) -> str:
    """The innermost line of exc's traceback outside torch and autopar."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _internal(f.filename)]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


def one_line(exc: BaseException) -> str:
    """'Type: first line of the message', at most 400 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Whether exc is what a collective raises when another rank failed, died or stalled."""
    for e in _chain(exc):
        if isinstance(e, (PeerFailureError, dist.DistBackendError, dist.DistNetworkError)):
            return True
        if not isinstance(e, dist.DistStoreError) and any(m in f"{type(e).__name__}: {e}" for m in _PEER_MARKS):
            return True
    return False


def is_timeout(exc: BaseException) -> bool:
    """Whether exc (or what caused it) says something timed out."""
    return any(m in str(e) for e in _chain(exc) for m in _TIMEOUT_MARKS)
