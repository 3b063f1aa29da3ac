"""The engine's compiled programs and what they carry: prefilling one request into a slot,
starting another request of the same prompt from that prefill, one decode step of every
busy slot, moving a slot's request down; each slot's `Steering`
(next input token, logit bias, token counts, penalties) kept on the device between steps;
and the widths that keep the programs few (`bucket`, `span`, `row_bucket`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .._generate import decode_step, prefill
from .._jit import Flattened
from .._sampling import next_token_per_row
from ..nn._cache import KVCache
from ._bank import bind_rows

# Alternatives per token the engine reports (OpenAI's `logprobs` is at most 5).
TOP_LOGPROBS = 5
SMALLEST_BUCKET = 8
SMALLEST_SPAN = 128


class Steering(NamedTuple):
    """What each slot's next choice depends on besides the model, kept on the device and
    carried from step to step: its next input token, its logit bias and the counts of the
    tokens it generated (`[slots, vocab]`), and its presence and frequency penalties."""

    tokens: Array
    bias: Array
    counts: Array
    presence: Array
    frequency: Array


def _steered(logits, steering: Steering, rows: int):
    """The logits of the first `rows` slots as their bias and penalties make them."""
    counts = steering.counts[:rows]
    penalty = steering.presence[:rows, None] * (counts > 0) + steering.frequency[:rows, None] * counts
    return logits.astype(jnp.float32) + steering.bias[:rows] - penalty


def bucket(length: int, limit: int) -> int:
    """The prefill width of a prompt of `length` ids, at most `limit`: the next of 8, 16,
    32, 48, 64, 96, 128, 192, ... (powers of two from `SMALLEST_BUCKET`, and from 32 on the
    midpoints between them: a prompt pays for at most a third more columns than it holds,
    for two programs per doubling)."""
    width = SMALLEST_BUCKET
    while width < length:
        if width >= 32 and width & (width - 1) == 0 and width * 3 // 2 >= length:
            width = width * 3 // 2
            break
        width *= 2
    return min(width, limit)


def span(columns: int, limit: int) -> int:
    """The cache columns a decode step's attention reads when its longest request uses
    `columns`: `bucket(columns)`, at least `SMALLEST_SPAN`, at most `limit` (the cache's).
    Reading fewer columns than the cache holds makes a step cheaper (attention's cost grows
    with the columns read); each span is one program, so spans below `SMALLEST_SPAN`,
    where attention costs little, share one."""
    return min(max(SMALLEST_SPAN, bucket(columns, limit)), limit)


def _top(logprobs):
    values, ids = lax.top_k(logprobs, TOP_LOGPROBS)
    return ids.astype(jnp.int32), values


def _top_if(wanted, logprobs):
    """`_top` when any row wants it (a runtime branch: top-k over the vocabulary sorts)."""

    def none(x):
        return jnp.zeros(x.shape[:-1] + (TOP_LOGPROBS,), jnp.int32), jnp.zeros(x.shape[:-1] + (TOP_LOGPROBS,), x.dtype)

    return lax.cond(jnp.any(wanted), _top, none, logprobs)


def _choose(logits, steered, key_data, steps, temperature, top_k, top_p, wanted):
    """Every row's next token, chosen from the `steered` logits (bias and penalties
    applied), and its log-probabilities under the model's `logits` (chosen, top ids, top
    values; zeros when no row in `wanted` asks for the top ones), then the chosen one's
    under the logits divided by the row's temperature (1 for greedy rows): what the token
    was sampled from before top-k/top-p filtering, as RL objectives weigh it (TRL's GRPO)."""
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), steps)
    tokens = next_token_per_row(steered, keys, temperature=temperature, top_k=top_k, top_p=top_p)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    scale = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)[:, None]
    tempered = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
    sampled = jnp.take_along_axis(tempered, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen, *_top_if(wanted, logprobs), sampled


def _prefill_program(
    weights: Flattened,
    cache: KVCache,
    steering: Steering,
    slot,
    tokens,
    count,
    key_data,
    temperature,
    top_k,
    top_p,
    wanted,
    row_scale,
    bias,
    presence,
    frequency,
    echo,
):
    """Prefill one right-padded prompt, write its cache row into `slot`, pick its first token
    and make it the slot's next input (`steering`, which also takes the request's `bias`
    `[vocab]` and penalties and starts its counts at its first token). `weights`: `(model, split_layers(model))`;
    `row_scale` `[1, adapters]`: its adapter, or None without adapter slots. Returns
    `(cache, steering, first, prompt, logits)`: `first` as `_choose` returns it, `prompt`
    the prompt's log-probabilities with `echo` (else None), `logits` `[1, vocab]` the last
    prompt position's (what `_share_program` chooses another request's first token from)."""
    model, blocks = weights.tree
    if row_scale is not None:
        model, blocks = bind_rows(model, row_scale), [bind_rows(b, row_scale) for b in blocks]
    width = tokens.shape[1]
    mask = jnp.arange(width)[None, :] < count
    last = None if echo else count - 1
    logits, small = prefill(model, tokens, mask, width, every_position=echo, last=last, blocks=blocks)
    if echo:
        every = jax.nn.log_softmax(logits[0], axis=-1)  # [width, vocab]: row i predicts token i + 1
        seen = jnp.take_along_axis(every[:-1], tokens[0, 1:, None], axis=-1)[:, 0]
        prompt = (seen, *_top(every[:-1]))
        logits = lax.dynamic_index_in_dim(logits, count[0] - 1, 1, keepdims=False)
    else:
        prompt = None
    zero = jnp.zeros((), jnp.int32)
    mask_row = jnp.pad(mask, ((0, 0), (0, cache.columns - width)))
    cache = KVCache(
        tuple(
            _write_row(layer, small.keys[i], slot, count, cache.columns, axis=2) for i, layer in enumerate(cache.keys)
        ),
        tuple(
            _write_row(layer, small.values[i], slot, count, cache.columns, axis=3)
            for i, layer in enumerate(cache.values)
        ),
        lax.dynamic_update_slice(cache.mask, mask_row, (slot, zero)),
        cache.positions.at[slot].set(count[0]),
        cache.index.at[slot].set(count[0]),
    )
    steering, first = _first_token(
        steering, slot, logits, key_data, temperature, top_k, top_p, wanted, bias, presence, frequency
    )
    return cache, steering, first, prompt, logits


def _first_token(steering, slot, logits, key_data, temperature, top_k, top_p, wanted, bias, presence, frequency):
    """A request's first token, chosen from its prompt's last `logits` `[1, vocab]` with
    its settings (`bias` `[vocab]` added; nothing generated yet, so no penalty), and slot
    `slot`'s steering started from it: `(steering, first)`, `first` as `_choose` returns it."""
    steered = logits.astype(jnp.float32) + bias[None]
    first = _choose(logits, steered, key_data, jnp.zeros((1,), jnp.int32), temperature, top_k, top_p, wanted)
    token = first[0][0]
    steering = Steering(
        steering.tokens.at[slot].set(token),
        steering.bias.at[slot].set(bias),
        steering.counts.at[slot].set(jax.nn.one_hot(token, bias.shape[0], dtype=steering.counts.dtype)),
        steering.presence.at[slot].set(presence),
        steering.frequency.at[slot].set(frequency),
    )
    return steering, first


def _share_program(
    cache: KVCache,
    steering: Steering,
    source,
    slot,
    logits,
    key_data,
    temperature,
    top_k,
    top_p,
    wanted,
    bias,
    presence,
    frequency,
):
    """A request whose prompt slot `source` was just prefilled with (the same ids, the same
    adapter), started in slot `slot` without computing its prompt again: `source`'s cache
    row copied into `slot`, its first token chosen from that prefill's last `logits`
    `[1, vocab]` with this request's own settings, as `_prefill_program` would have chosen
    it. Returns `(cache, steering, first)`."""
    cache = jax.tree.map(lambda x: _copy_row(x, source, slot), cache)
    steering, first = _first_token(
        steering, slot, logits, key_data, temperature, top_k, top_p, wanted, bias, presence, frequency
    )
    return cache, steering, first


def _write_row(blocks: tuple, part, slot, count, columns: int, *, axis: int) -> tuple:
    """One layer's keys (`axis` 2: columns) or values (`axis` 3) of one prompt, `part`
    `[1, kv_heads, ...]` of its width, written into row `slot` of a blocked cache layer
    (`KVCache.blocks`, of `columns` columns) from column 0: each block gets the prompt's
    columns it holds. A ring (`KVCache.rings`: one block of `window` < `columns` columns)
    gets the last `window` of the prompt's `count` `[1]` columns, column `c` at slot
    `c mod window` (slots of no column yet: whatever, masked by `KVCache.key_columns`)."""
    zero = jnp.zeros((), jnp.int32)
    if len(blocks) == 1 and (window := blocks[0].shape[axis]) < columns:
        last = count[0] - 1
        held = jnp.clip(last - (last - jnp.arange(window)) % window, 0, part.shape[axis] - 1)
        piece = jnp.take(part, held, axis=axis).astype(blocks[0].dtype)
        return (lax.dynamic_update_slice(blocks[0], piece, (slot, zero, zero, zero)),)
    out, start, width = [], 0, part.shape[axis]
    for block in blocks:
        size = block.shape[axis]
        if start < width:
            piece = lax.slice_in_dim(part, start, min(width, start + size), axis=axis).astype(block.dtype)
            block = lax.dynamic_update_slice(block, piece, (slot, zero, zero, zero))
        out.append(block)
        start += size
    return tuple(out)


def _decode_program(
    weights: Flattened,
    cache: KVCache,
    steering: Steering,
    steps,
    key_data,
    temperature,
    top_k,
    top_p,
    wanted,
    row_scale,
    span,
):
    """One step of the first `rows` slots (`rows`: the length of `steps` and the other
    per-row settings; the engine keeps its requests in the lowest slots): each one's last
    token in (`steering.tokens`, as the last step or prefill left it on the device), its
    next token (and log-probabilities) out, chosen with its bias and penalties, made its
    next input and counted. `weights`: `(model,
    split_layers(model))`; `row_scale` `[rows, adapters]`: each row's adapter, or None
    without adapter slots; `span`: the cache columns attention reads (every active slot's
    are below it)."""
    model, blocks = weights.tree
    blocks = blocks if row_scale is None else [bind_rows(b, row_scale) for b in blocks]
    rows, slots = steps.shape[0], steering.tokens.shape[0]
    # The rows in use, sliced out of the cache and written back in place (the cache is donated).
    part = cache if rows == slots else jax.tree.map(lambda x: x[:rows] if x.ndim else x, cache)
    logits, part = decode_step(model, steering.tokens[:rows], part, blocks, span)
    if rows < slots:
        part = jax.tree.map(lambda whole, x: lax.dynamic_update_slice_in_dim(whole, x, 0, axis=0), cache, part)
    out = _choose(logits, _steered(logits, steering, rows), key_data, steps, temperature, top_k, top_p, wanted)
    counts = steering.counts.at[jnp.arange(rows), out[0]].add(1.0)
    return part, steering._replace(tokens=steering.tokens.at[:rows].set(out[0]), counts=counts), out


def _move_program(cache: KVCache, steering: Steering, source, target):
    """Slot `source`'s request moved to slot `target`: its cache row (every layer's keys and
    values, its mask, position and column) and its steering (next input token, bias,
    counts, penalties)."""

    def move(x):
        return _copy_row(x, source, target)

    return jax.tree.map(move, cache), Steering(*map(move, steering))


def _copy_row(x, source, target):
    """`x` with its row `target` (axis 0: the slots) a copy of its row `source`."""
    return lax.dynamic_update_index_in_dim(x, lax.dynamic_index_in_dim(x, source, 0, keepdims=False), target, 0)


def row_bucket(active: int, slots: int) -> int:
    """How many rows a decode step runs for `active` requests: the next power of two, at
    most `slots` (one program each; the requests are kept in the lowest slots)."""
    rows = 1
    while rows < active:
        rows *= 2
    return min(rows, slots)
