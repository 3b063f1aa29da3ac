"""Hooks: what a `Trainer` does every N steps besides training (evaluate, checkpoint,
log, show progress, sample).

A hook is any object with an `every` attribute (fire after every `every`-th step; 0:
never by step) and a `__call__(state)`; optionally `on_start(state)` (before the first
step), `on_record(row)` (every row a run records: a training step's loss, an
evaluation), `on_end(state)` (after the last step) and `close()` (always, also when the
run fails). Subclass `Hook` to get the optional methods as no-ops.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._checkpoint import Checkpointer
from .._distributed import is_main_process
from .._generate import generate
from ..models._preference import METRICS as PAIR_METRICS
from ..models._preference import ORPO_METRICS
from ._errors import ConfigError
from ._output import read_metrics
from ._scores import WATCHED, watched_metric
from ._trainer import Hook, TrainState


def _main() -> bool:
    return is_main_process()


class Evaluate(Hook):
    """Held-out loss (and accuracy) every `every` steps, before the first step
    (`at_start`) and after the last (`at_end`); recorded as `{"kind": "eval", ...}` rows.

    **Arguments:**

    - `evaluate`: `model -> {"loss": float, "accuracy": float | None, ...}`.
    - `every`: steps between evaluations (0: only at the start and the end).
    - `at_start`, `at_end`: also evaluate before the first step and after the last.
    - `first`: an evaluation already made at the start, recorded instead of running one.

    `results` lists `(step, evaluation)` in order.
    """

    def __init__(
        self,
        evaluate: Callable[[Any], dict[str, Any]],
        *,
        every: int = 0,
        at_start: bool = True,
        at_end: bool = True,
        first: dict[str, Any] | None = None,
    ):
        self.evaluate, self.every, self.at_start, self.at_end, self.first = evaluate, every, at_start, at_end, first
        self.results: list[tuple[int, dict[str, Any]]] = []

    def _run(self, state: TrainState, result: dict[str, Any] | None = None) -> None:
        ev = result if result is not None else self.evaluate(state.model)
        self.results.append((state.step, ev))
        state.trainer.record(eval_row(state.step, ev) | {"elapsed": state.trainer.elapsed()})

    def on_start(self, state: TrainState) -> None:
        if self.at_start:
            self._run(state, self.first)

    def __call__(self, state: TrainState) -> None:
        if state.step != state.steps or not self.at_end:  # the last step: on_end evaluates
            self._run(state)

    def on_end(self, state: TrainState) -> None:
        # A run stopped early ends after a step whose evaluation is already made.
        if self.at_end and not (self.results and self.results[-1][0] == state.step):
            self._run(state)


# An evaluation's numbers as its row names them (`eval_` + the evaluation's key).
EVAL_KEYS = ("loss", "accuracy", "perplexity", "macro_f1", "per_class")
# A preference task's (TRL's names): `eval_rewards/chosen`, ..., ORPO's `eval_nll_loss`, ...
PREFERENCE_KEYS = (*PAIR_METRICS, *ORPO_METRICS)


# A GRPO task's (TRL's names), and each reward function's `rewards/NAME/mean` and `/std`.
GRPO_KEYS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "sample",
)


def eval_row(step: int, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The `{"kind": "eval", "step", "eval_loss", "eval_accuracy", ...}` row of an
    evaluation (`eval_accuracy` None when it measures none; `eval_perplexity` of a
    language model; `eval_macro_f1` and `eval_per_class`, `{class: {"precision",
    "recall", "f1", "support"}}`, of a classifier; TRL's `eval_rewards/chosen`, ... of a
    preference task; `eval_loss/NAME` of each of several adapters)."""
    row = {"kind": "eval", "step": step, "eval_loss": evaluation["loss"], "eval_accuracy": evaluation.get("accuracy")}
    row |= {f"eval_{k}": evaluation[k] for k in (*EVAL_KEYS[2:], *PREFERENCE_KEYS, *GRPO_KEYS) if k in evaluation}
    row |= {f"eval_{k}": v for k, v in evaluation.items() if k.startswith("rewards/")}
    return row | {f"eval_{k}": v for k, v in evaluation.items() if k.startswith("loss/")}  # each adapter's


def evaluation_at_start(metrics: Path) -> dict[str, Any] | None:
    """The evaluation before a run's first step, read back from its metrics.jsonl's step-0
    row (`eval_row`'s inverse, less the example count): what a resumed run's `loss_fell`
    compares with. None when the run did not evaluate before training."""
    row = next((r for r in read_metrics(metrics) if r.get("kind") == "eval" and r.get("step") == 0), None)
    if row is None:
        return None
    return {k.removeprefix("eval_"): v for k, v in row.items() if k.startswith("eval_") and v is not None}


class Checkpoint(Hook):
    """Saves the trained leaves (`trainer.step.partition(model)[0]` as `"params"`), the
    optimizer state and `extra` every `every` steps with `zoo.Checkpointer` (every process
    takes part: each writes its own shards). The weights are checked first: a save never
    holds NaN or inf (the run stops with `RunStopped` instead).

    **Arguments:**

    - `directory`: the checkpoints' folder.
    - `every`: steps between saves (0: none by step; `at_end` or `save` still save).
    - `keep`: how many checkpoints to keep, newest first.
    - `at_end`: also save after the last step.
    - `extra`: more of the state to save (e.g. `{"key": key}`); `metadata`: JSON saved
      alongside (with the step).
    - `checkpointer`: an open `zoo.Checkpointer` of `directory` to use (e.g. the one a
      resumed run restored from; opened with `keep=None` when `pinned` is given);
      `last_saved`: the step already saved there.
    - `notes`: `() -> dict`, more JSON metadata read at each save (`KeepBest`'s record).
    - `pinned`: `() -> set of steps` kept beyond the newest `keep` (the best checkpoint):
      the hook then deletes the others itself, after each save and when it closes.
    - `more`: `() -> dict`, more state read at each save (a GRPO run's current rollout).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        every: int = 0,
        keep: int = 3,
        at_end: bool = False,
        extra: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        checkpointer=None,
        last_saved: int | None = None,
        notes: Callable[[], dict[str, Any]] | None = None,
        pinned: Callable[[], set[int]] | None = None,
        more: Callable[[], dict[str, Any]] | None = None,
    ):
        self.directory, self.every, self.keep, self.at_end = Path(directory), every, keep, at_end
        self.extra, self.metadata, self.more = dict(extra or {}), dict(metadata or {}), more
        self.checkpointer, self.last_saved = checkpointer, last_saved
        self.notes, self.pinned = notes, pinned

    def save(self, state: TrainState) -> None:
        """Save the state of `state.step` now (once per step)."""
        if self.last_saved == state.step:
            return
        state.trainer.check_finite(state)
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.directory, keep=None if self.pinned else self.keep)
        params = state.trainer.step.partition(state.model)[0]
        metadata = {"step": state.step, **self.metadata, **(self.notes() if self.notes else {})}
        self.checkpointer.save(
            state.step,
            {"params": params, "opt_state": state.opt_state, **self.extra, **(self.more() if self.more else {})},
            metadata=metadata,
        )
        self.last_saved = state.step
        self._rotate(self.checkpointer)

    def _rotate(self, checkpointer: Checkpointer) -> None:
        """Delete the checkpoints beyond the newest `keep` but the `pinned` ones (without
        `pinned`, the `Checkpointer` rotates them itself)."""
        if self.pinned is None:
            return
        steps = checkpointer.steps()  # committed; the save in flight is the newest
        newest = sorted(set(steps) | ({self.last_saved} if self.last_saved is not None else set()))[-self.keep :]
        for step in steps:
            if step not in newest and step not in self.pinned():
                checkpointer.delete(step)

    def __call__(self, state: TrainState) -> None:
        if state.step != state.steps or not self.at_end:
            self.save(state)

    def on_end(self, state: TrainState) -> None:
        if self.at_end:
            self.save(state)

    def on_preempt(self, state: TrainState) -> str:
        self.save(state)
        self.close()
        return f"checkpoint saved in {self.directory}"

    def kept(self) -> str | None:
        return f"step {self.last_saved} in {self.directory}" if self.last_saved else None

    def close(self) -> None:
        """Wait for a save in flight, then close the checkpointer (`save` reopens it)."""
        if self.checkpointer is not None:
            checkpointer, self.checkpointer = self.checkpointer, None
            checkpointer.wait()
            self._rotate(checkpointer)
            checkpointer.close()


class MetricsLog(Hook):
    """metrics.jsonl: every recorded row of `kinds` as one JSON line, flushed as written
    (process 0 only). A resumed run (started after step 0) keeps the file's rows up to
    its start step and continues it.

    Training rows: `{"kind": "train", "step", "loss", "examples_per_s" (and
    "tokens_per_s"), "lr", "elapsed"}` (+ `"skipped"` when non-finite steps are skipped);
    evaluation rows: `{"kind": "eval", "step", "eval_loss", "eval_accuracy", "elapsed"}`
    (+ `"eval_perplexity"` of a language model, `"eval_macro_f1"` and `"eval_per_class"`
    of a classifier: `eval_row`). Non-finite numbers are written as null.
    """

    def __init__(self, path: str | Path, *, kinds: tuple[str, ...] = ("train", "eval")):
        self.path, self.kinds = Path(path), kinds
        self._file = None

    def on_start(self, state: TrainState) -> None:
        from ._output import Metrics, read_metrics

        if not _main():
            return
        # A resumed run keeps the rows up to its start; at the last step (a run killed after
        # its final checkpoint) the final evaluation is redone.
        redo = ("eval", state.step) if state.step == state.steps else None

        cut: list[tuple[int, str]] = []
        rows = read_metrics(self.path, lambda number, text: cut.append((number, text))) if state.step else []
        kept = [r for r in rows if r.get("step", 0) <= state.step and (r.get("kind"), r.get("step")) != redo]
        if cut:  # a row cut off mid-write: said when it was one of the kept steps' (not recorded again)
            number, text = cut[0]
            found = re.search(r'"step": *(\d+)', text)
            step = int(found[1]) if found else (rows[-1].get("step", 0) if rows else 0)
            if step <= state.step:
                print(
                    f"zoo: note: {self.path} line {number} was cut off mid-write ({text[:40]!r}...) by the run that "
                    f"stopped: dropped (the resumed run records the steps after {state.step} anew)",
                    file=sys.stderr,
                )
        self._file = Metrics(self.path)
        for row in kept:
            self._file.write(row)

    def on_record(self, row: dict[str, Any]) -> None:
        if self._file is not None and row.get("kind") in self.kinds:
            self._file.write(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard(Hook):
    """TensorBoard event files in `logdir` (process 0 only), via tensorboardX
    (`pip install 'eqx-zoo[tensorboard]'`): the scalars `loss` and `lr` per step,
    `eval_loss`, `eval_accuracy`, `eval_perplexity`, `eval_macro_f1` per evaluation (those
    it measures), a classifier's `eval_precision/CLASS`, `eval_recall/CLASS`,
    `eval_f1/CLASS`, a preference task's TRL metrics, and a GRPO run's (`reward`,
    `rewards/NAME/mean`, `completions/mean_length`, ... per step; `eval_` ones per
    evaluation)."""

    def __init__(self, logdir: str | Path):
        try:
            import tensorboardX  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "TensorBoard logging needs tensorboardX: pip install 'eqx-zoo[tensorboard]' (or tensorboardX)"
            ) from e
        self.logdir = Path(logdir)
        self._writer = None

    def on_start(self, state: TrainState) -> None:
        from tensorboardX import SummaryWriter

        if _main():
            self._writer = SummaryWriter(str(self.logdir))

    def on_record(self, row: dict[str, Any]) -> None:
        if self._writer is None:
            return
        scalars = {
            "train": ("loss", "lr", *GRPO_KEYS[:-1]),
            "eval": tuple(f"eval_{k}" for k in (*EVAL_KEYS[:-1], *PREFERENCE_KEYS, *GRPO_KEYS[:-1])),
        }
        values = {name: row.get(name) for name in scalars.get(row.get("kind"), ())}
        prefix = "rewards/" if row.get("kind") == "train" else "eval_rewards/"  # GRPO: each reward function's
        values |= {name: value for name, value in row.items() if name.startswith(prefix)}
        for label, scores in (row.get("eval_per_class") or {}).items():
            values |= {f"eval_{score}/{label}": scores[score] for score in ("precision", "recall", "f1")}
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(name, float(value), row["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class Progress(Hook):
    """A progress bar on `stream` (default stderr; process 0 only): redrawn in place on a
    terminal, a line every tenth of the run otherwise; evaluations between start and end
    as lines of their own. `unit`: `"ex"` (examples/s) or `"tok"` (tokens/s)."""

    def __init__(self, *, unit: str = "ex", label: str = "train", stream: Any = None):
        self.unit, self.label, self.stream = unit, label, stream
        self._bar = None
        self._span = (0, 0)

    def on_start(self, state: TrainState) -> None:
        from ._output import Progress as Bar

        if _main():
            self._bar = Bar(
                state.steps, start=state.step, unit=self.unit, label=self.label, stream=self.stream or sys.stderr
            )
            self._span = (state.step, state.steps)

    def on_record(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            return
        if row.get("kind") == "train":
            rate = row.get("tokens_per_s" if self.unit == "tok" else "examples_per_s")
            self._bar.update(row["step"], float("nan") if row["loss"] is None else row["loss"], rate)
        elif row.get("kind") == "eval" and row["step"] not in self._span:
            acc = row.get("eval_accuracy")
            # A preference or GRPO run's: TRL's names, as its logs print them.
            trl = "".join(  # a GRPO run's: its mean reward and completion length
                f", {k} {row[f'eval_{k}']:.4f}"
                for k in (*PREFERENCE_KEYS[:6], "reward", "completions/mean_length")
                if k != "rewards/accuracies" and row.get(f"eval_{k}") is not None
            )
            self._bar.note(
                f"step {row['step']}: eval loss {row['eval_loss']:.4f}"
                + ("" if acc is None else f", accuracy {100 * acc:.1f}%")
                + trl
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Sample(Hook):
    """A decoder's greedy continuation of `prompt` (`zoo.generate`) every `every` steps
    and after the last (`at_end`), recorded as `{"kind": "sample", "step", "prompt",
    "completion", "new_tokens"}` rows.

    **Arguments:**

    - `prompt`: token ids `[1, P]` (numpy or jax, int32).
    - `new_tokens`: tokens generated each time.
    - `decode`: token ids (a 1-D numpy array) → text (default: the ids as a list).

    `results` lists the rows in order.
    """

    def __init__(
        self,
        prompt,
        *,
        every: int = 0,
        new_tokens: int = 32,
        decode: Callable[[Any], Any] | None = None,
        at_end: bool = True,
    ):
        import numpy as np

        self.prompt = np.asarray(prompt, np.int32)
        self.every, self.new_tokens, self.at_end = every, new_tokens, at_end
        self.decode = decode or (lambda ids: [int(t) for t in ids])
        self.results: list[dict[str, Any]] = []

    def _run(self, state: TrainState) -> None:
        import numpy as np

        out = generate(state.model, self.prompt, max_new_tokens=self.new_tokens)
        # This process's copy of the rows (any process count).
        ids = np.asarray(out.addressable_data(0)) if out.is_fully_replicated else np.asarray(out)
        n = self.prompt.shape[1]
        row = {
            "kind": "sample",
            "step": state.step,
            "prompt": self.decode(self.prompt[0]),
            "completion": self.decode(ids[0, n:]),
            "new_tokens": self.new_tokens,
        }
        self.results.append(row)
        state.trainer.record(row)

    def __call__(self, state: TrainState) -> None:
        if state.step != state.steps or not self.at_end:
            self._run(state)

    def on_end(self, state: TrainState) -> None:
        if self.at_end and not (self.results and self.results[-1]["step"] == state.step):
            self._run(state)


def decoder_sample(model, task, *, prompt_len: int = 16, new_tokens: int = 32) -> Sample:
    """The `Sample` hook of a decoder's run: a greedy continuation of the start of the
    first validation window, decoded by the task's tokenizer (else as bytes)."""
    import numpy as np

    from ..hf import Tokenizer
    from ._task import decoder_of

    max_len = model.config.max_len
    prompt_len = min(prompt_len, max_len // 2)
    new_tokens = min(new_tokens, max_len - prompt_len)
    tokens = np.asarray(task.eval_data["tokens"][:1, :prompt_len], np.int32)
    tokenizer = Tokenizer.from_pretrained(task.tokenizer_dir) if task.tokenizer_dir is not None else None
    return Sample(tokens, new_tokens=new_tokens, decode=decoder_of(tokenizer))


# --------------------------------------------------------------------------- the best checkpoint: KeepBest
# Watching a run's evaluations: keep the checkpoint of the best one (`RunConfig.keep_best`)
# and stop when the metric has not improved for a while (`RunConfig.early_stop`).


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

    def __init__(self, metric: str, evaluations: Evaluate, saver: Checkpoint, *, keep: bool, patience: int, every: int):
        self.metric, self.evaluations, self.saver = metric, evaluations, saver
        self.keep, self.patience, self.every = keep, patience, every
        self.mode = WATCHED[metric][0]
        self.value: float | None = None
        self.step: int | None = None
        self.since = 0  # evaluations since the best
        self.checked: int | None = None
        if keep:
            saver.pinned = lambda: set() if self.step is None else {self.step}
        saver.notes = lambda: {
            "best": {"metric": self.metric, "value": self.value, "step": self.step, "since": self.since}
        }

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
        return {
            "metric": self.metric,
            "mode": self.mode,
            "value": self.value,
            "step": self.step,
            "evaluations_since": self.since,
            "checkpoint": str(directory / str(self.step)) if kept else None,
        }


def watch(config: Any, evaluations: Evaluate, saver: Checkpoint) -> KeepBest | None:
    """The `KeepBest` hook of a run whose config keeps the best checkpoint or stops early
    (`RunConfig.keep_best`, `early_stop`), or None."""
    if config.keep_best is None and not config.early_stop:
        return None
    return KeepBest(
        watched_metric(config.keep_best),
        evaluations,
        saver,
        keep=config.keep_best is not None,
        patience=config.early_stop,
        every=config.eval_interval,
    )
