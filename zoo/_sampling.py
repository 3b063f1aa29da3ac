"""Choosing the next token from logits: repetition penalty, greedy, temperature, top-k,
top-p (nucleus).

The order and the rules are those of transformers' `generate`: the repetition penalty
first (`RepetitionPenaltyLogitsProcessor`, greedy decoding included), then temperature,
then top-k (keep every token scoring at least the k-th best, ties included), then top-p
(keep the most likely tokens until their probability reaches `top_p`, at least one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .nn._sharding import entries, sharding_spec


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, repetition_penalty: float = 1.0) -> None:
    """A one-line `ValueError` naming the fix for a bad sampling setting."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None (no top-k filtering), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None (no nucleus filtering), got {top_p}")
    if not 0 < repetition_penalty < float("inf"):
        raise ValueError(
            f"repetition_penalty must be a finite number > 0 (1 is none; above 1 discourages repeats), "
            f"got {repetition_penalty}"
        )


def seen_tokens(
    tokens: Int[Array, "batch seq"], mask: Bool[Array, "batch seq"], vocab: int
) -> Bool[Array, "batch vocab"]:
    """Which ids each row holds at its real tokens (`mask`): `[batch, vocab]` booleans, the
    set the repetition penalty applies to. One column at a time: no `[batch, seq, vocab]`
    array."""
    ids = jnp.arange(vocab)
    rows = None if sharding_spec(tokens) is None else P(entries(tokens)[0], None)  # the batch's layout

    def add(i, seen):
        return seen | ((lax.dynamic_index_in_dim(tokens, i, 1) == ids) & lax.dynamic_index_in_dim(mask, i, 1))

    return lax.fori_loop(0, tokens.shape[1], add, jnp.zeros((tokens.shape[0], vocab), bool, out_sharding=rows))


def apply_repetition_penalty(
    logits: Float[Array, "batch vocab"], seen: Bool[Array, "batch vocab"], penalty: float
) -> Float[Array, "batch vocab"]:
    """transformers' `RepetitionPenaltyLogitsProcessor`: the logit of every token already
    present (`seen`) divided by `penalty` where it is positive, multiplied by it where it is
    negative (above 1, repeats become less likely either way); the others unchanged.

    **Arguments:** `logits` `[batch, vocab]`, `seen` (`seen_tokens` of the prompt and the
    tokens generated so far), `penalty` > 0 (1: no change).

    **Returns:** the penalised logits.
    """
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def filter_logits(
    logits: Float[Array, "batch vocab"], *, temperature: float, top_k: int | None, top_p: float | None
) -> Float[Array, "batch vocab"]:
    """`logits / temperature` with the tokens top-k and top-p remove set to `-inf`.

    **Arguments:** float32 `logits` `[batch, vocab]`, `temperature > 0`, `top_k` (None:
    off), `top_p` (None or 1: off).

    **Returns:** the processed logits; sampling from their softmax is sampling as
    transformers' `generate(do_sample=True, ...)` does.
    """
    logits = logits.astype(jnp.float32) / temperature
    vocab = logits.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        ranked = -jnp.sort(-logits, axis=-1)  # best first
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better-ranked tokens
        keep_ranked = (before < top_p).at[..., 0].set(True)
        # The worst kept score: a threshold, not a scatter (tokens tied with it stay too).
        cutoff = jnp.min(jnp.where(keep_ranked, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def next_token(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> Int[Array, " batch"]:
    """The next token of every row: `argmax` when `temperature == 0`, else a draw from the
    filtered distribution (`filter_logits`) with `key`."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
