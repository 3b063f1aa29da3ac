"""Fingerprints: a 32-bit checksum of each leaf's bits, computed where its shards lie."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

_GOLDEN = 0x9E3779B1  # odd: multiplying by it is a bijection mod 2**32


def _bits(x: jax.Array) -> jax.Array:
    """A `uint32` array holding `x`'s bit pattern (one element per element of `x`)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    try:
        if size == 4:
            return lax.bitcast_convert_type(x, jnp.uint32)
        if size == 2:
            return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        if size == 1:
            return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
        if size == 8:
            halves = lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
            return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(_GOLDEN))
    except TypeError:
        pass
    # Sub-byte types (int4, float4, ...) convert exactly to a wider one.
    wide = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
    return lax.bitcast_convert_type(x.astype(wide), jnp.uint32)


def _host_bits(x: np.ndarray) -> np.ndarray:
    """`_bits` of a NumPy array, on the host (the device would round 64-bit types)."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or x.dtype.itemsize not in (1, 2, 4, 8):
        return x.astype(np.uint32)
    if x.dtype.itemsize == 8:
        halves = np.ascontiguousarray(x).view(np.uint32).reshape(*x.shape, 2)
        return halves[..., 0] ^ (halves[..., 1] * np.uint32(_GOLDEN))
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return np.ascontiguousarray(x).view(unsigned).astype(np.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """Σ bits[i] · (2i+1) · φ mod 2**32 over flat positions i: a replicated `uint32` scalar.

    The weights are odd, so changing any one element changes the sum, and positions are
    weighted, so swapped elements do too. Computed where the shards lie (an all-reduce
    of one scalar), so it costs no transfer and every process gets the same value.
    """
    bits = _bits(x)
    sharding = jax.typeof(bits).sharding
    kwargs = {} if sharding.mesh.empty else {"out_sharding": sharding}
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(bits.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, bits.shape, dim, **kwargs)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[dim]
    weight = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_GOLDEN)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [_fingerprint(x) for x in leaves])


def _placement(x: Any) -> Any:
    """Leaves with the same placement are fingerprinted by one program."""
    if not isinstance(x, jax.Array) or not x.committed:
        return "default"
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return tuple(sorted(d.id for d in sharding.device_set))


def compute_fingerprints(stored: Mapping[str, Any], host: set[str]) -> dict[str, int]:
    """`path → fingerprint` of stored leaves. Those in `host` (saved as NumPy arrays) are
    read bit for bit on the host first, as the device would narrow 64-bit types; the
    others were saved from jax arrays and are fingerprinted as jax arrays."""
    leaves = {name: jnp.asarray(_host_bits(x) if name in host else x) for name, x in stored.items()}
    groups: dict[Any, list[str]] = {}
    for name, x in leaves.items():
        groups.setdefault(_placement(x), []).append(name)
    out: dict[str, int] = {}
    for names in groups.values():
        values = jax.device_get(_fingerprints([leaves[n] for n in names]))
        out.update({n: int(v) for n, v in zip(names, values)})
    return out
