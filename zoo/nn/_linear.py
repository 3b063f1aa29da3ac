"""Linear layer on batched, global-view arrays."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int8, PRNGKeyArray

from .._axes import field
from ._sharding import broadcast_like, contract_spec, entries, for_use, sharding_spec


class Linear(eqx.Module):
    """`y = x @ weight + bias` over the last axis of a batched input.

    The weight is stored `[in, out]`. Its logical axes are hyperparameters (`in_axis`,
    `out_axis`), so the same layer can be an embed→mlp projection in one place and
    mlp→embed in another.
    """

    weight: Float[Array, "in_features out_features"] = field(axes=lambda self: (self.in_axis, self.out_axis))
    bias: Float[Array, " out_features"] | None = field(axes=lambda self: (self.out_axis,))
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    in_axis: str | None = eqx.field(static=True)
    out_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        in_axis: str | None = "embed",
        out_axis: str | None = "mlp",
        init_std: float | None = None,
        dtype: jnp.dtype = jnp.float32,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`, `out_features`: sizes of the input and output feature axes.
        - `use_bias`: whether to add a learned bias.
        - `in_axis`, `out_axis`: logical axis names of the weight's two dimensions.
        - `init_std`: `None` for the uniform(±1/√in) initialisation of `eqx.nn.Linear`; a
          float for normal(0, init_std) weights and zero biases (as GPT-2 and BERT).
        - `dtype`: parameter dtype.
        - `key`: PRNG key.
        """
        wkey, bkey = jr.split(key)
        shape = (in_features, out_features)
        if init_std is None:
            lim = 1 / math.sqrt(in_features)
            self.weight = jr.uniform(wkey, shape, dtype, -lim, lim)
            self.bias = jr.uniform(bkey, (out_features,), dtype, -lim, lim) if use_bias else None
        else:
            self.weight = init_std * jr.normal(wkey, shape, dtype)
            self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features
        self.in_axis = in_axis
        self.out_axis = out_axis

    def __call__(
        self, x: Float[Array, "*batch {self.in_features}"], *, key: Any = None
    ) -> Float[Array, "*batch {self.out_features}"]:
        """Apply the layer to `x` (any leading batch dims); returns `[*batch, out]`.

        `key` is unused (the layer is deterministic); it is accepted so that wrappers with
        dropout, such as LoRA branches, can stand in for a `Linear`.
        """
        y = project(x, self.weight)
        if self.bias is not None:
            y = y + broadcast_like(self.bias.astype(y.dtype), y)
        return y


def project(x: Float[Array, "*batch i"], weight: Float[Array, "i o"] | Int8[Array, "i o"]) -> Float[Array, "*batch o"]:
    """`x @ weight` over `x`'s last axis, in `x`'s dtype, safe under every sharding preset.

    The weight is converted to `x`'s dtype at the matmul, after any gather: a reduced or
    int8 weight (`QuantizedLinear`) travels in its own dtype.

    A weight split over the mesh axis of `x`'s batch (FSDP) is gathered for the use
    (`for_use`); the output sharding is spelled out because a row-parallel weight's
    contracted dim is split over `model`, where jax will not guess.

    The leading dims are flattened into one before the matmul (and restored after) when
    only the first of them is split: the same product, but the gradient of the weight is
    then one plain 2-D `x.T @ dy`. With several batch dims XLA's CPU backend transposes
    the large operand (often fused into the elementwise backward before it, at cache-miss
    speed) — for rank-8 LoRA factors that cost more than all the matmuls
    (docs/performance.md, "Where the LoRA backward time went").
    """
    weight = for_use(weight, x, lead_ndim=x.ndim - 1)
    flat, restore = flatten_rows(x)
    if flat.ndim == 2:
        out_sharding = contract_spec(flat, (entries(weight)[1],), 1)
        return restore(_matmul("ni,io->no", flat, weight, out_sharding))
    out_sharding = contract_spec(x, (entries(weight)[1],), x.ndim - 1)
    return _matmul("...i,io->...o", x, weight, out_sharding)


def _matmul(spec: str, x: Array, weight: Array, out_sharding: Any) -> Array:
    """`einsum(spec, x, weight as x's dtype)`. A weight stored narrower than `x` (a frozen
    base in bfloat16 or int8, `zoo.lora.cast_frozen`) is converted again in the backward
    pass rather than kept: otherwise the backward pass keeps the converted copy, a float32
    weight per layer, which undoes the narrow storage during the step."""

    # A module-level function bound with partial, not a closure: a closure is a new function
    # at every call, which the tests' runtime type checks decorate again every time.
    matmul = functools.partial(_einsum_as_x, spec=spec, out_sharding=out_sharding)
    if jnp.dtype(weight.dtype).itemsize < jnp.dtype(x.dtype).itemsize:
        matmul = jax.checkpoint(matmul, policy=jax.checkpoint_policies.nothing_saveable)
    return matmul(x, weight)


def _einsum_as_x(x: Array, weight: Array, *, spec: str, out_sharding: Any) -> Array:
    """`einsum(spec, x, weight)` with `weight` converted to `x`'s dtype (`_matmul`)."""
    return jnp.einsum(spec, x, weight.astype(x.dtype), out_sharding=out_sharding)


def linear_from(weight: Array, bias: Array | None, *, in_axis: str | None, out_axis: str | None) -> Linear:
    """A `Linear` holding these arrays as they are (`Linear.__init__` draws new weights): a
    dequantised base (`QuantizedLinear`, `FourBitLinear`) as a float layer."""
    linear = object.__new__(Linear)
    n_in, n_out = weight.shape[-2:]
    fields = dict(weight=weight, bias=bias, in_features=n_in, out_features=n_out, in_axis=in_axis, out_axis=out_axis)
    for name, value in fields.items():
        object.__setattr__(linear, name, value)
    return linear


def flatten_rows(x: Float[Array, "*batch i"]) -> tuple[Array, Callable[[Array], Array]]:
    """`x` as one matrix of rows `[prod(batch), i]`, and the function that restores the
    leading dims of a result `[prod(batch), o]` (what `project` does around its matmul).

    Layers that feed one input to several projections (attention's q/k/v, a gated MLP's
    gate/up) flatten it once, so the backward pass keeps one copy of it, not one per
    projection. `x` is returned unchanged (and `restore` is the identity) when it is
    already 2-D or less, or when a dim other than the first is split over a mesh axis.
    Callers pass per-example dropout keys only with the unflattened `x` (a LoRA branch's
    dropout draws one mask per example along the first dim).
    """
    parts = entries(x)
    if x.ndim <= 2 or any(e is not None for e in parts[1:-1]):
        return x, lambda y: y
    lead = x.shape[:-1]
    flat = x.reshape(math.prod(lead), x.shape[-1], out_sharding=_spec_or_none(x, (parts[0], parts[-1])))
    return flat, functools.partial(_restore_rows, lead=lead, parts=parts)


def _restore_rows(y: Array, *, lead: tuple[int, ...], parts: Sequence) -> Array:
    """`y` `[prod(lead), o]` as `[*lead, o]`, split as `parts` says (`flatten_rows`)."""
    out = _spec_or_none(y, (*parts[:-1], entries(y)[-1]))
    return y.reshape(*lead, y.shape[-1], out_sharding=out)


def _spec_or_none(x: jax.Array, partitions: tuple) -> P | None:
    return None if sharding_spec(x) is None else P(*partitions)
