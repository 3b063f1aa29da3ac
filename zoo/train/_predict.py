"""A saved run's predictions: a classifier's logits of texts, a regressor's outputs of numbers
(`SavedRun.predict`, `zoo predict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import numpy as np

from ._errors import ConfigError
from ._user_data import byte_tokenizer

if TYPE_CHECKING:
    from ._saved_run import SavedRun


@eqx.filter_jit
def _classify(model, batch):
    return model(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types"))


@eqx.filter_jit
def _regress(model, batch):
    return model(batch["x"])


def encode(run: SavedRun, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Texts as a classifier run's examples: its tokenizer (or UTF-8 bytes), cut and padded
    to its `seq_len`, as its training rows were."""
    tokenizer = run.tokenizer if run.tokenizer is not None else byte_tokenizer()
    return tokenizer(list(texts), max_len=run.seq_len, pad_to=run.seq_len)


def forward(run: SavedRun, arrays: dict[str, np.ndarray], *, batch_size: int = 64) -> np.ndarray:
    """The model's outputs on every row of `arrays` (`tokens`/`mask`/`token_types`, or `x`),
    float32 numpy, in chunks of `batch_size` rows (the last padded: one compiled shape)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 (rows per forward pass), got {batch_size!r}")
    fn = _regress if run.kind == "regression" else _classify
    n = len(next(iter(arrays.values())))
    rows = max(1, min(n, batch_size))
    outs = []
    for start in range(0, n, rows):
        chunk = {k: v[start : start + rows] for k, v in arrays.items()}
        m = len(next(iter(chunk.values())))
        if m < rows:  # copies of the first row, dropped below
            chunk = {k: np.concatenate([v, np.repeat(v[:1], rows - m, axis=0)]) for k, v in chunk.items()}
        outs.append(np.asarray(fn(run.model, chunk), np.float32)[:m])
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)


def predict(run: SavedRun, inputs: Sequence[str] | Any, *, batch_size: int = 64) -> np.ndarray:
    """A classifier's logits `[n, labels]` of texts, or a regressor's outputs `[n, out]` of
    numbers `[n, in]`; a `ConfigError` for a language model (it generates) or inputs of the
    wrong kind."""
    if run.kind == "lm":
        raise ConfigError(
            f"{run.folder} is a language model run: it predicts no labels; continue text with zoo generate"
        )
    if run.kind == "classification":
        texts = list(inputs)
        if not all(isinstance(t, str) for t in texts):
            raise ConfigError(f"{run.folder} is a classifier run: its inputs are texts")
        return forward(run, encode(run, texts), batch_size=batch_size)
    x = np.asarray(inputs, np.float32)
    width = getattr(run.model, "in_size", None)
    if x.ndim != 2 or (width is not None and x.shape[1] != width):
        raise ConfigError(f"{run.folder} is a regressor of {width} inputs: give rows of {width} numbers, got shape "
                          f"{x.shape}")  # fmt: skip
    return forward(run, {"x": x}, batch_size=batch_size)
