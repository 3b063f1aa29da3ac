"""One run per output folder: an exclusive lock held by the operating system, and the check
that a folder holding another run's outputs is not silently replaced.

The lock is `fcntl.flock` on `OUTPUT/.zoo.lock`, taken before the run writes anything and
held until it ends; the kernel releases it when the process dies (killed, crashed, the
machine's power aside), so a lock is never stale. The file keeps the holder's pid and start
time, for the error another run prints.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path

from ._errors import ConfigError
from ._folder import LOCK_NAME, MARKER, previous_outputs


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return ""
    return f" ({text})" if text else ""


@contextlib.contextmanager
def _flock(path: Path, flag: str) -> Iterator[None]:
    import fcntl

    created = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
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
        stack.enter_context(_flock(output / LOCK_NAME, "--output"))
        if not checkpoints.resolve().is_relative_to(output.resolve()):
            # Next to the folder, not in it: the checkpoint folder holds numbered steps only.
            stack.enter_context(_flock(checkpoints.parent / f".{checkpoints.name}{LOCK_NAME}", "--checkpoint-dir"))
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
