"""What a run shows and leaves behind: the progress bar, metrics.jsonl, loss.png, JSON files.

Every file is written atomically (a temporary file next to the target, fsync, `os.replace`),
so a run stopped half-way leaves whole files or none; metrics.jsonl is appended line by
line and flushed, so it always parses up to its last line.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .._files import atomic_write


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (Path, tuple, set)):
        return str(value) if isinstance(value, Path) else list(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def write_json(target: Path, value: Any) -> None:
    """`value` as indented JSON at `target`, atomically."""
    text = json.dumps(value, indent=2, default=_json_default) + "\n"
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: those become null."""
    return None if value is None or not math.isfinite(value) else value


class Metrics:
    """`metrics.jsonl`: one JSON object per line, flushed as written.

    Training rows: `{"kind": "train", "step", "loss", "examples_per_s" (and
    "tokens_per_s" for token models), "lr", "elapsed"}`; evaluation rows: `{"kind":
    "eval", "step", "eval_loss", "eval_accuracy" (when the model predicts classes or
    tokens), "elapsed"}`. `elapsed` counts seconds since the run started.
    """

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(path, "a" if append else "w")

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: _finite(v) if isinstance(v, float) else v for k, v in row.items()}
        self._file.write(json.dumps(clean, default=_json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path, on_torn: Any = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (for the plot of a resumed run, and for tests). A last
    line cut off by a crash mid-write is dropped, and `on_torn(line number, its text)` told."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:  # a last line cut off by a crash mid-write: dropped
                if on_torn is not None:
                    on_torn(i + 1, line)
                break
            raise
    return rows


def plot_losses(
    rows: list[dict[str, Any]], target: Path, title: str, baselines: dict[str, float] | None = None
) -> None:
    """loss.png: the training loss per step (and its running mean), the evaluation loss as
    a marker at each step it was measured, and `baselines` (label → held-out loss) as
    dashed lines; when the evaluations measured an accuracy, a second panel shows it.
    Matplotlib's Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("kind") == "eval" and r.get("eval_loss") is not None]
    accs = [
        (r["step"], r["eval_accuracy"]) for r in rows if r.get("kind") == "eval" and r.get("eval_accuracy") is not None
    ]
    if accs:
        fig, (ax, ax_acc) = plt.subplots(2, 1, figsize=(7, 6), dpi=100, sharex=True, height_ratios=(2, 1))
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=1, label="train loss")
        window = max(1, len(losses) // 10)
        if window > 1:
            smooth = [
                sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax.plot(steps, smooth, color="tab:blue", lw=2, label=f"train loss (mean of {window})")
    if evals:
        steps, losses = zip(*evals)
        # Measured points as markers; the thin line only guides the eye between them.
        ax.plot(steps, losses, color="tab:orange", lw=1, alpha=0.6)
        ax.plot(steps, losses, "o", color="tab:orange", ms=5, label=f"eval loss ({len(evals)} evaluations)")
    for (label, value), color in zip((baselines or {}).items(), ("tab:green", "tab:red", "tab:purple")):
        ax.axhline(value, ls="--", color=color, lw=1.5, label=label)
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if accs:
        steps, values = zip(*accs)
        ax_acc.plot(steps, [100 * v for v in values], "o-", color="tab:green", ms=5, lw=1, label="eval accuracy")
        ax_acc.set_ylabel("accuracy (%)")
        ax_acc.set_xlabel("step")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend(fontsize=8)
    else:
        ax.set_xlabel("step")
    fig.tight_layout()
    atomic_write(target, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def _clock(seconds: int | float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A progress bar on stderr: redrawn in place (`\\r`) on a terminal, a line every
    tenth of the run otherwise (logs, CI). Shows the step, the loss, the throughput and
    the time left."""

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        unit: str = "ex",
        label: str = "train",
        quiet: bool = False,
        stream: Any = None,
    ):
        self.total, self.start, self.unit, self.label, self.quiet = total, start, unit, label, quiet
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.began = time.perf_counter()
        self.every = max(1, (total - start) // 10)
        self._width = 0

    def update(self, step: int, loss: float, rate: float | None) -> None:
        """Step `step` finished with training loss `loss` at `rate` units per second."""
        if self.quiet:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.began
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        speed = f"{rate:,.0f} {self.unit}/s" if rate else "-"
        if self.tty:
            filled = int(24 * done)
            bar = "#" * filled + "." * (24 - filled)
            text = (
                f"{self.label} [{bar}] {step}/{self.total}  loss {loss:.4f}  {speed}  {_clock(elapsed)}<{_clock(eta)}"
            )
            pad = max(self._width - len(text), 0)
            self._width = len(text)
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        elif step == self.start + 1 or step == self.total or (step - self.start) % self.every == 0:
            self.stream.write(
                f"{self.label} step {step}/{self.total}  loss {loss:.4f}  {speed}  elapsed {_clock(elapsed)}  "
                f"left {_clock(eta)}\n"
            )
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line between updates (an evaluation), not overwritten by the bar."""
        if self.quiet:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
