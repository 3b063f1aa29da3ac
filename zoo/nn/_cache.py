"""A key/value cache for autoregressive decoding, threaded through the model's own layers.

The cache holds every layer's keys and values for a fixed number of columns
(`prompt + new tokens`; in the decode steps a sliding layer holds only its window:
`KVCache.rings`), stacked on a leading `"layers"` axis like `Stacked`'s parameters, so
one `lax.scan` over layers reads and writes it. Column `c` of the cache is
column `c` of the token buffer; a column's *position* (for RoPE and learned positions) is
its row's count of real tokens before it, so left-padded prompts decode as if unpadded.

There is no cached copy of the layers: `Transformer.extend` runs the same embedding,
blocks, attention and head as training with a `KVCache` passed down (`Stacked` and
`Unstacked` hand each layer its own keys and values, `Attention` writes the new ones
with `KVCache.write` and attends over `KVCache.read`). This module only stores, writes
and reads columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._sharding import entries, sharding_spec

# How `Attention` contracts what `KVCache.read` returns (einsum letters: b batch, k
# kv_heads, t columns, d head_dim).
KEYS_LAYOUT = "bktd"
VALUES_LAYOUT = "bkdt"


class KVCache(eqx.Module):
    """Keys of every layer, `[layers, batch, kv_heads, columns, head_dim]`, and values,
    `[layers, batch, kv_heads, head_dim, columns]`: both attention products contract the
    cache's last dimension (`head_dim` for the scores, `columns` for the values), the form
    XLA's CPU matmuls run fastest on a decode step's small per-head products (1.3-1.8× for
    the attention at 16 rows, 256 columns, than values laid out as the keys).

    - `keys`, `values`: rotated keys (RoPE applied) and values, in the compute dtype.
    - `mask`: `[batch, columns]`, `True` where a column holds a real token (written and
      not padding).
    - `positions`: `[batch]`, the position of each row's next token.
    - `index`: the next column to write: one for every row (`zoo.generate`: prompts are
      left-padded), or `[batch]`, one per row (`zoo.serve.Engine`: each slot is a request
      of its own length, written from column 0).
    - `span` (static): attention reads only the first `span` columns (`None`: all); the
      caller knows no row uses the others (`zoo.serve.Engine`'s decode step).

    `split()` gives the same cache with `keys` and `values` as tuples of per-layer arrays
    (without the `layers` dimension), which `Unstacked` layers read and write: see
    `zoo._generate.split_layers`. `blocks()` splits each layer's further into blocks of
    `CACHE_BLOCK` columns (`zoo.serve.Engine`'s cache: a step that reads the first columns
    only reads whole blocks in place, where a slice of one array would be copied first).
    Inside a layer (`Attention`), `keys` and `values` are that layer's: one array, or a
    tuple of blocks. `rings()` keeps a sliding layer's last `window` columns only (its
    arrays then hold `window` columns, fewer than `mask`; in a blocked cache, one block):
    the decode steps (`zoo.generate`'s loop, `zoo.serve.Engine`'s) write column `c` at slot
    `c mod window`, and `key_columns` says which column each slot holds.

    Under a mesh the batch dimension follows the tokens (`data`) and `kv_heads` follows
    the key projection's output (`model` under tensor parallelism).
    """

    # Every layer's (stacked, or a tuple of per-layer arrays or of per-layer blocks), or,
    # inside a layer, its own (one array, or a tuple of blocks).
    keys: (
        Float[Array, "_layers batch kv_heads _columns head_dim"]
        | Float[Array, "batch kv_heads _columns head_dim"]
        | tuple[Float[Array, "batch kv_heads _columns head_dim"], ...]
        | tuple[tuple[Float[Array, "batch kv_heads _columns head_dim"], ...], ...]
    )
    values: (
        Float[Array, "_layers batch kv_heads head_dim _columns"]
        | Float[Array, "batch kv_heads head_dim _columns"]
        | tuple[Float[Array, "batch kv_heads head_dim _columns"], ...]
        | tuple[tuple[Float[Array, "batch kv_heads head_dim _columns"], ...], ...]
    )
    mask: Bool[Array, "batch columns"]
    positions: Int[Array, " batch"]
    index: Int[Array, "*rows"]
    span: int | None = eqx.field(static=True, default=None)

    @property
    def columns(self) -> int:
        """How many columns the cache holds (prompt + new tokens)."""
        return self.mask.shape[-1]

    def split(self) -> KVCache:
        """The same cache with each layer's keys and values in arrays of their own (tuples),
        as `Unstacked` layers read and write them."""
        layers = range(self.keys.shape[0])
        return self.holding(tuple(self.keys[i] for i in layers), tuple(self.values[i] for i in layers))

    def blocks(self, size: int | None = None) -> KVCache:
        """The same cache with each layer's keys and values split into blocks of `size`
        columns (default `CACHE_BLOCK`; the last block holds the rest), arrays of their own:
        `keys[layer][block]`."""
        cache = self.split() if not isinstance(self.keys, tuple) else self
        parts = block_columns(self.columns, size)

        def split(x, axis):  # a ring (`rings`: fewer columns than the mask) stays one block
            if x.shape[axis] < self.columns:
                return (x,)
            # dynamic_slice: one compiled program per block size, not one per block (an eager
            # `lax.slice` bakes its start into the program: 131,072 columns, 2,048 of them).
            return tuple(lax.dynamic_slice_in_dim(x, a, n, axis=axis) for a, n in parts)

        keys = tuple(split(k, 2) for k in cache.keys)
        values = tuple(split(v, 3) for v in cache.values)
        return self.holding(keys, values)

    def holding(self, keys, values) -> KVCache:
        """The same cache (mask, positions, index, span) over other `keys` and `values`: a
        layer's own (`Stacked`, `Unstacked`), or every layer's again."""
        return KVCache(keys, values, self.mask, self.positions, self.index, self.span)

    def reading(self, span: int | None) -> KVCache:
        """The same cache whose attention reads only the first `span` columns."""
        return KVCache(self.keys, self.values, self.mask, self.positions, self.index, span)

    def extend(self, mask: Bool[Array, "batch seq"]) -> tuple[KVCache, Int[Array, "batch seq"]]:
        """Open `seq` new columns at `index` for tokens whose real ones `mask` marks.

        **Returns:** `(the cache with those columns marked in its mask, the new tokens'
        positions)`: each row counts on from its `positions` (padding takes its row's
        last position, masked).
        """
        mask = mask.astype(bool)
        s = mask.shape[1]
        if jnp.ndim(self.index) == 0:
            columns = lax.dynamic_update_slice(self.mask, mask, (jnp.zeros((), jnp.int32), self.index))
        else:  # each row at its own column
            rows, cols = jnp.arange(mask.shape[0])[:, None], self.index[:, None] + jnp.arange(s)
            columns = self.mask.at[rows, cols].set(mask, mode="drop")
        # As transformers: a row's positions count its real tokens (padding sits at 0, masked).
        positions = jnp.maximum(self.positions[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
        return KVCache(self.keys, self.values, columns, self.positions, self.index, self.span), positions

    def advance(self, mask: Bool[Array, "batch seq"]) -> KVCache:
        """After the layers wrote the columns `extend` opened: the next position and column
        of each row (the span is the caller's, per call: dropped)."""
        count = jnp.sum(mask.astype(bool), axis=1, dtype=jnp.int32)
        return KVCache(self.keys, self.values, self.mask, self.positions + count, self.index + mask.shape[1])

    def rings(self, windows: Sequence[int | None], filled: int, columns: int | None = None) -> KVCache:
        """The split cache (`split()`) widened to `columns` columns (default its own; the
        new ones empty), with each layer whose window (`windows`, one per layer, `None`:
        global) is below `columns` holding a ring of `window` columns: the last `window` of
        the `filled` columns written so far (all of them, zeros after, when fewer), column
        `c` at slot `c mod window`, where the decode steps go on writing.
        Why: a sliding layer never reads further back, so its cache need not hold more; and
        a prompt's cache of its own columns grows only its global layers to the decode's."""
        cache = self.split() if not isinstance(self.keys, tuple) else self
        columns = self.columns if columns is None else columns
        more = columns - self.columns
        keys, values = list(cache.keys), list(cache.values)
        for i, w in enumerate(windows):
            if w is None or w >= columns:  # every column
                keys[i] = jnp.pad(keys[i], ((0, 0), (0, 0), (0, more), (0, 0))) if more else keys[i]
                values[i] = jnp.pad(values[i], ((0, 0), (0, 0), (0, 0), (0, more))) if more else values[i]
                continue
            start = max(filled - w, 0)  # the window's first column, at slot start mod w
            k, v = keys[i][:, :, start : start + w], values[i][..., start : start + w]
            short = w - k.shape[2]  # fewer columns than the window so far: empty slots after
            k = jnp.pad(k, ((0, 0), (0, 0), (0, short), (0, 0))) if short else k
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, short))) if short else v
            keys[i], values[i] = jnp.roll(k, start % w, axis=2), jnp.roll(v, start % w, axis=3)
        mask = jnp.pad(self.mask, ((0, 0), (0, more))) if more else self.mask
        return KVCache(tuple(keys), tuple(values), mask, self.positions, self.index, self.span)

    def _ring(self) -> int | None:
        """One layer's ring size when it holds a ring (fewer columns than the mask: `rings`;
        in a blocked cache, its one block), else `None`."""
        keys = self.keys[0] if isinstance(self.keys, tuple) and len(self.keys) == 1 else self.keys
        if isinstance(keys, tuple) or keys.ndim != 4 or keys.shape[2] >= self.columns:
            return None
        return keys.shape[2]

    def key_columns(self, seq: int, read: int) -> tuple[Int[Array, "rows read"], Bool[Array, "batch read"]]:
        """For one layer, after `write` of `seq` new columns: the column each of the `read`
        columns `read()` gives holds, `[1 or batch, read]`, and whether it holds a real
        token, `[batch, read]`. A ring's slot `j` holds the latest column `c ≡ j (mod
        window)` written (none yet: `c < 0`, not real), per row where `index` is per row."""
        if (w := self._ring()) is None:
            return jnp.arange(read)[None], self.mask[:, :read]
        last = jnp.reshape(self.index, (-1, 1)) + seq - 1  # [1 or batch, 1]
        held = last - (last - jnp.arange(w)) % w  # [1 or batch, window]
        at = jnp.clip(held, 0)
        real = jnp.take(self.mask, at[0], axis=1) if held.shape[0] == 1 else jnp.take_along_axis(self.mask, at, 1)
        return held, real & (held >= 0)

    def _read_blocks(self) -> int:
        """How many of one layer's blocks attention reads: those holding the first `span`."""
        used, start, n = self.span if self.span is not None else self.columns, 0, 0
        while n < len(self.keys) and start < used:
            start, n = start + self.keys[n].shape[2], n + 1
        return n

    def write(self, k: Float[Array, "batch seq kv_heads head_dim"], v: Float[Array, "batch seq kv_heads head_dim"]):
        """One layer's cache with the new keys `k` and values `v` written at columns `index …
        index+seq` (a scalar: every row's; `[batch]`: each row's own). A blocked layer
        writes only into the blocks attention reads (a column beyond them is dropped: the
        caller's rows write below `span`)."""
        b, s = k.shape[:2]
        ring = self._ring()
        if ring is not None and s != 1:
            raise ValueError(
                f"a sliding layer's ring cache ({ring} columns) takes one new token per call, got {s}; fill a full "
                "cache with the prompt (zoo._generate.prefill) and keep each window with KVCache.rings"
            )
        if ring is not None and isinstance(self.keys, tuple):  # a blocked cache's ring: its one block
            layer = self.holding(self.keys[0], self.values[0]).write(k, v)
            return self.holding((layer.keys,), (layer.values,))
        index = self.index if ring is None else self.index % ring  # a ring writes column c at c mod window
        if isinstance(self.keys, tuple):  # blocks
            columns = jnp.broadcast_to(jnp.reshape(self.index, (-1, 1)) + jnp.arange(s), (b, s))
            rows = jnp.arange(b)[:, None]
            keys, values, start = list(self.keys), list(self.values), 0
            for i in range(self._read_blocks()):
                size = keys[i].shape[2]
                at = jnp.where((columns >= start) & (columns < start + size), columns - start, size)  # size: dropped
                keys[i] = keys[i].at[rows, :, at].set(k.astype(keys[i].dtype), mode="drop")
                values[i] = values[i].at[rows, :, :, at].set(v.astype(values[i].dtype), mode="drop")
                start += size
            return self.holding(tuple(keys), tuple(values))
        if jnp.ndim(index) == 0:
            zero = jnp.zeros((), jnp.int32)
            keys = lax.dynamic_update_slice(
                self.keys, jnp.swapaxes(k, 1, 2).astype(self.keys.dtype), (zero, zero, index, zero)
            )  # [batch, kv_heads, seq, head_dim]
            values = lax.dynamic_update_slice(
                self.values, jnp.transpose(v, (0, 2, 3, 1)).astype(self.values.dtype), (zero, zero, zero, index)
            )  # [batch, kv_heads, head_dim, seq]
        else:  # each row at its own column: a scatter of `seq` columns per row (`[b, seq]` first)
            rows, cols = jnp.arange(b)[:, None], index[:, None] + jnp.arange(s)
            keys = self.keys.at[rows, :, cols].set(k.astype(self.keys.dtype))
            values = self.values.at[rows, :, :, cols].set(v.astype(self.values.dtype))
        return self.holding(keys, values)

    def read(self) -> tuple[list[Array], list[Array]]:
        """One layer's keys (`KEYS_LAYOUT`) and values (`VALUES_LAYOUT`) that attention reads,
        in parts whose columns follow each other from column 0: the whole array (its first
        `span` columns, sliced: a copy), or the blocks holding the first `span` columns,
        each in place."""
        if self._ring() is not None:  # every slot, in ring order (`key_columns` says which column)
            return list(self.keys) if isinstance(self.keys, tuple) else [self.keys], (
                list(self.values) if isinstance(self.values, tuple) else [self.values]
            )
        if isinstance(self.keys, tuple):
            n = self._read_blocks()
            return list(self.keys[:n]), list(self.values[:n])
        if self.span is not None and self.span < self.columns:
            return [self.keys[:, :, : self.span]], [self.values[..., : self.span]]
        return [self.keys], [self.values]


# Columns per block of a blocked cache (`KVCache.blocks`): the engine's attention spans are
# multiples of it. 64 read faster than 32 (more products per step) at 128-192 columns.
CACHE_BLOCK = 64


def block_columns(columns: int, size: int | None = None) -> list[tuple[int, int]]:
    """`(first column, columns)` of each block of a cache of `columns` columns split into
    blocks of `size` (default `CACHE_BLOCK`; the last one holds the rest)."""
    size = size or CACHE_BLOCK
    return [(a, min(size, columns - a)) for a in range(0, columns, size)]


def _weight(linear) -> jax.Array:
    """The weight of a `Linear`, or of the base of a LoRA-wrapped one (a 4-bit base: its
    codes, which lie on the weight's axes)."""
    base = linear.base if hasattr(linear, "base") else linear
    return base.codes if hasattr(base, "codes") else base.weight


def empty_cache(
    attention, num_layers: int, batch: int, columns: int, dtype, tokens: Int[Array, "batch seq"]
) -> KVCache:
    """A zero cache for `num_layers` layers shaped like `attention` (the stacked `Attention`).

    Its batch dimension takes the sharding of `tokens`' batch, its `kv_heads` dimension
    the sharding of the key projection's output dimension (unless the batch already uses
    that mesh axis), so writing the projected keys into it moves no data.
    """
    shape = (num_layers, batch, attention.num_kv_heads, columns, attention.head_dim)
    spec = sharding_spec(tokens)
    if spec is None:
        cache_spec = mask_spec = None
    else:
        batch_entry = entries(tokens)[0]
        kv_entry = entries(_weight(attention.k_proj))[-1]
        busy = set((batch_entry,) if isinstance(batch_entry, str) else (batch_entry or ()))
        kv_axes = set((kv_entry,) if isinstance(kv_entry, str) else (kv_entry or ()))
        kv_size = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in kv_axes)
        if busy & kv_axes or attention.num_kv_heads % kv_size:
            kv_entry = None
        cache_spec = jax.P(None, batch_entry, kv_entry, None, None)
        mask_spec = jax.P(batch_entry, None)
    return KVCache(
        keys=jnp.zeros(shape, dtype, out_sharding=cache_spec),
        values=jnp.zeros(shape[:3] + (shape[4], shape[3]), dtype, out_sharding=cache_spec),
        mask=jnp.zeros((batch, columns), bool, out_sharding=mask_spec),
        positions=jnp.zeros((batch,), jnp.int32, out_sharding=None if spec is None else jax.P(entries(tokens)[0])),
        index=jnp.zeros((), jnp.int32),
    )
