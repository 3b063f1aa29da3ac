"""A classifier's scores from its predictions: accuracy, macro-F1 and each class's precision,
recall, F1 and support, as scikit-learn defines them (numpy, on the host); a language
model's perplexity; and which of them a run can watch (`WATCHED`). No jax: the flags'
checks read it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# Classifiers with at most this many classes list every one in `per_class`.
ALL_CLASSES_UP_TO = 1024


def classification_scores(labels: Any, predictions: Any, label_names: Sequence[str]) -> dict[str, Any]:
    """Accuracy, macro-F1 and per-class scores of predicted label ids against the true ones.

    As scikit-learn's `precision_recall_fscore_support` and `f1_score(average="macro")`:
    a class's precision is 0 when nothing was predicted as it (recall likewise when it has
    no example), its F1 0 when both are; the macro-F1 is the unweighted mean of the F1 of
    the classes that occur among the labels or the predictions.

    **Arguments:** `labels` and `predictions`, integer ids `[n]` (label `i` is
    `label_names[i]`), `label_names` every class's name.

    **Returns:** `{"examples", "accuracy", "macro_f1", "per_class": {name: {"precision",
    "recall", "f1", "support"}}}` (every class of `label_names`, in order; beyond
    `ALL_CLASSES_UP_TO` classes, those that occur among the labels or the predictions).
    Counted over the classes that occur, so sparse ids (labels 0 and 1000000) cost what
    their examples do, not a dense table over the id range.
    """
    labels, predictions = np.asarray(labels).reshape(-1), np.asarray(predictions).reshape(-1)
    if labels.shape != predictions.shape:
        raise ValueError(f"labels {labels.shape} and predictions {predictions.shape} differ in length")
    k = len(label_names)
    if labels.size and not (0 <= min(labels.min(), predictions.min()) and max(labels.max(), predictions.max()) < k):
        raise ValueError(f"label ids must be in [0, {k}) for the {k} label_names")
    occur, index = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    m = len(occur)
    both = np.zeros((m, m), np.int64)  # both[true, predicted], over the classes that occur
    np.add.at(both, (index[: labels.size], index[labels.size :]), 1)
    hits, support, predicted = np.diag(both), both.sum(axis=1), both.sum(axis=0)
    precision = np.divide(hits, predicted, out=np.zeros(m), where=predicted > 0)
    recall = np.divide(hits, support, out=np.zeros(m), where=support > 0)
    total = precision + recall
    f1 = np.divide(2 * precision * recall, total, out=np.zeros(m), where=total > 0)
    at = {int(c): i for i, c in enumerate(occur)}
    shown = range(k) if k <= ALL_CLASSES_UP_TO else occur.tolist()

    def scores(c: int) -> dict[str, Any]:
        i = at.get(c)
        if i is None:  # neither a label nor a prediction
            return {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
        return {
            "precision": float(precision[i]),
            "recall": float(recall[i]),
            "f1": float(f1[i]),
            "support": int(support[i]),
        }

    return {
        "examples": int(labels.size),
        "accuracy": float(hits.sum() / labels.size) if labels.size else None,
        "macro_f1": float(f1.mean()) if m else None,
        "per_class": {str(label_names[c]): scores(int(c)) for c in shown},
    }


def class_scores(predicted: Any, labels: Any, label_names: Sequence[str]) -> dict[str, Any]:
    """What an evaluation adds for a classifier: `{"macro_f1", "per_class"}` of
    `classification_scores` (macro-F1 0.0 when there are no examples)."""
    scores = classification_scores(labels, predicted, label_names)
    return {"macro_f1": scores["macro_f1"] or 0.0, "per_class": scores["per_class"]}


def perplexity(loss: float) -> float:
    """`exp(loss)` of a mean next-token cross-entropy (nats per token); inf past float64."""
    return math.exp(loss) if loss < 709 else math.inf


# The evaluation metrics a run can watch (`RunConfig.keep_best`, `early_stop`): whether
# lower or higher is better, and the task kinds that measure it.
WATCHED = {
    "eval_loss": ("min", ("regression", "lm", "classification")),
    "eval_perplexity": ("min", ("lm",)),
    "eval_accuracy": ("max", ("lm", "classification")),
    "eval_macro_f1": ("max", ("classification",)),
}


def watched_metric(name: str | None) -> str:
    """The evaluation row's name of a watched metric given as `eval_accuracy` or
    `accuracy` (None: `eval_loss`); ValueError listing them for any other."""
    if name is None:
        return "eval_loss"
    full = name if name.startswith("eval_") else f"eval_{name}"
    if full not in WATCHED:
        raise ValueError(f"{name!r} is no evaluation metric; choose one of {', '.join(WATCHED)}")
    return full
