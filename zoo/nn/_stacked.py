"""Layers stacked on a leading axis and run with `lax.scan`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jaxtyping import PRNGKeyArray

from .._axes import stacked_field
from ._cache import KVCache
from ._dropout import fold_in
from ._pattern import LayerPattern
from ._remat import _REMAT_POLICIES, resolve_remat

Layer = TypeVar("Layer", bound=eqx.Module)


class Stacked(eqx.Module, Generic[Layer]):
    """`num_layers` copies of one layer, parameters stacked on a leading `"layers"` axis.

    Calling it runs the layers in order with `lax.scan`, so the program (and its compile
    time) holds one layer, not `num_layers`. Reduced parameters scan fine; their gradients
    come out unreduced and stay so through the scan's transpose.
    """

    layers: Layer = stacked_field()
    num_layers: int = eqx.field(static=True)
    remat: str | None = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], Layer],
        num_layers: int,
        *,
        remat: str | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a PRNG key.
        - `num_layers`: how many layers to stack.
        - `remat`: `None`, or a `jax.checkpoint` policy name (one of
          `zoo.nn.REMAT_POLICIES`) to recompute activations in the backward pass, or
          `"auto"`: `"projections"` when the residuals the stack would keep without remat
          are estimated above `zoo.nn._remat.REMAT_AUTO_ABOVE` bytes (from the input's
          static shape, at trace time), else none (`remat_policy`).
        - `key`: split into one key per layer.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if remat is not None and remat != "auto" and remat not in _REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {remat!r}; use one of {list(_REMAT_POLICIES)} or 'auto'")
        self.layers = eqx.filter_vmap(make_layer)(jr.split(key, num_layers))
        self.num_layers = num_layers
        self.remat = remat

    def __call__(self, x, *args, key=None, cache: KVCache | None = None, pattern: LayerPattern | None = None, **kwargs):
        """Run `x` through every layer in order; extra arguments go to each layer call.

        `key` (optional): one PRNG key per example (`[batch]`); layer `i` gets those keys
        folded with `i`, so every layer draws its own dropout masks.
        `cache` (optional, inference): a `KVCache` whose keys and values are stacked on a
        leading `layers` axis; the scan hands layer `i` its own and collects what it
        wrote. Then returns `(output, cache)`.
        `pattern` (optional): a `LayerPattern` of `[layers]` arrays, scanned beside the
        parameters; layer `i` is called with `pattern=` its own values (traced scalars).
        A layer that returns `(output, data)` (a block called with `router=True`) makes
        this return `(output, each layer's data stacked on a leading axis)`.
        """
        params, static = eqx.partition(self.layers, eqx.is_array)
        # A uniform stack scans no pattern: its program is the one without.
        patterned = () if pattern is None else (pattern,)
        if cache is not None:
            cached = functools.partial(_cached_layer_step, static, key, cache, args, kwargs)
            xs = (params, jnp.arange(self.num_layers), (cache.keys, cache.values), *patterned)
            out, (keys, values) = lax.scan(cached, x, xs)
            return out, cache.holding(keys, values)

        # Module-level steps, not closures: the tests' runtime type checks decorate a nested
        # function each time its `def` runs.
        body = functools.partial(_layer_step, static, key, args, kwargs)
        policy = self.remat_policy(x)
        if policy is not None:
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[policy])
        out, per_layer = lax.scan(body, x, (params, jnp.arange(self.num_layers), *patterned))
        return out if per_layer is None else (out, per_layer)

    def remat_policy(self, x) -> str | None:
        """The policy name the stack runs input `x` (an array or its shape and dtype) with:
        `remat`, `"auto"` resolved from `x`'s static shape, `num_layers` and the layers'
        attention heads (`zoo.nn._remat.resolve_remat`); `None`: no checkpoint."""
        heads = getattr(getattr(self.layers, "attention", None), "num_heads", None)
        return resolve_remat(self.remat, x, self.num_layers, heads)

    def unstack(self) -> Unstacked[Layer]:
        """Each layer as a module of its own, its arrays copied out of the stacked ones
        (`Unstacked`)."""
        params, static = eqx.partition(self.layers, eqx.is_array)
        return Unstacked(
            tuple(eqx.combine(jax.tree.map(lambda x, i=i: x[i], params), static) for i in range(self.num_layers))
        )


class Unstacked(eqx.Module, Generic[Layer]):
    """The layers of a `Stacked` as modules of their own, run one after another (unrolled).

    Called like `Stacked` (the same arguments, keys folded the same way; a `cache` of
    per-layer keys and values, `KVCache.split` or `KVCache.blocks`). Why: in a `lax.scan`
    over stacked layers, XLA's CPU backend copies each layer's weights out of the
    `[layers, ...]` arrays (a dynamic slice) before every matmul, on every call: for one
    decoded token that tripled the bytes moved. The decode loops run these instead; the
    program then holds every layer (longer to compile).
    """

    layers: tuple[Layer, ...]

    def __call__(self, x, *args, key=None, cache: KVCache | None = None, pattern: LayerPattern | None = None, **kwargs):
        """As `Stacked.__call__`, layer by layer (layer `i` gets row `i` of `pattern`)."""
        keys = None if cache is None else list(cache.keys)
        values = None if cache is None else list(cache.values)
        for i, layer in enumerate(self.layers):
            more = {} if key is None else {"key": fold_in(key, i)}
            if pattern is not None:
                more["pattern"] = jax.tree.map(lambda a, i=i: a[i], pattern)
            if cache is None:
                x = layer(x, *args, **more, **kwargs)
                continue
            x, layer_cache = layer(x, *args, cache=cache.holding(keys[i], values[i]), **more, **kwargs)
            keys[i], values[i] = layer_cache.keys, layer_cache.values
        return x if cache is None else (x, cache.holding(tuple(keys), tuple(values)))


def _layer_step(static, key, args, kwargs, h, xs):
    """One layer of `Stacked.__call__`'s scan: layer `index`'s parameters (and pattern
    row) combined with the stack's `static` part and applied to `h`; a layer's
    `(output, data)` gives the data to stack, otherwise `None`."""
    layer_params, index, *rows = xs
    layer = eqx.combine(layer_params, static)
    out = layer(h, *args, **_per_layer(key, index, rows), **kwargs)
    # A layer may return (output, per-layer data): the data is stacked over the layers.
    return out if isinstance(out, tuple) else (out, None)


def _cached_layer_step(static, key, cache, args, kwargs, h, xs):
    """`_layer_step` with layer `index`'s slice of the `KVCache` (inference): returns the
    layer's output and what it wrote to its cache."""
    layer_params, index, kv, *rows = xs
    layer = eqx.combine(layer_params, static)
    h, layer_cache = layer(h, *args, cache=cache.holding(*kv), **_per_layer(key, index, rows), **kwargs)
    return h, (layer_cache.keys, layer_cache.values)


def _per_layer(key, index, rows) -> dict:
    """Layer `index`'s own arguments in the scan: its dropout keys (the stack's `key`
    folded with `index`) and its row of the `LayerPattern`, where there are any."""
    more = {} if key is None else {"key": fold_in(key, index)}
    return more | ({"pattern": rows[0]} if rows else {})
