"""SIGTERM (a scheduler's preemption notice) turned into a clean stop at a step every
process of a run agrees on.

A process that gets SIGTERM only notes it. The training loop asks `stop_at(step)` after
each step: in a single-process run that is the note itself; in a multi-process run the
processes exchange their notes (one tiny all-gather across processes, outside the compiled
training step, at the same steps in every process), so all of them see the signal at the
same step even when only one process got it, and all save that step's checkpoint
together. Signal handlers cannot agree on a step themselves: each process sees the signal
between other bytecodes of its own loop.

Why not jax's own preemption service (`multihost_utils.reached_preemption_sync_point`,
set up by `jax.distributed.initialize`)? Its sync point is the fastest process's last
step + 1 as the processes last reported it, and a process reports nothing before its
first call: a signal during loading or compiling finds no counters and is dropped (and its
SIGTERM handler has then swallowed the signal). An all-gather at fixed steps has no such
gap and needs no background protocol.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from .._distributed import sigterm_noted


class Preemption:
    """SIGTERM noted instead of ending the process, and the step at which to stop.

    Install it (construct it, or use it as a context manager) before loading and
    compiling; call `stop_at(step)` after every training step in every process; call
    `restore()` (or leave the `with` block) when the run ends.

    **Arguments:**

    - `enabled`: whether to take over SIGTERM at all (False: the signal keeps its
      handler, `stop_at` is always False). Only the main thread can install a handler;
      elsewhere this is off too.
    - `early`: what a SIGTERM before the first `stop_at` call raises, from the signal
      handler, in a single-process run: an exception to stop loading or compiling at once
      (nothing is being trained yet, so there is nothing to save). `None`: the signal is
      only noted and the run stops after its first step. Multi-process runs always note
      it (one process stopping alone would leave the others waiting in their first
      collective), so they stop after the first step, at the same step.
    - `every`: in a multi-process run, compare the processes' notes at the first step and
      then every `every` steps (each comparison is one small all-gather that waits for
      every process). 1 stops at the next step; more trades a little latency for less
      waiting.
    """

    def __init__(self, *, enabled: bool, early: Callable[[], BaseException] | None = None, every: int = 1):
        import jax

        if every < 1:
            raise ValueError(f"Preemption: every must be >= 1, got {every}")
        # This process got SIGTERM (maybe already between `zoo.distributed_init` and now).
        self.requested = sigterm_noted()
        self.every = every
        self._multi = jax.process_count() > 1
        self._early = None if self._multi else early
        self._started = False  # stop_at was called: the training loop runs
        self._first: int | None = None  # the first step asked about
        self._installed = False
        self._previous: Any = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
            self._installed = True

    def _note(self, signum, frame) -> None:
        self.requested = True
        if not self._started and self._early is not None:
            raise self._early()

    def stop_at(self, step: int) -> bool:
        """Whether to stop after `step` (and save it). In a multi-process run every process
        must call this after every step, with the same steps; it returns the same answer in
        all of them: True from the first compared step after any process got SIGTERM."""
        self._started = True
        if not self._installed:
            return False
        if not self._multi:
            return self.requested
        if self._first is None:
            self._first = step
        if step != self._first and step % self.every:
            return False
        return self._anyone(self.requested)

    @staticmethod
    def _anyone(flag: bool) -> bool:
        """Whether `flag` is True in any process (an all-gather across processes)."""
        import numpy as np
        from jax.experimental import multihost_utils

        return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())

    def restore(self) -> None:
        """Give SIGTERM back the handler it had (the default one if that was not set from
        Python, e.g. jax's preemption notifier's)."""
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
