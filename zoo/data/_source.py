"""What a training task draws its batches from: a `BatchSource` gives the batch of any step,
this process's rows of it (`zoo.data.Dataset` is one; so are the built-in models' data)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import numpy as np

from .._distributed import local_rows


@runtime_checkable
class BatchSource(Protocol):
    """Training batches indexed by step: what a `zoo.train.Task` trains on.

    One method, `batch_at(step, batch_size, *, seed=0, mesh=None, data_axes="data")`: the
    batch of training step `step` (from 1) as a dict of numpy arrays with `batch_size`
    rows over every process, this process's rows of it (`local_batch`). A function of
    `(step, batch_size, seed)` alone, so every process draws the same global batch and a
    resumed run sees the batches it would have seen. `zoo.data.Dataset` is one (a user's
    file: epochs of seeded permutations); the built-in models' synthetic data and corpora
    are others (`zoo.train`).
    """

    def batch_at(
        self,
        step: int,
        batch_size: int,
        *,
        seed: int = 0,
        mesh: jax.sharding.Mesh | None = None,
        data_axes: str | tuple[str, ...] = "data",
    ) -> dict[str, np.ndarray]: ...


def local_batch(
    batch: dict[str, np.ndarray], *, mesh: jax.sharding.Mesh | None = None, data_axes: str | tuple[str, ...] = "data"
) -> dict[str, np.ndarray]:
    """This process's rows of a global batch (numpy arrays, rows first): every row with
    one process, else its block of them (`zoo.local_rows` over `data_axes` of `mesh`;
    default: the mesh set by `jax.set_mesh`). The inverse of `zoo.global_batch`, which
    assembles these rows into the global array.

    **Returns:** a dict of the same keys."""
    if jax.process_count() == 1:
        return batch
    rows = local_rows(len(next(iter(batch.values()))), mesh, data_axes)
    return {name: array[rows] for name, array in batch.items()}
