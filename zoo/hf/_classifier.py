"""Hugging Face `BertForSequenceClassification` ↔ `zoo.models.EncoderClassifier` with
BERT's own pooling (the `[CLS]` state through `bert.pooler.dense` and tanh): read
(`load_bert_classifier`) and written (`save_bert_classifier`)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jaxtyping import PRNGKeyArray

from .._files import atomic_write, to_host
from .._presets import rules as preset_rules
from .._rules import Rules, _concrete_mesh, partition_specs
from ..models import EncoderClassifier
from ._export import save_pretrained
from ._files import CONFIG_NAME, WEIGHTS_NAME, Checkpoint
from ._hub import resolve_model_dir
from ._load import load_family

# classifier leaf → checkpoint tensor names (task-model file, bare BertModel file), transposed
_POOLER = {
    "weight": ("bert.pooler.dense.weight", "pooler.dense.weight"),
    "bias": ("bert.pooler.dense.bias", "pooler.dense.bias"),
}
_HEAD = {"weight": "classifier.weight", "bias": "classifier.bias"}


def load_bert_classifier(
    path: str | os.PathLike,
    *,
    num_labels: int | None = None,
    key: PRNGKeyArray | None = None,
    rules: Rules | None = None,
    mesh: Any = None,
    dtype: Any = jnp.float32,
    config_overrides: Mapping[str, Any] | None = None,
) -> EncoderClassifier:
    """A `zoo.models.EncoderClassifier(pooling="cls")` holding a Hugging Face BERT
    classifier: the encoder (`bert.*`, as `from_pretrained`), the pooler
    (`bert.pooler.dense.*`) and the head (`classifier.*`, its rows the labels). Its logits
    are `BertForSequenceClassification`'s (in eval mode).

    **Arguments:**

    - `path`: a `BertForSequenceClassification` folder; or a `BertModel` folder (its
      `pooler.dense.*`) with `num_labels`, for a new head (normal(0, `initializer_range`)
      weights, zero bias, from `key`, default `jax.random.key(0)`), as
      `BertForSequenceClassification.from_pretrained` starts fine-tuning.
    - `num_labels`: the number of classes; checked against the file's head if it has one.
    - `rules`, `mesh`, `dtype`, `config_overrides`: as `zoo.hf.from_pretrained`; the pooler and
      head take the sharding their annotations give under the same rules (replicated
      without them).

    Raises a `ValueError` when the file holds no pooler (zoo's own BERT export has none),
    or no head and no `num_labels`.
    """
    path = resolve_model_dir(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tensors of a task head.*")
        encoder = load_family("bert", path, rules=rules, mesh=mesh, dtype=dtype, config_overrides=config_overrides)
    d = encoder.config.d_model
    with Checkpoint(path) as checkpoint:
        keys = set(checkpoint.keys())

        def read(*names: str) -> np.ndarray | None:
            name = next((n for n in names if n in keys), None)
            return None if name is None else checkpoint.read(name, ())

        pooler = {param: read(*names) for param, names in _POOLER.items()}
        head = {param: read(name) for param, name in _HEAD.items()}
    if any(v is None for v in pooler.values()):
        raise ValueError(
            f"{str(path)!r} holds no BERT pooler (bert.pooler.dense.* or pooler.dense.*), which "
            "BertForSequenceClassification classifies through; zoo's own BERT export has none. Use a "
            "mean-pooling zoo.models.EncoderClassifier(zoo.hf.from_pretrained(path), num_labels, key=...) instead."
        )
    if any(v is None for v in head.values()):
        if num_labels is None:
            raise ValueError(
                f"{str(path)!r} holds no classifier.* head (a BertModel checkpoint?): pass num_labels= for a new one"
            )
        head = None
    else:
        found = head["weight"].shape[0]
        if num_labels is not None and num_labels != found:
            raise ValueError(f"{str(path)!r} has a head for {found} labels, not num_labels={num_labels}")
        num_labels = found
    if pooler["weight"].shape != (d, d) or (head is not None and head["weight"].shape[1] != d):
        raise ValueError(f"{str(path)!r}: the pooler / classifier weights do not fit hidden_size {d}")
    model = EncoderClassifier(encoder, num_labels, pooling="cls", key=jax.random.key(0) if key is None else key)
    values = {("pooler", "weight"): pooler["weight"].T, ("pooler", "bias"): pooler["bias"]}
    if head is not None:
        values |= {("head", "weight"): head["weight"].T, ("head", "bias"): head["bias"]}
    else:  # the new head, in the parameters' dtype and placed like the rest
        values |= {("head", "weight"): np.asarray(model.head.weight), ("head", "bias"): np.asarray(model.head.bias)}
    specs = concrete = None
    if rules is not None or mesh is not None:
        concrete = _concrete_mesh(mesh)
        specs = partition_specs(model, preset_rules("dp") if rules is None else rules, concrete)
    new = []
    for (module, param), value in values.items():
        value = np.asarray(value).astype(jnp.dtype(dtype))
        if specs is None:
            new.append(jnp.asarray(value))
        else:
            spec = getattr(getattr(specs, module), param)
            new.append(jax.device_put(value, jax.sharding.NamedSharding(concrete, spec)))
    return eqx.tree_at(lambda m: [getattr(getattr(m, mod), p) for mod, p in values], model, replace=new)


def save_bert_classifier(
    model: EncoderClassifier, directory: str | os.PathLike, *, label_names: list[str] | None = None
) -> list[Path]:
    """Write a `pooling="cls"` `zoo.models.EncoderClassifier` (LoRA merged first) as a
    Hugging Face `BertForSequenceClassification` folder: transformers'
    `AutoModelForSequenceClassification.from_pretrained(directory)` computes its logits,
    and `load_bert_classifier(directory)` reads it back.

    The encoder as `zoo.hf.save_pretrained` writes it (its tensors under `bert.`), the
    pooler as `bert.pooler.dense.*` and the head as `classifier.*` (torch's `[out, in]`
    layout); config.json's `architectures` is `["BertForSequenceClassification"]`,
    `id2label` / `label2id` name the classes (`label_names`, default `LABEL_i`).

    **Returns:** the paths written (none on processes other than 0). Raises `ValueError`
    for a mean-pooled classifier (no Hugging Face class computes its logits) and as
    `save_pretrained`.
    """
    if model.pooling != "cls":
        raise ValueError(
            f"a {model.pooling}-pooled classifier is no BertForSequenceClassification (which reads the [CLS] state "
            "through the pooler); write its encoder with zoo.hf.save_pretrained and its head apart"
        )
    names = list(label_names) if label_names is not None else [f"LABEL_{i}" for i in range(model.num_labels)]
    if len(names) != model.num_labels:
        raise ValueError(f"{len(names)} label names for a classifier of {model.num_labels} labels")
    extra = {
        "bert.pooler.dense.weight": to_host(model.pooler.weight).T,
        "bert.pooler.dense.bias": to_host(model.pooler.bias),
        "classifier.weight": to_host(model.head.weight).T,
        "classifier.bias": to_host(model.head.bias),
    }
    written = save_pretrained(model.encoder, directory)
    if jax.process_index() != 0:
        return written
    directory = Path(directory)
    with Checkpoint(directory) as checkpoint:
        tensors = {
            (k if k.startswith("bert.") else f"bert.{k}"): np.array(checkpoint.read(k, ())) for k in checkpoint.keys()
        }
    tensors |= {k: np.ascontiguousarray(v) for k, v in extra.items()}
    atomic_write(
        directory / WEIGHTS_NAME, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
    )
    config = json.loads((directory / CONFIG_NAME).read_text())
    config |= {
        "architectures": ["BertForSequenceClassification"],
        "id2label": {str(i): n for i, n in enumerate(names)},
        "label2id": {n: i for i, n in enumerate(names)},
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    return written


__all__ = ["load_bert_classifier", "save_bert_classifier"]
