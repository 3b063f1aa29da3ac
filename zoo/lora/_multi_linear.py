"""A `Linear` with several named LoRA branches, each row of a batch using one of them."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .._axes import field
from ..nn import FourBitLinear, Linear, QuantizedLinear, dropout
from ..nn._sharding import contract_spec, entries, for_use, sharding_spec
from ._layer import LinearWrapper


class MultiLoraLinear(LinearWrapper):
    """A frozen `base` `Linear` (or int8 `QuantizedLinear`, 4-bit `FourBitLinear`) with `K` named LoRA branches.

    `lora_A` is `[K, in, r]` and `lora_B` `[K, r, out]`: adapter `k`'s branch (peft's
    `lora_A.<name>` / `lora_B.<name>`, transposed) padded with zeros to the largest rank
    `r`; an adapter that does not target this layer is all zeros here (`present[k]` is
    `False`). The padding stays zero in training: its gradients are zero.

    Each row of the input uses one adapter: `row_scale` `[batch, K]` (set by `route`)
    holds `scalings[k]` at the row's adapter and 0 elsewhere (a row of zeros: the bare
    base). Without `row_scale`, every row uses `active` (an index into `names`, or `None`:
    the bare base). The branch is computed for all `K` adapters as one rank-`K·r` product
    and masked per row: two dense contractions, one compiled program for any mix of
    adapters, and gradients that reach each adapter only from its own rows.
    """

    base: Linear | QuantizedLinear | FourBitLinear
    lora_A: Float[Array, "adapters in_features r"] = field(axes=lambda self: (None, self.base.in_axis, None))
    lora_B: Float[Array, "adapters r out_features"] = field(axes=lambda self: (None, None, self.base.out_axis))
    row_scale: Float[Array, "batch adapters"] | None = field(axes=lambda self: ("batch", None))
    names: tuple[str, ...] = eqx.field(static=True)
    ranks: tuple[int, ...] = eqx.field(static=True)
    scalings: tuple[float, ...] = eqx.field(static=True)
    dropout_rates: tuple[float, ...] = eqx.field(static=True)
    present: tuple[bool, ...] = eqx.field(static=True)
    active: int | None = eqx.field(static=True)

    @property
    def merged(self) -> bool:
        """Never: named adapters are merged one at a time (`merge(adapter(model, name))`)."""
        return False

    def __call__(self, x: Float[Array, "*batch in"], *, key: Any = None) -> Float[Array, "*batch out"]:
        """`base(x)` plus each row's adapter branch. `key`: per-example dropout keys, or `None`."""
        y = self.base(x)
        scale = self.row_scale
        if scale is None:
            if self.active is None:
                return y
            scale = jnp.asarray(_one_hot_scale(self.active, self.scalings), jnp.float32)
        rates = set(self.dropout_rates)
        if key is not None and len(rates) > 1:
            raise ValueError(
                f"adapters {self.names} have different lora_dropout {self.dropout_rates}: one batch with dropout "
                "keys can use one rate only; give them the same lora_dropout, or train them apart"
            )
        dropped = dropout(x, rates.pop(), key)
        a = for_use(self.lora_A, dropped, lead_ndim=x.ndim - 1)
        b = for_use(self.lora_B, dropped, lead_ndim=x.ndim - 1)
        h = jnp.einsum(
            "...i,kir->...kr", dropped, a.astype(x.dtype), out_sharding=contract_spec(x, (None, None), x.ndim - 1)
        )
        h = h * _broadcast_rows(scale.astype(h.dtype), h)
        out = contract_spec(h, (entries(b)[-1],), h.ndim - 2)
        return y + jnp.einsum("...kr,kro->...o", h, b.astype(h.dtype), out_sharding=out).astype(y.dtype)


def _one_hot_scale(k: int, scalings: tuple[float, ...]) -> np.ndarray:
    scale = np.zeros(len(scalings), np.float32)
    scale[k] = scalings[k]
    return scale


def _broadcast_rows(scale: Array, h: Array) -> Array:
    """`scale` `[batch, K]` or `[K]` broadcast to `h` `[rows, *rest, K, r]` (the row's
    scale on every position and rank), with `h`'s sharding. Layers that flatten
    `[batch, seq]` into rows before a projection (attention, `zoo.nn.flatten_rows`) give
    `rows = batch · seq`, batch-major: each example's scale is repeated `seq` times."""
    spec = sharding_spec(h)
    if scale.ndim == 2 and scale.shape[0] != h.shape[0]:
        batch, k = scale.shape
        if h.shape[0] % batch:
            raise ValueError(
                f"routed adapters: {batch} rows were routed (zoo.lora.route) but a layer sees {h.shape[0]} rows, "
                "not a multiple: route one adapter index per example of the batch the model is called with"
            )
        per = h.shape[0] // batch
        row = None if spec is None else spec[0]
        wide = lax.broadcast_in_dim(
            scale, (batch, per, k), (0, 2), out_sharding=None if spec is None else P(row, None, None)
        )
        scale = wide.reshape(batch * per, k, out_sharding=None if spec is None else P(row, None))
    dims = (0, h.ndim - 2) if scale.ndim == 2 else (h.ndim - 2,)
    return lax.broadcast_in_dim(scale, h.shape, dims, out_sharding=spec)
