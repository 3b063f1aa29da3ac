"""A `Linear` with a low-rank branch: `y = base(x) + scaling · dropout(x) A B`, or its DoRA form."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._axes import field
from .._reduced import plain_spec
from ..nn import FourBitLinear, Linear, QuantizedLinear, dropout, project
from ..nn._four_bit_linear import dequantize_codes
from ..nn._sharding import for_use, like_rows, sharding_spec


class LinearWrapper(eqx.Module):
    """What a wrapper of a `Linear` (its `base`) shows of it: `in_features`, `out_features`."""

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features


class LoraLinear(LinearWrapper):
    """A frozen `base` `Linear` (or its int8 `QuantizedLinear`, or 4-bit `FourBitLinear`: QLoRA)
    plus a trainable rank-`r` branch.

    `lora_A` is `[in, r]` and `lora_B` `[r, out]` (peft's `lora_A.weight` / `lora_B.weight`
    transposed, like every zoo weight). Their logical axes follow the base weight's: A keeps
    the input axis and B the output axis; the rank axis is never split. With `merged`, the
    branch is already folded into `base.weight` and is skipped.

    With `use_dora` (DoRA, as peft computes it) the layer also holds a trainable
    `lora_magnitude_vector` `[out]` (logical axis: the base's output axis) and computes
    `m / ‖W + scaling·A B‖ · (x W + scaling · x A B)` (+ bias): the norm is over each
    output's column of the weight, treated as a constant in the backward pass (peft's
    `detach`, DoRA paper §4.3). `dora_norm` holds that norm while a DoRA branch is merged
    (`merge(..., unload=False)`), so `unmerge` can undo it; it is `None` otherwise.
    """

    base: Linear | QuantizedLinear | FourBitLinear
    lora_A: Float[Array, "in_features r"] = field(axes=lambda self: (self.base.in_axis, None))
    lora_B: Float[Array, "r out_features"] = field(axes=lambda self: (None, self.base.out_axis))
    lora_magnitude_vector: Float[Array, " out_features"] | None = field(axes=lambda self: (self.base.out_axis,))
    dora_norm: Float[Array, " out_features"] | None = field(axes=lambda self: (self.base.out_axis,))
    r: int = eqx.field(static=True)
    scaling: float = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)
    merged: bool = eqx.field(static=True)
    use_dora: bool = eqx.field(static=True)

    def __init__(
        self,
        base: Linear | QuantizedLinear | FourBitLinear,
        r: int,
        *,
        scaling: float,
        dropout_rate: float = 0.0,
        init: bool | str = True,
        use_dora: bool = False,
        key: PRNGKeyArray,
    ):
        """**Arguments:** the `base` layer, rank `r`, the branch's `scaling`, input
        `dropout_rate`, `init` (`True`: A uniform ±1/√in, B = 0; `"gaussian"`: A normal(0,
        1/r), B = 0; `False`: both random), `use_dora` (DoRA: a magnitude vector, set to the
        column norms of `W + scaling · A B` as peft sets it), PRNG `key`."""
        n_in, n_out = base.in_features, base.out_features
        if r > min(n_in, n_out):
            raise ValueError(
                f"LoRA rank r={r} exceeds min(in, out) = {min(n_in, n_out)} of a Linear({n_in}, {n_out}); "
                "a rank that large is no low-rank update: choose r <= min(in, out)"
            )
        ka, kb = jr.split(key)
        # An int8 or 4-bit base keeps its float dtype in its scale.
        dtype = (
            base.float_dtype
            if isinstance(base, FourBitLinear)
            else base.scale.dtype
            if isinstance(base, QuantizedLinear)
            else base.weight.dtype
        )
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
        self.use_dora = use_dora
        self.dora_norm = None
        self.lora_magnitude_vector = None
        if use_dora:
            weight = float_weight(base, jnp.float32)
            delta = a.astype(jnp.float32) @ b.astype(jnp.float32)
            self.lora_magnitude_vector = column_norm(weight + scaling * delta).astype(dtype)

    def __call__(self, x: Float[Array, "*batch in"], *, key: Any = None) -> Float[Array, "*batch out"]:
        """`base(x)` plus the branch (unless merged). `key`: per-example keys for the
        branch's dropout, or `None`."""
        y = self.base(x)
        if self.merged:
            return y
        dropped = dropout(x, self.dropout_rate, key)
        h = project(project(dropped, self.lora_A), self.lora_B)
        if not self.use_dora:
            return y + (h * self.scaling).astype(y.dtype)
        return y + self._dora(x, dropped, y, h, key).astype(y.dtype)

    def _dora(self, x: Array, dropped: Array, y: Array, h: Array, key: Any) -> Array:
        """What DoRA adds to `base(x)`: `(m/n - 1) · x W + m/n · scaling · x A B`, peft's
        `DoraLinearLayer.forward` (`n` the column norms of `W + scaling · A B`, a constant)."""
        # The norm gets no gradient: its inputs are constants, taken off any reduced
        # typing (free) so they meet the frozen weight; the weight is gathered like the
        # base gathers it for its matmul.
        weight = _constant(float_weight(self.base, x.dtype, like=x))
        a, b = (_constant(for_use(v, x, lead_ndim=x.ndim - 1)).astype(x.dtype) for v in (self.lora_A, self.lora_B))
        delta = a @ b
        norm = jax.lax.stop_gradient(column_norm(weight + self.scaling * delta))
        if self.dropout_rate > 0 and key is not None:
            # peft: the base on the dropped input, no bias (a 4-bit base: the float weight above)
            base = project(dropped, weight if isinstance(self.base, FourBitLinear) else self.base.weight)
            if isinstance(self.base, QuantizedLinear):
                base = base * like_rows(self.base.scale.astype(base.dtype), base)
        else:
            base = y if self.base.bias is None else y - like_rows(self.base.bias.astype(y.dtype), y)
        factor = like_rows(self.lora_magnitude_vector.astype(y.dtype), y) / like_rows(norm.astype(y.dtype), y)
        return factor * (base + self.scaling * h.astype(y.dtype)) - base

    def delta(self) -> Float[Array, "*layers i o"]:
        """The branch as a weight update, `scaling · A B`, in float32."""
        a, b = self.lora_A.astype(jnp.float32), self.lora_B.astype(jnp.float32)
        return self.scaling * (a @ b)


def float_weight(base: Linear | QuantizedLinear | FourBitLinear, dtype: Any, like: Array | None = None) -> Array:
    """The base's weight `[*layers, in, out]` as floats of `dtype` (an int8 or 4-bit one
    dequantised; gathered for use with activation `like`, as its matmul gathers it)."""
    if isinstance(base, FourBitLinear):
        codes, scale = base.codes, base.scale
        if like is not None:
            codes, scale = (for_use(v, like, lead_ndim=like.ndim - 1) for v in (codes, scale))
        return dequantize_codes(codes, scale, base.kind, dtype, base.nested_scales())
    if isinstance(base, QuantizedLinear):
        q, scale = base.weight, base.scale
        if like is not None:
            q, scale = for_use(q, like, lead_ndim=like.ndim - 1), for_use(scale, like, lead_ndim=like.ndim - 1)
        return q.astype(dtype) * scale.astype(dtype)[..., None, :]
    weight = base.weight if like is None else for_use(base.weight, like, lead_ndim=like.ndim - 1)
    return weight.astype(dtype)


def column_norm(weight: Float[Array, "*layers i o"]) -> Float[Array, "*layers o"]:
    """The L2 norm of each output's column of a `[in, out]` weight (peft's row norm of `[out, in]`)."""
    return jnp.sqrt(jnp.sum(jnp.square(weight), axis=-2))


def _constant(x: Array) -> Array:
    """`x` without gradient and without reduced typing (free: a reduced array holds the
    same values everywhere; no transpose ever runs for a constant)."""
    x = jax.lax.stop_gradient(x)
    spec = sharding_spec(x)
    if spec is None or not (spec.reduced or spec.unreduced):
        return x
    return jax.reshard(x, plain_spec(x))


def mutated_init(
    weight: Float[Array, "*layers i o"], r: int, scaling: float, kind: str
) -> tuple[Float[Array, "*layers i r"], Float[Array, "*layers r o"], Float[Array, "*layers i o"]]:
    """PiSSA's or OLoRA's branch of a base `weight` `[*layers, in, out]`, as peft computes it
    (`LoraLayer.pissa_init` / `olora_init`, on torch's `[out, in]` weight `Wt`), in float32:
    `(A [*layers, in, r], B [*layers, r, out], residual W − scaling · A B)`.

    - `"pissa"`: `Wt = V S Uh` (exact SVD); `B = V_r √(S_r / scaling)`, `A = √(S_r / scaling) Uh_r`
      (torch's layout), so `scaling · B A` is the rank-r truncation of `Wt`.
    - `"olora"`: `Wt = Q R`; `B = Q_r` (first r columns), `A = R_r` (first r rows).

    Singular vectors and QR columns are defined up to sign; flipping one rank's sign in
    both A and B changes neither `A B` nor the residual.
    """
    wt = jnp.swapaxes(weight.astype(jnp.float32), -1, -2)  # torch's [out, in]
    if kind == "pissa":
        v, sv, uh = jnp.linalg.svd(wt, full_matrices=False)
        root = jnp.sqrt(sv[..., :r] / scaling)
        a_t = root[..., :, None] * uh[..., :r, :]  # [r, in]
        b_t = v[..., :, :r] * root[..., None, :]  # [out, r]
    elif kind == "olora":
        q, rr = jnp.linalg.qr(wt)
        a_t, b_t = rr[..., :r, :], q[..., :, :r]
    else:
        raise ValueError(f"no base-changing initialisation {kind!r}: 'pissa' or 'olora'")
    a, b = jnp.swapaxes(a_t, -1, -2), jnp.swapaxes(b_t, -1, -2)
    return a, b, weight.astype(jnp.float32) - scaling * (a @ b)
