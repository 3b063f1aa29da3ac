"""Logical-axis annotations declared where a parameter field is declared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.tree_util import GetAttrKey

from ._tree import child, is_array_like, path_str

_AXES = "zoo_axes"
_STACKED = "zoo_stacked"

LAYERS = "layers"


AxesDecl = tuple[str | None, ...] | Callable[[Any], tuple[str | None, ...]]


def field(*, axes: AxesDecl, **kwargs: Any) -> Any:
    """An `eqx.field` that declares the logical axes of the array it holds.

    **Arguments:**

    - `axes`: one logical axis name per array dimension, e.g. `("embed", "mlp")`, or a
      function of the module returning that tuple, for modules whose axis names are
      hyperparameters (`axes=lambda self: (self.in_axis, self.out_axis)`).
      `None` means "never sharded" for that dimension.
    - `kwargs`: passed on to `eqx.field` (e.g. `converter`).

    Layers stacked by `zoo.nn.Stacked` gain a leading `"layers"` axis automatically.
    """
    if not callable(axes) and (not isinstance(axes, tuple) or not all(a is None or isinstance(a, str) for a in axes)):
        raise TypeError(f"axes must be a tuple of str or None (or a callable), got {axes!r}")
    metadata = dict(kwargs.pop("metadata", {}))
    metadata[_AXES] = axes
    return eqx.field(metadata=metadata, **kwargs)


def stacked_field(**kwargs: Any) -> Any:
    """An `eqx.field` whose array leaves carry one extra leading `"layers"` axis.

    Used by `zoo.nn.Stacked`; a user module that stacks layers itself can use it too.
    """
    metadata = dict(kwargs.pop("metadata", {}))
    metadata[_STACKED] = True
    return eqx.field(metadata=metadata, **kwargs)


@dataclasses.dataclass(frozen=True)
class LogicalAxes:
    """The logical axes of one array leaf (a pytree leaf, not a node)."""

    names: tuple[str | None, ...]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _axes_for_path(model: Any, path: tuple) -> tuple[tuple[str | None, ...] | None, int]:
    """(declared axes of the field that holds this leaf, number of stacking levels above it)."""
    node = model
    declared = None
    stacked = 0
    for key in path:
        if isinstance(node, eqx.Module) and isinstance(key, GetAttrKey):
            f = node.__dataclass_fields__.get(key.name)
            if f is not None:
                if _AXES in f.metadata:
                    declared = f.metadata[_AXES]
                    if callable(declared):
                        declared = tuple(declared(node))
                if f.metadata.get(_STACKED):
                    stacked += 1
                    declared = None
        node = child(node, key, None)  # other containers: no metadata below them
        if node is None:
            break
    return declared, stacked


def logical_axes(model: Any) -> Any:
    """The logical axes of every array leaf of `model`.

    **Arguments:**

    - `model`: any pytree, usually an `eqx.Module` built from `zoo.nn` modules.

    **Returns:**

    A pytree with `model`'s structure whose array leaves (and `jax.ShapeDtypeStruct`
    leaves, e.g. of `eqx.filter_eval_shape`) are replaced by `LogicalAxes` (other leaves
    by `None`). Arrays in fields without an annotation are treated as
    replicated (every dimension `None`). Raises `ValueError` if an annotation does not
    have one name per dimension.
    """

    def one(path, leaf):
        if not is_array_like(leaf):
            return None
        declared, stacked = _axes_for_path(model, path)
        core_ndim = leaf.ndim - stacked
        if declared is None:
            declared = (None,) * max(core_ndim, 0)
        names = (LAYERS,) * stacked + tuple(declared)
        if len(names) != leaf.ndim:
            raise ValueError(
                f"{path_str(path)} has shape {leaf.shape} ({leaf.ndim} dims) but its field "
                f"declares logical axes {names} ({len(names)} names, including {stacked} "
                "stacked 'layers' axes). Declare one logical axis per dimension with "
                "zoo.field(axes=(...))."
            )
        return LogicalAxes(names)

    return jax.tree_util.tree_map_with_path(one, model)
