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
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

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


def _per_row(value):
    """A per-row setting `[batch]` as a column `[batch, 1]`; a Python number as it is."""
    return value if value is None or isinstance(value, (int, float)) else jnp.asarray(value)[:, None]


def filter_logits(
    logits: Float[Array, "batch vocab"],
    *,
    temperature: float | Float[Array, " batch"],
    top_k: int | None | Int[Array, " batch"],
    top_p: float | None | Float[Array, " batch"],
) -> Float[Array, "batch vocab"]:
    """`logits / temperature` with the tokens top-k and top-p remove set to `-inf`.

    **Arguments:** float32 `logits` `[batch, vocab]`, `temperature > 0`, `top_k` (None:
    off), `top_p` (None or 1: off). Each setting is one number for every row
    (`zoo.generate`: compiled in), or a `[batch]` array, one per row (`zoo.serve.Engine`:
    requests with different settings share one program; there `top_k` 0 and `top_p` 1
    are off).

    **Returns:** the processed logits; sampling from their softmax is sampling as
    transformers' `generate(do_sample=True, ...)` does.
    """
    temperature, top_k, top_p = _per_row(temperature), _per_row(top_k), _per_row(top_p)
    logits = logits.astype(jnp.float32) / temperature
    vocab = logits.shape[-1]
    ranked = None
    if isinstance(top_k, int) and top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    elif top_k is not None and not isinstance(top_k, int):
        ranked = -jnp.sort(-logits, axis=-1)  # best first
        kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, vocab - 1), axis=-1)
        logits = jnp.where((top_k > 0) & (logits < kth), -jnp.inf, logits)
        ranked = jnp.where((top_k > 0) & (ranked < kth), -jnp.inf, ranked)  # = sorting the filtered logits
    if top_p is not None and (not isinstance(top_p, float) or top_p < 1):
        ranked = -jnp.sort(-logits, axis=-1) if ranked is None else ranked
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better-ranked tokens
        keep_ranked = (before < top_p).at[..., 0].set(True)
        # The worst kept score: a threshold, not a scatter (tokens tied with it stay too).
        cutoff = jnp.min(jnp.where(keep_ranked, ranked, jnp.inf), axis=-1, keepdims=True)
        filtered = jnp.where(logits < cutoff, -jnp.inf, logits)
        logits = filtered if isinstance(top_p, float) else jnp.where(top_p < 1, filtered, logits)
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


def next_token_per_row(
    logits: Float[Array, "batch vocab"],
    keys: Key[Array, " batch"],
    *,
    temperature: Float[Array, " batch"],
    top_k: Int[Array, " batch"],
    top_p: Float[Array, " batch"],
) -> Int[Array, " batch"]:
    """`next_token` with settings of its own for every row: greedy where `temperature` is
    0, else a draw with the row's key (`keys`, `[batch]`) from its filtered distribution
    (`top_k` 0 and `top_p` 1 are off). A row drawn with key `k` picks what `next_token`
    picks for it alone with `k`, so one program serves greedy and sampled rows alike."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0
    temperature = jnp.where(sampled, temperature, 1.0)

    def draw(filtering: bool):
        def run(_):
            if filtering:
                filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
            else:  # no row filters: skip the sort over the vocabulary
                filtered = logits.astype(jnp.float32) / temperature[:, None]
            drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row[None], axis=-1)[0])(keys, filtered)
            return jnp.where(sampled, drawn.astype(jnp.int32), greedy)

        return run

    # Runtime branches, one program: an all-greedy step pays for no draw and no sort.
    filters = jnp.any(sampled & ((top_k > 0) | (top_p < 1)))
    branch = jnp.where(jnp.any(sampled), jnp.where(filters, 2, 1), 0)
    return lax.switch(branch, [lambda _: greedy, draw(False), draw(True)], None)
