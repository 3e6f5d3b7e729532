"""Shared helpers for autopar's tests."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import pytest
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar import analyze, capture
from autopar import models


TOKEN_DIMS = ({0: "batch", 1: "seq"},)

# One capture cache for the session (every rank process inherits it), never the user's.
os.environ.setdefault("AUTOPAR_CACHE_DIR", tempfile.mkdtemp(prefix="autopar-test-cache-"))


def small(name: str, **overrides):
    """A small zoo model built on CPU (deterministic weights)."""
    torch.manual_seed(0)
    return models.build(name, {k: v for k, v in overrides.items()}, device="cpu")


def analysed(model, args, dims=None, **kw):
    return analyze(capture(model, args, dims=dims, **kw))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fake_world():
    """``fake_world(n)`` makes this process one of ``n`` fake ranks until the test ends."""
    def start(n: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


# A test module that runs its cases in shared process worlds defines ``_world(size)`` (every
# case on ``size`` ranks in one world, results by case); these run each world once per module.
@pytest.fixture(scope="module")
def world2(request) -> dict:
    return request.module._world(2)


@pytest.fixture(scope="module")
def world4(request) -> dict:
    return request.module._world(4)
