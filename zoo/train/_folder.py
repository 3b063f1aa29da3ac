"""What a run wrote in its folder, so that `overwrite` deletes exactly that.

A run folder carries a marker, `OUTPUT/.zoo-run.json`, listing every file the run writes
there (paths relative to the folder), each added before the file is written. A path ending
in `/` stands for a folder zoo created and writes alone: the export's folder while it is
being written (then its files), a TensorBoard folder inside the run's. `overwrite` deletes
those files, and refuses a folder holding anything else, naming it: a user's own
`config.json` or a Python package `model/` is never deleted. The run's lock (`.zoo.lock`),
the marker itself and the temporary files of an interrupted atomic write of a listed file
are zoo's too. The checkpoint folder (inside the run's or not) is the `Checkpointer`'s: only
its step folders are deleted, anything else in it stays.

A folder written before the marker existed is recognised as a zoo run when it holds
nothing but a run's outputs (`RUN_OUTPUTS`, the lock, the checkpoints, and in `model/` or
`adapter/` only the names the exports write) and its `config.json` reads as a `RunConfig`.
Only process 0 writes the marker.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from .._checkpoint import Checkpointer
from .._files import atomic_write
from .._mismatch import shorten
from ..hf._export import FILE_NAMES as MODEL_FILES
from ..lora._io import FILE_NAMES as ADAPTER_FILES
from ._config import RunConfig
from ._errors import ConfigError
from ._head import HEAD_NAME, LABELS_NAME

MARKER = ".zoo-run.json"
LOCK_NAME = ".zoo.lock"
_FORMAT = "zoo run folder"
# A run's own files at the top of its folder, listed in the marker when the run starts
# (and a classifier's label names, `_head.LABELS_NAME`, listed when written).
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png")
# The exports' folders and the names written there: save_pretrained's (tokenizer files
# included), the sentence-transformers config the run's export copies beside them
# (`_export.TOKENIZER_FILES`) and a classifier's head (`_head.HEAD_NAME`); save_adapter's,
# and a classifier's README.md.
EXPORTS = {"model": (*MODEL_FILES, "sentence_bert_config.json", HEAD_NAME), "adapter": (*ADAPTER_FILES, "README.md")}
# What a run leaves in its folder (the checkpoints folder is checked on its own).
RUN_OUTPUTS = (*RUN_FILES, LABELS_NAME, *EXPORTS)
# `zoo._files.atomic_write`'s temporary file of NAME, left by a crash between write and rename.
_TMP = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{32}\.tmp")


def previous_outputs(output: Path) -> list[str]:
    """The names in `output` of a run's outputs (sorted, `/` after folders), whoever wrote them."""
    if not output.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if p.name in RUN_OUTPUTS)


def _files(output: Path, skip: Path) -> list[str]:
    """Every file under `output` (and every empty folder, with `/`), relative, sorted;
    `skip` (the checkpoints folder) left out. A link is an entry, never followed."""
    found = []
    for root, dirs, names in os.walk(output):
        here = Path(root)
        for name in list(dirs):
            path = here / name
            if path == skip or path.is_symlink():
                dirs.remove(name)
                if path != skip:
                    found.append(path.relative_to(output).as_posix())
            elif not any(path.iterdir()):
                found.append(path.relative_to(output).as_posix() + "/")
        found += [(here / name).relative_to(output).as_posix() for name in names]
    return sorted(found)


def _read(output: Path) -> list[str] | None:
    """The files the marker lists, or `None` without a (readable) marker."""
    try:
        value = json.loads((output / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict) or value.get("format") != _FORMAT or not isinstance(value.get("files"), list):
        return None
    return [f for f in value["files"] if isinstance(f, str)]


def _is_old_run(output: Path, files: list[str]) -> bool:
    """Whether a folder without a marker is a zoo run's: only a run's outputs, and a
    `config.json` that reads as a `RunConfig`."""
    listed = {*RUN_FILES, LABELS_NAME, *(f"{d}/{n}" for d, names in EXPORTS.items() for n in names)}
    if "config.json" not in files or not all(_zoos(f, listed) for f in files):
        return False
    try:
        values = json.loads((output / "config.json").read_text())
        RunConfig.from_dict(values)
    except (OSError, ValueError, TypeError, ConfigError):
        return False
    return isinstance(values, dict) and {"model", "steps", "batch_size", "seed"} <= set(values)


def _zoos(path: str, listed: Iterable[str]) -> bool:
    """Whether `path` is among `listed` (or under a listed folder), zoo's lock or marker,
    or the temporary file of an interrupted write of one of them."""
    listed = set(listed)
    if path in (LOCK_NAME, MARKER) or path in listed or any(f.endswith("/") and path.startswith(f) for f in listed):
        return True
    folder, _, name = path.rpartition("/")
    tmp = _TMP.fullmatch(name)
    return tmp is not None and _zoos(f"{folder}/{tmp['name']}" if folder else tmp["name"], listed)


def strangers(output: Path, checkpoints: Path) -> list[str]:
    """The entries at the top of `output` that are not zoo's (its lock, marker, checkpoints
    folder, atomic-write leftovers), `/` after folders: what a folder of no run holds
    besides (read without walking it: `--output .` of a large tree is refused at once)."""
    if not output.is_dir():
        return []
    return sorted(
        p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if p != checkpoints and not _zoos(p.name, [])
    )


def owned(output: Path, checkpoints: Path) -> tuple[list[str], list[str]]:
    """`(zoo's, foreign)`: the files under `output` (the checkpoints folder aside) the
    marker lists (or, without one, all of them in a folder `_is_old_run` recognises), and
    the others."""
    if not output.is_dir():
        return [], []
    files = _files(output, checkpoints)
    listed = _read(output)
    if listed is None:
        listed = files if _is_old_run(output, files) else []
    return [f for f in files if _zoos(f, listed)], [f for f in files if not _zoos(f, listed)]


def claim(output: Path, checkpoints: Path, names: Iterable[str], *, replace: str | None = None) -> None:
    """List `names` (paths relative to `output`) in its marker, before they are written
    (process 0 only).

    A folder without a marker that `_is_old_run` recognises keeps its files listed.
    `replace`: a listed folder (`"model/"`) whose entry `names` replaces (its files,
    once written)."""
    listed = _read(output)
    if listed is None:
        files = _files(output, checkpoints) if output.is_dir() else []
        listed = [f for f in files if f != LOCK_NAME] if _is_old_run(output, files) else []
    new = sorted({*(f for f in listed if f != replace), *names})
    if new == sorted(listed):
        return
    text = json.dumps({"format": _FORMAT, "version": 1, "files": new}, indent=1) + "\n"
    atomic_write(output / MARKER, lambda tmp: Path(tmp).write_text(text))


def remove_run(output: Path, checkpoints: Path) -> None:
    """`overwrite`: delete the earlier run's files in `output` and its checkpoints (the
    lock is held). Nothing is deleted when `output` holds a file zoo did not write.

    **Raises:** `ConfigError` naming those files and the fix."""
    mine, foreign = owned(output, checkpoints)
    if foreign:
        raise ConfigError(
            f"RunConfig.overwrite: RunConfig.output {output} holds files zoo did not write ({shorten(foreign, 6)}); "
            "overwrite replaces only a zoo run's outputs: choose another RunConfig.output, or move those files away"
        )
    if checkpoints.is_dir():
        # The Checkpointer's steps only: whatever else is in the folder is not the run's.
        with Checkpointer(checkpoints, keep=None, async_save=False) as ckpt:
            for step in ckpt.steps():
                ckpt.delete(step)
    for name in sorted(mine, key=lambda f: f == MARKER):  # the marker last: it lists the rest
        path = output / name
        if name == LOCK_NAME:
            continue
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    # Folders the run made and left empty (model/, a TensorBoard folder's parents), deepest first.
    for folder in sorted({(output / f).parent for f in mine}, key=lambda p: -len(p.parts)):
        while folder != output and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


# --------------------------------------------------------------------------- the run's lock
# One run per output folder: an exclusive lock held by the operating system, and the check
# that a folder holding another run's outputs is not silently replaced.
#
# The lock is `fcntl.flock` on `OUTPUT/.zoo.lock`, taken before the run writes anything and
# held until it ends; the kernel releases it when the process dies (killed, crashed, the
# machine's power aside), so a lock is never stale. The file keeps the holder's pid and start
# time, for the error another run prints.


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return ""
    return f" ({text})" if text else ""


def check_folder(folder: Path, flag: str) -> None:
    """Refuse, before anything runs, a `folder` that cannot be made because it, or the
    nearest of its parents that exists, is a file: a `ConfigError` naming `flag`, the
    file and the fix. Creates nothing (a run that fails leaves no folder behind)."""
    there = folder
    while not there.exists() and there.parent != there:
        there = there.parent
    if not there.exists() or there.is_dir():
        return
    if there == folder:
        raise ConfigError(f"{flag} {folder} is a file, not a folder; choose a folder (it is created if missing)")
    raise ConfigError(
        f"{flag} {folder}: {there} is a file, so no folder can be created in it; choose a folder whose parents are folders"
    )


def make_folder(folder: Path, flag: str) -> None:
    """Create `folder` (and its parents); a `ConfigError` naming `flag`, the path and the
    operating system's reason when it cannot be."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is a file, not a folder; choose a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{flag} {folder}: cannot create the folder ({e.strerror}); choose a folder you can write"
        ) from None


@contextlib.contextmanager
def _flock(path: Path, flag: str) -> Iterator[None]:
    import fcntl

    created = not path.parent.exists()
    make_folder(path.parent, flag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"{flag} {path.parent} is in use by another zoo run{_holder(path)}; wait for it to end, "
                "or choose another folder"
            ) from None
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {stamp}\n".encode(), 0)
        try:
            yield
        finally:
            # A run that failed before writing anything leaves no folder behind.
            if created and {p.name for p in path.parent.iterdir()} == {path.name}:
                with contextlib.suppress(OSError):
                    path.unlink()
                    path.parent.rmdir()
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def run_lock(output: Path, checkpoints: Path, *, main: bool) -> Iterator[None]:
    """Hold the output folder (and a --checkpoint-dir outside it) for one run; ConfigError
    if another process holds it. Only process 0 of a multi-process run locks (the others
    write into the same shared folder under its lock)."""
    if not main:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_flock(output / LOCK_NAME, "RunConfig.output"))
        if not checkpoints.resolve().is_relative_to(output.resolve()):
            # Next to the folder, not in it: the checkpoint folder holds numbered steps only.
            stack.enter_context(
                _flock(checkpoints.parent / f".{checkpoints.name}{LOCK_NAME}", "RunConfig.checkpoint_dir")
            )
        fresh = not previous_outputs(output) and not _has_entries(checkpoints)
        try:
            yield
        except BaseException:
            if fresh:
                _remove_untrained(output, checkpoints)
            raise


def _has_entries(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _remove_untrained(output: Path, checkpoints: Path) -> None:
    """A new run that failed (or was stopped) before its first training step leaves the
    folder as it found it: its config.json (and labels.json, a metrics.jsonl without a
    training row, an empty checkpoints folder) would make the same command refuse the folder next time."""
    if _has_entries(checkpoints):
        return
    metrics = output / "metrics.jsonl"
    if metrics.is_file():
        with contextlib.suppress(OSError):
            if '"kind": "train"' in metrics.read_text():
                return
    if not set(previous_outputs(output)) <= {"config.json", "labels.json", "metrics.jsonl"}:
        return
    for name in ("config.json", "labels.json", "metrics.jsonl", MARKER):
        with contextlib.suppress(OSError):
            (output / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        if checkpoints.is_dir():
            checkpoints.rmdir()
