"""A resumed run continues the run saved in its folder: the settings it leaves unset come
from that run's config.json, and a setting that would change what it trains is refused.
`RunConfig.resolved` does both, so `zoo train --resume` and `zoo.train.run(RunConfig(...,
resume=True))` continue a run alike. Works on the flat form (`RunConfig.to_dict`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._errors import ConfigError
from ._flags import Flag


def saved_config(output: str | None) -> dict[str, Any] | None:
    """The flat config (config.json) of the run saved in the folder `output`; None
    without a folder or the file. A `ConfigError` if the file cannot be read."""
    if not output:
        return None
    path = Path(output).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"RunConfig.resume: cannot read {path}: {e}; fix or remove it") from e
    if not isinstance(saved, dict):
        raise ConfigError(f"RunConfig.resume: {path} is not a run's config.json (not a JSON object); fix or remove it")
    return saved


def inherit(given: dict[str, Any], saved: dict[str, Any], flags: dict[str, Flag]) -> dict[str, Any]:
    """`given` (the flat keys a config sets) over the saved run's values of every key
    that is not this launch's own (`Flag.resume != "launch"`)."""
    inherited = {k for k, f in flags.items() if f.resume != "launch"}
    return {k: v for k, v in saved.items() if k in inherited and v is not None} | given


def check_unchanged(now: dict[str, Any], saved: dict[str, Any], flags: dict[str, Flag], normal) -> None:
    """Refuse a resumed run whose flat config `now` changes a setting of the saved run
    that changes what it trains (`Flag.resume == "fixed"`), naming each field.
    `normal(key, value)` is the value's comparable form."""
    changed = [
        f"{flags[k].field} {now[k]} (was {saved[k]})"
        for k in sorted(now)
        if k in saved and k in flags and flags[k].resume == "fixed" and normal(k, now[k]) != normal(k, saved[k])
    ]
    if changed:
        raise ConfigError(
            f"RunConfig.resume: {', '.join(changed)} would change the run saved in {now['output']}; drop "
            f"{'them' if len(changed) > 1 else 'it'} to continue that run, or start a new one (another "
            "RunConfig.output, or RunConfig.overwrite without RunConfig.resume)"
        )
