"""Rotary position embeddings (RoPE), in the half-split layout of GPT-NeoX and Llama."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int


def rope_frequencies(
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
) -> Float[Array, " half"]:
    """The inverse frequencies `theta^(-2i/head_dim)`, `[head_dim/2]` (`theta`: a number,
    or a layer's traced base in a patterned stack).

    `llama3`: `(factor, low_freq_factor, high_freq_factor, original_max_len)` rescales them
    as Llama 3.1 does (`rope_type: "llama3"`, transformers' `_compute_llama3_parameters`):
    wavelengths longer than `original_max_len / low_freq_factor` are divided by `factor`,
    those shorter than `original_max_len / high_freq_factor` kept, those between blended.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    seq_len: int,
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
) -> tuple[Float[Array, "seq half"], Float[Array, "seq half"]]:
    """`(cos, sin)` of the rotation angles `p · theta^(-2i/head_dim)`, `[seq, head_dim/2]`
    (`llama3`: the frequencies rescaled, see `rope_frequencies`)."""
    inv_freq = rope_frequencies(head_dim, theta=theta, llama3=llama3)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def rope_angles(
    positions: Int[Array, "batch seq"],
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
) -> tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]:
    """`(cos, sin)` as `rope_tables`, at given per-row `positions` `[batch, seq]` (packed
    documents whose positions restart at 0)."""
    inv_freq = rope_frequencies(head_dim, theta=theta, llama3=llama3)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "batch seq *heads head_dim"],
    cos: Float[Array, "*rows seq half"],
    sin: Float[Array, "*rows seq half"],
) -> Float[Array, "batch seq *heads head_dim"]:
    """Rotate each pair `(x[i], x[i + half])` of every head by its position's angle, `half`
    being `cos`'s last size.

    `cos`/`sin`: `[seq, half]` (every row at positions `0..seq-1`) or `[batch, seq, half]`
    (per-row positions, `rope_angles`). With `2·half < head_dim` (partial rotary, Phi-4-mini's
    `partial_rotary_factor`) only the first `2·half` dimensions of each head are rotated, in
    the same split layout, and the rest pass through unchanged, as transformers' Phi-3 does.

    Computed in float32, returned in `x`'s dtype.
    """
    half = cos.shape[-1]
    rotary = 2 * half
    if rotary > x.shape[-1]:
        raise ValueError(f"apply_rope: cos/sin rotate {rotary} dimensions of heads {x.shape[-1]} wide")
    extra = x.ndim - 3  # head dims between seq and head_dim
    shape = (x.shape[0] if cos.ndim == 3 else 1, x.shape[1]) + (1,) * extra + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:rotary]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rotary < x.shape[-1]:  # partial rotary: the tail is not rotated
        parts.append(x32[..., rotary:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
