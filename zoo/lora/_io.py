"""Saving and loading LoRA adapters as peft does, without torch.

An adapter directory holds what `peft.PeftModel.save_pretrained` writes, plus zoo's own
metadata in a file of its own (peft ignores it):

- `adapter_config.json`: `LoraConfig.to_peft_dict`, with `target_modules` and
  `modules_to_save` the full Hugging Face / peft names of the modules, `task_type`
  (`CAUSAL_LM` for a `Transformer`, `FEATURE_EXTRACTION` for an `Encoder`, `SEQ_CLS` for
  an `EncoderClassifier`), `base_model_name_or_path` (the folder the model was loaded
  from by `zoo.hf`, or the argument), `fan_in_fan_out` (GPT-2's `Conv1D`s), and, for
  fused modules (GPT-2's `c_attn`, Phi-3's `qkv_proj`), `rank_pattern` / `alpha_pattern`
  (below).
- `adapter_model.safetensors`: only the adapter: `base_model.model.<module>.lora_A.weight`
  `[r, in]` and `...lora_B.weight` `[out, r]` (zoo's `[in, r]` / `[r, out]` transposed),
  one pair per stacked layer, and every leaf of the `modules_to_save` modules as
  `base_model.model.<module>.<param>` (a `Linear`'s `weight` as torch's `[out, in]`, a
  `Conv1D`'s as is, everything else as is).
- `zoo_adapter.json`: the zoo model's class and config, the zoo-side `target_modules` /
  `exclude_modules` / `modules_to_save`, and a SHA-256 of the tensors' contents (names,
  dtypes, shapes, bytes) that ties the two other files together.
- `head.safetensors`, for an `EncoderClassifier` that mean-pools (which no Hugging Face
  class computes): its head as torch's `nn.Linear` state dict (`weight` `[num_labels,
  d_model]`, `bias`). Its adapter is its encoder's, a `FEATURE_EXTRACTION` one on
  `BertModel` (peft and sentence-transformers read it as features); the logits are
  `mean(last_hidden_state over the attention mask) @ weight.T + bias`. A `SEQ_CLS`
  adapter is written only for a classifier that pools as `BertForSequenceClassification`
  (`pooling="cls"`), so nothing opens an adapter as a model that computes other logits.

Module names are those of the Hugging Face model the zoo model stands for
(`hf_module_name`, from the `zoo.hf` family registry), so peft opens zoo adapters and zoo
opens peft's. Some families fuse several zoo projections into one HF module (GPT-2's
`c_attn`: q | k | v; Phi-3's `qkv_proj`, of unequal widths under grouped-query attention,
and `gate_up_proj`), each zoo module one `Block` of its outputs (`zoo.hf._layout`, as the
weights are loaded and exported): zoo's rank-r branches on m of its blocks are written as
one rank-m·r branch on the fused module (A the A's stacked, B block-diagonal), with
`rank_pattern` m·r and `alpha_pattern` chosen so peft's scaling equals zoo's; a peft branch
of rank r on it loads as rank-r zoo branches sharing A (B split by blocks), exactly; a
block-structured one (as zoo writes it, also after peft re-saved it without
`zoo_adapter.json`) splits back.

Writes are atomic per file (a temporary file next to the target, then `os.replace`):
the weights first, then `adapter_config.json`, then `zoo_adapter.json`; `load_adapter`
rejects tensors whose contents differ from the ones `zoo_adapter.json` records, so an
interrupted save leaves either the previous adapter or one that fails to load, never a
half-written one that loads. A file rewritten with the same tensors (as peft tools do)
still loads.

The concerns live apart: the JSON files (`_peft_config`), the tensors on disk
(`_safetensors`), which leaf is which file tensor (`_entries`), fused modules (`_fused`),
PiSSA / OLoRA conversion (`_pissa`) and a mean-pooling classifier's head (`_heads`); this
module holds the two entry points.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
from jaxtyping import PRNGKeyArray

from .._tree import node_at
from ._apply import (
    ADAPTED,
    TIED_HEAD,
    _check_modules_to_save,
    _replace_lora,
    _with,
    add_lora,
    expert_targets,
    modules,
    saved_modules,
    target_names,
)
from ._config import MUTATING, LoraConfig
from ._embedding import LoraEmbedding
from ._entries import _check_shapes, _entries, _Entry, _skip_absent
from ._expert_files import expert_tensors, expert_values
from ._fused import _file_tensors, _loaded_values
from ._heads import _apart_tensors, _head_values, _read_apart
from ._layer import LoraLinear
from ._names import (
    adapter_names,
    hf_module_name,
    lead,
)
from ._peft_config import (
    CONFIG_NAME,
    FILE_NAMES,
    PREFIX,
    WEIGHTS_NAME,
    ZOO_NAME,
    _base_named,
    _check_meta,
    _check_scaling,
    _describe,
    _lora_config,
    _module_of,
    _plain,
    _read_config,
)
from ._pissa import _convert_to_original
from ._safetensors import _read_checked, _write, tensors_sha256
from ._tokens import TrainableTokens


def save_adapter(
    model: Any,
    config: LoraConfig,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    path_initial_model_for_weight_conversion: str | os.PathLike | Any = None,
) -> list[Path]:
    """Write `model`'s LoRA adapter to `directory` as peft does (no torch needed).

    **Arguments:**

    - `model`: a zoo model carrying LoRA branches (`add_lora`), possibly sharded.
    - `config`: the `LoraConfig` the branches were added with.
    - `directory`: created if needed; `adapter_config.json`, `adapter_model.safetensors`
      and `zoo_adapter.json` in it are replaced atomically, other files are left alone,
      nothing is deleted. A folder holding a file of those names must already be an
      adapter folder (an `adapter_config.json` with `"peft_type"`, or a readable
      `adapter_model.safetensors`); any other is refused with a `FileExistsError` naming
      the files.
    - `base_model_name_or_path`: what peft's `AutoPeftModel*.from_pretrained(directory)`
      loads the base model from. Default: the folder `zoo.hf` loaded `model` from (its
      config's `source_dir`; a snapshot of the Hub cache as its id, its commit as
      `revision`, as peft writes one), else none (peft's `PeftModel` still opens the
      adapter on a model you pass; AutoPeftModel then cannot).
    - `path_initial_model_for_weight_conversion` (peft's argument of that name): a folder
      holding this adapter as it was at initialisation (`save_adapter` right after
      `add_lora`), or that initial model itself. The adapter is then written as one that applies to the *original* base:
      `ΔW = A B − A₀ B₀` as a rank-2r branch (A `[A; A₀]`, B `[B, −B₀]`), `r` and
      `lora_alpha` doubled (`√2` with rsLoRA), `init_lora_weights` `True`, as peft writes
      it. Needed for PiSSA / OLoRA (`init_lora_weights="pissa"` / `"olora"`), whose base
      keeps a residual: without it, the file applies to that residual (peft and zoo
      recompute it from the original base when loading; not for fused modules such as
      GPT-2's `c_attn`, whose peft residual is one decomposition of the fused weight).

    Only the branches (per stacked layer, as peft's `[r, in]`/`[out, r]`; branches on the
    blocks of a fused module as one, e.g. GPT-2's q/k/v in `c_attn`) and the leaves of `config.modules_to_save` are written; see the
    module docstring. An `EncoderClassifier` pooling as `BertForSequenceClassification`
    (`pooling="cls"`) is written as a peft `SEQ_CLS` adapter; one that mean-pools as its
    encoder's `FEATURE_EXTRACTION` adapter plus its whole head in `head.safetensors`
    (LoRA branches on the head are refused: keep the head in `modules_to_save`). In a
    multi-process run every process must call it (arrays are gathered); process 0 writes.

    **Returns:** the paths of the files written (none on processes other than 0).
    """
    base = _replace_lora(model, lambda layer: layer.base)
    found = _branches(model, base, config)
    _check_modules_to_save(model, config)
    names = adapter_names(base)
    apart = _apart_tensors(model, names, found)
    entries = _entries(model, config, names)

    tensors, fused, rank_pattern, alpha_pattern = _file_tensors(model, config, entries)
    if jax.process_index() != 0:
        return []

    peft_targets = sorted({_module_of(k) for k in tensors if ".lora_" in k})
    experts, expert_ranks, expert_alphas, peft_parameters = expert_tensors(model, config, names)
    tensors |= experts
    saved = [n for n in saved_modules(model, config) if names is None or n not in names.apart]
    peft_saved = sorted({hf_module_name(model, n, idx) for n in saved for idx in np.ndindex(lead(model, n))}) or None
    values = config.to_peft_dict(peft_targets)
    values.update(
        target_modules=peft_targets,
        exclude_modules=None,
        modules_to_save=peft_saved,
        task_type=None if names is None else names.task_type,
        **_base_named(base, base_model_name_or_path),
        # peft's one flag for Conv1D targets ([in, out] weights); it corrects it per module.
        fan_in_fan_out=names is not None
        and any(names.conv1d(n, node_at(model, p).base) for n, (p, _) in modules(model, LoraLinear).items()),
        rank_pattern=rank_pattern | expert_ranks,
        alpha_pattern=alpha_pattern | expert_alphas,
        target_parameters=peft_parameters or None,
    )
    if path_initial_model_for_weight_conversion is not None:
        initial = path_initial_model_for_weight_conversion
        if not isinstance(initial, str | os.PathLike):  # the model itself, at initialisation
            initial = _file_tensors(initial, config, _entries(initial, config, names))[0]
        tensors, values = _convert_to_original(tensors, values, config, initial)
    elif config.init_lora_weights in MUTATING and fused:
        raise ValueError(
            f"init_lora_weights={config.init_lora_weights!r} on parts of {sorted(fused)[0]}, which Hugging Face fuses "
            "into one module: peft would recompute its residual base from the fused weight, not zoo's parts. Save "
            "with path_initial_model_for_weight_conversion=<the adapter saved right after add_lora> for an adapter "
            "of the original base"
        )
    meta = (
        _describe(model)
        | {
            "format": "zoo LoRA adapter",
            "target_modules": _plain(config.target_modules),
            "exclude_modules": _plain(config.exclude_modules),
            "target_parameters": _plain(config.target_parameters),
            "modules_to_save": _plain(config.modules_to_save),
            "tensors_sha256": tensors_sha256(tensors),
        }
        | ({"head_sha256": tensors_sha256(apart)} if apart else {})
    )
    return _write(Path(directory), tensors, values, meta, apart)


def _branches(model: Any, base: Any, config: LoraConfig) -> dict[str, tuple[tuple, int]]:
    """The LoRA branches of `model` (`base` is it without them) by name: those `config`
    targets, of its rank and scaling (else a `ValueError`: pass the config they were added
    with)."""
    found = modules(model, ADAPTED)
    if not found:
        raise ValueError(f"this {type(model).__name__} has no LoRA branches: add them with zoo.lora.add_lora first")
    expected = sorted(target_names(base, config) + expert_targets(base, config))
    found = {n: v for n, v in found.items() if not isinstance(node_at(model, v[0]), TrainableTokens)}
    if sorted(found) != expected:
        raise ValueError(
            f"the model's LoRA branches {sorted(found)} are not the ones config targets {expected}: "
            "pass the LoraConfig the branches were added with"
        )
    for name, (path, _) in found.items():
        layer = node_at(model, path)
        if layer.r != config.r or layer.scaling != config.scaling:
            raise ValueError(
                f"LoRA branch {name!r} has r={layer.r}, scaling={layer.scaling}, but config has "
                f"r={config.r}, scaling={config.scaling}: pass the LoraConfig the branches were added with"
            )
    return found


def load_adapter(
    model: Any, directory: str | os.PathLike, *, key: PRNGKeyArray | None = None
) -> tuple[Any, LoraConfig]:
    """Load an adapter `save_adapter` (or peft) wrote into `model`; returns `(model, config)`.

    **Arguments:**

    - `model`: the base model (branches are added with the file's config, using `key`,
      default `jax.random.key(0)`; the values are then overwritten), or a model that
      already carries LoRA branches of the right shapes (their scaling and dropout become
      the file's). Never modified in place.
    - `directory`: holding `adapter_config.json` and `adapter_model.safetensors` (and
      `zoo_adapter.json` when zoo wrote it).

    Every key and shape is checked before anything is set: a `ValueError` lists missing
    keys, unexpected keys and mis-shaped tensors. Loaded leaves take the dtype and (on a
    mesh) the sharding of the leaves they replace; branches added here to a model on a
    mesh take their base weight's layout (A its input axis, B its output axis).

    peft adapters load with their Hugging Face names: a `target_modules="all-linear"`
    adapter of `BertModel` holds a branch on `pooler.dense`, which zoo's `Encoder` lacks:
    it is skipped with a warning (it only changes `pooler_output`; the hidden states are
    exact). A `SEQ_CLS` adapter is refused by a mean-pooling `EncoderClassifier` (its
    logits would differ); such a classifier reads its encoder's adapter (a peft
    `FEATURE_EXTRACTION` one on `BertModel`) and, when the folder has it,
    `head.safetensors` into its head. Per-module `rank_pattern` / `alpha_pattern` are accepted where
    zoo's one rank and scaling hold them exactly (fused modules: GPT-2's `c_attn`, Phi-3's
    `qkv_proj` / `gate_up_proj`).
    """
    directory = Path(directory)
    values, meta = _read_config(directory)
    tensors = _read_checked(
        directory / WEIGHTS_NAME,
        None if meta is None else meta.get("tensors_sha256"),
        f"the adapter was changed or its save was interrupted; save it again. If you changed the weights on purpose "
        f"(e.g. trained further with peft), delete {ZOO_NAME} to load it as a peft adapter.",
    )

    base = _replace_lora(model, lambda layer: layer.base)
    names = adapter_names(base)
    if names is not None and meta is None:  # a peft adapter: maybe of an older transformers' module names
        tensors = names.current(tensors)
    _check_meta(model, meta, values, names, directory)
    tensors, apart = _read_apart(tensors, values, meta, names, directory)
    tensors = _skip_absent(tensors, names, directory)
    # peft saves the base embedding (and head) beside an embedding's branch (its
    # `save_embedding_layers`, for a resized vocabulary); zoo keeps the model's own.
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".base_layer.weight")}
    config = _lora_config(base, values, meta, frozenset(tensors))
    head_key = f"{PREFIX}{(names.module(TIED_HEAD) if names is not None else None) or TIED_HEAD}.lora_A.weight"
    if (
        getattr(base, TIED_HEAD, "absent") is None
        and head_key in tensors
        and not isinstance(config.target_modules, str)
        and TIED_HEAD not in config.target_modules
    ):
        # peft saves a tied head's branch (ensure_weight_tying) but leaves it out of target_modules.
        config = dataclasses.replace(config, target_modules=(*config.target_modules, TIED_HEAD))
    if apart and meta is None and not set(names.apart) <= set(saved_modules(base, config)):
        # A head file without zoo's record of it (peft re-saved the adapter): the head trained whole.
        config = dataclasses.replace(config, modules_to_save=(*(config.modules_to_save or ()), *names.apart))

    added = not modules(model, ADAPTED)
    if config.init_lora_weights in MUTATING and not added:
        raise ValueError(
            f"this adapter applies to the residual base init_lora_weights={config.init_lora_weights!r} leaves; load "
            "it into the original base model (zoo.lora.unload(model) is the residual), which zoo decomposes again"
        )
    if added:
        model = add_lora(model, config, key=jax.random.key(0) if key is None else key)
    else:
        _check_modules_to_save(model, config)
        model = _replace_lora(model, functools.partial(_adopt, config=config))

    entries = _entries(model, config, names)
    if config.init_lora_weights in MUTATING and any(e.block is not None for e in entries):
        raise ValueError(
            f"{directory}: a {config.init_lora_weights!r} adapter on a module Hugging Face fuses (as GPT-2's c_attn) "
            "applies to peft's residual of the fused weight, which zoo (adapting its parts) cannot recompute; save "
            "it in peft with path_initial_model_for_weight_conversion for an adapter of the original base"
        )
    expert_paths, expert_new, tensors = expert_values(model, tensors, values, config, names, directory)
    _check_shapes(entries, tensors, model, meta, directory, values)
    _check_scaling(tensors, values, config, directory)
    paths, new = _untied(entries, _loaded_values(model, entries, tensors, config, directory), directory)
    paths, new = paths + expert_paths, new + expert_new
    if apart:  # the head's leaves (torch's orientation), like the leaves they replace
        head_paths, head_values = _head_values(model, names, apart, directory, meta)
        paths, new = paths + head_paths, new + head_values
    model = eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)
    return model, config


def _untied(entries: list[_Entry], new: list[Any], directory: Path) -> tuple[list[tuple], list[Any]]:
    """`(paths, values)` of the loaded leaves without a tied head's entries, each of which
    must be its embedding's branch transposed (else a `ValueError`: not trained tied)."""
    own = {entry.path: value for entry, value in zip(entries, new, strict=True) if not entry.tied}
    for entry, value in zip(entries, new, strict=True):
        if entry.tied and not np.array_equal(np.asarray(value), np.asarray(own[entry.path])):
            raise ValueError(
                f"{directory}: {entry.source.names[0].removeprefix(PREFIX)} is not the token embedding's branch "
                "transposed, so this tied head was not trained tied (peft's ensure_weight_tying); zoo keeps a tied "
                "head one weight with its embedding: train it with ensure_weight_tying=True"
            )
    kept = [(entry.path, value) for entry, value in zip(entries, new, strict=True) if not entry.tied]
    return [p for p, _ in kept], [v for _, v in kept]


def _adopt(layer: Any, *, config: LoraConfig) -> Any:
    """A branch the model already carries, taking the loaded adapter's scaling and dropout."""
    if isinstance(layer, TrainableTokens):
        return layer
    if layer.merged:
        raise ValueError("this model's LoRA branches are merged into its weights: unmerge (or unload) it first")
    if getattr(layer, "use_dora", False) != config.use_dora:
        raise ValueError(
            f"the adapter has use_dora={config.use_dora} but this model's LoRA branches have "
            f"use_dora={layer.use_dora}: load it into the base model (zoo.lora.unload(model)) instead"
        )
    if isinstance(layer, LoraEmbedding):
        return _with(layer, scaling=config.scaling)
    return _with(layer, scaling=config.scaling, dropout_rate=config.lora_dropout)


__all__ = ["CONFIG_NAME", "FILE_NAMES", "load_adapter", "save_adapter"]
