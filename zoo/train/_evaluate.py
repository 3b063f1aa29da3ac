"""Held-out evaluation of a model, and the linear probe (a classifier's head fitted alone)."""

from __future__ import annotations

import math
from typing import Any

from .._distributed import global_batch, local_rows
from ..models._preference import ORPO_METRICS
from ._errors import ConfigError
from ._scores import class_scores, perplexity

# The most bytes of float32 logits one evaluation chunk of a decoder holds (`[rows, seq,
# vocab]`): 64 rows of a 151,936-token vocabulary at 2,048 positions would be 80 GB.
EVAL_LOGITS_BYTES = 1 << 30


def evaluation_rows(
    task, model, *, batch_size: int, microbatches: int | None, seq_len: int | None, data_size: int
) -> int:
    """Rows per chunk of a run's held-out evaluation: the global batch, or 64 where that is
    larger (fewer calls); for a decoder's tasks at most `EVAL_LOGITS_BYTES` of logits, but
    never fewer rows than one training microbatch (whose step holds their logits already).
    A multiple of the data axis. `Evaluator` also cuts it to the evaluated rows."""
    rows = max(batch_size, 64)
    vocab = getattr(getattr(model, "config", None), "padded_vocab", None)
    if task.kind in ("lm", "preference") and vocab and seq_len:
        fit = EVAL_LOGITS_BYTES // (seq_len * vocab * 4)
        rows = min(rows, max(batch_size // (microbatches or 1), fit))
    return data_size * max(1, math.ceil(rows / data_size))


class Evaluator:
    """Held-out loss and accuracy of a model (and a classifier's macro-F1 and per-class
    scores, a language model's perplexity): a task's `metrics_fn` jitted, run on
    fixed-size chunks split over the data axis (the last chunk padded with weight-0 rows).

    Padded texts (a `mask` in the data) are evaluated shortest first, each chunk cut to
    its longest text rounded up to a multiple of `bucket` positions: most docstrings are
    far shorter than the training length, so this does a fraction of the work, for one
    compile per bucket (a few at most).

    `rows` is the most rows of one call (a multiple of the mesh's data axis); a set of
    fewer rows runs in one call of its own size rounded up to the data axis, not padded to
    `rows` (8 held-out examples cost 8 rows of work, not 64)."""

    def __init__(self, task, mesh, rows: int, *, bucket: int = 16):
        import equinox as eqx

        self.task, self.mesh, self.rows, self.bucket = task, mesh, rows, bucket
        self._fn = eqx.filter_jit(task.metrics_fn)

    def __call__(self, model, data: dict, *, features: bool = False) -> dict[str, Any]:
        """`{"loss", "accuracy" (None for regression), "examples", "features" (numpy, in
        the rows' order, when asked)}` over every row of `data` (several adapters: also
        each one's `"loss/NAME"` on its own rows); a classifier's also
        `"macro_f1"` and `"per_class"` (`_scores.class_scores`), a language model's
        `"perplexity"` (of the mean next-token loss), a preference task's TRL metrics
        (`"rewards/chosen"`, ..., `"logps/rejected"`; ORPO's `"nll_loss"`, ...)."""
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        n = len(next(iter(data.values())))
        data_size = dict(self.mesh.shape).get("data", 1)
        chunk_rows = min(self.rows, data_size * math.ceil(n / data_size))
        sharding = NamedSharding(self.mesh, P("data"))
        lengths = data["mask"].sum(axis=1) if "mask" in data else None
        order = np.argsort(lengths, kind="stable") if lengths is not None else np.arange(n)
        outs, feats, preds = [], [], []
        for start in range(0, n, chunk_rows):
            rows = order[start : start + chunk_rows]
            chunk = {k: v[rows] for k, v in data.items()}
            if lengths is not None:  # cut the padding every row of the chunk has
                seq = data["mask"].shape[1]
                keep = min(seq, -(-int(lengths[rows].max()) // self.bucket) * self.bucket)
                chunk = {k: v[:, :keep] if v.ndim == 2 and v.shape[1] == seq else v for k, v in chunk.items()}
            m = len(rows)
            if m < chunk_rows:  # pad with copies of the first row, weighted 0
                chunk = {k: np.concatenate([v, np.repeat(v[:1], chunk_rows - m, axis=0)]) for k, v in chunk.items()}
            chunk["weight"] = (np.arange(chunk_rows) < m).astype(np.float32)
            out = self._fn(model, put_rows(chunk, sharding))
            outs.append({k: v.sum() for k, v in out.items() if k not in ("features", "predicted")})
            if features:
                feats.append(np.asarray(out["features"])[:m])
            if "predicted" in out:
                preds.append(np.asarray(out["predicted"])[:m])
        sums = {"loss": 0.0, "weight": 0.0, "correct": 0.0}
        for out in outs:
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        result = {
            "loss": sums["loss"] / max(sums["weight"], 1e-12),
            "accuracy": None if self.task.kind == "regression" else sums["correct"] / max(sums["weight"], 1e-12),
            "examples": n,
        }
        if self.task.kind == "lm":
            result["perplexity"] = perplexity(result["loss"])
        for name in self.task.adapter_names or ():  # each adapter on its own held-out rows
            result[f"loss/{name}"] = sums[f"loss/{name}"] / max(sums[f"weight/{name}"], 1e-12)
        if self.task.kind == "preference":  # TRL's metrics, means over the pairs ("accuracy": rewards/accuracies)
            result |= {k: v / max(sums["weight"], 1e-12) for k, v in sums.items() if "/" in k or k in ORPO_METRICS}
        if preds:  # a classifier's predictions, in the rows' order: its per-class scores
            predicted = np.empty(n, np.int64)
            predicted[order] = np.concatenate(preds)
            names = self.task.label_names or [str(i) for i in range(model.num_labels)]
            result |= class_scores(predicted, data["labels"], names)
        if features:
            result["features"] = np.empty_like(np.concatenate(feats))
            result["features"][order] = np.concatenate(feats)
        return result


def head_metrics(features, labels, weight, bias, label_names=None) -> dict[str, Any]:
    """Loss and accuracy (and with `label_names`, `class_scores`) of a linear head
    `features @ weight + bias` (numpy, float64)."""
    import numpy as np

    logits = features @ weight + bias
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -logp[np.arange(len(labels)), labels].mean()
    predicted = logits.argmax(axis=1)
    out = {"loss": float(loss), "accuracy": float((predicted == labels).mean()), "examples": len(labels)}
    return out | (class_scores(predicted, labels, label_names) if label_names else {})


def fit_head(features, labels, weight, bias, *, steps: int, lr: float = 1e-2, l2: float = 1e-3):
    """A linear probe: softmax regression of `labels` on frozen `features`, full-batch
    Adam for `steps` steps from the head's `(weight [d, k], bias [k])`, L2 penalty `l2`
    on the weight. numpy: a few hundred steps on a thousand rows take a second."""
    import numpy as np

    x, y = features.astype(np.float64), labels
    w, b = np.array(weight, np.float64), np.array(bias, np.float64)
    onehot = np.eye(w.shape[1])[y]
    moments = [np.zeros_like(w), np.zeros_like(b), np.zeros_like(w), np.zeros_like(b)]
    for t in range(1, steps + 1):
        logits = x @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(y)
        grads = (x.T @ g + l2 * w, g.sum(axis=0))
        for i, (param, grad) in enumerate(zip((w, b), grads)):
            m, v = moments[i], moments[i + 2]
            m[...] = 0.9 * m + 0.1 * grad
            v[...] = 0.999 * v + 0.001 * grad**2
            param -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return w, b


def put_rows(batch: dict, sharding) -> dict:
    """A whole numpy batch (the same in every process) on the devices of `sharding`, dim 0
    split over its data axis. In a multi-process run each process hands over only the rows
    its own devices hold (`zoo.local_rows`), so no process copies rows it does not keep."""
    import jax

    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    rows = local_rows(len(next(iter(batch.values()))), sharding.mesh)
    return global_batch({k: v[rows] for k, v in batch.items()}, sharding.mesh)


class TaskEvaluation:
    """An `Evaluator`'s place for a task with its own held-out evaluation (`Task.evaluate`)."""

    def __init__(self, task):
        self.task = task

    def __call__(self, model, data: dict, *, features: bool = False) -> dict[str, Any]:
        return self.task.evaluate(model, data)


def plain(evaluation: dict[str, Any]) -> dict[str, Any]:
    """An evaluation without its `features`."""
    return {k: v for k, v in evaluation.items() if k != "features"}


def first_evaluation(
    evaluate: Evaluator | TaskEvaluation, model, *, probe_steps: int, start: int
) -> list[dict[str, Any]]:
    """The run's stages before training: the held-out evaluation of `model` (at `start`),
    and with `probe_steps` (a fresh classifier, `start` 0) the linear probe: the new head
    fitted alone on the frozen encoder's features, the baseline that fine-tuning is
    compared with (`"baseline": True`). Returns the stages, `[0]` the starting point."""
    import numpy as np

    from ..nn import Linear  # jax: this module is imported by the CLI's parser

    task = evaluate.task
    if not (probe_steps and start == 0):
        return [
            {
                "name": "before training" if start == 0 else f"resumed at step {start}",
                **plain(evaluate(model, task.eval_data)),
            }
        ]
    # Training itself starts from the new head: on a thousand texts a head fitted this
    # close to the training set leaves fine-tuning nothing to learn but overconfidence.
    if not isinstance(model.head, Linear) or model.head.bias is None:
        raise ConfigError("RunConfig.probe needs the head to stay a plain Linear; keep it out of the LoRA targets")
    test = evaluate(model, task.eval_data, features=True)
    train = evaluate(model, task.train_data, features=True)
    w0, b0 = np.asarray(model.head.weight), np.asarray(model.head.bias)
    w, b = fit_head(train["features"], task.train_data["labels"], w0, b0, steps=probe_steps)
    probe = head_metrics(test["features"], task.eval_data["labels"], w, b, task.label_names)
    train_probe = head_metrics(train["features"], task.train_data["labels"], w, b)
    return [
        {"name": "pretrained encoder + new head", **plain(test)},
        {
            "name": "frozen encoder + fitted head (linear probe)",
            **probe,
            "train_accuracy": train_probe["accuracy"],
            "baseline": True,
        },
    ]
