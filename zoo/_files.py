"""Writing files so that a crash never leaves a half-written one: temp file, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np


def atomic_write(target: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` a temporary file next to `target`, flush it to disk, `os.replace` it.

    The file ends with the usual permissions (0o666 less the umask), whatever `write`
    creates it with (safetensors makes owner-only files). On any error the temporary file
    is removed and `target` is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies
        mode = os.fstat(fd).st_mode & 0o777
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the renames in `directory` durable (POSIX; a no-op where it cannot be done)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def to_host(x: jax.Array | np.ndarray) -> np.ndarray:
    """A numpy copy of a (possibly sharded, possibly multi-process) array: every process
    gets the whole value."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
