"""A key/value cache for autoregressive decoding, and the layers' cached forward pass.

The cache holds every layer's keys and values for a fixed number of columns
(`prompt + new tokens`), stacked on a leading `"layers"` axis like `Stacked`'s
parameters, so one `lax.scan` over layers reads and writes it. Column `c` of the cache is
column `c` of the token buffer; a column's *position* (for RoPE and learned positions) is
its row's count of real tokens before it, so left-padded prompts decode as if unpadded.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._attention import Attention
from ._block import TransformerBlock
from ._rope import rope_frequencies
from ._sharding import entries, sharding_spec


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

    `split()` gives the same cache with `keys` and `values` as tuples of per-layer arrays
    (without the `layers` dimension), which the decode steps use: see
    `zoo._generate.split_layers`. `blocks()` splits each layer's further into blocks of
    `CACHE_BLOCK` columns (`zoo.serve.Engine`'s cache: a step that reads the first columns
    only reads whole blocks in place, where a slice of one array would be copied first).

    Under a mesh the batch dimension follows the tokens (`data`) and `kv_heads` follows
    the key projection's output (`model` under tensor parallelism).
    """

    keys: (
        Float[Array, "layers batch kv_heads columns head_dim"]
        | tuple[Float[Array, "batch kv_heads columns head_dim"], ...]
        | tuple[tuple[Float[Array, "batch kv_heads _block head_dim"], ...], ...]
    )
    values: (
        Float[Array, "layers batch kv_heads head_dim columns"]
        | tuple[Float[Array, "batch kv_heads head_dim columns"], ...]
        | tuple[tuple[Float[Array, "batch kv_heads head_dim _block"], ...], ...]
    )
    mask: Bool[Array, "batch columns"]
    positions: Int[Array, " batch"]
    index: Int[Array, "*rows"]

    @property
    def columns(self) -> int:
        """How many columns the cache holds (prompt + new tokens)."""
        return self.mask.shape[-1]

    def split(self) -> KVCache:
        """The same cache with each layer's keys and values in arrays of their own (tuples),
        as the decode loop over `split_layers` reads and writes them."""
        layers = range(self.keys.shape[0])
        return KVCache(
            tuple(self.keys[i] for i in layers),
            tuple(self.values[i] for i in layers),
            self.mask,
            self.positions,
            self.index,
        )

    def blocks(self, size: int | None = None) -> KVCache:
        """The same cache with each layer's keys and values split into blocks of `size`
        columns (default `CACHE_BLOCK`; the last block holds the rest), arrays of their own:
        `keys[layer][block]`, as `blocked_attention` reads and writes them."""
        cache = self.split() if not isinstance(self.keys, tuple) else self
        parts = block_columns(self.columns, size)
        keys = tuple(tuple(k[:, :, a : a + n] for a, n in parts) for k in cache.keys)
        values = tuple(tuple(v[..., a : a + n] for a, n in parts) for v in cache.values)
        return KVCache(keys, values, self.mask, self.positions, self.index)


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
    attention: Attention, num_layers: int, batch: int, columns: int, dtype, tokens: Int[Array, "batch seq"]
) -> KVCache:
    """A zero cache for `num_layers` layers shaped like `attention` (the stacked module).

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


def _rotate(x: Float[Array, "batch seq *heads head_dim"], positions: Int[Array, "batch seq"], attention: Attention):
    """RoPE at per-row `positions` (`zoo.nn.apply_rope`'s half-split layout and arithmetic)."""
    hd = x.shape[-1]
    half = hd // 2
    inv_freq = rope_frequencies(hd, theta=attention.rope_theta, llama3=getattr(attention, "rope_llama3", None))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, half]
    shape = x.shape[:2] + (1,) * (x.ndim - 3) + (half,)
    c, s = jnp.cos(angles).reshape(shape), jnp.sin(angles).reshape(shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def cached_attention(
    attention: Attention,
    x: Float[Array, "batch seq embed"],
    keys: Float[Array, "layers batch kv_heads columns head_dim"],
    values: Float[Array, "layers batch kv_heads head_dim columns"],
    *,
    layer: Int[Array, ""],
    positions: Int[Array, "batch seq"],
    index: Int[Array, "*rows"],
    allowed: Bool[Array, "batch seq columns"],
    span: int | None = None,
):
    """`attention` over `x` (columns `index … index+seq`) and every cached column.

    Writes the new keys and values into layer `layer` of the stacked `keys`/`values` at
    column `index` (a scalar: every row's; `[batch]`: each row's own), then attends from
    each new query to the columns `allowed` marks (and, with a `sliding_window`, only to
    the last `window` columns up to its own: the cache keeps every column, the band is a
    mask). With `span`, only the first `span` columns are read (the caller knows no row
    uses the others; `zoo.serve.Engine`'s decode step).
    Same arithmetic as `Attention.__call__` (scores in float32, the same softmax), so a
    cached step equals the full forward pass on the prefix.

    **Returns:** `(output [batch, seq, embed], keys, values)`.
    """
    b, s, _ = x.shape
    q, k, v = _project(attention, x, positions)
    if jnp.ndim(index) == 0:
        zero = jnp.zeros((), jnp.int32)
        keys = lax.dynamic_update_slice(
            keys, jnp.swapaxes(k, 1, 2)[None].astype(keys.dtype), (layer, zero, zero, index, zero)
        )  # [1, batch, kv_heads, seq, head_dim]
        values = lax.dynamic_update_slice(
            values, jnp.transpose(v, (0, 2, 3, 1))[None].astype(values.dtype), (layer, zero, zero, zero, index)
        )  # [1, batch, kv_heads, head_dim, seq]
    else:  # each row at its own column: a scatter of `seq` columns per row (`[b, seq]` first)
        rows, cols = jnp.arange(b)[:, None], index[:, None] + jnp.arange(s)
        keys = keys.at[layer, rows, :, cols].set(k.astype(keys.dtype))
        values = values.at[layer, rows, :, :, cols].set(v.astype(values.dtype))
    k_all = lax.dynamic_index_in_dim(keys, layer, 0, keepdims=False).astype(x.dtype)
    v_all = lax.dynamic_index_in_dim(values, layer, 0, keepdims=False).astype(x.dtype)
    if span is not None and span < keys.shape[3]:  # only the first `span` columns are in use
        k_all, v_all, allowed = k_all[:, :, :span], v_all[..., :span], allowed[..., :span]
    return _attend(attention, q, [k_all], [v_all], index, allowed, x.dtype), keys, values


def blocked_attention(
    attention: Attention,
    x: Float[Array, "batch seq embed"],
    keys: tuple[Float[Array, "batch kv_heads _block head_dim"], ...],
    values: tuple[Float[Array, "batch kv_heads head_dim _block"], ...],
    *,
    positions: Int[Array, "batch seq"],
    index: Int[Array, "*rows"],
    allowed: Bool[Array, "batch seq columns"],
    span: int | None = None,
):
    """`cached_attention` over one layer of a blocked cache (`KVCache.blocks`): attention
    reads only the blocks that hold the first `span` columns (default all), each in place,
    and the new keys and values are written into those blocks at columns `index …
    index+seq` (a column beyond them is dropped: the caller's rows write below `span`).
    Same arithmetic as `cached_attention` but for the order of the sums over blocks.

    **Returns:** `(output [batch, seq, embed], keys, values)` (tuples of blocks).
    """
    b, s, _ = x.shape
    q, k, v = _project(attention, x, positions)
    columns = jnp.reshape(index, (-1, 1)) + jnp.arange(s)  # [1 or batch, seq]: where each row writes
    columns = jnp.broadcast_to(columns, (b, s))
    rows = jnp.arange(b)[:, None]
    keys, values, start = list(keys), list(values), 0
    used = span if span is not None else allowed.shape[-1]
    read = 0  # the blocks attention reads: every block that holds one of the first `span` columns
    while read < len(keys) and start < used:
        size = keys[read].shape[2]
        inside = (columns >= start) & (columns < start + size)
        at = jnp.where(inside, columns - start, size)  # out of the block: dropped
        keys[read] = keys[read].at[rows, :, at].set(k.astype(keys[read].dtype), mode="drop")
        values[read] = values[read].at[rows, :, :, at].set(v.astype(values[read].dtype), mode="drop")
        start, read = start + size, read + 1
    parts_k = [kb.astype(x.dtype) for kb in keys[:read]]
    parts_v = [vb.astype(x.dtype) for vb in values[:read]]
    out = _attend(attention, q, parts_k, parts_v, index, allowed[..., :start], x.dtype)
    return out, tuple(keys), tuple(values)


def _project(attention: Attention, x, positions):
    """The queries `[batch, seq, kv_heads, group, head_dim]`, keys and values `[batch, seq,
    kv_heads, head_dim]` of `x`, queries and keys rotated at `positions` (RoPE)."""
    b, s, _ = x.shape
    kvh, g, hd = attention.num_kv_heads, attention.num_heads // attention.num_kv_heads, attention.head_dim
    q = attention.q_proj(x).reshape(b, s, kvh, g, hd)
    k = attention.k_proj(x).reshape(b, s, kvh, hd)
    v = attention.v_proj(x).reshape(b, s, kvh, hd)
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    if attention.rope_theta is not None:
        q, k = _rotate(q, positions, attention), _rotate(k, positions, attention)
    return q, k, v


def _attend(attention: Attention, q, keys: list, values: list, index, allowed, dtype):
    """Attention of the queries `q` over the cache columns in `keys` and `values` (parts of
    the columns, in order, as long together as `allowed`'s last dimension), through the
    output projection. Scores in float32, the same softmax as `Attention.__call__`."""
    b, s = q.shape[:2]
    hd = attention.head_dim
    scores = [jnp.einsum("bskgd,bktd->bkgst", q, k, preferred_element_type=jnp.float32) for k in keys]
    scores = (scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)) / math.sqrt(hd)
    window = getattr(attention, "sliding_window", None)
    if window is not None:  # Mistral's band: a query sees the `window` columns up to its own
        query_columns = jnp.reshape(index, (-1, 1)) + jnp.arange(s)  # [1 or batch, seq]
        allowed = allowed & (query_columns[:, :, None] - jnp.arange(allowed.shape[-1]) < window)
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = (probs / jnp.sum(probs, axis=-1, keepdims=True)).astype(dtype)
    out, start = None, 0
    for v in values:  # each part's columns of the probabilities times its values
        n = v.shape[-1]
        part = jnp.einsum("bkgst,bkdt->bskgd", probs[..., start : start + n] if len(values) > 1 else probs, v)
        out, start = part if out is None else out + part, start + n
    return attention.o_proj(out.reshape(b, s, attention.num_heads * hd))


def cached_block(
    block: TransformerBlock, x: Float[Array, "batch seq embed"], keys, values, *, attend=cached_attention, **kwargs
):
    """`TransformerBlock.__call__` (inference: no dropout) with `cached_attention` (or
    `attend`: `blocked_attention` over a blocked cache).

    **Returns:** `(output, keys, values)`.
    """
    if block.pre_norm:
        a, keys, values = attend(block.attention, block.attention_norm(x), keys, values, **kwargs)
        h = x + a
        return h + block.mlp(block.mlp_norm(h)), keys, values
    a, keys, values = attend(block.attention, x, keys, values, **kwargs)
    h = block.attention_norm(x + a)
    return block.mlp_norm(h + block.mlp(h)), keys, values
