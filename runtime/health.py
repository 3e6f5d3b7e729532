"""Rank health: when a rank raises, dies or stalls, the others stop and say which one, and when.

A collective waits for every rank of its group. Left alone, a rank whose peer is gone gets
``Connection reset by peer`` or waits out the group's timeout (torch's default for gloo:
30 minutes, for every group a device mesh makes, whatever the default group's) and says
nothing about who failed. Here:

* **Timeout.** :func:`init_distributed` (or ``start(timeout_s=...)``) gives every collective a
  timeout -- the default group's, the groups that exist and those made later
  (:func:`set_timeout`): ``timeout_s``, else the environment variable ``AUTOPAR_TIMEOUT_S``,
  else :data:`DEFAULT_TIMEOUT_S` (300 s). It bounds only the wait for a rank that never
  joins (a stalled one); a rank that raises or dies is noticed at once, whatever it is.
* **Records.** A :class:`Monitor` per rank keeps records in the default group's store, under
  ``autopar/<job secret>/`` (:func:`share_secret`; ``run_ranks`` gives its ranks one, and
  :func:`init_distributed` broadcasts one from rank 0), so that one who can reach the store's
  port but is not a rank can neither read the records nor order a rank to stop: ``hb/<rank>``, the heartbeat (every ``beat_s`` = 1 s, ``world / 1000`` s past
  1,000 ranks, and at every step on worlds of up to 64 ranks, at most once a beat on larger
  ones: the
  step, pid, node and the line the main thread is on); ``end/<rank>``, how the rank ended
  (``raised``, ``peer``, ``timeout``, ``stalled``, ``exited``); ``news``, the first failure;
  ``abort/<rank>``, the others' order to a rank they timed out waiting for.
* **Blame.** When a collective fails, :meth:`Monitor.diagnose` blames a rank
  (:func:`~autopar.runtime.faults.judge`): one that recorded an exception; else one whose
  process is gone (on this node, by pid; elsewhere, its heartbeat stopped for 3 beats);
  else one that exited normally; else, after a timeout, one that is alive but never joined
  (the smallest step first), which is then told to stop. It never hangs: each store call
  waits at most 2 s, and a store that does not answer says its host (rank 0, unless
  torchrun's agent hosts it) died -- rank 0 ending on a failure keeps it up ~2 beats first,
  and each heartbeat caches the news, so the others can still name the first failure.
* **Report.** :func:`explain` turns such a collective error into a
  :class:`~autopar.core.errors.PeerFailureError` ("rank 1 failed at step 3 (RuntimeError: boom);
  rank 0 stops"). The monitor chains an excepthook onto ``sys.excepthook`` that does this
  for an uncaught exception. The monitor starts with :func:`init_distributed` or
  :func:`start`, or by itself at the first step of a multi-rank group, so a torchrun script
  that makes its own process group gets the diagnosis with no change (but keeps its
  timeout). A rank ending on an uncaught exception skips the interpreter's teardown
  (seconds; it can hang on a broken group) once the atexit handlers have run.

A *step* is one call of a parallel model's forward (``ParallelModule.forward``,
``PipelineModule.step``) on this rank, counted from 1 by :func:`note_step`; step 0 is
before the first (e.g. inside ``parallelize``). With gradient accumulation each
micro-batch's forward is a step.

Exit codes of a rank's process (under torchrun, and ``RankOutcome.exitcode`` of
``run_ranks_outcomes``):

====  =====================================================================================
0     finished
1     this rank raised: its traceback is the report (with a note naming the rank and step)
3     :data:`EXIT_PEER_FAILED`: another rank failed first; stderr has the PeerFailureError
      naming it, its step and what happened (raised, died, hung, stalled, unreachable)
4     :data:`EXIT_STALLED`: the other ranks timed out waiting for this rank in a
      collective; stderr has this rank's main-thread stack at that moment
<0    killed by a signal (-9: SIGKILL); torchrun prints "Signal 9 (SIGKILL)"
====  =====================================================================================

torchrun itself exits 1 when any rank fails; its summary lists each failed rank with its
exit code, the "root cause" being the first to end -- a survivor on the same node waits
(up to 2 s) for the rank it blames to end first, so that is the rank to blame.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopar.core.errors import ConfigError, PeerFailureError
from autopar.runtime.faults import (DEFAULT_TIMEOUT_S, EXIT_PEER_FAILED, EXIT_STALLED, TIMEOUT_ENV, Diagnosis, alive,
                                    is_timeout, judge, last_user_frame, looks_like_peer_failure, main_thread_at,
                                    main_thread_stack, node_id, one_line, same_node)

__all__ = ["DEFAULT_TIMEOUT_S", "EXIT_PEER_FAILED", "EXIT_STALLED", "TIMEOUT_ENV", "Diagnosis", "Monitor",
           "explain", "init_distributed", "judge", "monitor", "note_step", "resolve_timeout", "set_timeout", "start",
           "step"]

_STORE_OP_S = 2.0   # the longest one store call of the monitor waits
SECRET_ENV = "AUTOPAR_JOB_SECRET"           # the job's secret, in every rank's environment (share_secret)
_step = 0                                   # this rank's step (note_step)
_where = "?"                                # where the main thread started that step (note_step)
PER_STEP_BEATS_UP_TO = 64                   # larger worlds beat at most once per beat_s (Monitor.beat)
STORE_WRITES_PER_S = 1000                   # the heartbeat writes all ranks together send the store, at most


def beat_interval(world: int) -> float:
    """The default heartbeat interval of a world: 1 s, longer past 1,000 ranks."""
    return max(1.0, world / STORE_WRITES_PER_S)

_monitor: Monitor | None = None             # this process's monitor (start)
_previous_hook: Callable[..., Any] | None = None   # sys.excepthook before start() chained onto it
_exit_code: int | None = None               # set when this rank ends on its own uncaught exception
_stopped_by: PeerFailureError | None = None  # set when another rank's failure stopped this one (Monitor._stop_for)
STOP_GRACE_S = 10.0                         # after another rank's failure, how long user code has to handle it
_auto_started = False                       # note_step has tried to start a monitor


def note_step() -> None:
    """Count one step (one forward of a parallel model) on this rank; with a monitor running,
    also write the heartbeat (one store write, 5-20 us on one node), so that a rank that
    dies is named with its exact step. The first step of a multi-rank group without a monitor starts one, so that a
    script that made its own process group gets the diagnosis too."""
    global _step, _auto_started, _where
    _step += 1
    _where = main_thread_at()       # read here, on the main thread: the heartbeat thread only copies it
    if _monitor is not None:
        _monitor.beat(on_step=True)
    elif not _auto_started:
        _auto_started = True
        if dist.is_initialized() and dist.get_world_size() > 1:
            try:
                start()
            except Exception as e:  # noqa: BLE001 - training goes on without the diagnosis
                warnings.warn(f"autopar: the health monitor did not start ({one_line(e)})", stacklevel=2)


def step() -> int:
    """This rank's step: forwards of parallel models so far (0 before the first)."""
    return _step


class _StoreDown(Exception):
    pass


class Monitor:
    """This rank's heartbeat thread and its records in the store (see the module docstring).

    Every store call holds one lock and waits at most ``_STORE_OP_S``; after one fails the
    store counts as down and the monitor stops using it (the heartbeat thread ends).
    """

    def __init__(self, store: Any, rank: int, world: int, *, timeout_s: float | None, beat_s: float = 1.0,
                 store_host: int | None = 0, on_abort: Callable[[str], None] | None = None,
                 keep: Any = None) -> None:
        self.rank, self.world, self.timeout_s, self.beat_s = rank, world, timeout_s, beat_s
        self._store = store
        # the records' keys hold the job's secret: one who reaches the store's port but is not a
        # rank can neither read them nor order a rank to stop (the key names are unknown to them)
        secret = os.environ.get(SECRET_ENV, "")
        self._space = f"autopar/{secret}" if secret else "autopar"
        self._keep = keep                      # the group's own store: holds the server up while we use it
        self._store_host = store_host          # the rank whose process serves the store; None: no rank
        self._host_beat: dict | None = None    # its heartbeat, to tell by pid that the store is gone
        self._on_abort = on_abort
        self._node = node_id()
        self._lock = threading.Lock()
        self._down = False
        self._ended: str | None = None         # the kind of this rank's end record, once written
        self._beats = 0
        self._last_write = -math.inf           # monotonic time of the last heartbeat written
        self._news: dict | None = None         # the first failure any rank recorded, once seen
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"autopar-heartbeat-{rank}", daemon=True)

    # --- the store ------------------------------------------------------------------------

    def _reachable(self) -> bool:
        host = self._host_beat
        if not self._down and host is not None and same_node(host, self._node) and not alive(host["pid"]):
            self._down = True      # its host is gone: a call would only fail (and log a C++ stack)
        return not self._down

    def _set(self, key: str, record: dict) -> bool:
        with self._lock:
            if not self._reachable():
                return False
            try:
                self._store.set(f"{self._space}/{key}", json.dumps(record))
                return True
            except Exception:  # noqa: BLE001 - any store failure means the store is gone
                self._down = True
                return False

    def _read(self, key: str) -> dict | None:
        """The record under key, None if there is none; _StoreDown if the store does not answer."""
        with self._lock:
            if not self._reachable():
                raise _StoreDown
            try:
                full = f"{self._space}/{key}"
                return json.loads(self._store.get(full)) if self._store.check([full]) else None
            except Exception as e:  # noqa: BLE001
                self._down = True
                raise _StoreDown from e

    # --- heartbeat ------------------------------------------------------------------------

    def start(self) -> Monitor:
        self.beat()
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._halt.is_set()

    def stop(self) -> None:
        """End the heartbeat; records that this rank exited normally unless it already ended
        (if it failed and hosts the store, first :meth:`linger`). Later calls do nothing."""
        if self.stopped:
            return
        if self._ended is None:
            self._end({"kind": "exited", "step": _step})
        elif self._ended != "exited":
            self.linger()
        self._halt.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.beat_s + _STORE_OP_S)

    def beat(self, *, on_step: bool = False) -> bool:
        """Write this rank's heartbeat now. :func:`note_step` calls it at every step, so a rank's
        last step is exact, on worlds of up to :data:`PER_STEP_BEATS_UP_TO` ranks; on larger
        ones a step writes only if the last write is a beat old (every rank writes to one store:
        at most ``world / beat_s`` writes a second, whatever the step rate)."""
        if self._halt.is_set():
            return False
        now = time.monotonic()
        if on_step and self.world > PER_STEP_BEATS_UP_TO and now - self._last_write < self.beat_s:
            return True
        self._last_write = now
        self._beats += 1
        ok = self._set(f"hb/{self.rank}", {"beat": self._beats, "step": _step, "pid": os.getpid(),
                                           "node": self._node, "where": _where})
        if ok and self._host_beat is None and self._store_host not in (None, self.rank):
            try:   # the store host's pid, as soon as it has written it (see _reachable)
                self._host_beat = self._read(f"hb/{self._store_host}")
            except _StoreDown:
                return False
        return ok

    def _run(self) -> None:
        while not self._halt.wait(self.beat_s):
            if not self.beat():
                return
            try:
                self._news = self._news or self._read("news")
                order = self._read(f"abort/{self.rank}")
            except _StoreDown:
                return
            if order is not None and self._ended in (None, "timeout"):
                self._abort(str(order.get("why", "?")))
            culprit = _culprit(self._news, self.rank)
            if culprit is not None and self._ended is None:
                self._stop_for(culprit)
                return

    def _stop_for(self, diag: Diagnosis) -> None:
        """Another rank failed (the store's news): stop this rank too, whatever groups it shares
        with that one. The main thread gets a :class:`PeerFailureError` at its next Python line
        (user code can catch it); if the process is still running :data:`STOP_GRACE_S` later, it
        ends with :data:`EXIT_PEER_FAILED` and the error on stderr. Either way it exits non-zero."""
        global _stopped_by, _exit_code
        err = PeerFailureError(f"{diag.what()}; rank {self.rank} stops", rank=diag.rank, step=diag.step,
                               where=f"rank {self.rank} at step {_step} ({_where})",
                               got=f"rank {diag.rank}'s failure record in the store",
                               fix=diag.fix())
        self.record_peer_failure(diag)
        _stopped_by, _exit_code = err, EXIT_PEER_FAILED
        _raise_in_main(err)
        if not self._halt.wait(STOP_GRACE_S):
            sys.stderr.write(f"[rank {self.rank}] PeerFailureError: {err}\n")
            self._halt.set()
            _exit_now(EXIT_PEER_FAILED)

    def _abort(self, why: str) -> None:
        """The others timed out waiting for this rank: show where it is and end the process."""
        msg = (f"rank {self.rank} stops at step {_step} (exit code {EXIT_STALLED}): {why}\n"
               f"rank {self.rank}'s main thread was here:\n{main_thread_stack()}")
        self._end({"kind": "stalled", "step": _step})
        sys.stderr.write(msg)
        sys.stderr.flush()
        if self._on_abort is not None:
            try:
                self._on_abort(msg)
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(EXIT_STALLED)

    # --- records --------------------------------------------------------------------------

    def _end(self, record: dict) -> None:
        """Write this rank's end record: the first stands, except that a timeout mark is replaced.
        A failure with someone to blame is also the news, if it is the first (see _run)."""
        if self._ended not in (None, "timeout"):
            return
        self._ended = record["kind"]
        self._set(f"end/{self.rank}", record)
        if record["kind"] == "raised" or record.get("blame", {}).get("rank") is not None:
            with self._lock:
                if self._reachable():
                    try:
                        self._store.compare_set(f"{self._space}/news", "",
                                                json.dumps({"rank": self.rank, **record}))
                    except Exception:  # noqa: BLE001
                        self._down = True

    def record_failure(self, exc: BaseException) -> None:
        """Record that this rank raised exc itself (the others will name this rank and step)."""
        self._end({"kind": "raised", "step": _step, "error": one_line(exc)})

    def record_peer_failure(self, diag: Diagnosis) -> None:
        """Record that this rank stops because of another rank (so the others can follow the blame)."""
        self._end({"kind": "peer", "step": _step, "blame": diag.to_json()})

    def order_abort(self, rank: int, why: str) -> None:
        """Tell a stalled rank to stop: its heartbeat thread reads this within one beat (if this
        rank hosts the store, :meth:`linger` keeps it up until then)."""
        self._set(f"abort/{rank}", {"why": why, "by": self.rank})

    def linger(self) -> None:
        """This rank hosts the store and ends on a failure: keep the store up until every other
        rank has ended or had two beats to read the news (its heartbeat caches it) and any
        order to stop, so that they can still say why once the store is gone with this process."""
        if self._store_host != self.rank or self.world == 1:
            return
        deadline = time.monotonic() + 2 * self.beat_s + 0.5
        while time.monotonic() < deadline:
            try:
                if all(self._read(f"end/{r}") for r in range(self.world) if r != self.rank):
                    return
            except _StoreDown:
                return
            time.sleep(0.1)

    def wait_for_exit(self, rank: int, timeout_s: float = 2.0) -> None:
        """Wait (if rank runs on this node) until rank's process is gone, so that a launcher
        watching both sees the rank to blame end first (torchrun's "root cause")."""
        try:
            beat = self._read(f"hb/{rank}")
        except _StoreDown:
            return
        if beat is None or not same_node(beat, self._node):
            return
        deadline = time.monotonic() + timeout_s
        while alive(beat["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.25)   # > torchrun's default --monitor-interval (0.1 s)

    # --- diagnosis ------------------------------------------------------------------------

    def _snapshot(self) -> tuple[dict[int, dict | None], dict[int, dict | None]]:
        beats = {r: self._read(f"hb/{r}") for r in range(self.world)}
        return beats, {r: self._read(f"end/{r}") for r in range(self.world)}

    def diagnose(self, *, timed_out: bool = False, wait_s: float | None = None) -> Diagnosis:
        """Which rank a failed collective is blamed on. Polls the records for up to wait_s
        (default 3 beats + 1 s: how long a dead rank on another node takes to go stale);
        after a timeout it first gives the other ranks 3 beats to record theirs."""
        stale_s = 3 * self.beat_s
        wait_s = stale_s + 1.0 if wait_s is None else wait_s
        if timed_out:
            self._end({"kind": "timeout", "step": _step})
        elif self._host_beat is not None and same_node(self._host_beat, self._node):
            time.sleep(0.1)   # a dying host closes its connections before its pid is gone: let it go
        start = time.monotonic()
        seen: dict[int, tuple[Any, float]] = {}
        while True:
            try:
                beats, ends = self._snapshot()
            except _StoreDown:
                return self._from_news() or self._unreachable()
            now = time.monotonic()
            for r, b in beats.items():
                if r not in seen or seen[r][0] != (b or {}).get("beat"):
                    seen[r] = ((b or {}).get("beat"), now)
            local = {r for r, b in beats.items() if b and same_node(b, self._node)}
            found = judge(self.rank, beats, ends, {r: now - t for r, (_, t) in seen.items()}, local=local,
                          gone={r for r in local if not alive(beats[r]["pid"])}, stale_s=stale_s,
                          settled=timed_out and now - start >= min(stale_s, wait_s))
            if found is not None:
                return found
            if now - start >= wait_s:
                return Diagnosis("unknown", None, None, f"no rank recorded a failure within {wait_s:g} s")
            time.sleep(min(0.1, self.beat_s / 4))

    def _from_news(self) -> Diagnosis | None:
        """The first failure recorded, as the heartbeat saw it before the store went away."""
        news = self._news
        if news is None or news.get("rank") == self.rank:
            return None
        if news["kind"] == "raised":
            return Diagnosis("raised", news["rank"], news.get("step"), news.get("error", "?"))
        blame = news["blame"]
        return None if blame["rank"] == self.rank else Diagnosis(**blame)

    def _unreachable(self) -> Diagnosis:
        where = _store_address(self._store)
        host, beat = self._store_host, self._host_beat
        if host is None or host == self.rank:
            return Diagnosis("unreachable", None, None, f"the store at {where} does not answer")
        if beat is not None and same_node(beat, self._node) and not alive(beat["pid"]):
            return Diagnosis("died", host, None, f"its process {beat['pid']} is gone, and with it the store "
                             f"it hosted at {where}")
        return Diagnosis("unreachable", host, None, f"it hosts the store at {where}, which does not answer: "
                         "it most likely died")


def _culprit(news: dict | None, me: int) -> Diagnosis | None:
    """The rank to blame in the store's news (the first failure any rank recorded), if another."""
    if not news:
        return None
    blame = news.get("blame")
    if news.get("kind") == "raised":
        diag = Diagnosis("raised", news.get("rank"), news.get("step"), str(news.get("error", "?")))
    elif isinstance(blame, dict) and blame.get("rank") is not None:
        diag = Diagnosis(str(blame.get("kind", "unknown")), blame["rank"], blame.get("step"),
                         str(blame.get("detail", "?")))
    else:
        return None
    return diag if isinstance(diag.rank, int) and diag.rank != me else None


def _raise_in_main(err: PeerFailureError) -> None:
    """Raise ``err`` in the main thread at its next Python line (CPython's asynchronous
    exception: delivered when the thread runs Python, not while it waits inside a C call)."""
    class _Deliver(PeerFailureError):
        def __new__(cls, *args: Any, **kwargs: Any) -> PeerFailureError:     # noqa: D102
            return err
    try:
        import ctypes
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                                   ctypes.py_object(_Deliver))
    except Exception:  # noqa: BLE001 - no CPython API: the grace period's exit still stops the rank
        pass


@contextlib.contextmanager
def peer_errors() -> Iterator[None]:
    """Around a call of autopar's that runs collectives (a forward, ``pm.step``, ``opt.step()``,
    a save or load): a collective error because another rank failed becomes the
    :class:`PeerFailureError` naming that rank (``__cause__``: torch's error), so user code
    catches a typed error, not gloo's ``RuntimeError``. The rank then exits non-zero even if
    user code goes on to return normally."""
    global _stopped_by, _exit_code
    try:
        yield
    except PeerFailureError as err:
        _stopped_by, _exit_code = _stopped_by or err, EXIT_PEER_FAILED
        raise
    except RuntimeError as exc:
        if _monitor is None or not looks_like_peer_failure(exc):
            raise
        err = explain(exc)
        if not isinstance(err, PeerFailureError):
            raise
        _stopped_by, _exit_code = _stopped_by or err, EXIT_PEER_FAILED
        raise err from exc


def stopped_by() -> PeerFailureError | None:
    """The peer failure that stopped this rank, if another rank's failure did."""
    return _stopped_by


def _store_address(store: Any) -> str:
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    return f"{store.host}:{store.port}" if store is not None else "?"


def explain(exc: BaseException) -> BaseException:
    """What to report for exc, an exception about to end this rank; records how it ended.

    A collective failing because another rank raised, died or stalled becomes a
    :class:`PeerFailureError` naming that rank and its step (``__cause__`` is exc); a stalled
    rank is told to stop. Anything else is returned as it is, recorded as this rank's own
    failure, with a note saying so. Without a running monitor, exc is returned untouched.
    """
    mon = _monitor
    if mon is None or isinstance(exc, PeerFailureError):
        return exc
    if not looks_like_peer_failure(exc):
        mon.record_failure(exc)
        _note(exc, f"autopar: rank {mon.rank} raised at step {_step}; the other ranks stop with exit code "
                   f"{EXIT_PEER_FAILED} naming it")
        return exc
    diag = mon.diagnose(timed_out=is_timeout(exc))
    mon.record_peer_failure(diag)
    if diag.rank is None or diag.rank == mon.rank:
        _note(exc, f"autopar: {diag.what()}")
        return exc
    if diag.kind == "stalled":
        waited = f" {mon.timeout_s:g} s" if mon.timeout_s else ""
        mon.order_abort(diag.rank, f"rank {mon.rank} timed out after{waited} waiting for it in a collective "
                                   f"at step {_step}")
    err = PeerFailureError(f"{diag.what()}; rank {mon.rank} stops", rank=diag.rank, step=diag.step,
                           where=f"rank {mon.rank} at step {_step}, in a collective called from "
                                 f"{last_user_frame(exc)}",
                           got=one_line(exc), fix=diag.fix())
    err.__cause__ = exc
    return err


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note") and text not in getattr(exc, "__notes__", ()):
        exc.add_note(text)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """sys.excepthook while a monitor runs: a peer's failure exits EXIT_PEER_FAILED with a
    PeerFailureError; this rank's own exception is recorded and reported as usual."""
    mon = _monitor
    if mon is not None and exc is not None and not isinstance(exc, KeyboardInterrupt):
        try:
            err = explain(exc)
        except Exception:  # noqa: BLE001 - the original report matters more
            err = exc
        if isinstance(err, PeerFailureError):
            sys.stderr.write(f"[rank {mon.rank}] PeerFailureError: {err}\n")
            mon.stop()
            if err.rank is not None:
                mon.wait_for_exit(err.rank)
            _exit_now(EXIT_PEER_FAILED)
        global _exit_code
        _exit_code = 1   # after the atexit handlers, skip the interpreter's slow teardown (see _at_exit)
    (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)


def _exit_now(code: int) -> None:
    """End the process now: flush what is buffered, skip the teardown (which can take seconds,
    or hang on a process group whose peer is gone)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def monitor() -> Monitor | None:
    """This process's monitor, unless there is none or it was stopped."""
    return _monitor if _monitor is not None and not _monitor.stopped else None


def start(*, timeout_s: float | None = None, beat_s: float | None = None, hook: bool = True,
          on_abort: Callable[[str], None] | None = None) -> Monitor:
    """Attach a monitor to the initialised default process group (once: later calls return it).

    ``beat_s``: the heartbeat interval; by default 1 s up to :data:`STORE_WRITES_PER_S` ranks
    and ``world / STORE_WRITES_PER_S`` beyond (every rank writes to one store: its load stays
    bounded, and a dead rank on another node is noticed after 3 beats).

    ``timeout_s``: if given, the timeout of every collective (:func:`set_timeout`); else the
    groups keep theirs. ``hook`` chains the excepthook onto ``sys.excepthook``;
    ``on_abort(message)`` runs just before a stalled rank ends itself (run_ranks sends the
    message to the parent).
    """
    global _monitor, _previous_hook
    if not dist.is_initialized():
        raise ConfigError("the health monitor needs an initialised process group", where="health.start",
                          fix="call autopar.runtime.health.init_distributed() instead, or "
                              "torch.distributed.init_process_group first")
    if timeout_s is not None:
        set_timeout(timeout_s)
    if monitor() is not None:
        return _monitor
    base = dist.distributed_c10d._get_default_store()
    try:
        store = base.clone()            # a connection of its own, with its own short timeout
        store.set_timeout(timedelta(seconds=_STORE_OP_S))
    except Exception:  # noqa: BLE001 - a store without clone(): share it, keeping its timeout
        store = base
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host = None if agent or _store_address(base) == "?" else 0
    _monitor = Monitor(store, dist.get_rank(), dist.get_world_size(), timeout_s=_group_timeout_s(),
                       beat_s=beat_s or beat_interval(dist.get_world_size()), store_host=host,
                       on_abort=on_abort, keep=base).start()
    if hook and sys.excepthook is not _excepthook:
        _previous_hook, sys.excepthook = sys.excepthook, _excepthook
    return _monitor


def set_timeout(timeout_s: float) -> None:
    """Make timeout_s the timeout of every collective: of the groups that exist, and of those
    made later without one (torch would give those its own default, 30 minutes for gloo,
    whatever the default group's timeout; device meshes make such groups)."""
    timeout = timedelta(seconds=resolve_timeout(timeout_s))
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timeout, group)
        except Exception:  # noqa: BLE001 - a group this rank is not in, or a backend without timeouts
            pass


def _group_timeout_s() -> float | None:
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - only used in messages
        return None


def resolve_timeout(timeout_s: float | None = None) -> float:
    """timeout_s, else $AUTOPAR_TIMEOUT_S, else DEFAULT_TIMEOUT_S; a positive, finite number."""
    raw, source = (timeout_s, "timeout_s") if timeout_s is not None else (os.environ.get(TIMEOUT_ENV), TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{source} must be a positive number of seconds", where="health.resolve_timeout",
                          expected="e.g. 300", got=repr(raw),
                          fix=f"set {TIMEOUT_ENV} to the longest a collective may wait for a slow rank")
    return value


def share_secret() -> None:
    """Give every rank of the default group one job secret (``AUTOPAR_JOB_SECRET``), made by rank 0
    and broadcast over the group (not through the store), unless the environment has one. The
    health records' keys hold it (:class:`Monitor`). A collective: every rank calls it."""
    if os.environ.get(SECRET_ENV) or dist.get_world_size() == 1:
        return
    box = [secrets.token_hex(16) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    os.environ[SECRET_ENV] = str(box[0])


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> Monitor:
    """Initialise the default process group with a collective timeout and start the monitor.

    Under torchrun (``WORLD_SIZE`` set) the group comes from the environment (``env://``);
    without it, a world of one. ``backend``: nccl when CUDA is available, else gloo.
    ``timeout_s``: see :func:`resolve_timeout`; it applies to every group, those made later
    included (:func:`set_timeout`). A group already initialised is kept, with this timeout.
    """
    timeout = resolve_timeout(timeout_s)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ:
            if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("MASTER_ADDR"):
                from autopar.runtime.launch import interface_for
                name = interface_for(os.environ["MASTER_ADDR"])     # gloo listens there, not on every interface
                if name is not None:
                    os.environ["GLOO_SOCKET_IFNAME"] = name
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout))
    if monitor() is None:
        share_secret()
    return start(timeout_s=timeout)


@atexit.register
def _at_exit() -> None:
    """The last atexit handler (registered when autopar is imported): stop the monitor; a rank
    that failed then exits at once, so that it ends before the peers it takes down."""
    if _monitor is not None:
        _monitor.stop()
        if _exit_code is not None:
            _exit_now(_exit_code)
