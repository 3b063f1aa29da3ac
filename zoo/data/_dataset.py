"""A user's data file as batches for `zoo.TrainStep`: tokenised with the model's own
tokenizer, packed, split, shuffled by seed, each process reading only its rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._distributed import local_rows
from .._tree import counted
from ..hf._files import read_json
from ..hf._tokenizer import Tokenizer
from ._chat import ChatTemplate, rendering
from ._packing import Document, pack
from ._preference import preference_rows
from ._records import DataFormatError, Kind, folder_refused, read_located


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Rows of one data file, ready to batch: a `zoo.data.BatchSource` (`batch_at`), what
    a `zoo.train.Task` on the file trains on.

    **Fields:**

    - `arrays`: numpy arrays with one leading row per example. Language modelling
      (`kind` `"text"`, `"prompt_completion"`, `"chat"`): `"tokens"`, `"mask"`,
      `"segment_ids"`, `"positions"`, `"weights"` `[rows, seq_len]` (what
      `zoo.models.next_token_loss` reads). Classification: `"tokens"`, `"mask"`,
      `"token_types"` `[rows, seq_len]` and `"labels"` `[rows]` (what
      `zoo.models.classification_loss` reads). Preference pairs (`"preference"`):
      `"chosen_tokens"`, `"chosen_mask"`, `"chosen_completion"` and the same for
      `"rejected"`, `[pairs, seq_len]`, one pair per row (what
      `zoo.models.PreferenceLoss` reads).
    - `kind`: the file's format.
    - `label_names`: classification only: the name of each label id.
    - `truncated`: how many documents were longer than `seq_len` and cut (prompt /
      completion and chat are truncated, plain text is split into pieces).
    - `sha256`: the digest of the file's bytes as they were read (a run saves it with its
      checkpoints, so that a resume can refuse a file edited in between).
    """

    arrays: dict[str, np.ndarray]
    kind: Kind
    label_names: tuple[str, ...] | None = None
    truncated: int = 0
    sha256: str | None = None

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    @property
    def num_labels(self) -> int | None:
        """Classification: the number of labels; else `None`."""
        return None if self.label_names is None else len(self.label_names)

    def batches(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        data_axes: str | tuple[str, ...] = "data",
    ) -> Iterator[dict[str, np.ndarray]]:
        """One epoch of batches: dicts of numpy arrays, this process's rows only.

        **Arguments:**

        - `batch_size`: the global batch size (rows over every process).
        - `seed`, `epoch`: the shuffle is a permutation drawn from `(seed, epoch)`, the
          same on every process and every run.
        - `shuffle`: `False` keeps the file's order.
        - `mesh`, `data_axes`: with several processes, which rows of each global batch
          this process holds (`zoo.local_rows`; default: the mesh set by `jax.set_mesh`).

        **Returns:** an iterator of `len(self) // batch_size` batches (the last partial
        batch is dropped: the step compiles for one shape). Pass each to
        `zoo.global_batch` (several processes) or straight to `zoo.TrainStep`.
        """
        self._check_batch_size(batch_size)
        if not shuffle:
            mine = local_rows(batch_size, mesh, data_axes) if jax.process_count() > 1 else slice(0, batch_size)
            for b in range(len(self) // batch_size):
                yield {name: array[b * batch_size : (b + 1) * batch_size][mine] for name, array in self.arrays.items()}
            return
        per_epoch = len(self) // batch_size
        for b in range(per_epoch):
            yield self.batch_at(epoch * per_epoch + b + 1, batch_size, seed=seed, mesh=mesh, data_axes=data_axes)

    def batch_at(
        self,
        step: int,
        batch_size: int,
        *,
        seed: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        data_axes: str | tuple[str, ...] = "data",
    ) -> dict[str, np.ndarray]:
        """The batch of training step `step` (from 1), this process's rows of it: the
        batches of `batches(seed=seed, epoch=e)` for e = 0, 1, ... one after another. A
        function of the step alone, so a resumed run sees the batches it would have seen.

        **Arguments:** as `batches`; `mesh=None` with one process: the whole global batch.
        """
        rows = self.rows_at(step, batch_size, seed=seed)
        if jax.process_count() > 1:
            rows = rows[local_rows(batch_size, mesh, data_axes)]
        return {name: array[rows] for name, array in self.arrays.items()}

    def rows_at(self, step: int, batch_size: int, *, seed: int = 0) -> np.ndarray:
        """The indices of the rows of training step `step`'s global batch (every
        process's): what `batch_at` takes, before it keeps this process's rows."""
        self._check_batch_size(batch_size)
        epoch, index = divmod(step - 1, len(self) // batch_size)
        return np.random.default_rng([seed, epoch]).permutation(len(self))[
            index * batch_size : (index + 1) * batch_size
        ]

    def _check_batch_size(self, batch_size: int) -> None:
        if batch_size < 1 or batch_size > len(self):
            raise ValueError(f"batch_size must be between 1 and the {len(self)} rows of the dataset, got {batch_size}")


def _held_out(keys: list[bytes], fraction: float) -> np.ndarray:
    """Which documents are held out: the `round(fraction * n)` (at least 1 when
    `fraction > 0` and there are 2 or more) with the smallest content hashes, so the split
    depends only on the documents, not on their order or a seed."""
    if not 0 <= fraction < 1:
        raise ValueError(f"validation must be a fraction in [0, 1), got {fraction}")
    n = len(keys)
    count = round(fraction * n)
    if fraction > 0 and n >= 2:
        count = min(max(count, 1), n - 1)
    ranks = np.argsort([hashlib.sha256(k).digest() for k in keys], kind="stable")
    held = np.zeros(n, bool)
    held[ranks[:count]] = True
    return held


def _labels(records: list[dict[str, Any]], wheres: list[str]) -> tuple[np.ndarray, tuple[str, ...]]:
    """Label ids and names: integer labels (ints, or strings of digits as a `.csv` holds
    them) are their own ids, named `"0"…`; names get ids in sorted name order. A file
    mixing the two kinds is refused, naming the first label of each kind."""
    raw = [r["label"] for r in records]
    numeric = [isinstance(v, int) or bool(re.fullmatch(r"\d+", v)) for v in raw]
    if all(numeric):
        ids = np.asarray([int(v) for v in raw], np.int32)
        return ids, tuple(str(i) for i in range(int(ids.max()) + 1))
    if any(numeric):
        i, j = numeric.index(True), numeric.index(False)
        raise DataFormatError(
            f"labels must be of one kind, integers >= 0 or names: {wheres[i]} has {raw[i]!r} but {wheres[j]} has "
            f"{raw[j]!r}; use one kind for every label"
        )
    names = tuple(sorted(set(raw)))
    index = {name: i for i, name in enumerate(names)}
    return np.asarray([index[v] for v in raw], np.int32), names


def _special_id(tokenizer: Tokenizer, folder: Path | None, name: str) -> int | None:
    if folder is None:
        return None
    value = (read_json(folder / "tokenizer_config.json") or {}).get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return tokenizer.tokenizer.token_to_id(value) if isinstance(value, str) else None


def load(
    path: str | os.PathLike,
    tokenizer: Tokenizer | str | os.PathLike,
    *,
    seq_len: int,
    packed: bool = True,
    validation: float = 0.0,
    chat_template: ChatTemplate | None = None,
    eos_id: int | None = None,
    data: bytes | None = None,
    system: str | None = None,
    max_prompt_len: int | None = None,
    truncation: str = "keep_end",
    located: tuple[Kind, list[dict[str, Any]], list[str]] | None = None,
) -> tuple[Dataset, Dataset]:
    """A data file as `(train, validation)` datasets, tokenised with a model's tokenizer.

    **Arguments:**

    - `path`: the data file: `.txt` (the whole text, cut into rows), `.jsonl` with
      `"text"`, `"prompt"`/`"completion"`, `"messages"` (chat) or `"text"`/`"label"`, or
      `.csv` with `text`/`label` columns (see docs/data.md).
    - `tokenizer`: a model folder (its `tokenizer.json`, `tokenizer_config.json`,
      `chat_template.jinja`) or a `zoo.hf.Tokenizer`.
    - `seq_len`: tokens per row.
    - `packed`: pack several short documents into each row (segment ids keep them
      apart); `False`: one document per row.
    - `validation`: the fraction of documents held out, chosen by content hash.
    - `chat_template`: overrides the folder's template (needed for chat data when
      `tokenizer` is a `Tokenizer`).
    - `eos_id`: the end-of-sequence id appended to each completion (default: the
      folder's `eos_token`; none when unknown).
    - `data`: the file's bytes when the caller has read them already (the file is then
      not opened again; as `read_records`).
    - `system`, `max_prompt_len`, `truncation`: preference pairs (`zoo.data.preference_rows`).
    - `located`: `(kind, records, wheres)` to read instead of the file's (some of its
      records, as `read_located` gives them: one adapter's); `data` is then only digested.

    **Returns:** `(train, validation)`, their `sha256` the digest of the bytes read; `validation` has no rows when `validation=0`.
    Raises `DataFormatError` for a file zoo cannot read.
    """
    folder = None
    if not isinstance(tokenizer, Tokenizer):
        folder = Path(tokenizer)
        tokenizer = Tokenizer.from_pretrained(folder)
    if eos_id is None:
        eos_id = _special_id(tokenizer, folder, "eos_token")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (a token and its successor), got {seq_len}")
    if data is None and Path(path).is_dir():
        raise folder_refused(path)
    if data is None:
        data = Path(path).read_bytes()  # read once: the records and the digest are of these bytes
    digest = hashlib.sha256(data).hexdigest()
    kind, records, wheres = read_located(path, data=data) if located is None else located
    conversational = kind == "prompt_completion" and any(isinstance(r["prompt"], list) for r in records)
    if chat_template is None and folder is not None and (kind in ("chat", "preference") or conversational):
        chat_template = ChatTemplate.from_pretrained(folder)  # read only for data that renders conversations
    if kind == "prompt":
        raise DataFormatError(
            f'{str(path)!r} holds prompts alone ({{"prompt"}} lines with no "completion"): nothing to train on by '
            'next-token or preference loss; give each line its answer ({"prompt", "completion"}), or let GRPO '
            "complete them: zoo finetune transformer --objective grpo --reward FILE.py:NAME --data FILE"
        )
    if kind == "classification":
        return _classification(records, wheres, tokenizer, seq_len, validation, digest)
    rust = tokenizer.tokenizer
    rust.no_truncation()  # `Tokenizer.__call__` leaves its last truncation switched on
    if kind == "preference":
        return _pairs(
            records,
            wheres,
            rust,
            validation,
            digest,
            seq_len=seq_len,
            pad_id=tokenizer.pad_id,
            eos_id=eos_id,
            chat_template=chat_template,
            system=system,
            max_prompt_len=max_prompt_len,
            truncation=truncation,
        )
    documents, keys, truncated = _documents(kind, records, wheres, rust, seq_len, eos_id, chat_template, path)
    held = _held_out(keys, validation)
    return tuple(
        Dataset(
            pack([d for d, h in zip(documents, held) if h == side], seq_len, pad_id=tokenizer.pad_id, packed=packed),
            kind,
            truncated=truncated,
            sha256=digest,
        )
        for side in (False, True)
    )


def _documents(
    kind: str,
    records: list[dict[str, Any]],
    wheres: list[str],
    rust: Any,
    seq_len: int,
    eos_id: int | None,
    chat_template: ChatTemplate | None,
    path: str | os.PathLike,
) -> tuple[list[Document], list[bytes], int]:
    """`(documents, keys, truncated)` of `text`, `prompt_completion` or `chat` records:
    each document's ids and loss weights (a long text cut into pieces of `seq_len`, any
    other record cut to it), the content key that holds it out or not, and how many
    records were cut."""
    documents: list[Document] = []
    keys: list[bytes] = []
    truncated = 0
    if kind == "text":
        for r, where in zip(records, wheres):
            ids = np.asarray(rust.encode(str(r["text"])).ids, np.int32)
            _check_targets(kind, np.ones(len(ids), np.float32), seq_len, where)
            # A long text is cut into pieces of seq_len (a .txt is one long text).
            for start in range(0, len(ids), seq_len):
                piece = ids[start : start + seq_len]
                documents.append((piece, np.ones(len(piece), np.float32)))
                keys.append(piece.tobytes())
    if chat_template is None and (
        kind == "chat" or kind == "prompt_completion" and isinstance(records[0]["prompt"], list)
    ):
        raise DataFormatError(
            f"{str(path)!r} holds chat messages but the tokenizer has no chat template; pass a model folder whose "
            "tokenizer_config.json has chat_template (or chat_template.jinja), or a jinja2 template file: "
            "--chat-template FILE (in Python: chat_template=zoo.data.ChatTemplate(text))"
        )
    for r, where in zip(records, wheres) if kind != "text" else ():
        if kind == "chat" and not any(m["role"] == "assistant" for m in r["messages"]):
            # Checked before rendering: a template may refuse other roles with a message that names none.
            roles = sorted({m["role"] for m in r["messages"]})
            raise DataFormatError(
                f'{where}: no assistant turn to train on (roles {roles}; only "assistant" turns are targets): '
                'name the model\'s turns "assistant" and the user\'s "user" (ShareGPT\'s "gpt" and "human"), '
                "or remove the line"
            )
        with rendering(where):
            ids, weights = _encoded(kind, r, rust, eos_id, chat_template, where)
        _check_targets(kind, weights, seq_len, where)
        if len(ids) > seq_len:
            truncated += 1
            ids, weights = ids[:seq_len], weights[:seq_len]
        documents.append((ids, weights))
        keys.append(json.dumps(r, sort_keys=True).encode())
    return documents, keys, truncated


def _classification(
    records: list[dict[str, Any]], wheres: list[str], tokenizer: Tokenizer, seq_len: int, validation: float, digest: str
) -> tuple[Dataset, Dataset]:
    """`text`/`label` records as `(train, validation)` datasets: each text one row of
    `seq_len` tokens, its label's index; the held-out records chosen by content hash."""
    ids, names = _labels(records, wheres)
    held = _held_out([json.dumps(r, sort_keys=True).encode() for r in records], validation)
    arrays = tokenizer([str(r["text"]) for r in records], max_len=seq_len, pad_to=seq_len)
    arrays["labels"] = ids
    return tuple(
        Dataset({k: v[rows] for k, v in arrays.items()}, "classification", label_names=names, sha256=digest)
        for rows in (~held, held)
    )


def _encoded(
    kind: str,
    record: dict[str, Any],
    rust: Any,
    eos_id: int | None,
    chat_template: ChatTemplate | None,
    where: str = "a record",
) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, weights)` of one `prompt_completion` or `chat` record: the loss weights 1 on
    the completion (and its eos) or on every token of an assistant turn, 0 elsewhere."""
    if kind == "prompt_completion" and isinstance(record["prompt"], list):
        # TRL's conversational prompt-completion: the loss on what prompt + completion renders
        # past the prompt rendered with the generation prompt (the template's EOS included).
        head = chat_template.render(record["prompt"], add_generation_prompt=True)
        text = chat_template.render([*record["prompt"], *record["completion"]])
        if not text.startswith(head):
            raise DataFormatError(
                f"{where}: the chat template renders the prompt differently alone and followed by the completion, so the "
                "completion cannot be cut from it; use a template that renders conversations by prefixes"
            )
        spans = [(len(head), len(text))]
    elif kind == "prompt_completion":
        prompt = rust.encode(str(record["prompt"])).ids
        completion = rust.encode(str(record["completion"]), add_special_tokens=False).ids
        completion += [] if eos_id is None else [eos_id]
        ids = np.asarray(prompt + completion, np.int32)
        return ids, np.concatenate([np.zeros(len(prompt), np.float32), np.ones(len(completion), np.float32)])
    else:
        text, spans = chat_template.assistant_spans(record["messages"])
    encoding = rust.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    weights = np.zeros(len(ids), np.float32)
    # Every token overlapping an assistant span (transformers' return_assistant_tokens_mask
    # marks the tokens of a span's first and last characters and those between:
    # the same tokens, also when a span starts or ends on whitespace no token holds).
    offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
    for start, end in spans:
        weights[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 1.0
    return ids, weights


def _pairs(records, wheres, rust, validation: float, digest: str, **options) -> tuple[Dataset, Dataset]:
    """Preference pairs as `(train, validation)` datasets, one pair per row
    (`preference_rows` with `options`), the held-out pairs chosen by content hash."""
    arrays, cut = preference_rows(records, wheres, rust, **options)
    held = _held_out([json.dumps(r, sort_keys=True).encode() for r in records], validation)
    return tuple(
        Dataset({k: v[rows] for k, v in arrays.items()}, "preference", truncated=cut, sha256=digest)
        for rows in (~held, held)
    )


def _check_targets(kind: Kind, weights: np.ndarray, seq_len: int, where: str) -> None:
    """Refuse a document that would leave no target token in its row (its loss would be
    0 / 0, a NaN when a whole batch is such): its first token is no target, and
    truncation to `seq_len` keeps `weights[:seq_len]`. Names the `seq_len` that fits it."""
    targets = np.flatnonzero(weights[1:]) + 1
    if len(targets) and targets[0] < seq_len:
        return
    if len(targets):
        what = {"prompt_completion": "the completion starts", "chat": "the first assistant turn starts"}[kind]
        raise DataFormatError(
            f"{where}: no target token is left after truncation to seq_len {seq_len} ({what} at token "
            f"{targets[0]}); seq_len={targets[0] + 1} or more fits it (or shorten or remove the example)"
        )
    fix = {
        "text": "field 'text' holds fewer than 2 tokens, so nothing to predict; remove the line",
        "prompt_completion": "field 'completion' is empty and no end-of-sequence token follows it (the tokenizer "
        "has no eos_token); give it a completion or remove the line",
        "chat": "no assistant turn to train on (only assistant tokens are targets); add one or remove the line",
    }[kind]
    raise DataFormatError(f"{where}: {fix}")


def describe(dataset: Dataset) -> str:
    """One line about a dataset: its format, rows and (language modelling) how many
    tokens carry loss, or (classification) its labels."""
    if dataset.label_names is not None:
        return (
            f"{dataset.kind}: {counted(len(dataset), 'row')}, {dataset.num_labels} labels {list(dataset.label_names)}"
        )
    if dataset.kind == "preference":
        return f"preference: {counted(len(dataset), 'pair')}, {dataset.truncated} cut to fit"
    weights = dataset.arrays["weights"]
    fill = dataset.arrays["mask"].mean() if len(dataset) else 0.0
    return (
        f"{dataset.kind}: {counted(len(dataset), 'row')}, {counted(int(weights.sum()), 'target token')}, {math.floor(100 * fill)}% of row "
        f"tokens real, {dataset.truncated} truncated"
    )
