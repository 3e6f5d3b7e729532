"""Checkpoints of models trained under a data-axis mode other than all-reduce.

Under ``local_sgd`` and ``gossip`` the data-axis ranks hold different parameters and optimizer
state between averages, and every mode keeps state of its own: the error-feedback residuals
(``compressed``), the averaged gradients not applied yet (``async``), the step and draw counts.
A checkpoint keeps all of it, so training resumes exactly where it stopped:

- every model and optimizer tensor is stored with a leading *replica* dimension of the data
  axis's size, rank ``r`` of the axis writing index ``r`` (``model/up.weight`` of shape
  ``(dp, *shape)``); a checkpoint saved under all-reduce loads into every replica alike;
- the mode's own state goes under ``dp_mode/rank<R>/`` per global rank (``R``): residuals and
  queued gradients as tensors, the counters as an object.

Loading needs the same mode's state layout: the same data-axis size for the replicas, and the
same ranks for the mode's own state (a :class:`~autopar.core.errors.CheckpointError` says so).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.core.errors import CheckpointError


def mode_state(model: Any) -> Any:
    """The :class:`~autopar.runtime.data_modes.ModeState` of ``model``'s data axis, or None."""
    from autopar.runtime.optim import data_runtimes
    for rt in data_runtimes(model):
        if rt is not None and rt.modes is not None:
            return rt.modes
    return None


def replica(state: Any, lay: Any, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``(layout, tensor)`` with the replica dimension in front (``state``: the mode, or None)."""
    if state is None:
        return lay, t
    from autopar.checkpoint.layout import Layout
    if lay.flat is not None:
        raise CheckpointError("a sharded piece under a data-axis mode", where="autopar.save",
                              fix="data-axis modes run with zero_stage=0")
    segments = [((0, *lo), (1, *size), (state.rank, *whole)) for lo, size, whole in lay.segments]
    return Layout((state.n, *lay.shape), (1, *lay.local_shape), segments), t.unsqueeze(0)


def _prefix() -> str:
    return f"dp_mode/rank{dist.get_rank() if dist.is_initialized() else 0}"


def save_items(state: Any, add: Callable[[str, Any, torch.Tensor], None], objects: dict[str, Any]) -> None:
    """Add the mode's own state to what this rank writes (async gradients still travelling
    are waited for first: that changes when, not what, they are applied)."""
    if state is None:
        return
    from autopar.checkpoint.layout import whole
    prefix = _prefix()
    state.queued = [(step, b, ("done", state.finish(h))) for step, b, h in state.queued]
    for b, t in state.memory.items():
        add(f"{prefix}/memory/{b}", whole(tuple(t.shape)), t)
    for i, (_, _, h) in enumerate(state.queued):
        add(f"{prefix}/queued/{i}", whole(tuple(h[1].shape)), h[1])
    objects[prefix] = {"mode": state.mode.to_dict(), "steps": state.steps,
                       "issued": {str(b): c for b, c in state.issued.items()},
                       "memory": sorted(state.memory), "queued": [[s, b] for s, b, _ in state.queued]}

def load_plan(state: Any, md: dict, want: Callable[[str, Any, torch.Tensor], None],
              objects_wanted: list[str], problems: list[str]) -> Callable[[dict], None]:
    """Ask for the mode's own state; return what restores it once the objects are read."""
    if state is None:
        return lambda objects: None
    prefix = _prefix()
    if prefix not in md:
        problems.append(f"{prefix} is missing (the checkpoint was not saved under dp_mode "
                        f"{state.mode.kind!r} on these ranks)")
        return lambda objects: None
    objects_wanted.append(prefix)
    tensors: dict[str, torch.Tensor] = {}
    for key, saved in md.items():
        if key.startswith(prefix + "/"):
            name = key[len(prefix) + 1:]
            tensors[name] = torch.zeros(tuple(saved.size), dtype=saved.properties.dtype, device=state.device)
            from autopar.checkpoint.layout import whole
            want(key, whole(tuple(saved.size)), tensors[name])

    def restore(objects: dict) -> None:
        meta = objects[prefix]
        if meta.get("mode") != state.mode.to_dict():
            raise CheckpointError("the checkpoint was saved under another data-axis mode", where="autopar.load",
                                  expected=str(state.mode.to_dict()), got=str(meta.get("mode")),
                                  fix="parallelize with the dp_mode the checkpoint was saved under")
        state.steps = int(meta["steps"])
        state.issued = {int(b): int(c) for b, c in meta["issued"].items()}
        state.memory = {int(b): tensors[f"memory/{b}"] for b in meta["memory"]}
        state.queued = [(int(s), int(b), ("done", tensors[f"queued/{i}"])) for i, (s, b) in enumerate(meta["queued"])]
    return restore
