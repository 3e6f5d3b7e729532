"""Restricted unpickling for checkpoints: nothing a checkpoint holds runs code when it is read.

``.metadata`` goes through :class:`SafeUnpickler` (an explicit allow-list of globals, no
attributes set on classes); stored objects through ``torch.load(..., weights_only=True)``
(:func:`load_object`), and a save refuses what a load would refuse (:func:`dump_object`).
:mod:`autopar.checkpoint.integrity` uses both.
"""
from __future__ import annotations

import io
import pickle
import re
import struct
from typing import Any

import torch

from autopar.core.errors import CheckpointError


def _one_line(exc: BaseException) -> str:
    for f in getattr(exc, "failures", {}).values():      # torch's CheckpointException: the first rank's cause
        return _one_line(f[0] if isinstance(f, tuple) else f)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


# -- the unpickler -------------------------------------------------------------------
class _Refused(Exception):
    pass


def _allowed() -> dict[tuple[str, str], Any]:
    """Every global a ``.metadata`` written by torch.distributed.checkpoint refers to (found by
    recording ``find_class`` on real files), plus plain containers. Each is data: building it
    runs no code but a dataclass ``__init__``, an Enum lookup or a container constructor."""
    import builtins
    import collections
    import pathlib
    from torch.distributed.checkpoint import filesystem, metadata
    out: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"):
        out[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    out[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    out[("torch", "Size")] = torch.Size
    out[("torch", "device")] = torch.device
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout   # returns a torch.layout
    out.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        out[("pathlib", name)] = getattr(pathlib, name)         # StorageMeta.checkpoint_id
    out[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("dict", "list", "tuple", "set", "frozenset", "bytes", "bytearray", "str", "int", "float",
                 "complex", "bool"):
        out[("builtins", name)] = getattr(builtins, name)
    return out


class SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """An unpickler that builds only allow-listed globals.

    The pure-Python unpickler, so that ``BUILD`` on a class (which would set attributes on,
    say, ``Metadata`` itself for the rest of the process) can be refused as well."""

    _ALLOWED: dict[tuple[str, str], Any] | None = None
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if SafeUnpickler._ALLOWED is None:
            SafeUnpickler._ALLOWED = _allowed()
        try:
            return SafeUnpickler._ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise _Refused(f"setting attributes of the class {self.stack[-2].__qualname__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build

    limit = 0                       # the pickle's own size (safe_unpickle sets it)

    def _load_bytearray8(self) -> None:
        # the pure-Python unpickler allocates the declared length before reading it: bounded
        # here by what the file holds, so 32 bytes cannot ask for gigabytes
        size, = struct.unpack("<Q", self.read(8))
        if size > self.limit:
            raise _Refused(f"a {size}-byte array in a {self.limit}-byte file")
        b = bytearray(size)
        self.readinto(b)
        self.append(b)

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id (external storage)")


def safe_unpickle(data: bytes, what: str, where: str) -> Any:
    """``pickle.loads`` through :class:`SafeUnpickler`; anything else is a CheckpointError."""
    try:
        unpickler = SafeUnpickler(io.BytesIO(data))
        unpickler.limit = len(data)
        return unpickler.load()
    except _Refused as e:
        raise CheckpointError(f"{what} asks to build {e}, which a checkpoint never holds; nothing was run",
                              where=where, expected="torch.distributed.checkpoint metadata (plain data)",
                              got=str(e), fix="do not load checkpoints from untrusted sources; "
                              "re-save from a trusted copy") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbage pickle fails in many ways
        raise CheckpointError(f"{what} is unreadable (truncated or not a checkpoint file)", where=where,
                              got=_one_line(e), fix="restore it from a copy, or load an older checkpoint") from None


def dump_object(obj: Any, key: str) -> bytes:
    """``torch.save`` of a stored object, checked to load back under ``weights_only=True``
    (so a save never writes what a load would refuse)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        load_object(data, key, "autopar.save")
    except CheckpointError as e:
        raise CheckpointError(f"{key} holds a value a checkpoint cannot store safely", where="autopar.save",
                              expected="tensors, numbers, strings, None and lists/tuples/dicts of them",
                              got=e.got, fix="keep optimizer state and parameter-group options plain data") from None
    return data


def load_object(data: bytes, key: str, where: str) -> Any:
    """A stored object read with torch's weights-only unpickler: no code runs."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"global[: ]+'?([\w.]+)", str(e))
        name = found.group(1) if found else _one_line(e)
        raise CheckpointError(f"{key} asks to build {name}, which a checkpoint never holds; nothing was run",
                              where=where, expected="tensors and plain data", got=name,
                              fix="do not load checkpoints from untrusted sources; re-save from a trusted copy"
                              ) from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{key} is unreadable", where=where, got=_one_line(e),
                              fix="restore the checkpoint from a copy, or load an older one") from None
