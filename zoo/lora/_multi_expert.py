"""Several adapters' LoRA branches on a mixture of experts' expert weights, each row of a
batch using one of them: the serving engine's adapter bank on peft's `target_parameters`."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._axes import field
from ..nn import ExpertLinear
from ..nn._experts import _spec
from ..nn._sharding import for_use
from ._multi_linear import _broadcast_rows


class MultiLoraExpertLinear(eqx.Module):
    """A frozen `base` `ExpertLinear` with `K` adapters' per-expert branches stacked.

    `lora_A` is `[K, experts, in, r]` and `lora_B` `[K, experts, r, out]`: adapter `k`'s
    `LoraExpertLinear` branch zero-padded to rank `r` (all zeros where adapter `k` leaves
    this projection alone). Their logical axes are the base weight's (`"expert"`, its input
    or output axis); the adapter and rank axes are never split.

    Each row of the input uses one adapter: `row_scale` `[batch, K]` holds the row's
    adapter's scaling at its index and 0 elsewhere (a row of zeros: the bare base). Expert
    `e` of a row of adapter `k` computes `x W_e + s_k · (x A_ke) B_ke`: the branch is
    computed for all `K` adapters at once and masked per row (two dense contractions, one
    program for any mix). Only `Experts`' dense dispatch can use it: the sorted dispatch
    computes with one folded weight for every row (`stacked`, refused here).
    """

    base: ExpertLinear
    lora_A: Float[Array, "adapters experts in_features r"] = field(
        axes=lambda self: (None, "expert", self.base.in_axis, None)
    )
    lora_B: Float[Array, "adapters experts r out_features"] = field(
        axes=lambda self: (None, "expert", None, self.base.out_axis)
    )
    row_scale: Float[Array, "batch adapters"] | None = field(axes=lambda self: ("batch", None))

    def __init__(self, base: ExpertLinear, adapters: int, rank: int, *, lead: tuple[int, ...] = ()):
        """**Arguments:** the `base` experts (their weight `[*lead, experts, in, out]`, `lead`
        the sizes of the `Stacked` levels above it), the number of `adapters` `K` held and
        their largest `rank`. Every branch starts at zero; `row_scale` is unset (set it per
        batch: `zoo.serve`'s `bind_rows`)."""
        experts, n_in, n_out = base.weight.shape[-3:]
        dtype = base.weight.dtype
        self.base = base
        self.lora_A = jnp.zeros((*lead, adapters, experts, n_in, rank), dtype)
        self.lora_B = jnp.zeros((*lead, adapters, experts, rank, n_out), dtype)
        self.row_scale = None

    @property
    def merged(self) -> bool:
        """Never: the branches stay apart, one per adapter."""
        return False

    def _branch(self, x: Array, lead: int, into: str, out: str, tail: tuple) -> Array:
        """Each row's adapter branch: `(x A_k)` for every adapter `k` by the einsum `into`
        (`[*batch, experts, K, r]`), masked and scaled per row, then with B by `out`."""
        if self.row_scale is None:
            raise ValueError(
                "MultiLoraExpertLinear holds several adapters and no row picks one: bind each row's adapter "
                "scaling first (row_scale [batch, K], as zoo.serve's bind_rows does)"
            )
        a, b = (for_use(v, x, lead_ndim=lead).astype(x.dtype) for v in (self.lora_A, self.lora_B))
        low = jnp.einsum(into, x, a, out_sharding=_spec(x, lead, (None, None, None)))
        low = low * _broadcast_rows(self.row_scale.astype(low.dtype), low)
        return jnp.einsum(out, low, b, out_sharding=_spec(x, lead, tail))

    def spread(self, rows: Float[Array, "*batch in"], lead: int) -> Float[Array, "*batch experts out"]:
        """`ExpertLinear.spread` plus each row's adapter's branch on every expert."""
        y = self.base.spread(rows, lead)
        h = self._branch(rows, lead, "...d,kedr->...ekr", "...ekr,keri->...ei", (None, None))
        return y + h.astype(y.dtype)

    def gather(self, h: Float[Array, "*batch experts in"], lead: int) -> Float[Array, "*batch out"]:
        """`ExpertLinear.gather` plus each row's adapter's branch, summed over the experts."""
        y = self.base.gather(h, lead)
        return y + self._branch(h, lead, "...ei,keir->...ekr", "...ekr,kerd->...d", (None,)).astype(y.dtype)

    def stacked(self, dtype: Any) -> Array:
        """Refused: the sorted dispatch computes every row with one weight, and these rows
        each use their own adapter's."""
        raise ValueError(
            "Experts(dispatch='sorted') folds one weight for every row, but rows here use different adapters' "
            "expert branches: serve expert LoRA adapters on a model built with TransformerConfig(moe_dispatch='dense') "
            "(the default)"
        )
