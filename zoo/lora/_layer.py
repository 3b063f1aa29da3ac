"""A `Linear` with a low-rank branch: `y = base(x) + scaling · dropout(x) A B`."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import field
from ..nn import Linear, QuantizedLinear, dropout, project


class LoraLinear(eqx.Module):
    """A frozen `base` `Linear` (or its int8 `QuantizedLinear`) plus a trainable rank-`r` branch.

    `lora_A` is `[in, r]` and `lora_B` `[r, out]` (peft's `lora_A.weight` / `lora_B.weight`
    transposed, like every zoo weight). Their logical axes follow the base weight's: A keeps
    the input axis and B the output axis; the rank axis is never split. With `merged`, the
    branch is already folded into `base.weight` and is skipped.
    """

    base: Linear | QuantizedLinear
    lora_A: Float[Array, "in_features r"] = field(axes=lambda self: (self.base.in_axis, None))
    lora_B: Float[Array, "r out_features"] = field(axes=lambda self: (None, self.base.out_axis))
    r: int = eqx.field(static=True)
    scaling: float = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)
    merged: bool = eqx.field(static=True)

    def __init__(
        self,
        base: Linear | QuantizedLinear,
        r: int,
        *,
        scaling: float,
        dropout_rate: float = 0.0,
        init: bool | str = True,
        key: PRNGKeyArray,
    ):
        """**Arguments:** the `base` layer, rank `r`, the branch's `scaling`, input
        `dropout_rate`, `init` (`True`: A uniform ±1/√in, B = 0; `"gaussian"`: A normal(0,
        1/r), B = 0; `False`: both random), PRNG `key`."""
        n_in, n_out = base.in_features, base.out_features
        if r > min(n_in, n_out):
            raise ValueError(
                f"LoRA rank r={r} exceeds min(in, out) = {min(n_in, n_out)} of a Linear({n_in}, {n_out}); "
                "a rank that large is no low-rank update: choose r <= min(in, out)"
            )
        ka, kb = jr.split(key)
        # An int8 base keeps its float dtype in its scale.
        dtype = base.scale.dtype if isinstance(base, QuantizedLinear) else base.weight.dtype
        if init == "gaussian":
            a = jr.normal(ka, (n_in, r), dtype) / r
        else:
            lim = 1 / math.sqrt(n_in)
            a = jr.uniform(ka, (n_in, r), dtype, -lim, lim)
        b = jr.normal(kb, (r, n_out), dtype) / math.sqrt(r) if init is False else jnp.zeros((r, n_out), dtype)
        self.base = base
        self.lora_A = a
        self.lora_B = b
        self.r = r
        self.scaling = scaling
        self.dropout_rate = dropout_rate
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def __call__(self, x: Float[Array, "*batch in"], *, key: Any = None) -> Float[Array, "*batch out"]:
        """`base(x)` plus the branch (unless merged). `key`: per-example keys for the
        branch's dropout, or `None`."""
        y = self.base(x)
        if self.merged:
            return y
        h = project(project(dropout(x, self.dropout_rate, key), self.lora_A), self.lora_B)
        return y + (h * self.scaling).astype(y.dtype)

    def delta(self) -> Float[Array, "*layers i o"]:
        """The branch as a weight update, `scaling · A B`, in float32."""
        a, b = self.lora_A.astype(jnp.float32), self.lora_B.astype(jnp.float32)
        return self.scaling * (a @ b)
