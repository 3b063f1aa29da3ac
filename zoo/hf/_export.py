"""Writing zoo models as Hugging Face checkpoints (`config.json` + `model.safetensors`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from .._export_dir import check_export_dir
from .._files import atomic_write, fsync_dir, to_host
from ..models import Encoder, Transformer
from . import _families  # noqa: F401  (registers the families)
from ._family import families, family_of, get_family
from ._files import CONFIG_NAME, WEIGHTS_NAME, read_json
from ._layout import leaf_sources

GENERATION_NAME = "generation_config.json"
# Files of the source folder that travel with the weights (tokenizers of every family).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
# Every name save_pretrained may write (the tokenizer's files only for a model loaded from a folder).
FILE_NAMES = (WEIGHTS_NAME, CONFIG_NAME, GENERATION_NAME, *TOKENIZER_FILES)
# Keys of a source config.json that describe the zoo model, never copied over.
_NOT_KEPT = ("architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "auto_map")


def _source_config(config: Any, family: Any) -> tuple[Path | None, dict[str, Any] | None]:
    """The folder the model was loaded from and its config.json, when both still exist
    and are this family's."""
    folder = getattr(config, "source_dir", None)
    if folder is None or not Path(folder).is_dir():
        return None, None
    values = read_json(Path(folder) / CONFIG_NAME)
    if values is None or values.get("model_type") != family.name:
        return Path(folder), None
    return Path(folder), values


def _family(model: Any) -> Any:
    family = family_of(model)
    if family.written_as is not None:  # e.g. a multimodal checkpoint's text decoder: written as that
        family = get_family(family.written_as)
    if not isinstance(model, family.model_class):
        written = {}
        for f in families().values():
            written.setdefault(f.model_class.__name__, []).append(f.name)
        classes = "; ".join(f"{c} as {' / '.join(names)}" for c, names in sorted(written.items()))
        raise TypeError(
            f"save_pretrained writes the zoo model classes of the registered families ({classes}), got a "
            f"{type(model).__name__}" + (" (write its .encoder)" if hasattr(model, "encoder") else "")
        )
    return family


def _hf_config(model: Any) -> tuple[Any, dict[str, Any], Path | None, dict[str, Any] | None]:
    family = _family(model)
    folder, base = _source_config(model.config, family)
    values = family.config_to_hf(model.config, base)
    if base is not None:  # keep what the zoo does not model (token ids, names, …)
        values = {k: v for k, v in base.items() if k not in _NOT_KEPT} | values
    return family, values, folder, base


def hf_tensors(model: Encoder | Transformer) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of `model`, by name, as host numpy arrays.

    The model's family (`zoo.hf.family_of`) names them. Stacked leaves are split into one
    tensor per layer, `Linear` weights transposed to torch's `[out, in]`, GPT-2's q/k/v
    fused into `c_attn` (Phi-3's into `qkv_proj` / `gate_up_proj`), a padded vocabulary cut back to `vocab_size`. Sharded leaves are
    gathered (every process must call this in a multi-process run).
    """
    family = _family(model)
    family.config_to_hf(model.config)  # refuses configs the architecture cannot express
    fused: dict[str, tuple[Any, dict[int, np.ndarray]]] = {}
    tensors: dict[str, np.ndarray] = {}
    for _, leaf, source in leaf_sources(family, model, model.config):
        host = to_host(leaf)
        layers = host.reshape(-1, *host.shape[source.stacked :]) if source.stacked else None  # stacked experts: L·E
        for i, name in enumerate(source.names):
            value = source.to_file(host if layers is None else layers[i])
            if source.block is None:
                tensors[name] = value
            else:
                fused.setdefault(name, (source, {}))[1][source.block.index] = value
    for name, (source, blocks) in fused.items():
        tensors[name] = source.block.join(blocks, source.block_axis)
    return tensors


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
    floating = {str(t.dtype) for t in tensors.values() if np.issubdtype(t.dtype, np.floating) or t.dtype.kind == "V"}
    return floating.pop() if len(floating) == 1 else "float32"


def save_pretrained(model: Encoder | Transformer, directory: str | os.PathLike) -> list[Path]:
    """Write `model` as a Hugging Face checkpoint that `transformers` loads as is.

    **Arguments:**

    - `model`: a zoo model of a registered family: the one it was loaded as
      (`config.family`), else chosen by shape (`zoo.hf.family_of`): a
      `zoo.models.Encoder` is written as `BertModel` (no pooler: loading it into
      `BertModel` leaves the pooler freshly initialised, `last_hidden_state` is exact), a
      `zoo.models.Transformer` with learned positions as `GPT2LMHeadModel`, one with RoPE,
      RMSNorm and SwiGLU as `LlamaForCausalLM` (as Mistral with a sliding window, Qwen2
      with q/k/v-only biases, Gemma with GeGLU); a model loaded by `zoo.hf` as the family
      it was loaded as (any of `zoo.hf.families()`). Configs the architecture cannot
      express raise a `ValueError` naming them. May be sharded; LoRA branches must be
      merged first (`zoo.lora.merge`).
    - `directory`: created if needed. `model.safetensors`, `config.json` and (a
      decoder's) `generation_config.json` in it are replaced atomically (a temporary file next to
      each, then `os.replace`; weights first, config last); other files are left alone,
      nothing is deleted. A folder holding a file of a name it writes must already be a
      Hugging Face model folder (a `config.json` with `"model_type"`, or a readable
      `model.safetensors`, as an interrupted save leaves it); any other is refused with a
      `FileExistsError` naming the files, so a user's own `config.json` is never replaced.

    A model loaded from a folder (`config.source_dir`) keeps that folder's config.json
    keys the zoo does not model (token ids, activation spellings) and gets its tokenizer
    files and `generation_config.json` copied; otherwise `generation_config.json` is made
    from the config. An encoder (BERT) generates nothing: it gets no
    `generation_config.json`, as transformers' `BertModel.save_pretrained` writes none. `max_position_embeddings` is the model's `max_len`.

    Tensors keep the leaves' dtype. In a multi-process run every process must call it
    (sharded leaves are gathered); process 0 writes. `zoo.hf.from_pretrained` of the
    result gives back `model`'s leaves bit for bit.

    **Returns:** the paths of the files written (none on processes other than 0).
    """
    family, values, folder, _ = _hf_config(model)
    directory = Path(directory)
    same = folder is not None and folder.resolve() == directory.resolve()
    tokenizer = [n for n in TOKENIZER_FILES if folder is not None and not same and (folder / n).is_file()]
    made = family.generation_config(values)  # None: a model that generates nothing (BERT)
    names = [WEIGHTS_NAME, *tokenizer, *([GENERATION_NAME] if made is not None else []), CONFIG_NAME]
    tensors = hf_tensors(model)  # every process: sharded leaves are gathered
    if jax.process_index() != 0:
        return []
    check_export_dir(
        directory,
        names,
        writer="zoo.hf.save_pretrained",
        config=CONFIG_NAME,
        key="model_type",
        weights=WEIGHTS_NAME,
        kind="a Hugging Face model folder",
    )
    values["dtype"] = _dtype_name(tensors)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(
        directory / WEIGHTS_NAME,
        lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"}),
    )
    for name in tokenizer:
        data = (folder / name).read_bytes()
        atomic_write(directory / name, lambda tmp, data=data: Path(tmp).write_bytes(data))
    if made is not None:
        generation = (read_json(folder / GENERATION_NAME) if folder is not None else None) or made
        gen_text = json.dumps(generation, indent=2, sort_keys=True) + "\n"
        atomic_write(directory / GENERATION_NAME, lambda tmp: Path(tmp).write_text(gen_text))
    text = json.dumps(values, indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    fsync_dir(directory)
    return [directory / name for name in names]


__all__ = ["hf_tensors", "save_pretrained"]
