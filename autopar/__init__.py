"""autopar: automatic parallelization of PyTorch training.

An unmodified ``nn.Module`` is captured into an ATen-level ``torch.fx`` graph, analysed
(shapes, FLOPs, memory, repeated blocks, MoE regions), planned by a cost model, rewritten
with collectives and run on ``torch.distributed``.

Importing ``autopar`` imports torch and the errors; the engine (capture, passes, planner,
runtime) is imported on first use of a name that needs it (``autopar.parallelize`` ...), so the
command line and ``import autopar`` start about as fast as ``import torch``.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any

# torch warns at import when NumPy is absent; autopar never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

# Functional collectives must be imported before any graph holding them is built,
# or their backward is silently wrong (see DESIGN.md, rule 3).
import torch.distributed._functional_collectives  # noqa: F401,E402

from autopar.core.errors import (AutoparError, AutoparInternalError, CaptureError, CheckpointError,  # noqa: E402
                                 ConfigError, DoesNotFitError, InputMismatchError, MeshError, OptimizerError,
                                 PeerFailureError, PlanFileError, ShardingError, UnsupportedError)
from autopar.core.layer_kinds import register_layer_kinds as _register_layer_kinds  # noqa: E402

_register_layer_kinds("autopar.models.depth:model_layer_kinds")   # the zoo's and transformers' layer kinds

__version__ = "0.1.0"

#: public name -> the module that defines it (imported when the name is first used)
_LAZY = {
    "capture": "autopar.passes.capture", "analyze": "autopar.passes.pipeline", "Plan": "autopar.core.plans",
    "DataMode": "autopar.core.dp_mode", "DataOptions": "autopar.core.options",
    "ExpertOptions": "autopar.core.options", "PipelineOptions": "autopar.core.options",
    "ContextOptions": "autopar.core.options",
    "TensorOptions": "autopar.core.options", "optimizer": "autopar.api", "parallelize": "autopar.api",
    "plan": "autopar.api", "load": "autopar.checkpoint", "save": "autopar.checkpoint",
    "full_state_dict": "autopar.checkpoint.full", "save_pretrained": "autopar.checkpoint.pretrained",
    "init_distributed": "autopar.runtime.health", "clip_grad_norm_": "autopar.clip",
    "ScaledPlan": "autopar.scaled_plan", "scale_plan": "autopar.scaled_plan", "Trainer": "autopar.trainer",
}
_SUBMODULES = {"checkpoint", "data", "models", "cli", "passes", "cost", "runtime", "build", "core", "summary"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_"):
        try:                                   # a subpackage or module: autopar.runtime, autopar.api ...
            value = importlib.import_module(f"autopar.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"autopar.{name}":
                raise
            raise AttributeError(f"module 'autopar' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = ["AutoparError", "AutoparInternalError", "CaptureError", "CheckpointError", "ConfigError",
           "DoesNotFitError", "InputMismatchError", "MeshError", "OptimizerError", "PeerFailureError",
           "PlanFileError", "ShardingError", "UnsupportedError",
           "ContextOptions", "DataMode", "DataOptions", "ExpertOptions", "PipelineOptions", "Plan", "TensorOptions", "ScaledPlan",
           "analyze", "capture", "checkpoint", "clip_grad_norm_", "data", "full_state_dict", "init_distributed",
           "load", "optimizer", "parallelize", "plan", "save", "save_pretrained", "scale_plan", "Trainer",
           "__version__"]
