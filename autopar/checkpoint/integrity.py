"""What keeps checkpoints safe to read and write: restricted unpickling, checksums, a save lock.

:mod:`autopar.checkpoint` lays tensors out; this module guards the files it reads and writes.

- **Nothing in a checkpoint runs code when it is read** (:mod:`autopar.checkpoint.safe_pickle`). ``.metadata`` goes through
  :class:`SafeUnpickler`, which resolves only an explicit allow-list of globals (the
  ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, dtypes, layouts,
  ``torch.device``, paths, ``OrderedDict`` and plain builtin containers) and refuses to
  set attributes on a class; stored objects (optimizer scalars, parameter groups, autopar's
  own record) go through ``torch.load(..., weights_only=True)``, torch's own allow-list. A
  refused global raises :class:`CheckpointError` naming it, before anything is built.
- **Every file is checked before it is read.** A save writes ``MANIFEST.json`` (size and
  sha256 of every shard file and of ``.metadata``) into the checkpoint directory; a load
  verifies them all first (the ranks split the files between them) and names any file that
  is missing, of the wrong size or of the wrong content. A directory with no manifest
  (written before it existed, or by another tool) loads with a warning, unverified, still
  through the restricted unpickler. The manifest guards against corruption, not against an
  attacker who can rewrite it: that is what the restricted unpickler is for.
- **One save at a time per checkpoint root.** ``<root>/.autopar-save.lock`` is created
  with ``O_CREAT | O_EXCL`` holding the owner's host, pid and start time; a second saver
  gets a :class:`CheckpointError` naming the owner. Only rank 0 takes it, and every rank
  learns the outcome (:func:`collectively`), so all ranks raise together. A lock left on this
  host by a process that is gone (a save killed part-way) is broken with a warning; one from
  another host never is (its owner may be alive): the error names it, and says to delete it.
- **``LATEST`` only moves forward**, and is read strictly (one plain directory name).

Every I/O failure becomes a :class:`CheckpointError` saying what, where and how to fix it
(:func:`io_error`), never a raw ``OSError`` or torch's "unexpected pos". :func:`write` and
:func:`read` drive ``torch.distributed.checkpoint`` for :mod:`autopar.checkpoint`, so all of
the above holds on every save and load.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import os
import shutil
import tempfile
import re
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DcpError   # a BaseException

from autopar.core.errors import CheckpointError
from autopar.checkpoint.safe_pickle import dump_object, load_object, safe_unpickle

MANIFEST = "MANIFEST.json"
LOCK = ".autopar-save.lock"
LATEST = "LATEST"
METADATA = ".metadata"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")    # a plain file or directory name
T = TypeVar("T")


# -- ranks agreeing --------------------------------------------------------------------------
def agree(error: CheckpointError | None, distributed: bool) -> None:
    """Raise on every rank when any rank failed (a rank raising alone would leave the others
    waiting in the next collective). A rank re-raises its own error, the others the first."""
    if not distributed:
        if error is not None:
            raise error
        return
    mine = None if error is None else (error.what, error.where, error.expected, error.got, error.fix)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if error is not None:
        raise error
    for rank, e in enumerate(everyone):
        if e is not None:
            what, where, expected, got, fix = e
            raise CheckpointError(f"{what} (on rank {rank})", where=where, expected=expected, got=got, fix=fix)


def collectively(fn: Callable[[], T], distributed: bool, *, rank0_only: bool = False) -> T | None:
    """Run ``fn`` (on rank 0 only, or on every rank) and raise its CheckpointError on all ranks."""
    out, err = None, None
    if not (rank0_only and distributed and dist.get_rank() != 0):
        try:
            out = fn()
        except CheckpointError as e:
            err = e
    agree(err, distributed)
    return out


# -- I/O errors ------------------------------------------------------------------------------
def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError under ``exc``: torch wraps it (``unexpected pos`` from its zip writer,
    a CheckpointException holding each rank's failure)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        for f in getattr(e, "failures", {}).values():
            todo.append(f[0] if isinstance(f, tuple) else f)
        todo += [e.__cause__, e.__context__]
    return None


def _one_line(exc: BaseException) -> str:
    for f in getattr(exc, "failures", {}).values():      # torch's CheckpointException: the first rank's cause
        return _one_line(f[0] if isinstance(f, tuple) else f)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def io_error(exc: BaseException, doing: str, where: str, fix: str | None = None) -> CheckpointError:
    """A CheckpointError for an I/O failure while ``doing`` (e.g. "writing step-5"); ``fix``
    for a failure that is not the file system's (say, a corrupt file torch cannot parse)."""
    e = _os_error(exc)
    if e is None:
        cut_short = "unexpected pos" in str(exc)
        return CheckpointError(f"{doing} failed" + (" (a write was cut short)" if cut_short else ""),
                               where=where, got=_one_line(exc),
                               fix="check free space and permissions where the checkpoint goes, then retry"
                               if cut_short else fix or "retry; if it persists, report it with this message")
    path = e.filename or where
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    got = f"{code}: {e.strerror} ({path})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return CheckpointError(f"{doing} failed: out of space (disk full, quota or file-size limit)", where=where,
                               got=got, fix="free space on that file system (or raise the limit) and save again; "
                               "LATEST still names the previous checkpoint")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reading = doing.startswith(("reading", "checking"))
        return CheckpointError(f"{doing} failed: {path} is not " + ("readable" if reading else "writable"),
                               where=where, got=got, fix="make it " + ("readable" if reading else "writable")
                               + " by this user, or pass another path")
    if e.errno == errno.ENOENT:
        return CheckpointError(f"{doing} failed: {path} is missing", where=where, got=got,
                               fix="restore the missing file, or load an older checkpoint")
    return CheckpointError(f"{doing} failed", where=where, got=got,
                           fix="check the file system holding the checkpoint, then retry")


def is_io_failure(exc: BaseException) -> bool:
    """Did ``exc`` (from torch's save or load) come from the file system?"""
    return _os_error(exc) is not None or "unexpected pos" in str(exc)


def extra_to_json(extra: Any) -> str:
    """``save``'s ``extra=`` as JSON text: stored as data, so reading it back runs nothing."""
    try:
        return json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise CheckpointError("save's extra= must be JSON-serialisable", where="autopar.save",
                              expected="dicts, lists, strings, numbers, booleans and None", got=str(e),
                              fix="convert it to plain data (a tensor with .tolist(), a path with str())") from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch warns that a checkpoint without a process group is a single-process one: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- manifest --------------------------------------------------------------------------------
def digest(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file. sha256 rather than crc32: a 32-bit check lets one corrupted
    file in 2**32 through, which checkpoints of many shards saved many times approach, and
    hashlib's sha256 (SHA extensions, GIL released) reads faster than most disks write."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


class HashingWriter(FileSystemWriter):
    """A FileSystemWriter that records the size and sha256 of each file this rank wrote."""

    written: dict[str, dict[str, Any]]

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        names = {r.storage_data.relative_path for r in fut.wait()}
        self.written = {n: digest(Path(self.path) / n) for n in sorted(names)}
        return fut


def signing_key(key: Any, where: str) -> bytes | None:
    """``key=`` of save/load as bytes (a str is taken as UTF-8); None for no key."""
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else key if isinstance(key, (bytes, bytearray)) else None
    if not raw:
        raise CheckpointError("a checkpoint key must be non-empty bytes or a string", where=where,
                              got=type(key).__name__ if raw is None else "empty",
                              fix="pass key=os.environ['MY_CKPT_KEY'] (the same on every rank, for save and load)")
    return bytes(raw)


def _signature(key: bytes, files: dict[str, dict[str, Any]]) -> str:
    return hmac.new(key, json.dumps(files, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def write_manifest(target: Path, files: dict[str, dict[str, Any]], key: bytes | None = None) -> None:
    """Rank 0, after every rank wrote and ``.metadata`` exists: the manifest, atomically; with
    ``key``, signed (an HMAC-SHA256 of the file list, so a tampered manifest is refused)."""
    files = dict(sorted({**files, METADATA: digest(target / METADATA)}.items()))
    record: dict[str, Any] = {"format": 1, "algorithm": "sha256", "files": files}
    if key is not None:
        record["hmac-sha256"] = _signature(key, files)
    body = json.dumps(record, indent=1)
    fd, tmp = tempfile.mkstemp(dir=target, prefix=f".{MANIFEST}.")   # unpredictable, O_EXCL: no planted link
    with os.fdopen(fd, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target / MANIFEST)


def read_manifest(target: Path, key: bytes | None = None) -> dict[str, dict[str, Any]] | None:
    """``{file: {"size", "sha256"}}`` from ``target``'s manifest; None when it has none. With
    ``key``, its signature must match."""
    where = f"autopar.load ({target / MANIFEST})"
    try:
        raw = (target / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise io_error(e, f"reading {MANIFEST}", where) from None
    try:
        files = json.loads(raw)["files"]
        ok = isinstance(files, dict) and all(
            _NAME.fullmatch(n) or n == METADATA for n in files) and all(
            isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str) for v in files.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{MANIFEST} is unreadable", where=where,
                              expected='JSON {"files": {name: {"size": int, "sha256": str}}}',
                              got=repr(raw[:60]), fix="restore the checkpoint from a copy, or load an older one")
    if key is not None:
        sig = json.loads(raw).get("hmac-sha256")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, _signature(key, files)):
            raise CheckpointError(f"{MANIFEST} in {target} is " + ("not signed" if sig is None else
                                  "signed with another key, or altered since it was signed"),
                                  where=where, expected="a manifest signed with the key given to autopar.load",
                                  got="no signature" if sig is None else "a signature that does not match",
                                  fix="load it with the key it was saved with; if that is the key you passed, the "
                                      "checkpoint was changed by someone else: do not use it")
    return files


def _check(target: Path, name: str, want: dict[str, Any], got: dict[str, Any] | None = None) -> None:
    where = f"autopar.load ({target / name})"
    if got is None:
        try:
            got = digest(target / name)
        except OSError as e:
            raise io_error(e, f"checking {name}", where) from None
    if got["size"] != want["size"]:
        raise CheckpointError(f"{name} in {target} is corrupt: {got['size']} bytes, the save wrote {want['size']}",
                              where=where, expected=f"{want['size']} bytes", got=f"{got['size']} bytes",
                              fix="restore the file from a copy, or load an older checkpoint")
    if got["sha256"] != want["sha256"]:
        raise CheckpointError(f"{name} in {target} is corrupt: its checksum differs from the one saved",
                              where=where, expected=f"sha256 {want['sha256']}", got=f"sha256 {got['sha256']}",
                              fix="restore the file from a copy, or load an older checkpoint")


def verify(target: Path, rank: int = 0, world: int = 1, key: bytes | None = None) -> dict[str, dict[str, Any]] | None:
    """Check this rank's share of ``target``'s files against its manifest; return the manifest
    (None, with a warning, for a checkpoint saved without one; with ``key`` that is an error)."""
    files = read_manifest(target, key)
    if files is None and key is not None:
        raise CheckpointError(f"{target} has no {MANIFEST}, so nothing vouches for it", where="autopar.load",
                              expected="a manifest signed with the key given", got="no manifest",
                              fix="load it without key= only if you trust where it came from")
    if files is None:
        warnings.warn(f"{target} has no {MANIFEST} (saved by an older autopar or another tool): its files "
                      "cannot be verified; re-save it to add checksums", stacklevel=3)
        return None
    for name in sorted(files)[rank::world]:
        _check(target, name, files[name])
    return files


class SafeReader(FileSystemReader):
    """A FileSystemReader whose ``.metadata`` is read once, checked against the manifest and
    unpickled by :class:`SafeUnpickler` (torch's own reader unpickles it with ``pickle.load``)."""

    def __init__(self, path: Path, manifest: dict[str, dict[str, Any]] | None) -> None:
        super().__init__(str(path))
        self._manifest, self._md = manifest, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        target = Path(self.path)
        where = f"autopar.load ({target / METADATA})"
        if self._md is None:
            try:
                data = (target / METADATA).read_bytes()
            except OSError as e:
                raise io_error(e, f"reading {METADATA}", where) from None
            if self._manifest is not None:
                _check(target, METADATA, self._manifest.get(METADATA, {"size": -1, "sha256": ""}),
                       {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            md = safe_unpickle(data, f"{target / METADATA}", where)
            if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
                raise CheckpointError(f"{target / METADATA} is not checkpoint metadata", where=where,
                                      got=type(md).__name__, fix="restore it from a copy, or load an older checkpoint")
            for info in md.storage_data.values():
                rel = getattr(info, "relative_path", None)
                if not isinstance(rel, str) or not _NAME.fullmatch(rel) or (
                        self._manifest is not None and rel not in self._manifest):
                    raise CheckpointError(f"{target / METADATA} refers to a file the save did not write",
                                          where=where, got=repr(rel), expected=f"a file listed in {MANIFEST}",
                                          fix="restore the checkpoint from a copy, or load an older one")
            self._md = md
        if getattr(self._md, "storage_meta", None) is None:
            self._md.storage_meta = StorageMeta()
        self._md.storage_meta.load_id = self.load_id
        return self._md


# -- the save lock ---------------------------------------------------------------------------
def _owner(lock: Path) -> tuple[str, dict[str, Any]]:
    """A description of who holds ``lock``, and its record."""
    try:
        info = json.loads(lock.read_text())
        host, pid = str(info["host"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown owner (the lock file is empty or unreadable)", {}
    text = f"host {host}, pid {pid}, since {info.get('time', '?')}"
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            text += f" (pid {pid} is not running on this host: the lock is stale)"
        except OSError:
            pass
    return text, info


def _stale_here(info: dict[str, Any]) -> bool:
    """Was the lock taken on this host by a process that is no longer running?"""
    if not info or str(info.get("host")) != socket.gethostname():
        return False
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


def acquire(root: Path, *, _retry: bool = True) -> str:
    """Create ``root``'s save lock (atomically); return its token. Raises when another holds it.
    A lock left on this host by a process that is gone (a save killed part-way) is broken, with
    a warning; one from another host is never broken (its owner may be alive)."""
    lock = root / LOCK
    token = uuid.uuid4().hex
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner, info = _owner(lock)
        if _retry and _stale_here(info) and _owner(lock)[1].get("token") == info.get("token"):
            warnings.warn(f"autopar.save: breaking the stale lock {lock} ({owner})", stacklevel=3)
            lock.unlink(missing_ok=True)
            return acquire(root, _retry=False)
        raise CheckpointError(f"another save to {root} is in progress", where="autopar.save",
                              got=f"{lock} held by {owner}",
                              fix=f"let that save finish, or save to another directory; if that process is gone "
                              f"(killed mid-save), delete {lock} and save again") from None
    except OSError as e:
        raise io_error(e, f"writing the checkpoint root {root}", "autopar.save") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                       "time": time.strftime("%Y-%m-%d %H:%M:%S"), "token": token}, f)
    except OSError as e:
        lock.unlink(missing_ok=True)
        raise io_error(e, f"writing the save lock {lock}", "autopar.save") from None
    return token


def release(root: Path, token: str) -> None:
    """Remove ``root``'s save lock if it is still ours."""
    lock = root / LOCK
    _, info = _owner(lock)
    if info.get("token") == token:
        lock.unlink(missing_ok=True)
    else:
        warnings.warn(f"{lock} was removed or replaced while this save held it; left as it is", stacklevel=3)


@contextlib.contextmanager
def save_lock(root: Path, distributed: bool, check: Callable[[], None]) -> Iterator[None]:
    """Hold ``root``'s save lock (rank 0 takes it) and run ``check`` under it; every rank
    raises together if either fails."""
    token = None

    def take() -> None:
        nonlocal token
        token = acquire(root)
        check()

    try:
        collectively(take, distributed, rank0_only=True)
        yield
    finally:
        if token is not None:
            release(root, token)


# -- LATEST ----------------------------------------------------------------------------------
def read_latest(root: Path, where: str) -> str | None:
    """The directory name ``root/LATEST`` holds; None when there is no LATEST."""
    marker = root / LATEST
    fix = f"delete {marker}, or write into it the name of a complete step-* directory under {root}"
    try:
        raw = marker.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise CheckpointError(f"{marker} is a directory", where=where, expected="a file naming a checkpoint directory",
                              got="a directory", fix=fix) from None
    except OSError as e:
        raise io_error(e, f"reading {marker}", where) from None
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _NAME.fullmatch(name):
        raise CheckpointError(f"{marker} is garbage", where=where, expected="one line naming a checkpoint directory",
                              got=repr(raw[:40]), fix=fix)
    return name


def _step(name: str | None) -> int | None:
    m = re.fullmatch(r"step-(\d+)", name or "")
    return int(m.group(1)) if m else None


def switch_latest(root: Path, target: Path) -> None:
    """Point ``LATEST`` at ``target`` atomically, unless it names a higher step (LATEST only
    moves forward: the older step's directory stays, loadable by its path, with a warning)."""
    current = _step(read_latest(root, "autopar.save"))
    new = _step(target.name)
    if current is not None and new is not None and new < current:
        warnings.warn(f"saved {target}, but {root / LATEST} stays at step {current}: LATEST only moves forward "
                      f"(load this one by passing its directory)", stacklevel=3)
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{LATEST}.")
        with os.fdopen(fd, "w") as f:
            f.write(target.name + "\n")
        os.replace(tmp, root / LATEST)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise io_error(e, f"pointing {root / LATEST} at {target.name}", "autopar.save") from None


def latest(path: str | os.PathLike) -> Path:
    """The newest complete checkpoint under ``path`` (or ``path`` itself, a checkpoint directory)."""
    root = Path(path)
    name = read_latest(root, "autopar.load")
    if name is None:
        if (root / METADATA).exists():     # a checkpoint directory itself
            return root
        raise CheckpointError(f"no checkpoint at {root}", where="autopar.load",
                              expected=f"{root}/{LATEST} naming a complete checkpoint",
                              got="nothing" if not root.is_dir() else f"{sorted(p.name for p in root.iterdir())[:5]}",
                              fix="pass the directory autopar.save wrote to")
    if not (root / name / METADATA).exists():
        raise CheckpointError(f"{root / LATEST} names {name}, which is incomplete", where="autopar.load",
                              fix="restore the directory or point LATEST at an older step-* directory")
    return root / name


# -- writing and reading through torch.distributed.checkpoint ---------------------------------
def prepare(root: Path, target: Path) -> None:
    """Under the save lock, before anything is written: refuse to overwrite the current
    checkpoint, and unmark a stale directory of the same name (so a save that dies part-way
    leaves it incomplete, not a mix of old and new files that looks whole)."""
    if read_latest(root, "autopar.save") == target.name and (target / METADATA).exists():
        raise CheckpointError(f"{target} is the current checkpoint; saving over it would risk losing it",
                              where="autopar.save", fix="pass a new step=, or no step= for a time-stamped name")
    refuse_links(target)
    try:
        for stale in (MANIFEST, METADATA):
            (target / stale).unlink(missing_ok=True)
    except OSError as e:
        raise io_error(e, f"writing {target}", "autopar.save") from None


def refuse_links(target: Path) -> None:
    """A step directory that is a symbolic link, or holds one, would send the shards (torch
    opens them by name, following links) to files outside the checkpoint: refused."""
    links = [target] if target.is_symlink() else []
    if not links and target.is_dir():
        links = [p for p in target.iterdir() if p.is_symlink()]
    if links:
        raise CheckpointError(f"{links[0]} is a symbolic link: a save writes only into real files under the "
                              "checkpoint directory", where="autopar.save",
                              got=f"{links[0]} -> {os.readlink(links[0])}",
                              fix=f"remove {links[0]} (and any other link in {target}), or save under another step")


def remove_partial(root: Path, target: Path) -> None:
    """A save that failed part-way (a full disk): its directory goes, unless LATEST names it,
    so that it neither holds the space nor stands in the way of the next save."""
    if target.is_symlink() or read_latest(root, "autopar.save") == target.name:
        return
    shutil.rmtree(target, ignore_errors=True)


def write(root: Path, target: Path, tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor], items: list,
          objects: dict[str, Any], distributed: bool, key: bytes | None = None) -> None:
    """Write ``items`` (pieces of ``tensors``) and ``objects`` into ``target`` (every rank its
    own), then, on rank 0, the manifest and ``LATEST``. Raises on every rank together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from autopar.core.errors import AutoparInternalError
    blobs = collectively(lambda: {k: dump_object(v, k) for k, v in objects.items()}, distributed) or {}
    items = items + [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in blobs]

    class Planner(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(list(items))
            return self.plan

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(blobs[write_item.index.fqn])
            view = tensors[(write_item.index.fqn, tuple(write_item.index.offset))]
            return view.contiguous().clone() if view.numel() != view.untyped_storage().nbytes() // max(
                view.element_size(), 1) else view.contiguous()

    writer = HashingWriter(str(target))
    try:
        with quiet():
            dcp.save({}, storage_writer=writer, no_dist=not distributed,
                     planner=Planner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except ValueError as e:
        raise AutoparInternalError(f"checkpoint pieces do not tile the whole tensors: {e}") from e
    except (Exception, DcpError) as e:
        if is_io_failure(e):        # torch's save fails on every rank together
            raise io_error(e, f"writing {target}", "autopar.save") from None
        raise
    files = [getattr(writer, "written", {})]
    if distributed:
        files = [{}] * dist.get_world_size()
        dist.all_gather_object(files, getattr(writer, "written", {}))
    collectively(lambda: _commit(root, target, {k: v for f in files for k, v in f.items()}, key), distributed,
                 rank0_only=True)


def _commit(root: Path, target: Path, files: dict[str, dict[str, Any]], key: bytes | None = None) -> None:
    """Rank 0, once every rank has written: the manifest, then ``LATEST``."""
    try:
        write_manifest(target, files, key)
    except OSError as e:
        raise io_error(e, f"writing {target / MANIFEST}", "autopar.save") from None
    switch_latest(root, target)


def read(reader: SafeReader, target: Path, md: dict[str, Any], dests: dict[tuple[str, tuple[int, ...]], list],
         objects: list[str], distributed: bool) -> dict[str, Any]:
    """Read into ``dests`` (views of this rank's tensors, per stored piece) and return the
    stored ``objects``, unpickled weights-only. Raises on every rank together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    raw: dict[str, bytes] = {}

    def narrow(t: torch.Tensor, read_item: ReadItem) -> torch.Tensor:
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    class Planner(LoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            reads: list[ReadItem] = []
            for (key, offsets), views in dests.items():
                chunk = ChunkStorageMetadata(torch.Size(offsets), views[0].shape)
                reads += create_read_items_for_chunk_list(key, md[key], [chunk])
            for key in objects:
                reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                      dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                      storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            return LoadPlan(reads)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value) -> None:
            raw[read_item.dest_index.fqn] = value.read()     # unpickled below, restricted

        def resolve_tensor(self, read_item):
            return narrow(dests[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))][0], read_item)

        def commit_tensor(self, read_item, tensor) -> None:
            for other in dests[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))][1:]:
                narrow(other, read_item).copy_(tensor)

    try:
        with quiet():
            dcp.load({}, storage_reader=reader, planner=Planner(), no_dist=not distributed)
    except (Exception, DcpError) as e:      # torch's load fails on every rank together
        if is_io_failure(e) or isinstance(e, DcpError):
            raise io_error(e, f"reading {target}", "autopar.load", fix="a file in it is corrupt: restore the "
                           "checkpoint from a copy, or load an older one") from None
        raise
    where = f"autopar.load ({target})"
    return collectively(lambda: {k: load_object(b, k, where) for k, b in raw.items()}, distributed) or {}
