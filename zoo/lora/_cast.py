"""Storing the frozen base of a LoRA model in a narrower float dtype."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._apply import modules, trainable
from ._config import LoraConfig
from ._layer import LoraLinear


def cast_frozen(model: Any, dtype: Any = jnp.bfloat16, *, config: LoraConfig | None = None) -> Any:
    """The model with every frozen floating-point leaf stored in `dtype` (default bfloat16).

    The leaves `zoo.lora.trainable(model, config)` marks trainable — every `lora_A` /
    `lora_B` and the `config.modules_to_save` modules — keep their dtype (float32); the
    rest (base weights and biases, embeddings, norms, a frozen head) are cast. Frozen
    leaves get no gradient and are never communicated, so the step's collectives are
    unchanged; their resident bytes halve. Compute is not narrowed: every zoo layer casts
    a weight to its activation's dtype where it is used (`zoo.nn.project`, the norms), so
    a float32 model computes in float32 from rounded weights; set the config's `dtype` to
    `"bfloat16"` for bfloat16 compute as well. Casting keeps each leaf's sharding.

    **Arguments:**

    - `model`: a model with LoRA branches (`zoo.lora.add_lora`).
    - `dtype`: the storage dtype of the frozen leaves, a floating-point dtype.
    - `config`: the `LoraConfig` the branches were added with (its `modules_to_save` stay
      trainable and uncast); `None` keeps only the branches.

    **Returns:** the model with the frozen leaves cast; train it with
    `zoo.TrainStep(..., trainable=zoo.lora.trainable(model, config))`.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"cast_frozen stores the frozen base in a floating-point dtype, got {dtype}; "
            "use jnp.bfloat16 or jnp.float16 (integer quantisation is not supported)"
        )
    if not modules(model, LoraLinear):
        raise ValueError(
            "cast_frozen found no LoRA branches in the model: add them first with "
            "zoo.lora.add_lora(model, config, key=...), or the whole model would be frozen"
        )
    keep = trainable(model, config)

    def one(leaf, train):
        if train or not eqx.is_inexact_array(leaf) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        return leaf.astype(dtype)

    return jax.tree.map(one, model, keep)
