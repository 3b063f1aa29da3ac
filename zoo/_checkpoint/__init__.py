"""Checkpoints of a whole training state: sharded, atomic, checked, keep-last-k.

A checkpoint is one orbax-checkpoint step directory `<directory>/<step>/` holding two
items committed together:

- `state/`: every array leaf of the state, written shard by shard by the processes that
  hold them (tensorstore, OCDBT layout), keyed by the leaf's `jax.tree_util.keystr` path.
  Typed PRNG keys are stored as their key data (`uint32`).
- `manifest/`: JSON: format version, zoo / jax versions, the step, each leaf's path, kind,
  shape, dtype (and key implementation), a 32-bit fingerprint of its bits, the values of
  Python scalar leaves, the configs of the models in the state, and the user's metadata.

Orbax writes a step into `<step>.orbax-checkpoint-tmp*/` and renames it to `<step>/`
once every item of every process is written, so an interrupted save never shows up as a
step. Restores read the manifest first and compare it with the target structure before
touching array data, then recompute the fingerprints of what was read.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._checkpointer": ("Checkpointer", "Restored"),
        "._manifest": ("CheckpointError", "DamagedCheckpointError"),
    },
)

if TYPE_CHECKING:
    from ._checkpointer import Checkpointer as Checkpointer
    from ._checkpointer import Restored as Restored
    from ._manifest import CheckpointError as CheckpointError
    from ._manifest import DamagedCheckpointError as DamagedCheckpointError
