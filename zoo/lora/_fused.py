"""Branches on modules Hugging Face fuses (GPT-2's `c_attn`: q | k | v; Phi-3's `qkv_proj`
and `gate_up_proj`): zoo's rank-r branches on m of a fused module's blocks written as one
rank-m·r branch (A the A's stacked, B block-diagonal) with the `rank_pattern` /
`alpha_pattern` that keep peft's scaling zoo's, and a file's fused branch split back into
zoo's exactly (one peft branch of rank r: every block shares A). Also the adapter's
tensors as the file holds them and, on load, each leaf's new value."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from .._files import to_host
from .._tree import node_at
from ..hf._layout import Block
from ._config import LoraConfig
from ._entries import _Entry
from ._peft_config import PREFIX, _module_of

# The leaves of a branch, in the order a fused module's parts are gathered.
_SLOTS = ("lora_A", "lora_B", "lora_magnitude_vector")


def _fuse(parts: dict[int, tuple[np.ndarray, np.ndarray]], block: Block) -> tuple[np.ndarray, np.ndarray]:
    """One branch on a fused HF module from the zoo branches on some of its blocks.

    `parts`: block `k` → (A `[r, in]`, B `[width_k, r]`), file orientation; `block`: the
    module's blocks. **Returns:** A `[p·r, in]` (the A's stacked in block order) and B
    `[total, p·r]` (block-diagonal: block `k`'s rows hold its B in its own rank columns,
    absent blocks' rows are zero).
    """
    order = sorted(parts)
    r, p = parts[order[0]][0].shape[0], len(order)
    a = np.concatenate([parts[k][0] for k in order], axis=0)
    columns = {k: np.pad(parts[k][1], [(0, 0), (j * r, (p - 1 - j) * r)]) for j, k in enumerate(order)}
    return a, block.join(columns, axis=0)


def _unfuse(
    a: np.ndarray, b: np.ndarray, blocks: list[int], block: Block, r: int, module: str, where: str
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Zoo rank-`r` branches on `blocks` (of `block`'s) from one fused branch (A `[R, in]`,
    B `[total, R]`) on HF module `module`, exactly.

    - `R == r` (a branch peft trained): every block gets the whole A and its rows of B.
    - `R == m·r`, B block-structured (each block's rows use one group of r rank columns,
      no two blocks the same group; as `_fuse` writes): each block gets its group's rows
      of A and its block of B. A block whose rows are all zero gets the group at its
      position among `blocks` (or a free one) and a zero B.

    Blocks without a zoo branch must have zero rows of B. Anything else raises.
    """
    rank, n = a.shape[0], len(block.widths)
    rows = dict(enumerate(block.split(b, axis=0)))
    absent = [k for k in range(n) if k not in blocks and np.any(rows[k])]
    if absent:
        raise ValueError(
            f"{where}: the branch changes outputs of blocks {absent} of the fused module, which this zoo model "
            f"has no branch for; load it into a model with branches on all {n} (target_modules="
            f"[{module.rsplit('.', 1)[-1]!r}])"
        )
    if rank == r:
        return {k: (a, rows[k]) for k in blocks}
    groups = rank // r if rank % r == 0 else 0
    assigned: dict[int, int] = {}
    for k in blocks:
        used = {c // r for c in np.flatnonzero(np.any(rows[k], axis=0))}
        if len(used) > 1:
            break
        if used:
            assigned[k] = used.pop()
    else:
        if groups and len(set(assigned.values())) == len(assigned):
            for j, k in enumerate(blocks):
                if k not in assigned:  # B is zero here: any A is exact; keep zoo's own order where free
                    taken = set(assigned.values())
                    options = [g for g in [j, *range(groups)] if g < groups and g not in taken]
                    assigned[k] = options[0] if options else 0
            return {
                k: (a[g * r : (g + 1) * r], rows[k][:, g * r : (g + 1) * r])
                for k, g in ((k, assigned[k]) for k in blocks)
            }
    raise ValueError(
        f"{where}: a fused branch of rank {rank} is neither block-structured rank-{r} branches (each block's outputs "
        f"reading its own {r} rank columns) nor one rank-{r} branch, so zoo's rank-{r} branches on its {len(blocks)} "
        "parts cannot hold it exactly (zoo gives every module one rank). Was it trained further in peft after zoo "
        "wrote it? Load it into peft, or re-train it with one rank."
    )


def _file_tensors(
    model: Any, config: LoraConfig, entries: list[_Entry]
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, int], dict[str, float]]:
    """The adapter's tensors as peft's file holds them (fused modules' branches fused), the
    fused modules, and the `rank_pattern` / `alpha_pattern` those need."""
    tensors: dict[str, np.ndarray] = {}
    fused: dict[str, tuple[Block, dict[int, list[np.ndarray]]]] = {}
    for entry in entries:
        leaf, source = to_host(node_at(model, entry.path)), entry.source
        for idx, key in zip(np.ndindex(leaf.shape[: source.stacked]), source.names, strict=True):
            value = source.to_file(leaf[idx])
            if entry.block is None:
                tensors[key] = value
            else:
                slot = fused.setdefault(_module_of(key), (entry.block, {}))[1].setdefault(
                    entry.block.index, [None, None, None]
                )
                slot[_SLOTS.index(entry.path[-1].name)] = value
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for module, (block, parts) in fused.items():
        a, b = _fuse({k: (v[0], v[1]) for k, v in parts.items()}, block)
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = a, b
        if config.use_dora:
            if len(parts) != len(block.widths):
                raise ValueError(
                    f"DoRA branches on {len(parts)} of the {len(block.widths)} parts of {module}, which Hugging Face "
                    "fuses into one module: peft's magnitude vector covers all its outputs, so adapt all of them "
                    f"(target_modules=[{module.rsplit('.', 1)[-1]!r}]) or use plain LoRA"
                )
            tensors[f"{PREFIX}{module}.lora_magnitude_vector"] = block.join({k: v[2] for k, v in parts.items()}, axis=0)
        rank = a.shape[0]
        if rank != config.r:
            # peft scales the fused branch by alpha / rank (or / √rank): choose its alpha so
            # that the product is zoo's scaling.
            rank_pattern[module] = rank
            alpha_pattern[module] = config.scaling * (math.sqrt(rank) if config.use_rslora else rank)
    return tensors, fused, rank_pattern, alpha_pattern


def _loaded_values(model, entries, tensors, config: LoraConfig, directory: Path) -> list[jax.Array]:
    """The new value of each entry's leaf: its file tensors (fused modules' branches split
    once per Hugging Face module), in the leaf's shape, dtype and placement."""
    split: dict[tuple[str, int], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    fused_entries = [e for e in entries if e.block is not None and e.path[-1] == GetAttrKey("lora_A")]
    for entry in fused_entries:
        for i, k in enumerate(entry.source.names):
            module = _module_of(k)
            if (module, i) in split:
                continue
            blocks = sorted(e.block.index for e in fused_entries if k in e.source.names)
            split[(module, i)] = _unfuse(
                tensors[k],
                tensors[f"{PREFIX}{module}.lora_B.weight"],
                blocks,
                entry.block,
                config.r,
                module,
                f"{directory}: {module}",
            )
    new = []
    for entry in entries:
        old, source = node_at(model, entry.path), entry.source
        if entry.block is None:
            parts = [tensors[k] for k in source.names]
        elif entry.path[-1] == GetAttrKey("lora_magnitude_vector"):
            parts = [entry.block.split(tensors[k], axis=0)[entry.block.index] for k in source.names]
        else:
            which = 0 if entry.path[-1] == GetAttrKey("lora_A") else 1
            parts = [split[(_module_of(k), i)][entry.block.index][which] for i, k in enumerate(source.names)]
        core = tuple(old.shape[source.stacked :])
        parts = [source.from_file(np.asarray(p).astype(old.dtype), core) for p in parts]
        value = np.stack(parts).reshape(old.shape) if source.stacked else parts[0]
        # Like the leaf it replaces (`add_lora` places new branches like their base weight).
        sharding = old.sharding if isinstance(old, jax.Array) else None
        new.append(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
    return new
