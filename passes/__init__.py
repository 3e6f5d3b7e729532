"""autopar.passes."""

from autopar.core.lazy import submodules as _submodules  # noqa: E402

__getattr__ = _submodules(__name__)     # the other modules, imported on first use
