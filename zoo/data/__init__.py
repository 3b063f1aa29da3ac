"""Datasets made from real text that ships with Python: nothing is downloaded."""

from ._bytes import (
    ByteCorpus,
    byte_tokens,
    english_prose,
    fixed_windows,
    pydoc_topic_texts,
    random_windows,
    split_files,
    stdlib_code,
    stdlib_source_files,
)
from ._docstrings import DOCSTRING_PACKAGES, TextClassification, stdlib_docstrings

__all__ = [
    "DOCSTRING_PACKAGES",
    "ByteCorpus",
    "TextClassification",
    "byte_tokens",
    "english_prose",
    "fixed_windows",
    "pydoc_topic_texts",
    "random_windows",
    "split_files",
    "stdlib_code",
    "stdlib_docstrings",
    "stdlib_source_files",
]
