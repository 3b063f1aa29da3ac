"""A full disk during a checkpoint save, reported as what it is.

orbax writes arrays through tensorstore in background threads: a full disk there surfaces
as a `ValueError("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']")`
when the save is next waited for, after orbax has logged the same error with a traceback
from each of its threads. The checkpointer raises it as `OSError(ENOSPC)` naming the
checkpoint folder instead (the CLI prints that as one line), and orbax's log records of it
are dropped: the error itself is raised, so nothing is lost.
"""

from __future__ import annotations

import errno
import logging
import threading

_MARKS = ("No space left on device", "os_error_code='28'", "[Errno 28]")


def _chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error` (or one it was raised from) says the disk is full."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if any(mark in str(e) for mark in _MARKS):
            return True
    return False


def disk_full_error(directory: str, error: BaseException) -> OSError:
    """The `OSError(ENOSPC)` to raise for `error`, naming the checkpoint `directory`."""
    return OSError(errno.ENOSPC, "No space left on device (saving a checkpoint)", directory)


class _DropDiskFull(logging.Filter):
    """ERROR records (and tracebacks) of a full disk: the checkpointer raises it. orbax's,
    and asyncio's "Task exception was never retrieved" of an orbax write task that failed on
    it and was collected unawaited once the save had failed (whether one is depends on
    timing)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (is_disk_full(exc) or any(mark in record.getMessage() for mark in _MARKS))


_FILTER = _DropDiskFull()


def quiet_disk_full_logs() -> None:
    """Drop the log records of a full disk that orbax (through absl's logger) and asyncio
    (its write tasks) print beside the error the checkpointer raises (idempotent)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


_CLOSED_LOOP = "RuntimeError: Event loop is closed"


class _WithoutClosedLoopTracebacks:
    """`sys.stderr` without the tracebacks that end in `RuntimeError: Event loop is
    closed`: after a failed save, tensorstore's writes still in flight complete into orbax's
    closed asyncio loop, and each prints one (C++ calls `PyErr_Display`, which writes to
    `sys.stderr`, bypassing `sys.excepthook`): noise around the one line that says the disk
    is full. Every other traceback and line is written as it comes.

    Lines are gathered per writing thread: a background thread's traceback comes a line
    at a time, and the main thread's error line may arrive in between (it must neither
    end that traceback nor be held with it)."""

    def __init__(self, stream):
        self._stream = stream
        self._held: dict[int, list[str]] = {}  # each thread's traceback in progress
        self._partial: dict[int, str] = {}  # each thread's unfinished line

    def write(self, text: str) -> int:
        thread = threading.get_ident()
        *lines, self._partial[thread] = (self._partial.get(thread, "") + text).split("\n")
        for line in lines:
            self._line(thread, line + "\n")
        return len(text)

    def _line(self, thread: int, line: str) -> None:
        if thread not in self._held and not line.startswith("Traceback (most recent call last):"):
            self._stream.write(line)
            return
        held = self._held.setdefault(thread, [])
        held.append(line)
        if line.startswith((" ", "Traceback (most recent call last):")):
            return  # the traceback goes on
        del self._held[thread]
        if line.rstrip("\n") != _CLOSED_LOOP:
            self._stream.write("".join(held))

    def flush(self) -> None:
        for thread, partial in list(self._partial.items()):  # every thread's: exit flushes from one
            if partial and not self._held.get(thread):
                self._stream.write(partial)
                self._partial[thread] = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def without_closed_loop_tracebacks(stream):
    """`stream` (e.g. `sys.stderr`) without the tracebacks of tensorstore's writes that
    complete after a failed save (`_WithoutClosedLoopTracebacks`); the `zoo` command writes
    its stderr through it."""
    return stream if isinstance(stream, _WithoutClosedLoopTracebacks) else _WithoutClosedLoopTracebacks(stream)
