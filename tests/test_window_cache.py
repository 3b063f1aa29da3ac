"""zoo.generate's decode loop keeps a sliding layer's window only: a ring of `window` columns.

References: the split cache of every column (the path before rings), step by step, its
logits and keys; the loop's carried arrays (the compiled program's `while`); one device
against dp and tp meshes. transformers' greedy tokens past the window (Mistral, Qwen2,
SmolLM3, Gemma 2, Gemma 3: windows of 3 under prompts of 2-6 tokens and 6 new ones, left
padded) are test_family_generate.py's `test_greedy_equals_transformers_loaded_through_zoo_hf`
(and Gemma 3 under dp, fsdp and tp), whose decode loop now runs these rings.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_rounding_close, preset_mesh, tiny_decoder

import zoo
from zoo._generate import _generate_program, decode_cache, decode_step, prefill, split_layers
from zoo.nn._cache import KVCache, empty_cache

# Left-padded prompts of lengths 6, 4, 2 and 5: a window of 3 bites within them.
TOKENS = np.array([[5, 9, 3, 17, 2, 11], [0, 0, 21, 4, 8, 30], [0, 0, 0, 0, 12, 6], [0, 7, 7, 19, 1, 25]], np.int32)
MASK = TOKENS != 0
NEW, WINDOW = 6, 3
SUMS = {"terms": 32, "depth": 3 * 6 + 1}  # 3 layers of ~6 chained float32 sums plus the head


@functools.cache
def _model():
    """Layers 0 and 2 slide (window 3), layer 1 is global."""
    return tiny_decoder(
        jax.random.key(8), max_len=12, num_layers=3, sliding_window=WINDOW, sliding_layers=(True, False, True)
    )


def _while_carries(jaxpr, every: bool = False) -> list[tuple]:
    """The shapes every `while` loop in `jaxpr` (and the programs it calls) carries; with
    `every`, the shapes of every value computed."""
    shapes = []
    for eqn in jaxpr.eqns:
        if every or eqn.primitive.name == "while":
            shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += _while_carries(inner, every)
    return shapes


def test_the_decode_loop_carries_a_ring_of_window_columns_for_each_sliding_layer():
    model, (b, s) = _model(), TOKENS.shape
    settings = (NEW, 0.0, None, None, None, 0, 1.0)
    program = functools.partial(_generate_program.__wrapped__, settings=settings, stream=None, key=None)  # unjitted
    jaxpr = eqx.filter_make_jaxpr(program)(model, jnp.asarray(TOKENS), jnp.asarray(MASK))[0].jaxpr
    carries = _while_carries(jaxpr)
    kvh, hd = model.config.kv_heads, model.config.d_model // model.config.num_heads
    # Keys [batch, kv_heads, columns, head_dim], values [batch, kv_heads, head_dim, columns].
    assert carries.count((b, kvh, WINDOW, hd)) == 2 and carries.count((b, kvh, hd, WINDOW)) == 2, carries
    assert carries.count((b, kvh, s + NEW, hd)) == 1 and carries.count((b, kvh, hd, s + NEW)) == 1, carries
    # The prompt's pass fills a cache of the prompt's own columns: no layer's stack of
    # prompt + new columns anywhere in the program (only the global layer grows to them).
    every = _while_carries(jaxpr, every=True)
    layers = model.config.num_layers
    assert (layers, b, kvh, s + NEW, hd) not in every and (layers, b, kvh, s, hd) in every


def test_ring_steps_give_the_full_cache_logits_and_hold_its_window():
    """From the same prefill, steps on the rings and on every column give the same logits
    (float32 sums in another order) and tokens; slot `j` of a ring holds the window's
    column `c = j (mod window)` as the full cache holds it (layer 0: bit for bit)."""
    model, columns = _model(), TOKENS.shape[1] + NEW
    pre, step = eqx.filter_jit(prefill), eqx.filter_jit(decode_step)
    logits, cache = pre(model, jnp.asarray(TOKENS), jnp.asarray(MASK), columns)
    _, prompt = pre(model, jnp.asarray(TOKENS), jnp.asarray(MASK), TOKENS.shape[1])  # the prompt's own columns
    full, ring, blocks = cache.split(), decode_cache(model, prompt, columns), split_layers(model)
    assert [k.shape[2] for k in ring.keys] == [WINDOW, columns, WINDOW]
    ring_logits = logits
    for _ in range(NEW - 1):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        np.testing.assert_array_equal(jnp.argmax(ring_logits, axis=-1), token)
        logits, full = step(model, token, full, blocks)
        ring_logits, ring = step(model, token, ring, blocks)
        assert_rounding_close(np.asarray(ring_logits), np.asarray(logits), **SUMS)
    last = columns - 2  # the last column written
    held = np.array([c for j in range(WINDOW) for c in range(last - WINDOW + 1, last + 1) if c % WINDOW == j])
    for layer in (0, 2):  # slot j holds column c = j (mod window), the window's latest
        want = full.keys[layer][:, :, held]
        check = np.testing.assert_array_equal if layer == 0 else functools.partial(assert_rounding_close, **SUMS)
        check(np.asarray(ring.keys[layer]), np.asarray(want))


def test_global_layers_and_short_generations_keep_every_column():
    """A window at least the cache's columns needs no ring: the split cache as it was."""
    model = tiny_decoder(jax.random.key(9), max_len=12, sliding_window=12)
    _, cache = prefill(model, jnp.asarray(TOKENS), jnp.asarray(MASK), TOKENS.shape[1])
    assert [k.shape[2] for k in decode_cache(model, cache, TOKENS.shape[1] + NEW).keys] == [12, 12]


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_sharded_ring_generation_equals_one_device(preset):
    model = _model()
    tokens, mask = np.concatenate([TOKENS, TOKENS[::-1]]), np.concatenate([MASK, MASK[::-1]])
    greedy = zoo.generate(model, tokens, mask=mask, max_new_tokens=NEW)
    mesh = preset_mesh(preset, 8)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules(preset), mesh)
        np.testing.assert_array_equal(zoo.generate(placed, tokens, mask=mask, max_new_tokens=NEW), greedy)


def test_a_ring_with_a_column_per_row_steps_as_every_column():
    """Each row at its own column (`index` `[batch]`, as `zoo.serve.Engine`'s slots): from
    any state (random keys, values and masks), a step over rings holding each row's last
    `window` columns gives the logits of the step over every column."""
    model = tiny_decoder(jax.random.key(5), max_len=24, sliding_window=WINDOW)
    attention, rows, columns = model.layers.layers.attention, 3, 22
    kvh, hd, layers = attention.num_kv_heads, attention.head_dim, model.config.num_layers
    draws = jax.random.split(jax.random.key(6), 2 * layers + 1)
    index = jnp.array([3, 17, 1], jnp.int32)  # each row's next column (row 2: one written)
    full = KVCache(
        tuple(jax.random.normal(draws[i], (rows, kvh, columns, hd)) for i in range(layers)),
        tuple(jax.random.normal(draws[layers + i], (rows, kvh, hd, columns)) for i in range(layers)),
        jax.random.bernoulli(draws[-1], 0.7, (rows, columns)),
        jnp.array([4, 11, 1], jnp.int32),
        index,
    )  # fmt: skip
    last = np.asarray(index)[:, None] - 1
    held = np.clip(last - (last - np.arange(WINDOW)) % WINDOW, 0, None)  # slot j: column j (mod window)
    ring = full.holding(
        tuple(jnp.take_along_axis(k, jnp.asarray(held)[:, None, :, None], axis=2) for k in full.keys),
        tuple(jnp.take_along_axis(v, jnp.asarray(held)[:, None, None, :], axis=3) for v in full.values),
    )
    blocks, step, token = split_layers(model), eqx.filter_jit(decode_step), jnp.array([1, 7, 30], jnp.int32)
    want, _ = step(model, token, full, blocks)
    got, after = step(model, token, ring, blocks)
    assert_rounding_close(np.asarray(got), np.asarray(want), terms=32, depth=2 * 6 + 1)
    assert after.keys[0].shape[2] == WINDOW


def test_the_engine_keeps_a_ring_for_each_sliding_layer():
    """zoo.serve.Engine's blocked cache: a sliding layer holds one ring of `window` columns,
    a global one every column, and `cache_bytes` (the memory check) counts what it holds.
    (test_serve.py's `test_the_engine_serves_each_architecture_as_it_generates` serves
    requests past these windows against zoo.generate and the full forward.)"""
    from zoo.serve import Engine
    from zoo.serve._limits import cache_bytes

    model = _model()
    engine = Engine(model, slots=2, max_len=12)
    cache = engine._cache
    assert [[b.shape[2] for b in k] for k in cache.keys] == [[WINDOW], [12], [WINDOW]]
    assert [[b.shape[3] for b in v] for v in cache.values] == [[WINDOW], [12], [WINDOW]]
    held = sum(x.nbytes for x in jax.tree.leaves((cache.keys, cache.values)))
    assert cache_bytes(model.config, 2, 12) == held + 3 * 4 * 2 * model.config.vocab_size


def test_splitting_a_long_cache_into_blocks_compiles_once_per_block_size():
    """`KVCache.blocks` compiles a program per block shape, not one per block: as many
    for 64 blocks a layer as for 32 (an engine with a long `max_len` once compiled
    thousands, each holding memory mappings)."""
    from helpers import backend_compiles

    counts = []
    for columns in (2048, 4096):
        cache = empty_cache(_model().layers.layers.attention, 3, 2, columns, jnp.float32, jnp.zeros((2, 1), jnp.int32))
        with backend_compiles() as names:
            blocked = cache.split().blocks()
        assert len(blocked.keys[0]) == columns // 64
        counts.append(len(names))
    assert counts[0] == counts[1] < 32, counts
