"""Hugging Face `BertForSequenceClassification` → `zoo.models.EncoderClassifier` with
BERT's own pooling (the `[CLS]` state through `bert.pooler.dense` and tanh)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._rules import Rules
from ..models import EncoderClassifier
from ._files import Checkpoint
from ._load import load_bert

# classifier leaf → (checkpoint tensor, transposed)
_HEAD = {
    ("pooler", "weight"): ("bert.pooler.dense.weight", True),
    ("pooler", "bias"): ("bert.pooler.dense.bias", False),
    ("head", "weight"): ("classifier.weight", True),
    ("head", "bias"): ("classifier.bias", False),
}


def load_bert_classifier(
    path: str | os.PathLike,
    *,
    rules: Rules | None = None,
    mesh: Any = None,
    dtype: Any = jnp.float32,
    config_overrides: Mapping[str, Any] | None = None,
) -> EncoderClassifier:
    """A `zoo.models.EncoderClassifier(pooling="cls")` holding a Hugging Face
    `BertForSequenceClassification` checkpoint: the encoder (`bert.*`, as `load_bert`),
    the pooler (`bert.pooler.dense.*`) and the head (`classifier.*`, its rows the labels).
    Its logits are the HF model's (in eval mode).

    **Arguments:** as `zoo.hf.load_bert` (`path`, `rules`, `mesh`, `dtype`,
    `config_overrides`); the pooler and head take the sharding their annotations give
    under the same rules (replicated without them).

    Raises a `ValueError` naming the missing tensors when the file holds no pooler or no
    classifier (a `BertModel` or `BertForMaskedLM` checkpoint).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*tensors of a task head.*")
        encoder = load_bert(path, rules=rules, mesh=mesh, dtype=dtype, config_overrides=config_overrides)
    with Checkpoint(path) as checkpoint:
        keys = set(checkpoint.keys())
        missing = [name for name, _ in _HEAD.values() if name not in keys]
        if missing:
            raise ValueError(
                f"{str(path)!r} holds no {', '.join(missing)}: it is not a BertForSequenceClassification "
                "checkpoint (load a BertModel with zoo.hf.load_bert and add a head with "
                "zoo.models.EncoderClassifier(encoder, num_labels, key=...))"
            )
        values = {leaf: checkpoint.read(name, ()) for leaf, (name, _) in _HEAD.items()}
    values = {leaf: (v.T if _HEAD[leaf][1] else v) for leaf, v in values.items()}
    num_labels = values[("head", "weight")].shape[1]
    d = encoder.config.d_model
    if values[("pooler", "weight")].shape != (d, d) or values[("head", "weight")].shape[0] != d:
        raise ValueError(
            f"{str(path)!r}: the pooler / classifier weights have shapes "
            f"{list(values[('pooler', 'weight')].shape)} / {list(values[('head', 'weight')].shape)} (zoo layout), "
            f"but hidden_size is {d}"
        )
    model = EncoderClassifier(encoder, num_labels, pooling="cls", key=jax.random.key(0))
    leaves = [getattr(getattr(model, module), param) for module, param in _HEAD]
    sharding = None
    if rules is not None or mesh is not None:
        from .._rules import _concrete_mesh, partition_specs
        from .._rules import rules as preset_rules

        concrete = _concrete_mesh(mesh)
        specs = partition_specs(model, preset_rules("dp") if rules is None else rules, concrete)
        sharding = [jax.sharding.NamedSharding(concrete, getattr(getattr(specs, m), p)) for m, p in _HEAD]
    new = []
    for i, (leaf, value) in enumerate(zip(leaves, values.values(), strict=True)):
        value = np.asarray(value, dtype=jnp.dtype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf.dtype)
        new.append(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding[i]))
    model = eqx.tree_at(lambda m: [getattr(getattr(m, mod), p) for mod, p in _HEAD], model, replace=new)
    return model


__all__ = ["load_bert_classifier"]
