"""Reading a user's data file (`.txt`, `.jsonl`, `.csv`) and telling which format it holds."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Literal

Kind = Literal["text", "prompt_completion", "chat", "classification"]

FORMATS = (
    '.txt (plain text), or .jsonl lines holding {"text"}, {"prompt", "completion"}, {"messages"} or '
    '{"text", "label"}, or .csv with "text" and "label" columns'
)


class DataFormatError(ValueError):
    """A data file zoo cannot read: an unknown extension, an empty file, a line with none
    of the known keys, or lines of different formats in one file."""


def _kind(record: Any, where: str) -> Kind:
    """The format of one `.jsonl` record."""
    if not isinstance(record, dict):
        raise DataFormatError(
            f"{where}: expected a JSON object, got {type(record).__name__}; each line must be one of {FORMATS}"
        )
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record and "label" in record:
        return "classification"
    if "text" in record:
        return "text"
    raise DataFormatError(
        f"{where}: none of the known keys (found {sorted(record)}); each line needs "
        '"text", "prompt"+"completion", "messages" or "text"+"label"'
    )


def read_records(path: str | os.PathLike, *, data: bytes | None = None) -> tuple[Kind, list[dict[str, Any]]]:
    """The records of a data file and their format.

    **Arguments:** `path`, a `.txt`, `.jsonl` or `.csv` file; `data`, its bytes when the
    caller has read them already (the file is then not opened again).

    **Returns:** `(kind, records)`: `kind` is `"text"`, `"prompt_completion"`, `"chat"` or
    `"classification"`; each record is a dict (`.txt`: one record `{"text": whole file}`).
    Raises `DataFormatError` (one line, naming the file and line) for an unknown
    extension, an empty file, a record with none of the known keys, or mixed formats.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl", ".csv"):
        raise DataFormatError(f"{str(path)!r}: unknown extension {suffix or '(none)'!r}; zoo reads {FORMATS}")
    text = (path.read_bytes() if data is None else data).decode("utf-8")
    if not text.strip():
        raise DataFormatError(f"{str(path)!r} is empty; put at least one example in it ({FORMATS})")
    if suffix == ".txt":
        return "text", [{"text": text}]
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        columns = reader.fieldnames or []
        if "text" not in columns or "label" not in columns:
            raise DataFormatError(
                f"{str(path)!r}: a .csv needs a header with 'text' and 'label' columns (classification), found {columns}"
            )
        records = [{"text": row["text"], "label": row["label"]} for row in reader]
        if not records:
            raise DataFormatError(f"{str(path)!r} has a header but no rows")
        return "classification", records
    records, kinds = [], {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(
                f"{where} is not valid JSON ({e.msg}); a .jsonl holds one JSON object per line"
            ) from None
        kinds.setdefault(_kind(record, where), number)
        records.append(record)
    if len(kinds) > 1:
        first = ", ".join(f"{k} (first at line {n})" for k, n in kinds.items())
        raise DataFormatError(f"{str(path)!r} mixes formats: {first}; put each format in its own file")
    (kind,) = kinds
    return kind, records
