"""The package's environment, read in one place: its switches and its installed version
(no jax import: `zoo/__init__.py` reads them before anything else)."""

from __future__ import annotations

import importlib.metadata
import os

try:
    VERSION = importlib.metadata.version("eqx-zoo")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    VERSION = "0+unknown"


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to a true value (`1`, `true`, `yes`, `on`)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def runtime_checks() -> bool:
    """Whether `ZOO_RUNTIME_CHECKS` asks for the runtime checks (jaxtyping + beartype on the
    package, id ranges inside compiled code): set to anything but empty, `0`, `false`, `no`."""
    return os.environ.get("ZOO_RUNTIME_CHECKS", "").strip().lower() not in ("", "0", "false", "no")
