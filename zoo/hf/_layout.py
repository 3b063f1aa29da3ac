"""Where each zoo leaf lives in a Hugging Face file: the one description that loading,
export and adapter files (`zoo.lora.save_adapter` / `load_adapter`) all read.

The families (`zoo/hf/_families/*.py`, see `_family.py`) fill it in: a `Source` per leaf
(its tensor names, stacking, orientation, padding, offset) and, for fused tensors, a
`Block` (which of the side-by-side blocks along the output axis is the leaf's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .. import nn

if TYPE_CHECKING:
    import numpy as np

# numpy and jax are imported where used: the families (and so the `zoo` command's help,
# which lists them) load without them.


@dataclasses.dataclass(frozen=True)
class Block:
    """A zoo leaf's place in a fused Hugging Face tensor: its output axis (the leaf's last
    axis, zoo orientation) is block `index` of blocks of `widths` laid side by side along
    the fused tensor's output axis.

    GPT-2's `c_attn`: q, k, v are blocks 0, 1, 2 of `(d, d, d)`. Phi-3's `qkv_proj` with
    grouped-query attention: of `(heads·head_dim, kv_heads·head_dim, kv_heads·head_dim)`;
    its `gate_up_proj`: gate and up, of `(mlp_dim, mlp_dim)`. Weights and LoRA branches
    alike: a branch's B on a fused module is one such tensor (its rows are the outputs).
    """

    index: int
    widths: tuple[int, ...]

    @property
    def total(self) -> int:
        """The fused tensor's size along the output axis."""
        return sum(self.widths)

    def span(self, index: int | None = None) -> slice:
        """Block `index`'s (default: this leaf's) positions along the fused output axis."""
        index = self.index if index is None else index
        start = sum(self.widths[:index])
        return slice(start, start + self.widths[index])

    def join(self, parts: Mapping[int, np.ndarray], axis: int) -> np.ndarray:
        """The fused tensor of `parts` (block index → that block, laid along `axis`); the
        blocks not given are zeros."""
        import numpy as np

        first = next(iter(parts.values()))
        shape = list(first.shape)
        shape[axis] = self.total
        out = np.zeros(shape, first.dtype)
        for k, value in parts.items():
            index = [slice(None)] * out.ndim
            index[axis] = self.span(k)
            out[tuple(index)] = value
        return out

    def split(self, value: np.ndarray, axis: int) -> list[np.ndarray]:
        """Each block of the fused tensor `value` (its blocks laid along `axis`)."""
        import numpy as np

        if value.shape[axis] != self.total:
            raise ValueError(f"a fused tensor of blocks {self.widths} is {self.total} wide, got {value.shape}")
        moved = np.moveaxis(value, axis, 0)
        return [np.moveaxis(moved[self.span(k)], 0, axis) for k in range(len(self.widths))]


def fused_group(container: str, *modules: str) -> dict[str, tuple[str, ...]]:
    """`Family.fused` entries: the zoo `modules` under `container` (in block order) that
    Hugging Face fuses into one tensor, each mapped to the group."""
    group = tuple(f"{container}.{m}" for m in modules)
    return dict.fromkeys(group, group)


def output_width(config: Any, module: str) -> int:
    """The output width of a zoo attention / feed-forward projection (`…q_proj`, `…k_proj`,
    `…v_proj`, `…o_proj`, `…gate`, `…up`, `…down`) under a model config."""
    head_dim = config.head_dim or config.d_model // config.num_heads
    widths = {
        "q_proj": config.num_heads * head_dim,
        "k_proj": config.kv_heads * head_dim,
        "v_proj": config.kv_heads * head_dim,
        "o_proj": config.d_model,
        "gate": config.hidden_dim,
        "up": config.hidden_dim,
        "down": config.d_model,
    }
    return widths[module.rsplit(".", 1)[-1]]


@dataclasses.dataclass(frozen=True)
class Source:
    """The Hugging Face tensors one zoo leaf is made of.

    - `names`: one tensor name per layer (`np.ndindex` order of the leading layer axes;
      one name for an unstacked leaf).
    - `stacked`: the number of leading layer axes (`[L, ...]`: layer `i` ← `names[i]`).
    - `transpose`: the file holds the transpose of each layer's slice (torch `nn.Linear`
      weights are `[out, in]`, zoo's `[in, out]`).
    - `file_shape`: the full shape of each named tensor in the file (the whole fused
      tensor for a `block`).
    - `block`: the leaf's `Block` of a fused tensor (GPT-2's `c_attn`, Phi-3's
      `qkv_proj`), else `None`.
    - `valid`: the part of each layer's leaf core (zoo orientation, from index 0) the file
      holds, when the leaf is larger (a vocabulary padded for tensor parallelism: the
      padding rows read as zeros and are not written); `None`: all of it.
    - `offset`: added on reading, subtracted on writing (Gemma's RMSNorm scales by
      `1 + weight`: the zoo leaf holds `1 + weight`).
    """

    names: tuple[str, ...]
    stacked: int
    transpose: bool
    file_shape: tuple[int, ...]
    block: Block | None = None
    valid: tuple[int, ...] | None = None
    offset: float = 0.0

    @classmethod
    def of(
        cls,
        names: tuple[str, ...],
        core: tuple[int, ...],
        *,
        stacked: int,
        transpose: bool,
        block: Block | None = None,
        valid: tuple[int, ...] | None = None,
        offset: float = 0.0,
    ) -> Source:
        """The `Source` of a leaf whose per-layer shape (zoo orientation) is `core`."""
        held = list(core if valid is None else valid)
        if block is not None:
            held[-1] = block.total
        file_shape = tuple(held[::-1] if transpose else held)
        return cls(names, stacked, transpose, file_shape, block, None if valid == core else valid, offset)

    @property
    def block_axis(self) -> int:
        """The file tensor's axis that holds the blocks of a fused tensor (zoo's last axis)."""
        return 0 if self.transpose else -1

    def file_index(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The slice of one layer's file tensor that holds `index` (bounded slices) of the
        leaf's core dims."""
        if self.block is not None:
            start = self.block.span().start
            last = index[-1]
            index = (*index[:-1], slice(last.start + start, last.stop + start))
        return index[::-1] if self.transpose else index

    def to_file(self, value: np.ndarray) -> np.ndarray:
        """One layer's slice of the leaf (zoo orientation) as the file holds it: padding
        dropped, offset taken off, transposed; a fused leaf's own block only (`Block.join`
        lays the blocks together)."""
        import numpy as np

        if self.valid is not None:
            value = value[tuple(slice(0, v) for v in self.valid)]
        if self.offset:
            value = value - np.asarray(self.offset, value.dtype)
        return np.ascontiguousarray(value.T if self.transpose else value)

    def from_file(self, value: np.ndarray, core: tuple[int, ...]) -> np.ndarray:
        """One layer's file tensor (a fused leaf's own block) as the leaf's slice of shape
        `core`: transposed, offset added, padding rows zero."""
        import numpy as np

        value = value.T if self.transpose else value
        if self.offset:
            value = value + np.asarray(self.offset, value.dtype)
        if value.shape != tuple(core):
            value = np.pad(value, [(0, c - v) for v, c in zip(value.shape, core, strict=True)])
        return value


def leaf_sources(family: Any, model: Any, config: Any) -> Iterator[tuple[tuple, Any, Source]]:
    """`(key path, leaf, Source)` for every array leaf of `model` (arrays, shape structs or
    zero-stride placeholders), in `jax.tree` order.

    Raises a `ValueError` naming every leaf the layout has no tensor for (e.g. a LoRA
    branch: merge it first).
    """
    import jax

    from .._tree import dotted_name, is_array_like, node_at

    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]
    out, unknown, quantized = [], [], []
    for path, leaf in leaves:
        if not is_array_like(leaf):
            continue
        parent = node_at(model, path[:-1])
        source = family.source(dotted_name(path[:-1]), dotted_name(path[-1:]), parent, tuple(leaf.shape), config)
        if source is None:
            (quantized if isinstance(parent, nn.QuantizedLinear | nn.FourBitLinear) else unknown).append(
                dotted_name(path)
            )
        else:
            out.append((path, leaf, source))
    if quantized:
        raise ValueError(
            f"these leaves of the {type(model).__name__} are int8 or 4-bit (zoo.nn.QuantizedLinear / FourBitLinear, "
            f"from zoo.lora.cast_frozen(model, jnp.int8 | 'nf4' | 'int4')): {quantized}. Hugging Face checkpoints "
            "hold float weights: "
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
    return isinstance(parent, nn.Linear | nn.QuantizedLinear) and param == "weight"
