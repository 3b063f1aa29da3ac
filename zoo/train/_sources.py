"""A run's data: its settings (`DataConfig`, what a run trains on), and the built-in
models' data as `zoo.data.BatchSource`s: the mlp's teacher, windows of a
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
from ._errors import ConfigError
from ._flags import flag

# The largest count a run takes (steps, rows, intervals): compiled programs count steps and
# rows in int32.
MAX_COUNT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What a run trains on.

    **Fields:**

    - `source`: a built-in data set's name (`"teacher"`, `"code"`, `"prose"`, `"docstrings"`;
      which ones a model takes: `zoo train --help`), or a file (None: the model's default
      for the command), or one file per LoRA adapter to train at once, `{NAME: FILE}` (kept
      as the text `"NAME=FILE,NAME=FILE"`, `--data`'s form).
    - `seq_len`: tokens per example, padded or cut (None: the model's default; the mlp has
      no sequences).
    - `eval_size`: held-out examples evaluated (0: the data set's default).
    - `packed`, `validation`, `chat_template`: how a user's file is read (None: packed,
      0.1): texts packed into full windows, the held-out fraction, the chat template of
      conversations.
    """

    source: str | dict[str, str] | None = flag(
        None, name="data", metavar="NAME|FILE", group="model and data", help="{data_sets}"
    )
    seq_len: int | None = flag(None, metavar="L", help="tokens per example, padded or cut ({per_model})")
    eval_size: int = flag(
        0,
        metavar="N",
        group="evaluation and outputs",
        resume="safe",
        help="held-out examples evaluated (default: all test texts; 256 LM windows; 1024 mlp examples)",
    )
    packed: bool | None = flag(
        None,
        group="model and data",
        help="--data FILE (language modelling): pack short documents into each row (default yes)",
    )
    validation: float | int | None = flag(
        None,
        metavar="FRACTION",
        group="model and data",
        help="--data FILE: the fraction of its documents held out for evaluation (default 0.1)",
    )
    chat_template: str | None = flag(
        None,
        metavar="FILE",
        group="model and data",
        help="--data FILE of chat messages: a jinja2 chat template (default: the tokenizer's)",
    )
    system_prompt: str | None = flag(
        None,
        metavar="TEXT",
        group="training",
        help="preference pairs: a "
        "system prompt put before every prompt (a system turn of conversations that "
        "have none) (default: none)",
    )
    max_prompt_len: int | None = flag(
        None,
        metavar="N",
        group="training",
        help="preference pairs too long "
        "for --seq-len: the prompt is cut to N tokens, then the completions to what is "
        "left (default: half of --seq-len)",
    )
    prompt_truncation: str = flag(
        "keep_end",
        choices=("keep_end", "keep_start", "error"),
        group="training",
        help="which end of a too-long prompt is kept (TRL's truncation_mode), or error to "
        "refuse such pairs (default keep_end)",
    )

    def __post_init__(self):
        if isinstance(self.source, dict):  # one file per adapter: stored as --data's text
            object.__setattr__(self, "source", ",".join(f"{name}={file}" for name, file in self.source.items()))
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ConfigError(f"DataConfig.seq_len must be an integer >= 2 (or None), got {self.seq_len!r}")
        if not isinstance(self.eval_size, int) or self.eval_size < 0:
            raise ConfigError(f"DataConfig.eval_size must be an integer >= 0, got {self.eval_size!r}")
        for field in ("seq_len", "eval_size"):
            if (getattr(self, field) or 0) > MAX_COUNT:
                raise ConfigError(
                    f"DataConfig.{field} must be at most {MAX_COUNT} (2**31 - 1: compiled programs count in int32), "
                    f"got {getattr(self, field)}"
                )
        if self.max_prompt_len is not None and (
            not isinstance(self.max_prompt_len, int)
            or self.max_prompt_len < 1
            or self.seq_len is not None
            and self.max_prompt_len >= self.seq_len
        ):
            raise ConfigError(
                f"DataConfig.max_prompt_len must be an integer from 1 to seq_len - 1 (room for a "
                f"completion), got {self.max_prompt_len!r}"
            )
        if self.prompt_truncation not in ("keep_end", "keep_start", "error"):
            raise ConfigError(
                f"DataConfig.prompt_truncation must be keep_end, keep_start or error, got {self.prompt_truncation!r}"
            )
        if self.validation is not None and not (isinstance(self.validation, int | float) and 0 <= self.validation < 1):
            raise ConfigError(f"DataConfig.validation must be a fraction in [0, 1), got {self.validation!r}")


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
