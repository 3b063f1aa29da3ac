"""Reduced-safe broadcasting of a parameter against a batch-sharded activation."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P


def sharding_spec(x: jax.Array) -> P | None:
    """The `PartitionSpec` in `x`'s type, or `None` when no mesh is in use."""
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty:
        return None
    return sharding.spec


def broadcast_like(param: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcast `param` over the leading dims of `x` (its own dims are `x`'s last ones).

    `x + param` fails when `x` is sharded on the data axis and `param` is reduced over it
    ("Inputs cannot be sharded/varying on the same axes that another input is reduced
    on"). Broadcasting first, into `x`'s own sharding, makes the elementwise op one between
    equally sharded arrays; its transpose is a local sum into an unreduced gradient, so no
    all-reduce is added to the loop (see docs/design.md, "The traps").
    """
    dims = tuple(range(x.ndim - param.ndim, x.ndim))
    return lax.broadcast_in_dim(param, x.shape, dims, out_sharding=sharding_spec(x))
