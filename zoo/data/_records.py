"""Reading a user's data file (`.txt`, `.jsonl`, `.json`, `.csv`) and telling which format it holds."""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

Kind = Literal["text", "prompt_completion", "chat", "classification", "preference", "prompt"]

FORMATS = (
    '.txt (plain text), or .jsonl lines (or a .json array) holding {"text"}, {"prompt", "completion"}, {"messages"}, '
    '{"text", "label"}, {"prompt", "chosen", "rejected"} (preference pairs) or {"prompt"} alone (prompts for GRPO), '
    'or .csv with "text" and "label" columns'
)
PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


class DataFormatError(ValueError):
    """A data file zoo cannot read: an unknown extension, an empty file, a line with none
    of the known keys, or lines of different formats in one file."""


def folder_refused(path: str | os.PathLike) -> DataFormatError:
    """The error for a folder given as a data file (Hugging Face `datasets` reads a folder of
    files as one data set; zoo reads one file)."""
    return DataFormatError(
        f"{str(path)!r} is a folder; zoo reads one data file: join its files into one (e.g. cat {path}/*.jsonl > "
        "all.jsonl) and pass that"
    )


# Other tools' formats a line may be in, and how to write it in one zoo reads.
_OTHER_FORMATS = {
    "conversations": (
        '; ShareGPT\'s "conversations" of {"from", "value"} are "messages" of {"role", "content"} '
        '(human: "user", gpt: "assistant")'
    ),
    "instruction": '; Alpaca\'s "instruction" (+ "input") and "output" are a "prompt" and a "completion"',
}


def extract_prompt(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A preference pair without a `"prompt"` (TRL's implicit prompt) with its prompt: the
    longest shared beginning of `chosen` and `rejected` (messages of a conversation, or
    characters of a text, less the space before where they part, as TRL's
    `extract_prompt`), cut from both."""
    chosen, rejected = record["chosen"], record["rejected"]
    if type(chosen) is not type(rejected) or not isinstance(chosen, str | list):
        return record  # the field checks name what is wrong
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise DataFormatError(
            f"{where}: a preference pair without a 'prompt' has its prompt in chosen and rejected (TRL's implicit "
            f"prompt), but they {'share no beginning' if n == 0 else 'differ in nothing past their shared one'}; "
            'add a "prompt" field'
        )
    return {**record, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _kind(record: Any, where: str) -> Kind:
    """The format of one `.jsonl` record."""
    if not isinstance(record, dict):
        raise DataFormatError(
            f"{where}: expected a JSON object, got {type(record).__name__}; each line must be one of {FORMATS}"
        )
    if "chosen" in record or "rejected" in record:
        missing = [k for k in PREFERENCE_FIELDS if k not in record]
        if missing:
            raise DataFormatError(
                f"{where}: a preference pair needs {' + '.join(map(repr, PREFERENCE_FIELDS))}, but {missing} "
                f"{'is' if len(missing) == 1 else 'are'} missing (found {sorted(record)}); add "
                f"{'it' if len(missing) == 1 else 'them'} or remove the line"
            )
        return "preference"
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "prompt" in record and "text" not in record:
        return "prompt"  # prompts alone (GRPO's rollouts complete them); other keys are the rewards' columns
    if "text" in record and "label" in record:
        return "classification"
    if "text" in record:
        return "text"
    hint = next((h for k, h in _OTHER_FORMATS.items() if k in record), "")
    raise DataFormatError(
        f"{where}: none of the known keys (found {sorted(record)}); each line needs "
        '"text", "prompt"+"completion", "messages", "text"+"label", "prompt"+"chosen"+"rejected" or "prompt" alone'
        + hint
    )


def _check_fields(kind: Kind, record: dict[str, Any], where: str) -> None:
    """Refuse a record whose fields are not what its format holds: texts, prompts and
    completions strings, chat messages objects with a string role and content, labels
    non-empty strings or integers >= 0 (zoo has no ignore label: a -1 would be a class)."""
    if kind == "prompt_completion" and isinstance(record["prompt"], list) and isinstance(record["completion"], list):
        _check_conversational_pair(record, where)  # TRL's conversational prompt-completion
        return
    if kind == "prompt_completion" and (isinstance(record["prompt"], list) or isinstance(record["completion"], list)):
        raise DataFormatError(
            f"{where}: field 'prompt' is {type(record['prompt']).__name__} but 'completion' is "
            f"{type(record['completion']).__name__}; write both as strings or both as lists of "
            '{"role": ..., "content": ...} messages'
        )
    names = {"text": ("text",), "classification": ("text",), "prompt_completion": ("prompt", "completion")}
    for name in names.get(kind, ()):
        if not isinstance(record[name], str):
            raise DataFormatError(
                f"{where} field {name!r} is {type(record[name]).__name__} {record[name]!r}, not a string; "
                'write it as a JSON string ("...")'
            )
    if kind == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataFormatError(
                f"{where} field 'messages' must be a non-empty list of "
                '{"role": ..., "content": ...} objects, got ' + type(messages).__name__
            )
        _check_messages(messages, "messages", where)
    if kind == "preference":
        _check_preference(record, where)
    if kind == "prompt":
        _check_prompt(record["prompt"], where)
    if kind == "classification":
        label = record["label"]
        if isinstance(label, str) and not label.strip():
            raise DataFormatError(f"{where} field 'label' is empty; give every example a label (or remove the line)")
        negative = isinstance(label, str) and re.fullmatch(r"\s*-\d+\s*", label)
        if negative or isinstance(label, int) and not isinstance(label, bool) and label < 0:
            raise DataFormatError(
                f"{where} field 'label' is {label!r}: labels are integers >= 0 or names, and zoo has no ignore "
                "label; give the example its class (or remove the line)"
            )
        if not (isinstance(label, str) or isinstance(label, int) and not isinstance(label, bool)):
            raise DataFormatError(
                f"{where} field 'label' is {type(label).__name__} {label!r}; a label is an integer >= 0 or a name "
                "(a string)"
            )


def _check_messages(messages: list[Any], name: str, where: str) -> None:
    """Each item of a list of messages an object with a string role and content (a turn
    calling tools may have `"content": null`, as OpenAI's and transformers' tool calls do)."""
    for i, m in enumerate(messages):
        content = m.get("content", "") if isinstance(m, dict) else None
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and (isinstance(content, str) or content is None and "tool_calls" in m)
        ):
            raise DataFormatError(
                f"{where} field {name!r} item {i} is {m!r}; each message must be an object with a string "
                '"role" and a string "content" (null only beside "tool_calls")'
            )


def _check_conversational_pair(record: dict[str, Any], where: str) -> None:
    """A conversational prompt / completion: two lists of messages, the completion not empty."""
    for name in ("prompt", "completion"):
        if not record[name]:
            raise DataFormatError(f"{where} field {name!r} is an empty list; give it at least one message")
        _check_messages(record[name], name, where)


def _check_preference(record: dict[str, Any], where: str) -> None:
    """A pair's fields: all texts, or all conversations (lists of messages, the prompt's
    ending on a user turn), with non-empty completions."""
    forms = {
        k: "text" if isinstance(record[k], str) else "messages" if isinstance(record[k], list) else None
        for k in PREFERENCE_FIELDS
    }
    for k, form in forms.items():
        if form is None:
            raise DataFormatError(
                f"{where} field {k!r} is {type(record[k]).__name__} {record[k]!r}; a preference field is a string or "
                'a list of {"role": ..., "content": ...} messages'
            )
    if len(set(forms.values())) > 1:
        raise DataFormatError(
            f"{where}: mixes texts and message lists ({', '.join(f'{k}: {v}' for k, v in forms.items())}); write "
            "prompt, chosen and rejected all as strings or all as lists of messages"
        )
    for k in ("chosen", "rejected"):
        value = record[k]
        empty = (
            not value.strip()
            if isinstance(value, str)
            else not value or not any(isinstance(m, dict) and str(m.get("content", "")).strip() for m in value)
        )
        if empty:
            raise DataFormatError(
                f"{where} field {k!r} is empty; a preference pair needs two non-empty completions "
                "(fill it in or remove the line)"
            )
    if forms["prompt"] == "messages":
        for k in PREFERENCE_FIELDS:
            _check_messages(record[k], k, where)


def _check_prompt(prompt: Any, where: str) -> None:
    """A prompt alone: a non-empty string, or a conversation (messages) ending on a user turn."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataFormatError(f"{where} field 'prompt' is empty; give every line a prompt (or remove the line)")
        return
    if not isinstance(prompt, list) or not prompt:
        raise DataFormatError(
            f"{where} field 'prompt' is {type(prompt).__name__} {prompt!r}; a prompt is a string or a non-empty list "
            'of {"role": ..., "content": ...} messages'
        )
    _check_messages(prompt, "prompt", where)
    if prompt[-1]["role"] == "assistant":
        raise DataFormatError(
            f"{where} field 'prompt' ends on an assistant turn; a prompt to complete ends on a user (or system) turn"
        )


def read_records(path: str | os.PathLike, *, data: bytes | None = None) -> tuple[Kind, list[dict[str, Any]]]:
    """The records of a data file and their format.

    **Arguments:** `path`, a `.txt`, `.jsonl`, `.json` (an array of records) or `.csv` file; `data`, its bytes when the
    caller has read them already (the file is then not opened again).

    **Returns:** `(kind, records)`: `kind` is `"text"`, `"prompt_completion"`, `"chat"` or
    `"classification"`; each record is a dict (`.txt`: one record `{"text": whole file}`).
    Raises `DataFormatError` (one line, naming the file and line) for an unknown
    extension, an empty file, a record with none of the known keys, mixed formats, or a
    field of the wrong type (a number as a text, an empty or negative label).
    """
    kind, records, _ = read_located(path, data=data)
    return kind, records


def _json_records(text: str, path: Path) -> Iterator[tuple[str, Any]]:
    """`(where, record)` of a `.jsonl` (one JSON value per line) or a `.json`: one
    JSON array of records (`"NAME item N"`, from 1), else JSON lines, as the `json` loader
    of Hugging Face `datasets` reads both."""
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFormatError(
                f"{path.name} line {e.lineno} is not valid JSON ({e.msg}); a .json holds one JSON array of objects "
                "(or one object per line)"
            ) from None
        yield from ((f"{path.name} item {n}", item) for n, item in enumerate(items, start=1))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            array = " (a JSON array? name the file .json)" if number == 1 and line.strip() == "[" else ""
            raise DataFormatError(
                f"{where} is not valid JSON ({e.msg}); a {path.suffix.lower()} holds one JSON object per line{array}"
            ) from None
        yield where, record


def read_located(path: str | os.PathLike, *, data: bytes | None = None) -> tuple[Kind, list[dict[str, Any]], list[str]]:
    """`read_records` with where each record is: `"NAME line N"` (a `.json` array's:
    `"NAME item N"`; a `.txt`: `"NAME"`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl", ".json", ".csv"):
        raise DataFormatError(f"{str(path)!r}: unknown extension {suffix or '(none)'!r}; zoo reads {FORMATS}")
    text = (path.read_bytes() if data is None else data).decode("utf-8-sig")  # a leading BOM is no text
    if not text.strip():
        raise DataFormatError(f"{str(path)!r} is empty; put at least one example in it ({FORMATS})")
    if suffix == ".txt":
        return "text", [{"text": text}], [path.name]
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        columns = reader.fieldnames or []
        if "text" not in columns or "label" not in columns:
            raise DataFormatError(
                f"{str(path)!r}: a .csv needs a header with 'text' and 'label' columns (classification), found {columns}"
            )
        records, wheres = [], []
        for row in reader:
            where = f"{path.name} line {reader.line_num}"
            # A short row leaves its missing columns None: an empty text or label.
            record = {"text": row["text"] or "", "label": row["label"] or ""}
            _check_fields("classification", record, where)
            records.append(record)
            wheres.append(where)
        if not records:
            raise DataFormatError(f"{str(path)!r} has a header but no rows")
        return "classification", records, wheres
    records, kinds, wheres = [], {}, []
    for where, record in _json_records(text, path):
        if isinstance(record, dict) and "prompt" not in record and "chosen" in record and "rejected" in record:
            record = extract_prompt(record, where)
        kind = _kind(record, where)
        kinds.setdefault(kind, where.removeprefix(f"{path.name} "))  # "line N" / "item N"
        _check_fields(kind, record, where)
        records.append(record)
        wheres.append(where)
    if len(kinds) > 1:
        first = ", ".join(f"{k} (first at {at})" for k, at in kinds.items())
        raise DataFormatError(f"{str(path)!r} mixes formats: {first}; put each format in its own file")
    (kind,) = kinds
    return kind, records, wheres
