"""A model's call boundary: its inputs go where its parameters are.

A zoo model placed by `zoo.shard` computes under explicit sharding, which needs a mesh in
context and inputs on that mesh (batch split over `data`: FSDP layouts gather weights
against it). `place_inputs` makes any input work: host numpy, `jnp` arrays, or arrays
already placed, inside or outside `jax.set_mesh`, eager or under `jax.jit`. Inputs whose
batch dimension is already split over a mesh axis (a training step's microbatches) are
left exactly as they are, so a compiled step does not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# The mesh axis every zoo rules preset splits the batch over.
DATA_AXIS = "data"

Call = TypeVar("Call", bound=Callable[..., Any])


def _leaf_mesh(leaf: Any) -> Any:
    if isinstance(leaf, jax.core.Tracer):
        sharding = jax.typeof(leaf).sharding
    else:
        sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return sharding.mesh
    return None


def model_mesh(model: Any) -> Any:
    """The mesh `model`'s parameters are placed on, or `None` (one device, or no arrays).

    A concrete `jax.sharding.Mesh` for placed arrays; inside `jax.jit` (traced
    parameters) the `AbstractMesh` of their type.
    """
    for leaf in _arrays(model):
        mesh = _leaf_mesh(leaf)
        if mesh is not None:
            return mesh
    return None


def _arrays(model: Any) -> list:
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def _on_device(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A model on one device: its concrete array inputs go to that device."""
    leaves = _arrays(model)
    sharding = None if not leaves or isinstance(leaves[0], jax.core.Tracer) else leaves[0].sharding

    def one(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return jnp.asarray(x) if sharding is None else jax.device_put(x, sharding)
        if sharding is not None and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        return x

    return tuple(one(x) for x in args), {k: one(v) for k, v in kwargs.items()}


def _tracing() -> bool:
    # `jax.sharding.get_mesh` refuses to run under a trace, and says so.
    try:
        jax.sharding.get_mesh()
    except ValueError:
        return True
    return False


def _is_input(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and x.ndim >= 1


def _batch_split(x: Any) -> bool:
    """Whether `x`'s leading dimension is already split over some mesh axis."""
    if not isinstance(x, jax.Array):
        return False
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty:
        return False
    parts = tuple(sharding.spec)
    return bool(parts) and parts[0] is not None


def _pad_rows(x: jax.Array, extra: int) -> jax.Array:
    # Repeat the last row: padded rows are copies of a real example, so they cannot
    # produce NaNs or infinities; they are sliced off the outputs.
    return jnp.concatenate([x, jnp.broadcast_to(x[-1:], (extra, *x.shape[1:]))], axis=0)


def _placer(mesh: Any, traced: bool) -> Callable[[Any, P], jax.Array]:
    if traced:
        return lambda x, spec: jax.reshard(jnp.asarray(x), spec)
    return lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))


def _data_size(mesh: Any) -> int:
    if DATA_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[DATA_AXIS]


def _call_on_mesh(call: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
    """Under an active mesh context: place the inputs, call, drop padded rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if any(kind != AxisType.Explicit for kind in mesh.axis_types):
        # Inside `shard_map` (manual axes: per-device code) or under automatic sharding:
        # not ours to place.
        return call(model, *args, **kwargs)
    traced = _tracing()
    place = _placer(None if traced else jax.sharding.get_mesh(), traced)
    inputs = [x for x in (*args, *kwargs.values()) if _is_input(x)]
    if not inputs or all(_batch_split(x) for x in inputs):
        return call(model, *args, **kwargs)
    batch = inputs[0].shape[0]
    split = _data_size(mesh)
    extra = -batch % split

    def one(x: Any) -> Any:
        if not _is_input(x) or _batch_split(x) or x.shape[0] != batch:
            return x
        if extra:
            x = _pad_rows(place(x, P()), extra)
        return place(x, P(DATA_AXIS) if split > 1 else P())

    out = call(model, *(one(x) for x in args), **{k: one(v) for k, v in kwargs.items()})
    if not extra:
        return out

    def unpad(y: Any) -> Any:
        if not isinstance(y, jax.Array) or y.ndim == 0 or y.shape[0] != batch + extra:
            return y
        # A slice of a split dimension has no unambiguous sharding: gather the rows first.
        y = jax.reshard(y, P(None, *tuple(jax.typeof(y).sharding.spec)[1:]))
        return y[:batch]

    return jax.tree.map(unpad, out)


def place_inputs(call: Call) -> Call:
    """Decorate a model's `__call__` so it accepts inputs however they arrive.

    For a model whose parameters lie on a mesh (`zoo.shard`): without an active mesh
    context, the parameters' mesh is entered (`jax.set_mesh`, or its abstract mesh under
    `jax.jit`). Then every array argument with a leading batch dimension that is not
    already split over a mesh axis is placed on the mesh with that dimension split over
    `"data"`; a batch that `"data"` does not divide is first padded with copies of its
    last row, and the padded rows are dropped from the outputs. Arguments already split
    (a training step's microbatches) pass unchanged, and nothing is done inside
    `jax.shard_map`. A model on one device gets its concrete inputs on that device (host
    numpy included) and runs off any mesh that is set.

    **Arguments:** `call`, a method `(model, *inputs, **inputs)` whose array arguments
    all lead with the batch dimension.

    **Returns:** the wrapped method; results equal the unsharded model's.
    """

    @functools.wraps(call)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
        mesh = model_mesh(model)
        if mesh is None:
            args, kwargs = _on_device(model, args, kwargs)
            if jax.sharding.get_abstract_mesh().empty or _tracing():
                return call(model, *args, **kwargs)
            # A mesh is set but the model lies on one device: run it off the mesh, where
            # its arrays are (eager ops would otherwise be dispatched to the mesh's devices).
            with jax.set_mesh(None):
                return call(model, *args, **kwargs)
        if not jax.sharding.get_abstract_mesh().empty:
            return _call_on_mesh(call, model, args, kwargs)
        if isinstance(mesh, jax.sharding.Mesh) and not _tracing():
            context = jax.set_mesh(mesh)
        else:
            context = jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))
        with context:
            return _call_on_mesh(call, model, args, kwargs)

    return wrapper  # type: ignore[return-value]
