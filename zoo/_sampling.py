"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

The order and the rules are those of transformers' `generate`: temperature first, then
top-k (keep every token scoring at least the k-th best, ties included), then top-p (keep
the most likely tokens until their probability reaches `top_p`, at least one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """A one-line `ValueError` naming the fix for a bad sampling setting."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None (no top-k filtering), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None (no nucleus filtering), got {top_p}")


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
