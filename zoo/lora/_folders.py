"""Several named adapters in one folder, laid out as peft's `save_pretrained` writes them:
the adapter named `"default"` at the root, every other one in a subfolder of its name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jaxtyping import PRNGKeyArray

from ._config import LoraConfig
from ._io import CONFIG_NAME, load_adapter, save_adapter
from ._named import stack_adapters
from ._weighted import named

DEFAULT = "default"  # peft's name for the adapter at the folder's root


def save_adapters(
    model: Any,
    configs: Mapping[str, LoraConfig],
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
) -> list[Path]:
    """Write every named adapter of `model` as peft's `save_pretrained` does: `"default"`
    at `directory`, each other adapter `name` at `directory/name` (each a `save_adapter`
    folder). peft opens it with `PeftModel.from_pretrained(base, directory)` and
    `load_adapter(directory/name, adapter_name=name)`; zoo with `load_adapters`.

    **Arguments:** `model` holding named adapters (or a plain LoRA model: `"default"`),
    `configs` (name → the `LoraConfig` each was added with, as `load_adapters` and
    `add_weighted_adapter` return them), `directory`, `base_model_name_or_path` (as
    `save_adapter`'s). **Returns:** the paths written.
    """
    adapters, _, _ = named(model)
    if not adapters:
        raise ValueError("save_adapters: this model holds no adapters (zoo.lora.add_adapter adds them)")
    missing = [n for n in adapters if n not in configs]
    if missing:
        raise ValueError(
            f"save_adapters: configs lacks {missing}: give the LoraConfig of every adapter {list(adapters)}"
        )
    for name in adapters:
        if name != DEFAULT and (not name or name in (".", "..") or "/" in name or os.sep in name):
            raise ValueError(f"save_adapters: adapter name {name!r} cannot be a folder name: rename it")
    directory = Path(directory)
    written: list[Path] = []
    for name, single in adapters.items():
        where = directory if name == DEFAULT else directory / name
        written += save_adapter(single, configs[name], where, base_model_name_or_path=base_model_name_or_path)
    return written


def load_adapters(
    model: Any, directory: str | os.PathLike, *, key: PRNGKeyArray | None = None
) -> tuple[Any, dict[str, LoraConfig]]:
    """Load every adapter of a folder peft's `save_pretrained` (or `save_adapters`) wrote
    with several adapters: the root's as `"default"`, each subfolder holding an
    `adapter_config.json` as its name (sorted); returns `(model, {name: config})`.

    **Arguments:** `model` the bare base, `directory`, `key` (as `load_adapter`'s). The
    returned model holds the adapters as named adapters (`MultiLoraLinear`), `"default"`
    (else the first) active.
    """
    if named(model)[0]:
        raise ValueError("load_adapters: give the bare base model (zoo.lora.unload(model)), not one holding adapters")
    directory = Path(directory)
    folders = {DEFAULT: directory} if (directory / CONFIG_NAME).is_file() else {}
    if directory.is_dir():
        for sub in sorted(directory.iterdir()):
            if sub.is_dir() and (sub / CONFIG_NAME).is_file():
                if sub.name == DEFAULT:
                    raise ValueError(f"{sub}: peft keeps the adapter named 'default' at the root, not in a subfolder")
                folders[sub.name] = sub
    if not folders:
        raise FileNotFoundError(
            f"{directory}: no adapter ({CONFIG_NAME}) at the root or in a subfolder: give a folder peft's "
            "save_pretrained or zoo.lora.save_adapters wrote"
        )
    key = jax.random.key(0) if key is None else key
    models, configs = {}, {}
    for i, (name, where) in enumerate(folders.items()):
        models[name], configs[name] = load_adapter(model, where, key=jax.random.fold_in(key, i))
    return stack_adapters(models), configs
