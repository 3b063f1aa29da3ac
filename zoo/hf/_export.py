"""Writing zoo models as Hugging Face checkpoints (`config.json` + `model.safetensors`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from .._files import atomic_write, fsync_dir, to_host
from ..models import Encoder, Transformer
from ._bert import BERT
from ._files import CONFIG_NAME, WEIGHTS_NAME
from ._gpt2 import GPT2
from ._layout import Layout, leaf_sources


def _layout_of(model: Any) -> Layout:
    if isinstance(model, Encoder):
        return BERT
    if isinstance(model, Transformer):
        return GPT2
    raise TypeError(
        f"save_pretrained writes a zoo.models.Encoder (as BERT) or a zoo.models.Transformer (as GPT-2), "
        f"got a {type(model).__name__}"
    )


def hf_tensors(model: Encoder | Transformer) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of `model`, by name, as host numpy arrays.

    Stacked leaves are split into one tensor per layer, `Linear` weights transposed to
    torch's `[out, in]` (BERT, GPT-2's untied `lm_head`), GPT-2's q/k/v fused into
    `c_attn`. Sharded leaves are gathered (every process must call this in a
    multi-process run).
    """
    layout = _layout_of(model)
    layout.config_to_hf(model.config)  # refuses configs the architecture cannot express
    blocks: dict[str, dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for _, leaf, source in leaf_sources(layout, model, model.config):
        host = to_host(leaf)
        for i, name in enumerate(source.names):
            value = host[i] if source.stacked else host
            value = value.T if source.transpose else value
            if source.part is None:
                tensors[name] = np.ascontiguousarray(value)
            else:
                blocks.setdefault(name, {})[source.part[0]] = value
    for name, parts in blocks.items():
        tensors[name] = np.ascontiguousarray(np.concatenate([parts[k] for k in sorted(parts)], axis=-1))
    return tensors


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
    floating = {str(t.dtype) for t in tensors.values() if np.issubdtype(t.dtype, np.floating) or t.dtype.kind == "V"}
    return floating.pop() if len(floating) == 1 else "float32"


def save_pretrained(model: Encoder | Transformer, directory: str | os.PathLike) -> None:
    """Write `model` as a Hugging Face checkpoint that `transformers` loads as is.

    **Arguments:**

    - `model`: a `zoo.models.Encoder`, written as `BertModel` (no pooler: loading it into
      `BertModel` leaves the pooler freshly initialised, `last_hidden_state` is exact), or
      a GPT-2-shaped `zoo.models.Transformer`, written as `GPT2LMHeadModel`. Configs the
      architecture cannot express (RoPE, RMSNorm, grouped-query attention, SwiGLU, no
      biases, post-norm for GPT-2) raise a `ValueError` naming them. May be sharded; LoRA
      branches must be merged first (`zoo.lora.merge`).
    - `directory`: created if needed. `model.safetensors` and `config.json` in it are
      replaced atomically (a temporary file next to each, then `os.replace`; weights
      first, config last); other files are left alone.

    Tensors keep the leaves' dtype. In a multi-process run every process must call it
    (sharded leaves are gathered); process 0 writes. `zoo.hf.from_pretrained` of the
    result gives back `model`'s leaves bit for bit.
    """
    layout = _layout_of(model)
    values = layout.config_to_hf(model.config)
    tensors = hf_tensors(model)
    if jax.process_index() != 0:
        return
    values["dtype"] = _dtype_name(tensors)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(
        directory / WEIGHTS_NAME,
        lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"}),
    )
    text = json.dumps(values, indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    fsync_dir(directory)


__all__ = ["hf_tensors", "save_pretrained"]
