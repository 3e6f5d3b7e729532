"""The one mesh reader and the one axis order.

A user's mesh is an int (one tensor axis), a ``{axis: size}`` mapping, or a torch
``DeviceMesh``. :func:`read` turns any of them into ``((axis, size), ...)``; every place that
looks at a mesh reads it here. Axes are listed outermost first in :data:`AXIS_ORDER` — ``pp``,
``dp``, ``cp``, ``ep``, ``tp`` — so tensor-parallel ranks are neighbours (the fastest links)
and pipeline stages the farthest apart; each kind of mesh below accepts a subset, in that order.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopar.core.errors import MeshError

#: Every mesh axis autopar knows, outermost first.
AXIS_ORDER: tuple[str, ...] = ("pp", "dp", "cp", "ep", "tp")

Axes = tuple[tuple[str, int], ...]


def read(mesh: Any, example: str = "e.g. {'dp': 2, 'tp': 2}") -> Axes:
    """``((axis, size), ...)`` of an int (one ``tp`` axis), a mapping or a DeviceMesh (an unnamed
    one-axis mesh is ``tp``; an unnamed larger one has axes ``axis0``, ``axis1``, ...)."""
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return (("tp", mesh),)
    if isinstance(mesh, Mapping):
        return tuple((str(k), int(v)) for k, v in mesh.items())
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "size"):
        names = mesh.mesh_dim_names or (("tp",) if mesh.ndim == 1 else tuple(f"axis{i}" for i in range(mesh.ndim)))
        return tuple((names[i], mesh.size(i)) for i in range(mesh.ndim))
    raise MeshError("mesh must be a DeviceMesh, an int or a {axis: size} mapping", where="mesh",
                    got=type(mesh).__name__, fix=f"pass {example}")


def names(mesh: Any) -> tuple[str, ...]:
    """The axis names of ``mesh``, outermost first (:func:`read`)."""
    return tuple(a for a, _ in read(mesh))


def has_axis(mesh: Any, axis: str) -> bool:
    """Does ``mesh`` name ``axis``? (False for a mesh autopar cannot read.)"""
    try:
        return axis in names(mesh)
    except MeshError:
        return False


def in_order(axes: Axes, allowed: tuple[str, ...]) -> bool:
    """Are ``axes`` distinct, each in ``allowed``, listed in :data:`AXIS_ORDER`, each of size >= 1?"""
    got = [a for a, _ in axes]
    return (len(set(got)) == len(got) and all(a in allowed for a in got)
            and got == [a for a in AXIS_ORDER if a in got] and all(n >= 1 for _, n in axes))


def dense_axes(mesh: Any) -> Axes:
    """The axes of a mesh with no pipeline and no experts: ``dp``, ``cp`` and/or ``tp`` (in that order)."""
    axes = read(mesh, "e.g. {'dp': 2, 'tp': 2}, init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp')) or 4")
    got = [a for a, _ in axes]
    if got == ["tp", "dp"]:
        raise MeshError("the data axis must be the outer mesh axis", where="mesh", got=str(axes),
                        fix="list dp before tp, e.g. {'dp': 2, 'tp': 2}: tensor-parallel ranks are neighbours")
    if not axes or not in_order(axes, ("dp", "cp", "tp")):
        raise MeshError("this takes a mesh of a data axis, a context axis and/or a tensor axis", where="mesh",
                        expected="axes named dp, cp and/or tp (in that order), each of size >= 1", got=str(axes),
                        fix="with pp or ep axes, call autopar.parallelize with that mesh (it plans the pipeline and "
                            "the experts) or run `autopar plan` for a cluster"
                        if any(a in ("pp", "ep") for a in got) else "name the axes dp, cp and tp, in that order")
    return axes


def pipeline_axes(mesh: Any) -> Axes:
    """The axes of a pipeline mesh: ``pp`` first, then ``dp``, ``cp``, ``ep`` and/or ``tp``."""
    axes = _named(mesh, "e.g. {'pp': 2, 'tp': 2}")
    if not in_order(axes, ("pp", "dp", "cp", "ep", "tp")):
        raise MeshError("pipeline mesh axes must be pp, then dp, cp, ep and/or tp, each of size >= 1", where="mesh",
                        expected="e.g. {'pp': 2}, {'pp': 2, 'dp': 2}, {'pp': 2, 'cp': 2} or {'pp': 2, 'tp': 2}",
                        got=str(dict(axes)), fix="list the axes in the order pp, dp, cp, ep, tp")
    return axes


def expert_axes(mesh: Any) -> Axes:
    """The axes of an expert-parallel mesh without a pipeline: ``dp``, ``cp``, ``ep``, ``tp`` (ep required)."""
    axes = _named(mesh, "e.g. {'ep': 2} or {'dp': 2, 'ep': 2}")
    if not in_order(axes, ("dp", "cp", "ep", "tp")) or "ep" not in dict(axes):
        raise MeshError("expert-parallel mesh axes must be dp, cp, ep, tp in that order (ep required)", where="mesh",
                        expected="e.g. {'ep': 2}, {'dp': 2, 'ep': 2}, {'cp': 2, 'ep': 2}, {'ep': 2, 'tp': 2}",
                        got=str(dict(axes)), fix="list the axes in the order dp, cp, ep, tp")
    return axes


def named_axes(mesh: Any, example: str) -> Axes:
    """``((axis, size), ...)`` of a mapping or a DeviceMesh with named axes (``example`` is the
    fix an error offers)."""
    return _named(mesh, example)


def _named(mesh: Any, example: str) -> Axes:
    if isinstance(mesh, Mapping) or (hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "size")
                                     and mesh.mesh_dim_names):
        return read(mesh)
    if hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "size"):
        return ()
    raise MeshError("the mesh must be a {axis: size} mapping or a DeviceMesh with named axes", where="mesh",
                    got=type(mesh).__name__, fix=example)


def stage_device(stage: int, devices: int, placement: str = "loop") -> int:
    """The pipeline rank holding global ``stage``: ``stage % devices`` (``placement="loop"``), or,
    V-shaped (``"v"``, two stages a rank, DualPipeV), ``stage`` below ``devices`` and
    ``2 * devices - 1 - stage`` from there (the first and the last stage on rank 0)."""
    if placement == "v":
        return stage if stage < devices else 2 * devices - 1 - stage
    return stage % devices
