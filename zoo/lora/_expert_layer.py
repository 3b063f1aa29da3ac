"""LoRA on a mixture of experts' stacked expert weights: peft's `target_parameters`.

peft 0.21 adapts a 3-D expert parameter (transformers 5's `mlp.experts.gate_up_proj`
`[experts, 2·width, hidden]`, `mlp.experts.down_proj` `[experts, hidden, width]`) with a
`lora.ParamWrapper`: one rank-r branch per expert, `W_e + scaling · B_e A_e`. A zoo
`ExpertLinear` (`zoo.nn.Experts`' `gate`, `up`, `down`, stored `[experts, in, out]`)
carries it as `LoraExpertLinear`: `lora_A` `[experts, in, r]`, `lora_B` `[experts, r,
out]`, expert `e`'s update `scaling · A_e B_e` (peft's transposed).
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import field
from ..nn import ExpertLinear
from ..nn._experts import _spec
from ..nn._sharding import entries, for_use


class LoraExpertLinear(eqx.Module):
    """A frozen `base` `ExpertLinear` plus a trainable rank-`r` branch per expert.

    `lora_A` is `[experts, in, r]` and `lora_B` `[experts, r, out]`; their logical axes
    are the base weight's (`"expert"` first, A its input axis, B its output axis; the rank
    axis is never split), so under `ep` each device holds its own experts' branches.
    Expert `e` computes `x W_e + scaling · (x A_e) B_e`; with `merged` the branch is
    already folded into `base.weight`.
    """

    base: ExpertLinear
    lora_A: Float[Array, "experts in_features r"] = field(axes=lambda self: ("expert", self.base.in_axis, None))
    lora_B: Float[Array, "experts r out_features"] = field(axes=lambda self: ("expert", None, self.base.out_axis))
    r: int = eqx.field(static=True)
    scaling: float = eqx.field(static=True)
    merged: bool = eqx.field(static=True)
    use_dora: bool = eqx.field(static=True)  # always False: peft's ParamWrapper has no DoRA

    def __init__(self, base: ExpertLinear, r: int, *, scaling: float, init: bool | str = True, key: PRNGKeyArray):
        """**Arguments:** the `base` experts, rank `r`, the branch's `scaling`, `init` (`True`:
        A uniform ±1/√in, B = 0, as peft's ParamWrapper; `"gaussian"`: A normal(0, 1/r),
        B = 0; `False`: both random), PRNG `key`."""
        experts, n_in, n_out = base.weight.shape[-3:]
        if r > min(n_in, n_out):
            raise ValueError(
                f"LoRA rank r={r} exceeds min(in, out) = {min(n_in, n_out)} of the experts' [{n_in}, {n_out}] "
                "projections: choose r <= min(in, out)"
            )
        ka, kb = jr.split(key)
        dtype = base.weight.dtype
        if init == "gaussian":
            a = jr.normal(ka, (experts, n_in, r), dtype) / r
        else:
            lim = 1 / math.sqrt(n_in)
            a = jr.uniform(ka, (experts, n_in, r), dtype, -lim, lim)
        zero = jnp.zeros((experts, r, n_out), dtype)
        self.base = base
        self.lora_A = a
        self.lora_B = jr.normal(kb, (experts, r, n_out), dtype) / math.sqrt(r) if init is False else zero
        self.r = r
        self.scaling = scaling
        self.merged = False
        self.use_dora = False

    @property
    def in_axis(self) -> str | None:
        return self.base.in_axis

    @property
    def out_axis(self) -> str | None:
        return self.base.out_axis

    def _branch(self, x: Array, lead: int, into: str, out: str, tail: Any) -> Array:
        """`scaling · (x A) B` by the einsums `into` (x with A) and `out` (that with B);
        `tail(B)`: the output's sharding after `x`'s `lead` batch dimensions."""
        a, b = (for_use(v, x, lead_ndim=lead).astype(x.dtype) for v in (self.lora_A, self.lora_B))
        low = jnp.einsum(into, x, a, out_sharding=_spec(x, lead, (entries(a)[0], None)))
        return jnp.einsum(out, low, b, out_sharding=_spec(x, lead, tail(b))) * self.scaling

    def spread(self, rows: Float[Array, "*batch in"], lead: int) -> Float[Array, "*batch experts out"]:
        """`ExpertLinear.spread` plus each expert's branch (unless merged)."""
        y = self.base.spread(rows, lead)
        if self.merged:
            return y
        h = self._branch(rows, lead, "...d,edr->...er", "...er,eri->...ei", lambda b: (entries(b)[0], entries(b)[2]))
        return y + h.astype(y.dtype)

    def gather(self, h: Float[Array, "*batch experts in"], lead: int) -> Float[Array, "*batch out"]:
        """`ExpertLinear.gather` plus each expert's branch (unless merged)."""
        y = self.base.gather(h, lead)
        if self.merged:
            return y
        return y + self._branch(h, lead, "...ei,eir->...er", "...er,erd->...d", lambda b: (entries(b)[2],)).astype(
            y.dtype
        )

    def stacked(self, dtype: Any) -> Float[Array, "experts in_features out_features"]:
        """The weight with the branch folded in, in `dtype` (as peft's forward computes it)."""
        if self.merged:
            return self.base.stacked(dtype)
        return (self.base.weight.astype(jnp.float32) + self.delta()).astype(dtype)

    def delta(self) -> Float[Array, "*layers experts i o"]:
        """The branch as a weight update, `scaling · A_e B_e` per expert, in float32."""
        a, b = self.lora_A.astype(jnp.float32), self.lora_B.astype(jnp.float32)
        return self.scaling * (a @ b)
