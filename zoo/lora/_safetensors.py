"""An adapter's tensors on disk: the hash that ties `adapter_model.safetensors` (and a
classifier's `head.safetensors`) to `zoo_adapter.json`, the folder's files written
atomically, weights first, and a tensors file read back checked against its recorded hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
import safetensors.numpy

from .._export_dir import check_export_dir
from .._files import atomic_write, fsync_dir
from ._peft_config import CONFIG_NAME, FILE_NAMES, HEAD_NAME, WEIGHTS_NAME, ZOO_NAME, _json_safe


def tensors_sha256(tensors: dict[str, np.ndarray]) -> str:
    """A SHA-256 of the tensors' contents: each name, dtype, shape and bytes, by name.

    Unlike a hash of the file, it does not change when a tool rewrites the file with the
    same tensors (another header order, other metadata, other padding)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        digest.update(json.dumps([name, str(value.dtype), list(value.shape)]).encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _write(
    directory: Path,
    tensors: dict[str, np.ndarray],
    values: dict[str, Any],
    meta: dict[str, Any],
    apart: dict[str, np.ndarray],
) -> list[Path]:
    """An adapter's files into `directory` (refused if it holds a user's files of their
    names), weights first; the paths written."""
    check_export_dir(
        directory,
        FILE_NAMES,
        writer="zoo.lora.save_adapter",
        config=CONFIG_NAME,
        key="peft_type",
        weights=WEIGHTS_NAME,
        kind="a LoRA adapter folder",
    )
    directory.mkdir(parents=True, exist_ok=True)
    written = [WEIGHTS_NAME] + ([HEAD_NAME] if apart else []) + [CONFIG_NAME, ZOO_NAME]
    for name, arrays in ((WEIGHTS_NAME, tensors), (HEAD_NAME, apart)):
        if arrays:
            atomic_write(
                directory / name, lambda tmp, a=arrays: safetensors.numpy.save_file(a, tmp, metadata={"format": "pt"})
            )
    for file, contents in ((CONFIG_NAME, values), (ZOO_NAME, meta)):
        text = json.dumps(_json_safe(contents), indent=2, sort_keys=True) + "\n"
        atomic_write(directory / file, lambda tmp, text=text: Path(tmp).write_text(text))
    fsync_dir(directory)
    return [directory / name for name in written]


def _read_checked(path: Path, recorded: str | None, advice: str) -> dict[str, np.ndarray]:
    """The tensors of the safetensors file `path`, checked against the SHA-256 zoo_adapter.json
    `recorded` for them (None: a peft file, unchecked); a `ValueError` ending in `advice`
    when they differ."""
    try:
        tensors = safetensors.numpy.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"cannot read {path}: {e}") from e
    if recorded is not None and tensors_sha256(tensors) != recorded:
        raise ValueError(
            f"the tensors in {path} are not the ones {path.parent / ZOO_NAME} records (their contents' SHA-256 "
            f"differs): {advice}"
        )
    return tensors
