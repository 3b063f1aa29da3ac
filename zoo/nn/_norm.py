"""LayerNorm and RMSNorm over the last axis of batched arrays."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._axes import field
from ._sharding import broadcast_like


class LayerNorm(eqx.Module):
    """Layer normalisation over the last axis, with optional learned scale and shift.

    Statistics are computed in float32 whatever the input dtype.
    """

    weight: Float[Array, " dim"] | None = field(axes=lambda self: (self.axis,))
    bias: Float[Array, " dim"] | None = field(axes=lambda self: (self.axis,))
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        use_weight: bool = True,
        use_bias: bool = True,
        axis: str | None = "embed",
        dtype: jnp.dtype = jnp.float32,
    ):
        """**Arguments:** `dim` (size of the normalised axis), `eps`, whether to learn a
        scale (`use_weight`, init 1) and a shift (`use_bias`, init 0), the logical `axis`
        name of those vectors, their `dtype`."""
        self.weight = jnp.ones((dim,), dtype) if use_weight else None
        self.bias = jnp.zeros((dim,), dtype) if use_bias else None
        self.dim = dim
        self.eps = eps
        self.axis = axis

    def __call__(self, x: Float[Array, "*batch {self.dim}"]) -> Float[Array, "*batch {self.dim}"]:
        """Normalise `x` over its last axis; returns the same shape and dtype."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * lax.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * broadcast_like(self.weight.astype(y.dtype), y)
        if self.bias is not None:
            y = y + broadcast_like(self.bias.astype(y.dtype), y)
        return y.astype(x.dtype)


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation over the last axis with an optional learned scale."""

    weight: Float[Array, " dim"] | None = field(axes=lambda self: (self.axis,))
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        use_weight: bool = True,
        axis: str | None = "embed",
        dtype: jnp.dtype = jnp.float32,
    ):
        """**Arguments:** `dim`, `eps`, `use_weight` (learn a scale, init 1), the logical
        `axis` name of the scale, its `dtype`."""
        self.weight = jnp.ones((dim,), dtype) if use_weight else None
        self.dim = dim
        self.eps = eps
        self.axis = axis

    def __call__(self, x: Float[Array, "*batch {self.dim}"]) -> Float[Array, "*batch {self.dim}"]:
        """Normalise `x` over its last axis; returns the same shape and dtype."""
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            y = y * broadcast_like(self.weight.astype(y.dtype), y)
        return y.astype(x.dtype)
