"""4-bit weights: NF4 as bitsandbytes stores it (blockwise absmax over its code book, two
codes per byte, the scales optionally quantised again to 8 bits) and symmetric int4 per
group. Pure functions on `[rows, cols]` matrices in torch's `nn.Linear` orientation
(`[out, in]`: the blocks run along `in`, as bitsandbytes flattens a weight row by row), each
one compiled program per shape (`jax.jit`), not one per operation."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int8, UInt8

# bitsandbytes' NF4 code book (the normal-float levels of QLoRA), sorted.
NF4_CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)  # fmt: skip
NF4_BOUNDS = ((NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)).astype(np.float32)
NESTED_BLOCK_SIZE = 256  # bitsandbytes' block for the 8-bit quantised scales


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32 on the CPU: a float32 step; the first half counted from
    `start`, the second from `end`, each value one fused multiply-add (one rounding)."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64(np.float32((end32 - start32) / np.float32(steps - 1)))
    i = np.arange(steps)
    out = np.where(i < steps // 2, np.float64(start32) + step * i, np.float64(end32) - step * (steps - 1 - i))
    return out.astype(np.float32)


@functools.cache
def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic code book (`create_dynamic_map()`, 256 sorted
    float32 values), as its CPU quantiser leaves it: the first value set to -1."""
    data = []
    for i in range(7):  # max_exponent_bits 7 of 8 bits, signed
        bounds = _linspace_f32(0.1, 1.0, 2**i + 1)
        means = ((bounds[:-1] + bounds[1:]) / np.float32(2)).astype(np.float32)
        scale = np.float32(10.0 ** (i - 6))
        data += [scale * means, -scale * means]
    code = np.sort(np.concatenate([*data, np.array([0.0, 1.0], np.float32)]).astype(np.float32))
    code[0] = -1.0
    code.setflags(write=False)
    return code


def _check_blocks(shape: tuple[int, ...], block_size: int, what: str) -> None:
    if len(shape) != 2 or shape[1] % block_size or block_size % 2:
        raise ValueError(
            f"{what} quantises a [rows, cols] matrix whose cols are a multiple of the block size {block_size} (an "
            f"even number), got shape {tuple(shape)}: pick a block size that divides {shape[-1]}"
        )


@functools.partial(jax.jit, static_argnames=("block_size",))
def nf4_quantize(
    weight: Float[Array, "rows cols"], block_size: int = 64
) -> tuple[UInt8[Array, "rows half"], Float[Array, "rows blocks"]]:
    """NF4 codes of `weight` as `bitsandbytes.functional.quantize_4bit(quant_type="nf4")`
    makes them: each block of `block_size` values along a row scaled by its absmax,
    rounded to the nearest NF4 level (ties to the lower one).

    **Returns:** `(codes, absmax)`: uint8 `[rows, cols // 2]` (the first of two values in
    the high nibble) and float32 `[rows, cols // block_size]`."""
    _check_blocks(weight.shape, block_size, "nf4_quantize")
    rows, cols = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, cols // block_size, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    # bitsandbytes multiplies by the reciprocal (1 / absmax, an all-zero block's values stay 0);
    # XLA flushes subnormals, so its 1e-38 floor is a `where` here.
    inverse = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    scaled = jnp.clip(blocks * inverse[..., None], -1.0, 1.0)
    q = jnp.searchsorted(jnp.asarray(NF4_BOUNDS), scaled.reshape(rows, cols), side="left").astype(jnp.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2], absmax


@functools.partial(jax.jit, static_argnames=("dtype",))
def nf4_dequantize(
    codes: UInt8[Array, "rows half"], absmax: Float[Array, "rows blocks"], dtype=jnp.float32
) -> Float[Array, "rows cols"]:
    """The weight NF4 `codes` and their blocks' `absmax` stand for, in `dtype` (computed
    in float32, as bitsandbytes' `dequantize_4bit`)."""
    rows = codes.shape[0]
    q = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(rows, -1)
    levels = jnp.asarray(NF4_CODE)[q.astype(jnp.int32)]
    block_size = q.shape[1] // absmax.shape[1]
    out = levels.reshape(rows, absmax.shape[1], block_size) * absmax.astype(jnp.float32)[..., None]
    return out.reshape(rows, -1).astype(dtype)


def quantize_scales(
    absmax: Float[Array, "*shape"],
) -> tuple[UInt8[Array, "*shape"], Float[Array, " nested"], Float[Array, ""]]:
    """bitsandbytes' double quantisation of NF4 scales (`compress_statistics=True`): the
    mean `offset` taken out, the rest quantised by its 8-bit CPU quantiser in blocks of
    256 over the flattened scales (divided by the block's absmax, the nearest value of
    `dynamic_code()`, ties to the lower). bitsandbytes finds the nearest with an approximate
    search that, for a few values in a thousand, takes the second nearest; this takes the
    nearest always (its scales are at least as close).

    The offset is the float32 rounding of the exact mean (summed in float64); torch's
    float32 sum, which bitsandbytes uses, depends on the CPU's vector width, so the offset
    may differ from it in its last bit. Runs on the host (concrete arrays, as when a
    model is quantised while loading). **Returns:** `(codes, nested_absmax, offset)`."""
    flat = absmax.astype(jnp.float32).reshape(-1)
    offset = jnp.asarray(np.float32(np.mean(np.asarray(flat, dtype=np.float64))), jnp.float32)  # on the host
    codes, nested = quantize_blockwise(flat - offset, dynamic_code(), NESTED_BLOCK_SIZE)
    return codes.reshape(absmax.shape), nested, offset


@jax.jit
def dequantize_scales(
    codes: UInt8[Array, "*shape"], nested_absmax: Float[Array, " nested"], offset: Float[Array, ""]
) -> Float[Array, "*shape"]:
    """The NF4 scales double-quantised `codes` stand for (`quantize_scales`'s inverse, as
    bitsandbytes' `dequantize_4bit` computes them: code x block absmax, then + offset, each
    rounded)."""
    offset = offset.astype(jnp.float32)
    flat = unfused(
        jnp.isfinite(offset),
        lambda: dequantize_blockwise(codes.reshape(-1), nested_absmax, dynamic_code(), NESTED_BLOCK_SIZE),
    )
    return (flat + offset).reshape(codes.shape)


def unfused(finite: Array, product: Callable[[], Array]) -> Array:
    """`product()`, rounded on its own before what is added to it, as bitsandbytes rounds
    a scale's `code · absmax` before adding the offset. XLA fuses a product and a sum into
    one multiply-add (a different last bit) and drops optimisation barriers on the CPU; a
    branch on the data is the boundary it keeps (`finite` false: NaN, which the sum with a
    non-finite offset would be anyway)."""
    return jax.lax.cond(jnp.all(finite), product, lambda: jnp.full_like(product(), jnp.nan))


@functools.partial(jax.jit, static_argnames=("block_size",))
def quantize_blockwise(
    values: Float[Array, " n"], code: Float[np.ndarray | Array, " levels"], block_size: int
) -> tuple[UInt8[Array, " n"], Float[Array, " blocks"]]:
    """bitsandbytes' 8-bit blockwise quantiser on the CPU: per block of `block_size` (the
    last may be shorter) its absmax; each value divided by it, then the code book's
    nearest entry (the lower of two at equal distance). Returns `(codes, absmax)`."""
    n = values.shape[0]
    pad = -n % block_size
    blocks = jnp.pad(values.astype(jnp.float32), (0, pad)).reshape(-1, block_size)
    valid = (jnp.arange(n + pad) < n).reshape(-1, block_size)
    absmax = jnp.max(jnp.where(valid, jnp.abs(blocks), -jnp.inf), axis=-1)
    normed = (blocks / absmax[:, None]).reshape(-1)[:n]
    table = jnp.asarray(code)
    left = jnp.clip(jnp.searchsorted(table, normed, side="right") - 1, 0, len(code) - 1)
    right = jnp.minimum(left + 1, len(code) - 1)
    closer = jnp.abs(normed - table[right]) < jnp.abs(normed - table[left])
    return jnp.where(closer, right, left).astype(jnp.uint8), absmax


@functools.partial(jax.jit, static_argnames=("block_size",))
def dequantize_blockwise(
    codes: UInt8[Array, " n"],
    absmax: Float[Array, " blocks"],
    code: Float[np.ndarray | Array, " levels"],
    block_size: int,
) -> Float[Array, " n"]:
    """`quantize_blockwise`'s inverse: each code's value times its block's absmax (float32)."""
    n = codes.shape[0]
    scale = jnp.repeat(absmax.astype(jnp.float32), block_size)[:n]
    return jnp.asarray(code)[codes.astype(jnp.int32)] * scale


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_quantize(
    weight: Float[Array, "rows cols"], group_size: int = 128
) -> tuple[Int8[Array, "rows cols"], Float[Array, "rows groups"]]:
    """Symmetric int4 per group of `group_size` values along a row: `scale = absmax / 7`,
    `q = round(w / scale)` in [-7, 7] (so `q · scale` is within half a step of `w`).

    **Returns:** `(q, scale)`: int8 `[rows, cols]` holding the 4-bit values (pack them with
    `pack_int4`) and float32 `[rows, cols // group_size]`."""
    _check_blocks(weight.shape, group_size, "int4_quantize")
    rows, cols = weight.shape
    groups = weight.astype(jnp.float32).reshape(rows, cols // group_size, group_size)
    absmax = jnp.max(jnp.abs(groups), axis=-1)
    scale = jnp.where(absmax > 0, absmax / 7.0, 1.0)
    q = jnp.clip(jnp.round(groups / scale[..., None]), -7, 7).astype(jnp.int8)
    return q.reshape(rows, cols), scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def int4_dequantize(
    q: Int8[Array, "rows cols"], scale: Float[Array, "rows groups"], dtype=jnp.float32
) -> Float[Array, "rows cols"]:
    """The weight int4 values `q` and their groups' `scale` stand for, in `dtype`."""
    rows, cols = q.shape
    out = q.astype(jnp.float32).reshape(rows, scale.shape[1], -1) * scale.astype(jnp.float32)[..., None]
    return out.reshape(rows, cols).astype(dtype)


@jax.jit
def pack_int4(q: Int8[Array, "rows cols"]) -> UInt8[Array, "rows half"]:
    """Two int4 values per byte (two's complement nibbles, the first in the high one)."""
    nibbles = q.astype(jnp.uint8) & 0xF
    return (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]


@jax.jit
def unpack_int4(packed: UInt8[Array, "rows half"]) -> Int8[Array, "rows cols"]:
    """`pack_int4`'s inverse."""
    nibbles = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(packed.shape[0], -1).astype(jnp.int8)
    return jnp.where(nibbles > 7, nibbles - 16, nibbles).astype(jnp.int8)
