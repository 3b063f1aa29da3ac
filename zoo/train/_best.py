"""Watching a run's evaluations: keep the checkpoint of the best one (`RunConfig.keep_best`)
and stop when the metric has not improved for a while (`RunConfig.early_stop`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ._hooks import Checkpoint, Evaluate
from ._scores import WATCHED, watched_metric
from ._trainer import Hook, TrainState


class KeepBest(Hook):
    """After each evaluation made after a training step (`Evaluate`'s, which fires first):
    is its `metric` the best yet (lower for losses and perplexity, higher for accuracy and
    macro-F1; strictly better)? Then, with `keep`, the state is saved as a checkpoint by
    `saver` (once per step) and that step is pinned: `--keep`'s rotation never deletes it.
    With `patience`, a run whose metric has not improved for `patience` evaluations in a
    row stops there (`Trainer.request_stop`): it ends as at its last step.

    The evaluation before training is no candidate (its checkpoint would be the starting
    point). What the hook knows is saved with every checkpoint (`notes`, the metadata's
    `"best"`), so a resumed run continues it.

    **Arguments:** `metric` (an evaluation row's name, `_scores.WATCHED`), `evaluations`
    (the `Evaluate` hook), `saver` (the `Checkpoint` hook), `keep`, `patience` (0: never
    stop), `every` (the evaluations' interval).

    `record()` is what summary.json's `"best"` holds.
    """

    def __init__(self, metric: str, evaluations: Evaluate, saver: Checkpoint, *, keep: bool, patience: int,
                 every: int):  # fmt: skip
        self.metric, self.evaluations, self.saver = metric, evaluations, saver
        self.keep, self.patience, self.every = keep, patience, every
        self.mode = WATCHED[metric][0]
        self.value: float | None = None
        self.step: int | None = None
        self.since = 0  # evaluations since the best
        self.checked: int | None = None
        if keep:
            saver.pinned = lambda: set() if self.step is None else {self.step}
        saver.notes = lambda: {"best": {"metric": self.metric, "value": self.value, "step": self.step,
                                        "since": self.since}}  # fmt: skip

    def on_start(self, state: TrainState) -> None:
        checkpointer = self.saver.checkpointer
        if state.step and checkpointer is not None:  # resumed: continue the record saved with the step
            saved = checkpointer.metadata(state.step).get("best") or {}
            if saved.get("metric") == self.metric:
                self.value, self.step, self.since = saved.get("value"), saved.get("step"), saved.get("since", 0)
        self.checked = state.step

    def _better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return self.value is None or (value < self.value if self.mode == "min" else value > self.value)

    def _watch(self, state: TrainState) -> None:
        step, evaluation = self.evaluations.results[-1] if self.evaluations.results else (None, None)
        if step != state.step or step == self.checked:
            return
        self.checked = step
        value = evaluation.get(self.metric.removeprefix("eval_"))
        if value is not None and self._better(float(value)):
            self.value, self.step, self.since = float(value), step, 0
            if self.keep:
                self.saver.save(state)
            return
        self.since += 1
        if self.patience and self.since >= self.patience and step < state.steps:
            state.trainer.request_stop(
                f"{self.metric} has not improved for {self.since} evaluations (best {self.value:.6g} at step "
                f"{self.step})"
            )

    def __call__(self, state: TrainState) -> None:
        self._watch(state)

    def on_end(self, state: TrainState) -> None:
        self._watch(state)

    def record(self, directory: Path) -> dict[str, Any]:
        """summary.json's `"best"`: the metric, whether lower or higher is better, the best
        value and its step, the evaluations since, and the kept checkpoint's folder."""
        kept = self.keep and self.step is not None
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                "evaluations_since": self.since, "checkpoint": str(directory / str(self.step)) if kept else None}  # fmt: skip


def watch(config: Any, evaluations: Evaluate, saver: Checkpoint) -> KeepBest | None:
    """The `KeepBest` hook of a run whose config keeps the best checkpoint or stops early
    (`RunConfig.keep_best`, `early_stop`), or None."""
    if config.keep_best is None and not config.early_stop:
        return None
    return KeepBest(watched_metric(config.keep_best), evaluations, saver, keep=config.keep_best is not None,
                    patience=config.early_stop, every=config.eval_interval)  # fmt: skip
