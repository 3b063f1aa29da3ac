"""Token embedding lookup on batched integer ids."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import field
from ._broadcast import sharding_spec


class Embedding(eqx.Module):
    """A `[vocab, dim]` table looked up by integer ids of any batch shape."""

    weight: Float[Array, "vocab dim"] = field(axes=("vocab", "embed"))
    num_embeddings: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        init_std: float = 1.0,
        dtype: jnp.dtype = jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:** vocabulary size `num_embeddings`, embedding size `dim`, the
        normal initialisation's `init_std`, parameter `dtype`, PRNG `key`."""
        self.weight = init_std * jr.normal(key, (num_embeddings, dim), dtype)
        self.num_embeddings = num_embeddings
        self.dim = dim

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch {self.dim}"]:
        """Look up `ids`; returns `[*batch, dim]` sharded like `ids` on its batch dims."""
        spec = sharding_spec(ids)
        # `weight[ids]` refuses to guess an output sharding under explicit meshes; the
        # rows follow the ids' sharding, the embedding dim is replicated.
        out_sharding = None if spec is None else P(*spec.partitions, None)
        return self.weight.at[ids].get(out_sharding=out_sharding)
