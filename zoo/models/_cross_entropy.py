"""Cross-entropy written so it holds when the vocabulary axis is split over a mesh axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


def cross_entropy(
    logits: Float[Array, "*batch vocab"], targets: Int[Array | np.ndarray, "*batch"]
) -> Float[Array, "*batch"]:
    """Negative log-likelihood of `targets` under `logits`, float32.

    Written with a one-hot contraction rather than a gather, so it works unchanged when
    the vocab axis is split over a mesh axis (tensor parallelism).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    return -jnp.einsum("...v,...v->...", logp, onehot)
