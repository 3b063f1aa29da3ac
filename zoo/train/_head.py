"""A classifier run's files beside its exports: its label names (`labels.json`, written when
the run starts) and, when every weight trained, its head (`model/head.safetensors`: the
leaves of the `zoo.models.EncoderClassifier` outside its encoder, which
`zoo.hf.save_pretrained` does not write). A LoRA run's head is in its adapter
(`modules_to_save`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from .._files import atomic_write, to_host
from ._errors import ConfigError

LABELS_NAME = "labels.json"
HEAD_NAME = "head.safetensors"
_FORMAT = "zoo classifier head"
# The classifier's parts outside its encoder, in the order it applies them.
_PARTS = ("pooler", "head")


def read_labels(folder: Path) -> tuple[str, ...] | None:
    """The label names a run folder's labels.json holds (label `i` is the `i`-th), or None
    without one (a run of an older zoo, or no classifier).

    **Raises:** `ConfigError` for a labels.json that is there but damaged (not JSON, no
    list of names, a name repeated): reading on would name the classes wrongly."""
    path = folder / LABELS_NAME
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} is damaged ({type(e).__name__}: {str(e).splitlines()[0]}); restore it, or train the run again"
        ) from None
    labels = value.get("labels") if isinstance(value, dict) else None
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str | int) for x in labels):
        raise ConfigError(
            f'{path} is damaged: it holds no {{"labels": [names...]}}; restore it, or train the run again'
        )
    names = tuple(str(x) for x in labels)
    if len(set(names)) != len(names):
        raise ConfigError(f"{path} is damaged: a label name appears twice; restore it, or train the run again")
    return names


def head_tensors(model: Any) -> dict[str, np.ndarray]:
    """The classifier's leaves outside its encoder by name (`head.weight`, `head.bias`,
    `pooler.weight`, ... in zoo's `[in, out]` layout), as host numpy arrays."""
    out = {}
    for part in _PARTS:
        module = getattr(model, part, None)
        for field in ("weight", "bias"):
            leaf = getattr(module, field, None) if module is not None else None
            if leaf is not None:
                out[f"{part}.{field}"] = to_host(leaf)
    return out


def save_head(model: Any, directory: Path) -> list[Path]:
    """Write `head_tensors(model)` to `directory/head.safetensors` (atomically), its
    pooling and label count in the file's metadata. Every process calls it (sharded leaves
    are gathered); process 0 writes. **Returns:** the paths written (none on the others)."""
    path = Path(directory) / HEAD_NAME
    tensors = head_tensors(model)
    if jax.process_index() != 0:
        return []
    meta = {"format": _FORMAT, "pooling": str(model.pooling), "num_labels": str(model.num_labels)}
    atomic_write(path, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata=meta))
    return [path]


def load_head(model: Any, path: Path) -> Any:
    """`model` (an `EncoderClassifier` of the same pooling and label count) with the head
    of the file `save_head` wrote; a `ValueError` naming what does not fit."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        tensors = safetensors.numpy.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read {path}: {e}") from e
    if meta.get("pooling", model.pooling) != model.pooling:
        raise ValueError(
            f"{path} is the head of a {meta['pooling']}-pooled classifier, not a {model.pooling}-pooled one"
        )
    want = head_tensors(model)
    wrong = sorted(set(want) ^ set(tensors)) + [
        f"{k} {tensors[k].shape} (the model's: {v.shape})"
        for k, v in want.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    if wrong:
        raise ValueError(f"{path} does not fit this classifier: {', '.join(wrong)}")
    names = list(want)

    def leaves(m):
        return [getattr(getattr(m, name.split(".")[0]), name.split(".")[1]) for name in names]

    values = [jnp.asarray(tensors[n], dtype=leaf.dtype) for n, leaf in zip(names, leaves(model))]
    return eqx.tree_at(leaves, model, values)
