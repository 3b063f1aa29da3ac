"""What every command shares: the one-line error and the library's errors in flag names,
and the devices.

Nothing here imports jax when the module loads: the number of simulated CPU devices must
be set (`init_devices`) before jax starts its backend.
"""

from __future__ import annotations

import os
import re

from ..train import ConfigError, RunConfig


class CLIError(ConfigError):
    """A user mistake: printed as one line with the fix, no traceback; exit code 2. A
    `zoo.train.ConfigError`, so library callers catch the CLI's checks with it too."""

    exit_code = 2
    prefix = "error"


# A config field as the library's errors name it: `RunConfig.batch_size`, `OptimizerConfig.lr`.
_FIELD = re.compile(r"\b(?:RunConfig|DataConfig|OptimizerConfig|GRPOConfig)\.\w+")


def flag_names(message: str) -> str:
    """A library error's text with each config field it names as its flag
    (`RunConfig.batch_size` → `--batch-size`, `DataConfig.source` → `--data`; the fields'
    `zoo.train.Flag`s): the one place the CLI turns the library's words into its own. A
    flag left out is an unset field, so "(or None)" goes too. The positional field
    (`RunConfig.model`) is the argument `MODEL`."""
    options = {f.field: str(f.name).upper() if f.positional else f.option for f in RunConfig.flags()}
    text = _FIELD.sub(lambda m: options.get(m.group(0), m.group(0)), message)
    return text.replace(" (or None)", "") if text != message else text


# Devices simulated on CPU when --devices is not given.
DEFAULT_CPU_DEVICES = 8


# --- devices --------------------------------------------------------------------------------------


def init_devices_env() -> None:
    """XLA flags every command sets before jax's backend starts."""
    # Simulated devices share a few cores: on a busy machine one device's thread can reach
    # a collective long after the others, and XLA's CPU runtime aborts after 40 s of
    # waiting by default. Let it wait (read when the backend starts; harmless elsewhere).
    flags = os.environ.get("XLA_FLAGS", "")
    if "collective_call_terminate_timeout" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_call_terminate_timeout_seconds=3600".strip()


def init_devices(devices: int | None) -> int:
    """Set up jax's devices and return how many the command uses.

    On CPU, `devices` simulated devices (default 8); on an accelerator, the real ones
    (`devices` of them, default all). Must run before anything touches jax's backend;
    when the backend is already up (a caller in the same process), what it has is used.
    """
    import jax

    if devices is not None and devices < 1:
        raise CLIError(f"--devices must be >= 1, got {devices}")
    init_devices_env()
    wanted = DEFAULT_CPU_DEVICES if devices is None else devices
    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # backend already up (e.g. called in-process): use what is there
        pass
    have = len(jax.devices())
    if devices is None:
        return have if jax.default_backend() != "cpu" else min(have, wanted)
    if have < devices:
        raise CLIError(
            f"asked for {devices} devices but jax has {have} ({jax.default_backend()}); pass --devices {have} or fewer"
        )
    return devices
