"""Rows of `seq_len` tokens made from token documents, packed or one per row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Document = tuple[np.ndarray, np.ndarray]
"""`(ids int32 [n], weights float32 [n])`: a document's tokens and, per token, its weight
as a next-token target (0 on prompts and user turns)."""


def _empty(rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "tokens": np.full((rows, seq_len), pad_id, np.int32),
        "mask": np.zeros((rows, seq_len), bool),
        "segment_ids": np.zeros((rows, seq_len), np.int32),
        "positions": np.zeros((rows, seq_len), np.int32),
        "weights": np.zeros((rows, seq_len), np.float32),
    }


def pack(documents: Sequence[Document], seq_len: int, *, pad_id: int = 0, packed: bool = True) -> dict[str, np.ndarray]:
    """Documents laid out in rows of `seq_len` tokens, for `zoo.models.next_token_loss`.

    **Arguments:**

    - `documents`: `(ids, weights)` pairs, each at most `seq_len` tokens.
    - `seq_len`: the row length.
    - `pad_id`: the id filling the rest of each row.
    - `packed`: `True`: documents fill rows in order, a new row starting when the next
      one does not fit (greedy, so the order is kept); `False`: one document per row.

    **Returns:** `{"tokens", "mask", "segment_ids", "positions", "weights"}`, each
    `[rows, seq_len]`: `segment_ids` numbers the documents of a row from 1 (0: padding),
    so attention stays inside each document; `positions` restart at 0 at each document;
    `weights` are the documents' target weights, 0 at each document's first token
    (nothing in the row before it may predict it) and on padding; `mask` is `True` on
    real tokens.
    """
    rows: list[list[Document]] = []
    used = seq_len  # force a first row
    for ids, weights in documents:
        n = len(ids)
        if n > seq_len:
            raise ValueError(f"a document of {n} tokens does not fit rows of seq_len={seq_len}; cut it first")
        if n == 0:
            continue
        if not packed or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, weights))
        used += n
    out = _empty(len(rows), seq_len, pad_id)
    for r, row in enumerate(rows):
        start = 0
        for segment, (ids, weights) in enumerate(row, start=1):
            end = start + len(ids)
            out["tokens"][r, start:end] = ids
            out["mask"][r, start:end] = True
            out["segment_ids"][r, start:end] = segment
            out["positions"][r, start:end] = np.arange(len(ids))
            out["weights"][r, start:end] = weights
            out["weights"][r, start] = 0.0
            start = end
    return out
