"""Saving and loading LoRA adapters in peft's on-disk layout, without torch.

An adapter directory holds what `peft.PeftModel.save_pretrained` writes:

- `adapter_config.json`: `LoraConfig.to_peft_dict`, with `target_modules` the full peft
  names of the adapted modules (one per stacked layer) and `modules_to_save` peft names
  too, plus a `"zoo"` entry (the zoo model's class and config, the zoo-side
  `target_modules` / `exclude_modules` / `modules_to_save`, and the SHA-256 of the weights
  file, which ties the two files together).
- `adapter_model.safetensors`: only the adapter, as numpy arrays:
  `base_model.model.<module>.lora_A.weight` `[r, in]` and `...lora_B.weight` `[out, r]`
  (zoo's `[in, r]` / `[r, out]` transposed), one pair per stacked layer, and every leaf of
  the `modules_to_save` modules as `base_model.model.<module>.<param>` (a `Linear`'s
  `weight` transposed to torch's `[out, in]`, everything else as is).

Module names (`hf_module_name(model, name, index)`; `name` is the zoo attribute path
`modules()` reports, `index` one layer number per `Stacked` above the module):

- `Encoder` follows Hugging Face `BertModel`, `EncoderClassifier` follows
  `BertForSequenceClassification` (`encoder.` → `bert.`, `head` → `classifier`):

  | zoo `Encoder` module, layer `i` | HF BERT module |
  |---|---|
  | `embeddings`, `embeddings.word_embeddings` / `position_embeddings` / `token_type_embeddings` | same |
  | `embeddings.norm` | `embeddings.LayerNorm` |
  | `layers` / `layers.layers` / `layers.layers.attention` | `encoder.layer` / `encoder.layer.{i}` / `encoder.layer.{i}.attention` |
  | `layers.layers.attention.q_proj` / `k_proj` / `v_proj` | `encoder.layer.{i}.attention.self.query` / `key` / `value` |
  | `layers.layers.attention.o_proj` | `encoder.layer.{i}.attention.output.dense` |
  | `layers.layers.attention_norm` | `encoder.layer.{i}.attention.output.LayerNorm` |
  | `layers.layers.mlp.up` | `encoder.layer.{i}.intermediate.dense` |
  | `layers.layers.mlp.down` | `encoder.layer.{i}.output.dense` |
  | `layers.layers.mlp_norm` | `encoder.layer.{i}.output.LayerNorm` |

- Every other module (of any other model, or not in the table) keeps its zoo name with
  each `Stacked`'s `layers` attribute replaced by the layer number:
  `layers.layers.attention.q_proj`, layer 3 → `layers.3.attention.q_proj`;
  `hidden.layers.linear`, layer 0 → `hidden.0.linear`; unstacked modules keep their name.

Parameter names are the zoo leaf names (`weight`, `bias`), which are HF's for `Linear`,
`LayerNorm` and `Embedding`; only a `Linear`'s `weight` is transposed.

Writes are atomic per file (a temporary file next to the target, then `os.replace`);
the weights are replaced first and the config last, and `load_adapter` rejects weights
whose hash differs from the one the config records, so an interrupted save leaves either
the previous adapter or one that fails to load, never a half-written one that loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey, SequenceKey
from jaxtyping import PRNGKeyArray

from .._files import atomic_write, fsync_dir, to_host
from .._mismatch import mismatch_lines
from ..hf._family import get_family
from ..models import Encoder, EncoderClassifier
from ..nn import Linear, Stacked
from ._apply import (
    _all_module_names,
    _check_modules_to_save,
    _matches,
    _name,
    _node,
    _replace_lora,
    _with,
    add_lora,
    modules,
    target_names,
)
from ._config import LoraConfig
from ._layer import LoraLinear

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."

# zoo `Encoder` module name → HF `BertModel` module name: the BERT family's table.
BERT_NAMES = get_family("bert").module_names

# peft features zoo's LoRA does not have: refused on load rather than silently ignored.
_UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication", "lora_bias")


# --------------------------------------------------------------------------- names


def _child(node: Any, part: str) -> Any:
    if isinstance(node, list | tuple):
        return node[int(part)]
    if isinstance(node, dict):
        return node[part]
    return getattr(node, part)


def _generic_name(model: Any, name: str, index: tuple[int, ...]) -> str:
    """The zoo name with each `Stacked`'s `layers` attribute replaced by its layer number."""
    parts: list[str] = []
    node, rest = model, list(index)
    for part in name.split(".") if name else []:
        if isinstance(node, Stacked) and part == "layers":
            if not rest:
                raise ValueError(f"module {name!r} lies under more Stacked levels than index {index} gives")
            parts.append(str(int(rest.pop(0))))
        else:
            parts.append(part)
        node = _child(node, part)
    if rest:
        raise ValueError(f"module {name!r} lies under fewer Stacked levels than index {index} gives")
    return ".".join(parts)


def hf_module_name(model: Any, name: str, index: tuple[int, ...] = ()) -> str:
    """The Hugging Face / peft name of zoo module `name` (layer `index` if stacked) of `model`.

    `name` is a dotted zoo path as `zoo.lora.modules` reports it (e.g.
    `layers.layers.attention.q_proj`); `index` holds one layer number per `Stacked` above
    the module. `Encoder` and `EncoderClassifier` follow HF BERT (see the module
    docstring's table); other models get the zoo name with the layer numbers in place of
    the `Stacked`'s `layers` attribute.
    """
    if isinstance(model, EncoderClassifier):
        if name == "head" or name.startswith("head."):
            return "classifier" + name[len("head"):]
        if name == "encoder":
            return "bert"
        if name.startswith("encoder."):
            return "bert." + hf_module_name(model.encoder, name[len("encoder."):], index)
    elif isinstance(model, Encoder) and name in BERT_NAMES:
        return BERT_NAMES[name].format(*index)
    return _generic_name(model, name, index)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One array leaf of the adapter and the file keys its stacked slices go to."""

    path: tuple  # key path of the leaf in the model
    stacked: int  # leading layer axes
    transpose: bool  # zoo [.., a, b] ↔ file [b, a]
    keys: tuple[str, ...]  # file keys, one per layer index in np.ndindex order

    def file_shape(self, leaf: Any) -> tuple[int, ...]:
        shape = tuple(leaf.shape[self.stacked:])
        return shape[::-1] if self.transpose else shape


def _lora_entries(model: Any) -> list[_Entry]:
    entries = []
    for name, (path, stacked) in modules(model, LoraLinear).items():
        layer = _node(model, path)
        lead = layer.lora_A.shape[:stacked]
        for leaf in ("lora_A", "lora_B"):
            keys = tuple(f"{PREFIX}{hf_module_name(model, name, idx)}.{leaf}.weight" for idx in np.ndindex(lead))
            entries.append(_Entry(path + (GetAttrKey(leaf),), stacked, True, keys))
    return entries


def _saved_modules(model: Any, config: LoraConfig) -> list[str]:
    """Zoo names of the outermost modules `config.modules_to_save` matches."""
    if not config.modules_to_save:
        return []
    chosen: list[str] = []
    for name in _all_module_names(model):
        if _matches(name, config.modules_to_save) and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    return chosen


def _module_path(model: Any, name: str) -> tuple:
    """The key path of the module with dotted zoo name `name`."""
    path: list = []
    node = model
    for part in name.split(".") if name else []:
        if isinstance(node, list | tuple):
            path.append(SequenceKey(int(part)))
        elif isinstance(node, dict):
            path.append(DictKey(part))
        else:
            path.append(GetAttrKey(part))
        node = _child(node, part)
    return tuple(path)


def _lead_at(model: Any, path: tuple) -> tuple[int, ...]:
    """The layer counts of the `Stacked` modules the key path `path` passes through."""
    lead: list[int] = []
    node = model
    for key in path:
        if isinstance(node, Stacked):
            lead.append(node.num_layers)
        node = _node(node, (key,))
    return tuple(lead)


def _lead(model: Any, name: str) -> tuple[int, ...]:
    """The layer counts of the `Stacked` levels above module `name`."""
    return _lead_at(model, _module_path(model, name))


def _save_entries(model: Any, config: LoraConfig) -> list[_Entry]:
    entries = []
    for name in _saved_modules(model, config):
        path = _module_path(model, name)
        module = _node(model, path)
        if modules(module, LoraLinear):
            raise ValueError(
                f"modules_to_save module {name!r} contains LoRA branches; peft does not allow a "
                "module to be both adapted and saved in full: take it out of target_modules or modules_to_save"
            )
        leaves, _ = jax.tree_util.tree_flatten_with_path(module)
        for leaf_path, leaf in leaves:
            if not eqx.is_array(leaf):
                continue
            full = path + leaf_path
            parent, param = _node(model, full[:-1]), _name(full[-1:])
            stacked = len(_lead_at(model, full))
            module_name = _name(full[:-1])
            keys = tuple(
                f"{PREFIX}{hf_module_name(model, module_name, idx)}.{param}"
                for idx in np.ndindex(leaf.shape[:stacked])
            )
            transpose = isinstance(parent, Linear) and param == "weight"
            entries.append(_Entry(full, stacked, transpose, keys))
    return entries


def _entries(model: Any, config: LoraConfig) -> list[_Entry]:
    entries = _lora_entries(model) + _save_entries(model, config)
    seen: dict[str, tuple] = {}
    for entry in entries:
        for k in entry.keys:
            if k in seen:
                raise ValueError(f"two leaves of this {type(model).__name__} map to the adapter key {k!r}")
            seen[k] = entry.path
    return entries


# --------------------------------------------------------------------------- files


def _sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _describe(model: Any) -> dict[str, Any]:
    """The zoo model's class and config, recorded for load-time checks and messages."""
    out: dict[str, Any] = {"model": type(model).__name__}
    config = getattr(model, "config", None)
    if config is None and isinstance(model, EncoderClassifier):
        config = model.encoder.config
        out["num_labels"] = model.num_labels
    if dataclasses.is_dataclass(config):
        out["model_config"] = _json_safe(dataclasses.asdict(config))
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def save_adapter(model: Any, config: LoraConfig, directory: str | os.PathLike) -> None:
    """Write `model`'s LoRA adapter to `directory` as peft does (no torch needed).

    **Arguments:**

    - `model`: a zoo model carrying LoRA branches (`add_lora`), possibly sharded.
    - `config`: the `LoraConfig` the branches were added with.
    - `directory`: created if needed; `adapter_config.json` and `adapter_model.safetensors`
      in it are replaced atomically, other files are left alone.

    Only the branches (`lora_A`/`lora_B`, per stacked layer, transposed to peft's
    `[r, in]`/`[out, r]`) and the leaves of `config.modules_to_save` are written; see the
    module docstring for the key names. In a multi-process run every process must call
    it (arrays are gathered); process 0 writes.
    """
    found = modules(model, LoraLinear)
    if not found:
        raise ValueError(f"this {type(model).__name__} has no LoRA branches: add them with zoo.lora.add_lora first")
    base = _replace_lora(model, lambda layer: layer.base)
    expected = sorted(target_names(base, config))
    if sorted(found) != expected:
        raise ValueError(
            f"the model's LoRA branches {sorted(found)} are not the ones config targets {expected}: "
            "pass the LoraConfig the branches were added with"
        )
    for name, (path, _) in found.items():
        layer = _node(model, path)
        if layer.r != config.r or layer.scaling != config.scaling:
            raise ValueError(
                f"LoRA branch {name!r} has r={layer.r}, scaling={layer.scaling}, but config has "
                f"r={config.r}, scaling={config.scaling}: pass the LoraConfig the branches were added with"
            )
    _check_modules_to_save(model, config)
    entries = _entries(model, config)

    tensors: dict[str, np.ndarray] = {}
    for entry in entries:
        leaf = to_host(_node(model, entry.path))
        for idx, key in zip(np.ndindex(leaf.shape[: entry.stacked]), entry.keys, strict=True):
            value = leaf[idx]
            tensors[key] = np.ascontiguousarray(value.T if entry.transpose else value)
    if jax.process_index() != 0:
        return

    peft_targets = sorted({k[len(PREFIX):].rsplit(".", 2)[0] for e in _lora_entries(model) for k in e.keys})
    saved = _saved_modules(model, config)
    peft_saved = sorted({hf_module_name(model, n, idx) for n in saved
                         for idx in np.ndindex(_lead(model, n))}) or None
    values = config.to_peft_dict(peft_targets)
    values.update(target_modules=peft_targets, exclude_modules=None, modules_to_save=peft_saved)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    digest: dict[str, str] = {}

    def write_weights(tmp: str) -> None:
        safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
        digest["sha256"] = _sha256(tmp)

    atomic_write(directory / WEIGHTS_NAME, write_weights)
    values["zoo"] = _describe(model) | {
        "target_modules": _plain(config.target_modules),
        "exclude_modules": _plain(config.exclude_modules),
        "modules_to_save": _plain(config.modules_to_save),
        "weights_sha256": digest["sha256"],
    }
    text = json.dumps(_json_safe(values), indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    fsync_dir(directory)


# --------------------------------------------------------------------------- loading


def _read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise FileNotFoundError(f"no adapter directory at {str(directory)!r}")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{str(directory)!r} is not a complete LoRA adapter: missing {', '.join(missing)} "
            f"(an adapter holds {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    try:
        values = json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{directory / CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{directory / CONFIG_NAME} does not hold a JSON object")  # noqa: TRY004
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
    return values


def _candidates(model: Any) -> dict[str, tuple[tuple, int]]:
    return modules(model, (Linear, LoraLinear))


def _from_peft_names(model: Any, values: dict[str, Any]) -> tuple[Any, Any]:
    """Zoo `target_modules` and `modules_to_save` for an adapter peft (not zoo) wrote:
    each zoo module is chosen when the peft names of all its layers match."""

    def chosen(names: list[str], patterns: Any, exclude: Any, what: str) -> list[str]:
        out = []
        for name in names:
            hf = [hf_module_name(model, name, idx) for idx in np.ndindex(_lead(model, name))]
            hits = [_matches(n, patterns) and not _matches(n, exclude) for n in hf]
            if all(hits):
                out.append(name)
            elif any(hits):
                raise ValueError(
                    f"the adapter's {what} {patterns!r} match only some layers of the stacked module "
                    f"{name!r} ({[n for n, h in zip(hf, hits, strict=True) if h]}); zoo adapts all layers of a stack"
                )
        return out

    targets = values.get("target_modules")
    if targets == "all-linear":
        zoo_targets: Any = "all-linear"
    else:
        patterns = tuple(targets) if isinstance(targets, list) else targets
        exclude = values.get("exclude_modules")
        exclude = tuple(exclude) if isinstance(exclude, list) else exclude
        zoo_targets = tuple(chosen(list(_candidates(model)), patterns, exclude, "target_modules"))
        if not zoo_targets:
            raise ValueError(
                f"the adapter's target_modules {targets!r} match no Linear layer of this {type(model).__name__}; "
                f"its layers' peft names are e.g. {_example_names(model)}"
            )
    save = values.get("modules_to_save")
    zoo_save = None
    if save:
        names = [n for n in _all_module_names(model) if not n.endswith(".base")]
        picked = chosen(names, tuple(save), None, "modules_to_save")
        zoo_save = tuple(n for n in picked if not any(n.startswith(p + ".") for p in picked))
        if not zoo_save:
            raise ValueError(f"the adapter's modules_to_save {save!r} match no module of this {type(model).__name__}")
    return zoo_targets, zoo_save


def _example_names(model: Any) -> list[str]:
    names = []
    for name in list(_candidates(model))[:8]:
        names.append(hf_module_name(model, name, tuple(0 for _ in _lead(model, name))))
    return names


def _lora_config(model: Any, values: dict[str, Any]) -> LoraConfig:
    zoo_entry = values.get("zoo")
    fields = dict(values)
    if fields.get("init_lora_weights") not in (True, False, "gaussian"):
        fields["init_lora_weights"] = True  # peft's other inits (pissa, loftq, …): the file holds the result
    if isinstance(zoo_entry, dict) and "target_modules" in zoo_entry:
        recorded = zoo_entry.get("model")
        if recorded is not None and recorded != type(model).__name__:
            raise ValueError(
                f"this adapter was saved from a zoo {recorded}; it cannot be loaded into a {type(model).__name__}"
            )
        for k in ("target_modules", "exclude_modules", "modules_to_save"):
            fields[k] = zoo_entry.get(k)
    else:
        base = _replace_lora(model, lambda layer: layer.base)
        fields["target_modules"], fields["modules_to_save"] = _from_peft_names(base, values)
        fields["exclude_modules"] = None
    return LoraConfig.from_peft_dict(fields)


def _config_diff(model: Any, zoo_entry: Any) -> str:
    if not isinstance(zoo_entry, dict):
        return ""
    mine = _describe(model)
    saved_cfg, my_cfg = zoo_entry.get("model_config") or {}, mine.get("model_config") or {}
    diffs = [f"{k}: saved {saved_cfg.get(k)!r}, this model {my_cfg.get(k)!r}"
             for k in sorted(set(saved_cfg) | set(my_cfg)) if saved_cfg.get(k) != my_cfg.get(k)]
    if zoo_entry.get("num_labels") != mine.get("num_labels"):
        diffs.append(f"num_labels: saved {zoo_entry.get('num_labels')!r}, this model {mine.get('num_labels')!r}")
    return ("\n  the model configs differ: " + "; ".join(diffs)) if diffs else ""


def _branch_sharding(model: Any, entry: _Entry) -> NamedSharding | None:
    """For a branch `load_adapter` just added to a model on a mesh: the layout its
    annotations give under the rules that placed the base weight (A keeps the base
    weight's input-axis sharding, B its output-axis sharding, the rank axis is whole)."""
    leaf = entry.path[-1]
    if not (isinstance(leaf, GetAttrKey) and leaf.name in ("lora_A", "lora_B")):
        return None
    weight = _node(model, entry.path[:-1]).base.weight
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    lead, (into, out) = spec[: entry.stacked], spec[entry.stacked:]
    return NamedSharding(sharding.mesh, P(*lead, into, None) if leaf.name == "lora_A" else P(*lead, None, out))


def load_adapter(
    model: Any, directory: str | os.PathLike, *, key: PRNGKeyArray | None = None
) -> tuple[Any, LoraConfig]:
    """Load an adapter `save_adapter` (or peft) wrote into `model`; returns `(model, config)`.

    **Arguments:**

    - `model`: the base model (branches are added with the file's config, using `key`,
      default `jax.random.key(0)`; the values are then overwritten), or a model that
      already carries LoRA branches of the right shapes (their scaling and dropout become
      the file's). Never modified in place.
    - `directory`: holding `adapter_config.json` and `adapter_model.safetensors`.

    Every key and shape is checked before anything is set: a `ValueError` lists missing
    keys, unexpected keys and mis-shaped tensors. Loaded leaves take the dtype and (on a
    mesh) the sharding of the leaves they replace; branches added here to a model on a
    mesh take their base weight's layout (A its input axis, B its output axis).
    """
    directory = Path(directory)
    values = _read_config(directory)
    config = _lora_config(model, values)
    zoo_entry = values.get("zoo")

    added = not modules(model, LoraLinear)
    if added:
        model = add_lora(model, config, key=jax.random.key(0) if key is None else key)
    else:
        _check_modules_to_save(model, config)

        def adopt(layer: LoraLinear) -> LoraLinear:
            if layer.merged:
                raise ValueError("this model's LoRA branches are merged into its weights: unmerge (or unload) it first")
            return _with(layer, scaling=config.scaling, dropout_rate=config.lora_dropout)

        model = _replace_lora(model, adopt)

    weights = directory / WEIGHTS_NAME
    recorded = zoo_entry.get("weights_sha256") if isinstance(zoo_entry, dict) else None
    if recorded is not None and _sha256(weights) != recorded:
        raise ValueError(
            f"{weights} does not match {directory / CONFIG_NAME} (its SHA-256 differs from the one "
            "the config records): the adapter was changed or its save was interrupted; save it again"
        )
    try:
        tensors = safetensors.numpy.load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read {weights}: {e}") from e

    entries = _entries(model, config)
    expected = {k: (entry, i) for entry in entries for i, k in enumerate(entry.keys)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = []
    for k in sorted(set(expected) & set(tensors)):
        entry, _ = expected[k]
        want = entry.file_shape(_node(model, entry.path))
        if tuple(tensors[k].shape) != want:
            misshaped.append(f"{k}: expected {list(want)}, found {list(tensors[k].shape)}")
    if missing or unexpected or misshaped:
        lines = [f"the adapter in {str(directory)!r} does not fit this {type(model).__name__}:"]
        lines += mismatch_lines("keys", missing, unexpected, misshaped)
        raise ValueError("\n".join(lines) + _config_diff(model, zoo_entry))

    new = []
    for entry in entries:
        old = _node(model, entry.path)
        parts = [tensors[k].T if entry.transpose else tensors[k] for k in entry.keys]
        value = np.stack(parts).reshape(old.shape) if entry.stacked else parts[0]
        value = np.asarray(value).astype(old.dtype)
        sharding = _branch_sharding(model, entry) if added else None
        if sharding is None and isinstance(old, jax.Array):
            sharding = old.sharding
        new.append(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
    paths = [entry.path for entry in entries]
    model = eqx.tree_at(lambda m: [_node(m, p) for p in paths], model, replace=new)
    return model, config


__all__ = ["BERT_NAMES", "hf_module_name", "load_adapter", "save_adapter"]
