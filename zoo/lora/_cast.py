"""Storing the frozen base of a LoRA model in a narrower dtype: bfloat16, float16 or int8."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._tree import node_at
from ..nn import QuantizedLinear, dequantize
from ._apply import ADAPTED, modules, trainable
from ._config import LoraConfig
from ._layer import LoraLinear


def cast_frozen(model: Any, dtype: Any = jnp.bfloat16, *, config: LoraConfig | None = None) -> Any:
    """The model with its frozen leaves stored in `dtype` (default bfloat16), or in int8.

    The leaves `zoo.lora.trainable(model, config)` marks trainable — every `lora_A` /
    `lora_B` and the `config.modules_to_save` modules — keep their dtype (float32); the
    rest (base weights and biases, embeddings, norms, a frozen head) are cast. Frozen
    leaves get no gradient and are never communicated, so the step's collectives are
    unchanged; their resident bytes halve (a quarter for int8 weights). Compute is not
    narrowed: every zoo layer casts a weight to its activation's dtype where it is used
    (`zoo.nn.project`, the norms), so a float32 model computes in float32 from rounded
    weights; set the config's `dtype` to `"bfloat16"` for bfloat16 compute as well.
    Casting keeps each leaf's sharding.

    `dtype=jnp.int8` stores the base `Linear` of every (unmerged) LoRA branch as a
    `zoo.nn.QuantizedLinear` (int8 weight, one float32 scale per output channel: an error
    of at most absmax/254 per channel) and every other frozen floating leaf (embeddings,
    norms, biases, a frozen head) in bfloat16. Casting such a model to a floating dtype
    dequantises its `QuantizedLinear` layers first (`cast_frozen(model, jnp.float32)`
    gives back float weights).

    **Arguments:**

    - `model`: a model with LoRA branches (`zoo.lora.add_lora`).
    - `dtype`: the storage dtype of the frozen leaves: a floating-point dtype, or int8.
    - `config`: the `LoraConfig` the branches were added with (its `modules_to_save` stay
      trainable and uncast); `None` keeps only the branches.

    **Returns:** the model with the frozen leaves cast; train it with
    `zoo.TrainStep(..., trainable=zoo.lora.trainable(model, config))`.
    """
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"cast_frozen: {dtype!r} is not a dtype; use jnp.bfloat16, jnp.float16 or jnp.int8") from e
    quantize = dtype == jnp.int8
    if not quantize and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"cast_frozen stores the frozen base in a floating-point dtype or int8, got {dtype}; "
            "use jnp.bfloat16, jnp.float16 or jnp.int8 (int8 is the only integer storage zoo quantises to)"
        )
    if not modules(model, ADAPTED):
        raise ValueError(
            "cast_frozen found no LoRA branches in the model: add them first with "
            "zoo.lora.add_lora(model, config, key=...), or the whole model would be frozen"
        )
    found = modules(model, LoraLinear)
    if quantize and any(node_at(model, p).merged for p, _ in found.values()):
        raise ValueError(
            "cast_frozen(model, jnp.int8) cannot quantise a base that holds a merged LoRA branch: "
            "unmerge the model first (zoo.lora.unmerge)"
        )
    model = dequantize(model)  # int8 layers back to float32; re-quantising them is exact
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
    paths = [p for p, _ in found.values() if not node_at(keep, p).base.weight]

    def quantized(path):
        layer = QuantizedLinear.quantize(node_at(model, path).base)
        bias = node_at(cast, path).base.bias
        return layer if bias is None else eqx.tree_at(lambda q: q.bias, layer, bias)

    return eqx.tree_at(lambda m: [node_at(m, p).base for p in paths], cast, replace=[quantized(p) for p in paths])
