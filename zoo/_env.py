"""The package's environment switches, read in one place (no jax import: `zoo/__init__.py`
reads them before anything else)."""

from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to a true value (`1`, `true`, `yes`, `on`)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def runtime_checks() -> bool:
    """Whether `ZOO_RUNTIME_CHECKS` asks for the runtime checks (jaxtyping + beartype on the
    package, id ranges inside compiled code): set to anything but empty, `0`, `false`, `no`."""
    return os.environ.get("ZOO_RUNTIME_CHECKS", "").strip().lower() not in ("", "0", "false", "no")
