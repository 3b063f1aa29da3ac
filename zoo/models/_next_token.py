"""Each next token's log-probability (and the distribution's entropy) under a decoder,
with the output head applied a chunk of positions at a time when the full logits would
be large: the one place the next-token losses (SFT, DPO/ORPO, GRPO) read the head."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..nn._experts import RouterChoice
from ..nn._sharding import shard_count
from ._cross_entropy import cross_entropy

# `loss_chunk="auto"` chunks when a batch's float32 logits would exceed AUTO_ABOVE bytes,
# in chunks of about CHUNK_BYTES of logits each. Measured (benchmarks/chunked_loss.py,
# docs/performance.md, "Loss without the full logits"): at a 151,936-word vocabulary a
# chunk of 32 rows (19 MiB) ran the step 1.48x slower than the full logits, 128 rows
# (78 MiB) 1.20x, 256 rows 1.22x: each chunk reads the whole head, so a chunk needs
# about a hundred rows or more to keep the matmuls efficient; 64 MiB gives 110 rows at
# that vocabulary, 512 at 32k. Below two such chunks chunking saves little (the full
# logits' temporaries, about three times their size, stay under 0.4 GiB) and the
# unchunked program is today's: tiny models compile what they always did.
AUTO_ABOVE = 128 * 2**20
CHUNK_BYTES = 64 * 2**20


class TokenTerms(NamedTuple):
    """What a next-token loss reads off a decoder's forward pass.

    **Fields:** `logps`, each target's log-probability `[batch, seq - 1]` (float32);
    `entropy`, the predicted distribution's entropy at each position (or `None` when not
    asked for); `choice`, the routers' choices (a mixture of experts asked for them, else
    `None`); `correct`, 1.0 where the target is the logits' argmax, else 0.0 (when asked
    for, else `None`).
    """

    logps: Float[Array, "batch seq_minus_1"]
    entropy: Float[Array, "batch seq_minus_1"] | None
    choice: RouterChoice | None
    correct: Float[Array, "batch seq_minus_1"] | None = None


def chunk_length(model: Any, tokens: Int[Array | np.ndarray, "batch seq"]) -> int | None:
    """How many positions `next_token_terms` applies `model`'s head to at once: its
    config's `loss_chunk` (`"auto"`: a chunk of about `CHUNK_BYTES` of logits when the
    batch's logits exceed `AUTO_ABOVE` bytes), or `None` (the full logits at once: the
    setting says so, the logits are small, or the model has no separate head).

    The bytes counted are one device's: `tokens`' rows split over the mesh axes its
    sharding splits them over (`data`), the vocabulary over those of the output head's
    table (tensor parallelism), where those shardings are known (explicit sharding)."""
    config = getattr(model, "config", None)
    setting = getattr(config, "loss_chunk", None)
    if setting is None or not callable(getattr(model, "hidden", None)):
        return None
    batch, targets = tokens.shape[0], tokens.shape[1] - 1
    held = -(-batch // shard_count(tokens, 0)) * -(-config.padded_vocab // _vocab_shards(model, config.padded_vocab))
    row = held * 4  # float32 logits of one position of every row, on one device
    if setting == "auto":
        if row * targets <= AUTO_ABOVE:
            return None
        setting = max(1, CHUNK_BYTES // row)
    return setting if setting < targets else None


def _vocab_shards(model: Any, vocab: int) -> int:
    """Over how many devices the output head's table (`lm_head`, else the tied token
    embedding) splits the vocabulary: the most any of its `vocab`-long dims is split."""
    head = getattr(model, "lm_head", None)
    head = getattr(model, "token_embedding", None) if head is None else head
    leaves = [x for x in jax.tree.leaves(head) if hasattr(x, "shape") and vocab in tuple(x.shape)]
    return max((shard_count(x, d) for x in leaves for d, n in enumerate(x.shape) if n == vocab), default=1)


def next_token_terms(
    model: Any,
    tokens: Int[Array | np.ndarray, "batch seq"],
    *,
    inputs: dict[str, Any],
    temperature: float | None = None,
    entropy: bool = False,
    router: bool = False,
    correct: bool = False,
) -> TokenTerms:
    """Each token's log-probability from position 1 given the ones before it.

    **Arguments:**

    - `model`: a decoder; `model(tokens, **inputs)` gives its logits. A `Transformer`
      (LoRA-wrapped, quantized or not) with `config.loss_chunk` set is run to its last
      layer (`model.hidden`) and its own `head` (final norm, output head tied or not,
      soft-capping) applied a chunk of positions at a time, each chunk's logits recomputed
      in the backward pass (`jax.checkpoint`) rather than kept; any other model, or small
      logits (`chunk_length`), takes the full logits at once.
    - `tokens`: `[batch, seq]` ids.
    - `inputs`: the model's keyword inputs (`mask=`, `key=`, packing).
    - `temperature`: the logits divided by it (GRPO's sampling temperature); `None`: as
      they are.
    - `entropy`: also the entropy of each predicted distribution.
    - `router`: also the routers' choices (`model.with_router`).
    - `correct`: also whether each target is the argmax of its logits (held-out accuracy).

    **Returns:** a `TokenTerms`; chunked or not, equal within float32 rounding.
    """
    chunk = chunk_length(model, tokens)
    if chunk is None:
        return _full(model, tokens, inputs, temperature, entropy, router, correct)
    out = model.hidden(tokens, router=True, **inputs) if router else (model.hidden(tokens, **inputs), None)
    logps, ent, hits = _chunked(model.head, out[0][:, :-1], tokens[:, 1:], chunk, temperature, entropy, correct)
    return TokenTerms(logps, ent, out[1], hits)


def _divided(logits: Float[Array, "*batch vocab"], temperature: float) -> Float[Array, "*batch vocab"]:
    """`logits / temperature`, kept finite: a padded vocabulary's entries sit at the float32
    minimum, which a temperature below 1 would turn into -inf (and their 0 · -inf in the
    one-hot contractions into NaN)."""
    return jnp.maximum(logits / temperature, jnp.finfo(jnp.float32).min)


def _hits(logits: Float[Array, "*batch vocab"], targets: Int[Array, " *batch"]) -> Float[Array, " *batch"]:
    """1.0 where `targets` is the argmax of `logits`, else 0.0."""
    return (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)


def _full(model, tokens, inputs, temperature, entropy, router, correct=False) -> TokenTerms:
    """`next_token_terms` from the full logits `[batch, seq, vocab]`."""
    logits, choice = model.with_router(tokens, **inputs) if router else (model(tokens, **inputs), None)
    logits = logits[:, :-1]
    if temperature is not None:
        logits = _divided(logits, temperature)
    logps = -cross_entropy(logits, tokens[:, 1:])  # a one-hot contraction: TP-safe
    ent = None
    if entropy:
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return TokenTerms(logps, ent, choice, _hits(logits, tokens[:, 1:]) if correct else None)


def _chunked(
    head: Any,
    h: Float[Array, "batch targets embed"],
    targets: Int[Array, "batch targets"],
    chunk: int,
    temperature: float | None,
    entropy: bool,
    correct: bool = False,
) -> tuple[Float[Array, "batch targets"], Float[Array, "batch targets"] | None, Float[Array, "batch targets"] | None]:
    """Log-probabilities of `targets` (and entropies, argmax hits) from the hidden states `h`, `head`
    applied to `chunk` positions at a time in a `lax.scan`. The positions are padded to
    a multiple of `chunk` (zero states, target 0) and the padding's results dropped."""
    batch, length, _ = h.shape
    count = -(-length // chunk)
    pad = count * chunk - length
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [chunks, batch, chunk, ...]: the batch axis (split over `data`) stays where it was.
    hs = jnp.moveaxis(h.reshape(batch, count, chunk, h.shape[-1]), 1, 0)
    ts = jnp.moveaxis(targets.reshape(batch, count, chunk), 1, 0)

    @jax.checkpoint  # the backward pass recomputes a chunk's logits instead of saving them
    def terms(hc, tc):
        logits = head(hc).astype(jnp.float32)
        if temperature is not None:
            logits = _divided(logits, temperature)
        logz = jax.nn.logsumexp(logits, axis=-1)
        onehot = jax.nn.one_hot(tc, logits.shape[-1], dtype=jnp.float32)
        logps = jnp.einsum("...v,...v->...", logits, onehot) - logz  # a one-hot contraction: TP-safe
        hits = _hits(logits, tc) if correct else None
        if not entropy:
            return logps, None, hits
        probs = jnp.exp(logits - logz[..., None])
        return logps, logz - jnp.einsum("...v,...v->...", probs, logits), hits

    def body(carry, x):
        return carry, terms(*x)

    _, (logps, ent, hits) = jax.lax.scan(body, None, (hs, ts))

    def unchunk(y):
        return jnp.moveaxis(y, 0, 1).reshape(batch, count * chunk)[:, :length]

    return unchunk(logps), None if ent is None else unchunk(ent), None if hits is None else unchunk(hits)
