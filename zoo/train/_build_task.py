"""`build_task`: the task of any registered model (`zoo.train.model_spec`), on one of its
built-in data sets or on a user's data file (`zoo.train._user_data`).

`zoo train`, `zoo finetune`, `zoo info` and `zoo inspect` all build their model here, from
a `RunConfig`, so the same settings give the same model.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._tree import human_bytes
from ._adapters import adapters_task, read_adapter_records
from ._config import RunConfig, check_fits_model
from ._errors import ConfigError
from ._registry import model_spec
from ._task import Task
from ._user_data import check_data_file, user_data_task


def build_task(config: RunConfig, *, rules, mesh) -> Task:
    """The task of model `config.model` (`zoo.train.model_spec`) on data
    `config.data.source`.

    **Arguments:**

    - `config`: the run's `RunConfig` with its defaults applied
      (`config.resolved(command)`, what `zoo.train.run` builds from). `data.source` None
      builds the model alone (`zoo info`, `zoo inspect`): no data is read, and the task's
      batches are random ones of the real shapes and dtypes.
    - `rules`, `mesh`: pretrained weights are read straight onto `mesh` under `rules`
      (`zoo.hf.from_pretrained`); a model built from scratch is left unplaced.

    **Returns:** the `Task`. Raises `zoo.train.ConfigError` for settings the model does
    not take (an unknown name or data set, a data file it cannot read or train on,
    `--init` for a model without pretrained weights or of another architecture, a dtype
    it does not compute in).
    """
    if config.steps is None or config.batch_size is None:
        raise ConfigError("build_task takes a config with its defaults applied: pass config.resolved(command)")
    spec = model_spec(config.model)
    check_data_file(config)  # a data set of the model's, or a file it trains on
    check_fits_model(config, spec)  # as `resolved` does: a config filled in by hand too
    # Every example holds at least one 4-byte value per token: a held-out set that cannot
    # fit even so is refused before it is drawn (a bound, so never a false refusal).
    check_rows_fit("DataConfig.eval_size", config.data.eval_size, 4 * (config.data.seq_len or 1), "the held-out set")
    try:
        if config.data.source is not None and config.data.source not in spec.datasets:
            adapters = read_adapter_records(config.data.source) if spec.kind == "lm" else None
            if adapters is not None:  # several adapters, each on its own records
                return adapters_task(config, adapters, rules=rules, mesh=mesh)
            return user_data_task(config, rules=rules, mesh=mesh)
        return spec.build(config, rules=rules, mesh=mesh)
    except MemoryError as e:
        if not config.data.eval_size:
            raise
        raise ConfigError(
            f"DataConfig.eval_size {config.data.eval_size}: the held-out examples do not fit in memory ({e}); lower it"
        ) from e


# --------------------------------------------------------------------------- memory bounds
# Whether a run's batches and held-out examples can fit in this machine's memory: a row
# count far beyond it is refused with one line before anything is allocated, instead of a
# `MemoryError` naming terabytes.


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
