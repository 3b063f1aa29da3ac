"""Text generation with a key/value cache: one prefill, then a compiled decode loop.

`generate(model, tokens, ...)` compiles one program per (batch, prompt length,
`max_new_tokens`, sampling settings): the prompt's forward pass fills the cache
(`prefill`, from the prompts padded on the left: right-padded ones are moved there first),
then a `lax.while_loop` runs one cached step per new token (`decode_step`)
and picks it (`zoo._sampling.next_token`, after the repetition penalty when one is set). Repeated calls with the same shapes reuse the
compiled program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._checks import check_ids
from ._finite import check_finite_once
from ._kernels import eigen_matmuls
from ._reduced import gather_over
from ._sampling import apply_repetition_penalty, check_sampling, next_token, seen_tokens
from .lora._named import adapter_names as held_adapters
from .lora._named import route
from .models import Transformer
from .models._config import rope_scaling_of
from .models._transformer import layer_settings
from .nn._cache import KVCache, empty_cache
from .nn._sharding import entries, mesh_axes_of, sharding_spec
from .nn._stacked import Unstacked


def split_layers(model: Transformer) -> list:
    """Each layer of `model` as a module of its own, its arrays copied out of the stacked ones.

    Why: in a `lax.scan` over the stacked layers, XLA's CPU backend copies each layer's
    weights out of the `[layers, ...]` arrays (a dynamic slice) before every matmul, on every
    step: for one decoded token that tripled the bytes moved. The decode loops slice once
    (`zoo.generate`: per call, before its loop) and run the layers one after another on
    arrays of their own (`zoo.nn.Stacked.unstack`); the prefill keeps the scan (one copy per
    prompt, and the program holds one layer). Costs: a second copy of the layer weights
    while it lives, and a decode program that holds every layer (longer to compile).
    """
    return list(model.layers.unstack().layers)


def _unrolled(model: Transformer, blocks: Sequence | None) -> Transformer:
    """`model` running `blocks` (`split_layers`) one after another, or as it is."""
    if blocks is None:
        return model
    return eqx.tree_at(lambda m: m.layers, model, Unstacked(tuple(blocks)))


def prefill(
    model: Transformer,
    tokens: Int[Array, "batch prompt"],
    mask: Bool[Array, "batch prompt"],
    columns: int,
    *,
    every_position: bool = False,
    last: Int[Array, " batch"] | None = None,
    blocks: Sequence | None = None,
) -> tuple[Float[Array, "batch *prompt vocab"], KVCache]:
    """Run the padded prompts through `model`, filling a cache of `columns` columns.

    **Arguments:** the decoder, `tokens` and `mask` (`True` at real tokens; each row's
    tokens together, padded on the left as `zoo.generate` lays them out, or on the right
    as `zoo.serve.Engine` does), the cache length `columns` (prompt + new tokens),
    `every_position`: return the logits at every column, not only the next token's;
    `last`: each row's last real column (default the last column: left padding);
    `blocks`: `split_layers(model)`, to run the layers from those (no copy of each layer's
    weights out of the stacked arrays) and return a split cache (`KVCache.split`).

    **Returns:** `(logits of the token after each row's last real one [batch, vocab]
    (float32), or at every column [batch, prompt, vocab] with every_position; cache)`.
    The cache's `index` is the prompt width `prompt` (the next column to write).
    """
    b, _ = tokens.shape
    cache = empty_cache(
        model.layers.layers.attention, model.config.num_layers, b, columns, model.config.compute_dtype, tokens
    )
    h, cache = _unrolled(model, blocks).extend(tokens, cache if blocks is None else cache.split(), mask=mask)
    if every_position:
        logits = model.head(h)
    elif last is None:
        logits = model.head(h[:, -1:])[:, 0]
    else:  # right padding: each row's own last real token
        logits = model.head(jnp.take_along_axis(h, last[:, None, None], axis=1))[:, 0]
    return logits, cache


def decode_cache(model: Transformer, cache: KVCache, columns: int) -> KVCache:
    """The cache of `zoo.generate`'s decode loop, `columns` columns (prompt + new tokens),
    from `prefill`'s of the prompt's own columns (all written): split per layer
    (`KVCache.split`), each sliding layer whose window is below `columns` keeping only its
    window, a ring (`KVCache.rings`); global layers grown to every column. The prompt's pass
    never holds a column for the new tokens: the program's peak is the prompt's cache and
    the decode's, not a full one per layer. The windows are the config's (static), as
    `layer_pattern` scans them."""
    return cache.rings(layer_settings(model.config)["window"], cache.columns, columns)


def decode_step(
    model: Transformer,
    token: Int[Array, " batch"],
    cache: KVCache,
    blocks: Sequence | None = None,
    span: int | None = None,
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """One new token per row through `model`, attending to the cache; each row writes at
    the cache's `index` (shared, or its own). With `blocks` (`split_layers(model)`) the
    layers run from those and the cache is a split one (`KVCache.split`) or a blocked one
    (`KVCache.blocks`); with `span` (and `blocks`), attention reads only the cache's first
    `span` columns (every row's `index` must be below it): a split cache's are sliced (a
    copy), a blocked cache's blocks holding them are read in place.

    **Returns:** `(logits of the token after it [batch, vocab] (float32), updated cache)`.
    """
    h, cache = _unrolled(model, blocks).extend(token[:, None], cache.reading(span))
    return model.head(h)[:, 0], cache


def _replicate_vocab(logits):
    """Logits with the vocab dimension whole on every device (sorting and argmax need it)."""
    if sharding_spec(logits) is None:
        return logits
    return jax.reshard(logits, P(entries(logits)[0], None))


@functools.partial(eqx.filter_jit, compiler_options=eigen_matmuls())  # zoo/_kernels.py
def _generate_program(model, tokens, mask, key, settings, stream, prompt=None, rows=None):
    """The prompts as given (`prompt`, default `tokens`) followed by the new tokens of
    the left-padded `tokens` and `mask`; `rows`: each row's adapter index (data: one
    program for any mix), or `None`."""
    max_new, temperature, top_k, top_p, eos, pad, penalty = settings
    b, s = tokens.shape
    columns = s + max_new
    # FSDP: parameters split over the axes the batch uses are gathered once, for the loop.
    batch_axes = mesh_axes_of(tokens, (0,)) if sharding_spec(tokens) is not None else frozenset()
    mesh = jax.sharding.get_abstract_mesh()
    data_axes = frozenset(a for a in ("data",) if not mesh.empty and a in mesh.axis_names)
    if batch_axes | data_axes:
        model = gather_over(model, axes=tuple(batch_axes | data_axes))
    if rows is not None:  # every forward pass below (prefill, each step) routes each row
        model = route(model, rows)

    def pick(logits, step, seen):
        step_key = None if key is None else jax.random.fold_in(key, step)
        logits = _replicate_vocab(logits)
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, penalty)
        return next_token(logits, step_key, temperature=temperature, top_k=top_k, top_p=top_p)

    def remember(seen, tok):  # the ids the penalty applies to: the prompt's and each new one
        return None if seen is None else seen | (jnp.arange(seen.shape[1]) == tok[:, None])

    def write(out, done, tok, step):
        if eos is not None:  # finished rows continue with padding
            tok = jnp.where(done, pad, tok)
            done = done | (tok == eos)
        out = jnp.where(jnp.arange(columns)[None, :] == s + step, tok[:, None], out)
        if stream is not None:  # ordered effects need one device: the host puts steps in order
            jax.debug.callback(functools.partial(_deliver, id(stream)), step, tok)
        return out, done, tok

    logits, cache = prefill(model, tokens, mask, s)
    blocks, cache = split_layers(model), decode_cache(model, cache, columns)  # copied once, not every step
    seen = None if penalty == 1 else seen_tokens(tokens, mask.astype(bool), logits.shape[-1])
    out = jnp.pad(tokens if prompt is None else prompt, ((0, 0), (0, max_new)), constant_values=pad)
    done = jnp.zeros((b,), bool, out_sharding=None if sharding_spec(tokens) is None else P(entries(tokens)[0]))
    out, done, tok = write(out, done, pick(logits, 0, seen), 0)
    seen = remember(seen, tok)

    def cond(state):
        step, _, _, _, done, _ = state
        more = step < max_new
        return more if eos is None else more & ~jnp.all(done)

    def body(state):
        step, tok, cache, out, done, seen = state
        logits, cache = decode_step(model, tok, cache, blocks)
        out, done, tok = write(out, done, pick(logits, step, seen), step)
        return step + 1, tok, cache, out, done, remember(seen, tok)

    state = (jnp.asarray(1, jnp.int32), tok, cache, out, done, seen)
    _, _, _, out, _, _ = lax.while_loop(cond, body, state)
    return out


class _InOrder:
    """Hands `stream` each step's tokens in step order, whatever order callbacks arrive in."""

    def __init__(self, stream: Callable[[np.ndarray], Any]):
        self.stream, self.next, self.pending = stream, 0, {}

    def __call__(self, step, tokens) -> None:
        self.pending[int(step)] = np.asarray(tokens)
        while self.next in self.pending:
            self.stream(self.pending.pop(self.next))
            self.next += 1


# The compiled loop knows its `stream` by id; each call registers a fresh `_InOrder` for it.
_STREAMS: dict[int, _InOrder] = {}


def _deliver(stream_id: int, step, tokens) -> None:
    _STREAMS[stream_id](step, tokens)


def _model_mesh(model) -> Any:
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        sharding = getattr(leaf, "sharding", None)
        # One device too: its arrays' explicit axes lay out the activations, so the cache
        # must be made on the same mesh.
        if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
            return sharding.mesh
    return None


def _left_padding_order(mask: np.ndarray) -> np.ndarray | None:
    """The column order that moves each row's padding in front of its prompt, keeping the
    order of each (None when every row is padded on the left already). Each row needs at
    least one real token (True), all in one run: padded on the left, the right, or both."""
    if not mask.any(axis=1).all():
        row = int(np.flatnonzero(~mask.any(axis=1))[0])
        raise ValueError(f"mask row {row} has no real token (all False); every prompt needs at least one token")
    cols = np.arange(mask.shape[1])[None, :]
    first = mask.argmax(axis=1)[:, None]
    last = mask.shape[1] - 1 - mask[:, ::-1].argmax(axis=1)[:, None]
    bad = np.flatnonzero(((cols > first) & (cols < last) & ~mask).any(axis=1))
    if bad.size:
        raise ValueError(
            f"mask row {int(bad[0])} has padding (False) between its real tokens; generate needs each prompt's "
            "tokens together, padded on the left or on the right"
        )
    if (last == mask.shape[1] - 1).all():
        return None
    return np.argsort(mask, axis=1, kind="stable")  # False (padding) first


def _tokens_of(tokens: Any) -> Any:
    """`generate`'s tokens (a jax array as it is, else numpy), checked to be `[batch, prompt]` ids."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(
            f"tokens must be [batch, prompt], got shape {tuple(tokens.shape)}; add a batch axis with tokens[None]"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    return tokens


def _mask_of(mask: Any, b: int, s: int) -> Any:
    """`generate`'s mask: all real when None, else checked to be one bool per token."""
    if mask is None:
        return np.ones((b, s), bool)
    mask = mask if isinstance(mask, jax.Array) else np.asarray(mask)
    if tuple(mask.shape) != (b, s):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but tokens have {(b, s)}; pass one bool per token "
            "(True at real tokens, False on the padding)"
        )
    return mask


def _left_padded_prompts(tokens: Any, mask: Any) -> tuple[Any, Any, bool]:
    """`(tokens, mask, moved)` in the left-padded layout the cache is filled from: rows
    padded on the right (or on both sides) moved to their padding first, then the prompt,
    each in order (`moved`), left-padded rows as they are. A traced mask is taken as is."""
    order = None if isinstance(mask, jax.core.Tracer) else _left_padding_order(np.asarray(mask).astype(bool))
    if order is None:
        return tokens, mask, False
    if isinstance(tokens, jax.core.Tracer):
        tokens = jnp.take_along_axis(tokens, jnp.asarray(order), axis=1)
    else:
        tokens = np.take_along_axis(np.asarray(tokens), order, axis=1)
    return tokens, np.take_along_axis(np.asarray(mask).astype(bool), order, axis=1), True


BASE = "__base__"  # peft's name for the bare base in `adapter_names`


def adapter_rows(model: Any, adapter_names: Any, b: int) -> np.ndarray | None:
    """`generate`'s `adapter_names` as one adapter index per row (`-1`: the bare base), or
    `None` when not given; names, `"__base__"` / `None` and indices are checked here."""
    if adapter_names is None:
        return None
    held = held_adapters(model)
    if not held:
        raise ValueError(
            "adapter_names: this model holds no named adapters; build one with zoo.lora.add_adapter or "
            "zoo.lora.stack_adapters (a plain LoRA model has one adapter: call generate without adapter_names)"
        )
    if isinstance(adapter_names, str) or len(adapter_names) != b:
        raise ValueError(
            f"adapter_names must name one adapter per prompt ({b}), got {adapter_names!r}; "
            f"choose from {list(held)}, {BASE!r} (or None) for the bare base, or their indices"
        )
    rows = []
    for i, name in enumerate(adapter_names):
        if name is None or name == BASE:
            rows.append(-1)
        elif isinstance(name, str):
            if name not in held:
                raise ValueError(f"adapter_names[{i}]: no adapter named {name!r}: this model holds {list(held)}")
            rows.append(held.index(name))
        elif isinstance(name, int | np.integer) and not isinstance(name, bool) and -1 <= name < len(held):
            rows.append(int(name))
        else:
            raise ValueError(
                f"adapter_names[{i}] = {name!r} is out of range: this model holds {len(held)} adapters {list(held)} "
                f"(indices 0..{len(held) - 1}; -1, None or {BASE!r}: the bare base)"
            )
    return np.asarray(rows, np.int32)


def _check_length(max_new_tokens: Any, s: int, max_len: int) -> int:
    """`max_new_tokens` as an int, checked positive and to fit `max_len` after `s` prompt tokens."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if s + max_new_tokens > max_len:
        raise ValueError(
            f"prompt length {s} + max_new_tokens {max_new_tokens} = {s + max_new_tokens} exceeds the model's max_len "
            f"{max_len}; lower max_new_tokens to at most {max(max_len - s, 0)} or shorten the prompts"
        )
    return int(max_new_tokens)


def _check_rope_switch(config: Any, mask: Any, s: int, max_new_tokens: int) -> None:
    """Refuse a generation a longrope model's cache cannot decode as transformers does
    (`zoo.nn.RopeScaling.decode_limit`), for each row's own prompt length (`mask`'s real
    tokens; a traced mask: the padded width `s`)."""
    scaling = rope_scaling_of(config)
    if scaling is None or scaling.kind != "longrope":
        return
    lengths = [s] if isinstance(mask, jax.core.Tracer) else np.asarray(mask).sum(axis=1).tolist()
    # The tightest limit is the longest prompt still within the original context.
    n = max((int(n) for n in lengths if n <= scaling.original_max_len), default=None)
    limit = None if n is None else scaling.decode_limit(n)
    if limit is not None and max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {n} tokens + max_new_tokens {max_new_tokens} passes this model's original context "
            f"({scaling.original_max_len} tokens, where its longrope RoPE switches to its long factors; transformers "
            f"then recomputes every earlier key, which a key/value cache cannot): lower max_new_tokens to at most "
            f"{limit}, or give prompts longer than {scaling.original_max_len} tokens"
        )


def _check_vocabulary(vocab: int, tokens: Any, mask: Any, **ids: int | None) -> None:
    """Refuse a real token (where `mask`, when both are concrete) or an id of `ids` outside
    `[0, vocab)`: the embedding lookup would clamp it (finite, wrong logits)."""
    if not isinstance(tokens, jax.core.Tracer) and not isinstance(mask, jax.core.Tracer):
        real = np.where(np.asarray(mask).astype(bool), np.asarray(tokens), 0)
        check_ids(real, vocab, where="generate", name="tokens")
    for name, value in ids.items():
        if value is not None and not 0 <= int(value) < vocab:
            raise ValueError(f"{name} {value} is outside the model's vocabulary [0, {vocab}); pass an id below {vocab}")


def generate(
    model: Transformer,
    tokens: Int[ArrayLike, "batch prompt"],
    *,
    mask: Bool[ArrayLike, "mask_batch mask_prompt"] | None = None,  # checked against tokens below
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    repetition_penalty: float = 1.0,
    key: PRNGKeyArray | None = None,
    stream: Callable[[np.ndarray], Any] | None = None,
    adapter_names: list[str | int | None] | None = None,
) -> Int[Array, "batch total"]:
    """Continue every prompt by `max_new_tokens` tokens with a decoder and a key/value cache.

    **Arguments:**

    - `model`: a `zoo.models.Transformer` (learned or rotary positions, grouped-query
      attention, LoRA branches merged or not, any compute dtype), on one device or placed
      on a mesh (see below).
    - `tokens`: `[batch, prompt]` integer ids; prompts of different lengths padded on the
      left or on the right (each row's tokens together).
    - `mask`: `[batch, prompt]`, `True` at real tokens, `False` on the padding (default:
      all real). Each row's positions count from its first real token, as transformers'
      `generate` does with left padding; right-padded rows are moved to the left-padded
      layout before the prompt's forward pass, so either padding generates the same tokens
      (the output keeps the prompts as given).
    - `max_new_tokens`: how many tokens to add; `prompt + max_new_tokens` must not exceed
      the model's `max_len`.
    - `temperature`: `0` (default) is greedy decoding; above 0, tokens are drawn from
      `softmax(logits / temperature)` after `top_k` / `top_p` filtering.
    - `top_k`: keep only the `top_k` most likely tokens (sampling only).
    - `top_p`: keep the most likely tokens up to total probability `top_p`, in (0, 1].
    - `eos_token_id`: a row that produced it continues with `pad_token_id`; the loop stops
      early once every row has.
    - `pad_token_id`: what finished rows continue with (default `eos_token_id`).
    - `repetition_penalty`: as transformers' (`RepetitionPenaltyLogitsProcessor`): before
      choosing (greedy or sampled), the logit of every token the row already holds (its
      prompt's real tokens and what it generated) is divided by it where positive and
      multiplied by it where negative; 1 (default) changes nothing, above 1 discourages
      repeats. Padding is not counted (transformers' counts a padded batch's pad id too).
    - `key`: a PRNG key, needed when sampling; the same key gives the same tokens.
    - `stream`: called from the compiled loop (a host callback) with each step's new
      tokens (those the output gets: padding after a row's eos), a numpy `[batch]` array,
      in order, as they are chosen; every call has been made when `generate` returns.
    - `adapter_names`: for a model holding named adapters (`zoo.lora.add_adapter`), the
      adapter of each prompt, as peft's `generate(..., adapter_names=)`: a name,
      `"__base__"` or `None` (the bare base), or an index; the prompt's forward pass and
      every step route each row (`zoo.lora.route`). One compiled program for any mix.
      Without it, every row uses the active adapter (`zoo.lora.set_adapter`).

    Compiled once per batch size, prompt length, `max_new_tokens` and sampling settings
    (a repeated call with the same shapes compiles nothing). On a mesh (under
    `jax.set_mesh`, or a model placed by `zoo.shard`), the batch is split over `data`
    when its size divides, attention heads and the cache over `model` as the parameters'
    layout says (tensor parallelism); parameters split over `data` (FSDP presets) are
    gathered once, before the loop, so each device holds the whole model while decoding.

    **Returns:** int32 `[batch, prompt + max_new_tokens]`, the prompts as given (padding
    included) followed by the new tokens: `out[:, prompt:]` is each row's continuation.
    """
    if not isinstance(model, Transformer):
        raise TypeError(
            f"generate needs a decoder (zoo.models.Transformer), got {type(model).__name__}; encoders do not generate text"
        )
    # Weights holding NaN give NaN logits, whose argmax (token 0) looks like an answer.
    check_finite_once(model, where="zoo.generate's model")
    tokens_np = _tokens_of(tokens)
    b, s = tokens_np.shape
    max_new_tokens = _check_length(max_new_tokens, s, model.config.max_len)
    rows_np = adapter_rows(model, adapter_names, b)
    mask_np = _mask_of(mask, b, s)
    _check_rope_switch(model.config, mask_np, s, max_new_tokens)
    _check_vocabulary(model.config.vocab_size, tokens_np, mask_np, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    prompt_np = tokens_np  # what the output starts with
    tokens_np, mask_np, moved = _left_padded_prompts(tokens_np, mask_np)
    settings = _settings(max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id, repetition_penalty)
    if settings[1] > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass key=jax.random.key(seed)")
    key = None if settings[1] == 0 else key
    run = functools.partial(_run, model, (tokens_np, mask_np, prompt_np, rows_np), moved, key, settings, stream)
    if jax.sharding.get_abstract_mesh().empty and (mesh := _model_mesh(model)) is not None:
        with jax.set_mesh(mesh):
            return run()
    return run()


def _settings(max_new_tokens, temperature, top_k, top_p, eos_token_id, pad_token_id, repetition_penalty) -> tuple:
    """`generate`'s settings, checked, as the compiled program's static argument: greedy
    decoding drops the sampling filters, `pad_token_id` defaults to `eos_token_id` (else 0)."""
    temperature = float(temperature)
    check_sampling(temperature, top_k, top_p, float(repetition_penalty))
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    return (
        max_new_tokens,
        temperature,
        None if temperature == 0 else top_k,
        None if temperature == 0 or top_p == 1 else top_p,
        None if eos_token_id is None else int(eos_token_id),
        int(pad_token_id),
        float(repetition_penalty),
    )


def _run(model, arrays: tuple, moved: bool, key, settings: tuple, stream) -> Array:
    """`generate`'s program on the host arrays `(tokens, mask, prompt, rows)`, placed on
    the current mesh (the batch over `data` when its size divides), streaming in order."""
    tokens_np, mask_np, prompt_np, rows_np = arrays
    mesh = jax.sharding.get_abstract_mesh()
    toks, msk = jnp.asarray(tokens_np, jnp.int32), jnp.asarray(mask_np, bool)
    prompt = jnp.asarray(prompt_np, jnp.int32) if moved else toks
    rows = None if rows_np is None else jnp.asarray(rows_np)
    if not mesh.empty:
        data = mesh.shape.get("data", 1)
        # A data axis of size 1 too: the model's activations are laid out over it, and the
        # cache must be laid out as they are.
        spec = P("data") if "data" in mesh.axis_names and toks.shape[0] % data == 0 else P()
        toks, msk, prompt = (jax.device_put(x, spec) for x in (toks, msk, prompt))
        rows = None if rows is None else jax.device_put(rows, spec)
    if stream is None:
        return _generate_program(model, toks, msk, key, settings, None, prompt, rows)
    _STREAMS[id(stream)] = _InOrder(stream)
    try:
        out = _generate_program(model, toks, msk, key, settings, stream, prompt, rows)
        jax.effects_barrier()  # every token handed over before returning
    finally:
        _STREAMS.pop(id(stream), None)
    return out
