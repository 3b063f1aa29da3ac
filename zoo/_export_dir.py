"""Where an export may write: a folder that is missing, empty, or already an export of its
kind, so that `zoo.hf.save_pretrained` and `zoo.lora.save_adapter` never replace a user's
file that happens to carry one of their names.

The rule is transformers' and peft's (`save_pretrained` replaces the files of its own names
and leaves the others) with one guard: a folder that holds a file of those names but is
not such an export (no config naming the format, no readable weights file) is refused,
naming the files. Nothing is ever deleted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import safetensors


def _json_has(path: Path, key: str) -> bool:
    """Whether `path` is a JSON object with `key`."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(value, dict) and key in value


def is_safetensors(path: Path) -> bool:
    """Whether safetensors reads `path` as a safetensors file (its header parses)."""
    try:
        with safetensors.safe_open(str(path), framework="numpy"):
            return True
    except Exception:  # safetensors raises its own error types, or OSError: not one
        return False


def check_export_dir(
    directory: str | Path, names: Iterable[str], *, writer: str, config: str, key: str, weights: str, kind: str
) -> None:
    """Refuse to write the files `names` into `directory` when some already exist there and
    the folder is not an export of this kind: its `config` file is no JSON object with
    `key`, and its `weights` file (what an interrupted save leaves alone: weights are
    written first) is no safetensors file.

    **Arguments:** `writer` (the function, for the message), `kind` (what the folder would
    be, e.g. "a Hugging Face model folder").

    **Raises:** `FileExistsError` naming the files and the fix.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return
    taken = sorted(name for name in set(names) if (directory / name).exists())
    if not taken or _json_has(directory / config, key) or is_safetensors(directory / weights):
        return
    raise FileExistsError(
        f"{writer}: {directory} holds {', '.join(taken)}, which it would replace, and is not {kind} (no {config} "
        f'with "{key}", no {weights}); write into another folder, or move those files away first'
    )
