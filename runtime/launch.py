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
"""
from __future__ import annotations

import multiprocessing
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from autopar.errors import AutoparError

__all__ = ["run_ranks"]

_PRELOAD = ["torch", "torch.distributed", "torch.distributed._functional_collectives", "autopar"]
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


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, backend: str,
               timeout_s: float, args: tuple[Any, ...], out: Connection) -> None:
    """Body of one rank process: join the group, run fn, send ("ok"|"err", payload) back."""
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=timeout_s))
        reply = ("ok", pickle.dumps(fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        out.close()
        return
    out.send_bytes(pickle.dumps(reply))
    out.close()
    dist.destroy_process_group()


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world, *args) on `world` fresh processes with an initialised default
    process group; return the list of per-rank return values (index = rank).

    fn must be a module-level (picklable) function; args and return values must pickle.
    If a rank raises or dies, the other ranks are terminated and AutoparError names the
    rank (with its traceback or exit code). The whole call waits at most timeout_s.
    """
    if world < 1:
        raise AutoparError("run_ranks needs at least one rank", expected="world >= 1", got=str(world))
    ctx = _context()
    where = f"run_ranks({getattr(fn, '__qualname__', fn)!s}, world={world})"
    port = _free_port()
    procs, readers = [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, name=f"autopar-rank{rank}", daemon=True,
                           args=(fn, rank, world, port, backend, timeout_s, args, writer))
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)

    results: dict[int, Any] = {}
    failed: dict[int, tuple[int, str, str | None]] = {}  # rank -> (priority, what, traceback)
    deadline = grace_end = time.monotonic() + timeout_s
    try:
        while pending := [r for r in range(world) if r not in results and r not in failed]:
            left = min(deadline, grace_end) - time.monotonic()
            if left <= 0:
                break
            wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], left)
            for rank in pending:
                reply = None
                if readers[rank].poll():
                    try:
                        reply = pickle.loads(readers[rank].recv_bytes())
                    except EOFError:
                        pass
                if reply is None and not procs[rank].is_alive():
                    procs[rank].join()
                    what = f"rank {rank} of {world} exited with code {procs[rank].exitcode}"
                    failed[rank] = (0, what + " without reporting a result", None)
                elif reply is not None and reply[0] == "err":
                    tb = reply[1].strip() or "?"
                    prio = 2 if any(mark in tb for mark in _COLLATERAL) else 1
                    failed[rank] = (prio, f"rank {rank} of {world} raised: {tb.splitlines()[-1]}", tb)
                elif reply is not None:
                    results[rank] = pickle.loads(reply[1])
                if failed and grace_end > time.monotonic() + _GRACE_S:
                    grace_end = time.monotonic() + _GRACE_S  # collect the others' failures
        if failed:
            rank = min(failed, key=lambda r: (failed[r][0], r))
            _, what, tb = failed[rank]
            others = sorted(set(failed) - {rank})
            raise AutoparError(
                what + (f" (ranks {others} also failed, likely as a result)" if others else ""), where=where,
                got=f"traceback from rank {rank}:\n{tb}" if tb else None,
                fix=None if tb else "the rank called os._exit, crashed or was killed; "
                "run fn on that rank alone to see why")
        if pending:
            raise AutoparError(f"ranks {pending} of {world} did not finish within {timeout_s:g} s",
                               where=where, fix="look for a rank stuck in a collective that "
                               "the others never join, or raise timeout_s")
        for proc in procs:
            proc.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
    return [results[r] for r in range(world)]
