"""A one-host world listens on loopback only, and its store obeys no one but its ranks.

In a real two-rank gloo world from ``run_ranks`` (what ``autopar train`` uses), each rank lists
the TCP sockets it listens on (``/proc/net/tcp``, ``tcp6``): every one is bound to a loopback
address (torch's store on its own binds every interface, gloo the hostname's). Then a stranger
on the host connects to the store's port, as anyone who can reach it could: the records
under the names the health monitor used before (``autopar/hb/0``) are not there, and writing
the old order to stop (``autopar/abort/1``) leaves rank 1 running (it would exit with code 4
within a beat).
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest

from autopar.runtime.launch import run_ranks

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}     # 127.0.0.1, ::1 as /proc writes them


def listening(pid: int) -> list[tuple[str, int]]:
    """(address in /proc's hex form, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:          # state LISTEN, this process's socket
                addr, port = f[1].split(":")
                out.append((addr, int(port, 16)))
    return out


def _rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)                      # gloo's pairs exist
    out = {"listening": listening(os.getpid())}
    # a connection of its own to the store, with the group's key prefix (fixed by torch, so
    # known to anyone): what a stranger who reaches the port has
    stranger = dist.distributed_c10d._get_default_store().clone()
    stranger.set_timeout(timedelta(seconds=5))
    time.sleep(1.5)                         # every rank has beaten at least once
    out["read"] = stranger.check(["autopar/hb/0"])
    if rank == 0:
        stranger.set("autopar/abort/1", json.dumps({"why": "a stranger says so", "by": 0}))
    dist.barrier()
    time.sleep(3.0)                         # three beats: rank 1's monitor reads its orders every beat
    dist.barrier()
    out["alive"] = True
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp on this system")
    return run_ranks(_rank, 2, timeout_s=120)


def test_every_listening_socket_is_loopback(ranks):
    for r, got in enumerate(ranks):
        assert got["listening"], r
        outside = [a for a in got["listening"] if a[0] not in LOOPBACK]
        assert not outside, (r, got["listening"])


def test_a_stranger_on_the_port_neither_reads_records_nor_stops_a_rank(ranks):
    assert [got["read"] for got in ranks] == [False, False]
    assert [got["alive"] for got in ranks] == [True, True]


def test_gloo_is_pointed_at_the_interface_that_reaches_the_master():
    """Under torchrun, ``init_distributed`` sets ``GLOO_SOCKET_IFNAME`` to the interface traffic
    to ``MASTER_ADDR`` leaves by: loopback for a one-host job."""
    from autopar.runtime.launch import interface_for, loopback_interface
    assert interface_for("127.0.0.1") == loopback_interface() is not None
    assert interface_for("localhost") == loopback_interface()
    assert interface_for("no-such-host.invalid") is None
