"""Storing the frozen base of a LoRA model in a narrower dtype: bfloat16, float16, int8, or 4 bits
(NF4, int4: QLoRA)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._tree import dotted_name, node_at
from ..nn import dequantize
from ..nn._quantized import quantize_kind, quantizer, stack_projections
from ._apply import ADAPTED, modules, trainable
from ._config import LoraConfig
from ._layer import LoraLinear
from ._multi_linear import MultiLoraLinear


def cast_frozen(
    model: Any, dtype: Any = jnp.bfloat16, *, config: LoraConfig | None = None, block_size: int | None = None
) -> Any:
    """The model with its frozen leaves stored in `dtype` (default bfloat16), or in int8, NF4 or int4.

    The leaves `zoo.lora.trainable(model, config)` marks trainable — every `lora_A` /
    `lora_B` and the `config.modules_to_save` modules — keep their dtype (float32); the
    rest (base weights and biases, embeddings, norms, a frozen head) are cast. Frozen
    leaves get no gradient and are never communicated, so the step's collectives are
    unchanged; their resident bytes halve (a quarter for int8 weights). Compute is not
    narrowed: every zoo layer casts a weight to its activation's dtype where it is used
    (`zoo.nn.project`, the norms), so a float32 model computes in float32 from rounded
    weights; set the config's `dtype` to `"bfloat16"` for bfloat16 compute as well.
    Casting keeps each leaf's sharding.

    `dtype=jnp.int8` stores every frozen projection of the layer stack, adapted or not
    (what `zoo.hf.from_pretrained(quantize=)` and bitsandbytes' QLoRA quantise), and the
    base `Linear` of every (unmerged) LoRA branch (a `LoraLinear`, or the
    `MultiLoraLinear` of several named adapters) as a `zoo.nn.QuantizedLinear` (int8
    weight, one float32 scale per output channel: an error of at most absmax/254 per
    channel), and every other frozen floating leaf (embeddings, norms, biases, a frozen
    head) in bfloat16. Casting such a model to a floating dtype dequantises its
    `QuantizedLinear` layers first (`cast_frozen(model, jnp.float32)`
    gives back float weights).

    `dtype="nf4"` or `"int4"` (QLoRA) stores those `Linear`s as `zoo.nn.FourBitLinear`
    (4-bit codes, one float32 scale per block of `block_size` input features: NF4 as
    bitsandbytes stores it, blocks of 64 by default; int4 symmetric per group, 128 by
    default), the other frozen floating leaves in bfloat16, as for int8.

    **Arguments:**

    - `model`: a model with LoRA branches (`zoo.lora.add_lora`; several named adapters:
      `zoo.lora.stack_adapters`, `load_adapters`).
    - `dtype`: the storage dtype of the frozen leaves: a floating-point dtype, int8, or
      `"nf4"` / `"int4"`; the text forms `RunConfig.quantize` and `--quantize` take are
      read too (`"int8"`, `"nf4:32"`: a 4-bit block of 32; `"nf4:dq"` / `"nf4:32:dq"`:
      NF4's block scales in 8 bits, bitsandbytes' double quantisation).
    - `block_size`: with `"nf4"` / `"int4"`, the input features per scale (default 64 /
      128; it must divide every quantised layer's input features).
    - `config`: the `LoraConfig` the branches were added with (its `modules_to_save` stay
      trainable and uncast); `None` keeps only the branches.

    **Returns:** the model with the frozen leaves cast; train it with
    `zoo.TrainStep(..., trainable=zoo.lora.trainable(model, config))`.
    """
    dtype, four_bit, block_size, double_quant = _storage(dtype, block_size)
    quantize = four_bit is not None or dtype == jnp.int8
    if not quantize and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"cast_frozen stores the frozen base in a floating-point dtype, int8 or 4 bits, got {dtype}; "
            "use jnp.bfloat16, jnp.float16, jnp.int8, 'nf4' or 'int4'"
        )
    if not modules(model, ADAPTED):
        raise ValueError(
            "cast_frozen found no LoRA branches in the model: add them first with "
            "zoo.lora.add_lora(model, config, key=...), or the whole model would be frozen"
        )
    found = modules(model, (LoraLinear, MultiLoraLinear))  # one adapter, or several named ones
    if quantize and any(node_at(model, p).merged for p, _ in found.values()):
        raise ValueError(
            f"cast_frozen(model, {four_bit or 'jnp.int8'!s}) cannot quantise a base that holds a merged LoRA branch: "
            "unmerge the model first (zoo.lora.unmerge)"
        )
    model = dequantize(model)  # int8 / 4-bit layers back to float32; re-quantising them is exact
    keep = trainable(model, config)
    storage = jnp.dtype(jnp.bfloat16) if quantize else dtype

    def one(leaf, train):
        if train or not eqx.is_inexact_array(leaf) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return leaf.astype(storage)

    cast = jax.tree.map(one, model, keep)
    if not quantize:
        return cast
    # Quantise from the float weights (not their bfloat16 copies); the biases as cast above.
    # Every frozen projection of the layer stack, adapted or not (as loading with quantize=
    # and bitsandbytes' QLoRA store the base), and an adapted layer's base outside it.
    bases = [(*path, jax.tree_util.GetAttrKey("base")) for path, _ in found.values()]
    paths = list(dict.fromkeys([*stack_projections(model), *bases]))
    paths = [p for p in paths if not node_at(keep, p).weight]

    def quantized(path):
        try:  # the quantiser loading uses too (zoo.hf.from_pretrained(quantize=))
            layer = quantizer(four_bit or "int8", block_size, double_quant)(node_at(model, path))
        except ValueError as e:
            raise ValueError(f"cast_frozen(model, {four_bit or 'int8'!r}) at {dotted_name(path)}: {e}") from None
        bias = node_at(cast, path).bias
        return layer if bias is None else eqx.tree_at(lambda q: q.bias, layer, bias)

    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], cast, replace=[quantized(p) for p in paths])


def _storage(dtype: Any, block_size: int | None) -> tuple[Any, str | None, int | None, bool]:
    """`cast_frozen`'s `dtype` and `block_size` read: `(dtype, "nf4" | "int4" | None, block,
    double quantisation)`, the text form ("nf4:32", "nf4:32:dq") split. **Raises:**
    `ValueError` naming what to give."""
    four_bit, double_quant = None, False
    if isinstance(dtype, str) and dtype.partition(":")[0] in ("nf4", "int4"):  # "nf4", or the text form "nf4:32"
        try:
            four_bit, block, double_quant = quantize_kind(dtype)
        except ValueError as e:
            raise ValueError(f"cast_frozen: {e}") from None
        if block is not None and block_size is not None:
            raise ValueError(f"cast_frozen: {dtype!r} gives the block already; drop block_size={block_size}")
        block_size = block_size if block is None else block
    if four_bit is None:
        try:
            dtype = jnp.dtype(dtype)
        except TypeError as e:
            raise ValueError(
                f"cast_frozen: {dtype!r} is not a dtype; use jnp.bfloat16, jnp.float16, jnp.int8, 'nf4' or 'int4'"
            ) from e
    elif block_size is not None and (block_size < 2 or block_size % 2):
        raise ValueError(f"cast_frozen: block_size must be an even number >= 2, got {block_size}")
    if block_size is not None and four_bit is None:
        raise ValueError(f"cast_frozen: block_size is for dtype 'nf4' or 'int4', not {dtype}")
    return dtype, four_bit, block_size, double_quant
