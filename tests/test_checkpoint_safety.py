"""Checkpoints are safe to read and to write (autopar.checkpoint.integrity).

- Reading runs nothing from the files: a crafted ``.metadata`` or stored object whose
  pickle calls ``os.system`` is refused with a CheckpointError naming it, and the file it
  would have created does not appear, whether or not the manifest was rewritten to match.
- Every file is checked before it is read: each of 40 single-bit flips in a shard (and 10 in
  ``.metadata``) is a CheckpointError naming the file.
- One save at a time per directory: a held lock refuses a second saver, naming the owner; two
  processes racing to save step 5 end with one success, one CheckpointError, and a
  checkpoint equal to the winner's model.
- ``LATEST`` only moves forward.
- Missing shard, truncated or garbage ``.metadata``, read-only directory, full disk,
  ``LATEST`` a directory or garbage: each a CheckpointError that says what, where and how to fix.

Everything is single-process with no process group, on an ``nn.Linear``.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import multiprocessing
import os
import pickle
import random
import resource
import signal
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar.checkpoint import integrity
from autopar.core.errors import CheckpointError

SHARD = "__0_0.distcp"


def _model(seed: int, width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A linear layer and its AdamW optimizer after one step (so it has state)."""
    torch.manual_seed(seed)
    model = nn.Linear(width, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _fresh(width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(width, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _reseal(target: Path) -> None:
    """Rewrite the manifest to match the files as they are now: what an attacker who can
    write the directory can do, so only the restricted unpickler stands in the way."""
    integrity.write_manifest(target, {n: integrity.digest(target / n) for n in os.listdir(target)
                                      if n.endswith(".distcp")})


class _Evil:
    """Pickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path, nn.Module]:
    """(root, checkpoint directory, the model saved in it)."""
    model, opt = _model(0)
    target = autopar.save(model, opt, tmp_path / "ckpt", step=1)
    return tmp_path / "ckpt", target, model


# -- nothing runs ------------------------------------------------------------------------------
@pytest.mark.parametrize("seal", [True, False], ids=["manifest-rewritten", "manifest-removed"])
def test_a_crafted_metadata_runs_nothing(saved, tmp_path, seal):
    root, target, _ = saved
    marker = tmp_path / "pwned-metadata"
    with open(target / ".metadata", "rb") as f:
        md = pickle.load(f)                 # our own, trusted file
    md.planner_data = _Evil(marker)         # a real Metadata carrying a payload
    (target / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(target) if seal else (target / "MANIFEST.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="no MANIFEST") if not seal else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match="system") as err:
            autopar.load(*_fresh(), root)
    assert "nothing was run" in str(err.value) and "fix:" in str(err.value)
    assert not marker.exists()


def test_a_metadata_that_sets_attributes_on_a_class_is_refused(saved):
    from torch.distributed.checkpoint.metadata import Metadata
    root, target, _ = saved
    # protocol 0: Metadata (the class itself), then BUILD with slot state {"version": "evil"}
    (target / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\nMetadata\n"
                                       b"(N}(Vversion\nVevil\nutb.")
    _reseal(target)
    with pytest.raises(CheckpointError, match="setting attributes of the class Metadata"):
        autopar.load(*_fresh(), root)
    assert Metadata.version is None


@pytest.mark.parametrize("seal", [True, False], ids=["manifest-rewritten", "manifest-removed"])
def test_a_crafted_stored_object_runs_nothing(saved, tmp_path, seal):
    root, target, _ = saved
    marker = tmp_path / "pwned-object"
    with open(target / ".metadata", "rb") as f:
        md = pickle.load(f)
    key = next(k for k in md.storage_data if k.fqn == "autopar/meta")
    info = md.storage_data[key]
    buf = io.BytesIO()
    torch.save({"format": 1, "step": 1, "extra": _Evil(marker)}, buf)
    evil = buf.getvalue()
    data = (target / info.relative_path).read_bytes()
    (target / info.relative_path).write_bytes(data[:info.offset] + evil + data[info.offset + info.length:])
    shift = len(evil) - info.length
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += shift
    info.length = len(evil)
    (target / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(target) if seal else (target / "MANIFEST.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="no MANIFEST") if not seal else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match="system") as err:
            autopar.load(*_fresh(), root)
    assert "autopar/meta" in str(err.value)
    assert not marker.exists()


def test_save_refuses_what_a_load_would_refuse(tmp_path):
    model, opt = _model(0)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        autopar.save(model, opt, tmp_path, step=1, extra={"loader": object()})
    opt.state[model.weight]["custom"] = _Evil(tmp_path / "x")
    with pytest.raises(CheckpointError, match="optim/weight/custom"):
        autopar.save(model, opt, tmp_path, step=1)
    assert not (tmp_path / "LATEST").exists() and not (tmp_path / integrity.LOCK).exists()


def test_extra_comes_back_as_json_reads_it(tmp_path):
    model, opt = _model(0)
    autopar.save(model, opt, tmp_path, step=3, extra={"pos": (1, 2), "name": "shard-7", 4: 0.5})
    info = autopar.load(*_fresh(), tmp_path)
    assert info["extra"] == {"pos": [1, 2], "name": "shard-7", "4": 0.5} and info["step"] == 3


# -- every file checked ----------------------------------------------------------------------
def test_every_single_bit_flip_is_caught(saved):
    root, target, model = saved
    rng = random.Random(20240607)
    for name, flips in ((SHARD, 40), (".metadata", 10)):
        path = target / name
        good = path.read_bytes()
        caught = 0
        for _ in range(flips):
            bit = rng.randrange(len(good) * 8)
            bad = bytearray(good)
            bad[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(bad))
            with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as err:
                autopar.load(*_fresh(), root)
            caught += "corrupt" in str(err.value)
        path.write_bytes(good)
        assert caught == flips
    loaded, opt = _fresh()
    autopar.load(loaded, opt, root)
    assert _same(loaded, model)


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(saved):
    root, target, model = saved
    (target / "MANIFEST.json").unlink()
    loaded, opt = _fresh()
    with pytest.warns(UserWarning, match="cannot be verified"):
        autopar.load(loaded, opt, root)
    assert _same(loaded, model)


# -- one save at a time ------------------------------------------------------------------------
def test_a_held_lock_refuses_a_second_saver(saved):
    root, _, first = saved
    token = integrity.acquire(root)         # another saver, mid-save
    second, opt = _model(1)
    with pytest.raises(CheckpointError, match="another save .* is in progress") as err:
        autopar.save(second, opt, root, step=5)
    text = str(err.value)
    assert f"pid {os.getpid()}" in text and socket.gethostname() in text and "delete" in text
    assert not (root / "step-00000005").exists() and (root / "LATEST").read_text().strip() == "step-00000001"
    integrity.release(root, token)
    autopar.save(second, opt, root, step=5)
    loaded, o = _fresh()
    autopar.load(loaded, o, root)
    assert _same(loaded, second) and not (root / integrity.LOCK).exists()


def test_a_stale_lock_from_this_host_is_broken_and_one_from_another_is_named(saved):
    root, _, _ = saved
    lock = root / integrity.LOCK
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**30,      # a save killed part-way
                                "time": "2024-01-01 00:00:00", "token": "x"}))
    with pytest.warns(UserWarning, match="breaking the stale lock"):
        autopar.save(*_model(1), root, step=2)
    assert (root / "LATEST").read_text().strip() == "step-00000002" and not lock.exists()
    lock.write_text(json.dumps({"host": "another-host", "pid": 2**30, "time": "2024-01-01 00:00:00", "token": "y"}))
    with pytest.raises(CheckpointError, match="another save .* is in progress") as err:
        autopar.save(*_model(1), root, step=3)
    assert str(lock) in str(err.value) and "another-host" in str(err.value)


def _race_saver(root: str, seed: int, barrier, results) -> None:
    torch.set_num_threads(1)
    model, opt = _model(seed)
    barrier.wait()
    try:
        autopar.save(model, opt, root, step=5)
        results.put((seed, "saved"))
    except CheckpointError as e:
        results.put((seed, str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the test, not lost in the child
        results.put((seed, f"RAW {type(e).__name__}: {e}"))


def test_two_processes_racing_to_save_leave_one_whole_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        root = tmp_path / f"race{round_}"
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_race_saver, args=(str(root), seed, barrier, results)) for seed in (10, 11)]
        for p in procs:
            p.start()
        outcome = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        winners = [s for s, r in outcome.items() if r == "saved"]
        assert len(winners) == 1, outcome
        loser = outcome[21 - winners[0]]
        assert "in progress" in loser or "current checkpoint" in loser, loser
        loaded, opt = _fresh()
        autopar.load(loaded, opt, root)
        assert _same(loaded, _model(winners[0])[0])
        assert not (root / integrity.LOCK).exists()


# -- LATEST moves forward ------------------------------------------------------------------------
def test_latest_never_moves_back(tmp_path):
    seven, opt7 = _model(7)
    five, opt5 = _model(5)
    autopar.save(seven, opt7, tmp_path, step=7)
    with pytest.warns(UserWarning, match="only moves forward"):
        older = autopar.save(five, opt5, tmp_path, step=5)
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000007"
    loaded, opt = _fresh()
    assert autopar.load(loaded, opt, tmp_path)["step"] == 7 and _same(loaded, seven)
    assert autopar.load(loaded, opt, older)["step"] == 5 and _same(loaded, five)   # still loadable by path


# -- I/O failures are CheckpointErrors ---------------------------------------------------------
def test_a_missing_shard_is_named(saved):
    root, target, _ = saved
    (target / SHARD).unlink()
    with pytest.raises(CheckpointError, match="missing") as err:
        autopar.load(*_fresh(), root)
    assert SHARD in str(err.value) and "fix:" in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
@pytest.mark.parametrize("seal", [True, False], ids=["manifest", "no-manifest"])
def test_a_broken_metadata_is_named(saved, damage, seal):
    root, target, _ = saved
    path = target / ".metadata"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else bytes(random.Random(3).randbytes(500)))
    if not seal:
        (target / "MANIFEST.json").unlink()
    with pytest.warns(UserWarning, match="no MANIFEST") if not seal else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=r"\.metadata") as err:
            autopar.load(*_fresh(), root)
    assert ("corrupt" if seal else "unreadable") in str(err.value) and "fix:" in str(err.value)


def test_a_garbage_manifest_is_named(saved):
    root, target, _ = saved
    (target / "MANIFEST.json").write_bytes(b"\x00\xffnot json")
    with pytest.raises(CheckpointError, match="MANIFEST.json is unreadable"):
        autopar.load(*_fresh(), root)


def test_a_read_only_directory_is_named(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        probe = root / "probe"
        try:
            probe.touch()                   # root ignores permissions: refuse writes below root by hand
            probe.unlink()
            real = os.open

            def refusing(path, *a, **kw):
                if str(path).startswith(str(root)):
                    raise PermissionError(errno.EACCES, "Permission denied", str(path))
                return real(path, *a, **kw)
            monkeypatch.setattr(os, "open", refusing)
        except PermissionError:
            pass
        with pytest.raises(CheckpointError, match="not writable") as err:
            autopar.save(*_model(0), root, step=1)
        assert str(root) in str(err.value) and "writable" in err.value.fix
    finally:
        root.chmod(0o755)


def test_a_full_disk_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    first, opt1 = _model(0, width=64)
    autopar.save(first, opt1, tmp_path, step=1)
    second, opt2 = _model(1, width=64)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8000, old_limit[1]))   # writes past 8 kB fail, as on a full disk
    try:
        with pytest.raises(CheckpointError, match="out of space") as err:
            autopar.save(second, opt2, tmp_path, step=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "step-00000002" in str(err.value) and "LATEST still names" in err.value.fix
    assert "unexpected pos" not in str(err.value)
    loaded, opt = _fresh(width=64)
    assert autopar.load(loaded, opt, tmp_path)["step"] == 1 and _same(loaded, first)
    assert not (tmp_path / "step-00000002").exists()    # the partial directory is gone with its space
    autopar.save(second, opt2, tmp_path, step=2)        # the lock was released
    assert autopar.load(loaded, opt, tmp_path)["step"] == 2 and _same(loaded, second)


# -- links and sizes planted by someone who can write the directory ---------------------------
@pytest.mark.parametrize("where", ["step directory", "shard inside it"])
def test_a_planted_symlink_is_refused_and_nothing_outside_is_written(tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("keep me")
    root = tmp_path / "ckpt"
    root.mkdir()
    if where == "step directory":
        (root / "step-00000001").symlink_to(outside, target_is_directory=True)
    else:
        (root / "step-00000001").mkdir()
        (root / "step-00000001" / SHARD).symlink_to(victim)
    model, opt = _model(0)
    with pytest.raises(CheckpointError, match="symbolic link") as err:
        autopar.save(model, opt, root, step=1)
    assert "fix:" in str(err.value)
    assert victim.read_text() == "keep me" and sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


def test_temporary_names_are_not_predictable(saved, monkeypatch):
    """The manifest and LATEST are written through fresh, exclusively created files: a link
    planted at the old predictable name (``.MANIFEST.json.<pid>``) is left alone."""
    root, target, _ = saved
    bait = root.parent / "bait.txt"
    bait.write_text("keep me")
    for where in (target / f".MANIFEST.json.{os.getpid()}", root / f".LATEST.{os.getpid()}"):
        where.symlink_to(bait)
    model, opt = _model(1)
    autopar.save(model, opt, root, step=2)
    assert bait.read_text() == "keep me"


def test_a_metadata_declaring_a_huge_array_allocates_nothing(saved):
    """32 bytes whose BYTEARRAY8 declares 1.9 GB: refused before any allocation."""
    import tracemalloc
    from autopar.checkpoint.safe_pickle import safe_unpickle
    bomb = pickle.PROTO + bytes([5]) + pickle.BYTEARRAY8 + (1_900_000_000).to_bytes(8, "little") + b"\0" * 8 \
        + pickle.STOP
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="1900000000-byte array"):
            safe_unpickle(bomb, "the .metadata", "autopar.load")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak
    root, target, _ = saved
    (target / ".metadata").write_bytes(bomb)
    _reseal(target)
    with pytest.raises(CheckpointError, match="byte array"):
        autopar.load(*_fresh(), root)


@pytest.mark.parametrize("latest", ["directory", "binary", "escape"])
def test_a_broken_latest_is_named(saved, latest):
    root, _, _ = saved
    marker = root / "LATEST"
    marker.unlink()
    if latest == "directory":
        marker.mkdir()
    else:
        marker.write_bytes(bytes(range(256)) if latest == "binary" else b"../../etc\n")
    for call in (lambda: autopar.load(*_fresh(), root), lambda: autopar.save(*_model(1), root, step=2)):
        with pytest.raises(CheckpointError, match="LATEST is") as err:
            call()
        assert str(marker) in str(err.value) and "delete" in err.value.fix



# -- two ranks ---------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int, root: str) -> dict:
    """Rank 0 holds the lock as another saver would: both ranks' saves must raise. Then a
    real two-rank save; then a corrupted shard: both ranks' loads must raise."""
    import torch.distributed as dist
    root_p = Path(root)
    out = {}
    model, opt = _model(0)
    token = integrity.acquire(root_p) if rank == 0 else None
    dist.barrier()
    try:
        autopar.save(model, opt, root, step=1)
        out["locked"] = "saved"
    except CheckpointError as e:
        out["locked"] = str(e)
    if rank == 0:
        integrity.release(root_p, token)
    target = autopar.save(model, opt, root, step=2)
    out["files"] = sorted(integrity.read_manifest(target))
    loaded, lopt = _fresh()
    autopar.load(loaded, lopt, root)
    out["same"] = _same(loaded, model)
    dist.barrier()
    if rank == 0:
        shard = target / sorted(n for n in out["files"] if n.endswith(".distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        autopar.load(loaded, lopt, root)
        out["corrupt"] = "loaded"
    except CheckpointError as e:
        out["corrupt"] = str(e)
    return out


def test_two_ranks_raise_together(tmp_path):
    from autopar.runtime.launch import run_ranks
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout_s=120)
    for r in results:
        assert "another save" in r["locked"], r["locked"]
        assert r["same"] and ".metadata" in r["files"]
        assert "corrupt" in r["corrupt"] and ".distcp" in r["corrupt"], r["corrupt"]


@pytest.mark.parametrize("record", [7, ["lr"], [{"lr": "0.1; rm -rf /"}], [{"betas": (0.9,)}],
                                    [{"not_a_setting": 1}], [{1: 2}]],
                         ids=["not a list", "not dicts", "lr a string", "short betas", "unknown key", "int key"])
def test_a_crafted_parameter_group_record_is_a_checkpoint_error(record):
    from autopar.checkpoint.state import _restore_groups
    _, opt = _model(0)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(CheckpointError, match="param_groups") as err:
        _restore_groups(opt, record)
    assert "fix:" in str(err.value)
    assert [dict(g) for g in opt.param_groups] == before          # nothing half-applied


def test_a_signed_checkpoint_refuses_a_rewritten_manifest_and_another_key(tmp_path):
    """save(key=) signs the manifest: rewritten to match a changed weight (what the manifest
    alone cannot catch), loaded with another key, or unsigned, each is refused."""
    model, opt = _model(0)
    target = autopar.save(model, opt, tmp_path, step=1, key="s3cret")
    loaded, lopt = _fresh()
    assert autopar.load(loaded, lopt, tmp_path, key="s3cret")["step"] == 1 and _same(loaded, model)
    with pytest.raises(CheckpointError, match="signed with another key"):
        autopar.load(*_fresh(), tmp_path, key="guess")
    raw = bytearray((target / SHARD).read_bytes())
    raw[-40] ^= 0x10                                  # a weight changed by someone who can write the directory
    (target / SHARD).write_bytes(bytes(raw))
    _reseal(target)                                   # ... and who rewrote the manifest to match
    autopar.load(*_fresh(), tmp_path)                 # without a key: nothing can tell
    with pytest.raises(CheckpointError, match="not signed|altered") as err:
        autopar.load(*_fresh(), tmp_path, key="s3cret")
    assert "fix:" in str(err.value)
