"""A preference-tuning task (`RunConfig.objective` dpo / orpo): a decoder on a file of
preference pairs, its loss a `zoo.models.PreferenceLoss`, its held-out metrics TRL's; and a
finished preference run evaluated on a file of pairs (`zoo eval`, `evaluate_pairs`) by the
same task's evaluation.

The DPO reference: with LoRA, the same model with its adapters disabled, inside the step
(`PreferenceLoss`); without LoRA (or with LoRA `modules_to_save`, trained in full), the
model's log-probabilities computed once before training and stored with the pairs (TRL's
`precompute_ref_log_probs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ..data import Dataset
from ..models._preference import METRICS, ORPO_METRICS
from ._evaluate import Evaluator
from ._task import Task

# Past this β (DPO) or λ (ORPO) a run still trains, but not as the user likely meant: TRL
# documents 0.1-0.5, and at β x margin of tens the sigmoid loss saturates, so clipping
# leaves a sign-like update.
LARGE_BETA = 10.0

REFERENCE_IN_STEP = "reference: the base model (LoRA adapters disabled, in the training step)"
REFERENCE_PRECOMPUTED = "reference: the initial model's log-probabilities, computed once before training"


@dataclasses.dataclass(frozen=True)
class PreferencePairs:
    """A `zoo.data.BatchSource` of preference pairs: the `pairs` dataset's batches with
    `nll_norm` added, the mean count of chosen target tokens per row of the batch (ORPO's
    negative log-likelihood is a token mean over the batch, as TRL's; on several
    processes, over this process's rows)."""

    pairs: Dataset

    def __len__(self) -> int:
        return len(self.pairs)

    def batch_at(self, step: int, batch_size: int, **kwargs) -> dict[str, np.ndarray]:
        batch = self.pairs.batch_at(step, batch_size, **kwargs)
        return batch | {"nll_norm": nll_norm(batch)}

    def __getattr__(self, name: str) -> Any:  # the dataset's own fields (sha256, kind, arrays)
        return getattr(self.pairs, name)


def nll_norm(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Per row, the batch's mean number of chosen target tokens (positions 1 on)."""
    mean = batch["chosen_mask"][:, 1:].sum(axis=1).mean()
    return np.full(len(batch["chosen_mask"]), max(float(mean), 1.0), np.float32)


def preference_metrics(objective):
    """The evaluator's metrics of `objective` (a `PreferenceLoss`): per pair, each of
    TRL's metrics, the `loss`, and `correct` (the preference accuracy: the chosen reward
    above the rejected one), all scaled by the row's `weight` (0 on padding rows)."""

    def metrics(model, batch):
        w = batch["weight"]
        out = objective.metrics(model, {k: v for k, v in batch.items() if k != "weight"})
        return {k: v * w for k, v in out.items()} | {"weight": w, "correct": out["rewards/accuracies"] * w}

    return metrics


def reference_logps(objective, model, arrays: dict[str, np.ndarray], rows: int = 64) -> dict[str, np.ndarray]:
    """`ref_chosen_logps` / `ref_rejected_logps` of `model` for every pair of `arrays`,
    in chunks of `rows` (the last padded): one jitted program, run before training."""
    import equinox as eqx
    import jax

    fn = eqx.filter_jit(objective.reference_logps)
    n = len(arrays["chosen_tokens"])
    out: dict[str, list] = {"ref_chosen_logps": [], "ref_rejected_logps": []}
    for start in range(0, n, rows):
        chunk = {k: v[start : start + rows] for k, v in arrays.items() if k.startswith(("chosen_", "rejected_"))}
        m = len(chunk["chosen_tokens"])
        chunk = {k: np.concatenate([v, np.repeat(v[:1], rows - m, axis=0)]) for k, v in chunk.items()}
        got = jax.device_get(fn(model, chunk))
        for k in out:
            out[k].append(np.asarray(got[k])[:m])
    return {k: np.concatenate(v).astype(np.float32) for k, v in out.items()}


def preference_task(c, model, train: Dataset, val: Dataset, *, data: str, tokens: str) -> Task:
    """The task of `c.objective` on the pairs `train` (held out: `val`, else `train`)."""
    objective = c.preference_loss()
    eval_data = dict(val.arrays if len(val) else train.arrays)
    if c.data.eval_size:
        eval_data = {k: v[: c.data.eval_size] for k, v in eval_data.items()}
    held = f"{len(val)} held-out pairs" if len(val) else "no held-out pairs (evaluated on the training pairs)"
    reference = ""
    if c.objective == "dpo":
        # Modules trained in full beside the adapters (modules_to_save) change the model the
        # adapters are switched off in: the reference is then the model as it starts, too.
        if c.lora is not None and not c.lora.modules_to_save:
            reference = f"; {REFERENCE_IN_STEP}"
        else:  # no adapters to switch off: the model as it starts is the reference, computed once
            reference = f"; {REFERENCE_PRECOMPUTED}"
            train = dataclasses.replace(train, arrays=train.arrays | reference_logps(objective, model, train.arrays))
            eval_data |= reference_logps(objective, model, eval_data)
    return Task(
        model=model,
        kind="preference",
        loss_fn=objective,
        metrics_fn=preference_metrics(objective),
        train_source=PreferencePairs(train),
        seed=c.seed,
        eval_data=eval_data,
        train_data=None,
        data=f"{data}; {held}; {tokens} tokens, rows of {c.data.seq_len}; {c.objective} ({c.loss_type if c.objective == 'dpo' else 'odds ratio + NLL'}, beta {c.beta}){reference}",
        unit="examples",
        tokens_per_example=2 * c.data.seq_len,
    )


def evaluate_pairs(run: Any, pairs: Any, *, batch_size: int, initial_model: Callable[[], Any]) -> dict[str, Any]:
    """`run`'s model (a `SavedRun` of a dpo / orpo run) on every pair of `pairs` (a
    preference `zoo.data.Dataset`, read as the run read its data), `batch_size` pairs a
    call; `initial_model()` builds the model the run started from (asked only where DPO's
    reference is that model).

    **Returns:** `{"kind": "preference", "objective", "reference" (DPO's, in words; None
    for ORPO), "pairs", "loss", "accuracy" (= `rewards/accuracies`)}` and TRL's metrics,
    means over the pairs: `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`,
    `rewards/margins`, `logps/chosen`, `logps/rejected` (ORPO also `nll_loss`,
    `log_odds_ratio`, `log_odds_chosen`)."""
    import jax

    c = run.config
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, eval_size=0))  # every pair of the file
    precomputed = c.objective == "dpo" and (c.lora is None or bool(c.lora.modules_to_save))
    empty = dataclasses.replace(pairs, arrays={k: v[:0] for k, v in pairs.arrays.items()})
    model = initial_model() if precomputed else run.model  # what the task's reference log-probs are of
    task = preference_task(c, model, pairs, empty, data=str(run.folder), tokens="")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    scores = Evaluator(task, mesh, batch_size)(run.model, task.eval_data)
    reference = None
    if c.objective == "dpo":
        start = f"the model the run started from ({c.init})" if c.init else "the run's initial model"
        reference = start if precomputed else "the run's model with its LoRA adapters disabled (its base)"
    head = {"kind": "preference", "objective": c.objective, "reference": reference, "pairs": scores["examples"]}
    return head | {k: scores[k] for k in ("loss", "accuracy", *METRICS, *ORPO_METRICS) if k in scores}  # TRL's order


def beta_warning(objective: str, beta: float | None) -> str | None:
    """A warning for a preference run's `beta` far past the usual range (> `LARGE_BETA`),
    or None. Such a value is legal (it is not refused) but most likely a slip: a learning
    rate or a percentage typed into `--beta`."""
    if objective not in ("dpo", "orpo") or beta is None or beta <= LARGE_BETA:
        return None
    what = "DPO's beta" if objective == "dpo" else "ORPO's lambda (the odds-ratio weight)"
    usual = "0.1-0.5" if objective == "dpo" else "about 0.1"
    return (
        f"--beta {beta:g} is far past the usual range ({what}: {usual}; TRL's default 0.1): "
        f"the loss saturates and the update becomes the sign of the gradient. Pass --beta 0.1 "
        f"unless this is meant"
    )
