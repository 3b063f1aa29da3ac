"""Data for training: a user's own files (`load`: `.txt`, `.jsonl`, `.csv`, tokenised with
the model's tokenizer, packed, split and batched), datasets made from real text that ships
with Python (nothing is downloaded), and what a training task draws its batches from
(`BatchSource`: the batch of any step, this process's rows of it)."""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._bytes": (
            "ByteCorpus",
            "byte_tokens",
            "english_prose",
            "fixed_windows",
            "pydoc_topic_texts",
            "random_windows",
            "split_files",
            "stdlib_code",
            "stdlib_source_files",
        ),
        "._chat": ("ChatTemplate",),
        "._dataset": ("Dataset", "describe", "load"),
        "._docstrings": ("DOCSTRING_PACKAGES", "TextClassification", "stdlib_docstrings"),
        "._packing": ("pack",),
        "._preference": ("preference_rows",),
        "._records": ("DataFormatError", "read_records"),
        "._source": ("BatchSource", "local_batch"),
        "._word_order": ("WORD_ORDER_CORRUPTIONS", "docstring_word_order"),
    },
)

if TYPE_CHECKING:
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
    from ._chat import ChatTemplate
    from ._dataset import Dataset, describe, load
    from ._docstrings import DOCSTRING_PACKAGES, TextClassification, stdlib_docstrings
    from ._packing import pack
    from ._preference import preference_rows
    from ._records import DataFormatError, read_records
    from ._source import BatchSource, local_batch
    from ._word_order import WORD_ORDER_CORRUPTIONS, docstring_word_order

__all__ = [
    "DOCSTRING_PACKAGES",
    "WORD_ORDER_CORRUPTIONS",
    "BatchSource",
    "ByteCorpus",
    "ChatTemplate",
    "DataFormatError",
    "Dataset",
    "TextClassification",
    "byte_tokens",
    "describe",
    "docstring_word_order",
    "english_prose",
    "fixed_windows",
    "load",
    "local_batch",
    "pack",
    "preference_rows",
    "pydoc_topic_texts",
    "random_windows",
    "read_records",
    "split_files",
    "stdlib_code",
    "stdlib_docstrings",
    "stdlib_source_files",
]
