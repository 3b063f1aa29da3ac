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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
import safetensors.numpy
from jax.tree_util import GetAttrKey
from jaxtyping import PRNGKeyArray

from .._export_dir import check_export_dir
from .._files import atomic_write, fsync_dir, to_host
from .._mismatch import mismatch_lines, shorten, summary
from .._tree import dotted_name, key_path, node_at
from ..hf._layout import Block, Source
from ..nn import Embedding, Linear
from ._apply import (
    ADAPTED,
    LINEARS,
    TIED_HEAD,
    _all_module_names,
    _check_modules_to_save,
    _replace_lora,
    _with,
    add_lora,
    modules,
    outermost,
    saved_modules,
    target_names,
)
from ._config import INITS, MUTATING, LoraConfig
from ._embedding import LoraEmbedding
from ._layer import LoraLinear
from ._names import (
    adapter_names,
    hf_module_name,
    lead,
    lead_at,
    saves,
    select,
)
from ._tokens import TrainableTokens

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ZOO_NAME = "zoo_adapter.json"
# A mean-pooling classifier's head, apart from peft's files: torch `nn.Linear`'s state dict.
HEAD_NAME = "head.safetensors"
FILE_NAMES = (WEIGHTS_NAME, CONFIG_NAME, ZOO_NAME, HEAD_NAME)  # what save_adapter writes
PREFIX = "base_model.model."

# peft features zoo's LoRA does not have: refused on load rather than silently ignored.
# (`rank_pattern` / `alpha_pattern` are checked module by module: zoo reads the ones it writes.)
_UNSUPPORTED = ("layers_to_transform", "layer_replication", "lora_bias")


# --------------------------------------------------------------------------- entries


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
            _Entry(a_path, Source.of((f"{head}.lora_B.weight",), a_core, stacked=0, transpose=False, valid=valid_a),
                   tied=True),
        ]  # fmt: skip
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


def _module_of(key: str) -> str:
    """The HF module name of an adapter file key (`base_model.model.X.lora_A.weight` → `X`)."""
    name = key.removeprefix(PREFIX)
    match = re.fullmatch(r"(.*)\.lora_[AB](\.[^.]+)?\.weight", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


# --------------------------------------------------------------------------- fused modules


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


# --------------------------------------------------------------------------- files


def tensors_sha256(tensors: dict[str, np.ndarray]) -> str:
    """A SHA-256 of the tensors' contents: each name, dtype, shape and bytes, by name.

    Unlike a hash of the file, it does not change when a tool rewrites the file with the
    same tensors (another header order, other metadata, other padding)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        digest.update(json.dumps([name, str(value.dtype), list(value.shape)]).encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _describe(model: Any) -> dict[str, Any]:
    """The zoo model's class and config, recorded for load-time checks and messages."""
    out: dict[str, Any] = {"model": type(model).__name__}
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "encoder"):
        config = model.encoder.config
        out["num_labels"] = getattr(model, "num_labels", None)
        out["pooling"] = getattr(model, "pooling", None)
    if dataclasses.is_dataclass(config):
        out["model_config"] = _json_safe(dataclasses.asdict(config))
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _source_folder(model: Any) -> str | None:
    from ..hf._peft import source_of  # zoo.hf imports zoo.models; imported late

    return source_of(model)


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
      config's `source_dir`), else none (peft's `PeftModel` still opens the adapter on a
      model you pass; AutoPeftModel then cannot).
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
    found = modules(model, ADAPTED)
    if not found:
        raise ValueError(f"this {type(model).__name__} has no LoRA branches: add them with zoo.lora.add_lora first")
    base = _replace_lora(model, lambda layer: layer.base)
    expected = sorted(target_names(base, config))
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
    _check_modules_to_save(model, config)
    names = adapter_names(base)
    apart = _apart_tensors(model, names, found)
    entries = _entries(model, config, names)

    tensors, fused, rank_pattern, alpha_pattern = _file_tensors(model, config, entries)
    if jax.process_index() != 0:
        return []

    peft_targets = sorted({_module_of(k) for k in tensors if ".lora_" in k})
    saved = [n for n in saved_modules(model, config) if names is None or n not in names.apart]
    peft_saved = sorted({hf_module_name(model, n, idx) for n in saved for idx in np.ndindex(lead(model, n))}) or None
    values = config.to_peft_dict(peft_targets)
    values.update(
        target_modules=peft_targets,
        exclude_modules=None,
        modules_to_save=peft_saved,
        task_type=None if names is None else names.task_type,
        base_model_name_or_path=base_model_name_or_path or _source_folder(base),
        # peft's one flag for Conv1D targets ([in, out] weights); it corrects it per module.
        fan_in_fan_out=names is not None
        and any(names.conv1d(n, node_at(model, p).base) for n, (p, _) in modules(model, LoraLinear).items()),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
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
            "modules_to_save": _plain(config.modules_to_save),
            "tensors_sha256": tensors_sha256(tensors),
        }
        | ({"head_sha256": tensors_sha256(apart)} if apart else {})
    )
    return _write(Path(directory), tensors, values, meta, apart)


def _convert_to_original(
    tensors: dict[str, np.ndarray], values: dict[str, Any], config: LoraConfig, initial: Any
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """peft's `path_initial_model_for_weight_conversion`: the adapter as one on the
    original base, `ΔW = A B − A₀ B₀` (`A₀`, `B₀` from the adapter saved in `initial` at
    initialisation): each branch rank 2r, `r` and `lora_alpha` (and the patterns) doubled
    as peft doubles them, so its scaling is the same. A fused module's blocks keep their
    own rank columns together (each block's `[A; A₀]`), so zoo splits it back."""
    path = "the initial model" if isinstance(initial, dict) else Path(initial) / WEIGHTS_NAME
    try:
        start = initial if isinstance(initial, dict) else safetensors.numpy.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types; a missing file too
        raise ValueError(
            f"path_initial_model_for_weight_conversion: cannot read {path} ({e}); save the adapter there right "
            "after add_lora (zoo.lora.save_adapter(model, config, that_folder)), before training"
        ) from e
    branches = {k for k in tensors if ".lora_A." in k or ".lora_B." in k}
    if set(start) & branches != branches or any(start[k].shape != tensors[k].shape for k in branches):
        raise ValueError(
            f"path_initial_model_for_weight_conversion: {path} holds other branches than this adapter (keys or "
            "shapes differ): pass the folder this adapter was saved to right after add_lora"
        )
    if any(".lora_magnitude_vector" in k for k in tensors):
        raise ValueError("path_initial_model_for_weight_conversion converts plain LoRA adapters only, not DoRA")
    out = dict(tensors)
    for k in branches:
        if ".lora_A." not in k:
            continue
        b_key = k.replace(".lora_A.", ".lora_B.")
        a, a0, b, b0 = tensors[k], start[k], tensors[b_key], start[b_key]
        groups = a.shape[0] // config.r  # a fused module's blocks, r rank rows each
        rows = lambda x, j: x[j * config.r : (j + 1) * config.r]
        out[k] = np.concatenate([p for j in range(groups) for p in (rows(a, j), rows(a0, j))], axis=0)
        out[b_key] = np.concatenate([p for j in range(groups) for p in (rows(b.T, j).T, -rows(b0.T, j).T)], axis=1)
    values = dict(values)
    values.update(
        init_lora_weights=True,
        r=2 * config.r,
        lora_alpha=config.lora_alpha * (math.sqrt(2) if config.use_rslora else 2),
        rank_pattern={m: 2 * r for m, r in values.get("rank_pattern", {}).items()},
        alpha_pattern={m: 2 * a for m, a in values.get("alpha_pattern", {}).items()},
    )
    return out, values


def _file_tensors(model: Any, config: LoraConfig, entries: list[_Entry]) -> tuple[
    dict[str, np.ndarray], dict[str, Any], dict[str, int], dict[str, float]
]:  # fmt: skip
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


def _apart_tensors(model: Any, names: Any, found: dict[str, Any]) -> dict[str, np.ndarray]:
    """The file of `names.apart` (a mean-pooling classifier's head) as torch's
    `nn.Linear` state dict, `{"weight": [out, in], "bias": [out]}`; `{}` when there is none."""
    if names is None or not names.apart:
        return {}
    (name,) = names.apart
    adapted = [n for n in found if n == name or n.startswith(name + ".")]
    if adapted:
        raise ValueError(
            f"LoRA branches on {adapted}: a mean-pooling {type(model).__name__}'s {name} is saved whole in "
            f"{HEAD_NAME} (no Hugging Face model holds it); train it in full instead: modules_to_save=[{name!r}], "
            "not in target_modules"
        )
    head = node_at(model, key_path(model, name))
    out = {"weight": to_host(head.weight).T}
    if head.bias is not None:
        out["bias"] = to_host(head.bias)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _write(directory: Path, tensors: dict[str, np.ndarray], values: dict[str, Any], meta: dict[str, Any],
           apart: dict[str, np.ndarray]) -> list[Path]:  # fmt: skip
    """An adapter's files into `directory` (refused if it holds a user's files of their
    names), weights first; the paths written."""
    check_export_dir(directory, FILE_NAMES, writer="zoo.lora.save_adapter", config=CONFIG_NAME, key="peft_type",
                     weights=WEIGHTS_NAME, kind="a LoRA adapter folder")  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    written = [WEIGHTS_NAME] + ([HEAD_NAME] if apart else []) + [CONFIG_NAME, ZOO_NAME]
    for name, arrays in ((WEIGHTS_NAME, tensors), (HEAD_NAME, apart)):
        if arrays:
            atomic_write(directory / name,
                         lambda tmp, a=arrays: safetensors.numpy.save_file(a, tmp, metadata={"format": "pt"}))  # fmt: skip
    for file, contents in ((CONFIG_NAME, values), (ZOO_NAME, meta)):
        text = json.dumps(_json_safe(contents), indent=2, sort_keys=True) + "\n"
        atomic_write(directory / file, lambda tmp, text=text: Path(tmp).write_text(text))
    fsync_dir(directory)
    return [directory / name for name in written]


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} does not hold a JSON object")  # noqa: TRY004
    return values


def _read_config(directory: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if not directory.is_dir():
        raise FileNotFoundError(f"no adapter directory at {str(directory)!r}")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{str(directory)!r} is not a complete LoRA adapter: missing {', '.join(missing)} "
            f"(an adapter holds {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    values = _read_json(directory / CONFIG_NAME)
    if values.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"{directory} holds a {values.get('peft_type')!r} adapter; zoo.lora loads only LoRA (peft_type 'LORA')"
        )
    unsupported = [k for k in _UNSUPPORTED if values.get(k)]
    if unsupported:
        raise ValueError(
            f"{directory / CONFIG_NAME} uses peft features zoo.lora does not support: "
            + ", ".join(f"{k}={values[k]!r}" for k in unsupported)
        )
    meta = _read_json(directory / ZOO_NAME) if (directory / ZOO_NAME).is_file() else None
    return values, meta


def _from_peft_names(model: Any, values: dict[str, Any]) -> tuple[Any, Any]:
    """Zoo `target_modules` and `modules_to_save` for an adapter peft (not zoo) wrote:
    each zoo module is chosen when the peft names of all its layers match."""
    targets = values.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        zoo_targets: Any = "all-linear"
    else:
        patterns = tuple(targets) if isinstance(targets, list) else targets
        exclude = values.get("exclude_modules")
        exclude = tuple(exclude) if isinstance(exclude, list) else exclude
        candidates = list(modules(model, (*LINEARS, Embedding, *ADAPTED)))
        picked = select(model, candidates, patterns, "the adapter's target_modules")
        if getattr(model, TIED_HEAD, "absent") is None and any(
            t == TIED_HEAD or t.endswith("." + TIED_HEAD) for t in (targets if isinstance(targets, list) else [])
        ):
            picked.append(TIED_HEAD)  # the tied head: the token embedding (`tied_head` checks the tying)
        if exclude is not None:
            dropped = set(select(model, picked, exclude, "the adapter's exclude_modules"))
            picked = [n for n in picked if n not in dropped]
        zoo_targets = tuple(picked)
        if not zoo_targets:
            raise ValueError(
                f"the adapter's target_modules {targets!r} match no Linear layer of this {type(model).__name__}; "
                f"its layers' peft names are e.g. {_example_names(model)}"
            )
    save = values.get("modules_to_save")
    zoo_save = None
    if save:
        # peft's rule on the HF names peft saw: every module whose name ends with an entry
        # ("norm": each layer's input_layernorm and post_attention_layernorm, and model.norm).
        # An entry that matches nothing is allowed, as peft allows it (SEQ_CLS adds "score");
        # entries that together match nothing are refused.
        names = [n for n in _all_module_names(model) if not n.endswith(".base")]
        picked = select(model, names, tuple(save), "the adapter's modules_to_save", rule=saves, zoo_names=False)
        zoo_save = tuple(outermost(picked))
        if not zoo_save:
            innermost = [n for n in names if not any(m.startswith(n + ".") for m in names)]
            raise ValueError(
                f"the adapter's modules_to_save {save!r} match no module of this {type(model).__name__}: peft "
                "saves every module whose Hugging Face name ends with an entry, and this model's are e.g. "
                f"{_example_names(model, innermost)}; load it into the model it was trained on"
            )
    return zoo_targets, zoo_save


def _example_names(model: Any, names: list[str] | None = None) -> list[str]:
    """Layer 0's HF / peft names of the first 8 of `names` (default: the Linear layers)."""
    names = list(modules(model, (*LINEARS, LoraLinear))) if names is None else names
    return [hf_module_name(model, n, (0,) * len(lead(model, n))) for n in names[:8]]


def _lora_config(base: Any, values: dict[str, Any], meta: dict[str, Any] | None) -> LoraConfig:
    fields = dict(values)
    init = fields.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith(("pissa_niter_", "corda", "loftq"))):
        raise ValueError(
            f"this adapter was made with peft's init_lora_weights={init!r}, which changed the base weights it applies "
            "to in a way zoo cannot recompute; save it in peft with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=<the adapter saved at initialisation>) "
            "for an adapter of the original base, and load that"
        )
    if init not in INITS:
        fields["init_lora_weights"] = True  # peft's other inits (eva, orthogonal, …): the file holds the result
    if meta is not None and "target_modules" in meta:
        for k in ("target_modules", "exclude_modules", "modules_to_save"):
            fields[k] = meta.get(k)
    else:
        fields["target_modules"], fields["modules_to_save"] = _from_peft_names(base, values)
        fields["exclude_modules"] = None
    return LoraConfig.from_peft_dict(fields)


def _check_meta(model: Any, meta: dict[str, Any] | None, values: dict[str, Any], names: Any, where: Path) -> None:
    """Refuse adapters whose outputs this model would silently compute differently."""
    if meta is not None:
        recorded = meta.get("model")
        if recorded is not None and recorded != type(model).__name__:
            raise ValueError(
                f"this adapter was saved from a zoo {recorded}; it cannot be loaded into a {type(model).__name__}"
            )
        pooling = getattr(model, "pooling", None)
        if meta.get("pooling") is not None and pooling is not None and meta["pooling"] != pooling:
            raise ValueError(
                f"this adapter was saved from an {recorded} with pooling={meta['pooling']!r}; this one has "
                f"pooling={pooling!r}, so its head would see other features: build it with pooling={meta['pooling']!r}"
            )
    elif names is not None and values.get("task_type") == "SEQ_CLS" and not names.cls_pooling:
        raise ValueError(
            f"{where} is a peft SEQ_CLS adapter: peft trained it on {names.architecture}, which classifies the "
            f"[CLS] token through BERT's pooler (dense + tanh), but this {type(model).__name__} mean-pools and would "
            "give other logits. Load the classifier with zoo.hf.load_bert_classifier (pooling='cls'), or build "
            "it with EncoderClassifier(..., pooling='cls')."
        )


def _peft_scaling(values: dict[str, Any], module: str, rank: int) -> float:
    """peft's scaling of the branch on HF module `module` whose A has `rank` rows."""
    alpha = values.get("lora_alpha", 8)
    for key, value in (values.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if values.get("use_rslora") else rank)


def _config_diffs(model: Any, meta: Any) -> list[str]:
    """How the config the adapter was saved with differs from `model`'s (`key: saved X,
    this model Y`), from the adapter's zoo metadata; empty without it."""
    if not isinstance(meta, dict):
        return []
    mine = _describe(model)
    saved_cfg, my_cfg = meta.get("model_config") or {}, mine.get("model_config") or {}
    diffs = [
        f"{k}: saved {saved_cfg.get(k)!r}, this model {my_cfg.get(k)!r}"
        for k in sorted(set(saved_cfg) | set(my_cfg))
        if saved_cfg.get(k) != my_cfg.get(k)
    ]
    if meta.get("num_labels") != mine.get("num_labels"):
        diffs.append(f"num_labels: saved {meta.get('num_labels')!r}, this model {mine.get('num_labels')!r}")
    return diffs


def _config_diff(model: Any, meta: Any) -> str:
    diffs = _config_diffs(model, meta)
    return ("\n  the model configs differ: " + "; ".join(diffs)) if diffs else ""


def _why_not(values: dict[str, Any], unexpected: list[str], misshaped: list[str]) -> str:
    """The likely cause of a mismatch that adapter_config.json shows: other ranks by `rank_pattern`."""
    hints = []
    pattern = {m: r for m, r in (values.get("rank_pattern") or {}).items() if r != values.get("r")}
    if pattern and misshaped:
        hints.append(f"rank_pattern gives {shorten(sorted(f'{m}: {r}' for m, r in pattern.items()), 3)} another "
                     f"rank than r {values.get('r')}, but zoo gives every branch one rank: train it without "
                     "rank_pattern")  # fmt: skip
    return "".join(f"; {h}" for h in hints)


def _first_diff(model: Any, meta: Any) -> str:
    """The first few config differences, for a message's first line (or nothing)."""
    diffs = _config_diffs(model, meta)
    return f"; the model configs differ ({shorten(diffs, 3)}): an adapter of another base model?" if diffs else ""


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
        directory / WEIGHTS_NAME, None if meta is None else meta.get("tensors_sha256"),
        f"the adapter was changed or its save was interrupted; save it again. If you changed the weights on purpose "
        f"(e.g. trained further with peft), delete {ZOO_NAME} to load it as a peft adapter.",
    )  # fmt: skip

    base = _replace_lora(model, lambda layer: layer.base)
    names = adapter_names(base)
    _check_meta(model, meta, values, names, directory)
    tensors, apart = _read_apart(tensors, values, meta, names, directory)
    tensors = _skip_absent(tensors, names, directory)
    # peft saves the base embedding (and head) beside an embedding's branch (its
    # `save_embedding_layers`, for a resized vocabulary); zoo keeps the model's own.
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".base_layer.weight")}
    config = _lora_config(base, values, meta)
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
    _check_shapes(entries, tensors, model, meta, directory, values)
    _check_scaling(tensors, values, config, directory)
    new = _loaded_values(model, entries, tensors, config, directory)
    own = {entry.path: value for entry, value in zip(entries, new, strict=True) if not entry.tied}
    for entry, value in zip(entries, new, strict=True):
        if entry.tied and not np.array_equal(np.asarray(value), np.asarray(own[entry.path])):
            raise ValueError(
                f"{directory}: {entry.source.names[0].removeprefix(PREFIX)} is not the token embedding's branch "
                "transposed, so this tied head was not trained tied (peft's ensure_weight_tying); zoo keeps a tied "
                "head one weight with its embedding: train it with ensure_weight_tying=True"
            )
    new = [value for entry, value in zip(entries, new, strict=True) if not entry.tied]
    entries = [entry for entry in entries if not entry.tied]
    paths = [entry.path for entry in entries]
    if apart:  # the head's leaves (torch's orientation), like the leaves they replace
        head = key_path(model, names.apart[0])
        for param, value in sorted(apart.items(), reverse=True):  # weight, then bias
            old = node_at(model, head + (GetAttrKey(param),))
            value = np.asarray(value.T if param == "weight" else value).astype(old.dtype)
            if value.shape != old.shape:
                raise ValueError(f"{directory / HEAD_NAME}: {param} is {list(value.shape)} in zoo's layout, this "
                                 f"model's head holds {list(old.shape)}{_first_diff(model, meta)}")  # fmt: skip
            paths.append(head + (GetAttrKey(param),))
            new.append(jax.device_put(value, old.sharding) if isinstance(old, jax.Array) else jnp.asarray(value))
    model = eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)
    return model, config


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


def _read_apart(tensors: dict[str, np.ndarray], values: dict[str, Any], meta: Any, names: Any,
                directory: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:  # fmt: skip
    """`(peft's tensors, the head's)` of an adapter loaded into a mean-pooling classifier:
    the head from `head.safetensors` (checked against zoo_adapter.json's hash), or, from
    an adapter zoo wrote before it kept the head apart (a SEQ_CLS adapter of a mean-pooling
    classifier), taken out of peft's tensors, whose names lose the `bert.` prefix."""
    if names is None or not names.apart:
        return tensors, {}
    if values.get("task_type") == "SEQ_CLS" and isinstance(meta, dict) and meta.get("pooling") == "mean":
        old, head_name = PREFIX + names.family.prefix, PREFIX + names.module(names.apart[0]) + "."
        head = {k.removeprefix(head_name): v for k, v in tensors.items() if k.startswith(head_name)}
        rest = {(PREFIX + k.removeprefix(old) if k.startswith(old) else k): v for k, v in tensors.items()
                if not k.startswith(head_name)}  # fmt: skip
        return rest, head
    path = directory / HEAD_NAME
    if not path.is_file():
        return tensors, {}
    recorded = None if meta is None else meta.get("head_sha256")
    head = _read_checked(path, recorded, "the head was changed or its save was interrupted; save it again")
    return tensors, head


def _read_checked(path: Path, recorded: str | None, advice: str) -> dict[str, np.ndarray]:
    """The tensors of the safetensors file `path`, checked against the SHA-256 zoo_adapter.json
    `recorded` for them (None: a peft file, unchecked); a `ValueError` ending in `advice`
    when they differ."""
    try:
        tensors = safetensors.numpy.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read {path}: {e}") from e
    if recorded is not None and tensors_sha256(tensors) != recorded:
        raise ValueError(
            f"the tensors in {path} are not the ones {path.parent / ZOO_NAME} records (their contents' SHA-256 "
            f"differs): {advice}"
        )
    return tensors


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
            f"{_why_not(values or {}, unexpected, misshaped)}"
        ]
        lines += mismatch_lines("keys", missing, unexpected, misshaped)
        raise ValueError("\n".join(lines) + _config_diff(model, meta))


def _check_scaling(tensors, values, config: LoraConfig, directory: Path) -> None:
    """peft's scaling of every branch in the file is zoo's one scaling (else `ValueError`)."""
    wrong = []
    for k, value in tensors.items():
        if k.endswith(".lora_A.weight"):
            module = _module_of(k)
            scaling = _peft_scaling(values, module, value.shape[0])
            rank = value.shape[0]
            if not math.isclose(scaling, config.scaling, rel_tol=1e-9):
                wrong.append(f"{module} (rank {rank}, scaling {scaling})")
    if wrong:
        raise ValueError(
            f"zoo gives every LoRA branch one scaling, {config.scaling} (lora_alpha {config.lora_alpha}, r {config.r}"
            f"{', rsLoRA' if config.use_rslora else ''}), but {directory / CONFIG_NAME}'s rank_pattern / alpha_pattern "
            f"give these modules another: {shorten(sorted(wrong), 8)}"
        )


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


__all__ = ["hf_module_name", "load_adapter", "save_adapter", "tensors_sha256"]
