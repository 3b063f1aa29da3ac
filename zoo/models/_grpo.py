"""GRPO (and its DAPO / Dr. GRPO / BNPO / GSPO variants) as a loss in the `zoo.TrainStep`
contract, with the advantages of groups of completions as TRL 1.16 computes them.

A GRPO batch holds one completion per row: `tokens` `[batch, seq]` (prompt then completion,
right-padded), `completion` `[batch, seq]` (1 at the completion tokens the loss counts),
`advantages` `[batch]` (`group_advantages`); optionally `old_logps` `[batch, seq - 1]` (the
log-probabilities of the policy that sampled the rollout, for a rollout reused over several
updates: without them the ratio is 1, its gradient the policy gradient), `ref_logps`
`[batch, seq - 1]` (the reference's, computed once) and `dropout_key`. Log-probability
position `t` is the one of token `t + 1`, as `PreferenceLoss`'s.

Why it is exact across microbatches and devices: each loss type is a sum over the step's
global batch divided by a global count (sequences, completion tokens, or sequences times
`max_completion_length`), which is the `(loss_sums, weights)` form of the step's contract;
the step adds both over microbatches and devices before it divides. TRL divides by each
microbatch's own count for `grpo` and `bnpo` (a known source of gradients that change with
gradient accumulation); zoo's `bnpo` therefore equals `dapo` (TRL's global token count).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._next_token import next_token_terms

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


def _finite_at_least(name: str, value: Any, low: float, *, open_low: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if open_low else '>='} {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """Group relative policy optimisation as a `zoo.TrainStep` loss: `loss(model, batch)`
    → `(loss_sums [batch], weights [batch])` (the step divides their global sums);
    `metrics(model, batch)` → TRL's logged values over the batch.

    **Fields** (defaults TRL 1.16's `GRPOConfig`):

    - `loss_type`: how the per-token losses are averaged. `"grpo"`: each completion's mean,
      then the mean over completions; `"dapo"` and `"bnpo"`: the mean over every completion
      token of the global batch; `"dr_grpo"`: the sum over tokens divided by completions ×
      `max_completion_length`.
    - `beta`: the weight of the KL term to the reference (0: no reference at all).
    - `epsilon`, `epsilon_high`: the ratio is clipped to `[1 - epsilon, 1 + epsilon_high]`
      (`epsilon_high` None: `epsilon`; DAPO's clip-higher sets it above).
    - `importance_sampling_level`: `"token"` (a ratio per token) or `"sequence"` (GSPO: the
      exponentiated mean log-ratio of the completion, one per sequence).
    - `max_completion_length`: `dr_grpo`'s constant divisor (TRL's default 512).
    - `temperature`: the sampling temperature; log-probabilities are those of the logits
      divided by it, as the rollout sampled them.
    - `delta`: None, or the upper bound of the unclipped ratio (two-sided clipping).
    - `kl_correction`: the KL per token times its importance ratio (TRL's
      `use_bias_correction_kl`).
    - `reference`: `reference(model)` → the reference model (e.g. `zoo.lora.disabled_adapters`,
      the policy with its adapters off), used when `beta > 0` and the batch carries no
      `ref_logps`; computed in the same program under `stop_gradient`.
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int = 512
    temperature: float = 1.0
    delta: float | None = None
    kl_correction: bool = True
    reference: Callable[[Any], Any] | None = None

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, got {self.importance_sampling_level!r}"
            )
        if self.importance_sampling_level == "sequence" and self.loss_type != "grpo":
            raise ValueError(
                f"importance_sampling_level='sequence' (GSPO) weighs whole sequences, so it goes with "
                f"loss_type='grpo'; {self.loss_type!r} sums per-token losses (TRL warns on the same pair)"
            )
        _finite_at_least("beta", self.beta, 0.0)
        _finite_at_least("epsilon", self.epsilon, 0.0)
        if self.epsilon_high is not None:
            _finite_at_least("epsilon_high", self.epsilon_high, 0.0)
        _finite_at_least("temperature", self.temperature, 0.0, open_low=True)
        if self.delta is not None:
            _finite_at_least("delta", self.delta, 1.0, open_low=True)
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be an int >= 1, got {self.max_completion_length!r}")
        if self.reference is not None and not callable(self.reference):
            raise ValueError(f"reference must be a function model -> reference model, got {self.reference!r}")

    def __call__(self, model: Any, batch: dict[str, Any]) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        return self.loss(model, batch)

    def token_logps(self, model: Any, tokens: Any, *, key: Any = None) -> Float[Array, "batch seq_minus_1"]:
        """The log-probability of each token from position 1, from the logits divided by
        `temperature` (float32); large logits are never held whole
        (`TransformerConfig.loss_chunk`)."""
        return next_token_terms(model, tokens, inputs={"key": key}, temperature=self.temperature).logps

    def reference_logps(self, model: Any, batch: dict[str, Any]) -> Float[Array, "batch seq_minus_1"]:
        """The batch's `ref_logps` of `model` as it is: run it once on a rollout before the
        updates, and put them in the batch."""
        return self.token_logps(model, batch["tokens"])

    def _reference(self, model: Any, batch: dict[str, Any]) -> Any:
        if "ref_logps" in batch:
            return batch["ref_logps"]
        if self.reference is None:
            raise ValueError(
                "GRPOLoss with beta > 0 needs a reference: the batch has no ref_logps and this GRPOLoss no "
                "reference function; pass reference=zoo.lora.disabled_adapters (a LoRA model's base), or put "
                "GRPOLoss.reference_logps of the reference in the batch, or set beta=0"
            )
        return jax.lax.stop_gradient(self.token_logps(self.reference(model), batch["tokens"]))

    def _terms(self, model: Any, batch: dict[str, Any], *, entropy: bool = False) -> dict[str, Any]:
        """Per token (or per sequence, `[batch, 1]`): the loss, the KL, the ratio and its
        clipping, with the completion mask (and with `entropy`, the sampling
        distribution's entropy)."""
        keys = batch.get("dropout_key")
        terms = next_token_terms(
            model, batch["tokens"], inputs={"key": keys}, temperature=self.temperature, entropy=entropy
        )
        lp = terms.logps
        mask = batch["completion"][:, 1:].astype(jnp.float32)
        advantages = batch["advantages"].astype(jnp.float32)[:, None]
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(lp) if old is None else old
        log_ratio = lp - old
        if self.importance_sampling_level == "sequence":
            count = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1.0)
            log_ratio = jnp.sum(log_ratio * mask, axis=1, keepdims=True) / count
        ratio = jnp.exp(log_ratio)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + high)
        unclipped = ratio if self.delta is None else jnp.minimum(ratio, self.delta)
        per_token = -jnp.minimum(unclipped * advantages, clipped * advantages)
        # The clip metrics read the ratio after `delta` (as TRL's); the KL's correction before it.
        out = {"mask": mask, "ratio": unclipped, "advantages": advantages, "low": 1 - self.epsilon, "high": 1 + high}
        if self.beta != 0.0:
            ref = self._reference(model, batch)
            kl = jnp.exp(ref - lp) - (ref - lp) - 1
            kl = kl * ratio if self.kl_correction else kl
            per_token = per_token + self.beta * kl
            out["kl"] = kl
        out["per_token"] = per_token * jnp.ones_like(mask)
        out["entropy"] = terms.entropy
        return out

    def loss(self, model: Any, batch: dict[str, Any]) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
        """`(loss_sums, weights)` per completion, both `[batch]`: the step's loss is
        `sum(loss_sums) / sum(weights)` over the global batch (see `loss_type`)."""
        return self._sums(self._terms(model, batch))

    def _sums(self, t: dict[str, Any]) -> tuple[Any, Any]:
        mask = t["mask"]
        sums = jnp.sum(t["per_token"] * mask, axis=1)
        tokens = jnp.sum(mask, axis=1)
        if self.loss_type == "grpo":
            return sums / jnp.maximum(tokens, 1.0), jnp.ones_like(sums)
        if self.loss_type == "dr_grpo":
            return sums, jnp.full_like(sums, float(self.max_completion_length))
        return sums, tokens  # dapo, bnpo: the global token mean

    def metrics(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """TRL's logged values over the batch, scalars: `loss`, `entropy` (the mean over
        completion tokens of the sampling distribution's entropy), `kl` (when `beta > 0`),
        and `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean` (the
        share of tokens, or of sequences under GSPO, whose ratio is clipped where it
        matters: below with a negative advantage, above with a positive one)."""
        t = self._terms(model, batch, entropy=True)
        mask, ratio, adv = t["mask"], t["ratio"], t["advantages"]
        sums, weights = self._sums(t)

        def token_mean(x):
            if x.shape[1] == 1:  # one value per sequence (GSPO)
                return jnp.mean(x)
            return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        low = ((ratio < t["low"]) & (adv < 0)).astype(jnp.float32)
        high = ((ratio > t["high"]) & (adv > 0)).astype(jnp.float32)
        out = {
            "loss": jnp.sum(sums) / jnp.maximum(jnp.sum(weights), 1.0),  # TRL clamps so too
            "entropy": token_mean(t["entropy"]),
            "clip_ratio/low_mean": token_mean(low),
            "clip_ratio/high_mean": token_mean(high),
            "clip_ratio/region_mean": token_mean(jnp.maximum(low, high)),
        }
        if "kl" in t:
            out["kl"] = token_mean(t["kl"])
        return jax.tree.map(jax.lax.stop_gradient, out)


def reward_table(functions: Any, prompts: list, completions: list, **columns: Any) -> np.ndarray:
    """Each reward function's score of each completion, `[completions, functions]` float32,
    with TRL's calling convention: `function(prompts=..., completions=..., **columns)` →
    one number (a bool counts as 1 / 0, as for TRL; or `None`: the function does not apply to
    that completion, NaN here) per completion.

    **Arguments:**

    - `functions`: a callable, a sequence of them, or a dict name → callable.
    - `prompts`, `completions`: one per completion (each prompt repeated for its group).
    - `columns`: the data set's other columns, one value per completion, passed by name.

    **Raises** `ValueError` in one line naming the function: when it raises, returns the
    wrong count, a value that is no number, or NaN / infinity (use `None` for "not
    applicable").
    """
    named = _named(functions)
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"reward_table: {len(prompts)} prompts for {n} completions; give one prompt per completion")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"reward_table: column {key!r} has {len(values)} values for {n} completions")
    out = np.full((n, len(named)), np.nan, np.float32)
    for j, (name, function) in enumerate(named.items()):
        try:
            got = function(prompts=prompts, completions=completions, **columns)
        except Exception as e:  # the user's code: name it, keep its message
            raise ValueError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if not hasattr(got, "__len__") or len(got) != n:
            what = f"{len(got)} values" if hasattr(got, "__len__") else type(got).__name__
            raise ValueError(f"reward function {name!r} returned {what} for {n} completions; return one per completion")
        for i, value in enumerate(got):
            if value is None:
                continue
            if not isinstance(value, int | float | np.number | np.bool_):  # a bool is 1 / 0, as for TRL
                raise ValueError(
                    f"reward function {name!r} returned {value!r} for completion {i}; return a number, or None "
                    f"where the reward does not apply"
                )
            if not math.isfinite(value):
                raise ValueError(
                    f"reward function {name!r} returned {value} for completion {i}; return a finite number, or "
                    f"None where the reward does not apply"
                )
            out[i, j] = float(value)
    return out


def _named(functions: Any) -> dict[str, Any]:
    """`functions` as a dict name → callable (names from `__name__`, made unique)."""
    if isinstance(functions, dict):
        items = list(functions.items())
    else:
        items = [
            (getattr(f, "__name__", type(f).__name__), f)
            for f in (functions if isinstance(functions, list | tuple) else [functions])
        ]
    named: dict[str, Any] = {}
    for name, f in items:
        if not callable(f):
            raise ValueError(f"reward function {name!r} is {type(f).__name__}, not a function")
        unique, k = str(name), 2
        while unique in named:
            unique, k = f"{name}_{k}", k + 1
        named[unique] = f
    if not named:
        raise ValueError("reward_table needs at least one reward function")
    return named


def group_advantages(
    rewards: Any, num_generations: int, *, weights: Any = None, scale_rewards: str = "group"
) -> tuple[np.ndarray, np.ndarray]:
    """The advantages of completions sampled in groups, as TRL 1.16's GRPO computes them
    (`multi_objective_aggregation="sum_then_normalize"`).

    **Arguments:**

    - `rewards`: `[completions, functions]` (or `[completions]`, one function), each
      prompt's `num_generations` completions next to each other; NaN where a function does
      not apply to a completion (a reward function's `None`).
    - `num_generations`: the group size G (≥ 2).
    - `weights`: one weight per function (default 1 each).
    - `scale_rewards`: divide by the standard deviation of the `"group"` (GRPO), of the
      `"batch"`, or `"none"` (Dr. GRPO).

    **Returns** `(advantages, rewards)`, float32 `[completions]`: the weighted sum of the
    functions' rewards (NaN where none applies) minus its group's mean (NaN-aware), divided
    by the chosen standard deviation (sample std, + 1e-4); a completion no function scored
    gets advantage 0.
    """
    per_func = np.asarray(rewards, dtype=np.float32)
    if per_func.ndim == 1:
        per_func = per_func[:, None]
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(
            f"num_generations must be an int >= 2 (a group's mean is its baseline), got {num_generations!r}"
        )
    if per_func.ndim != 2 or len(per_func) % num_generations:
        raise ValueError(
            f"rewards must be [completions] or [completions, functions] with completions a multiple of "
            f"num_generations {num_generations}, got shape {per_func.shape}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    w = np.ones(per_func.shape[1], np.float32) if weights is None else np.asarray(weights, np.float32)
    if w.shape != (per_func.shape[1],):
        raise ValueError(f"weights must give one number per reward function ({per_func.shape[1]}), got {w.shape}")
    unscored = np.isnan(per_func).all(axis=1)
    total = np.nansum(per_func * w, axis=1).astype(np.float32)
    total[unscored] = np.nan
    groups = total.reshape(-1, num_generations)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a group no function scored: NaN, said below
        mean = np.repeat(np.nanmean(groups, axis=1), num_generations)
        if scale_rewards == "batch":
            std = np.full_like(total, _nanstd(total))
        else:
            std = np.repeat(_nanstd(groups, axis=1), num_generations)
        advantages = total - mean
        if scale_rewards != "none":
            advantages = advantages / (std + np.float32(1e-4))
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), total


def _nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's `nanstd`: the sample standard deviation (Bessel-corrected) over the non-NaN
    values, NaN where fewer than two, in TRL's order of operations (float32)."""
    mean = np.nanmean(x, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis).astype(np.float32)
    correction = np.where(count > 1, count / (count - 1), np.float32(np.nan)).astype(np.float32)
    return np.asarray(np.sqrt(np.nanmean((x - mean) ** 2, axis=axis) * correction), np.float32)
