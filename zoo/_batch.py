"""Placing a global batch on the data axes and splitting it into microbatches."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ._reduced import plain_spec


def data_axes_tuple(data_axes: str | tuple[str, ...]) -> tuple[str, ...]:
    """Normalise a data-axis argument to a tuple of mesh axis names."""
    return (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)


def batch_spec(ndim: int, data_axes: tuple[str, ...]) -> P:
    """`PartitionSpec` of a batch-leading array: dim 0 on the data axes, the rest replicated."""
    return P(data_entry(data_axes), *([None] * (ndim - 1)))


def data_entry(data_axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """The `PartitionSpec` entry that splits one dimension over the data axes."""
    return data_axes[0] if len(data_axes) == 1 else data_axes


def data_parallel_size(mesh: Any, data_axes: tuple[str, ...]) -> int:
    """Number of data-parallel shards: the product of the data axes' sizes (1 without a mesh)."""
    if mesh is None or mesh.empty:
        return 1
    missing = [a for a in data_axes if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"data axes {missing} are not in the mesh {dict(mesh.shape)}. Build the mesh with "
            f"a {missing[0]!r} axis (jax.make_mesh((n,), ({missing[0]!r},))) or pass "
            f"data_axes= one of {list(mesh.shape)}."
        )
    return math.prod(mesh.shape[a] for a in data_axes)


def require_explicit(mesh: Any) -> None:
    """Explicit-sharding mode needs the mesh's axes typed `AxisType.Explicit`."""
    for name, kind in zip(mesh.axis_names, mesh.axis_types):
        if kind != AxisType.Explicit:
            raise ValueError(
                f"mesh axis {name!r} has type {kind}; zoo's explicit mode needs every axis "
                "Explicit. Build the mesh with jax.make_mesh(shape, names, "
                "axis_types=(jax.sharding.AxisType.Explicit,) * len(names))."
            )


def check_batch(batch: Any, data_size: int, microbatches: int) -> int:
    """Check that every batch leaf has the same leading size, divisible by N × M.

    Returns the global batch size. Raises `ValueError` saying what to change.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("the batch has no arrays")
    sizes = {getattr(x, "shape", (None,))[0] if getattr(x, "ndim", 0) else None for x in leaves}
    if None in sizes:
        raise ValueError("every batch leaf needs a leading batch dimension; found a scalar")
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}")
    (size,) = sizes
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    unit = data_size * microbatches
    if size % unit != 0:
        lower = (size // unit) * unit
        hint = f"{lower} or {lower + unit}" if lower else f"{unit}"
        raise ValueError(
            f"global batch size {size} is not divisible by data-parallel size {data_size} x "
            f"microbatches {microbatches} = {unit}. Use a batch size that is a multiple of "
            f"{unit} (e.g. {hint}), or change the number of microbatches or devices."
        )
    return size


def shard_batch(batch: Any, data_axes: tuple[str, ...]) -> Any:
    """Inside jit: reshard each batch leaf so dim 0 is split over the data axes (free if
    it already is; a local slice if it arrived replicated)."""

    def one(x):
        spec = plain_spec(x)
        want = batch_spec(x.ndim, data_axes)
        # Keep any sharding of non-batch dims (e.g. sequence on another axis).
        want = P(want[0], *tuple(spec)[1:])
        return x if spec == want else jax.reshard(x, want)

    return jax.tree.map(one, batch)


def split_microbatches(batch: Any, microbatches: int, data_size: int, data_axes: tuple[str, ...]) -> Any:
    """Inside jit: `[B@data, ...]` → `[M, B/M @data, ...]` keeping every row on its device.

    A direct `reshape(M, B // M, ...)` makes microbatch m live on a few devices and
    compiles to an all-to-all. Splitting each device's own rows instead
    (`[N, B/N]` → `[N, M, b]` → swap → `[M, N·b]`) moves nothing.
    """
    first = data_entry(data_axes)

    def one(x):
        rest = x.shape[1:]
        rest_spec = tuple(plain_spec(x))[1:]
        n, m = data_size, microbatches
        b = x.shape[0] // (n * m)
        x = x.reshape(n, m * b, *rest, out_sharding=P(first, None, *rest_spec))
        x = x.reshape(n, m, b, *rest, out_sharding=P(first, None, None, *rest_spec))
        x = x.swapaxes(0, 1)
        return x.reshape(m, n * b, *rest, out_sharding=P(None, first, *rest_spec))

    return jax.tree.map(one, batch)


def split_local_microbatches(batch: Any, microbatches: int) -> Any:
    """Inside `shard_map` (per-device view): `[b_local, ...]` → `[M, b_local / M, ...]`."""
    return jax.tree.map(lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch)
