"""A frozen `Linear` stored in 4 bits: NF4 (bitsandbytes' code book) or symmetric int4,
one float32 scale per block of input features (NF4: or that scale's 8-bit code, bitsandbytes'
double quantisation)."""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Integer, UInt8

from .._axes import field
from .._reduced import plain_spec
from ._four_bit import (
    NESTED_BLOCK_SIZE,
    NF4_CODE,
    dynamic_code,
    int4_quantize,
    nf4_quantize,
    pack_int4,
    quantize_blockwise,
    unfused,
)
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

    **Double quantisation** (NF4 only, bitsandbytes' `bnb_4bit_use_double_quant`,
    `quantize(..., double_quant=True)`): `scale` holds each block scale's uint8 code in
    bitsandbytes' signed 8-bit dynamic code book, `scale_absmax` the float32 absmax of each
    run of 256 scales (in torch's order, `[out, blocks]` flattened row by row, per layer)
    and `scale_offset` the mean taken out of the scales (per layer): a block scale is
    `code · absmax + offset`, as bitsandbytes' `dequantize_4bit` computes it, so 8 + 32/256
    bits per block instead of 32. The scale codes carry the weight's axes (sharded like
    it, gathered as uint8 under FSDP); the nested absmax and offset (4 bytes per 16,384
    weights at blocks of 64) are replicated, since bitsandbytes' runs of 256 do not line
    up with a shardable axis.
    """

    codes: UInt8[Array, "*layers packed out_features"] = field(axes=lambda self: (self.in_axis, self.out_axis))
    scale: Float[Array, "*layers blocks out_features"] | UInt8[Array, "*layers blocks out_features"] = field(
        axes=lambda self: (self.in_axis, self.out_axis)
    )
    bias: Float[Array, "*layers out_features"] | None = field(axes=lambda self: (self.out_axis,))
    scale_absmax: Float[Array, "*layers nested"] | None = field(axes=lambda self: (None,))
    scale_offset: Float[Array, "*layers"] | None = field(axes=lambda self: ())
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    kind: str = eqx.field(static=True)  # "nf4" or "int4"
    scale_code0: float = eqx.field(static=True)  # the value of scale code 0 (double quantisation)
    in_axis: str | None = eqx.field(static=True)
    out_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        codes: Integer[Array, "*layers packed out_features"],  # uint8, checked below with the fix
        scale: Float[Array, "*layers blocks out_features"] | UInt8[Array, "*layers blocks out_features"],
        bias: Float[Array, "*layers out_features"] | None = None,
        *,
        kind: str = "nf4",
        in_axis: str | None = "embed",
        out_axis: str | None = "mlp",
        scale_absmax: Float[Array, "*layers nested"] | None = None,
        scale_offset: Float[Array, "*layers"] | None = None,
        scale_code0: float = -1.0,
    ):
        """**Arguments:**

        - `codes`: uint8 `[*layers, in // 2, out]`, two 4-bit codes per byte.
        - `scale`: float `[*layers, in // block_size, out]`, each block's scale (NF4: its
          absmax; int4: absmax / 7); or, double-quantised (NF4), those scales' uint8 codes.
        - `bias`: `[*layers, out]` floating-point, or `None`.
        - `kind`: `"nf4"` or `"int4"`, what a code stands for.
        - `in_axis`, `out_axis`: logical axis names of the weight's two core dimensions.
        - `scale_absmax`, `scale_offset`: with uint8 `scale` codes (double quantisation),
          the float32 absmax of each run of 256 scales `[*layers, ceil(blocks · out / 256)]`
          and the offset `[*layers]`; else `None`.
        - `scale_code0`: the value of scale code 0. bitsandbytes' dynamic code book
          (`create_dynamic_map()`) starts at -0.99296875 and its CPU quantiser sets that
          entry to -1 (zoo's `dynamic_code()`): a checkpoint's `nested_quant_map` says which
          its codes stand for.
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
        _check_nested(kind, scale, scale_absmax, scale_offset)
        self.codes = codes
        self.scale = scale
        self.bias = bias
        self.scale_absmax = scale_absmax
        self.scale_offset = scale_offset
        self.scale_code0 = float(scale_code0)
        self.in_features, self.out_features = in_features, codes.shape[-1]
        self.block_size = in_features // scale.shape[-2]
        self.kind = kind
        self.in_axis = in_axis
        self.out_axis = out_axis

    @property
    def double_quant(self) -> bool:
        """Whether the block scales are stored as 8-bit codes (bitsandbytes' double quantisation)."""
        return self.scale_absmax is not None

    @property
    def float_dtype(self) -> Any:
        """The float dtype the layer stands for (its scales', float32 when they are codes)."""
        return self.scale_absmax.dtype if self.double_quant else self.scale.dtype

    @classmethod
    def quantize(
        cls, linear: Linear, kind: str = "nf4", *, block_size: int | None = None, double_quant: bool = False
    ) -> FourBitLinear:
        """`linear`'s weight in 4 bits (`kind` "nf4" or "int4", blocks of `block_size`
        input features: default 64 for NF4, bitsandbytes' default, and 128 for int4); its
        bias kept as it is. Works on a stacked `Linear` (`[*layers, in, out]`) too.
        `double_quant=True` (NF4) stores the block scales in 8 bits as bitsandbytes'
        `compress_statistics=True` does (`zoo.nn._four_bit.quantize_scales`, each layer
        alone; traced weights take the float32 mean as the offset).

        **Raises:** `ValueError` when `block_size` does not divide the input features (the
        message names the sizes that do), or for double quantisation of int4."""
        if kind not in LEVELS:
            raise ValueError(f"FourBitLinear.quantize: kind must be 'nf4' or 'int4', got {kind!r}")
        if double_quant and kind != "nf4":
            raise ValueError(
                f"FourBitLinear.quantize: double quantisation is NF4's (bitsandbytes'), not {kind}'s: use kind='nf4' "
                "or double_quant=False"
            )
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
        layer = cls(codes, scale, linear.bias, kind=kind, in_axis=linear.in_axis, out_axis=linear.out_axis)
        if not double_quant:
            return layer
        return layer.with_scales(*_double_quantize(scale))

    def with_scales(
        self,
        codes: UInt8[Array | np.ndarray, "*layers blocks out_features"],
        absmax: Float[Array | np.ndarray, "*layers nested"],
        offset: Float[Array | np.ndarray | np.float32, "*layers"],
        code0: float = -1.0,
    ) -> FourBitLinear:
        """This NF4 layer with its block scales double-quantised: `codes` (uint8, this
        layer's scale layout), the nested `absmax` and `offset` per layer (bitsandbytes'
        `state2.absmax` and `offset`, e.g. read from a checkpoint) and the value of scale
        code 0 (`code0`: its `state2.code[0]`)."""
        return FourBitLinear(
            self.codes,
            jnp.asarray(codes),
            self.bias,
            kind=self.kind,
            in_axis=self.in_axis,
            out_axis=self.out_axis,
            scale_absmax=jnp.asarray(absmax, jnp.float32),
            scale_offset=jnp.asarray(offset, jnp.float32),
            scale_code0=code0,
        )

    def block_scales(self) -> Float[Array, "*layers blocks out_features"]:
        """The float32 scale of every block (double-quantised ones dequantised, bit for bit
        as bitsandbytes' `dequantize_4bit` computes them)."""
        return _scales_jit(self.scale, self.nested_scales())

    def nested_scales(self) -> tuple[Array, Array, float] | None:
        """What double-quantised scale codes need besides themselves (`dequantize_codes`'s
        `nested`): the nested absmax, the offset and code 0's value; `None` for float scales."""
        return (self.scale_absmax, self.scale_offset, self.scale_code0) if self.double_quant else None

    def dequantized_weight(self, dtype: Any = jnp.float32) -> Float[Array, "*layers in_features out_features"]:
        """The float weight `[*layers, in, out]` the codes stand for, computed in float32
        (as bitsandbytes' `dequantize_4bit`) and returned in `dtype`: one compiled program
        per shape, not one per operation."""
        return _dequantize_codes_jit(self.codes, self.scale, self.kind, dtype, self.nested_scales())

    def dequantize(self, dtype: Any = None) -> Linear:
        """The float `Linear` this layer stands for (weight in `dtype`, default the
        scales', float32), the bias as it is: e.g. to merge LoRA branches into it."""
        return linear_from(
            self.dequantized_weight(self.float_dtype if dtype is None else dtype),
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
        codes, scale = (for_use(v, x, lead_ndim=x.ndim - 1) for v in (self.codes, self.scale))
        apply = functools.partial(_dequantized_product, self.kind)
        y = jax.checkpoint(apply, policy=jax.checkpoint_policies.nothing_saveable)(
            x, codes, scale, self.nested_scales()
        )
        if self.bias is not None:
            y = y + broadcast_like(self.bias.astype(y.dtype), y)
        return y


def _dequantized_product(kind: str, x: Array, codes: Array, scale: Any, nested: Any) -> Array:
    """`x @ W` with `W` the weight dequantised from `codes` and `scale` in `x`'s dtype
    (`FourBitLinear.__call__`, which remats it: a module-level function, not a closure the
    tests' runtime checks would decorate at every call)."""
    return project(x, dequantize_codes(codes, scale, kind, x.dtype, nested))


def dequantize_codes(
    codes: UInt8[Array, "*layers packed out"],
    scale: Float[Array, "*layers blocks out"] | UInt8[Array, "*layers blocks out"],
    kind: str,
    dtype: Any,
    nested: tuple[Float[Array, "*layers nested"], Float[Array, "*layers"], float | Float[Array, ""]] | None = None,
) -> Float[Array, "*layers in out"]:
    """The weight `[*layers, in, out]` 4-bit `codes` (two per byte along `in`) and their
    blocks' `scale` stand for, computed in float32 and returned in `dtype`. With `nested`
    (double quantisation: the nested absmax, offset and code 0's value), `scale` holds the scales' 8-bit
    codes, dequantised first (`block_scales`)."""
    # Frozen: no gradient, so no reduced typing either (free: a gathered reduced array holds
    # the same values everywhere); jax's gather (the code lookup) does not take reduced specs.
    codes = _plain(jax.lax.stop_gradient(codes))
    scale = _block_scales(scale, nested)
    *layers, packed, n_out = codes.shape
    blocks = scale.shape[-2]
    # Blocks apart ([..., blocks, per block, out]), then both nibbles of a byte side by side
    # ([..., blocks, per block, 2, out]) and merged into `in`: each reshape names its output
    # sharding (the input axis's split stays on the blocks), as explicit sharding asks.
    spec = None if sharding_spec(codes) is None else plain_spec(codes)
    split = None if spec is None else P(*spec[:-2], spec[-2], None, spec[-1])
    codes = codes.reshape(*layers, blocks, packed // blocks, n_out, out_sharding=split)
    scale = scale[..., :, None, :]
    high, low = (_levels(nibbles, kind) * scale for nibbles in (codes >> 4, codes & 0xF))
    w = jnp.stack([high, low], axis=-2)  # rows 2i (high nibble), 2i + 1 (low)
    return w.reshape(*layers, 2 * packed, n_out, out_sharding=spec).astype(dtype)


_dequantize_codes_jit = jax.jit(dequantize_codes, static_argnames=("kind", "dtype"))


def _block_scales(
    scale: Float[Array, "*layers blocks out"] | UInt8[Array, "*layers blocks out"],
    nested: tuple[Float[Array, "*layers nested"], Float[Array, "*layers"], float | Float[Array, ""]] | None,
) -> Float[Array, "*layers blocks out"]:
    """The float32 block scales: `scale` itself, or with `nested` (absmax, offset, code 0's
    value) its 8-bit codes' values, `dynamic_code()[code] · absmax[run] + offset`, where the run is that of
    bitsandbytes' flattened `[out, blocks]` (256 scales). Each product is computed where
    the codes lie, on their sharding: the nested absmax and offset are replicated, so each
    device looks up its own runs (a constant index), no collective."""
    scale = _plain(jax.lax.stop_gradient(scale))
    if nested is None:
        return scale.astype(jnp.float32)
    absmax, offset = (_plain(jax.lax.stop_gradient(v)).astype(jnp.float32) for v in nested[:2])
    *_, blocks, n_out = scale.shape
    runs = (np.arange(n_out)[None, :] * blocks + np.arange(blocks)[:, None]) // NESTED_BLOCK_SIZE  # torch's order
    spec = None if sharding_spec(scale) is None else plain_spec(scale)
    run_absmax = jnp.take(absmax, jnp.asarray(runs, jnp.int32), axis=-1)  # [*layers, blocks, out], replicated
    table = jnp.asarray(dynamic_code()).at[0].set(jnp.asarray(nested[2], jnp.float32))
    q = scale.astype(jnp.int32)
    if spec is None:
        values = table[q]
    else:  # a replicated table looked up by split codes, and the runs' absmax cut as the codes are: no collective
        values, run_absmax = table.at[q].get(out_sharding=spec), jax.reshard(run_absmax, spec)
    # Rounded once each, as bitsandbytes computes them (not one multiply-add).
    return unfused(jnp.isfinite(offset), lambda: values * run_absmax) + offset[..., None, None]


_scales_jit = jax.jit(_block_scales)  # code 0's value (a float) is traced: one program for both


def _double_quantize(scale: Array) -> tuple[Array, Array, Array]:
    """The 8-bit codes `[*layers, blocks, out]`, nested absmax `[*layers, runs]` and offset
    `[*layers]` of float block scales, each layer's quantised as bitsandbytes quantises its
    `[out, blocks]` absmax (`quantize_scales`: the offset the exact mean rounded once, taken
    on the host; traced scales, e.g. under `jax.eval_shape`, take the float32 mean, which
    may differ in its last bit). One compiled program for all layers."""
    *layers, blocks, n_out = scale.shape
    rows = jnp.swapaxes(jnp.asarray(scale, jnp.float32).reshape(-1, blocks, n_out), -1, -2)  # torch's [out, blocks]
    if isinstance(scale, jax.core.Tracer):
        offset = jnp.mean(rows.reshape(rows.shape[0], -1), axis=-1)
    else:
        exact = np.mean(np.asarray(jax.device_get(rows), np.float64).reshape(rows.shape[0], -1), axis=-1)
        offset = jnp.asarray(exact.astype(np.float32))
    codes, absmax = _nested_codes(rows, offset)
    return codes.reshape(scale.shape), absmax.reshape(*layers, -1), offset.reshape(layers)


@jax.jit
def _nested_codes(
    rows: Float[Array, "layers out blocks"], offset: Float[Array, " layers"]
) -> tuple[UInt8[Array, "layers blocks out"], Float[Array, "layers runs"]]:
    """Each layer's scales less its offset, quantised by bitsandbytes' 8-bit blockwise
    quantiser in runs of 256 over the flattened `[out, blocks]`; the codes back in zoo's
    `[blocks, out]`."""

    def one(layer: Array, mean: Array) -> tuple[Array, Array]:
        return quantize_blockwise(layer.reshape(-1) - mean, dynamic_code(), NESTED_BLOCK_SIZE)

    codes, absmax = jax.vmap(one)(rows, offset)
    return jnp.swapaxes(codes.reshape(rows.shape), -1, -2), absmax


def _check_nested(kind: str, scale: Array, absmax: Array | None, offset: Array | None) -> None:
    """A double-quantised layer's fields fit each other (uint8 scale codes of an NF4 layer,
    one absmax per 256 scales and one offset per layer), or it has none."""
    if absmax is None and offset is None and scale.dtype != jnp.uint8:
        return
    *layers, blocks, n_out = scale.shape
    runs = -(-blocks * n_out // NESTED_BLOCK_SIZE)
    if (
        kind != "nf4"
        or scale.dtype != jnp.uint8
        or absmax is None
        or offset is None
        or tuple(absmax.shape) != (*layers, runs)
        or tuple(offset.shape) != tuple(layers)
    ):
        raise ValueError(
            f"FourBitLinear: double-quantised scales are an NF4 layer's uint8 scale codes [*layers, blocks, out] with "
            f"scale_absmax [*layers, {runs}] and scale_offset [*layers] (got kind {kind!r}, scale {scale.dtype} "
            f"{tuple(scale.shape)}, scale_absmax {None if absmax is None else tuple(absmax.shape)}, scale_offset "
            f"{None if offset is None else tuple(offset.shape)}): build one with FourBitLinear.quantize(linear, 'nf4', "
            "double_quant=True)"
        )


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
