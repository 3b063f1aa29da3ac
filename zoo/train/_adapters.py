"""Several LoRA adapters fine-tuned in one run over one frozen base (`zoo finetune --data`
with an `adapter` name on each record, or `--data NAME=FILE,NAME=FILE`): each adapter's
documents are read, split and packed apart (no row mixes two adapters), every step takes
`batch_size / K` rows of each adapter's own data (the rows that adapter trained alone with
`batch_size / K` would see), and the step trains all `K` at once (`zoo.lora.routed`,
`zoo.lora.clip_per_adapter`); the run evaluates each adapter on its own held-out rows and
saves each as its own peft folder (`zoo.lora.save_adapters`)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..data import DataFormatError, Dataset, local_batch
from ..data._records import read_located
from ._errors import ConfigError
from ._text import adapter_files, check_name

FIELD = "adapter"  # the record field naming a row's adapter
LM_KINDS = ("text", "prompt_completion", "chat")


@dataclasses.dataclass(frozen=True)
class AdapterRecords:
    """Each adapter's records as `zoo.data.read_located` gives them (`kind, records,
    wheres`), by name (the run's adapter order), and the digest of every byte read."""

    located: dict[str, tuple[str, list[dict[str, Any]], list[str]]]
    files: dict[str, Path]
    sha256: str

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters' names, in index order."""
        return tuple(self.located)


def _located(path: Path, raw: bytes) -> tuple[str, list[dict[str, Any]], list[str]]:
    try:
        kind, records, wheres = read_located(path, data=raw)
    except DataFormatError as e:
        raise ConfigError(f"--data: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--data {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    _check_kind(kind, path)
    return kind, records, wheres


def _check_kind(kind: str, path: Path) -> None:
    if kind not in LM_KINDS:
        raise ConfigError(
            f"--data {path} holds {kind.replace('_', '/')} records; several adapters train a decoder on text, "
            "prompt/completion or chat records (docs/training.md, Training several adapters at once)"
        )


def read_adapter_records(source: str) -> AdapterRecords | None:
    """The records of a several-adapter `--data`: one file whose records each name their
    adapter (`"adapter": NAME`; the adapters sorted by name), or `NAME=FILE` pairs (each
    file's records that adapter's; a record naming another adapter is refused). None for
    a single file whose records name no adapter (a one-adapter run). The records are
    returned without the `adapter` field: an adapter's documents are held out and packed
    as its own file of them would be.

    **Raises:** `ConfigError` naming the file and line of a record without the `adapter`
    field in a file where others have one, of a name that cannot be a folder's, or of a
    record of a pair's file naming another adapter; or a file that is no decoder's data."""
    pairs = adapter_files(source)
    if pairs is None:
        path = Path(source).expanduser()
        if path.suffix.lower() != ".jsonl":
            return None  # a .txt / .csv has no fields to name adapters by
        raw = path.read_bytes()
        if FIELD.encode() not in raw:
            return None  # no record names an adapter: spare every one-adapter run a second parse
        try:
            kind, records, wheres = read_located(path, data=raw)
        except (DataFormatError, UnicodeDecodeError):
            return None  # the one-adapter reader names what is wrong
        named = [i for i, r in enumerate(records) if FIELD in r]
        if not named:
            return None
        _check_kind(kind, path)
        groups: dict[str, tuple[list, list]] = {}
        for record, where in zip(records, wheres):
            if FIELD not in record:
                raise ConfigError(
                    f"--data: {where} has no {FIELD!r} field, but {wheres[named[0]]} names its adapter "
                    f"({records[named[0]][FIELD]!r}); give every record its adapter's name (or none of them, to "
                    "train one adapter)"
                )
            check_name(record[FIELD], f"--data: {where} field {FIELD!r}")
            rows = groups.setdefault(record[FIELD], ([], []))
            rows[0].append(_without_name(record))  # held out by its content: as in its adapter's own file
            rows[1].append(where)
        located = {n: (kind, *groups[n]) for n in sorted(groups)}
        return AdapterRecords(located, {n: path for n in located}, hashlib.sha256(raw).hexdigest())
    located, files, digests = {}, {}, []
    for name, file in pairs.items():
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"--data {name}={file}: no such file; check the path")
        raw = path.read_bytes()
        kind, records, wheres = _located(path, raw)
        located[name] = kind, [_without_name(r) for r in records], wheres
        files[name] = path
        digests.append(hashlib.sha256(raw).hexdigest())
        for record, where in zip(records, wheres):
            if FIELD in record and record[FIELD] != name:
                raise ConfigError(
                    f"--data: {where} names adapter {record[FIELD]!r}, but {path.name} holds adapter {name!r}'s "
                    f"rows (--data {name}={file}); remove the field, or move the line to {record[FIELD]!r}'s file"
                )
    return AdapterRecords(located, files, hashlib.sha256("".join(digests).encode()).hexdigest())


def _without_name(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its adapter's name: its content, which the held-out split hashes."""
    return {k: v for k, v in record.items() if k != FIELD}


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterRows:
    """A `zoo.data.BatchSource` of `K` adapters' rows: step `i`'s batch holds
    `batch_size / K` rows of each adapter's own `Dataset` (its `rows_at(i, batch_size /
    K)`, so the rows that adapter trained alone would see), adapter 0's first, with
    `"adapter"` (the row's adapter index) and `"adapter_norm"` (`zoo.lora.adapter_norms`
    of the rows' target counts over the global batch: each adapter's gradient its own
    rows' mean)."""

    names: tuple[str, ...]
    datasets: tuple[Dataset, ...]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """The step's rows of every adapter, this process's of them."""
        from ..lora import adapter_norms

        share = batch_size // len(self.names)
        parts = [{k: v[d.rows_at(step, share, seed=seed)] for k, v in d.arrays.items()} for d in self.datasets]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        batch["adapter"] = np.repeat(np.arange(len(self.names), dtype=np.int32), share)
        counts = batch["weights"][:, 1:].sum(axis=1, dtype=np.float64)  # next_token_loss's targets per row
        batch["adapter_norm"] = adapter_norms(batch["adapter"], counts, len(self.names))
        return local_batch(batch, mesh=mesh, data_axes=data_axes)


def adapter_metrics(names: tuple[str, ...]):
    """The evaluator's metrics of a several-adapter decoder: `lm_metrics` with each row
    through its own adapter (`batch["adapter"]`), and per adapter its rows' `loss/NAME`
    and `weight/NAME` (the evaluator's per-adapter mean)."""
    from ..lora import route
    from ._task import lm_metrics

    def metrics(model, batch):
        index = batch["adapter"]
        out = lm_metrics(route(model, index), {k: v for k, v in batch.items() if k != "adapter"})
        for k, name in enumerate(names):
            on = (index == k).astype(out["loss"].dtype)
            out[f"loss/{name}"] = out["loss"] * on
            out[f"weight/{name}"] = out["weight"] * on
        return out

    return metrics


def stacked(model: Any, names: tuple[str, ...]) -> Any:
    """The one-adapter LoRA `model` as `len(names)` adapters, each starting where a
    one-adapter run of the same seed starts (`zoo.lora.stack_adapters`).

    **Raises:** `ConfigError` for an adapter kind that cannot be stacked (DoRA, embedding
    LoRA, trainable tokens, `modules_to_save`)."""
    from ..lora import stack_adapters

    try:
        return stack_adapters(dict.fromkeys(names, model))
    except ValueError as e:
        raise ConfigError(f"--lora: several adapters (--data with adapter names): {str(e).splitlines()[0]}") from e


def stack_rows(parts: Mapping[str, Mapping[str, np.ndarray]], limit: int = 0) -> dict[str, np.ndarray]:
    """Each adapter's rows (the first `limit` of each, 0: all) one after another, with
    `"adapter"`, each row's adapter index."""
    arrays = [{k: v[:limit] if limit else v for k, v in p.items()} for p in parts.values()]
    out = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
    sizes = [len(next(iter(a.values()))) for a in arrays]
    out["adapter"] = np.repeat(np.arange(len(arrays), dtype=np.int32), sizes)
    return out
