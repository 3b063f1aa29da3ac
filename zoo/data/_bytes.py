"""Byte-level text corpora that ship with Python: the standard library's sources (code) and
the language reference's topics (English prose), split into train and validation bytes."""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig

import numpy as np

STDLIB = sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """A text as bytes (tokens 0..255), split by document into train and validation.

    **Fields:** `name` (what the text is), `train` and `validation` (`uint8` arrays),
    `documents` (how many documents the split was made from).
    """

    name: str
    train: np.ndarray
    validation: np.ndarray
    documents: int


def stdlib_source_files(max_bytes: int, min_files: int = 10) -> list[bytes]:
    """The standard library's top-level `.py` files, in name order, up to `max_bytes` in
    all but at least `min_files` of them (where there are as many).

    Top-level files only: sub-folders hold the large, repetitive test suite and
    site-packages (whatever happens to be installed). Sorted by name, so the text (and the
    split of `split_files`) is the same on every run.
    """
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(STDLIB, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        if total + len(data) > max_bytes and len(parts) >= min_files:
            break
        parts.append(data)
        total += len(data)
    return parts


def pydoc_topic_texts() -> list[bytes]:
    """The language reference's topics (what `help('if')` prints), in topic-name order,
    each UTF-8 encoded and followed by a blank line."""
    from pydoc_data.topics import topics

    return [topics[name].encode("utf-8") + b"\n\n" for name in sorted(topics)]


def split_files(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes: every 10th part is validation, the rest training, so the
    validation text comes from files (modules, topics) the model never saw."""
    train = b"".join(p for i, p in enumerate(parts) if i % 10 != 9)
    val = b"".join(p for i, p in enumerate(parts) if i % 10 == 9)
    return np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8)


def stdlib_code(max_bytes: int = 4_000_000) -> ByteCorpus:
    """Python code: the standard library's top-level sources (`stdlib_source_files`), at
    most `max_bytes` (but at least 10 files), every 10th file held out for validation."""
    parts = stdlib_source_files(max_bytes, min_files=10)
    return ByteCorpus("Python stdlib sources", *split_files(parts), len(parts))


def english_prose() -> ByteCorpus:
    """English prose: `pydoc_data.topics` (the language reference's topics), every 10th
    topic held out for validation."""
    parts = pydoc_topic_texts()
    return ByteCorpus("pydoc_data.topics prose", *split_files(parts), len(parts))


def random_windows(rng: np.random.Generator, data: np.ndarray, batch: int, seq: int) -> np.ndarray:
    """`batch` windows of `seq` bytes at random offsets, as int32 tokens `[batch, seq]`."""
    starts = rng.integers(0, len(data) - seq + 1, size=batch)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


def fixed_windows(data: np.ndarray, count: int, seq: int) -> np.ndarray:
    """`count` evenly spaced windows of `seq` bytes: the same validation set every time."""
    starts = np.linspace(0, len(data) - seq, count).astype(np.int64)
    return data[starts[:, None] + np.arange(seq)].astype(np.int32)


def byte_tokens(texts: list[str], seq: int, *, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Texts as UTF-8 byte tokens: `(tokens int32 [n, seq], mask bool [n, seq])`, each row
    cut at `seq` bytes and right-padded with `pad_id` (0 by default: no text holds a NUL
    byte, so 0 is free to mark padding)."""
    tokens = np.full((len(texts), seq), pad_id, np.int32)
    mask = np.zeros((len(texts), seq), bool)
    for row, text in enumerate(texts):
        data = np.frombuffer(text.encode("utf-8")[:seq], np.uint8)
        tokens[row, : len(data)] = data
        mask[row, : len(data)] = True
    return tokens, mask
