"""An `Embedding` with a low-rank branch: `E[ids] + scaling · A[ids] B`, peft's `lora.Embedding`."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._axes import field
from ..nn import Embedding, project
from ..nn._sharding import for_use, sharding_spec


class TableWrapper(eqx.Module):
    """What a wrapper of an `Embedding` (its `base`) shows of it: the table's `weight`
    (merged: the adapted one), `num_embeddings`, `dim`."""

    @property
    def weight(self) -> Float[Array, "vocab dim"]:
        return self.base.weight

    @property
    def num_embeddings(self) -> int:
        return self.base.num_embeddings

    @property
    def dim(self) -> int:
        return self.base.dim


class LoraEmbedding(TableWrapper):
    """A frozen `base` `Embedding` plus a trainable rank-`r` branch on its rows.

    `lora_embedding_A` is `[vocab, r]` and `lora_embedding_B` `[r, dim]` (peft's
    `lora_embedding_A` `[r, vocab]` and `lora_embedding_B` `[dim, r]` transposed): the
    adapted table is `E + scaling · A B`. A's rows follow the table's row axis, B's columns
    its `"embed"` axis. With `tie_head`, the tied output head (`attend`, a `Transformer`
    whose head is its token embedding) scores against the adapted table too: the two stay
    one weight, as peft's `ensure_weight_tying` ties the head's branch to the embedding's;
    without it the head scores against the base table, as peft leaves an untargeted tied
    head. With `merged`, the branch is already folded into `base.weight`.
    """

    base: Embedding
    lora_embedding_A: Float[Array, "vocab r"] = field(axes=lambda self: (self.base.row_axis, None))
    lora_embedding_B: Float[Array, "r dim"] = field(axes=lambda self: (None, "embed"))
    r: int = eqx.field(static=True)
    scaling: float = eqx.field(static=True)
    tie_head: bool = eqx.field(static=True)
    merged: bool = eqx.field(static=True)

    def __init__(
        self,
        base: Embedding,
        r: int,
        *,
        scaling: float,
        init: bool | str = True,
        tie_head: bool = False,
        key: PRNGKeyArray,
    ):
        """**Arguments:** the `base` table, rank `r`, the branch's `scaling`, `init` (`True` or
        `"gaussian"`: A = 0, B normal(0, 1), as peft initialises an embedding's branch;
        `False`: A normal too, for tests), `tie_head`, PRNG `key`."""
        if r > min(base.num_embeddings, base.dim):
            raise ValueError(
                f"LoRA rank r={r} exceeds min(rows, dim) = {min(base.num_embeddings, base.dim)} of an Embedding"
            )
        ka, kb = jr.split(key)
        dtype = base.weight.dtype
        a = (
            jr.normal(ka, (base.num_embeddings, r), dtype)
            if init is False
            else jnp.zeros((base.num_embeddings, r), dtype)
        )
        self.base = base
        self.lora_embedding_A = a
        self.lora_embedding_B = jr.normal(kb, (r, base.dim), dtype)
        self.r = r
        self.scaling = scaling
        self.tie_head = tie_head
        self.merged = False

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        """The rows of the adapted table for `ids`."""
        y = self.base(ids)
        if self.merged:
            return y
        spec = sharding_spec(ids)
        table = for_use(self.lora_embedding_A, ids, lead_ndim=ids.ndim)
        rows = table.at[ids].get(out_sharding=None if spec is None else P(*spec.partitions, None))
        h = project(rows.astype(y.dtype), self.lora_embedding_B)
        return y + (h * self.scaling).astype(y.dtype)

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]:
        """Scores of `x` against every row: the adapted table's with `tie_head`, else the base's."""
        y = self.base.attend(x)
        if self.merged or not self.tie_head:
            return y
        h = project(project(x, self.lora_embedding_B.T), self.lora_embedding_A.T)
        return y + (h * self.scaling).astype(y.dtype)

    def delta(self) -> Float[Array, "vocab dim"]:
        """The branch as a table update, `scaling · A B`, in float32."""
        return self.scaling * (self.lora_embedding_A.astype(jnp.float32) @ self.lora_embedding_B.astype(jnp.float32))
