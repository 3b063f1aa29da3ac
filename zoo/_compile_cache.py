"""JAX's persistent compilation cache in a per-user folder: compile a step once per machine."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from ._env import env_flag

# Environment variables: a folder for the cache, and an opt-out.
CACHE_DIR_ENV = "ZOO_COMPILE_CACHE_DIR"
NO_CACHE_ENV = "ZOO_NO_COMPILE_CACHE"

# Compiles shorter than this are not written: the small programs (initialisers, placement,
# one-op jits) recompile faster than a cache file is read and checked, while a training
# step of any real model takes seconds.
MIN_COMPILE_TIME_SECS = 0.5


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/zoo/jax`, or `~/.cache/zoo/jax` when `XDG_CACHE_HOME` is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zoo" / "jax"


def enable_compilation_cache(
    path: str | os.PathLike | None = None, *, min_compile_time_secs: float = MIN_COMPILE_TIME_SECS
) -> Path | None:
    """Turn on JAX's persistent compilation cache, so a second identical run loads its
    compiled programs from disk instead of compiling them again.

    **Arguments:**

    - `path`: the cache folder (created if missing). Default: `$ZOO_COMPILE_CACHE_DIR`, else
      `zoo.default_cache_dir()` (`$XDG_CACHE_HOME/zoo/jax` or `~/.cache/zoo/jax`).
    - `min_compile_time_secs`: only programs that took at least this long to compile are
      written (default 0.5 s).

    **Returns:** the folder in use, or `None` when `$ZOO_NO_COMPILE_CACHE` is set to a true
    value (`1`, `true`, `yes`), which turns the cache off whatever the arguments.

    The cache key covers the program, the jax/XLA version, the devices and the compiler
    flags, so a changed model or flag compiles afresh. Call it before the first compile;
    calling it again with another folder moves the cache there.
    """
    if env_flag(NO_CACHE_ENV):
        return None
    folder = Path(path if path is not None else os.environ.get(CACHE_DIR_ENV) or default_cache_dir()).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the compilation cache folder {folder}: {e}; pass another folder, set "
            f"{CACHE_DIR_ENV}, or turn the cache off with {NO_CACHE_ENV}=1"
        ) from e
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # jax decides once per process whether the cache is in use, at the first compile:
    # reset that decision so a call after some compiles still takes effect.
    compilation_cache.reset_cache()
    return folder
