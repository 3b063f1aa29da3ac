"""The errors of `zoo.train`: what the `zoo` command turns into one line and an exit code."""

from __future__ import annotations


class ConfigError(ValueError):
    """Settings that cannot be run (an unknown model, a flag out of range, an `--init`
    folder of the wrong architecture): the message names the fix. The `zoo` command
    prints it as one line and exits 2."""


class RunStopped(RuntimeError):
    """A run stopped because its loss or weights went non-finite (the `zoo` command: exit
    code 3)."""


class Preempted(RuntimeError):
    """A run stopped by SIGTERM after saving a checkpoint (the `zoo` command: exit code
    143, so a scheduler requeues it)."""
