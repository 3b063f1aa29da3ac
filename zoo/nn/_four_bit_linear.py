"""A frozen `Linear` stored in 4 bits: NF4 (bitsandbytes' code book) or symmetric int4,
one float32 scale per block of input features."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Integer, UInt8

from .._axes import field
from .._reduced import plain_spec
from ._four_bit import NF4_CODE, int4_quantize, nf4_quantize, pack_int4
from ._linear import Linear, linear_from, project
from ._sharding import broadcast_like, for_use, sharding_spec

# What each 4-bit code stands for, indexed by the code (a nibble): NF4's levels (scaled by
# the block's absmax), or int4's two's complement integers (scaled by absmax / 7).
LEVELS = {
    "nf4": NF4_CODE,
    "int4": np.array([n if n < 8 else n - 16 for n in range(16)], np.float32),
}
DEFAULT_BLOCK_SIZE = {"nf4": 64, "int4": 128}  # bitsandbytes' NF4 block; a usual int4 group


class FourBitLinear(eqx.Module):
    """`y = x @ dequantize(codes, scale) + bias`, a frozen `Linear` stored in 4 bits.

    The weight `[*layers, in, out]` is cut along `in` into blocks of `block_size` values
    per output feature; each block keeps one float32 `scale` and a 4-bit code per value,
    two codes per byte (`codes[..., i, o]` holds input rows `2i` in its high nibble and
    `2i + 1` in its low one). `kind` says what a code stands for:

    - `"nf4"`: bitsandbytes' NF4 level times the block's absmax. This is bitsandbytes'
      `quantize_4bit(quant_type="nf4")` of the torch weight `[out, in]`, transposed:
      the same codes, scales and dequantised weight, bit for bit.
    - `"int4"`: the integer in [-7, 7] times `absmax / 7` (symmetric per group): within
      half a step of the float weight.

    The fields carry the logical axes of the `Linear` they replace (codes and scales
    `(in_axis, out_axis)`, bias `(out_axis,)`), so `zoo.shard` and the rules place it as
    they place that `Linear`; under FSDP the 4-bit bytes are gathered, then dequantised.
    It has no gradient (codes are integers): it is the frozen base of a LoRA branch
    (QLoRA). Build one with `FourBitLinear.quantize(linear, "nf4")`; `dequantize()`
    gives the float `Linear`.
    """

    codes: UInt8[Array, "*layers packed out_features"] = field(axes=lambda self: (self.in_axis, self.out_axis))
    scale: Float[Array, "*layers blocks out_features"] = field(axes=lambda self: (self.in_axis, self.out_axis))
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: (self.out_axis,))
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    kind: str = eqx.field(static=True)  # "nf4" or "int4"
    in_axis: str | None = eqx.field(static=True)
    out_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        codes: Integer[Array, "*layers packed out_features"],  # uint8, checked below with the fix
        scale: Float[Array, "*layers blocks out_features"],
        bias: Float[Array, "*layers out_features"] | None = None,
        *,
        kind: str = "nf4",
        in_axis: str | None = "embed",
        out_axis: str | None = "mlp",
    ):
        """**Arguments:**

        - `codes`: uint8 `[*layers, in // 2, out]`, two 4-bit codes per byte.
        - `scale`: float `[*layers, in // block_size, out]`, each block's scale (NF4: its
          absmax; int4: absmax / 7).
        - `bias`: `[*layers, out]` floating-point, or `None`.
        - `kind`: `"nf4"` or `"int4"`, what a code stands for.
        - `in_axis`, `out_axis`: logical axis names of the weight's two core dimensions.
        """
        if kind not in LEVELS:
            raise ValueError(f"FourBitLinear kind must be 'nf4' or 'int4', got {kind!r}")
        if codes.dtype != jnp.uint8:
            raise TypeError(
                f"FourBitLinear stores uint8 codes (two per byte), got {codes.dtype}: build it with "
                "FourBitLinear.quantize(linear, kind)"
            )
        in_features = 2 * codes.shape[-2]
        if scale.shape[-1] != codes.shape[-1] or in_features % scale.shape[-2]:
            raise ValueError(
                f"FourBitLinear: scale {tuple(scale.shape)} does not fit codes {tuple(codes.shape)} (a weight of "
                f"{in_features} inputs): give one scale per block of inputs and output, [*layers, blocks, out]"
            )
        self.codes = codes
        self.scale = scale
        self.bias = bias
        self.in_features, self.out_features = in_features, codes.shape[-1]
        self.block_size = in_features // scale.shape[-2]
        self.kind = kind
        self.in_axis = in_axis
        self.out_axis = out_axis

    @classmethod
    def quantize(cls, linear: Linear, kind: str = "nf4", *, block_size: int | None = None) -> FourBitLinear:
        """`linear`'s weight in 4 bits (`kind` "nf4" or "int4", blocks of `block_size`
        input features: default 64 for NF4, bitsandbytes' default, and 128 for int4); its
        bias kept as it is. Works on a stacked `Linear` (`[*layers, in, out]`) too.

        **Raises:** `ValueError` when `block_size` does not divide the input features (the
        message names the sizes that do)."""
        if kind not in LEVELS:
            raise ValueError(f"FourBitLinear.quantize: kind must be 'nf4' or 'int4', got {kind!r}")
        size = DEFAULT_BLOCK_SIZE[kind] if block_size is None else block_size
        *layers, n_in, n_out = linear.weight.shape
        if size < 2 or size % 2 or n_in % size:
            fits = [b for b in (16, 32, 64, 128, 256) if n_in % b == 0]
            raise ValueError(
                f"FourBitLinear.quantize: a block of {size} input features does not divide this layer's {n_in} "
                f"inputs ({kind}); pass block_size= one of {fits or 'an even divisor of ' + str(n_in)}"
            )
        weight = linear.weight
        if isinstance(weight, jax.core.Tracer):
            codes, scale = _quantize_layers(weight.reshape(-1, n_in, n_out), kind, size)
        else:  # a placed weight: quantised on the host's device one layer at a time (each
            # layer's temporaries, not the stack's), placed again by zoo.shard as any new array
            host = np.asarray(jax.device_get(weight)).reshape(-1, n_in, n_out)
            parts = [
                jax.device_get(_quantize_layers(jnp.asarray(host[i : i + 1]), kind, size)) for i in range(len(host))
            ]
            codes, scale = (jnp.asarray(np.concatenate(p)) for p in zip(*parts, strict=True))
        codes, scale = codes.reshape(*layers, n_in // 2, n_out), scale.reshape(*layers, n_in // size, n_out)
        return cls(codes, scale, linear.bias, kind=kind, in_axis=linear.in_axis, out_axis=linear.out_axis)

    def dequantized_weight(self, dtype: Any = jnp.float32) -> Float[Array, "*layers in_features out_features"]:
        """The float weight `[*layers, in, out]` the codes stand for, computed in float32
        (as bitsandbytes' `dequantize_4bit`) and returned in `dtype`: one compiled program
        per shape, not one per operation."""
        return _dequantize_codes_jit(self.codes, self.scale, self.kind, dtype)

    def dequantize(self, dtype: Any = None) -> Linear:
        """The float `Linear` this layer stands for (weight in `dtype`, default the
        scale's, float32), the bias as it is: e.g. to merge LoRA branches into it."""
        return linear_from(
            self.dequantized_weight(self.scale.dtype if dtype is None else dtype),
            self.bias,
            in_axis=self.in_axis,
            out_axis=self.out_axis,
        )

    def __call__(
        self, x: Float[Array, "*batch {self.in_features}"], *, key: Any = None
    ) -> Float[Array, "*batch {self.out_features}"]:
        """Apply the layer to `x` (any leading batch dims) in `x`'s dtype; returns `[*batch, out]`.

        The codes and scales are gathered as they are stored (4-bit bytes, under FSDP),
        then dequantised in `x`'s dtype where they are used. The float weight is made again
        in the backward pass, not kept (it would undo the 4-bit storage during the step).
        `key` is unused, as for `Linear`."""

        def apply(x, codes, scale):
            w = dequantize_codes(codes, scale, self.kind, x.dtype)
            return project(x, w)

        codes = for_use(self.codes, x, lead_ndim=x.ndim - 1)
        scale = for_use(self.scale, x, lead_ndim=x.ndim - 1)
        y = jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable)(x, codes, scale)
        if self.bias is not None:
            y = y + broadcast_like(self.bias.astype(y.dtype), y)
        return y


def dequantize_codes(
    codes: UInt8[Array, "*layers packed out"], scale: Float[Array, "*layers blocks out"], kind: str, dtype: Any
) -> Float[Array, "*layers in out"]:
    """The weight `[*layers, in, out]` 4-bit `codes` (two per byte along `in`) and their
    blocks' `scale` stand for, computed in float32 and returned in `dtype`."""
    # Frozen: no gradient, so no reduced typing either (free: a gathered reduced array holds
    # the same values everywhere); jax's gather (the code lookup) does not take reduced specs.
    codes, scale = (_plain(jax.lax.stop_gradient(v)) for v in (codes, scale))
    *layers, packed, n_out = codes.shape
    blocks = scale.shape[-2]
    # Blocks apart ([..., blocks, per block, out]), then both nibbles of a byte side by side
    # ([..., blocks, per block, 2, out]) and merged into `in`: each reshape names its output
    # sharding (the input axis's split stays on the blocks), as explicit sharding asks.
    spec = None if sharding_spec(codes) is None else plain_spec(codes)
    split = None if spec is None else P(*spec[:-2], spec[-2], None, spec[-1])
    codes = codes.reshape(*layers, blocks, packed // blocks, n_out, out_sharding=split)
    scale = scale.astype(jnp.float32)[..., :, None, :]
    high, low = (_levels(nibbles, kind) * scale for nibbles in (codes >> 4, codes & 0xF))
    w = jnp.stack([high, low], axis=-2)  # rows 2i (high nibble), 2i + 1 (low)
    return w.reshape(*layers, 2 * packed, n_out, out_sharding=spec).astype(dtype)


_dequantize_codes_jit = jax.jit(dequantize_codes, static_argnames=("kind", "dtype"))


def _levels(nibbles: Array, kind: str) -> Array:
    """What each 4-bit code stands for (`LEVELS[kind][nibbles]`, float32), by selects, not a
    gather: elementwise, it keeps the codes' sharding whatever it is (jax's gather of a
    constant table by split indices fails under explicit sharding), and fuses with the
    unpacking and scaling."""
    n = nibbles.astype(jnp.int32)
    if kind == "int4":
        return jnp.where(n > 7, n - 16, n).astype(jnp.float32)
    table = LEVELS[kind]
    out = jnp.where(n == 0, table[0], table[-1]).astype(jnp.float32)
    for code in range(1, len(table) - 1):
        out = jnp.where(n == code, table[code], out)
    return out


def _plain(x: Array) -> Array:
    """`x` without reduced or unreduced typing, on the same devices."""
    spec = sharding_spec(x)
    if spec is None or not (spec.reduced or spec.unreduced):
        return x
    return jax.reshard(x, plain_spec(x))


@eqx.filter_jit
def _quantize_layers(
    weight: Float[Array, "layers in_features out_features"], kind: str, size: int
) -> tuple[UInt8[Array, "layers half out_features"], Float[Array, "layers blocks out_features"]]:
    """The codes and scales of a stack of weights `[layers, in, out]`, quantised as
    bitsandbytes quantises torch's `[out, in]` (rows of input features)."""
    layers, n_in, n_out = weight.shape
    rows = jnp.swapaxes(weight.astype(jnp.float32), -1, -2).reshape(-1, n_in)  # torch's [out, in]
    if kind == "nf4":
        packed, scale = nf4_quantize(rows, size)
    else:
        q, scale = int4_quantize(rows, size)
        packed = pack_int4(q)
    codes = jnp.swapaxes(packed.reshape(layers, n_out, n_in // 2), -1, -2)
    return codes, jnp.swapaxes(scale.reshape(layers, n_out, n_in // size), -1, -2)
