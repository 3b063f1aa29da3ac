"""Where each zoo leaf lives in a Hugging Face checkpoint: the families
(`zoo/hf/_families/*.py`, see `_family.py`) fill in this description, loading and export
read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax

from .._tree import dotted_name, node_at
from ..nn import Linear, QuantizedLinear


@dataclasses.dataclass(frozen=True)
class Source:
    """The Hugging Face tensors one zoo leaf is made of.

    - `names`: one checkpoint tensor name per stacked layer (one name for an unstacked leaf).
    - `stacked`: the leaf has a leading layer axis (`[L, ...]`, layer `i` ← `names[i]`).
    - `transpose`: the file holds the transpose of each layer's slice (torch `nn.Linear`
      weights are `[out, in]`, zoo's `[in, out]`).
    - `file_shape`: the full shape of each named tensor in the file.
    - `part`: `(k, n)` when the leaf is the `k`-th of `n` equal blocks of the file tensor's
      last axis (GPT-2's fused `c_attn`: q, k, v side by side), else `None`.
    - `valid`: the part of each layer's leaf core (zoo orientation, from index 0) the file
      holds, when the leaf is larger (a vocabulary padded for tensor parallelism: the
      padding rows read as zeros and are not written); `None`: all of it.
    - `offset`: added on reading, subtracted on writing (Gemma's RMSNorm scales by
      `1 + weight`: the zoo leaf holds `1 + weight`).
    """

    names: tuple[str, ...]
    stacked: bool
    transpose: bool
    file_shape: tuple[int, ...]
    part: tuple[int, int] | None = None
    valid: tuple[int, ...] | None = None
    offset: float = 0.0

    def file_index(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The slice of one layer's file tensor that holds `index` of the leaf's core dims."""
        index = index[::-1] if self.transpose else index
        if self.part is not None:
            k, n = self.part
            width = self.file_shape[-1] // n
            last = index[-1]
            index = (*index[:-1], slice(last.start + k * width, last.stop + k * width))
        return index


def leaf_sources(family: Any, model: Any, config: Any) -> Iterator[tuple[tuple, Any, Source]]:
    """`(key path, leaf, Source)` for every array leaf of `model` (arrays, shape structs or
    zero-stride placeholders), in `jax.tree` order.

    Raises a `ValueError` naming every leaf the layout has no tensor for (e.g. a LoRA
    branch: merge it first).
    """
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]
    out, unknown, quantized = [], [], []
    for path, leaf in leaves:
        if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):
            continue
        parent = node_at(model, path[:-1])
        source = family.source(dotted_name(path[:-1]), dotted_name(path[-1:]), parent, tuple(leaf.shape), config)
        if source is None:
            (quantized if isinstance(parent, QuantizedLinear) else unknown).append(dotted_name(path))
        else:
            out.append((path, leaf, source))
    if quantized:
        raise ValueError(
            f"these leaves of the {type(model).__name__} are int8 (zoo.nn.QuantizedLinear, from "
            f"zoo.lora.cast_frozen(model, jnp.int8)): {quantized}. Hugging Face checkpoints hold float weights: "
            "merge the LoRA branches (zoo.lora.merge dequantises them into float32 Linear layers) or dequantise "
            "the model first with zoo.nn.dequantize(model)."
        )
    if unknown:
        raise ValueError(
            f"these leaves of the {type(model).__name__} have no Hugging Face {family.name} tensor: "
            f"{unknown}. A model with LoRA branches must be merged first: zoo.lora.merge(model)."
        )
    return iter(out)


def is_linear_weight(parent: Any, param: str) -> bool:
    """Whether a leaf is the weight of a `zoo.nn.Linear` or `QuantizedLinear` (stored `[in, out]`)."""
    return isinstance(parent, Linear | QuantizedLinear) and param == "weight"
