"""Training a few rows of a frozen embedding: peft's `trainable_token_indices` (TrainableTokens)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._axes import field
from ..nn import Embedding, project
from ..nn._sharding import like_rows
from ._embedding import TableWrapper


class TrainableTokens(TableWrapper):
    """A frozen `base` `Embedding` whose rows `token_indices` are replaced by a trainable
    `trainable_tokens_delta` `[n, dim]` (peft's name: the new rows themselves, initialised to
    the original ones), e.g. new chat-template tokens, without unfreezing the table.

    With `tie_head`, the tied output head (`attend`) scores against the same new rows: the
    head and the embedding stay one weight, as peft ties a tied `lm_head`'s token adapter to
    the embedding's. `trainable_tokens_original` keeps the original rows (frozen), for
    `unmerge`. The rows are swapped by masks and small matmuls, not by a scatter into the
    table, so the gradient is `[n, dim]` and no table-sized array is written.
    """

    base: Embedding
    trainable_tokens_delta: Float[Array, "n dim"] = field(axes=(None, "embed"))
    trainable_tokens_original: Float[Array, "n dim"] = field(axes=(None, "embed"))
    token_indices: tuple[int, ...] = eqx.field(static=True)
    tie_head: bool = eqx.field(static=True)
    merged: bool = eqx.field(static=True)

    def __init__(self, base: Embedding, token_indices: tuple[int, ...] | list[int], *, tie_head: bool = False):
        """**Arguments:** the `base` table, the `token_indices` of the rows to train (distinct,
        in range), `tie_head`."""
        indices = tuple(int(i) for i in token_indices)
        self.base = base
        self.trainable_tokens_original = base.weight[np.asarray(indices)]
        self.trainable_tokens_delta = self.trainable_tokens_original
        self.token_indices = indices
        self.tie_head = tie_head
        self.merged = False

    def _select(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch n"]:
        return (ids[..., None] == jnp.asarray(self.token_indices, ids.dtype)).astype(jnp.float32)

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        """The table's rows for `ids`, the listed rows replaced by the trained ones."""
        y = self.base(ids)
        if self.merged:
            return y
        chosen = self._select(ids).astype(y.dtype)
        keep = 1 - jnp.sum(chosen, axis=-1, keepdims=True)
        return y * keep + project(chosen, self.trainable_tokens_delta.astype(y.dtype))

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch vocab"]:
        """Scores against every row: with `tie_head`, the listed rows' are the trained rows'."""
        y = self.base.attend(x)
        if self.merged or not self.tie_head:
            return y
        columns = np.zeros((len(self.token_indices), self.num_embeddings), np.float32)
        columns[np.arange(len(self.token_indices)), self.token_indices] = 1
        columns = jnp.asarray(columns, y.dtype)
        new = project(project(x, self.trainable_tokens_delta.T.astype(x.dtype)).astype(y.dtype), columns)
        return y * like_rows(1 - jnp.sum(columns, axis=0), y) + new

    def table(self, rows: Float[Array, "n dim"]) -> Float[Array, "vocab dim"]:
        """The base table with the listed rows set to `rows`."""
        weight = self.base.weight
        return weight.at[np.asarray(self.token_indices)].set(rows.astype(weight.dtype))
