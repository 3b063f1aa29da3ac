"""Preference losses (DPO and its variants, ORPO) in the `zoo.TrainStep` contract, with the
metrics TRL logs for them.

A preference batch holds each pair in one row, so no microbatch split can part a pair:
`chosen_tokens`, `rejected_tokens` `[batch, seq]` (prompt then completion, right-padded),
`chosen_mask`, `rejected_mask` (1 at real tokens) and `chosen_completion`,
`rejected_completion` (1 at completion tokens); optionally `ref_chosen_logps`,
`ref_rejected_logps` `[batch]` (reference log-probabilities computed before training),
`nll_norm` `[batch]` (ORPO: the mean number of chosen target tokens per row of the step's
global batch) and `dropout_key`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._next_token import next_token_terms

OBJECTIVES = ("dpo", "orpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
SIDES = ("chosen", "rejected")
# The metrics both objectives report per pair (TRL's names); ORPO adds its own three.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def token_logps(model: Any, tokens: Any, *, key: Any = None) -> Float[Array, "batch seq_minus_1"]:
    """The log-probability of each token from position 1 given the ones before it, float32.

    Rows are right-padded, so causal attention never lets padding change a real position.
    Large logits are never held whole (`TransformerConfig.loss_chunk`).
    """
    return next_token_terms(model, tokens, inputs={"key": key}).logps


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (TRL's `log1mexp`)."""
    t = -0.6931471805599453
    return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """A preference objective as a `zoo.TrainStep` loss: `loss(model, batch)` → per-pair
    losses `[batch]`; `metrics(model, batch)` → TRL's metrics per pair.

    **Fields:**

    - `objective`: `"dpo"` (against a reference) or `"orpo"` (no reference: an odds-ratio
      term plus the chosen sequences' negative log-likelihood).
    - `beta`: DPO's β (TRL's default 0.1), or ORPO's λ weight of the odds-ratio term.
    - `loss_type` (DPO): `"sigmoid"` (the DPO paper's), `"ipo"` (squared, per-token
      normalised as TRL does), `"hinge"` (SLiC), `"robust"` (labels flipped with
      probability `label_smoothing`, TRL's Robust DPO).
    - `label_smoothing`: the flip probability in [0, 0.5) of `"robust"`; TRL 1.x uses it
      for no other of these loss types, so it must be 0 for them.

    - `reference` (DPO): `reference(model)` → the reference model, e.g.
      `zoo.lora.disabled_adapters` (the policy with its LoRA adapters switched off); None:
      every batch carries its reference log-probabilities.

    Sequence log-probabilities are sums over completion tokens (prompt and padding
    masked). The reference log-probabilities are the batch's `ref_chosen_logps` /
    `ref_rejected_logps` when it has them, else those of `reference(model)`, computed in the
    same program under `jax.lax.stop_gradient`: with `zoo.lora.disabled_adapters`, frozen
    weights only, so it adds no gradient and no collective. Modules trained in full beside
    the adapters (LoRA `modules_to_save`) stay trained in that model: then put reference
    log-probabilities computed before training (`reference_logps`) in the batch instead.
    """

    objective: str = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: Callable[[Any], Any] | None = None

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not isinstance(self.beta, int | float) or not 0 < self.beta < math.inf:
            raise ValueError(f"beta must be a finite number > 0, got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not isinstance(self.label_smoothing, int | float) or not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.reference is not None and not callable(self.reference):
            raise ValueError(f"reference must be a function model -> reference model, got {self.reference!r}")
        if self.label_smoothing and (self.objective != "dpo" or self.loss_type != "robust"):
            raise ValueError(
                f"label_smoothing {self.label_smoothing} is used by loss_type 'robust' only (TRL 1.x ignores it "
                f"for {self.loss_type!r} and for ORPO): use loss_type='robust', or label_smoothing=0"
            )

    def __call__(self, model: Any, batch: dict[str, Any]) -> Float[Array, " batch"]:
        return self.loss(model, batch)

    # -- the pieces --------------------------------------------------------------------
    def _sides(self, model: Any, batch: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per side: the summed completion log-probs `logps`, the completion's token count
        `n` (TRL's: the unshifted completion mask), and (ORPO) the real targets' NLL sum."""
        keys = batch.get("dropout_key")
        out = {}
        for side in SIDES:
            lp = token_logps(model, batch[f"{side}_tokens"], key=keys)
            completion = batch[f"{side}_completion"].astype(jnp.float32)
            real = batch[f"{side}_mask"].astype(jnp.float32)
            out[side] = {
                "logps": jnp.sum(lp * completion[:, 1:], axis=1),
                "targets": jnp.sum(completion[:, 1:], axis=1),
                "n": jnp.maximum(jnp.sum(completion, axis=1), 1.0),
                "nll": -jnp.sum(lp * real[:, 1:], axis=1),
                "real": jnp.sum(real[:, 1:], axis=1),
            }
        return out

    def _reference(self, model: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.reference is None:
            raise ValueError(
                "DPO needs a reference: the batch has no ref_chosen_logps / ref_rejected_logps and this "
                "PreferenceLoss no reference function; pass reference=zoo.lora.disabled_adapters (a LoRA model's "
                "base), or compute the reference log-probabilities once before training "
                "(PreferenceLoss.reference_logps) and put them in the batch"
            )
        base = self.reference(model)
        ref = []
        for side in SIDES:
            completion = batch[f"{side}_completion"].astype(jnp.float32)
            ref.append(jnp.sum(token_logps(base, batch[f"{side}_tokens"]) * completion[:, 1:], axis=1))
        return jax.lax.stop_gradient(ref[0]), jax.lax.stop_gradient(ref[1])

    def reference_logps(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """`{"ref_chosen_logps", "ref_rejected_logps"}` of `model` as it is (TRL's
        `precompute_ref_log_probs`): run it once on the data before training, and train
        on the data with them."""
        out = {}
        for side in SIDES:
            completion = batch[f"{side}_completion"].astype(jnp.float32)
            out[f"ref_{side}_logps"] = jnp.sum(token_logps(model, batch[f"{side}_tokens"]) * completion[:, 1:], axis=1)
        return out

    def _terms(self, model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """(per-pair losses, per-pair metrics)."""
        s = self._sides(model, batch)
        c, r = s["chosen"], s["rejected"]
        if self.objective == "orpo":
            # TRL's ORPO: mean log-probs over the completion, the NLL a token mean over the
            # chosen sequences (prompt included) of the global batch: per pair, its sum over
            # the batch's mean count (`nll_norm`; without it, the pair's own count).
            pc, pr = c["logps"] / c["targets"], r["logps"] / r["targets"]
            log_odds = (pc - pr) - (_log1mexp(pc) - _log1mexp(pr))
            ratio = jax.nn.log_sigmoid(log_odds)
            nll = c["nll"] / batch.get("nll_norm", c["real"])
            losses = nll - self.beta * ratio
            rc, rr = self.beta * pc, self.beta * pr
            metrics = _pair_metrics(rc, rr, pc, pr)
            metrics |= {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
            return losses, jax.tree.map(jax.lax.stop_gradient, metrics)
        ref_c, ref_r = self._reference(model, batch)
        cl, rl = c["logps"] - ref_c, r["logps"] - ref_r
        delta = cl - rl
        b = self.beta
        if self.loss_type == "sigmoid":
            losses = -jax.nn.log_sigmoid(b * delta)
        elif self.loss_type == "hinge":
            losses = jax.nn.relu(1 - b * delta)
        elif self.loss_type == "ipo":
            losses = (cl / c["n"] - rl / r["n"] - 1 / (2 * b)) ** 2
        else:  # robust
            e = self.label_smoothing
            losses = (-(1 - e) * jax.nn.log_sigmoid(b * delta) + e * jax.nn.log_sigmoid(-b * delta)) / (1 - 2 * e)
        metrics = _pair_metrics(b * cl, b * rl, c["logps"], r["logps"])
        return losses, jax.tree.map(jax.lax.stop_gradient, metrics)

    def loss(self, model: Any, batch: dict[str, Any]) -> Float[Array, " batch"]:
        """Per-pair losses `[batch]` (the step averages them over the global batch)."""
        return self._terms(model, batch)[0]

    def metrics(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """Per pair: `loss` and TRL's metrics (`rewards/chosen`, `rewards/rejected`,
        `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`; ORPO
        also `nll_loss`, `log_odds_ratio`, `log_odds_chosen`), each `[batch]`; their means
        over pairs are TRL's logged values."""
        losses, metrics = self._terms(model, batch)
        return {"loss": losses, **metrics}


def _pair_metrics(rewards_c, rewards_r, logps_c, logps_r) -> dict[str, Any]:
    return {
        "rewards/chosen": rewards_c,
        "rewards/rejected": rewards_r,
        "rewards/accuracies": (rewards_c > rewards_r).astype(jnp.float32),
        "rewards/margins": rewards_c - rewards_r,
        "logps/chosen": logps_c,
        "logps/rejected": logps_r,
    }
