"""A classifier's scores from its predictions (precision, recall and F1 per class, macro-F1,
as scikit-learn defines them) and a language model's perplexity: what an evaluation adds
to its loss and accuracy; and which of them a run can watch (`WATCHED`). No jax: the
flags' checks read it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def class_scores(predicted, labels, label_names: Sequence[str]) -> dict[str, Any]:
    """Precision, recall and F1 of each class and their unweighted mean F1 (macro-F1).

    **Arguments:** `predicted`, `labels`: class ids, one per example (numpy ints);
    `label_names`: the name of each class id.

    **Returns:** `{"macro_f1": float, "per_class": {name: {"precision", "recall", "f1",
    "support"}}}`, as `sklearn.metrics.precision_recall_fscore_support` (a score whose
    denominator is 0 is 0); macro-F1 averages the classes that occur in `labels` or
    `predicted`, as scikit-learn's `f1_score(average="macro")`.
    """
    import numpy as np

    n = len(label_names)
    predicted, labels = np.asarray(predicted, np.int64), np.asarray(labels, np.int64)
    counts = np.zeros((n, n), np.int64)  # [true, predicted]
    np.add.at(counts, (labels, predicted), 1)
    hits, support, claimed = np.diag(counts), counts.sum(axis=1), counts.sum(axis=0)

    def ratio(a, b):
        return np.divide(a, b, out=np.zeros(n), where=b > 0)

    precision, recall = ratio(hits, claimed), ratio(hits, support)
    f1 = ratio(2 * precision * recall, precision + recall)
    seen = (support > 0) | (claimed > 0)
    per_class = {
        str(name): {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                    "support": int(support[i])}
        for i, name in enumerate(label_names)
    }  # fmt: skip
    return {"macro_f1": float(f1[seen].mean()) if seen.any() else 0.0, "per_class": per_class}


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
