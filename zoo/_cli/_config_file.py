"""`--config FILE`: a command's flags from a TOML, YAML or JSON file.

Keys are the long flags without the dashes, `-` or `_` alike (`batch-size` or
`batch_size`); `model` names the model. Values take the flag's type; the key=value
flags (`mesh`, `lora`, `model-config`) also take a table / mapping
(`mesh = {data = 4, model = 2}`), a `targets`/`save`/`exclude` entry of `lora` also a
list. Flags given on the command line override the file. A run's `config.json` is such a
file: `zoo train --config runs/<run>/config.json` runs it again.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from ._common import CLIError

# Keys that are not flags of the file's command but may appear in a run's config.json.
IGNORED_KEYS = ("command", "derived")
# Flags that make no sense in a file.
_NOT_IN_FILES = ("config", "help")


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct (json keeps the last of a repeated key silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(f"key {key!r} appears twice; keep one")
        seen[key] = value
    return seen


def _strict_yaml_loader():
    """yaml's SafeLoader, refusing a mapping with a key twice (it keeps the last silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise _DuplicateKey(f"key {key!r} appears twice; keep one")
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def read_config_file(path: str) -> dict[str, Any]:
    """The top-level table of a .toml, .yaml/.yml or .json file (CLIError if unreadable)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"--config {path}: no such file")
    suffix = file.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            with open(file, "rb") as f:
                values = tomllib.load(f)
        elif suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.load(file.read_text(), Loader=_strict_yaml_loader()) or {}
        elif suffix == ".json":
            values = json.loads(file.read_text(), object_pairs_hook=_no_duplicates)
        else:
            raise CLIError(
                f"--config {path}: unknown file type {suffix or '(none)'!r}; use .toml, .yaml, .yml or .json"
            )
    except CLIError:
        raise
    except Exception as e:  # tomllib / yaml / json each raise their own error types
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CLIError(f"--config {path}: cannot parse it as {suffix[1:].upper()}: {first}") from e
    if not isinstance(values, dict):
        raise CLIError(f"--config {path}: the file must hold a table of flag = value, got a {type(values).__name__}")
    return values


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest → action of the parser's flags and positionals that a file may set."""
    return {
        a.dest: a
        for a in parser._actions  # argparse keeps them here; there is no public accessor
        if a.dest not in _NOT_IN_FILES and a.dest != argparse.SUPPRESS
    }


def _pairs(value: dict[str, Any], key: str) -> str:
    """A mapping as the `k=v,...` text of a key=value flag (lists joined by '+')."""
    parts = []
    for k, v in value.items():
        if isinstance(v, list | tuple):
            v = "+".join(str(x) for x in v)
        elif isinstance(v, bool):
            v = "true" if v else "false"
        elif v is None:
            v = "none"
        parts.append(f"{k}={v}")
    if not parts:
        raise CLIError(f"--config: {key} is an empty table; leave the key out instead")
    return ",".join(parts)


def _convert(key: str, value: Any, action: argparse.Action, path: str) -> Any:
    """One file value as the flag would have parsed it."""
    where = f"--config {path}: {key}"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise CLIError(f"{where} must be true or false, got {value!r}")
        return value
    if value is None:
        return None
    if isinstance(value, dict):
        value = _pairs(value, key)
    elif isinstance(value, bool):
        raise CLIError(f"{where} takes a value ({action.metavar or action.dest}), not {str(value).lower()}")
    if action.type is not None:
        try:
            value = action.type(str(value)) if isinstance(value, str) or action.type in (int, float) else value
        except (TypeError, ValueError):
            kind = {int: "an integer", float: "a number"}.get(action.type, "valid")
            raise CLIError(f"{where} must be {kind}, got {value!r}") from None
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise CLIError(f"{where} must be one of {list(action.choices)}, got {value!r}")
    return value


def config_defaults(path: str, parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """The file's values as `parser.set_defaults` keywords (dest → value), checked: an
    unknown key fails naming it and listing the valid ones."""
    values = read_config_file(path)
    actions = _actions(parser)
    out: dict[str, Any] = {}
    unknown = []
    # A run's config.json lists the values it derived (RunConfig.derived: a warmup from its
    # steps, ...): left out, so that this run derives them from its own flags.
    derived = {str(k).replace("-", "_") for k in values.get("derived") or ()}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key in IGNORED_KEYS or key in derived:
            continue
        if key not in actions:
            unknown.append(str(raw_key))
            continue
        out[key] = _convert(str(raw_key), value, actions[key], path)
    if unknown:
        names = sorted(k.replace("_", "-") for k in actions)
        close = {k: difflib.get_close_matches(k.replace("_", "-"), names, n=1) for k in unknown}
        hints = ", ".join(f"{k!r} -> {c[0]!r}" for k, c in close.items() if c)
        raise CLIError(
            f"--config {path}: unknown keys {unknown} for zoo {command}"
            + (f" (did you mean {hints}?)" if hints else "")
            + f"; valid keys: {', '.join(names)}"
        )
    return out
