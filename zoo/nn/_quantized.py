"""A `Linear` whose weight is stored in int8, one float32 scale per output channel; and the
one mapping of a quantised base's kind ("nf4", "int4", "int8", "nf4:32") to the frozen layer
storing it, both ways."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8

from .._axes import field
from ._four_bit_linear import FourBitLinear
from ._linear import Linear, linear_from, project
from ._sharding import broadcast_like
from ._stacked import Stacked


class QuantizedLinear(eqx.Module):
    """`y = (x @ weight) · scale + bias`, a frozen `Linear` stored in int8.

    `weight` is int8 `[in, out]` (stacked layers lead with their layer dims, as `Linear`'s
    do inside `zoo.nn.Stacked`), `scale` float32 `[out]`: symmetric per-output-channel
    quantisation, `weight · scale` ≈ the float weight with an error of at most `scale / 2`
    = absmax / 254 per channel. The fields carry the logical axes of the `Linear` they
    replace (weight `(in_axis, out_axis)`, scale and bias `(out_axis,)`), so `zoo.shard`
    and the rules place it alike. Build one with `QuantizedLinear.quantize(linear)`;
    `dequantize()` gives the float `Linear` back. It has no gradient path worth training
    through (int8 is not differentiable): it is the frozen base of a LoRA branch
    (`zoo.lora.cast_frozen(model, jnp.int8)`).
    """

    weight: Int8[Array, "*layers in_features out_features"] = field(axes=lambda self: (self.in_axis, self.out_axis))
    scale: Float[Array, "*layers out_features"] = field(axes=lambda self: (self.out_axis,))
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: (self.out_axis,))
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    in_axis: str | None = eqx.field(static=True)
    out_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        weight: Int8[Array, "*layers in_features out_features"],
        scale: Float[Array, "*layers out_features"],
        bias: Float[Array, "*layers out_features"] | None = None,
        *,
        in_axis: str | None = "embed",
        out_axis: str | None = "mlp",
    ):
        """**Arguments:**

        - `weight`: the int8 weight `[*layers, in, out]`.
        - `scale`: the float scale of each output channel `[*layers, out]`.
        - `bias`: `[*layers, out]` floating-point, or `None`.
        - `in_axis`, `out_axis`: logical axis names of the weight's two core dimensions.
        """
        if weight.dtype != jnp.int8:
            raise TypeError(
                f"QuantizedLinear stores an int8 weight, got {weight.dtype}: build it with QuantizedLinear.quantize(linear)"
            )
        self.weight = weight
        self.scale = scale
        self.bias = bias
        self.in_features, self.out_features = weight.shape[-2:]
        self.in_axis = in_axis
        self.out_axis = out_axis

    @classmethod
    def quantize(cls, linear: Linear) -> QuantizedLinear:
        """`linear` with its weight quantised to int8 (symmetric, per output channel:
        `scale = absmax / 127` over the input axis, `weight = round(W / scale)`); its bias
        is kept as it is. Works on a stacked `Linear` (weight `[*layers, in, out]`) too, and
        keeps each array's sharding (the scale takes the bias's, i.e. the output axis's)."""
        q, scale = _int8_quantize(linear.weight)
        q, scale = _like(q, linear.weight), _like(scale, linear.bias)
        return cls(q, scale, linear.bias, in_axis=linear.in_axis, out_axis=linear.out_axis)

    def dequantize(self, dtype: Any = None) -> Linear:
        """The float `Linear` this layer stands for: weight `weight · scale` in `dtype`
        (default the scale's, float32), the bias as it is."""
        dtype = self.scale.dtype if dtype is None else dtype
        w = _like(_int8_dequantize(self.weight, self.scale, dtype), self.weight)
        return linear_from(w, self.bias, in_axis=self.in_axis, out_axis=self.out_axis)

    def __call__(
        self, x: Float[Array, "*batch {self.in_features}"], *, key: Any = None
    ) -> Float[Array, "*batch {self.out_features}"]:
        """Apply the layer to `x` (any leading batch dims) in `x`'s dtype; returns `[*batch, out]`.

        The int8 weight is converted to `x`'s dtype where it is used (exact: |q| ≤ 127) and
        scaled after the matmul, `[*batch, out]` multiplications instead of `[in, out]`.
        `key` is unused, as for `Linear`.
        """
        y = project(x, self.weight)
        y = y * broadcast_like(self.scale.astype(y.dtype), y)
        if self.bias is not None:
            y = y + broadcast_like(self.bias.astype(y.dtype), y)
        return y


# One compiled program per shape each (not one per operation: a model's layers are
# quantised and dequantised eagerly, one call per layer).
@jax.jit
def _int8_quantize(weight: Float[Array, "*layers n_in n_out"]) -> tuple[Int8[Array, "*layers n_in n_out"], Array]:
    """Symmetric per-output-channel int8: `(round(W / scale), scale = absmax / 127)`."""
    w = weight.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=-2)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    return jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def _int8_dequantize(weight: Int8[Array, "*layers n_in n_out"], scale: Array, dtype: Any) -> Array:
    """`weight · scale` in `dtype`, computed in float32."""
    return (weight.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]).astype(dtype)


QUANTIZE_KINDS = ("nf4", "int4", "int8")


def quantize_kind(text: str) -> tuple[str, int | None, bool]:
    """A quantised base's text form read: `(kind, block size or None, double quantisation)`
    from "nf4", "int4", "int8", "nf4:32" / "int4:64" (a 4-bit block of inputs per scale),
    and NF4's double-quantised scales (bitsandbytes' `bnb_4bit_use_double_quant`):
    "nf4:dq" or "nf4:64:dq".

    **Raises:** `ValueError` naming the forms."""
    kind, *parts = str(text).split(":")
    double_quant = parts[-1:] == ["dq"] and kind == "nf4"
    block = parts[:-1] if double_quant else parts
    fits = kind in QUANTIZE_KINDS and len(block) <= 1 and (kind != "int8" or not block)
    fits = fits and all(b.isdigit() and int(b) % 2 == 0 and int(b) >= 2 for b in block)
    if not fits:
        raise ValueError(
            f"quantize {text!r}: give nf4, int4 or int8, or a 4-bit kind with an even block of inputs per scale, "
            "e.g. nf4:32; nf4:dq or nf4:64:dq stores NF4's scales in 8 bits (double quantisation)"
        )
    return kind, int(block[0]) if block else None, double_quant


def quantizer(
    kind: str, block_size: int | None = None, double_quant: bool = False
) -> Callable[[Linear], QuantizedLinear | FourBitLinear]:
    """The function storing a float `Linear` as `kind` says: `"int8"` a `QuantizedLinear`
    (`QuantizedLinear.quantize`), `"nf4"` / `"int4"` a `FourBitLinear` of `block_size`
    inputs per scale (`FourBitLinear.quantize`; default 64 / 128; NF4's scales in 8 bits
    with `double_quant`). What loading
    (`zoo.hf.from_pretrained(quantize=)`) and `zoo.lora.cast_frozen` both quantise with.

    **Raises:** `ValueError` for another kind, or a block with int8."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"quantize {kind!r}: give nf4, int4 or int8")
    if kind == "int8":
        if block_size is not None:
            raise ValueError(f"quantize int8 stores one scale per output channel: it takes no block ({block_size})")
        return QuantizedLinear.quantize
    return functools.partial(FourBitLinear.quantize, kind=kind, block_size=block_size, double_quant=double_quant)


def stack_projections(model: Any) -> list[tuple]:
    """The key paths of every `Linear` inside a `Stacked` layer stack (the attention and
    MLP projections, a LoRA branch's base `Linear` too): what a quantised base stores in
    4 or 8 bits. Embeddings, norms and a head outside the stack stay float, as
    bitsandbytes leaves `lm_head` (`zoo.hf.from_pretrained(quantize=)`,
    `zoo.lora.cast_frozen`)."""
    found: list[tuple] = []

    def walk(node: Any, path: tuple, stacked: bool) -> None:
        if isinstance(node, Linear):
            if stacked:
                found.append(path)
            return
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        for key, child in children:
            if isinstance(child, eqx.Module | list | tuple | dict):
                walk(child, path + key, stacked or isinstance(node, Stacked))

    walk(model, (), False)
    return found


def dequantize(tree: Any, dtype: Any = None) -> Any:
    """`tree` with every `QuantizedLinear` (int8) and `FourBitLinear` (NF4, int4) replaced
    by its float `Linear` (`dequantize(dtype)`), e.g. before merging LoRA branches into it
    or exporting the model to Hugging Face."""
    quantized = (QuantizedLinear, FourBitLinear)
    return jax.tree.map(
        lambda node: node.dequantize(dtype) if isinstance(node, quantized) else node,
        tree,
        is_leaf=lambda node: isinstance(node, quantized),
    )


def _like(x: jax.Array, ref: jax.Array | None) -> jax.Array:
    """`x` on `ref`'s sharding when both are concrete arrays of the same rank (the
    elementwise ops keep it anyway under a mesh; this spells it out on placed arrays)."""
    if ref is None or isinstance(x, jax.core.Tracer) or isinstance(ref, jax.core.Tracer) or x.ndim != ref.ndim:
        return x
    return jax.device_put(x, ref.sharding)
