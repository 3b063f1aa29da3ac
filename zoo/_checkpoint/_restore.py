"""Restore planning: what orbax reads each leaf into (shape, dtype, target sharding) and
how what it read becomes the restored leaf."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._manifest import KEY, NUMPY, PYTHON, STATIC, abstract, leaf_kind


def _key_data_sharding(sharding: Any, ndim: int, extra: int) -> Any:
    """The sharding of the data of a key array of rank `ndim` placed by `sharding`: its
    spec over the key's `ndim` dimensions, then `extra` trailing, unsharded ones."""
    if isinstance(sharding, NamedSharding):
        # A key array's `.sharding` may already be its data's: on a one-device mesh jax
        # gives a scalar key `P(None,)`, one entry per data dimension. Its first `ndim`
        # entries are the key's either way (the data's own dimensions are never split).
        spec = tuple(sharding.spec)[:ndim]
        spec += (None,) * (ndim - len(spec))
        return NamedSharding(sharding.mesh, P(*spec, *([None] * extra)), memory_kind=sharding.memory_kind)
    return sharding


def _concrete(sharding: Any, path: str) -> Any:
    """`sharding` on a concrete mesh: `jax.eval_shape` under `jax.set_mesh(mesh)` gives
    shardings on the abstract mesh; the mesh set now supplies the devices."""
    if not isinstance(sharding, NamedSharding) or isinstance(sharding.mesh, jax.sharding.Mesh):
        return sharding
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.abstract_mesh != sharding.mesh:
        raise ValueError(
            f"`like` leaf {path} has a sharding on an abstract mesh {dict(sharding.mesh.shape)} (as "
            "jax.eval_shape gives), and no concrete mesh of that shape is set to supply its devices. Call "
            "restore under `with jax.set_mesh(mesh):` with the mesh `like` was built for, or give "
            "`like` leaves with concrete shardings."
        )
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def plan(saved: Mapping[str, Any], like_leaf: Any, path: str) -> tuple[Any, Callable[[Any], Any]]:
    """(what orbax reads this leaf into, or `None` if nothing is read; a function from
    what was read to the restored leaf)."""
    like_kind = leaf_kind(like_leaf)
    if like_kind == STATIC:
        return None, lambda _: like_leaf
    if saved["kind"] == PYTHON:
        return None, lambda _: saved["value"]
    if saved["kind"] == KEY:
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(saved["shape"]), like_leaf.dtype))
        shape, dtype = data.shape, np.dtype(data.dtype)
        finish = functools.partial(jax.random.wrap_key_data, impl=saved["impl"])
    else:
        shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])
        finish = _unchanged

    if like_kind == NUMPY or (saved["kind"] == NUMPY and abstract(like_leaf)):
        return np.empty(shape, dtype), np.asarray  # NumPy in, NumPy out
    sharding = getattr(like_leaf, "sharding", None)
    if sharding is None or (isinstance(like_leaf, jax.Array) and not like_leaf.committed):
        # `like` fixes no placement: read on the host and let jax place it, as jnp.asarray.
        return np.empty(shape, dtype), lambda value: finish(jnp.asarray(value))
    sharding = _concrete(sharding, path)
    if saved["kind"] == KEY:
        sharding = _key_data_sharding(sharding, len(saved["shape"]), len(shape) - len(saved["shape"]))
    if saved["kind"] == NUMPY:
        return np.empty(shape, dtype), lambda value: jax.device_put(value, sharding)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), finish


def _unchanged(value: Any) -> Any:
    """What was read is the leaf (`plan`)."""
    return value
