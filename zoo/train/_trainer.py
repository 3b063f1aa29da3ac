"""The training loop: a compiled `zoo.TrainStep` over batches, with hooks every N steps.

The loop's contract with its hooks (`TrainState`, `Hook`) lives here, beside the loop;
the hooks the runs use are in `_hooks.py`. SIGTERM (a scheduler's preemption notice) and a
first Ctrl-C are turned into a clean stop at a step every process agrees on (`Preemption`), where each hook
saves what it must (`Hook.on_preempt`).

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

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._distributed import sigterm_noted
from ._errors import Interrupted, Preempted, RunStopped

_ADVICE = "lower the learning rate, keep gradient clipping on, or skip such steps (skip_nonfinite)"


@dataclasses.dataclass
class TrainState:
    """What a hook sees.

    **Fields:**

    - `step`: steps done (the start step in `on_start`).
    - `steps`: the run's last step.
    - `model`, `opt_state`: after `step`.
    - `loss`: the training loss of `step` (None in `on_start`).
    - `trainer`: the `Trainer` (its `step`, `record`, `elapsed`, `stopped`).
    """

    step: int
    steps: int
    model: Any
    opt_state: Any
    loss: float | None
    trainer: Trainer


class Hook:
    """The base of hooks: fires after every `every`-th step (0: never by step). Override
    `__call__`, and any of `on_start`, `on_record`, `on_end`, `on_preempt`, `kept`, `close`."""

    every: int = 0

    def on_start(self, state: TrainState) -> None:
        """Before the first step (after a resumed run's restored step)."""

    def __call__(self, state: TrainState) -> None:
        """After step `state.step`, a multiple of `every`."""

    def on_record(self, row: dict[str, Any]) -> None:
        """A row the run recorded: `{"kind": "train", "step", "loss", "lr", ...}` after each
        step, `{"kind": "eval", "step", "eval_loss", "eval_accuracy", ...}` after each
        evaluation, `{"kind": "sample", ...}` after each sample."""

    def on_end(self, state: TrainState) -> None:
        """After the last step (not when the run fails)."""

    def on_preempt(self, state: TrainState) -> str | None:
        """SIGTERM or a first Ctrl-C: the run stops after `state.step` (every process at the same step); save
        what must outlive it. Returns what was saved, in words ("checkpoint saved in DIR"),
        or None if nothing."""
        return None

    def kept(self) -> str | None:
        """Where this hook's last good save is ("step 40 in DIR"), named when the run stops
        on a non-finite loss; None if it keeps none."""
        return None

    def close(self) -> None:
        """Last: release files and wait for saves, also when the run fails."""


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
        self._previous_int: Any = None
        self.interrupted = False  # Ctrl-C asked for the stop (not SIGTERM)
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
            self._installed = True
            # Ctrl-C too, where it would raise KeyboardInterrupt (not where it is ignored).
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous_int = signal.signal(signal.SIGINT, self._note_interrupt)

    def _note(self, signum, frame) -> None:
        self.requested = True
        if not self._started and self._early is not None:
            raise self._early()

    def _note_interrupt(self, signum, frame) -> None:
        """Ctrl-C: noted, as SIGTERM, so the run saves the step in progress and stops; a
        second one, or one before training started, stops at once (KeyboardInterrupt)."""
        if self.interrupted or not self._started:
            raise KeyboardInterrupt
        self.interrupted = self.requested = True

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
            if self._previous_int is not None:
                signal.signal(signal.SIGINT, self._previous_int)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


class Trainer:
    """Runs a `zoo.TrainStep` for `steps` steps, compiled once (the compiled program is the
    one `zoo.collectives` inspects), firing hooks after every N steps.

    **Arguments:**

    - `step`: the `zoo.TrainStep`.
    - `batch_at`: step (1-based) → that step's batch; a function of the step alone, so a
      resumed run sees the batches it would have seen.
    - `steps`: the last step.
    - `hooks`: `zoo.train.Hook`s (`Evaluate`, `Checkpoint`, `MetricsLog`, `TensorBoard`,
      `Progress`, `Sample`, or your own), fired in this order.
    - `lr`: step → the learning rate optax applies at it (`OptimizerConfig.rates`), logged
      with each step's loss (None: not logged).
    - `tokens_per_example`: logged throughput in tokens too.
    - `skip_nonfinite`: the optimizer skips non-finite steps (`optax.apply_if_finite`):
      count them instead of stopping.
    - `handle_sigterm`: on SIGTERM, finish the step in progress, let each hook save what
      it must (`Hook.on_preempt`: the `Checkpoint` hook saves the step) and raise
      `Preempted`; in a multi-process run every process stops after the same step
      (`Preemption`: the processes compare their notes after each step, outside the
      compiled step).
    - `preemption`: a `Preemption` installed earlier (before loading and compiling, as
      `zoo.train.run` does) to use instead of one of the loop's own.
    - `advice`: what a `RunStopped` message suggests: text, or a function of the step
      that went non-finite returning it (to name the cause it can see).
    - `step_metrics`: step → more numbers for that step's training row (GRPO's rollout
      metrics), read when the row is recorded.

    Every process runs the loop (the step is one program over every process's devices);
    the logging hooks write in process 0 only. A step whose loss is NaN or inf (without
    `skip_nonfinite`), or weights that went non-finite before a save, raise `RunStopped`
    naming the last good checkpoint; nothing after it is saved.

    A hook may end the run early (`request_stop`, e.g. `KeepBest`'s early stopping): the
    loop stops after that step's hooks and the run ends as after its last step (`on_end`
    with `state.step` the step it stopped at).

    After `run`: `losses` (the finite training losses), `skipped` (non-finite steps
    skipped), `train_seconds` (the steps' time, the hooks' left out), `hook_seconds`
    (the time of the hooks fired between steps: evaluations, saves), `last_step` and
    `stop_reason` (None unless a hook stopped the run).
    """

    def __init__(
        self,
        step,
        batch_at: Callable[[int], Any],
        *,
        steps: int,
        hooks: Sequence[Any] = (),
        lr: Callable[[int], float] | None = None,
        tokens_per_example: int | None = None,
        skip_nonfinite: bool = False,
        handle_sigterm: bool = True,
        advice: str | Callable[[int], str] = _ADVICE,
        preemption: Preemption | None = None,
        step_metrics: Callable[[int], dict[str, Any]] | None = None,
    ):
        self.step, self.batch_at, self.steps, self.hooks = step, batch_at, steps, list(hooks)
        self.step_metrics = step_metrics
        self.lr, self.tokens_per_example, self.skip_nonfinite = lr, tokens_per_example, skip_nonfinite
        self.handle_sigterm, self.advice, self.preemption = handle_sigterm, advice, preemption
        self.compiled = None
        self.losses: list[float] = []
        self.skipped = 0
        self.train_seconds = 0.0
        self.hook_seconds = 0.0
        self.last_step = steps
        self.stop_reason: str | None = None
        self._t0 = time.perf_counter()

    def request_stop(self, reason: str) -> None:
        """End the run after the current step's hooks, as after its last step (`on_end`
        hooks: final evaluation, saves, export, summary); `reason` is kept as `stop_reason`."""
        self.stop_reason = reason

    def compile(self, model, opt_state, *, start: int = 0):
        """Compile the step for the batches of this run (step `start + 1`'s as the example);
        `run` uses it. Returns the compiled step (for `zoo.collectives`)."""
        self.compiled = self.step.compile(model, opt_state, self.batch_at(start + 1))
        return self.compiled

    def elapsed(self) -> float:
        """Seconds since `run` began."""
        return time.perf_counter() - self._t0

    def record(self, row: dict[str, Any]) -> None:
        """Hand a row (`{"kind": ..., "step": ..., ...}`) to every hook's `on_record`."""
        for hook in self.hooks:
            on_record = getattr(hook, "on_record", None)
            if on_record is not None:
                on_record(row)

    def stopped(self, why: str, step: int) -> RunStopped:
        """The `RunStopped` of a run that must stop at `step`: `why`, then the last good
        checkpoint, then the advice."""
        saved = [k for h in self.hooks if (k := getattr(h, "kept", lambda: None)()) is not None]
        kept = f"the last good checkpoint is {saved[0]}" if saved else "no checkpoint was saved"
        advice = self.advice(step) if callable(self.advice) else self.advice
        return RunStopped(f"{why}: training stopped, nothing saved from it; {kept}. {advice}")

    def check_finite(self, state: TrainState) -> None:
        """Raise `RunStopped` if a trained weight is NaN or inf (a non-finite gradient can
        leave such weights under a finite loss)."""
        from .._finite import all_finite  # jax: the CLI's parser imports this module

        if not all_finite(self.step.partition(state.model)[0]):
            raise self.stopped(f"step {state.step}: the weights hold NaN or inf", state.step)

    def _preempted(self, state: TrainState, *, interrupted: bool = False) -> Preempted:
        """SIGTERM (or a first Ctrl-C: `interrupted`) after `state.step`: each hook saves
        what it must; the `Preempted` (`Interrupted`) to raise."""
        saved = [s for h in self.hooks if (s := getattr(h, "on_preempt", lambda _: None)(state)) is not None]
        kind, signal_name = (Interrupted, "Ctrl-C") if interrupted else (Preempted, "SIGTERM")
        where = f"stopped after step {state.step} of {state.steps}"
        if not saved:
            return kind(f"{signal_name}: {where}; nothing saved (no Checkpoint hook)")
        then = "" if interrupted else "; continue with the same command and --resume"
        return kind(f"{signal_name}: {where}, {', '.join(saved)}{then}")

    def _row(self, i: int, loss: float, rate: float, now: float) -> dict[str, Any]:
        """The training row of step `i` (`Hook.on_record`'s `{"kind": "train", ...}`)."""
        row: dict[str, Any] = {"kind": "train", "step": i, "loss": loss, "examples_per_s": rate}
        if self.tokens_per_example:
            row["tokens_per_s"] = rate * self.tokens_per_example
        if self.lr is not None:
            row["lr"] = float(self.lr(i))
        row["elapsed"] = now - self._t0
        if self.skip_nonfinite:
            row["skipped"] = self.skipped  # steps skipped so far
        return row if self.step_metrics is None else row | self.step_metrics(i)

    def run(self, model, opt_state, *, start: int = 0):
        """Steps `start + 1` … `steps` from `model` and `opt_state` (as after step `start`).
        Returns `(model, opt_state)` after the last step."""
        import jax

        compiled = self.compiled if self.compiled is not None else self.compile(model, opt_state, start=start)
        steps = self.steps
        self._t0 = time.perf_counter()
        self.losses, self.skipped, self.hook_seconds, self.stop_reason = [], 0, 0.0, None
        self.last_step = steps
        last = time.perf_counter()
        batch_size: int | None = None
        pending: tuple[int, Any] | None = None

        def flush() -> None:
            """Record the pending step: its loss is read here (the host waits for it)."""
            nonlocal pending, last
            if pending is None:
                return
            i, loss, metrics = pending
            pending = None
            value = float(loss)
            now = time.perf_counter()
            rate = batch_size / max(now - last, 1e-9)
            last = now
            finite = math.isfinite(value)
            if finite:
                self.losses.append(value)
            elif self.skip_nonfinite:
                self.skipped += 1
            row = self._row(i, value, rate, now)
            # The loss's own metrics (the step's fourth output: a router's `aux_loss`).
            clash = sorted(set(metrics or {}) & set(row))
            if clash:
                raise ValueError(
                    f"the loss returns metrics named {clash}, which the run's own row holds (its {sorted(row)}): "
                    "rename them in the loss's metrics dict"
                )
            self.record(row | {k: float(v) for k, v in (metrics or {}).items()})
            if not finite and not self.skip_nonfinite:
                raise self.stopped(f"step {i}: the training loss is {value}", i)

        def call(name: str, state: TrainState) -> None:
            for hook in self.hooks:
                method = getattr(hook, name, None)
                if method is not None:
                    method(state)

        own = self.preemption is None
        preemption = Preemption(enabled=self.handle_sigterm) if own else self.preemption
        state = TrainState(start, steps, model, opt_state, None, self)
        failed = True
        try:
            call("on_start", state)
            train_t0 = time.perf_counter()
            last = train_t0
            for i in range(start + 1, steps + 1):
                batch = self.batch_at(i)
                if batch_size is None:
                    batch_size = jax.tree.leaves(batch)[0].shape[0]
                model, opt_state, loss, *metrics = compiled(model, opt_state, batch)
                flush()  # the previous step's loss, read while this step runs
                pending = (i, loss, metrics[0] if metrics else None)
                due = [h for h in self.hooks if getattr(h, "every", 0) and i % h.every == 0]
                stop = preemption.stop_at(i)  # the same answer in every process
                if not due and not stop:
                    continue
                flush()
                hooks_t0 = time.perf_counter()
                state = TrainState(i, steps, model, opt_state, self.losses[-1] if self.losses else None, self)
                for hook in due:
                    hook(state)
                last = time.perf_counter()  # the hooks' time is not training throughput
                self.hook_seconds += last - hooks_t0
                if self.stop_reason is not None:  # a hook ended the run: it ends here, as at its last step
                    self.last_step = i
                    break
                if stop and i != steps:
                    raise self._preempted(state, interrupted=preemption.interrupted)
            flush()
            self.train_seconds = time.perf_counter() - train_t0 - self.hook_seconds
            loss = self.losses[-1] if self.losses else None
            state = TrainState(self.last_step, steps, model, opt_state, loss, self)
            self.check_finite(state)
            call("on_end", state)
            failed = False
        finally:
            if own:
                preemption.restore()
            # Ctrl-C, a full disk, a stopped run: saves in flight finish (or fail) first.
            for hook in self.hooks:
                close = getattr(hook, "close", None)
                if close is None:
                    continue
                if failed:
                    with contextlib.suppress(Exception):
                        close()
                else:
                    close()
        return model, opt_state
