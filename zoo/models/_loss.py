"""Losses in the `zoo.TrainStep` contract (per-example sums and weights)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from ..nn._experts import load_balancing_loss_per_device
from ._cross_entropy import cross_entropy
from ._next_token import next_token_terms


def next_token_loss(model: Any, batch: dict[str, Any], *, metrics: bool = False) -> tuple[Any, ...]:
    """Next-token cross-entropy of a language model, as `(loss_sums, token_counts)` per example.

    **Arguments:**

    - `model`: maps `tokens [batch, seq]` (and `mask=`, `key=`; `segment_ids=`,
      `positions=` when the batch has them) to logits.
    - `batch`: a dict with `"tokens"` `[batch, seq]` and optionally:
      `"mask"` `[batch, seq]` (`True`/1 at real tokens; a target counts when it is real),
      `"weights"` `[batch, seq]` (the weight of token `t` as a target, predicted from
      `t - 1`; overrides `"mask"` for the loss: 0 on prompts, padding and the first token
      of each packed document, as `zoo.data` batches hold them),
      `"segment_ids"`, `"positions"` `[batch, seq]` (packed documents, passed to the model)
      and `"dropout_key"` (one PRNG key per example, turning dropout on).

    **Returns:** per-example sums of weighted token losses and the sums of the weights;
    the step divides their global sums, so the loss is the mean over every counted target
    token.

    A mixture of experts whose config sets `output_router_logits` (transformers'
    condition) adds `router_aux_loss_coef` times the router's load-balancing loss, as
    transformers' `outputs.loss` does, computed per forward on each device: over each
    device's rows of the microbatch (`zoo.nn.load_balancing_loss_per_device`; no cross-device sum in the
    loop), each row's share weighted by its target count, so the step's loss is the
    language-model mean plus `coef` times the target-weighted mean of those per-device
    losses (on one device and one microbatch, transformers' loss exactly).

    With `metrics` and that router term, a third output `{"aux_loss": [batch]}`: each row's
    router loss times its target count, so the step reports (`zoo.TrainStep`'s fourth
    output, a run's `aux_loss` in metrics.jsonl) the target-weighted mean of the per-device
    load-balancing losses, unscaled by the coefficient (on one device and one microbatch,
    transformers' `aux_loss`). Without the term, the pair alone.

    A `Transformer` whose logits are large applies its head a chunk of positions at a
    time (`TransformerConfig.loss_chunk`): the full logits are never held.
    """
    coef = router_loss_coef(model)
    sums, counts, aux, _ = token_loss(model, batch, router=coef is not None)
    if aux is None:
        return sums, counts
    sums = sums + coef * aux
    return (sums, counts, {"aux_loss": aux}) if metrics else (sums, counts)


def token_loss(
    model: Any, batch: dict[str, Any], *, correct: bool = False, router: bool = False
) -> tuple[Any, Any, Any, Any]:
    """`next_token_loss`'s per-example terms, `(nll_sums, token_counts, aux_loss, hits)`:
    `nll_sums` the next-token cross-entropy alone (the router term not added: held-out
    loss is the data's); `aux_loss` (with `router`, for a model whose `router_loss_coef`
    is set; else `None`, and not computed) the router term's per-row loss times its target count; `hits` (with `correct`, else `None`) each row's count of targets that are the
    logits' argmax, weighted as the loss weighs them: the held-out accuracy, read off the
    same (chunked where large) head as the loss."""
    tokens = batch["tokens"]
    mask = batch.get("mask")
    packing = {name: batch[name] for name in ("segment_ids", "positions") if name in batch}
    inputs = dict(mask=None if mask is None else mask.astype(bool), key=batch.get("dropout_key"), **packing)
    terms = next_token_terms(model, tokens, inputs=inputs, router=router, correct=correct)
    nll = -terms.logps
    weights = target_weights(batch)
    sums, counts = jnp.sum(nll * weights, axis=1), jnp.sum(weights, axis=1)
    hits = None if terms.correct is None else jnp.sum(terms.correct * weights, axis=1)
    if not router:
        return sums, counts, None, hits
    choice = terms.choice
    aux = load_balancing_loss_per_device(choice.probs, choice.chosen, mask) * counts
    return sums, counts, aux, hits


def router_loss_coef(model: Any) -> float | None:
    """The weight of the router's load-balancing loss in `model`'s training loss: its
    config's `router_aux_loss_coef` for a mixture of experts with `output_router_logits`
    set (when transformers adds it), else `None` (nothing added, nothing computed)."""
    config = getattr(model, "config", None)
    if getattr(config, "num_experts", None) is None or not getattr(config, "output_router_logits", False):
        return None
    coef = float(config.router_aux_loss_coef)
    return coef or None


def target_weights(batch: dict[str, Any]) -> Float[Array, "batch seq_minus_1"]:
    """The weight of each next-token target of `batch` (`[batch, seq - 1]`, float32), as
    `next_token_loss` counts them: `"weights"` from position 1, else `"mask"` from
    position 1, else 1 everywhere."""
    tokens = batch["tokens"]
    if "weights" in batch:
        return batch["weights"][:, 1:].astype(jnp.float32)
    mask = batch.get("mask")
    return jnp.ones(tokens[:, 1:].shape, jnp.float32) if mask is None else mask[:, 1:].astype(jnp.float32)


def classification_loss(model: Any, batch: dict[str, Any]) -> Float[Array, " batch"]:
    """Per-example cross-entropy of a classifier on `batch["tokens"]` → `batch["labels"]`.

    Optional keys: `"mask"`, `"token_types"`, `"dropout_key"` (passed to the model).
    """
    logits = model(
        batch["tokens"],
        mask=None if batch.get("mask") is None else batch["mask"].astype(bool),
        token_types=batch.get("token_types"),
        key=batch.get("dropout_key"),
    )
    return cross_entropy(logits, batch["labels"])
