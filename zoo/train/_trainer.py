"""The training loop: a compiled `zoo.TrainStep` over batches, with hooks every N steps."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import Preempted, RunStopped
from ._hooks import Checkpoint, TrainState
from ._preemption import Preemption

_ADVICE = "lower the learning rate, keep gradient clipping on, or skip such steps (skip_nonfinite)"


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
    - `handle_sigterm`: on SIGTERM, finish the step in progress, save it with the
      `Checkpoint` hook and raise `Preempted`; in a multi-process run every process stops
      after the same step (`zoo.train._preemption.Preemption`: the processes compare their
      notes after each step, outside the compiled step).
    - `preemption`: a `Preemption` installed earlier (before loading and compiling, as
      `zoo.train.run` does) to use instead of one of the loop's own.
    - `advice`: what a `RunStopped` message suggests: text, or a function of the step
      that went non-finite returning it (to name the cause it can see).

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

    def __init__(self, step, batch_at: Callable[[int], Any], *, steps: int, hooks: Sequence[Any] = (),
                 lr: Callable[[int], float] | None = None, tokens_per_example: int | None = None,
                 skip_nonfinite: bool = False, handle_sigterm: bool = True,
                 advice: str | Callable[[int], str] = _ADVICE,
                 preemption: Preemption | None = None):  # fmt: skip
        self.step, self.batch_at, self.steps, self.hooks = step, batch_at, steps, list(hooks)
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
        saved = [h for h in self.hooks if isinstance(h, Checkpoint) and h.last_saved]
        kept = (f"the last good checkpoint is step {saved[0].last_saved} in {saved[0].directory}" if saved
                else "no checkpoint was saved")  # fmt: skip
        advice = self.advice(step) if callable(self.advice) else self.advice
        return RunStopped(f"{why}: training stopped, nothing saved from it; {kept}. {advice}")

    def check_finite(self, state: TrainState) -> None:
        """Raise `RunStopped` if a trained weight is NaN or inf (a non-finite gradient can
        leave such weights under a finite loss)."""
        from .._finite import all_finite  # jax: the CLI's parser imports this module

        if not all_finite(self.step.partition(state.model)[0]):
            raise self.stopped(f"step {state.step}: the weights hold NaN or inf", state.step)

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
            i, loss = pending
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
            row: dict[str, Any] = {"kind": "train", "step": i, "loss": value, "examples_per_s": rate}
            if self.tokens_per_example:
                row["tokens_per_s"] = rate * self.tokens_per_example
            if self.lr is not None:
                row["lr"] = float(self.lr(i))
            row["elapsed"] = now - self._t0
            if self.skip_nonfinite:
                row["skipped"] = self.skipped  # steps skipped so far
            self.record(row)
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
                model, opt_state, loss = compiled(model, opt_state, batch)
                flush()  # the previous step's loss, read while this step runs
                pending = (i, loss)
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
                    saver = next((h for h in self.hooks if isinstance(h, Checkpoint)), None)
                    if saver is None:
                        raise Preempted(f"SIGTERM: stopped after step {i} of {steps}; nothing saved (no Checkpoint "
                                        "hook)")  # fmt: skip
                    saver.save(state)
                    saver.close()
                    raise Preempted(f"SIGTERM: stopped after step {i} of {steps}, checkpoint saved in "
                                    f"{saver.directory}; continue with the same command and --resume")  # fmt: skip
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
