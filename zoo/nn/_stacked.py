"""Layers stacked on a leading axis and run with `lax.scan`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jaxtyping import PRNGKeyArray

from .._axes import stacked_field
from ._dropout import fold_in

Layer = TypeVar("Layer", bound=eqx.Module)

_REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


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
          `zoo.nn.REMAT_POLICIES`) to recompute activations in the backward pass.
        - `key`: split into one key per layer.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if remat is not None and remat not in _REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {remat!r}; use one of {list(_REMAT_POLICIES)}")
        self.layers = eqx.filter_vmap(make_layer)(jr.split(key, num_layers))
        self.num_layers = num_layers
        self.remat = remat

    def __call__(self, x, *args, key=None, **kwargs):
        """Run `x` through every layer in order; extra arguments go to each layer call.

        `key` (optional): one PRNG key per example (`[batch]`); layer `i` gets those keys
        folded with `i`, so every layer draws its own dropout masks.
        """
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, xs):
            layer_params, index = xs
            layer = eqx.combine(layer_params, static)
            if key is None:
                return layer(h, *args, **kwargs), None
            return layer(h, *args, key=fold_in(key, index), **kwargs), None

        if self.remat is not None:
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.remat])
        out, _ = lax.scan(body, x, (params, jnp.arange(self.num_layers)))
        return out


REMAT_POLICIES = tuple(_REMAT_POLICIES)
