"""A mean-pooling `EncoderClassifier`'s head, apart from peft's files: no Hugging Face class
computes its logits, so its adapter is its encoder's (`FEATURE_EXTRACTION`) and its head is
written whole to `head.safetensors` as torch's `nn.Linear` state dict, read back (checked
against zoo_adapter.json's hash) into the head. An adapter zoo wrote before it kept the
head apart (a `SEQ_CLS` one) still loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from .._files import to_host
from .._tree import key_path, node_at
from ._peft_config import HEAD_NAME, PREFIX, _first_diff
from ._safetensors import _read_checked


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


def _read_apart(
    tensors: dict[str, np.ndarray], values: dict[str, Any], meta: Any, names: Any, directory: Path
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`(peft's tensors, the head's)` of an adapter loaded into a mean-pooling classifier:
    the head from `head.safetensors` (checked against zoo_adapter.json's hash), or, from
    an adapter zoo wrote before it kept the head apart (a SEQ_CLS adapter of a mean-pooling
    classifier), taken out of peft's tensors, whose names lose the `bert.` prefix."""
    if names is None or not names.apart:
        return tensors, {}
    if values.get("task_type") == "SEQ_CLS" and isinstance(meta, dict) and meta.get("pooling") == "mean":
        old, head_name = PREFIX + names.family.prefix, PREFIX + names.module(names.apart[0]) + "."
        head = {k.removeprefix(head_name): v for k, v in tensors.items() if k.startswith(head_name)}
        rest = {
            (PREFIX + k.removeprefix(old) if k.startswith(old) else k): v
            for k, v in tensors.items()
            if not k.startswith(head_name)
        }
        return rest, head
    path = directory / HEAD_NAME
    if not path.is_file():
        return tensors, {}
    recorded = None if meta is None else meta.get("head_sha256")
    head = _read_checked(path, recorded, "the head was changed or its save was interrupted; save it again")
    return tensors, head


def _head_values(
    model: Any, names: Any, apart: dict[str, np.ndarray], directory: Path, meta: Any
) -> tuple[list[tuple], list[Any]]:
    """`(paths, values)` of the head's leaves from its file's tensors (torch's
    orientation), each like the leaf it replaces (dtype, placement); a `ValueError` when a
    shape differs."""
    head = key_path(model, names.apart[0])
    paths, new = [], []
    for param, value in sorted(apart.items(), reverse=True):  # weight, then bias
        old = node_at(model, head + (GetAttrKey(param),))
        value = np.asarray(value.T if param == "weight" else value).astype(old.dtype)
        if value.shape != old.shape:
            raise ValueError(
                f"{directory / HEAD_NAME}: {param} is {list(value.shape)} in zoo's layout, this "
                f"model's head holds {list(old.shape)}{_first_diff(model, meta)}"
            )
        paths.append(head + (GetAttrKey(param),))
        new.append(jax.device_put(value, old.sharding) if isinstance(old, jax.Array) else jnp.asarray(value))
    return paths, new
