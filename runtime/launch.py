"""Run a function on N real torch.distributed ranks on this one machine.

For tests and benchmarks that need genuine multi-process gloo worlds (real collectives,
real process boundaries) without a cluster launcher::

    from autopar.runtime.launch import run_ranks

    def work(rank: int, world: int, n: int) -> torch.Tensor:   # module level: picklable
        t = torch.full((n,), rank + 1.0)
        torch.distributed.all_reduce(t)
        return t

    results = run_ranks(work, 4, 8)      # results[r] is what rank r returned

Ranks are forked from a cached ``forkserver`` that has already imported torch,
torch.distributed and autopar, so after the first call a world of 4 starts in well under
a second. ``fn`` and its extra arguments must be picklable (a module-level function, not
a lambda or closure); so must the return values. Results are sent back with plain
``pickle`` (tensors by value, no shared memory), so a rank may exit right after replying.
A script that calls run_ranks at top level needs the ``if __name__ == "__main__":`` guard,
as with any non-fork multiprocessing start method.

Each rank runs the health monitor (``runtime/health.py``) and exits with the code a
torchrun rank would: when a rank raises, dies or stalls, the others stop naming it and its
step. ``run_ranks`` raises AutoparError for the first rank to fail (the root cause, not the
ranks that stopped because of it); ``run_ranks_outcomes`` waits for every rank and returns
how each ended (:class:`RankOutcome`), which is what fault tests need.
``collective_timeout_s`` is every collective's timeout (default: the call's ``timeout_s``).
"""
from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from autopar.core.errors import AutoparError

__all__ = ["RankOutcome", "run_ranks", "run_ranks_outcomes"]

_PRELOAD = ["torch", "torch.distributed", "torch.distributed._functional_collectives", "torch._dynamo", "autopar"]
_CTX: Any = None
_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' reports
# A rank whose traceback has one of these most likely failed because a peer died first.
_COLLATERAL = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
               "DistBackendError", "DistNetworkError")


def _context() -> Any:
    """The forkserver context, created once so every call reuses the same warm server."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LISTENING: list[socket.socket] = []
_WATCH_S = 0.5                 # how often a rank checks that its launcher still runs
EXIT_ORPHANED = 5              # a rank's exit code when its launcher died


def loopback_interface() -> str | None:
    """The name of this host's loopback interface (``lo`` on Linux), None if it has none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)


def interface_for(address: str) -> str | None:
    """The name of this host's interface that traffic to ``address`` leaves by (the loopback
    one for 127.0.0.1 or this host's own address), None if it cannot be told (no route, not
    Linux). Reads the kernel's route choice (a UDP connect sends nothing) and each interface's
    address (``SIOCGIFADDR``)."""
    import fcntl
    import struct
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(address), 9))
            mine = probe.getsockname()[0]
    except OSError:
        return None
    if mine.startswith("127."):
        return loopback_interface()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))   # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == mine:
                return name
    return None


def _loopback_store(rank: int, world: int, port: int) -> Any:
    """The world's store, listening on 127.0.0.1 only (torch's own binds every interface), and
    gloo's sockets on the loopback interface: nothing of a one-host world is reachable from
    another host."""
    import torch.distributed as dist

    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    timeout = timedelta(seconds=60)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(max(64, world))
    _LISTENING.append(sock)          # the store serves on this socket: open as long as the process
    return dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=sock.fileno())


def _watch_launcher(pid: int, rank: int) -> None:
    """End this rank when the process that launched it is gone (killed, even by SIGKILL): a
    rank is a child of the forkserver, so nothing else would stop it."""
    import threading

    from autopar.runtime.faults import alive

    def watch() -> None:
        while alive(pid):
            time.sleep(_WATCH_S)
        sys.stderr.write(f"rank {rank}: its launcher (pid {pid}) is gone; stopping\n")
        sys.stderr.flush()
        os._exit(EXIT_ORPHANED)
    threading.Thread(target=watch, name=f"autopar-launcher-watch-{rank}", daemon=True).start()


@contextlib.contextmanager
def _terminated_as_exit() -> Iterator[None]:
    """SIGTERM to the launcher (as ``kill`` or a scheduler sends) raises SystemExit in its main
    thread, so the ranks are stopped on the way out instead of being left running."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, secret: str, launcher: int, backend: str,
               timeout_s: float, args: tuple[Any, ...], out: Connection) -> None:
    """Body of one rank process: join the group, start the health monitor, run fn, send
    (kind, payload) back and exit with the code a torchrun rank would (runtime/health.py):
    ("ok", pickled result) 0; ("err", traceback) 1; ("peer", PeerFailureError text) 3;
    ("stalled", message and stack, sent by the monitor) 4."""
    import torch
    import torch.distributed as dist

    from autopar.core.errors import PeerFailureError
    from autopar.runtime import health

    def send(kind: str, payload: Any) -> None:
        out.send_bytes(pickle.dumps((kind, payload)))

    # a native crash (SIGSEGV, or glibc's SIGABRT on a corrupted heap) prints every thread's
    # Python stack to the rank's stderr: the line it died on, not only the parent's "exited -6"
    faulthandler.enable(all_threads=True)
    _watch_launcher(launcher, rank)
    mon = None
    try:
        torch.set_num_threads(1)
        os.environ[health.SECRET_ENV] = secret
        dist.init_process_group(backend, rank=rank, world_size=world, store=_loopback_store(rank, world, port),
                                timeout=timedelta(seconds=timeout_s))
        mon = health.start(timeout_s=timeout_s, on_abort=lambda message: send("stalled", message))
        result = fn(rank, world, *args)
        stopped = health.stopped_by()      # another rank failed: this one did not finish, even if fn returned
        reply, code = (("peer", str(stopped)), health.EXIT_PEER_FAILED) if stopped is not None else \
            (("ok", pickle.dumps(result)), 0)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        err = health.explain(exc)
        if isinstance(err, PeerFailureError):
            reply, code = ("peer", str(err)), health.EXIT_PEER_FAILED
        else:
            reply, code = ("err", traceback.format_exc()), 1
    send(*reply)
    out.close()
    if mon is not None:
        mon.stop()         # on a failure, keeps the store up until the others have read why
    if code == 0:
        dist.destroy_process_group()
    sys.exit(code)   # multiprocessing skips atexit: the monitor's thread just ends with the process


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


class _World:
    """The rank processes of one call, each with the pipe it replies on."""

    def __init__(self, fn: Callable[..., Any], world: int, args: tuple[Any, ...], backend: str,
                 collective_timeout_s: float) -> None:
        ctx = _context()
        port, secret = _free_port(), secrets.token_hex(16)
        self.procs, self.readers = [], []
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"autopar-rank{rank}", daemon=True,
                               args=(fn, rank, world, port, secret, os.getpid(), backend, collective_timeout_s,
                                     args, writer))
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.readers.append(reader)

    def wait(self, ranks: list[int], seconds: float) -> None:
        wait([self.readers[r] for r in ranks] + [self.procs[r].sentinel for r in ranks], max(0.0, seconds))

    def check(self, rank: int) -> tuple[str, Any] | None:
        """rank's reply (kind, payload); ("died", exit code) if it ended without one; None while it runs."""
        if self.readers[rank].poll():
            try:
                return pickle.loads(self.readers[rank].recv_bytes())
            except EOFError:
                pass
        if not self.procs[rank].is_alive():
            self.procs[rank].join()
            return ("died", self.procs[rank].exitcode)
        return None

    def exitcode(self, rank: int, seconds: float) -> int | None:
        self.procs[rank].join(seconds)
        return self.procs[rank].exitcode

    def close(self) -> None:
        _stop(self.procs)
        for reader in self.readers:
            reader.close()


def _failure(rank: int, world: int, reply: tuple[str, Any]) -> tuple[int, str, str | None]:
    """(priority, what, detail) of a failed rank's reply; the lowest priority is the root cause:
    a rank that died (0), raised or stalled (1), failed because of another rank (2)."""
    kind, payload = reply
    head = f"rank {rank} of {world}"
    if kind == "died":
        return 0, f"{head} exited with code {payload} without reporting a result", None
    if kind == "stalled":
        return 1, f"{head} stalled: {payload.splitlines()[0]}", payload
    if kind == "peer":
        return 2, f"{head} stopped: {payload.splitlines()[0]}", payload
    tb = payload.strip() or "?"
    prio = 2 if any(mark in tb for mark in _COLLATERAL) else 1
    return prio, f"{head} raised: {_last_line(tb)}", tb


def _last_line(tb: str) -> str:
    """The exception line of a traceback (notes added after it are skipped)."""
    lines = tb.splitlines()
    for line in reversed(lines):
        if line and not line.startswith((" ", "autopar: ")):
            return line
    return lines[-1]


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
              backend: str = "gloo", collective_timeout_s: float | None = None) -> list[Any]:
    """Run fn(rank, world, *args) on `world` fresh processes with an initialised default
    process group; return the list of per-rank return values (index = rank).

    fn must be a module-level (picklable) function; args and return values must pickle.
    If a rank raises or dies, the other ranks are terminated and AutoparError names the
    rank (with its traceback or exit code). The whole call waits at most timeout_s; each
    collective at most collective_timeout_s (default: timeout_s).
    """
    _check_world(world)
    where = f"run_ranks({getattr(fn, '__qualname__', fn)!s}, world={world})"
    with _terminated_as_exit():
        return _run(fn, world, args, timeout_s, backend, collective_timeout_s, where)


def _run(fn: Callable[..., Any], world: int, args: tuple, timeout_s: float, backend: str,
         collective_timeout_s: float | None, where: str) -> list[Any]:
    ranks = _World(fn, world, args, backend, collective_timeout_s or timeout_s)
    results: dict[int, Any] = {}
    failed: dict[int, tuple[int, str, str | None]] = {}  # rank -> (priority, what, detail)
    deadline = grace_end = time.monotonic() + timeout_s
    try:
        while pending := [r for r in range(world) if r not in results and r not in failed]:
            left = min(deadline, grace_end) - time.monotonic()
            if left <= 0:
                break
            ranks.wait(pending, left)
            for rank in pending:
                reply = ranks.check(rank)
                if reply is not None and reply[0] == "ok":
                    results[rank] = pickle.loads(reply[1])
                elif reply is not None:
                    failed[rank] = _failure(rank, world, reply)
                if failed and grace_end > time.monotonic() + _GRACE_S:
                    grace_end = time.monotonic() + _GRACE_S  # collect the others' failures
        if failed:
            raise _first_failure(failed, where)
        if pending:
            raise AutoparError(f"ranks {pending} of {world} did not finish within {timeout_s:g} s",
                               where=where, fix="look for a rank stuck in a collective that "
                               "the others never join, or raise timeout_s")
        for rank in range(world):
            ranks.exitcode(rank, max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        ranks.close()
    return [results[r] for r in range(world)]


def _check_world(world: int) -> None:
    if world < 1:
        raise AutoparError("run_ranks needs at least one rank", expected="world >= 1", got=str(world))


def _first_failure(failed: dict[int, tuple[int, str, str | None]], where: str) -> AutoparError:
    rank = min(failed, key=lambda r: (failed[r][0], r))
    _, what, detail = failed[rank]
    others = sorted(set(failed) - {rank})
    said = [failed[r][1] for r in others if failed[r][0] == 2 and " stopped: " in failed[r][1]]
    if detail:
        got = f"from rank {rank}:\n{detail}"
    else:
        got = f"the others said: {said[0]}" if said else None
    return AutoparError(
        what + (f" (ranks {others} also failed, likely as a result)" if others else ""), where=where, got=got,
        fix=None if detail else "the rank called os._exit, crashed or was killed; "
        "run fn on that rank alone to see why")


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_ranks_outcomes` ended.

    ``kind``: ok (``result`` is fn's value) | raised | peer (stopped because another rank
    failed: ``message`` is the PeerFailureError) | stalled (the others timed out waiting for
    it: ``message`` has its stack) | died (ended without a reply: killed, os._exit) |
    timeout (still running at the deadline; then killed). ``elapsed_s``: seconds from the
    start of the call to its reply or death. ``exitcode``: the process's (see runtime/health.py).
    """

    rank: int
    kind: str
    message: str
    elapsed_s: float
    exitcode: int | None
    result: Any = None


def run_ranks_outcomes(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
                       collective_timeout_s: float | None = None, backend: str = "gloo") -> list[RankOutcome]:
    """Like :func:`run_ranks`, but wait for every rank to end (or the deadline) instead of
    stopping the others at the first failure, and return how each ended: what fault tests
    need to see what the survivors said and how long they took."""
    _check_world(world)
    ranks = _World(fn, world, args, backend, collective_timeout_s or timeout_s)
    start = time.monotonic()
    got: dict[int, RankOutcome] = {}
    try:
        while pending := [r for r in range(world) if r not in got]:
            left = start + timeout_s - time.monotonic()
            if left <= 0:
                break
            ranks.wait(pending, left)
            for rank in pending:
                if (reply := ranks.check(rank)) is not None:
                    got[rank] = _outcome(rank, reply, time.monotonic() - start, ranks)
        for rank in pending:
            got[rank] = RankOutcome(rank, "timeout", f"still running after {timeout_s:g} s", timeout_s, None)
    finally:
        ranks.close()
    return [got[r] for r in range(world)]


def _outcome(rank: int, reply: tuple[str, Any], elapsed: float, ranks: _World) -> RankOutcome:
    kind, payload = reply
    if kind == "died":
        return RankOutcome(rank, "died", f"exited with code {payload} without a reply", elapsed, payload)
    code = ranks.exitcode(rank, 5.0)
    if kind == "ok":
        return RankOutcome(rank, "ok", "", elapsed, code, pickle.loads(payload))
    return RankOutcome(rank, {"err": "raised"}.get(kind, kind), payload, elapsed, code)
