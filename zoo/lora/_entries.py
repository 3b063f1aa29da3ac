"""Which tensor of an adapter file each array leaf of a zoo model is: an `_Entry` per leaf
(its key path, its file keys under peft's Hugging Face names, their orientation and
padding, and for a branch on a module Hugging Face fuses the `Block` of its outputs), for
the branches, the trainable tokens and the `modules_to_save` leaves; and a file's keys
checked against them before anything loads."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.tree_util import GetAttrKey

from .._mismatch import mismatch_lines, summary
from .._tree import dotted_name, key_path, node_at
from ..hf._layout import Block, Source
from ..nn import Linear
from ._apply import (
    ADAPTED,
    TIED_HEAD,
    modules,
    saved_modules,
)
from ._config import LoraConfig
from ._embedding import LoraEmbedding
from ._layer import LoraLinear
from ._names import (
    hf_module_name,
    lead,
    lead_at,
)
from ._peft_config import PREFIX, _config_diff, _first_diff, _module_of, _why_not
from ._tokens import TrainableTokens


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One array leaf of the adapter: its key path in the model, its file tensors (a
    `zoo.hf` `Source`: keys, orientation, padding, offset) and, for a branch on a fused HF
    module, the `Block` of that module's outputs its zoo module is."""

    path: tuple
    source: Source
    block: Block | None = None
    tied: bool = False  # a tied head's branch: the embedding's leaf again, under the head's keys


def _embedding_entries(model: Any, names: Any, name: str, path: tuple, layer: LoraEmbedding) -> list[_Entry]:
    """peft's `lora_embedding_A` `[r, vocab]` / `lora_embedding_B` `[dim, r]` of an adapted
    embedding (a padded vocabulary's rows dropped), and, for a tied head, the head's
    `lm_head.lora_A.weight` (= B) / `lora_B.weight` (= A), as peft's `ensure_weight_tying` ties them."""
    hf = hf_module_name(model, name)
    vocab = getattr(getattr(names, "config", None) or getattr(model, "config", None), "vocab_size", None)
    rows = layer.num_embeddings
    if name.split(".")[-1] in ("token_embedding", "word_embeddings") and vocab is not None and vocab < rows:
        rows = vocab
    a_core, b_core = tuple(layer.lora_embedding_A.shape), tuple(layer.lora_embedding_B.shape)
    valid_a = (rows, layer.r) if rows != layer.num_embeddings else None
    a_path, b_path = path + (GetAttrKey("lora_embedding_A"),), path + (GetAttrKey("lora_embedding_B"),)
    entries = [
        _Entry(
            a_path, Source.of((f"{PREFIX}{hf}.lora_embedding_A",), a_core, stacked=0, transpose=True, valid=valid_a)
        ),
        _Entry(b_path, Source.of((f"{PREFIX}{hf}.lora_embedding_B",), b_core, stacked=0, transpose=True)),
    ]
    if layer.tie_head:
        head = f"{PREFIX}{(names.module(TIED_HEAD) if names is not None else None) or TIED_HEAD}"
        entries += [
            _Entry(b_path, Source.of((f"{head}.lora_A.weight",), b_core, stacked=0, transpose=False), tied=True),
            _Entry(
                a_path,
                Source.of((f"{head}.lora_B.weight",), a_core, stacked=0, transpose=False, valid=valid_a),
                tied=True,
            ),
        ]
    return entries


def _lora_entries(model: Any, names: Any) -> list[_Entry]:
    entries = []
    for name, (path, _) in modules(model, TrainableTokens).items():
        delta = node_at(model, path).trainable_tokens_delta
        key = f"{PREFIX}{hf_module_name(model, name)}.token_adapter.trainable_tokens_delta"  # peft's
        source = Source.of((key,), tuple(delta.shape), stacked=0, transpose=False)
        entries.append(_Entry(path + (GetAttrKey("trainable_tokens_delta"),), source))
    for name, (path, _) in modules(model, LoraEmbedding).items():
        entries += _embedding_entries(model, names, name, path, node_at(model, path))
    for name, (path, stacked) in modules(model, LoraLinear).items():
        layer = node_at(model, path)
        block = None if names is None else names.block(name)
        for leaf in ("lora_A", "lora_B") + (("lora_magnitude_vector",) if layer.use_dora else ()):
            value = getattr(layer, leaf)
            suffix = "" if leaf == "lora_magnitude_vector" else ".weight"  # peft's key: `….lora_magnitude_vector`
            keys = tuple(
                f"{PREFIX}{hf_module_name(model, name, idx)}.{leaf}{suffix}"
                for idx in np.ndindex(value.shape[:stacked])
            )
            source = Source.of(keys, tuple(value.shape[stacked:]), stacked=stacked, transpose=value.ndim > stacked + 1)
            entries.append(_Entry(path + (GetAttrKey(leaf),), source, block))
    return entries


def _save_entries(model: Any, config: LoraConfig, names: Any) -> list[_Entry]:
    entries = []
    apart = () if names is None else names.apart
    for name in saved_modules(model, config):
        if name in apart:
            continue  # in a file of its own (`_apart_tensors`)
        path = key_path(model, name)
        module = node_at(model, path)
        if modules(module, ADAPTED):
            raise ValueError(
                f"modules_to_save module {name!r} contains LoRA branches; peft does not allow a "
                "module to be both adapted and saved in full: take it out of target_modules or modules_to_save"
            )
        leaves, _ = jax.tree_util.tree_flatten_with_path(module)
        for leaf_path, leaf in leaves:
            if not eqx.is_array(leaf):
                continue
            full = path + leaf_path
            parent, param, module_name = node_at(model, full[:-1]), dotted_name(full[-1:]), dotted_name(full[:-1])
            if names is not None and names.block(module_name) is not None:
                raise ValueError(
                    f"modules_to_save module {name!r} holds {module_name!r}, which Hugging Face fuses with other "
                    f"modules into {hf_module_name(model, module_name, (0,) * len(lead(model, module_name)))}; "
                    "zoo cannot save part of a fused module: choose modules that are whole in the HF model"
                )
            stacked = len(lead_at(model, full))
            keys = tuple(
                f"{PREFIX}{hf_module_name(model, module_name, idx)}.{param}" for idx in np.ndindex(leaf.shape[:stacked])
            )
            # The family's layout of the leaf (Conv1D or Linear, padded vocabulary, offset), under peft's names.
            source = None if names is None else names.source(module_name, param, parent, tuple(leaf.shape))
            if source is None:
                transpose = isinstance(parent, Linear) and param == "weight"
                source = Source.of(keys, tuple(leaf.shape[stacked:]), stacked=stacked, transpose=transpose)
            entries.append(_Entry(full, dataclasses.replace(source, names=keys, stacked=stacked)))
    return entries


def _entries(model: Any, config: LoraConfig, names: Any) -> list[_Entry]:
    entries = _lora_entries(model, names) + _save_entries(model, config, names)
    seen: dict[str, tuple] = {}
    for entry in entries:
        if entry.block is not None:
            continue  # fused parts share their HF module's keys on purpose
        for k in entry.source.names:
            if k in seen:
                raise ValueError(f"two leaves of this {type(model).__name__} map to the adapter key {k!r}")
            seen[k] = entry.path
    return entries


def _skip_absent(tensors: dict[str, np.ndarray], names: Any, where: Path) -> dict[str, np.ndarray]:
    """Drop (with a warning saying why) the branches on HF modules the zoo model lacks
    and that change nothing it computes (BertModel's pooler)."""
    if names is None:
        return tensors
    skipped: dict[str, str] = {}
    for key in tensors:
        reason = names.skipped(_module_of(key))
        if reason is not None:
            skipped[_module_of(key)] = reason
    if skipped:
        warnings.warn(
            f"{where}: skipping the adapter's tensors for {sorted(skipped)}: "
            + "; ".join(sorted(set(skipped.values()))),
            stacklevel=3,
        )
    return {k: v for k, v in tensors.items() if _module_of(k) not in skipped}


def _check_shapes(entries, tensors, model, meta, directory: Path, values: dict[str, Any] | None = None) -> None:
    """Every key the model's branches expect is in the file with a fitting shape, and no
    other: else one `ValueError` listing missing, unexpected and mis-shaped keys."""
    expected: dict[str, list[tuple[int, ...]]] = {}
    for entry in entries:
        shape = entry.source.file_shape
        for k in entry.source.names:
            if entry.block is None:
                expected[k] = [shape]
            else:
                # A fused branch: rank m·r (zoo's blocks, m ≤ n) or r (one peft branch), outputs all n blocks.
                n = len(entry.block.widths)
                if k.endswith("lora_magnitude_vector"):
                    expected[k] = [(entry.block.total,)]
                elif k.endswith("lora_A.weight"):
                    expected[k] = [(m * shape[0], shape[1]) for m in range(1, n + 1)]
                else:
                    expected[k] = [(entry.block.total, m * shape[1]) for m in range(1, n + 1)]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = []
    for k in sorted(set(expected) & set(tensors)):
        if tuple(tensors[k].shape) not in expected[k]:
            want = " or ".join(str(list(s)) for s in expected[k])
            misshaped.append(f"{k}: expected {want}, found {list(tensors[k].shape)}")
    if missing or unexpected or misshaped:
        lines = [
            f"the adapter in {str(directory)!r} does not fit this {type(model).__name__}: "
            f"{summary('keys', missing, unexpected, misshaped)}{_first_diff(model, meta)}"
            f"{_why_not(values or {}, unexpected, misshaped, model, meta)}"
        ]
        lines += mismatch_lines("keys", missing, unexpected, misshaped)
        raise ValueError("\n".join(lines) + _config_diff(model, meta))
