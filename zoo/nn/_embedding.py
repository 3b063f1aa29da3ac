"""Token embedding lookup on batched integer ids."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import field
from .._checks import check_array, check_ids
from ._linear import project
from ._sharding import for_use, sharding_spec


class Embedding(eqx.Module):
    """A `[vocab, dim]` table looked up by integer ids of any batch shape."""

    weight: Float[Array, "vocab dim"] = field(axes=lambda self: (self.row_axis, "embed"))
    num_embeddings: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    row_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        init_std: float = 1.0,
        row_axis: str | None = "vocab",
        dtype: jnp.dtype = jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:** vocabulary size `num_embeddings`, embedding size `dim`, the
        normal initialisation's `init_std`, the logical axis of the rows (`"vocab"` for
        tokens, `None` for small tables such as positions and token types that are never
        split), parameter `dtype`, PRNG `key`."""
        self.weight = init_std * jr.normal(key, (num_embeddings, dim), dtype)
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.row_axis = row_axis

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch {self.dim}"]:
        """Look up `ids`; returns `[*batch, dim]` sharded like `ids` on its batch dims."""
        check_array(ids, where="Embedding", name="ids", kind="int")
        ids = check_ids(ids, self.num_embeddings, where=f"Embedding of {self.num_embeddings} rows")
        spec = sharding_spec(ids)
        weight = for_use(self.weight, ids, lead_ndim=ids.ndim)
        # `weight[ids]` refuses to guess an output sharding under explicit meshes; the
        # rows follow the ids' sharding, the embedding dim is replicated.
        out_sharding = None if spec is None else P(*spec.partitions, None)
        return weight.at[ids].get(out_sharding=out_sharding)

    def attend(self, x: Float[Array, "*batch {self.dim}"]) -> Float[Array, "*batch {self.num_embeddings}"]:
        """Scores of `x` against every row (`x @ weight.T`): a tied output head.

        Returns `[*batch, vocab]` in `x`'s dtype, split over the mesh axes of the vocab
        dim (tensor parallelism) like the table.

        Under FSDP the table is gathered as the lookup gathers it, then transposed: the
        same all-gather of the same array, which XLA merges into one per step.
        """
        return project(x, for_use(self.weight, x, lead_ndim=x.ndim - 1).T)
