"""Errors autopar raises.

A user's mistake raises an :class:`AutoparError` subclass whose message says what went
wrong, where (module path, node, source line), what was expected, and how to fix it.
A broken internal invariant raises :class:`AutoparInternalError`, which says it is a bug.
"""
from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error caused by the user's input."""

    def __init__(self, what: str, *, where: str | None = None, expected: str | None = None,
                 got: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.expected, self.got, self.fix = what, where, expected, got, fix
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [self.what]
        if self.where:
            lines.append(f"  where: {self.where}")
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.got:
            lines.append(f"  got: {self.got}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)


class CaptureError(AutoparError):
    """The model could not be captured into a graph."""


class InputMismatchError(AutoparError):
    """The example inputs do not match what the model's forward accepts."""


class ConfigError(AutoparError):
    """A configuration value (model config, hardware profile, CLI flag) is invalid."""


class ShardingError(ConfigError):
    """A dimension is not divisible by the mesh axis a forced placement shards it over."""


class DoesNotFitError(ConfigError):
    """The model does not fit the devices; ``smallest_devices`` says how many would do."""

    def __init__(self, what: str, *, smallest_devices: int | None = None, **kw) -> None:
        self.smallest_devices = smallest_devices
        super().__init__(what, **kw)


class PlanFileError(ConfigError):
    """A plan file is unreadable, from an incompatible version, or for another model."""


class MeshError(ConfigError):
    """A mesh, the world size and the plan disagree."""


class UnsupportedError(ConfigError):
    """A dtype, device or feature autopar does not support."""


class OptimizerError(ConfigError):
    """An optimizer was given parameters the plan does not know, or an unsupported class."""


class CheckpointError(AutoparError):
    """A checkpoint cannot be written or read (missing, partial, or for another model)."""


class PeerFailureError(AutoparError):
    """Another rank failed (raised, died or stalled); ``rank`` and ``step`` say which and when."""

    def __init__(self, what: str, *, rank: int | None = None, step: int | None = None, **kw) -> None:
        self.rank, self.step = rank, step
        super().__init__(what, **kw)


class AutoparInternalError(RuntimeError):
    """An invariant inside autopar failed: this is a bug in autopar, not in the user's model."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}\n  (this is a bug in autopar; please report it with the command you ran)")
