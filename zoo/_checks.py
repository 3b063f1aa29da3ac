"""Checks of what a model's entry point is given: rank and dtype kind, and ids in range.

Shapes and dtypes are static under `jax.jit`, so these run once per compile and cost nothing
when the program runs. They are on by default, whether or not the full runtime type checks
(`ZOO_RUNTIME_CHECKS=1`: jaxtyping + beartype on every annotated function) are. Id values
are checked where they are concrete (host arrays, eager calls); inside compiled code only
under `ZOO_RUNTIME_CHECKS=1`, so a default training step holds no check.
"""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._env import runtime_checks

Kind = Literal["float", "int", "bool"]
_KINDS = {"float": jnp.floating, "int": jnp.integer, "bool": jnp.bool_}
_FIX = {
    "float": "cast it with .astype(jnp.float32)",
    "int": "pass integer ids (e.g. .astype(jnp.int32))",
    "bool": "pass a boolean array (e.g. ids != pad_id)",
}


def check_array(
    x: Any, *, where: str, name: str, kind: Kind, ndim: int | None = None, min_ndim: int = 0, last: int | None = None
) -> None:
    """Raise a `TypeError` / `ValueError` naming `where` and the fix unless `x` is an array of
    dtype kind `kind`, rank `ndim` (or at least `min_ndim`), with last dimension `last`."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{where}: {name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, _KINDS[kind]):
        article = "an" if kind == "int" else "a"
        raise TypeError(
            f"{where}: {name} must be {article} {kind} array, got {dtype} of shape {tuple(shape)}; {_FIX[kind]}"
        )
    rank = len(shape)
    if (ndim is not None and rank != ndim) or rank < min_ndim:
        want = f"{ndim}" if ndim is not None else f"at least {min_ndim}"
        raise ValueError(f"{where}: {name} must have {want} dimensions, got shape {tuple(shape)}")
    if last is not None and shape[-1] != last:
        raise ValueError(f"{where}: {name} must end with a dimension of size {last}, got shape {tuple(shape)}")


def check_ids(ids: Any, size: int, *, where: str, name: str = "ids") -> Any:
    """`ids`, refused unless every one lies in `[0, size)`: a lookup clamps an id outside
    (a silently wrong row). A concrete array (host numpy, an eager jax array) is checked
    here, a `ValueError` naming the first bad id and its position; a traced one inside
    the compiled program (`eqx.error_if`) only under `ZOO_RUNTIME_CHECKS=1`, so by default
    the program is unchanged.

    Traced ids split over devices (a sharded training step's batch) are not checked: the
    check would add communication to the step; their host batch is where to check them.

    **Returns:** `ids` (under runtime checks, the traced value the check guards)."""
    if isinstance(ids, jax.core.Tracer):
        if not runtime_checks() or _split(ids):
            # Split over devices, the check would be a reduction across them in every
            # microbatch: an all-reduce inside the step's loop, which zoo's step never holds.
            return ids
        return eqx.error_if(ids, (ids < 0) | (ids >= size), f"{where}: {name} outside [0, {size})")
    if isinstance(ids, jax.Array) and not ids.is_fully_addressable:
        return ids  # other processes hold rows of it: each checks its own
    host = np.asarray(ids)
    bad = np.flatnonzero((host < 0) | (host >= size))
    if bad.size:
        position = tuple(int(i) for i in np.unravel_index(bad[0], host.shape))
        raise ValueError(
            f"{where}: {name} holds {host[position]} at position {position}, outside [0, {size}) ({bad.size} such "
            f"in all); pass ids from 0 to {size - 1} (the model's own tokenizer's)"
        )
    return ids


def _split(x: Any) -> bool:
    """Whether traced `x` is split over mesh axes of more than one device (explicit
    sharding, or a `shard_map` body's varying axes)."""
    aval = jax.typeof(x)
    sharding = aval.sharding
    axes = set(aval.mat.varying)
    for entry in getattr(sharding, "spec", None) or ():
        axes |= set(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return any(sharding.mesh.shape.get(ax, 1) > 1 for ax in axes)
