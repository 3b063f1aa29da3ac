"""Checks of what a model's entry point is given: rank and dtype kind, and ids in range.

Shapes and dtypes are static under `jax.jit`, so these run once per compile and cost nothing
when the program runs. They are on by default, whether or not the full runtime type checks
(`ZOO_RUNTIME_CHECKS=1`: jaxtyping + beartype on every annotated function) are. Id values
are checked where they are concrete (host arrays, eager calls); inside compiled code only
under `ZOO_RUNTIME_CHECKS=1`, so a default training step holds no check.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

Kind = Literal["float", "int", "bool"]
_KINDS = {"float": jnp.floating, "int": jnp.integer, "bool": jnp.bool_}
_FIX = {
    "float": "cast it with .astype(jnp.float32)",
    "int": "pass integer ids (e.g. .astype(jnp.int32))",
    "bool": "pass a boolean array (e.g. ids != pad_id)",
}


def check_array(x: Any, *, where: str, name: str, kind: Kind, ndim: int | None = None, min_ndim: int = 0,
                last: int | None = None) -> None:  # fmt: skip
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


def runtime_checks() -> bool:
    """Whether `ZOO_RUNTIME_CHECKS` asks for runtime checks (as `zoo/__init__.py` reads it)."""
    return os.environ.get("ZOO_RUNTIME_CHECKS", "").strip().lower() not in ("", "0", "false", "no")


def check_ids(ids: Any, size: int, *, where: str, name: str = "ids") -> Any:
    """`ids`, refused unless every one lies in `[0, size)`: a lookup clamps an id outside
    (a silently wrong row). A concrete array (host numpy, an eager jax array) is checked
    here, a `ValueError` naming the first bad id and its position; a traced one inside
    the compiled program (`eqx.error_if`) only under `ZOO_RUNTIME_CHECKS=1`, so by default
    the program is unchanged.

    **Returns:** `ids` (under runtime checks, the traced value the check guards)."""
    if isinstance(ids, jax.core.Tracer):
        if not runtime_checks():
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
