"""zoo.generate: the KV-cached decoder against transformers' generate and the full forward.

References: transformers' GPT-2 (loaded through zoo.hf) and Llama (weights copied by hand
into a Llama-shaped zoo decoder: RoPE, GQA, RMSNorm, SwiGLU, untied head) with
left-padded batches; the model's own full forward pass on every prefix; transformers'
top-k / top-p warpers; the merged LoRA model; one device against dp and tp meshes.
The other families zoo.hf loads: test_family_generate.py.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import (
    assert_as_accurate,
    assert_rounding_close,
    backend_compiles,
    largest,
    noisy,
    preset_mesh,
    save_word_tokenizer,
    tiny_decoder,
    torch_reference,
)
from jax.sharding import PartitionSpec as P

import zoo
from zoo._generate import decode_step, prefill, split_layers
from zoo._sampling import apply_repetition_penalty, filter_logits, seen_tokens
from zoo.nn._cache import KVCache

# Left-padded prompts of lengths 6, 4, 2 and 5.
TOKENS = np.array([[5, 9, 3, 17, 2, 11], [0, 0, 21, 4, 8, 30], [0, 0, 0, 0, 12, 6], [0, 7, 7, 19, 1, 25]], np.int32)
MASK = TOKENS != 0
NEW = 6
# The tiny decoders' float32 sums (helpers.rounding_bound): <= 32 wide (MLP), 2 layers of ~6
# chained sums plus the head: a cached step vs the full forward, merged vs unmerged LoRA.
SUMS = {"terms": 32, "depth": 2 * 6 + 1}
# bfloat16 compute (u = 2^-8, sums accumulated in float32): ~37 roundings in a chain (2
# layers of ~17, the final norm and the head), each of at most the logits' scale, each side.
BF16_BOUND = 2 * (2 * 17 + 3) * 2.0**-8


def _torch(x):
    return torch.from_numpy(np.asarray(x).astype(np.int64))


def _decoder(seed: int, **overrides):
    """`helpers.tiny_decoder(key, **overrides)` drawn on the host: its structure (abstract
    evaluation: nothing runs), weights and embeddings normal(0, init_std), biases zero and
    norm scales one as its initialisation draws them, from numpy's `default_rng(seed)`, put
    on the device. Building it compiles nothing (eagerly, each initialiser compiles for
    each new shape: ~45 programs for the first configuration, ~25 for a new width)."""
    shapes = eqx.filter_eval_shape(tiny_decoder, jax.random.key(0), **overrides)
    rng, std = np.random.default_rng(seed), shapes.config.init_std

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith(".bias"):
            x = np.zeros(leaf.shape)
        elif "norm" in name:
            x = np.ones(leaf.shape)
        else:
            x = std * rng.standard_normal(leaf.shape)
        return jax.device_put(x.astype(leaf.dtype))

    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda p, x: draw(p, x) if is_shape(x) else x, shapes, is_leaf=is_shape)


@pytest.fixture(scope="module")
def gpt2_saved(tmp_path_factory):
    """A tiny random GPT2LMHeadModel, the folder it is saved in, and the same model loaded
    by zoo.hf from there."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=40, n_positions=16, bos_token_id=39, eos_token_id=39
    )
    model = noisy(transformers.GPT2LMHeadModel(config), 0.1)
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory)
    return model, directory, zoo.hf.from_pretrained(directory)


@pytest.fixture(scope="module")
def gpt2(gpt2_saved):
    """A tiny random GPT2LMHeadModel and the same model loaded by zoo.hf."""
    hf, _, model = gpt2_saved
    return hf, model


def _llama_pair(**zoo_overrides):
    """A tiny random LlamaForCausalLM and a zoo decoder holding its weights."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=39, eos_token_id=39, pad_token_id=0,
    )  # fmt: skip
    hf = noisy(transformers.LlamaForCausalLM(config), 0.1)
    zconfig = zoo.models.TransformerConfig(
        vocab_size=40, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=48, max_len=16,
        positions="rope", rope_theta=10000.0, activation="swiglu", norm="rmsnorm", norm_eps=1e-6,
        tie_embeddings=False, use_bias=False, **zoo_overrides,
    )  # fmt: skip
    # The decoder's structure alone (every weight is replaced below, none initialised), the
    # weights put on the device from host arrays: building it compiles nothing.
    model = eqx.filter_eval_shape(zoo.models.Transformer, zconfig, key=jax.random.key(0))
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    layers = range(config.num_hidden_layers)

    def stack(name, transpose=True):
        return jax.device_put(
            np.stack(
                [sd[f"model.layers.{i}.{name}"].T if transpose else sd[f"model.layers.{i}.{name}"] for i in layers]
            )
        )

    blk = model.layers.layers
    model = eqx.tree_at(
        lambda m: (
            m.token_embedding.weight, m.lm_head.weight, m.final_norm.weight,
            m.layers.layers.attention.q_proj.weight, m.layers.layers.attention.k_proj.weight,
            m.layers.layers.attention.v_proj.weight, m.layers.layers.attention.o_proj.weight,
            m.layers.layers.mlp.gate.weight, m.layers.layers.mlp.up.weight, m.layers.layers.mlp.down.weight,
            m.layers.layers.attention_norm.weight, m.layers.layers.mlp_norm.weight,
        ),
        model,
        (
            jax.device_put(sd["model.embed_tokens.weight"]), jax.device_put(sd["lm_head.weight"].T),
            jax.device_put(sd["model.norm.weight"]),
            stack("self_attn.q_proj.weight"), stack("self_attn.k_proj.weight"), stack("self_attn.v_proj.weight"),
            stack("self_attn.o_proj.weight"), stack("mlp.gate_proj.weight"), stack("mlp.up_proj.weight"),
            stack("mlp.down_proj.weight"), stack("input_layernorm.weight", False),
            stack("post_attention_layernorm.weight", False),
        ),
    )  # fmt: skip
    assert blk.attention.q_proj.weight.shape == model.layers.layers.attention.q_proj.weight.shape
    assert not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model))  # every weight copied
    return hf, model


@pytest.fixture(scope="module")
def llama():
    return _llama_pair()


def _hf_greedy(hf, tokens, mask, new):
    hf.generation_config.eos_token_id = None  # no early stop: every row gets `new` tokens
    with torch.no_grad():
        out = hf.generate(
            _torch(tokens), attention_mask=_torch(mask), do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    return out.numpy()


def test_greedy_equals_transformers_gpt2_left_padded(gpt2):
    hf, model = gpt2
    expected = _hf_greedy(hf, TOKENS, MASK, NEW)
    out = np.asarray(zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW))
    assert out.shape == (4, 6 + NEW) and out.dtype == np.int32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "pattern",
    [{}, {"sliding_layers": (False, True, True), "rope_layers": (True, False, True), "rope_thetas": (1e4, 1e4, 1e2)}],
)
def test_sliding_window_cached_logits_equal_full_forward(pattern):
    """A window of 3 on every layer, or on layers 1 and 2 with layer 1 without RoPE and
    layer 2 at another RoPE base: the cached steps (split layers) read the same pattern as
    the scanned forward."""
    model = _decoder(8, max_len=12, sliding_window=3, num_layers=3, **pattern)
    _check_cached_logits(model, TOKENS, MASK, NEW)


# Every span on the global layers; with a window of 3, the span inside a block (18). The span
# decides which blocks a step writes and reads (`KVCache._read_blocks`), the window which
# columns the mask lets each query see (`_causal` over the columns read): neither reads the
# other, and the span inside a block is where both meet (columns read past each row's own,
# masked by position and by the window). Each span is a program of its own (static), twice.
@pytest.mark.parametrize(("window", "spans"), [(None, (18, 20, None)), (3, (18,))])
def test_a_blocked_cache_decodes_as_the_split_cache(window, spans):
    """zoo.serve.Engine's cache: each layer's keys and values in blocks of columns, the
    step writing each row's new column into the block that holds it and reading only the
    blocks that hold the first `span` columns, in place. From any state (random keys,
    values, masks and per-row columns) a step gives the split cache's logits (which reads
    a sliced copy of those columns) and writes the same keys and values."""
    model = _decoder(5, max_len=24, sliding_window=window)
    attention, rows, columns = model.layers.layers.attention, 3, 22
    kvh, hd, layers = attention.num_kv_heads, attention.head_dim, model.config.num_layers
    rng = np.random.default_rng(6)  # drawn on the host: no program per shape

    def normal(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32))

    split = KVCache(
        tuple(normal(rows, kvh, columns, hd) for _ in range(layers)),
        tuple(normal(rows, kvh, hd, columns) for _ in range(layers)),
        jax.device_put(rng.random((rows, columns)) < 0.7),
        jax.device_put(np.array([4, 11, 2], np.int32)),
        jax.device_put(np.array([3, 17, 9], np.int32)),  # each row's next column
    )  # fmt: skip
    blocks = eqx.filter_jit(split_layers)(model)  # one program, not a slice per weight and layer
    step = eqx.filter_jit(decode_step)
    token = jnp.array([1, 7, 30], jnp.int32)
    for span in spans:  # 18: inside a block (its whole block is read); 20: a block's end
        want, after = step(model, token, split, blocks, span)
        got, blocked = step(model, token, split.blocks(4), blocks, span)  # blocks of 4 columns, the last of 2
        assert_rounding_close(np.asarray(got), np.asarray(want), **SUMS)
        # The first layer writes the very same keys and values; the later ones' inputs went
        # through the attention's sums in another order: within the model's rounding bound.
        for i in range(layers):
            check = np.testing.assert_array_equal if i == 0 else functools.partial(assert_rounding_close, **SUMS)
            check(np.concatenate([np.asarray(b) for b in blocked.keys[i]], axis=2), np.asarray(after.keys[i]))
            check(np.concatenate([np.asarray(b) for b in blocked.values[i]], axis=3), np.asarray(after.values[i]))
        np.testing.assert_array_equal(blocked.mask, after.mask)


def test_greedy_equals_transformers_llama_left_padded(llama):
    hf, model = llama
    # The copied weights give transformers' logits, as accurately as transformers' own.
    ref = torch_reference(lambda m: m(_torch(TOKENS[:1])).logits, hf)
    logits = eqx.filter_jit(lambda m, t: m(t))(model, TOKENS[:1])  # one program, not one per operation
    assert_as_accurate(logits, ref, what="llama logits")
    expected = _hf_greedy(hf, TOKENS, MASK, NEW)
    out = np.asarray(zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW))
    np.testing.assert_array_equal(out, expected)


@functools.cache
def _jitted():
    return eqx.filter_jit(prefill), eqx.filter_jit(decode_step), eqx.filter_jit(lambda m, t, k: m(t, mask=k))


def _check_cached_logits(model, tokens, mask, steps, relative=None):
    """Every cached step's logits against the full forward over each row's real tokens.

    The reference is one forward pass over the rows right-padded (positions then count
    from each row's first token, as the cache's do): its logits at a row's column `c`
    are those of the prefix ending there.
    """
    pre, step, full = _jitted()
    logits, cache = pre(model, jnp.asarray(tokens), jnp.asarray(mask), tokens.shape[1] + steps)
    rows = [list(t[m]) for t, m in zip(tokens, mask)]
    cached = []
    for _ in range(steps):
        cached.append(np.asarray(logits))
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        for row, t in zip(rows, np.asarray(nxt)):
            row.append(int(t))
        logits, cache = step(model, nxt, cache)
    width = tokens.shape[1] + steps
    padded = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    ref = np.asarray(
        full(
            model, jnp.asarray(padded), jnp.asarray(np.arange(width)[None] < np.array([len(r) for r in rows])[:, None])
        )
    )
    got, want = [], []
    for r, m in enumerate(mask):
        first = int(m.sum()) - 1  # the column of the prompt's last token
        for t in range(steps):
            got.append(cached[t][r])
            want.append(ref[r, first + t])
    # The same sums in another order (SUMS), or, in bfloat16, `relative` x the largest logit.
    if relative is None:
        assert_rounding_close(np.stack(got), np.stack(want), **SUMS)
    else:
        worst = float(np.abs(np.stack(got) - np.stack(want)).max())
        assert worst <= relative * largest(np.stack(want)), worst
    return cache


@pytest.mark.parametrize(
    "overrides", [{"positions": "learned"}, {"positions": "rope"}, {"embed_scale": 4.0, "activation": "geglu"}]
)
def test_cached_logits_equal_full_forward_at_every_step(overrides):
    model = _decoder(2, max_len=12, **overrides)
    _check_cached_logits(model, TOKENS, MASK, NEW)


def test_bf16_compute_caches_in_bf16_and_follows_the_full_forward():
    model = _decoder(3, max_len=12, dtype="bfloat16")
    cache = _check_cached_logits(model, TOKENS[:2], MASK[:2], 3, BF16_BOUND)
    assert cache.keys.dtype == jnp.bfloat16 and cache.values.dtype == jnp.bfloat16
    out = zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW)
    assert out.shape == (4, 12)


def test_lora_unmerged_equals_merged():
    base = _decoder(4, max_len=12)
    config = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    # add_lora's model, its base weights `base`'s and its A and B drawn on the host (random
    # B: the branches change the output): building it compiles nothing.
    shapes = eqx.filter_eval_shape(zoo.lora.add_lora, base, config, key=jax.random.key(5))
    held = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(base)[0]}
    rng = np.random.default_rng(5)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if name.endswith((".lora_A", ".lora_B")):
            return jax.device_put((0.3 * rng.standard_normal(leaf.shape)).astype(leaf.dtype))
        return held[name.replace(".base.", ".")]

    adapted = jax.tree_util.tree_map_with_path(fill, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    merged = zoo.lora.merge(adapted)
    out = zoo.generate(adapted, TOKENS, mask=MASK, max_new_tokens=NEW)
    np.testing.assert_array_equal(out, zoo.generate(merged, TOKENS, mask=MASK, max_new_tokens=NEW))
    assert not np.array_equal(out, zoo.generate(base, TOKENS, mask=MASK, max_new_tokens=NEW))  # the branches matter
    pre = _jitted()[0]
    a, _ = pre(adapted, jnp.asarray(TOKENS), jnp.asarray(MASK), 12)
    b, _ = pre(merged, jnp.asarray(TOKENS), jnp.asarray(MASK), 12)
    assert_rounding_close(a, b, terms=SUMS["terms"], depth=SUMS["depth"] + 1)  # + merging's rounding of W + sAB


@pytest.fixture(scope="module")
def decoder():
    return _decoder(6, max_len=12)


def _batch8():
    return np.concatenate([TOKENS, TOKENS[::-1]]), np.concatenate([MASK, MASK[::-1]])


@pytest.mark.parametrize("preset", ["dp", "tp", "fsdp"])
def test_sharded_generation_equals_one_device(decoder, preset):
    tokens, mask = _batch8()
    key = jax.random.key(7)
    greedy = zoo.generate(decoder, tokens, mask=mask, max_new_tokens=NEW)
    sample = dict(temperature=1.0, top_k=10, key=key, repetition_penalty=1.5)  # the penalty's ids split like the batch
    sampled = zoo.generate(decoder, tokens, mask=mask, max_new_tokens=NEW, **sample)
    mesh = preset_mesh(preset, 8)
    with jax.set_mesh(mesh):
        placed = zoo.shard(decoder, zoo.rules(preset), mesh)
        out = zoo.generate(placed, tokens, mask=mask, max_new_tokens=NEW)
        np.testing.assert_array_equal(out, greedy)
        assert out.sharding.spec[0] == "data"  # the batch stays split over data
        # Sampling under dp and tp. fsdp's program gathers the parameters before the prompt's
        # pass and then runs dp's on the same mesh (data=8): the same logits, split alike, reach
        # the sampling, so its sampled run is dp's (its gather: the greedy run and the
        # all-gathers counted below).
        if preset != "fsdp":
            out = zoo.generate(placed, tokens, mask=mask, max_new_tokens=NEW, **sample)
            np.testing.assert_array_equal(out, sampled)
        # The arguments as zoo.generate places them (`_run`: the prompt is the tokens).
        toks, msk = jax.device_put(jnp.asarray(tokens), P("data")), jax.device_put(jnp.asarray(mask), P("data"))
        if preset == "tp":  # the cache is split like the heads: kv_heads over model, batch over data
            # Explicit axes: the layout is the output's type, abstract evaluation gives it (no compile).
            _, cache = eqx.filter_eval_shape(prefill, placed, toks, msk, 12)
            assert cache.keys.sharding.spec == P(None, "data", "model", None, None)
        if preset == "fsdp":  # gathered once for decoding: no all-gather inside the decode loop
            from zoo._generate import _generate_program

            # The greedy call's own program (lowered from the same arguments: compiled above).
            settings = (NEW, 0.0, None, None, None, 0, 1.0)
            colls = zoo.collectives(_generate_program.lower(placed, toks, msk, None, settings, None, toks, None))
            assert zoo.count(colls, "all-gather", in_loop=True) == 0 < zoo.count(colls, "all-gather", in_loop=False)
    # Outside set_mesh, a placed model decodes on its own mesh.
    np.testing.assert_array_equal(zoo.generate(placed, tokens, mask=mask, max_new_tokens=NEW), greedy)


def test_a_model_placed_on_one_device_decodes_any_batch(decoder):
    """A model placed on a one-device mesh (a `--devices 1` run's) decodes on it, an odd
    batch too: its activations are laid out over the size-1 data axis, and so is the cache
    (it was not: the first write into it failed)."""
    tokens, mask = _batch8()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    placed = zoo.shard(decoder, zoo.rules("dp"), mesh)
    out = zoo.generate(placed, tokens[:7], mask=mask[:7], max_new_tokens=NEW)
    # One device's tokens for those 7 rows: the 8-row batch's first 7 (each row decodes on its
    # own, its prompt masked and positioned alone; the sharded tests' reference program).
    alone = np.asarray(zoo.generate(decoder, tokens, mask=mask, max_new_tokens=NEW))[:7]
    np.testing.assert_array_equal(out, alone)


def test_seeded_sampling_is_deterministic_and_top_k_1_is_greedy(decoder):
    kw = dict(mask=MASK, max_new_tokens=NEW, temperature=1.0)
    a = zoo.generate(decoder, TOKENS, key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(a, zoo.generate(decoder, TOKENS, key=jax.random.key(1), **kw))
    assert not np.array_equal(a, zoo.generate(decoder, TOKENS, key=jax.random.key(2), **kw))
    greedy = zoo.generate(decoder, TOKENS, mask=MASK, max_new_tokens=NEW)
    np.testing.assert_array_equal(zoo.generate(decoder, TOKENS, key=jax.random.key(1), top_k=1, **kw), greedy)


@pytest.mark.parametrize(("top_k", "top_p"), [(3, None), (None, 0.8), (None, 0.3), (5, 0.6), (1, None)])
def test_top_k_top_p_keep_the_tokens_transformers_keeps(top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(6, 12)).astype(np.float32) * 2
    warpers = [transformers.TemperatureLogitsWarper(0.7)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    ref = torch.from_numpy(logits)
    for w in warpers:
        ref = w(None, ref)
    ours = np.asarray(filter_logits(jnp.asarray(logits), temperature=0.7, top_k=top_k, top_p=top_p))
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref.numpy()))
    kept = np.isfinite(ours)
    assert_rounding_close(ours[kept], ref.numpy()[kept], terms=1, depth=1)  # logits / temperature: one rounding
    if top_k == 1:
        assert (kept.sum(axis=1) == 1).all()
    # Hand-checked on 4 tokens of probability 0.5, 0.25, 0.15, 0.1.
    small = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25]]))
    assert np.isfinite(filter_logits(small, temperature=1.0, top_k=None, top_p=0.7)).tolist() == [
        [False, True, False, True]
    ]
    assert np.isfinite(filter_logits(small, temperature=1.0, top_k=None, top_p=0.8)).tolist() == [
        [False, True, True, True]
    ]
    assert np.isfinite(filter_logits(small, temperature=1.0, top_k=2, top_p=None)).tolist() == [
        [False, True, False, True]
    ]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_processor_on_the_same_logits_and_ids(penalty):
    """The same logits (positive, negative, zero) and ids (repeats, left padding masked out):
    transformers' `RepetitionPenaltyLogitsProcessor`, up to the rounding of its one multiply
    or divide (measured: at most 1 ulp, 2.4e-7 on logits of ~4)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 24)).astype(np.float32) * 3
    logits[:, 5] = 0.0
    ids = rng.integers(0, 24, size=(4, 9)).astype(np.int32)
    ids[0, :3] = [5, 5, 7]
    want = transformers.RepetitionPenaltyLogitsProcessor(penalty)(_torch(ids), torch.from_numpy(logits)).numpy()
    seen = seen_tokens(jnp.asarray(ids), jnp.ones(ids.shape, bool), 24)
    got = np.asarray(apply_repetition_penalty(jnp.asarray(logits), seen, penalty))
    # One rounding each side (XLA may divide as a multiply by 1 / P): within 2u of each value.
    assert (np.abs(got - want) <= 2 * 2.0**-24 * np.abs(want)).all(), np.abs(got - want).max()
    assert np.array_equal(got == logits, want == logits.astype(np.float32))  # the same logits changed
    assert not np.array_equal(got, logits)
    # Padding (mask False) is not a token the row holds.
    masked = np.asarray(seen_tokens(jnp.asarray(ids), jnp.asarray(ids != ids[1, 0]), 24))
    assert not masked[1, ids[1, 0]] and masked.sum() < np.asarray(seen).sum()


def test_generate_with_repetition_penalty_equals_transformers_greedy_and_samples(gpt2):
    """zoo.generate(..., repetition_penalty=P) on unpadded prompts: transformers'
    `generate(repetition_penalty=P)` token for token (greedy); with sampling, the penalty
    changes the draw and the same key repeats it; a bad value is one line."""
    hf, model = gpt2
    tokens = TOKENS[[0, 3], 1:]  # two prompts of 5 real tokens, no padding
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(_torch(tokens), do_sample=False, max_new_tokens=NEW, repetition_penalty=1.8,
                           pad_token_id=0).numpy()  # fmt: skip
    got = np.asarray(zoo.generate(model, tokens, max_new_tokens=NEW, repetition_penalty=1.8))
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.asarray(zoo.generate(model, tokens, max_new_tokens=NEW)))
    kw = dict(max_new_tokens=NEW, temperature=1.0, key=jax.random.key(5), repetition_penalty=3.0)
    np.testing.assert_array_equal(zoo.generate(model, tokens, **kw), zoo.generate(model, tokens, **kw))
    with pytest.raises(ValueError, match=r"repetition_penalty must be a finite number > 0"):
        zoo.generate(model, tokens, max_new_tokens=2, repetition_penalty=0.0)


def test_eos_rows_continue_with_padding(decoder):
    plain = np.asarray(zoo.generate(decoder, TOKENS, mask=MASK, max_new_tokens=NEW))
    eos = int(plain[0, 7])  # row 0's second new token
    out = np.asarray(zoo.generate(decoder, TOKENS, mask=MASK, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=31))
    for row, ref in zip(out, plain):
        new, ref_new = row[6:], ref[6:]
        hits = np.flatnonzero(ref_new == eos)
        end = hits[0] + 1 if hits.size else NEW
        np.testing.assert_array_equal(new[:end], ref_new[:end])
        assert (new[end:] == 31).all()
    assert (out[0, 8:] == 31).all()


def test_compiles_once_per_shape_and_never_on_a_repeat(decoder):
    with backend_compiles() as names:
        kw = dict(mask=MASK[:, 2:], max_new_tokens=5)
        zoo.generate(decoder, TOKENS[:, 2:], **kw)
        first = sum("_generate_program" in n for n in names)
        zoo.generate(decoder, TOKENS[:, 2:] + 1, **kw)  # new values, same shapes
        zoo.generate(decoder, TOKENS[::-1, 2:], **kw)
        repeat = sum("_generate_program" in n for n in names) - first
    assert first == 1 and repeat == 0, names


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=7), "exceeds the model's max_len 12; lower max_new_tokens to at most 6"),
        (dict(max_new_tokens=2, mask=MASK[:, 1:]), "mask has shape (4, 5) but tokens have (4, 6)"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature must be >= 0"),
        (dict(max_new_tokens=2, temperature=1.0, top_p=0.0, key=jax.random.key(0)), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=2, temperature=1.0, top_p=1.5, key=jax.random.key(0)), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=2, temperature=1.0), "needs a PRNG key: pass key=jax.random.key(seed)"),
        (dict(max_new_tokens=2, mask=MASK & (np.arange(6) != 3)), "mask row 0 has padding (False) between its real"),
        (dict(max_new_tokens=2, mask=np.zeros((4, 6), bool)), "mask row 0 has no real token"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        # Ids outside the vocabulary: clamped by the lookup (finite, wrong logits) before.
        (dict(max_new_tokens=2, tokens=np.where(np.arange(24).reshape(4, 6) == 4, 32, TOKENS)),
         "generate: tokens holds 32 at position (0, 4), outside [0, 32) (1 such in all); pass ids from 0 to 31"),
        (dict(max_new_tokens=2, tokens=-TOKENS), "generate: tokens holds -5 at position (0, 0), outside [0, 32)"),
        (dict(max_new_tokens=2, eos_token_id=32), "eos_token_id 32 is outside the model's vocabulary [0, 32)"),
        (dict(max_new_tokens=2, pad_token_id=-1), "pad_token_id -1 is outside the model's vocabulary [0, 32)"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_fix(decoder, kwargs, message):
    kwargs = {"tokens": TOKENS} | kwargs
    with pytest.raises(ValueError) as info:
        zoo.generate(decoder, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_right_padded_prompts_generate_the_left_padded_tokens(decoder):
    """Prompts padded on the right (a tokenizer's default) generate, token for token, what
    the same prompts padded on the left do, greedy and sampled (the shapes and settings of
    the calls above: one compiled program each); the output starts with the prompts as
    given. Padding on both sides, the tokens together, reads the same."""
    right = np.stack([np.concatenate([t[m], t[~m]]) for t, m in zip(TOKENS, MASK)])
    assert not np.array_equal(right, TOKENS) and (right[:, 0] != 0).all()
    for kw in (dict(max_new_tokens=NEW), dict(max_new_tokens=NEW, temperature=1.0, key=jax.random.key(1))):
        left_out = np.asarray(zoo.generate(decoder, TOKENS, mask=MASK, **kw))
        right_out = np.asarray(zoo.generate(decoder, right, mask=right != 0, **kw))
        np.testing.assert_array_equal(right_out[:, 6:], left_out[:, 6:])
        np.testing.assert_array_equal(right_out[:, :6], right)
    # Rows 1-3: one pad moved to the right; row 0 (no padding) as it is: the shape and
    # settings of the greedy call above, its program.
    both = np.concatenate([TOKENS[:1], np.roll(TOKENS[1:], -1, axis=1) * (np.arange(6) < 5)])
    both_out = np.asarray(zoo.generate(decoder, both, mask=both != 0, max_new_tokens=NEW))
    left_out = np.asarray(zoo.generate(decoder, TOKENS, mask=MASK, max_new_tokens=NEW))
    np.testing.assert_array_equal(both_out[:, 6:], left_out[:, 6:])


@pytest.mark.parametrize("preset", [None, "tp"])
def test_stream_sees_every_new_token_in_order(decoder, preset):
    seen = []
    model = decoder if preset is None else zoo.shard(decoder, zoo.rules(preset), preset_mesh(preset, 8))
    out = zoo.generate(model, TOKENS[:2], mask=MASK[:2], max_new_tokens=NEW, stream=lambda t: seen.append(t.copy()))
    np.testing.assert_array_equal(np.stack(seen, axis=1), np.asarray(out)[:, 6:])


# --- the command ------------------------------------------------------------------------------

WORDS = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(38)]


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(gpt2_saved):
    """The tiny GPT-2's folder with a word-level tokenizer.json over its 40 ids written beside
    its weights (not saved and loaded again: the folder's model, as zoo.hf loaded it)."""
    _, directory, model = gpt2_saved
    save_word_tokenizer(WORDS, directory)
    return directory, model, zoo.hf.Tokenizer.from_pretrained(directory)


def _zoo(*args):
    """`zoo ARGS` in this process (the CLI's own entry; the process is not what these tests
    check): the result as `subprocess.run` gives it."""
    import subprocess

    from helpers import zoo_main

    rc, out, err = zoo_main(*args)
    return subprocess.CompletedProcess(args, rc, out, err)


def _left_padded(tokenizer, texts):
    batch = tokenizer(texts, padding_side="left")
    return batch["tokens"], batch["mask"]


def test_cli_streams_one_prompt_as_the_library_generates_it(gpt2_with_tokenizer):
    directory, model, tokenizer = gpt2_with_tokenizer
    prompt = "w3 w14 w7 w22"
    done = _zoo("generate", directory, "--prompt", prompt, "--max-new-tokens", 8)
    assert done.returncode == 0, done.stderr
    tokens, _ = _left_padded(tokenizer, [prompt])
    ids = np.asarray(zoo.generate(model, tokens, max_new_tokens=8))[0, 4:]
    ids = ids[: list(ids).index(39)] if 39 in ids else ids  # config.json's eos ends the text
    assert done.stdout == prompt + tokenizer.decode(ids) + "\n"
    assert "greedy" in done.stderr and "tokenizer.json" in done.stderr


def test_cli_samples_a_left_padded_batch_like_the_library(gpt2_with_tokenizer):
    directory, model, tokenizer = gpt2_with_tokenizer
    prompts = ["w3 w14 w7 w22", "w9"]
    args = ["--max-new-tokens", 6, "--temperature", 0.9, "--top-k", 12, "--top-p", 0.95, "--seed", 4]
    done = _zoo("generate", directory, "--prompt", prompts[0], "--prompt", prompts[1], *args, "--json",
                "--devices", 2, "--mesh", "data=2")  # fmt: skip
    assert done.returncode == 0, done.stderr
    tokens, mask = _left_padded(tokenizer, prompts)
    assert tokens.tolist() == [[5, 16, 9, 24], [0, 0, 0, 11]]
    kw = dict(max_new_tokens=6, temperature=0.9, top_k=12, top_p=0.95, eos_token_id=39, key=jax.random.key(4))
    out = np.asarray(zoo.generate(model, tokens, mask=mask, **kw))
    right = tokenizer(prompts)  # the tokenizer's default: padded on the right, the same tokens
    assert right["tokens"].tolist() == [[5, 16, 9, 24], [11, 0, 0, 0]]
    np.testing.assert_array_equal(
        np.asarray(zoo.generate(model, right["tokens"], mask=right["mask"], **kw))[:, 4:], out[:, 4:]
    )
    expected = []
    for p, row in zip(prompts, out):
        ids = [int(i) for i in row[4:]]
        expected.append({"prompt": p, "completion": tokenizer.decode(ids[: ids.index(39)] if 39 in ids else ids)})
    import json

    assert json.loads(done.stdout) == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--max-new-tokens", 20],
            "--max-new-tokens 20: the longest prompt has 2 tokens and the model's max_len is 16; use --max-new-tokens 14 or less",
        ),
        (["--temperature", 1, "--top-p", 2], "top_p must be in (0, 1]"),
        (["--adapter", "/nonexistent"], "--adapter /nonexistent: no adapter_config.json there"),
        (["--repetition-penalty", 0], "repetition_penalty must be a finite number > 0"),
        (["--stop", ""], "--stop: a stop string is empty"),
        (["--chat"], "has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json)"),
    ],
)
def test_cli_errors_are_one_line(gpt2_with_tokenizer, extra, message):
    from test_cli import one_line_error, zoo_main

    rc, _, err = zoo_main("generate", gpt2_with_tokenizer[0], "--prompt", "w1 w2", *extra)
    one_line_error(rc, err, message)


def test_cli_refuses_weights_holding_nan_with_exit_1(gpt2, tmp_path):
    """A NaN in a weight: zoo generate printed argmax-of-NaN tokens and exited 0 before."""
    from test_cli import one_line_error, zoo_main

    hf, _ = gpt2
    hf.save_pretrained(tmp_path)
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("mlp.c_fc.weight"))
    tensors[name][0, 0] = np.nan
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds NaN or inf \(1 of its \d+ values\)"):
        zoo.hf.from_pretrained(tmp_path)
    rc, out, err = zoo_main("generate", tmp_path, "--prompt", "x", "--max-new-tokens", 2)
    one_line_error(rc, err, f"SOURCE {tmp_path}: {tmp_path}: the weight model.", code=1)
    assert "holds NaN or inf" in err and out == ""


def test_model_call_refuses_ids_outside_the_vocabulary(decoder):
    """Where the ids are concrete (host numpy, an eager array), before the lookup clamps them."""
    for tokens, message in [
        (TOKENS + 20, "Embedding of 32 rows: ids holds 37 at position (0, 3), outside [0, 32) (6 such in all)"),
        (jnp.asarray(TOKENS - 1), "Embedding of 32 rows: ids holds -1 at position (1, 0), outside [0, 32)"),
    ]:
        with pytest.raises(ValueError) as info:
            decoder(tokens)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert np.isfinite(np.asarray(jax.jit(lambda m, t: m(t))(decoder, TOKENS + 20))).all()  # jit: checks off


def test_cli_refuses_what_is_not_a_decoder_source(tmp_path):
    from test_cli import one_line_error, zoo_main

    rc, _, err = zoo_main("generate", tmp_path, "--prompt", "x")
    one_line_error(rc, err, "neither a Hugging Face model folder")


def test_cli_help_lists_every_flag():
    from zoo._cli._main import build_parsers

    parser = build_parsers()[1]["generate"]
    text = " ".join(parser.format_help().split())
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    assert {"--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--adapter", "--devices",
            "--mesh", "--rules", "--chat", "--chat-template", "--stop", "--repetition-penalty"} <= set(flags)  # fmt: skip
    assert all(flag in text for flag in flags) and "generate" in " ".join(build_parsers()[0].format_help().split())


def test_padded_vocabulary_rows_are_never_generated():
    model = _decoder(9, max_len=12, vocab_multiple=12)  # 32 ids in 36 rows
    assert model.lm_head.weight.shape[1] == 36
    # Padding columns that would win every argmax and draw if they were not masked.
    head = np.array(model.lm_head.weight)
    head[:, 32:] = 10.0  # on the host: no program
    model = eqx.tree_at(lambda m: m.lm_head.weight, model, jax.device_put(head))
    greedy = np.asarray(zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW))
    sampled = np.asarray(
        zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW, temperature=2.0, key=jax.random.key(0))
    )
    assert greedy[:, 6:].max() < 32 and sampled[:, 6:].max() < 32
    hidden = jax.device_put(np.random.default_rng(1).standard_normal((2, 1, 16), np.float32))
    logits = np.asarray(eqx.filter_jit(lambda m, h: m.head(h))(model, hidden))  # one program, not one per operation
    assert (logits[..., 32:] == np.finfo(np.float32).min).all() and np.isfinite(logits[..., :32]).all()
