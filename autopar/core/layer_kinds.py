"""Who knows a model's layer kinds: the readers the capture asks (see
:func:`autopar.passes.replicate.periodic_run`).

Each reader returns ``(one hashable kind per layer, whether the model is a transformers one)``
or None when it does not know the model. The passes know no model family themselves; the model
zoo's reader is registered by name when ``autopar`` is imported (``autopar/__init__.py``) and
imported only when a capture first asks, so ``import autopar`` stays cheap.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Reader = Callable[[Any], "tuple[list[Any], bool] | None"]
_READERS: list["Reader | str"] = []


def register_layer_kinds(reader: "Reader | str") -> "Reader | str":
    """Add ``reader`` (a function, or ``"module:function"`` imported at first use) once."""
    if reader not in _READERS:
        _READERS.append(reader)
    return reader


def layer_kind_readers() -> list[Reader]:
    """The registered readers, in order, those named by a string imported now."""
    for i, reader in enumerate(_READERS):
        if isinstance(reader, str):
            module, _, name = reader.partition(":")
            _READERS[i] = getattr(importlib.import_module(module), name)
    return list(_READERS)


__all__ = ["Reader", "layer_kind_readers", "register_layer_kinds"]
