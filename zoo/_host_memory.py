"""glibc malloc settings that let XLA's CPU runtime reuse warm memory from step to step."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import warnings

from ._env import env_flag

# An opt-out for programs that call `keep_freed_memory`.
NO_KEEP_ENV = "ZOO_NO_KEEP_MEMORY"

# mallopt(3) parameters (glibc's malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
_SETTINGS = (
    (_M_ARENA_MAX, 1),  # every thread allocates from the main heap ...
    (_M_MMAP_MAX, 0),  # ... never from a private mapping, which free() would unmap,
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # and free() does not give the heap's top back either;
    (_M_TOP_PAD, 64 << 20),  # grow the heap in large steps.
)


def keep_freed_memory() -> bool:
    """Tell glibc's `malloc` to keep freed memory in the process, so that each training
    step's CPU buffers reuse pages already in place instead of faulting in fresh ones.

    XLA's CPU runtime allocates a compiled step's temporaries (one block of hundreds of MiB
    for a real model) with `malloc` on every call. glibc serves a block that large with
    its own `mmap` and unmaps it on `free`, so every step the kernel maps and zero-fills
    each 4 KiB page again: for the MiniLM LoRA step of `benchmarks/vs_torch.py`, 78,000
    page faults and about a quarter of the step's time (docs/performance.md, "Page faults").
    This sets, process-wide, through `mallopt(3)`: one malloc arena for all threads, no
    `mmap`-served blocks, no trimming of the heap. The process then keeps its peak memory
    until it exits (as PyTorch's caching allocators do), and all threads share one arena.

    A trade-off, hence opt-in (`zoo train/finetune --keep-memory`, or a script calls it first
    thing, **before the first jax computation**, so that the threads XLA starts take the one
    arena): it speeds up a step on one device whose temporaries are large (the MiniLM LoRA
    step: ~0.9x the time), but with several simulated CPU devices, whose threads allocate
    at once, and for compiling, the one arena costs more than the faults it saves (`zoo
    finetune minilm` on 8 simulated devices: ~1.25x the step time, compile +0.5-1 s).
    `ZOO_NO_KEEP_MEMORY=1` makes it a no-op.

    **Returns:** `True` when the settings were applied before jax started its backend;
    `False` when `ZOO_NO_KEEP_MEMORY` is set to a true value, on a C library other than
    glibc (nothing is changed), or when jax's backend was already running (the settings
    are applied, with a warning that they may not reach XLA's threads).
    """
    if env_flag(NO_KEEP_ENV):
        return False
    libc = _glibc()
    if libc is None:
        return False
    for param, value in _SETTINGS:
        libc.mallopt(param, value)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        warnings.warn(
            "zoo.keep_freed_memory() was called after jax started its backend: XLA's threads "
            "may keep their own malloc arenas, and each step's buffers may still be mapped "
            "afresh; call it first thing in the program, before any jax computation",
            stacklevel=2,
        )
        return False
    return True


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (the only one these settings are for)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    return libc
