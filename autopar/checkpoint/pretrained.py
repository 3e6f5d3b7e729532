"""Hugging Face directories in and out: :func:`save_pretrained` and the weights-only read
:func:`autopar.load` does when handed such a directory.

``save_pretrained(pm, directory)`` writes what ``AutoModel*.from_pretrained(directory)`` reads:
``config.json`` (and ``generation_config.json`` when the model has one) from the original model,
and its weights as safetensors, whatever mesh ``pm`` runs on: every rank calls it, the whole
state dict is gathered to rank 0 (:func:`autopar.full_state_dict`) and rank 0 writes. A tied
second name (``lm_head.weight`` beside ``embed_tokens.weight``) is left out, as ``transformers``
leaves it out: ``from_pretrained`` ties it again. Past ``max_shard_size`` bytes the weights are
split into ``model-0000k-of-0000n.safetensors`` files with a ``model.safetensors.index.json``.

Reading a directory is weights only: each rank reads, through safetensors' own slicing (no code
runs, nothing is unpickled), just the boxes of each tensor its plan holds. ``pytorch_model.bin``
files are pickles and are refused.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.checkpoint import integrity
from autopar.checkpoint.layout import model_entries
from autopar.core.errors import CheckpointError, ConfigError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")     # a plain file name, no path


def _safetensors() -> Any:
    try:
        import safetensors.torch
        return safetensors
    except ImportError:
        raise ConfigError("Hugging Face directories need the safetensors package", where="autopar.save_pretrained",
                          fix="pip install 'autopar[hf]' (or pip install safetensors)") from None


def is_pretrained_dir(path: str | os.PathLike) -> bool:
    """A directory ``transformers`` wrote: a config and weights, and no autopar checkpoint."""
    root = Path(path)
    return root.is_dir() and (root / CONFIG).is_file() and not (root / integrity.LATEST).exists() and not (
        root / integrity.METADATA).exists() and any((root / n).exists() for n in (
            WEIGHTS, INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json"))


def _size_bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(size).strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            try:
                return int(float(text[:-len(unit)]) * scale)
            except ValueError:
                break
    raise ConfigError(f"max_shard_size {size!r} is not a size", where="autopar.save_pretrained",
                      expected="bytes as an int, or a string like '5GB' or '500MB'", got=repr(size),
                      fix="pass max_shard_size='5GB'")


def save_pretrained(module: Any, directory: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> Path:
    """Write a ``transformers`` directory of a model from :func:`autopar.parallelize` (every
    rank calls it; rank 0 writes). Returns the directory."""
    from autopar.checkpoint.full import full_state_dict
    source = getattr(module, "pretrained_source", None)
    if getattr(module, "global_shapes", None) is None or source is None:
        raise CheckpointError("save_pretrained takes the model autopar.parallelize returned for a transformers "
                              "model (one with .config and .save_pretrained)", where="autopar.save_pretrained",
                              got=type(module).__name__ if getattr(module, "global_shapes", None) is None
                              else "a model without a transformers config",
                              fix="for any other model use autopar.full_state_dict(pm) and torch.save / "
                                  "safetensors on rank 0, or autopar.save for a sharded checkpoint")
    limit = _size_bytes(max_shard_size)
    st = _safetensors()
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    target = Path(directory)
    full = full_state_dict(module)

    def write() -> None:
        tied = {a for a, n in getattr(module, "param_aliases", {}).items() if a != n}
        tensors = {k: v.contiguous() for k, v in full.items() if k not in tied}
        try:
            target.mkdir(parents=True, exist_ok=True)
            integrity.refuse_links(target)
            config, generation = source
            config.save_pretrained(str(target))
            if generation is not None:
                generation.save_pretrained(str(target))
            shards: list[dict[str, torch.Tensor]] = [{}]
            used = 0
            for k, v in tensors.items():
                n = v.numel() * v.element_size()
                if shards[-1] and used + n > limit:
                    shards.append({})
                    used = 0
                shards[-1][k] = v
                used += n
            for stale in [p for p in target.glob("model*.safetensors*")]:
                stale.unlink()
            if len(shards) == 1:
                st.torch.save_file(shards[0], str(target / WEIGHTS), metadata={"format": "pt"})
            else:
                weight_map = {}
                for i, shard in enumerate(shards, 1):
                    name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    st.torch.save_file(shard, str(target / name), metadata={"format": "pt"})
                    weight_map.update({k: name for k in shard})
                total = sum(v.numel() * v.element_size() for v in tensors.values())
                (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": weight_map}, indent=2) + "\n")
        except OSError as e:
            raise integrity.io_error(e, f"writing {target}", "autopar.save_pretrained") from None

    integrity.collectively(write, distributed, rank0_only=True)
    return target


def _weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    where = f"autopar.load ({root})"
    if not (root / WEIGHTS).exists() and not (root / INDEX).exists():
        raise CheckpointError(f"{root} holds pytorch_model.bin pickles, which autopar does not read (loading a "
                              "pickle can run code)", where=where, expected=f"{WEIGHTS} or {INDEX}",
                              got="pytorch_model.bin", fix="convert it once, where you trust it: "
                              "Model.from_pretrained(dir).save_pretrained(dir2) writes safetensors")
    if (root / WEIGHTS).exists():
        files = [root / WEIGHTS]
    else:
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            ok = all(isinstance(n, str) and _FILE.fullmatch(n) for n in names)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise CheckpointError(f"{root / INDEX} is unreadable", where=where,
                                  expected='JSON {"weight_map": {tensor: plain file name}}',
                                  fix="restore the directory from its source")
        files = [root / n for n in names]
    st = _safetensors()
    out: dict[str, Path] = {}
    for f in files:
        try:
            with st.safe_open(str(f), framework="pt") as handle:
                out.update({k: f for k in handle.keys()})
        except (OSError, st.SafetensorError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file", where=where, got=str(e)[:200],
                                  fix="restore the file from its source") from None
    return out


def load_pretrained(model: nn.Module, optimizer: Any, root: Path) -> dict:
    """Read a ``transformers`` directory's weights into ``model`` (every rank calls it, each
    reading only the boxes its plan holds). The optimizer's state is left as it is; under mixed
    precision its fp32 masters take the weights."""
    from autopar.checkpoint.state import is_buffer, master_entries, masters_to_params
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    files = integrity.collectively(lambda: _weight_files(root), distributed)
    st = _safetensors()
    entries = master_entries(model, optimizer, model_entries(model))
    problems: list[str] = []
    reads: dict[Path, list] = {}
    names_here = {key for key, _, _ in entries}
    for key, lay, t in entries:
        if key not in files:
            if not is_buffer(model, key):
                problems.append(f"{key} is missing")
            continue
        reads.setdefault(files[key], []).append((key, lay, t))
    with torch.no_grad():
        for f, items in reads.items():
            with st.safe_open(str(f), framework="pt") as handle:
                for key, lay, t in items:
                    part = handle.get_slice(key)
                    shape = tuple(part.get_shape())
                    if shape != tuple(lay.shape):
                        problems.append(f"{key} is {list(shape)} there, {list(lay.shape)} here")
                        continue
                    for offsets, sizes, view in lay.pieces(t.data):
                        view.copy_(part[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
    if problems:
        problems = [f"{root}: " + "; ".join(problems[:8]) + (f" (and {len(problems) - 8} more)" if len(problems) > 8
                                                             else "")]
    err = None if not problems else CheckpointError(
        "the directory's weights do not fit this model", where="autopar.load", got=problems[0],
        fix="load the directory with the model class and config it was saved from")
    integrity.agree(err, distributed)
    extra = sorted(set(files) - names_here - set(getattr(model, "param_aliases", {})))
    if extra and (not distributed or dist.get_rank() == 0):
        warnings.warn(f"{root}: {len(extra)} tensors the model does not have were not read "
                      f"({', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''})", stacklevel=3)
    masters_to_params(optimizer)
    return {"step": None, "extra": None, "path": root}


__all__ = ["save_pretrained", "is_pretrained_dir", "load_pretrained"]
