"""4-bit weights (issue 46's first piece): zoo's NF4 against bitsandbytes' own CPU
quantiser byte for byte (codes, scales, double-quantised scales, dequantised weights; the
double-quantised `FourBitLinear` too), and int4 per group within half a step."""

from __future__ import annotations

import bitsandbytes.functional as bnb
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from zoo.nn import FourBitLinear, Linear
from zoo.nn._four_bit import (
    NF4_CODE,
    dequantize_scales,
    dynamic_code,
    int4_dequantize,
    int4_quantize,
    nf4_dequantize,
    nf4_quantize,
    pack_int4,
    quantize_blockwise,
    quantize_scales,
    unpack_int4,
)
from zoo.nn._four_bit_linear import dequantize_codes

# Random and real-shaped matrices ([out, in], as torch holds a Linear's weight), block sizes
# bitsandbytes takes; one block all zeros (a pruned row's start).
SHAPES = [((128, 64), 64), ((48, 256), 64), ((96, 512), 128), ((256, 2048), 64), ((64, 4096), 256)]


def _weight(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[0, :64] = 0.0
    w[1, 3] = 0.4  # an outlier: its block's other values fall on few levels
    return w


def test_the_code_books_are_bitsandbytes():
    assert np.array_equal(NF4_CODE, bnb.get_4bit_type("nf4", device="cpu").numpy())
    theirs = bnb.create_dynamic_map().numpy().copy()
    theirs[0] = -1.0  # as its CPU quantiser leaves the cached map (it sets the first entry)
    assert np.array_equal(dynamic_code(), theirs)


@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_nf4_codes_scales_and_weights_equal_bitsandbytes(shape, block):
    w = _weight(shape)
    packed, state = bnb.quantize_4bit(torch.from_numpy(w), blocksize=block, quant_type="nf4")
    codes, absmax = nf4_quantize(jnp.asarray(w), block)
    assert codes.dtype == jnp.uint8 and codes.shape == (shape[0], shape[1] // 2)
    np.testing.assert_array_equal(np.asarray(codes).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(absmax).reshape(-1), state.absmax.numpy())
    theirs = bnb.dequantize_4bit(packed, state).numpy()
    np.testing.assert_array_equal(np.asarray(nf4_dequantize(codes, absmax)), theirs)
    assert np.array_equal(np.asarray(nf4_dequantize(codes, absmax, jnp.bfloat16)).astype(np.float32),
                          theirs.astype(np.float32).astype(jnp.bfloat16).astype(np.float32))  # fmt: skip


@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_double_quantised_scales_read_as_bitsandbytes_reads_them(shape, block):
    """A bitsandbytes state with `compress_statistics` (as transformers saves QLoRA bases):
    zoo dequantises its stored codes, nested scales and offset to bitsandbytes' weights bit
    for bit. zoo's own double quantisation takes the nearest code where bitsandbytes'
    approximate search does: equal wherever bitsandbytes' choice is the nearest."""
    w = _weight(shape, seed=1)
    packed, state = bnb.quantize_4bit(torch.from_numpy(w), blocksize=block, quant_type="nf4", compress_statistics=True)
    codes, absmax = nf4_quantize(jnp.asarray(w), block)
    offset = jnp.float32(state.offset.item())
    scales = dequantize_scales(jnp.asarray(state.absmax.numpy()).reshape(absmax.shape),
                               jnp.asarray(state.state2.absmax.numpy()), offset)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(nf4_dequantize(codes, scales)), bnb.dequantize_4bit(packed, state).numpy())
    # Quantising the scales with bitsandbytes' offset: its codes and nested absmax.
    values = np.asarray(absmax).reshape(-1) - np.float32(state.offset.item())
    ours, nested = quantize_blockwise(jnp.asarray(values), dynamic_code(), 256)
    np.testing.assert_array_equal(np.asarray(nested), state.state2.absmax.numpy())
    ours, theirs, code = np.asarray(ours), state.absmax.numpy(), dynamic_code()
    normed = values / np.repeat(np.asarray(nested), 256)[: values.size]
    distance = lambda q: np.abs(normed - code[q.astype(np.int64)])  # noqa: E731
    assert np.all(distance(ours) <= distance(theirs))  # ours is the nearest level
    nearest = distance(theirs) <= distance(ours)
    np.testing.assert_array_equal(ours[nearest], theirs[nearest])
    assert np.all(np.abs(ours.astype(int) - theirs.astype(int)) <= 1)  # elsewhere its next code
    # zoo's own offset: the exact mean rounded once; the weights within one step of the scale's 8-bit code.
    c, n, off = quantize_scales(absmax)
    # torch sums the float32 scales in an order that depends on the CPU's vector width:
    # a pairwise sum of n non-negative terms is within ceil(log2 n) ulp of the exact one.
    bound = (np.ceil(np.log2(absmax.size)) + 1) * np.spacing(np.float32(state.offset.item()))
    assert abs(float(off) - state.offset.item()) <= bound
    back = np.asarray(dequantize_scales(c, n, off))
    step = np.repeat(np.asarray(n), 256)[: back.size].reshape(back.shape) * np.max(np.diff(code))
    assert np.all(np.abs(back - np.asarray(absmax)) <= step)


def _bnb_state(layer, shape, block):
    """bitsandbytes' `QuantState` of a double-quantised `FourBitLinear` (one layer, zoo's
    `[blocks, out]` scales transposed to torch's order), its nested code book zoo's."""
    return bnb.QuantState(
        absmax=torch.from_numpy(np.asarray(layer.scale).T.reshape(-1).copy()), shape=torch.Size(shape),
        code=torch.from_numpy(NF4_CODE.copy()), blocksize=block, quant_type="nf4", dtype=torch.float32,
        offset=torch.tensor(float(layer.scale_offset)),
        state2=bnb.QuantState(absmax=torch.from_numpy(np.asarray(layer.scale_absmax).copy()),
                              code=torch.from_numpy(dynamic_code().copy()), blocksize=256, dtype=torch.float32),
    )  # fmt: skip


@pytest.mark.parametrize(("shape", "block"), SHAPES[1:4])
def test_double_quantised_layer_is_bitsandbytes_dequantize_4bit(shape, block):
    """`FourBitLinear.quantize(..., double_quant=True)` stores the scales as bitsandbytes'
    nested state (uint8 codes, an absmax per 256 scales, the offset): its dequantised weight
    is what `dequantize_4bit` makes of that state, bit for bit (each scale's code x absmax
    rounded before the offset is added, as bitsandbytes does: XLA would fuse them into one
    multiply-add). bitsandbytes' own state (`compress_statistics=True`, its code book's
    first entry as it holds it) in a `FourBitLinear` dequantises to its weights bit for bit."""
    w = _weight(shape, seed=3)
    linear = eqx.tree_at(lambda m: m.weight, Linear(shape[1], shape[0], key=jax.random.key(0)), jnp.asarray(w.T))
    layer = FourBitLinear.quantize(linear, "nf4", block_size=block, double_quant=True)
    blocks = shape[1] // block
    assert layer.double_quant and layer.scale.dtype == jnp.uint8 and layer.scale.shape == (blocks, shape[0])
    assert layer.scale_absmax.shape == (-(-blocks * shape[0] // 256),) and layer.scale_offset.shape == ()
    codes, absmax = nf4_quantize(jnp.asarray(w), block)
    np.testing.assert_array_equal(np.asarray(layer.codes).T, np.asarray(codes))
    want = quantize_scales(absmax)  # zoo's double quantisation, scale for scale
    np.testing.assert_array_equal(np.asarray(layer.scale).T, np.asarray(want[0]))
    np.testing.assert_array_equal(layer.scale_absmax, want[1])
    theirs = bnb.dequantize_4bit(torch.from_numpy(np.asarray(codes).reshape(-1, 1)), _bnb_state(layer, shape, block))
    np.testing.assert_array_equal(np.asarray(layer.dequantized_weight()).T, theirs.numpy())
    np.testing.assert_array_equal(np.asarray(layer.block_scales()).T, np.asarray(dequantize_scales(*want)))
    # The suite compiles at XLA optimisation level 0 (tests/conftest.py), which fuses no
    # multiply-add; programs as users compile them (level 2) would: bit for bit there too.
    optimised = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
    weight = jax.jit(dequantize_codes, static_argnames=("kind", "dtype"), compiler_options=optimised)
    got = weight(layer.codes, layer.scale, "nf4", jnp.float32, layer.nested_scales())
    np.testing.assert_array_equal(np.asarray(got).T, theirs.numpy())
    scales = jax.jit(dequantize_scales, compiler_options=optimised)(*want)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(layer.block_scales()).T)
    # bitsandbytes' state, read into the layer.
    packed, state = bnb.quantize_4bit(torch.from_numpy(w), blocksize=block, quant_type="nf4", compress_statistics=True)
    read = FourBitLinear(
        layer.codes, jnp.asarray(state.absmax.numpy().reshape(shape[0], blocks).T), kind="nf4",
        scale_absmax=jnp.asarray(state.state2.absmax.numpy()), scale_offset=jnp.float32(state.offset.item()),
        scale_code0=float(state.state2.code[0]),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(read.dequantized_weight()).T, bnb.dequantize_4bit(packed, state).numpy())
    # 8 bits per block instead of 32: a third less than float32 scales at blocks of 64.
    plain = FourBitLinear.quantize(linear, "nf4", block_size=block)
    nbytes = lambda m: sum(x.nbytes for x in jax.tree.leaves(m) if x is not m.bias)  # noqa: E731
    assert nbytes(layer) == w.size // 2 + w.size // block + 4 * layer.scale_absmax.size + 4
    assert nbytes(plain) == w.size // 2 + 4 * w.size // block
    with pytest.raises(ValueError, match="double quantisation is NF4's.*not int4's"):
        FourBitLinear.quantize(linear, "int4", double_quant=True)
    with pytest.raises(
        ValueError, match=r"uint8 scale codes .*scale_absmax \[\*layers, \d+\] .*scale_absmax None, scale_offset None\)"
    ):
        FourBitLinear(layer.codes[:, :16], layer.scale[:, :16], kind="nf4")


@pytest.mark.parametrize("group", [32, 128])
def test_int4_per_group_is_within_half_a_step_and_packs_two_per_byte(group):
    w = _weight((64, 256), seed=2)
    q, scale = int4_quantize(jnp.asarray(w), group)
    assert q.dtype == jnp.int8 and int(jnp.max(jnp.abs(q))) <= 7 and scale.shape == (64, 256 // group)
    back = np.asarray(int4_dequantize(q, scale))
    half = np.repeat(np.asarray(scale), group, axis=1) / 2
    assert np.all(np.abs(back - w) <= half * (1 + 1e-6))
    packed = pack_int4(q)
    assert packed.dtype == jnp.uint8 and packed.shape == (64, 128)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), np.asarray(q))


def test_a_matrix_that_does_not_split_into_blocks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"multiple of the block size 64 .*got shape \(4, 96\)"):
        nf4_quantize(jnp.zeros((4, 96)), 64)
