"""The checkpointer: numbered checkpoints of whole training states in a directory."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from .._env import VERSION
from .._mismatch import listed
from ._disk import disk_full_error, is_disk_full, quiet_disk_full_logs
from ._fingerprint import compute_fingerprints
from ._manifest import (
    ARRAY,
    FORMAT,
    FORMAT_VERSION,
    KEY,
    NUMPY,
    CheckpointError,
    DamagedCheckpointError,
    abstract,
    configs,
    describe_leaf,
    flatten,
    mismatch,
)
from ._restore import plan

# A reader's listing races a writer deleting old steps; each retry sees the steps left.
_LIST_ATTEMPTS = 8


def _has_files(folder: str) -> bool:
    """Whether `folder` exists and holds anything."""
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns: unpack it as `step, state, metadata = ...`."""

    step: int
    state: Any
    metadata: dict[str, Any]


def _short(error: BaseException, limit: int = 600) -> str:
    """The head of an error's text (tensorstore appends its whole JSON spec; the full
    error stays chained as the cause)."""
    text = str(error).split(" [tensorstore_spec")[0]
    return text if len(text) <= limit else text[:limit] + " …"


class Checkpointer:
    """Saves and restores whole training states in a directory of numbered checkpoints.

    A state is any pytree of arrays and Equinox modules, typically
    `{"model": model, "opt_state": opt_state, "key": key}`. What is saved: every array
    leaf (sharded `jax.Array`s shard by shard, NumPy arrays, typed PRNG keys) and every
    Python `bool`/`int`/`float`/`str` leaf. What is not: the tree's structure and static
    parts (configs, static fields, functions held as leaves), which come from the `like`
    tree given to `restore`.

    Built on orbax-checkpoint (`CheckpointManager`): every process writes its own shards,
    one commit makes the step visible, and restore reads into any target sharding. Every
    process must call `save` and `restore` with the same arguments.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        """**Arguments:**

        - `directory`: where the checkpoints live (created if missing): a local or shared
          path, or a `gs://` URL. Each step is a subdirectory named by its number.
        - `keep`: keep the newest `keep` checkpoints and delete older ones after each
          save; `None` keeps all.
        - `async_save`: if `True`, `save` returns once the arrays are copied to host
          memory and the files are written in the background (see `wait`).
        - `read_only`: only list and restore. Opening a directory otherwise deletes the
          temporary directories of unfinished saves, so a process that reads while
          another one trains into the same directory (an evaluator) must pass `True`.
        """
        import orbax.checkpoint as ocp  # here: its import is slow, `import zoo` stays quick

        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        self._ocp = ocp
        self.read_only = read_only
        path = os.fspath(directory)
        self.directory = path if "://" in path else os.path.abspath(path)
        options = ocp.CheckpointManagerOptions(
            # Read-only: orbax warns about a max_to_keep or save interval it then ignores.
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
            # Interrupted saves leave `<step>.orbax-checkpoint-tmp*` directories: never
            # steps, removed (by process 0) when a Checkpointer opens the directory.
            cleanup_tmp_directories=not read_only,
        )
        import logging

        absl = logging.getLogger("absl")
        level = absl.level
        if read_only:  # orbax's "Given directory is read only" warning says what the caller asked for
            absl.setLevel(max(level, logging.ERROR))
        try:
            self._manager = self._open_manager(options)
        finally:
            absl.setLevel(level)
        self._pending: int | None = None  # the step of the last save started
        quiet_disk_full_logs()

    def _open_manager(self, options: Any) -> Any:
        """orbax's manager of the directory; a reader looks again when a step vanishes.

        orbax lists the step folders, then reads each one's time: a writer's `keep`
        deleting the oldest step in between raises `FileNotFoundError` for a folder
        that was never the reader's concern, so a read-only opener lists again.
        """
        attempts = 1
        while True:
            try:
                return self._ocp.CheckpointManager(self.directory, options=options, item_names=("state", "manifest"))
            except FileNotFoundError as e:
                gone = os.fspath(e.filename or "")
                inside = gone.startswith(self.directory + os.sep) and os.path.isdir(self.directory)
                if not self.read_only or not inside or attempts == _LIST_ATTEMPTS:
                    raise
                attempts += 1

    def _disk_full(self, error: Exception) -> Exception:
        """A full disk as `OSError(ENOSPC)` naming the directory; any other error as it is."""
        return disk_full_error(self.directory, error) if is_disk_full(error) else error

    # -- context manager ----------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for writes in flight, then release orbax's resources."""
        try:
            self._manager.close()
        except Exception as e:
            raise self._disk_full(e) from e

    def wait(self) -> None:
        """Block until every save started so far is written and committed.

        Errors of a background write are raised here (or by the next `save`); a full
        disk as `OSError` with `errno.ENOSPC` and the directory as its `filename` (the
        checkpoints committed before stay whole; the unfinished one is never a step).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._disk_full(e) from e

    # -- listing ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps of the committed checkpoints in the directory, oldest first.

        A step being written (by an asynchronous save still in flight) is not one yet.
        """
        steps = sorted(self._manager.all_steps())
        # orbax lists a step as soon as its save starts.
        if self._pending in steps and self._manager.is_saving_in_progress():
            steps.remove(self._pending)
        if self.read_only and "://" not in self.directory:  # another process's save not begun: no step yet
            steps = [n for n in steps if _has_files(os.path.join(self.directory, str(n)))]
        return steps

    def delete(self, step: int) -> None:
        """Delete checkpoint `step` (its folder); the directory's other entries stay.

        **Raises:** `CheckpointError` if there is no such step or the checkpointer is
        read-only."""
        if self.read_only:
            raise CheckpointError(
                f"this Checkpointer of {self.directory} was opened with read_only=True: it cannot delete"
            )
        if step not in self._manager.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; the steps there are {self.steps()}"
            )
        self._manager.delete(step)

    def latest_step(self) -> int | None:
        """The newest committed step, or `None` if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving -------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Save `state` as checkpoint `step`.

        **Arguments:**

        - `step`: a non-negative int not saved before in this directory.
        - `state`: a pytree of arrays (any sharding), typed PRNG keys, Python scalars and
          Equinox modules.
        - `metadata`: a JSON-serialisable dict returned by `restore` (data-loader
          position, run name, ...).

        Returns once the arrays are copied off the devices (the caller may then donate
        or overwrite them); with `async_save=True` the files are written afterwards.
        The checkpoint appears in `steps()` only once completely written; then the
        oldest checkpoints beyond `keep` are deleted.
        """
        if self.read_only:
            raise CheckpointError(
                f"this Checkpointer of {self.directory} was opened with read_only=True: it cannot save"
            )
        if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata must be JSON-serialisable (dicts, lists, str, numbers): {e}") from e

        flat, _ = flatten(state, "state")
        shapes_only = [path for path, leaf in flat.items() if abstract(leaf)]
        if shapes_only:
            raise TypeError(f"cannot save abstract leaves (jax.ShapeDtypeStruct), e.g. {shapes_only[0]}: save arrays")
        entries = {path: describe_leaf(leaf) for path, leaf in flat.items()}
        stored = {}
        for path, leaf in flat.items():
            kind = entries[path]["kind"]
            if kind == KEY:
                stored[path] = jax.random.key_data(leaf)
            elif kind in (ARRAY, NUMPY):
                stored[path] = leaf
        numpy = {path for path in stored if entries[path]["kind"] == NUMPY}
        for path, value in compute_fingerprints(stored, numpy).items():
            entries[path]["fingerprint"] = value

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "zoo_version": VERSION,
            "jax_version": jax.__version__,
            "step": step,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "leaves": entries,
            "configs": configs(state),
            "metadata": metadata,
        }
        ocp = self._ocp
        if step in self.steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory}; steps there: {self.steps()}. "
                "Save under a new step number, or delete that step's directory first."
            )
        # Both items are written into the same temporary step directory and committed by
        # one rename: a manifest never exists without its arrays, nor arrays without it.
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(stored), manifest=ocp.args.JsonSave(manifest)),
                force=True,
            )
        except Exception as e:  # this save's, or a full disk met by the previous one in the background
            raise self._disk_full(e) from e
        self._pending = step

    # -- restoring ----------------------------------------------------------------------
    def _choose(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.directory}: nothing to restore")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; the steps there are {steps}")
        return int(step)

    def _damaged(self, step: int, what: str, error: BaseException | None = None) -> DamagedCheckpointError:
        others = [s for s in self.steps() if s != step]
        fix = (
            f"Restore another step with restore(like, step=...); the others here are {others}."
            if others
            else "There is no other checkpoint in this directory."
        )
        detail = f"\n  cause: {type(error).__name__}: {_short(error)}" if error is not None else ""
        return DamagedCheckpointError(
            f"checkpoint step {step} in {os.path.join(self.directory, str(step))} is damaged: {what}{detail}\n{fix}",
            step=step,
            reason=what,
        )

    def _read_manifest(self, step: int) -> dict[str, Any]:
        ocp = self._ocp
        try:
            args = ocp.args.Composite(manifest=ocp.args.JsonRestore())
            manifest = self._manager.restore(step, args=args)["manifest"]
        except Exception as e:  # orbax / json raise many types; the cause is chained
            raise self._damaged(step, "its manifest cannot be read", e) from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "leaves" not in manifest:
            raise self._damaged(step, "its manifest is not a zoo checkpoint manifest")
        if manifest.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has format version {manifest['format_version']}, "
                f"newer than this zoo reads ({FORMAT_VERSION}); upgrade zoo"
            )
        return manifest

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The manifest of checkpoint `step` (default: the newest), read without touching
        array data: `"leaves"` (path → kind, shape, dtype, fingerprint), `"configs"`,
        `"metadata"`, `"step"`, versions."""
        return self._read_manifest(self._choose(step))

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with checkpoint `step` (default: the newest)."""
        return dict(self.manifest(step).get("metadata", {}))

    def restore_intact(self, like: Any, *, step: int | None = None) -> tuple[Restored, list[tuple[int, str]]]:
        """Restore checkpoint `step`, or (by default) the newest one that is intact.

        Without `step`, a damaged newer checkpoint (unreadable, truncated, an empty folder)
        is skipped and deleted: it can never be restored, and the next saves would collide
        with its step. Every process must call it alike (each deletes what it can). A
        read-only checkpointer deletes nothing (the run writing the directory owns it), and
        a checkpoint that vanished while it was read (a writer's `keep` deleted it) is no
        damage: it looks again at the steps there now.

        **Returns:** `(restored, skipped)`: the `Restored` checkpoint and the `(step, why)`
        of each damaged checkpoint deleted on the way (newest first).
        **Raises:** `CheckpointError` when `step` is given and cannot be restored
        (`DamagedCheckpointError` when it is damaged), `DamagedCheckpointError` (`step`
        None) when every checkpoint is damaged, naming each and why.
        """
        import logging
        import shutil

        skipped: list[tuple[int, str]] = []
        absl = logging.getLogger("absl")
        # A read-only look at a directory a run is saving into may find its newest steps gone
        # (the writer's `keep`): it looks again at what is there now, a few times.
        for _ in range(3 if self.read_only and step is None else 1):
            vanished = False
            for n in [step] if step is not None else sorted(self.steps(), reverse=True):
                if any(k == n for k, _ in skipped):
                    continue
                level = absl.level
                absl.setLevel(max(level, logging.ERROR))  # orbax's own warnings about the damage: ours names it
                try:
                    restored = self.restore(like, step=n)
                except DamagedCheckpointError as e:
                    if step is not None:
                        raise
                    if self.read_only and not _has_files(os.path.join(self.directory, str(n))):
                        # Deleted by the writer while we read it, or a save not begun: not damaged.
                        vanished = True
                        continue
                    skipped.append((n, e.reason))
                    continue
                finally:
                    absl.setLevel(level)
                if skipped and not self.read_only:
                    for k, _ in skipped:
                        shutil.rmtree(os.path.join(self.directory, str(k)), ignore_errors=True)
                    self._manager.reload()  # it lists the steps it saw when opened
                return restored, skipped
            if not vanished:
                break
            level = absl.level
            absl.setLevel(max(level, logging.ERROR))
            try:
                self._manager.reload()
            finally:
                absl.setLevel(level)
        if not skipped:
            raise CheckpointError(
                f"the checkpoints of {self.directory} were deleted while being read (a run saving into it keeps "
                "only its newest); try again"
            )
        what = "; ".join(f"step {k}: {why}" for k, why in skipped)
        raise DamagedCheckpointError(
            f"every checkpoint in {self.directory} is damaged ({what})", step=None, reason=what
        )

    def restore(self, like: Any, *, step: int | None = None) -> Restored:
        """Restore checkpoint `step` (default: the newest) into the structure of `like`.

        **Arguments:**

        - `like`: a pytree with the saved state's structure: a freshly initialised state
          placed on the target mesh (e.g. `zoo.shard(model, rules, mesh)` and its
          optimizer state), or `jax.eval_shape` of a function making one (leaves
          `jax.ShapeDtypeStruct` with `.sharding`). Each array is read straight into the
          sharding of its `like` leaf, which may differ from the saved one (another mesh,
          another number of devices). A leaf without a fixed placement (an uncommitted
          array, a `ShapeDtypeStruct` without sharding) is left for jax to place, like
          `jnp.asarray`. Static parts (configs, static fields) come from `like`.
        - `step`: which checkpoint; `None` for the newest.

        **Returns:** `Restored(step, state, metadata)`.

        **Raises:** `CheckpointError` if there is no such step, if the checkpoint's leaves
        do not match `like` (listing every missing, unexpected, mis-shaped and mis-typed
        leaf, checked before any array is read), if its files cannot be read, or if a
        leaf read back differs from what was saved (fingerprint mismatch).
        """
        step = self._choose(step)
        manifest = self._read_manifest(step)
        saved = manifest["leaves"]
        flat, treedef = flatten(like, "`like` tree")

        # Everything `like` and the manifest disagree on, before any array is read.
        error = mismatch(step, self.directory, saved, flat, manifest, like)
        if error is not None:
            raise error

        plans = {path: plan(saved[path], leaf, path) for path, leaf in flat.items()}
        targets = {path: target for path, (target, _) in plans.items() if target is not None}
        ocp = self._ocp
        try:
            args = ocp.args.Composite(state=ocp.args.StandardRestore(targets))
            read = dict(self._manager.restore(step, args=args)["state"])
        except Exception as e:  # tensorstore / orbax errors; the cause is chained
            raise self._damaged(
                step, "its array data cannot be read (a file is missing, truncated or changed)", e
            ) from e
        if set(read) != set(targets):
            raise self._damaged(
                step, f"it holds other arrays than its manifest lists ({len(read)} read, {len(targets)} listed)"
            )

        fingerprints = compute_fingerprints(read, {p for p in read if saved[p]["kind"] == NUMPY})
        corrupt = [p for p in targets if fingerprints[p] != saved[p].get("fingerprint")]
        if corrupt:
            raise self._damaged(
                step,
                f"the data of {len(corrupt)} leaves differs from what was saved (fingerprint mismatch):\n"
                + "\n".join(listed(corrupt))
                + "\nA file of the checkpoint was changed after it was written.",
            )

        leaves = [finish(read.get(path)) for path, (_, finish) in plans.items()]
        return Restored(step, jax.tree.unflatten(treedef, leaves), dict(manifest.get("metadata", {})))
