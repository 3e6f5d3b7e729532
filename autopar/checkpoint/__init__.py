"""Checkpoints that survive re-planning (:mod:`autopar.checkpoint.state`): :func:`save`,
:func:`load` and :func:`latest`.

- ``state.py``: what is written and read, keyed by the original model's names;
- ``layout.py``: each rank's tensors as boxes of the whole tensors;
- ``modes.py``: the data-axis modes' own state;
- ``integrity.py``: manifests, checksums, the save lock and ``LATEST``;
- ``safe_pickle.py``: the only unpickler, which builds plain data and nothing else.
"""
from autopar.checkpoint.integrity import latest
from autopar.checkpoint.state import load, save

__all__ = ["save", "load", "latest"]

from autopar.core.lazy import submodules as _submodules  # noqa: E402

__getattr__ = _submodules(__name__)     # the other modules, imported on first use
