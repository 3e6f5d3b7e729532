"""Nodes: tensor-parallel (and expert) groups stay inside one.

Two torchrun "nodes" of two ranks each on localhost (static rendezvous, ``--node-rank`` 0 and
1): every rank learns its node (torchrun's node rank); a plan made for tp=4 and scaled to the
four ranks by ``autopar.scale_plan`` (``LOCAL_WORLD_SIZE`` = 2) becomes dp=2 x tp=2 with each
tensor group inside a node; a user's ``{"tp": 4}`` still runs, with a warning on rank 0 that
names the two nodes and the simulator's price of its tensor-axis communication on these links
against inside one node. Plus the pure pieces: node layouts, groups' spans, scaling by node.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.nodes import regular_layout, spanning_groups
from tests.test_scaled_plan import _saved

ROOT = Path(__file__).resolve().parents[1]


def test_layouts_and_spans():
    assert regular_layout((0, 0, 1, 1)) == (2, 2)
    assert regular_layout((0, 1, 0, 1)) is None            # interleaved: not how torchrun numbers ranks
    assert regular_layout((0, 0, 0, 1)) is None
    ranks = torch.arange(8).reshape(2, 4)                   # dp=2 x tp=4 on 2 nodes of 4, and of 2
    assert spanning_groups(ranks, 1, (0, 0, 0, 0, 1, 1, 1, 1)) == 1
    assert spanning_groups(ranks, 1, (0, 0, 1, 1, 2, 2, 3, 3)) == 2
    assert spanning_groups(ranks, 0, (0, 0, 0, 0, 1, 1, 1, 1)) == 2


def test_scaling_keeps_tensor_and_expert_axes_inside_a_node():
    s = autopar.scale_plan(_saved(dp=2, tp=8, pp=1, schedule="1f1b", virtual=1, m=2), world=16, per_node=4)
    assert s.mesh == {"dp": 4, "tp": 4} and any("nodes of 4 ranks" in n for n in s.notes)
    s = autopar.scale_plan(_saved(dp=2, tp=8, pp=1, schedule="1f1b", virtual=1, m=2), world=16, per_node=8)
    assert s.mesh == {"dp": 2, "tp": 8} and not any("nodes of" in n for n in s.notes)   # fits a node: unchanged
    s = autopar.scale_plan(_saved(dp=8, tp=2, pp=1, ep=4, schedule="1f1b", virtual=1, m=2), world=16, per_node=4)
    assert s.mesh["tp"] * s.mesh["ep"] <= 4 and 4 % (s.mesh["tp"] * s.mesh["ep"]) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_keep_tp_inside_a_node(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(ROOT / "tests" / "nodes_run.py"), str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        finished = [p.communicate(timeout=400) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for p, (_, err) in zip(nodes, finished):
        assert p.returncode == 0, err[-3000:]
    r = json.loads(out.read_text())
    assert r["nodes"] == [0, 0, 1, 1]
    assert r["scaled_mesh"] == {"dp": 2, "tp": 2} and any("2 nodes of 2 ranks" in n for n in r["notes"])
    assert r["own"]["tp_groups"] == [[0, 1], [0, 1], [2, 3], [2, 3]]       # each inside a node
    assert r["own"]["split"] >= 2 and r["user"]["split"] >= 2              # weights really were split
    assert not [w for w in r["own"]["warnings"] if "spans" in w]
    spans = [w for w in r["user"]["warnings"] if "tp=4 spans 2 nodes" in w]
    assert spans and "ms per step" in spans[0] and "inside one node" in spans[0], r["user"]["warnings"]
