"""What a run raises: a bad setting, a run that stopped itself, a preempted run."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work (a negative step count, a non-finite learning rate, a
    batch the mesh cannot split): raised before anything is trained, naming the setting
    by its field (`RunConfig.rules`, `DataConfig.source`) and the fix. `zoo train` prints
    it as one line, each field as its flag (`--rules`, `--data`), and exits 2."""


class RunStopped(RuntimeError):
    """A run that stopped itself because its loss or weights went non-finite. Nothing
    from the bad steps is saved; the message names the last good checkpoint. `zoo train`
    exits 3."""


class Preempted(RuntimeError):
    """SIGTERM (a scheduler's preemption): the run saved a checkpoint after the step in
    progress and stopped; resuming continues it. `zoo train` exits 143 (128 + SIGTERM)."""


class Interrupted(Preempted):
    """The run stopped at a step boundary on Ctrl-C (SIGINT) after saving that step's
    checkpoint, as on SIGTERM; a second Ctrl-C stops at once. `output` is the run's
    folder (set by `zoo.train.run`), which `--resume` continues."""

    output = None
