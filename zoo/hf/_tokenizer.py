"""A Hugging Face fast tokenizer (`tokenizer.json`) producing the zoo's batch arrays."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tokenizers

from ._files import read_json

DEFAULT_MAX_LEN = 512
PADDING_SIDES = ("right", "left")


@runtime_checkable
class _Array(Protocol):
    """A numpy or jax array (or anything `np.asarray` reads as one); named without
    importing jax, which loading a tokenizer does not need."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray: ...


def _check_side(padding_side: str) -> str:
    if padding_side not in PADDING_SIDES:
        raise ValueError(
            f"padding_side must be 'right' (padding after each text) or 'left' (before it), got {padding_side!r}"
        )
    return padding_side


class Tokenizer:
    """Texts → `{"tokens", "mask", "token_types"}` numpy arrays `[batch, seq]` for zoo models.

    Wraps `tokenizers.Tokenizer` (the Rust library behind transformers' fast tokenizers)
    loaded from a model folder's `tokenizer.json`; no transformers, no torch. Special
    tokens are added as the file's post-processor says (`[CLS] … [SEP]` for BERT), exactly
    as `transformers.AutoTokenizer` and sentence-transformers do.

    Attributes: `tokenizer` (the wrapped `tokenizers.Tokenizer`), `max_len` (default
    truncation length), `pad_id`, `pad_type_id`, `padding_side` (`"right"` or `"left"`:
    where a call pads unless it says, as transformers' `tokenizer.padding_side`).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        max_len: int = DEFAULT_MAX_LEN,
        pad_id: int = 0,
        pad_type_id: int = 0,
        padding_side: str = "right",
    ):
        """**Arguments:** a `tokenizers.Tokenizer` (its own padding and truncation settings
        are switched off: this class pads and truncates), the default `max_len`, the
        padding token id `pad_id` and segment id `pad_type_id`, and the default
        `padding_side` (`"right"`, or `"left"`)."""
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.pad_id = pad_id
        self.pad_type_id = pad_type_id
        self.padding_side = _check_side(padding_side)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, max_len: int | None = None, padding_side: str = "right"
    ) -> Tokenizer:
        """The tokenizer of a model folder.

        **Arguments:**

        - `path`: a folder holding `tokenizer.json` (a Hugging Face or sentence-transformers
          model folder, e.g. `zoo.hf.minilm_path()`).
        - `max_len`: the default truncation length. Default: `max_seq_length` of
          `sentence_bert_config.json` when present (the length sentence-transformers
          truncates to), else `model_max_length` of `tokenizer_config.json` when it is a
          real limit, else 512.
        - `padding_side`: where calls pad by default, `"right"` (the default: the layout
          the zoo's encoders and training batches use) or `"left"` (prompts for
          `zoo.generate`, which takes either). transformers takes its default from
          `tokenizer_config.json`'s `padding_side`; the zoo pads on the right unless told.

        The padding id is the one `tokenizer.json`'s padding section names, else the id of
        the `pad_token` of `tokenizer_config.json` / `special_tokens_map.json`, else 0
        (the mask marks padding either way).
        """
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{str(folder)!r} holds no tokenizer.json; zoo.hf.Tokenizer reads fast-tokenizer files only "
                "(save one with transformers: AutoTokenizer.from_pretrained(d).save_pretrained(d))"
            )
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
        padding = tokenizer.padding or {}
        pad_id, pad_type_id = padding.get("pad_id"), padding.get("pad_type_id", 0)
        tok_config = read_json(folder / "tokenizer_config.json") or {}
        if pad_id is None:
            pad_token = tok_config.get("pad_token") or (read_json(folder / "special_tokens_map.json") or {}).get(
                "pad_token"
            )
            if isinstance(pad_token, dict):  # {"content": "[PAD]", ...}
                pad_token = pad_token.get("content")
            pad_id = tokenizer.token_to_id(pad_token) if isinstance(pad_token, str) else None
        if max_len is None:
            st_config = read_json(folder / "sentence_bert_config.json") or {}
            model_max = tok_config.get("model_max_length")
            if st_config.get("max_seq_length"):
                max_len = int(st_config["max_seq_length"])
            elif isinstance(model_max, int) and model_max <= 1_000_000:  # transformers writes 1e30 for "none"
                max_len = model_max
            else:
                max_len = DEFAULT_MAX_LEN
        pad_id = 0 if pad_id is None else pad_id
        return cls(tokenizer, max_len=max_len, pad_id=pad_id, pad_type_id=pad_type_id, padding_side=padding_side)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(
        self,
        texts: str | Sequence[str],
        *,
        max_len: int | None = None,
        pad_to: int | None = None,
        padding_side: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Tokenize a batch of texts.

        **Arguments:**

        - `texts`: a list of strings (or one string: a batch of one).
        - `max_len`: truncate each text to this many tokens, special tokens included
          (default `self.max_len`).
        - `pad_to`: pad every row to this length (default: to the longest row). Must be
          at least the longest row.
        - `padding_side`: `"right"` (padding after each text) or `"left"` (before it, as
          prompts for `zoo.generate`); default `self.padding_side`. The same arrays as
          transformers' tokenizer with that `padding_side`.

        **Returns:** `{"tokens": int32, "mask": bool, "token_types": int32}`, each
        `[batch, seq]`, padded with `pad_id` (mask `False`, token type `pad_type_id`) —
        the keys `zoo.models.Encoder` and its losses read.
        """
        if isinstance(texts, str):
            texts = [texts]
        side = _check_side(self.padding_side if padding_side is None else padding_side)
        max_len = self.max_len if max_len is None else max_len
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.tokenizer.enable_truncation(max_len)
        encodings = self.tokenizer.encode_batch(list(texts))
        longest = max((len(e.ids) for e in encodings), default=0)
        seq = longest if pad_to is None else pad_to
        if seq < longest:
            raise ValueError(
                f"pad_to={pad_to} is shorter than the longest tokenized text ({longest} tokens); "
                f"pass max_len={pad_to} to truncate to it"
            )
        tokens = np.full((len(encodings), seq), self.pad_id, np.int32)
        types = np.full((len(encodings), seq), self.pad_type_id, np.int32)
        mask = np.zeros((len(encodings), seq), bool)
        for row, e in enumerate(encodings):
            n = len(e.ids)
            cols = slice(0, n) if side == "right" else slice(seq - n, seq)
            tokens[row, cols] = e.ids
            types[row, cols] = e.type_ids
            mask[row, cols] = np.asarray(e.attention_mask, bool)
        return {"tokens": tokens, "mask": mask, "token_types": types}

    def decode(self, ids: Sequence[int] | _Array, *, skip_special_tokens: bool = True) -> str:
        """The text of one row of ids (a list, a numpy or a jax array; special tokens, hence
        BERT's padding, dropped by default)."""
        return self.tokenizer.decode([int(i) for i in np.asarray(ids)], skip_special_tokens=skip_special_tokens)
