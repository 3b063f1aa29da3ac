"""LayerNorm and RMSNorm over the last axis of batched arrays."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._axes import field
from ._sharding import broadcast_like, like_rows


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def standardize(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """`(x - mean) / sqrt(var + eps)` over the last axis (LayerNorm without scale and shift).

    Its derivative `r (t - mean(t) - x̂ mean(t x̂))` (`r` the reciprocal deviation, `x̂`
    the output) keeps `x̂` and the per-row `r` for the backward pass, where differentiating
    the formula keeps `x - mean`, `x̂` and two per-row arrays (docs/performance.md).
    """
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps)


@standardize.defjvp
def _standardize_jvp(eps, primals, tangents):
    (x,), (t,) = primals, tangents
    mean = jnp.mean(x, axis=-1, keepdims=True)
    r = lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + eps)
    y = (x - mean) * r
    mean_t = jnp.mean(t, axis=-1, keepdims=True)
    mean_ty = jnp.mean(t * y, axis=-1, keepdims=True)
    return y, r * (t - mean_t - y * mean_ty)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def rms_scale(x: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """`x / sqrt(mean(x²) + eps)` over the last axis (RMSNorm without its scale).

    Its derivative `r (t - x̂ mean(t x̂))` keeps the output `x̂` and the per-row `r`.
    """
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


@rms_scale.defjvp
def _rms_scale_jvp(eps, primals, tangents):
    (x,), (t,) = primals, tangents
    r = lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    y = x * r
    return y, r * (t - y * jnp.mean(t * y, axis=-1, keepdims=True))


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
        y = standardize(x.astype(jnp.float32), self.eps)
        if self.weight is not None:
            y = y * like_rows(self.weight.astype(y.dtype), y)
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
        y = rms_scale(x.astype(jnp.float32), self.eps)
        if self.weight is not None:
            y = y * like_rows(self.weight.astype(y.dtype), y)
        return y.astype(x.dtype)
