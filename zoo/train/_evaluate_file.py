"""A saved run evaluated on a data file in the formats `zoo train` reads (`SavedRun.evaluate`,
`zoo eval`): a language model's loss, perplexity and next-token accuracy; a classifier's
loss, accuracy, macro-F1 and per-class scores, its labels matched by name."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import equinox as eqx
import numpy as np

from ..data import DataFormatError
from ..data import load as load_data
from ..lora import adapter_names, set_adapter
from ._adapters import read_adapter_records
from ._errors import ConfigError
from ._predict import forward
from ._scores import classification_scores
from ._task import lm_metrics
from ._user_data import LM_KINDS, byte_tokenizer, read_kind

if TYPE_CHECKING:
    from ._saved_run import SavedRun

_lm_metrics = eqx.filter_jit(lm_metrics)


def _read(run: SavedRun, path: Path):
    """The file as the run read its data (its tokenizer, `seq_len`, packing and chat
    template), every row kept; a one-line `ConfigError` for a file it cannot read."""
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file; check the path")
    raw, kind = read_kind(path)
    wanted = "text, prompt/completion or chat records" if run.kind == "lm" else "text/label records"
    if (kind in LM_KINDS) != (run.kind == "lm"):
        what = f"{kind.replace('_', '/')} records (language modelling)" if kind in LM_KINDS else "text/label records"
        raise ConfigError(f"--data {path} holds {what} but {run.folder} is a {run.kind} run; give it {wanted}")
    return _rows(run, path, raw)


def _rows(run: SavedRun, path: Path, raw: bytes, located=None):
    """The file's (or `located`'s: some of its records) rows, as the run read its data."""
    source = run.tokenizer_dir if run.tokenizer is not None else byte_tokenizer()
    packed = run.config.data.packed is not False
    try:
        data, _ = load_data(path, source, seq_len=run.seq_len, packed=packed, chat_template=run.chat_template, data=raw,
                            located=located)  # fmt: skip
    except DataFormatError as e:
        raise ConfigError(f"--data: {str(e).splitlines()[0]}".replace("seq_len=", "--seq-len of the run ")) from None
    except ValueError as e:  # a template that cannot find the assistant turns
        raise ConfigError(f"--data {path}: {str(e).splitlines()[0]}") from None
    if len(data) == 0:
        raise ConfigError(f"--data {path}: no examples in it")
    return data


def _lm(run: SavedRun, arrays: dict[str, np.ndarray], batch_size: int) -> dict[str, Any]:
    n = len(arrays["tokens"])
    rows = max(1, min(n, batch_size))
    sums = {"loss": 0.0, "weight": 0.0, "correct": 0.0}
    for start in range(0, n, rows):
        chunk = {k: v[start : start + rows] for k, v in arrays.items()}
        m = len(chunk["tokens"])
        if m < rows:  # copies of the first row, weighted 0
            chunk = {k: np.concatenate([v, np.repeat(v[:1], rows - m, axis=0)]) for k, v in chunk.items()}
        chunk["weight"] = (np.arange(rows) < m).astype(np.float32)
        out = _lm_metrics(run.model, chunk)
        for k in sums:
            sums[k] += float(np.sum(np.asarray(out[k], np.float64)))
    loss = sums["loss"] / max(sums["weight"], 1e-12)
    return {"kind": "lm", "rows": n, "tokens": int(round(sums["weight"])), "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)), "accuracy": sums["correct"] / max(sums["weight"], 1e-12)}  # fmt: skip


def _adapters(run: SavedRun, path: Path, batch_size: int) -> dict[str, Any]:
    """A run of several adapters on a file whose records name their adapter: each
    adapter's records through it, and all of them together (means over every target token)."""
    import dataclasses

    names = adapter_names(run.model)
    records = read_adapter_records(str(path))
    if records is None:
        raise ConfigError(
            f"--data {path}: {run.folder} trained the adapters {list(names)}; give each record its adapter's name "
            '("adapter": NAME) to evaluate it through that adapter'
        )
    unknown = [n for n in records.names if n not in names]
    if unknown:
        raise ConfigError(f"--data {path}: adapters {unknown} are not among the run's {list(names)}; name one of those "
                          "on each record")  # fmt: skip
    per = {}
    for name, located in records.located.items():
        data = _rows(run, path, b"", located)
        per[name] = _lm(dataclasses.replace(run, model=set_adapter(run.model, name)), dict(data.arrays), batch_size)
    tokens = sum(r["tokens"] for r in per.values())
    loss = sum(r["loss"] * r["tokens"] for r in per.values()) / max(tokens, 1)
    return {"kind": "lm", "rows": sum(r["rows"] for r in per.values()), "tokens": tokens, "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": sum(r["accuracy"] * r["tokens"] for r in per.values()) / max(tokens, 1), "adapters": per}  # fmt: skip


def _classifier(run: SavedRun, data, path: Path, batch_size: int) -> dict[str, Any]:
    names = list(run.label_names or ())
    unknown = [name for name in data.label_names if name not in names]
    if unknown:
        raise ConfigError(
            f"--data {path}: labels {unknown} are not among the run's {names}; evaluate on examples of its classes"
        )
    index = np.asarray([names.index(name) for name in data.label_names], np.int32)
    labels = index[data.arrays["labels"]]
    logits = forward(run, {k: v for k, v in data.arrays.items() if k != "labels"}, batch_size=batch_size)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(labels)), labels].mean())
    return {"kind": "classification", "loss": loss, **classification_scores(labels, logits.argmax(axis=1), names)}


def evaluate_file(run: SavedRun, path: str | Path, *, batch_size: int = 64) -> dict[str, Any]:
    """`run`'s model on every example of the data file `path` (`.txt`, `.jsonl`, `.csv`, as
    `zoo train --data` reads them, with the run's tokenizer, `seq_len`, packing and chat
    template).

    **Returns:** for a language model `{"kind": "lm", "rows", "tokens" (target tokens),
    "loss" (mean next-token cross-entropy, nats), "perplexity", "accuracy"}` (the tokens
    counted as the run's loss counts them: completions, assistant turns); for a classifier
    `{"kind": "classification", "examples", "loss", "accuracy", "macro_f1", "per_class"}`
    (`zoo.train.classification_scores`; the file's labels matched to the run's by name).
    A run of several adapters reads a `.jsonl` whose records name their adapter
    (`"adapter": NAME`): each through its own, `"adapters": {NAME: scores}` beside the
    scores of all of them.
    **Raises:** `ConfigError` (a file of the other kind, labels the run does not have, a
    regressor, which trains on its own data only).
    """
    if run.kind == "regression":
        raise ConfigError(f"{run.folder} is a regressor trained on its own synthetic data, which reads no data file; "
                          "its held-out loss is summary.json's eval_after")  # fmt: skip
    path = Path(path).expanduser()
    data = _read(run, path)
    if run.kind == "lm" and adapter_names(run.model):
        return _adapters(run, path, batch_size)
    if run.kind == "lm":
        return _lm(run, dict(data.arrays), batch_size)
    return _classifier(run, data, path, batch_size)
