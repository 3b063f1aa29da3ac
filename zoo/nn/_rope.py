"""Rotary position embeddings (RoPE), in the half-split layout of GPT-NeoX and Llama."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def rope_tables(
    seq_len: int, head_dim: int, *, theta: float = 10000.0
) -> tuple[Float[Array, "seq half"], Float[Array, "seq half"]]:
    """`(cos, sin)` of the rotation angles `p · theta^(-2i/head_dim)`, `[seq, head_dim/2]`."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "batch seq *heads head_dim"],
    cos: Float[Array, "seq half"],
    sin: Float[Array, "seq half"],
) -> Float[Array, "batch seq *heads head_dim"]:
    """Rotate each pair `(x[i], x[i + head_dim/2])` of every head by its position's angle.

    Computed in float32, returned in `x`'s dtype.
    """
    half = x.shape[-1] // 2
    extra = x.ndim - 3  # head dims between seq and head_dim
    shape = (1, x.shape[1]) + (1,) * extra + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
