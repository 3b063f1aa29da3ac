"""Dropout driven by one PRNG key per example."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Key, PRNGKeyArray

# One PRNG key per example (new-style typed keys), the first axis of a batch.
ExampleKeys = Key[Array, " batch"]

# `fold_in` stream of the embedding dropout; layers use their index (0, 1, ...).
EMBEDDING_STREAM = 2**31 - 1


def example_keys(key: PRNGKeyArray, batch_size: int) -> ExampleKeys:
    """One PRNG key per example, `[batch_size]`: put them in the batch for dropout.

    Because each example's dropout mask comes from its own key, a step's result does not
    depend on how the batch is split over devices or microbatches.
    """
    return jr.split(key, batch_size)


def fold_in(keys: ExampleKeys, data: int | jax.Array) -> ExampleKeys:
    """`jax.random.fold_in` applied to each of a batch of keys (new, independent streams)."""
    return jax.vmap(jr.fold_in, in_axes=(0, None))(keys, data)


def dropout(
    x: Float[Array, " batch *rest"], rate: float, keys: Key[Array, " batch"] | None
) -> Float[Array, " batch *rest"]:
    """Zero each element of `x` with probability `rate` and scale the rest by `1/(1-rate)`.

    **Arguments:**

    - `x`: activations whose first axis is the batch.
    - `rate`: drop probability in `[0, 1)`.
    - `keys`: one PRNG key per example (`[batch]`), or `None` for inference (identity).

    **Returns:** an array like `x`.
    """
    if keys is None or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if keys.shape != x.shape[:1]:
        raise ValueError(
            f"dropout needs one PRNG key per example: keys of shape {keys.shape} for activations "
            f"of shape {x.shape}. Make them with zoo.nn.example_keys(key, batch_size)."
        )
    keep = jax.vmap(lambda k: jr.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)
