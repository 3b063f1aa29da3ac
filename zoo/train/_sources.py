"""The built-in models' data as `zoo.data.BatchSource`s: the mlp's teacher, windows of a
byte corpus, the docstring texts in epochs, and random rows of the real shapes (a model
built without data: `zoo info`, `zoo inspect`). Each `batch_at` is a function of the
step and the seed alone, the global batch drawn whole on every process and cut to this
process's rows (`zoo.data.local_batch`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..data import local_batch, random_windows

# jax is imported inside the functions: the CLI's parser imports this module.


def numpy_rng(*seed: Any):
    """A numpy generator from ints or jax PRNG keys: batches without compiling jax ops."""
    words: list[int] = []
    for s in seed:
        if isinstance(s, int):
            words.append(s)
        else:
            import jax

            words.extend(np.asarray(jax.random.key_data(s)).ravel().tolist())
    return np.random.default_rng(words)


def random_tokens(rng, rows: int, seq: int, vocab: int, *, pad_id: int | None = None):
    """Random `(tokens int32 [rows, seq], mask bool [rows, seq])`: ids in [1, vocab); with
    `pad_id`, each row keeps at least half its positions and pads the rest with it."""
    tokens = rng.integers(1, vocab, (rows, seq), dtype=np.int32)
    if pad_id is None:
        return tokens, np.ones((rows, seq), bool)
    lengths = rng.integers(seq // 2, seq + 1, (rows, 1))
    mask = np.arange(seq)[None, :] < lengths
    return np.where(mask, tokens, pad_id).astype(np.int32), mask


@dataclasses.dataclass(frozen=True)
class TeacherExamples:
    """The mlp's data: `{"x", "y"}` with `x` normal in `in_size` inputs and
    `y = sin(2 x·t0) cos(x·t1)`, the teacher `t` drawn from the seed."""

    in_size: int

    def examples(self, rng: np.random.Generator, n: int, seed: int) -> dict[str, np.ndarray]:
        """`n` examples drawn by `rng` from the teacher of `seed`."""
        teacher = np.random.default_rng(seed + 1).normal(size=(2, self.in_size)) / math.sqrt(self.in_size)
        x = rng.normal(size=(n, self.in_size)).astype(np.float32)
        proj = x @ teacher.T
        y = np.sin(2.0 * proj[:, :1]) * np.cos(proj[:, 1:])
        return {"x": x, "y": y.astype(np.float32)}

    def held_out(self, n: int, seed: int) -> dict[str, np.ndarray]:
        """The `n` evaluation examples of `seed` (drawn apart from every step's)."""
        return self.examples(numpy_rng(seed, 2), n, seed)

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """Fresh examples of the step (`zoo.data.BatchSource`)."""
        return local_batch(self.examples(numpy_rng(seed, 1, step), batch_size, seed), mesh=mesh, data_axes=data_axes)


@dataclasses.dataclass(frozen=True, eq=False)
class CorpusWindows:
    """A decoder's data on a corpus: `{"tokens"}`, windows of `seq_len` ids of `tokens`
    at random offsets."""

    tokens: np.ndarray
    seq_len: int

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """The step's windows (`zoo.data.BatchSource`)."""
        windows = random_windows(numpy_rng(seed, 1, step), self.tokens, batch_size, self.seq_len)
        return local_batch({"tokens": windows}, mesh=mesh, data_axes=data_axes)


@dataclasses.dataclass(frozen=True, eq=False)
class EpochRows:
    """A classifier's training texts (`arrays`, rows first) in epochs of fresh
    permutations; step k takes rows [(k-1)n, kn) of their concatenation (no row skipped
    at an epoch's end)."""

    arrays: dict[str, np.ndarray]

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """The step's rows (`zoo.data.BatchSource`)."""
        n_train = len(next(iter(self.arrays.values())))
        start = (step - 1) * batch_size
        rows: list[int] = []
        while len(rows) < batch_size:
            epoch, offset = divmod(start + len(rows), n_train)
            order = np.random.default_rng([seed, 3, epoch]).permutation(n_train)
            rows.extend(order[offset : offset + batch_size - len(rows)].tolist())
        return local_batch({k: v[rows] for k, v in self.arrays.items()}, mesh=mesh, data_axes=data_axes)


@dataclasses.dataclass(frozen=True)
class RandomRows:
    """Random rows of a model's real shapes and dtypes, for a model built without data
    (`zoo info`, `zoo inspect`): a decoder's `{"tokens"}` (`num_labels` None), or a
    classifier's `{"tokens", "mask", "labels"}` with rows padded by `pad_id` (and
    `"token_types"` when its tokenizer gives them)."""

    seq_len: int
    vocab_size: int
    pad_id: int | None = None
    num_labels: int | None = None
    token_types: bool = False

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """The step's random rows (`zoo.data.BatchSource`)."""
        rng = numpy_rng(seed, 1, step)
        tokens, mask = random_tokens(rng, batch_size, self.seq_len, self.vocab_size, pad_id=self.pad_id)
        if self.num_labels is None:
            batch = {"tokens": tokens}
        else:
            labels = rng.integers(0, self.num_labels, (batch_size,), dtype=np.int32)
            batch = {"tokens": tokens, "mask": mask, "labels": labels}
            if self.token_types:  # a tokenizer's rows carry token types too
                batch["token_types"] = np.zeros_like(tokens)
        return local_batch(batch, mesh=mesh, data_axes=data_axes)
