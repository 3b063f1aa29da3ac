"""What a run that went non-finite suggests: the likely cause the run can see (a batch
with no target token, a weight decay that overturns the weights), else the learning rate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._config import RunConfig

# Optimizers whose weight decay is scaled by the learning rate (decoupled, or added to the
# gradient): lr · weight_decay >= 1 moves each weight past zero every step.
_DECAYED = ("adamw", "sgd", "lion")


def nonfinite_advice(c: RunConfig, batch_at: Callable[[int], Any]) -> Callable[[int], str]:
    """The advice of a `RunStopped` at step `k`, as a function of `k` (`Trainer`'s
    `advice`): names the config fields to change (the CLI shows them as its flags).

    **Arguments:** `c`, the run's resolved config; `batch_at(k)`, the batch of step `k`
    (this process's rows, host arrays; read again only when a step failed)."""
    opt = c.optimizer

    def advice(step: int) -> str:
        weights = _weights(batch_at, step)
        if weights is not None and not np.any(weights[:, 1:]):
            return (
                f"The batch of step {step} holds no target token (every next-token weight is 0), so its loss is "
                "0/0: give every example a completion or assistant turn that fits in DataConfig.seq_len"
            )
        decay = opt.weight_decay or 0.0
        if opt.name in _DECAYED and opt.lr is not None and opt.lr * decay >= 1:
            return (
                f"OptimizerConfig.weight_decay {decay:g} times OptimizerConfig.lr {opt.lr:g} is {opt.lr * decay:g} "
                ">= 1, so each step pushes every weight past zero until it overflows: lower "
                "OptimizerConfig.weight_decay (typically 0.01 to 0.1)"
            )
        return (
            f"Lower OptimizerConfig.lr (now {opt.lr:g}), keep OptimizerConfig.clip > 0, or set "
            "RunConfig.skip_nonfinite to skip such steps"
        )

    return advice


def _weights(batch_at: Callable[[int], Any], step: int) -> np.ndarray | None:
    """The next-token weights of step `step`'s batch (None when it has none)."""
    try:
        batch = batch_at(step)
        weights = batch.get("weights") if isinstance(batch, dict) else None
        return None if weights is None or np.ndim(weights) != 2 else np.asarray(weights)
    except Exception:  # the advice must not hide the stop itself
        return None
