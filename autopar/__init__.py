"""autopar: automatic parallelization of PyTorch training.

An unmodified ``nn.Module`` is captured into an ATen-level ``torch.fx`` graph, analysed
(shapes, FLOPs, memory, repeated blocks, MoE regions), planned by a cost model, rewritten
with collectives and run on ``torch.distributed``.
"""
from __future__ import annotations

import warnings

# torch warns at import when NumPy is absent; autopar never needs NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

# Functional collectives must be imported before any graph holding them is built,
# or their backward is silently wrong (see DESIGN.md, rule 3).
import torch.distributed._functional_collectives  # noqa: F401

from autopar.core.errors import (AutoparError, AutoparInternalError, CaptureError, CheckpointError, ConfigError,
                            DoesNotFitError, InputMismatchError, MeshError, OptimizerError, PeerFailureError,
                            PlanFileError, ShardingError, UnsupportedError)
from autopar.passes.capture import capture
from autopar.passes.pipeline import analyze
from autopar.core.plans import Plan
from autopar.core.dp_mode import DataMode
from autopar.core.options import DataOptions, ExpertOptions, PipelineOptions, TensorOptions
from autopar.api import optimizer, parallelize, plan
from autopar import checkpoint, data
from autopar.checkpoint import load, save
from autopar.checkpoint.full import full_state_dict
from autopar.checkpoint.pretrained import save_pretrained
from autopar.runtime.health import init_distributed
from autopar.clip import clip_grad_norm_
from autopar.scaled_plan import ScaledPlan, scale_plan
from autopar.models.depth import model_layer_kinds
from autopar.passes.replicate import register_layer_kinds

register_layer_kinds(model_layer_kinds)      # the capture learns the zoo's and transformers' layer kinds
del model_layer_kinds, register_layer_kinds

__version__ = "0.1.0"

__all__ = ["AutoparError", "AutoparInternalError", "CaptureError", "CheckpointError", "ConfigError",
           "DoesNotFitError", "InputMismatchError", "MeshError", "OptimizerError", "PeerFailureError",
           "PlanFileError", "ShardingError", "UnsupportedError",
           "DataMode", "DataOptions", "ExpertOptions", "PipelineOptions", "Plan", "TensorOptions", "ScaledPlan", "analyze", "capture", "checkpoint", "clip_grad_norm_", "data", "full_state_dict", "init_distributed", "load", "optimizer", "parallelize", "plan", "save", "save_pretrained", "scale_plan",
           "__version__"]
