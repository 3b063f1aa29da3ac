"""Hugging Face `BertForSequenceClassification` (and RoBERTa's, XLM-RoBERTa's) ↔
`zoo.models.EncoderClassifier` with the model's own pooling (the first token's state
through a dense layer and tanh: BERT's `bert.pooler.dense`, RoBERTa's `classifier.dense`):
read (`load_bert_classifier`) and written (`save_bert_classifier`). The tensor names are
the family's (`sequence_classifier`, `classifier_modules`, `new_pooler` in
`zoo/hf/_families/`)."""

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
from ._family import Family, families, family_of, get_family
from ._files import CONFIG_NAME, WEIGHTS_NAME, Checkpoint, read_config
from ._hub import resolve_model_dir
from ._load import load_family

_PARAMS = ("weight", "bias")  # each classifier module's tensors, transposed weights (torch `[out, in]`)


def _classifier_family(path: Path) -> Family:
    """The family of an encoder folder that has a sequence classifier (BERT, RoBERTa, XLM-RoBERTa)."""
    family = get_family(read_config(path).get("model_type", "bert"), str(path / CONFIG_NAME))
    if getattr(family, "sequence_classifier", None) is None:
        readable = sorted(n for n, f in families().items() if getattr(f, "sequence_classifier", None))
        raise ValueError(
            f"{str(path)!r} is a {family.name!r} model; load_bert_classifier reads the sequence classifiers of "
            f"{readable}"
        )
    return family


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
    are `BertForSequenceClassification`'s (in eval mode). A RoBERTa or XLM-RoBERTa folder
    likewise: the encoder under `roberta.`, the pooler from `classifier.dense.*`, the head
    from `classifier.out_proj.*` (`RobertaForSequenceClassification`'s logits).

    **Arguments:**

    - `path`: a `BertForSequenceClassification` folder; or a `BertModel` folder (its
      `pooler.dense.*`) with `num_labels`, for a new head (normal(0, `initializer_range`)
      weights, zero bias, from `key`, default `jax.random.key(0)`), as
      `BertForSequenceClassification.from_pretrained` starts fine-tuning (a
      `RobertaModel` / `XLMRobertaModel` folder: a new pooler too, as RoBERTa's is the
      task head's).
    - `num_labels`: the number of classes; checked against the file's head if it has one.
    - `rules`, `mesh`, `dtype`, `config_overrides`: as `zoo.hf.from_pretrained`; the pooler and
      head take the sharding their annotations give under the same rules (replicated
      without them).

    Raises a `ValueError` when a BERT file holds no pooler (zoo's own BERT export has
    none), when the file holds no head and no `num_labels`, or when its `model_type` is
    none of these.
    """
    path = resolve_model_dir(path)
    family = _classifier_family(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tensors of a task head.*")
        encoder = load_family(family.name, path, rules=rules, mesh=mesh, dtype=dtype, config_overrides=config_overrides)
    d = encoder.config.d_model
    with Checkpoint(path) as checkpoint:
        keys = set(checkpoint.keys())

        def read(module: str, param: str) -> np.ndarray | None:
            names = [f"{m}.{param}" for m in family.classifier_modules[module]]
            name = next((n for n in names if n in keys), None)
            return None if name is None else checkpoint.read(name, ())

        pooler = {param: read("pooler", param) for param in _PARAMS}
        head = {param: read("head", param) for param in _PARAMS}
    if any(v is None for v in pooler.values()) and family.new_pooler:
        if any(v is not None for v in head.values()) or num_labels is None:
            raise ValueError(
                f"{str(path)!r} holds no {family.classifier_modules['pooler'][0]}.* for its classifier head"
                + ("" if num_labels is not None else ": pass num_labels= for a new head (and pooler)")
            )
        pooler = None
    elif any(v is None for v in pooler.values()):
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
    if (pooler is not None and pooler["weight"].shape != (d, d)) or (head is not None and head["weight"].shape[1] != d):
        raise ValueError(f"{str(path)!r}: the pooler / classifier weights do not fit hidden_size {d}")
    model = EncoderClassifier(encoder, num_labels, pooling="cls", key=jax.random.key(0) if key is None else key)
    if pooler is not None:
        values = {("pooler", "weight"): pooler["weight"].T, ("pooler", "bias"): pooler["bias"]}
    else:  # RoBERTa's pooler is the task head's: new, as the head
        values = {("pooler", p): np.asarray(getattr(model.pooler, p)) for p in _PARAMS}
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
    Hugging Face `BertForSequenceClassification` folder (`RobertaForSequenceClassification`,
    `XLMRobertaForSequenceClassification` for those encoders): transformers'
    `AutoModelForSequenceClassification.from_pretrained(directory)` computes its logits,
    and `load_bert_classifier(directory)` reads it back.

    The encoder as `zoo.hf.save_pretrained` writes it (its tensors under `bert.`; RoBERTa's
    under `roberta.`), the pooler as `bert.pooler.dense.*` and the head as `classifier.*`
    (RoBERTa's: `classifier.dense.*`, `classifier.out_proj.*`; torch's `[out, in]` layout);
    config.json's `architectures` is `["BertForSequenceClassification"]` (or RoBERTa's),
    `id2label` / `label2id` name the classes (`label_names`, default `LABEL_i`).

    **Returns:** the paths written (none on processes other than 0). Raises `ValueError`
    for a mean-pooled classifier (no Hugging Face class computes its logits) and as
    `save_pretrained`.
    """
    family = family_of(model.encoder)
    architecture = getattr(family, "sequence_classifier", None)
    if architecture is None:
        raise ValueError(f"a {family.name!r} encoder has no Hugging Face sequence classifier zoo writes")
    if model.pooling != "cls":
        raise ValueError(
            f"a {model.pooling}-pooled classifier is no {architecture} (which reads the first token's state "
            "through the pooler); write its encoder with zoo.hf.save_pretrained and its head apart"
        )
    names = list(label_names) if label_names is not None else [f"LABEL_{i}" for i in range(model.num_labels)]
    if len(names) != model.num_labels:
        raise ValueError(f"{len(names)} label names for a classifier of {model.num_labels} labels")
    extra = {}
    for module in ("pooler", "head"):
        leaf, name = getattr(model, module), family.classifier_modules[module][0]
        extra |= {f"{name}.weight": to_host(leaf.weight).T, f"{name}.bias": to_host(leaf.bias)}
    written = save_pretrained(model.encoder, directory)
    if jax.process_index() != 0:
        return written
    directory = Path(directory)
    with Checkpoint(directory) as checkpoint:
        tensors = {
            (k if k.startswith(family.prefix) else family.prefix + k): np.array(checkpoint.read(k, ()))
            for k in checkpoint.keys()
        }
    tensors |= {k: np.ascontiguousarray(v) for k, v in extra.items()}
    atomic_write(
        directory / WEIGHTS_NAME, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
    )
    config = json.loads((directory / CONFIG_NAME).read_text())
    config |= {
        "architectures": [architecture],
        "id2label": {str(i): n for i, n in enumerate(names)},
        "label2id": {n: i for i, n in enumerate(names)},
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))
    return written


__all__ = ["load_bert_classifier", "save_bert_classifier"]
