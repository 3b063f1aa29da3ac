"""Whether a run's batches and held-out examples can fit in this machine's memory: a row
count far beyond it is refused with one line before anything is allocated, instead of a
`MemoryError` naming terabytes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._errors import ConfigError
from ._output import human_bytes


def host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_rows_fit(field: str, rows: int, bytes_per_row: int | float, what: str) -> None:
    """Refuse `rows` rows of `bytes_per_row` bytes each when they alone exceed the host's
    memory: a `ConfigError` naming `field` (e.g. `RunConfig.batch_size`), the size and the
    largest count that fits. `what` says what the rows are ("one batch")."""
    memory = host_memory()
    if memory is None or bytes_per_row <= 0 or rows * bytes_per_row <= memory:
        return
    fits = max(1, int(memory // bytes_per_row))
    raise ConfigError(
        f"{field} {rows} makes {what} of {human_bytes(rows * bytes_per_row)} ({human_bytes(bytes_per_row)} a row), more than "
        f"this machine's {human_bytes(memory)} of memory; lower it (at most about {fits})"
    )


def bytes_per_row(arrays: dict[str, Any]) -> float:
    """The bytes of one row of a dict of arrays with a leading row axis (0 when empty)."""
    values = [np.asarray(v) for v in arrays.values()]
    rows = len(values[0]) if values and np.ndim(values[0]) else 0
    return sum(v.nbytes for v in values) / rows if rows else 0.0
