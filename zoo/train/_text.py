"""The settings' text forms, each read and written back in one place (what a flag and a
config.json hold): `--lora` (`parse_lora`, `lora_text`), `--mesh` (`parse_mesh`,
`mesh_text`), the `key=value` pairs of `--model-config` (`parse_pairs`, `parse_scalar`) and
one data file per adapter, `--data NAME=FILE,...` (`adapter_files`, `files_text`,
`absolute_files`). No jax: the `zoo` command's help reads them."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..lora import LoraConfig
from ._errors import ConfigError

# `--lora` key → (LoraConfig field). Keys the user leaves out take the command's defaults
# (`parse_lora(defaults=)`), then LoraConfig's (peft's: r=8, lora_alpha=8, lora_dropout=0).
LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "target_modules",
    "exclude": "exclude_modules",
    "parameters": "target_parameters",
    "rslora": "use_rslora",
    "save": "modules_to_save",
    "use_dora": "use_dora",
    "init_lora_weights": "init_lora_weights",
    "ensure_weight_tying": "ensure_weight_tying",
    "trainable_token_indices": "trainable_token_indices",
}

LORA_EXAMPLE = "r=8,alpha=16,targets=q_proj+v_proj"

# `--lora`'s keys in words (the flags' help, `help_texts`).
LORA_HELP = (
    "Keys: r (rank), alpha (lora_alpha; scaling alpha/r), dropout (the branches' input dropout), "
    "targets (Linear names joined by '+', e.g. q_proj+v_proj, or all-linear), exclude (names joined "
    "by '+'), parameters (a mixture of experts' expert weights, peft's target_parameters, joined by '+', "
    "e.g. gate_up_proj+down_proj or gate+up+down; then targets=none adapts no Linear), "
    "rslora (true/false: scaling alpha/sqrt(r)), save (modules_to_save, names joined by '+', "
    "trained in full; a classifier's default is head, its new classification head; save=none "
    "freezes it), use_dora (true/false: DoRA, a trained magnitude per output), "
    "init_lora_weights (true, gaussian, pissa or olora: peft's initialisations), ensure_weight_tying "
    "(true/false: a tied head adapted with its embedding, targets embedding+lm_head), trainable_token_indices "
    "(token ids joined by '+': only those embedding rows train)"
)


def _lora_value(key: str, value: str) -> Any:
    """One `--lora` value, read as its LoraConfig field wants it; ValueError if it cannot."""
    if key == "r":
        if not value.isdigit():
            raise ValueError(f"r must be a positive integer, got {value!r}")
        return int(value)
    if key in ("alpha", "dropout"):
        number = float(value)  # ValueError names the value
        if not math.isfinite(number):
            raise ValueError(f"{key}={value} is not a finite number")
        if key == "alpha" and number == 0:  # the branches' scale: every adapter's output times 0
            raise ValueError(
                "alpha=0 scales every adapter's output by 0, so the run would learn nothing; give alpha > 0"
            )
        return int(number) if key == "alpha" and number.is_integer() and "." not in value else number
    if key == "trainable_token_indices":
        ids = [i.strip() for i in value.split("+")]
        if not all(i.isdigit() for i in ids):
            raise ValueError(f"trainable_token_indices must be token ids joined by '+', e.g. 3+9+20, got {value!r}")
        return tuple(int(i) for i in ids)
    if key in ("rslora", "use_dora", "ensure_weight_tying"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if key == "init_lora_weights":
        return {"true": True, "false": False}.get(value.lower(), value)  # LoraConfig checks the names
    names = tuple(n.strip() for n in value.split("+"))
    if key == "targets" and value == "all-linear":
        return value
    if key == "save" and value.lower() == "none":
        return None
    if key == "targets" and value.lower() == "none":
        return ()  # no Linear: the experts alone (`parameters=`); LoraConfig refuses it without them
    if not all(names):
        raise ValueError(f"{key} must be module names joined by '+', e.g. q_proj+v_proj, got {value!r}")
    return names


def parse_lora(text: str, defaults: dict[str, Any]):
    """`"r=8,alpha=16,targets=q_proj+v_proj"` → a `zoo.lora.LoraConfig`: `defaults`
    (LoraConfig field → value) where the text names no value. An empty text is the defaults."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"bad RunConfig.lora {text!r}: {why}; write key=value pairs joined by commas, e.g. {LORA_EXAMPLE}; "
            f"keys: {', '.join(LORA_KEYS)}"
        )

    fields = dict(defaults)
    seen: set[str] = set()
    for part in text.split(",") if text.strip() else ():
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise bad(f"{part.strip()!r} is not key=value")
        if key not in LORA_KEYS:
            close = difflib.get_close_matches(key, list(LORA_KEYS), n=1)
            raise bad(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if key in seen:
            raise bad(f"key {key!r} appears twice")
        seen.add(key)
        try:
            fields[LORA_KEYS[key]] = _lora_value(key, value)
        except ValueError as e:
            raise bad(str(e)) from e
    try:
        return LoraConfig(**fields)
    except ValueError as e:
        raise bad(str(e)) from e


def lora_text(config) -> str:
    """A `LoraConfig` written back as a `--lora` value (every key spelled out)."""

    def names(value) -> str:
        if value is None:
            return "none"
        return value if isinstance(value, str) else "+".join(value)

    parts = [f"r={config.r}", f"alpha={config.lora_alpha:g}", f"dropout={config.lora_dropout:g}"]
    parts.append(f"targets={names(config.target_modules) if config.target_modules else 'none'}")
    if config.exclude_modules:
        parts.append(f"exclude={names(config.exclude_modules)}")
    if config.target_parameters:
        parts.append(f"parameters={names(config.target_parameters)}")
    parts.append(f"rslora={'true' if config.use_rslora else 'false'}")
    parts.append(f"save={names(config.modules_to_save)}")
    if config.use_dora:
        parts.append("use_dora=true")
    if config.ensure_weight_tying:
        parts.append("ensure_weight_tying=true")
    if config.trainable_token_indices:
        parts.append("trainable_token_indices=" + "+".join(str(i) for i in config.trainable_token_indices))
    if config.init_lora_weights is not True:
        parts.append(f"init_lora_weights={str(config.init_lora_weights).lower()}")
    return ",".join(parts)


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=4,model=2"` → `{"data": 4, "model": 2}`: the text form of `RunConfig.mesh`
    (`--mesh`, a config.json), the one parser of it. A `ConfigError` naming
    `RunConfig.mesh` unless every part is `name=size`, each name once, each size >= 1."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"bad RunConfig.mesh {text!r}: write it as name=size[,name=size], e.g. data=4,model=2")
        if name in mesh:
            raise ConfigError(f"bad RunConfig.mesh {text!r}: axis {name!r} appears twice")
        mesh[name] = int(size)
    return mesh


def mesh_text(shape: dict[str, int]) -> str:
    """`{"data": 4, "model": 2}` → `"data=4,model=2"` (what --mesh reads)."""
    return ",".join(f"{k}={v}" for k, v in shape.items())


def parse_pairs(text: str, field: str, convert) -> dict[str, Any]:
    """`"a=1,b=2"` → `{"a": convert("1"), ...}`; ConfigError naming `field` if malformed."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise ConfigError(
                f"RunConfig.{field} {text!r}: {part.strip()!r} is not key=value; write key=value pairs joined by "
                "commas, e.g. d_model=64,num_layers=2"
            )
        if key in out:
            raise ConfigError(f"RunConfig.{field} {text!r}: key {key!r} appears twice")
        try:
            out[key] = convert(value)
        except ValueError as e:
            raise ConfigError(f"RunConfig.{field} {text!r}: bad value {value!r}") from e
    return out


def parse_scalar(value: str) -> Any:
    """The value of a `key=value` pair (`--model-config`, `RunConfig.model_config` text) as
    the Python scalar it spells: int, float, true/false, none, or else the string."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def adapter_files(source: str | None) -> dict[str, str] | None:
    """`--data NAME=FILE,NAME=FILE` as `{NAME: FILE}` (one data file per adapter, in the
    order given); None for any other `--data` (a data set's name, or one file).

    **Raises:** `ConfigError` for a malformed pair, a name given twice or one that
    cannot be a folder's."""
    if source is None or "=" not in source or Path(source).expanduser().exists():
        return None
    files: dict[str, str] = {}
    for part in source.split(","):
        name, eq, file = (s.strip() for s in part.partition("="))
        if not eq or not name or not file:
            raise ConfigError(
                f"DataConfig.source {source!r}: {part.strip()!r} is not NAME=FILE; one file per adapter is written "
                "NAME=FILE pairs joined by commas, e.g. DataConfig.source support=support.jsonl,billing=billing.jsonl"
            )
        check_name(name, f"--data {source!r}")
        if name in files:
            raise ConfigError(
                f"DataConfig.source {source!r}: adapter {name!r} is named twice; give each adapter one file"
            )
        files[name] = file
    return files


def files_text(files: Mapping[str, str]) -> str:
    """`{NAME: FILE}` as the `--data` text `NAME=FILE,NAME=FILE` (config.json's form)."""
    return ",".join(f"{name}={file}" for name, file in files.items())


def check_name(name: Any, where: str) -> None:
    """An adapter's name: a non-empty string that can name its folder (adapter/NAME)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: adapter name {name!r} is not a non-empty string; name each adapter with text")
    if name in (".", "..") or "/" in name or os.sep in name or "," in name or "=" in name or name != name.strip():
        raise ConfigError(
            f"{where}: adapter name {name!r} cannot name a folder (adapter/{name}); use letters, digits, - or _"
        )


def absolute_files(source: str) -> str:
    """`NAME=FILE,...` with each existing file's path absolute (a resumed run finds them
    from anywhere); any other `source` as it is."""
    files = adapter_files(source)
    if files is None:
        return source
    return files_text(
        {n: str(Path(f).expanduser().resolve()) if Path(f).expanduser().exists() else f for n, f in files.items()}
    )


def quantize_kind(text: str) -> tuple[str, int | None, bool]:
    """`RunConfig.quantize` read: `(kind, block size or None, double quantisation)` from
    "nf4", "int4", "int8", "nf4:32" / "int4:64" (a 4-bit block of inputs) or "nf4:dq" /
    "nf4:64:dq" (NF4's scales in 8 bits), as `zoo.hf.from_pretrained(quantize=)`
    reads it. **Raises:** `ConfigError` naming the forms."""
    from ..nn._quantized import quantize_kind as read

    try:
        return read(text)
    except ValueError as e:
        raise ConfigError(f"RunConfig.{e}") from None
