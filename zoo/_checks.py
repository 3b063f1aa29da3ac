"""Trace-time checks of what a model's entry point is given: rank and dtype kind.

Shapes and dtypes are static under `jax.jit`, so these run once per compile and cost nothing
when the program runs. They are on by default, whether or not the full runtime type checks
(`ZOO_RUNTIME_CHECKS=1`: jaxtyping + beartype on every annotated function) are.
"""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp

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
