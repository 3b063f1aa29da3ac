"""ZeRO-1: the optimizer state split over the data axes, updated shard by shard."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import PartitionSpec as P

from ._batch import data_parallel_size
from ._reduced import plain_spec, reshard_tree, split_spec
from ._tree import is_array_like


def zero_active(shard_optimizer: bool, data_axes: tuple[str, ...]) -> bool:
    """Whether the optimizer state is sharded here (option on, more than one data shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    return shard_optimizer and not mesh.empty and data_parallel_size(mesh, data_axes) > 1


def shard_specs(params: Any, data_axes: tuple[str, ...]) -> Any:
    """The ZeRO layout of each trainable leaf (and so of its optimizer moments): split over
    `data_axes` along its first free dimension they divide (`split_spec`)."""
    n = data_parallel_size(jax.sharding.get_abstract_mesh(), data_axes)
    return jax.tree.map(lambda x: split_spec(x, data_axes, n), params)


def sharded_init(optimizer: optax.GradientTransformation, params: Any, data_axes: tuple[str, ...]) -> Any:
    """Traced: the optimizer state of `params` laid out in ZeRO shards."""
    # Moments built from the sliced parameters (`zeros_like`) inherit their layout.
    return optimizer.init(reshard_tree(params, shard_specs(params, data_axes)))


def _array_specs(tree: Any) -> Any:
    """The plain `PartitionSpec` of each array leaf of `tree` (arrays or shape structs)."""

    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct):
            spec = sharding.spec if sharding is not None else P()
            return P(*spec, *([None] * (x.ndim - len(spec))))
        return plain_spec(x)

    return jax.tree.map(one, eqx.filter(tree, is_array_like))


def sharded_update(
    optimizer: optax.GradientTransformation, params: Any, grads: Any, opt_state: Any, specs: Any
) -> tuple[Any, Any]:
    """Traced: update the ZeRO shards, then all-gather the parameters once.

    **Arguments:**

    - `optimizer`: the step's optax transformation.
    - `params`: the trainable leaves, in their own layout.
    - `grads`: the mean gradients, already reduced into `specs` (a reduce-scatter).
    - `opt_state`: the optimizer state (from `sharded_init`, or any layout: resharded).
    - `specs`: `shard_specs(params, ...)`.

    **Returns:** `(params, opt_state)`: params in their own layout, state in shards.
    """
    shards = reshard_tree(params, specs)  # replicated → split: a local slice
    state_specs = _array_specs(jax.eval_shape(optimizer.init, shards))
    opt_state = reshard_tree(opt_state, state_specs)  # no-op for a state from `init`
    updates, opt_state = optimizer.update(grads, opt_state, shards)
    shards = optax.apply_updates(shards, updates)
    params = reshard_tree(shards, jax.tree.map(plain_spec, params))  # the all-gather
    return params, reshard_tree(opt_state, state_specs)
