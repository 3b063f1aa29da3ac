"""Transformer building blocks and models against direct reference formulas, on one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import lm_batch, max_abs_diff, tiny_decoder, tiny_encoder_classifier

import zoo
from zoo.models import Encoder, EncoderConfig, Transformer, TransformerConfig


def np_rope(x, theta=10000.0):
    """Rotate pair (i, i + d/2) of each position p by p · theta^(-2i/d), one element at a time."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    d = x.shape[-1]
    for p in range(x.shape[1]):
        for i in range(d // 2):
            angle = p * theta ** (-2 * i / d)
            a, b = x[:, p, ..., i], x[:, p, ..., i + d // 2]
            out[:, p, ..., i] = a * np.cos(angle) - b * np.sin(angle)
            out[:, p, ..., i + d // 2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def np_attention(attn, x, mask=None):
    """Multi-head attention written head by head in numpy, keys/values shared by head groups."""
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def proj(lin):
        return x @ np.asarray(lin.weight, np.float64) + np.asarray(lin.bias, np.float64)

    q = proj(attn.q_proj).reshape(b, s, h, hd)
    k = proj(attn.k_proj).reshape(b, s, kvh, hd)
    v = proj(attn.v_proj).reshape(b, s, kvh, hd)
    if attn.rope_theta is not None:
        q, k = np_rope(q, attn.rope_theta), np_rope(k, attn.rope_theta)
    out = np.zeros((b, s, h, hd))
    for bi in range(b):
        for head in range(h):
            kv = head // (h // kvh)  # HF's repeat_kv: query head h reads kv head h // groups
            scores = q[bi, :, head] @ k[bi, :, kv].T / np.sqrt(hd)
            allowed = np.ones((s, s), bool)
            if attn.causal:
                allowed &= np.tril(np.ones((s, s), bool))
            if mask is not None:
                allowed &= np.asarray(mask[bi], bool)[None, :]
            scores = np.where(allowed, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[bi, :, head] = probs @ v[bi, :, kv]
    return out.reshape(b, s, h * hd) @ np.asarray(attn.o_proj.weight, np.float64) + np.asarray(attn.o_proj.bias)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rope", [None, 10000.0])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_matches_reference(causal, rope, kv_heads):
    k1, k2 = jax.random.split(jax.random.key(0))
    attn = zoo.nn.Attention(16, 4, num_kv_heads=kv_heads, causal=causal, rope_theta=rope, init_std=0.3, key=k1)
    x = jax.random.normal(k2, (2, 6, 16))
    mask = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    expected = np_attention(attn, x, mask)
    got = attn(x, mask=mask)
    # Rows of fully masked queries are arbitrary (no key allowed); compare the real ones.
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


def test_rope_matches_formula_and_depends_on_relative_position():
    x = jax.random.normal(jax.random.key(0), (1, 7, 2, 8))
    cos, sin = zoo.nn.rope_tables(7, 8)
    np.testing.assert_allclose(np.asarray(zoo.nn.apply_rope(x, cos, sin)), np_rope(x), rtol=1e-5, atol=1e-6)
    # <rope(q, m), rope(k, n)> depends only on m - n.
    q = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (8,)), (1, 7, 1, 8))
    k = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (8,)), (1, 7, 1, 8))
    rq, rk = zoo.nn.apply_rope(q, cos, sin)[0, :, 0], zoo.nn.apply_rope(k, cos, sin)[0, :, 0]
    dots = rq @ rk.T
    for offset in range(-3, 4):
        diag = np.diagonal(np.asarray(dots), offset)
        np.testing.assert_allclose(diag, diag[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_decoder_is_causal(positions):
    model = tiny_decoder(jax.random.key(0), positions=positions)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    forward = jax.jit(lambda t: model(t))
    logits = forward(tokens)
    for t in range(7):
        changed = tokens.at[:, t + 1].set((tokens[:, t + 1] + 5) % 32)
        new_logits = forward(changed)
        np.testing.assert_array_equal(np.asarray(new_logits[:, : t + 1]), np.asarray(logits[:, : t + 1]))
        assert not np.allclose(new_logits[:, t + 1], logits[:, t + 1])


def test_encoder_ignores_padding():
    encoder = Encoder(
        EncoderConfig(vocab_size=32, d_model=16, num_heads=4, num_layers=2, max_len=10), key=jax.random.key(0)
    )
    tokens = jnp.array([[5, 6, 7, 8, 0, 0, 0, 0], [9, 3, 4, 2, 11, 12, 0, 0]])
    mask = tokens != 0
    forward = jax.jit(lambda t, m: encoder(t, mask=m))
    hidden = forward(tokens, mask)
    # Other ids at padded positions (still masked) change nothing at real positions.
    noisy = jnp.where(mask, tokens, 17)
    hidden_noisy = forward(noisy, mask)
    np.testing.assert_allclose(
        np.asarray(hidden_noisy)[np.asarray(mask)], np.asarray(hidden)[np.asarray(mask)], atol=1e-6
    )
    # Mean pooling sees only real tokens: more padding, same sentence embedding.
    longer = jnp.pad(tokens, ((0, 0), (0, 2)))
    pooled = zoo.models.mean_pool(hidden, mask)
    pooled_longer = zoo.models.mean_pool(jax.jit(lambda t: encoder(t))(longer), longer != 0)
    np.testing.assert_allclose(np.asarray(pooled_longer), np.asarray(pooled), atol=1e-5)


def test_feedforward_and_blocks_match_formulas():
    key = jax.random.key(0)
    x = jax.random.normal(key, (2, 3, 8))
    ff = zoo.nn.FeedForward(8, 16, activation="swiglu", init_std=0.3, key=key)

    def lin(layer, h):
        return h @ layer.weight + layer.bias

    swiglu = lin(ff.down, jax.nn.silu(lin(ff.gate, x)) * lin(ff.up, x))
    np.testing.assert_allclose(ff(x), swiglu, rtol=1e-5, atol=1e-6)
    ff_gelu = zoo.nn.FeedForward(8, 16, activation="gelu", init_std=0.3, key=key)
    np.testing.assert_allclose(
        ff_gelu(x), lin(ff_gelu.down, jax.nn.gelu(lin(ff_gelu.up, x), approximate=False)), rtol=1e-5, atol=1e-6
    )

    attn = zoo.nn.Attention(8, 2, init_std=0.3, key=key)
    ln1, ln2 = zoo.nn.LayerNorm(8), zoo.nn.LayerNorm(8)
    pre = zoo.nn.TransformerBlock(attn, ff, ln1, ln2, pre_norm=True)
    post = zoo.nn.TransformerBlock(attn, ff, ln1, ln2, pre_norm=False)
    h = x + attn(ln1(x))
    np.testing.assert_allclose(pre(x), h + ff(ln2(h)), rtol=1e-5, atol=1e-6)
    h = ln1(x + attn(x))
    np.testing.assert_allclose(post(x), ln2(h + ff(h)), rtol=1e-5, atol=1e-6)


def test_dropout_follows_each_examples_key():
    """An example's dropout mask comes from its own key: it does not depend on which other
    examples share its batch (so splitting over devices/microbatches changes nothing)."""
    model = tiny_encoder_classifier(jax.random.key(0), dropout=0.3, attention_dropout=0.2)
    batch = lm_batch(jax.random.key(1), 6)
    keys = zoo.nn.example_keys(jax.random.key(2), 6)
    forward = jax.jit(lambda t, k: model(t, key=k))
    full = forward(batch["tokens"], keys)
    half = forward(batch["tokens"][3:], keys[3:])
    np.testing.assert_allclose(full[3:], half, rtol=1e-5, atol=1e-6)
    # Other keys, other masks: the output follows the keys (not one fixed mask).
    other = forward(batch["tokens"], zoo.nn.example_keys(jax.random.key(3), 6))
    assert not np.allclose(full, other)
    # Without keys dropout is off: the same weights with rates 0 (an independent model,
    # in which dropout cannot act) give the same outputs, and differ from training's.
    inference = jax.jit(lambda t: model(t))(batch["tokens"])
    no_dropout = tiny_encoder_classifier(jax.random.key(0), dropout=0.0, attention_dropout=0.0)
    assert max_abs_diff(no_dropout, model) == 0  # the rates are static: the weights are the same
    np.testing.assert_allclose(inference, jax.jit(lambda t: no_dropout(t))(batch["tokens"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        inference, jax.jit(lambda t, k: no_dropout(t, key=k))(batch["tokens"], keys), rtol=1e-6, atol=1e-6
    )
    assert not np.allclose(full, inference)
    # A wrong number of keys is refused: by jaxtyping here; the library's own message
    # (without runtime type checks) is tests/test_errors.py's.
    with pytest.raises(jaxtyping.TypeCheckError):
        zoo.nn.dropout(jnp.ones((4, 3)), 0.5, keys[:2])


def test_dropout_zeroes_a_fraction_and_rescales_the_rest():
    """`dropout(x, 0.25, keys)`: each element is 0 or x / 0.75, about a quarter zeros, an
    independent mask per example and per key."""
    x = jnp.ones((64, 256))
    keys = zoo.nn.example_keys(jax.random.key(0), 64)
    out = np.asarray(jax.jit(zoo.nn.dropout, static_argnums=1)(x, 0.25, keys))
    assert set(np.unique(out).tolist()) <= {0.0, np.float32(1 / 0.75)}
    dropped = (out == 0).mean()
    assert 0.23 < dropped < 0.27, dropped  # 16,384 draws: 0.25 ± 0.02 is 6 standard deviations
    assert len({row.tobytes() for row in out}) == 64  # no two examples share a mask
    again = np.asarray(zoo.nn.dropout(x, 0.25, zoo.nn.example_keys(jax.random.key(1), 64)))
    assert (again != out).mean() > 0.25  # another key, another mask
    np.testing.assert_array_equal(zoo.nn.dropout(x, 0.25, None), x)


def test_tied_head_is_the_embedding_and_remat_changes_nothing():
    tied = tiny_decoder(jax.random.key(0), tie_embeddings=True)
    assert tied.lm_head is None
    h = jnp.ones((1, 1, 16))
    np.testing.assert_allclose(
        tied.token_embedding.attend(h)[0, 0], tied.token_embedding.weight @ jnp.ones(16), rtol=1e-5
    )
    batch = lm_batch(jax.random.key(1), 4)

    def grads(model):
        return eqx.filter_grad(lambda m: zoo.models.next_token_loss(m, batch)[0].sum())(model)

    remat = tiny_decoder(jax.random.key(0), remat="nothing_saveable")
    plain = tiny_decoder(jax.random.key(0))
    # (The configs differ in `remat`, a static field, so compare the leaves.)
    assert max_abs_diff(grads(remat), grads(plain)) < 1e-6


def test_mixed_precision_computes_in_bf16_keeps_f32_params_and_grads():
    f32 = tiny_decoder(jax.random.key(0))
    bf16 = tiny_decoder(jax.random.key(0), dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(bf16, eqx.is_array)))
    batch = lm_batch(jax.random.key(1), 4)
    jaxpr = jax.make_jaxpr(lambda m: m(batch["tokens"]))(bf16)
    assert "bf16" in str(jaxpr)  # activations really run in bfloat16
    logits = bf16(batch["tokens"])
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, f32(batch["tokens"]), atol=0.1)

    def grads(model):
        return eqx.filter_grad(lambda m: zoo.models.next_token_loss(m, batch)[0].sum())(model)

    g16, g32 = grads(bf16), grads(f32)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
    assert max_abs_diff(g16, g32) < 0.1 * max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g32))


def test_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="num_kv_heads .3. must divide num_heads .4."):
        TransformerConfig(vocab_size=8, d_model=16, num_heads=4, num_kv_heads=3, num_layers=1)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TransformerConfig(vocab_size=8, d_model=10, num_heads=4, num_layers=1)
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerConfig(vocab_size=8, d_model=16, num_heads=4, num_layers=1, activation="tanh")
    with pytest.raises(ValueError, match="unknown TransformerConfig keys \\['heads'\\]"):
        TransformerConfig.from_dict({"vocab_size": 8, "d_model": 16, "heads": 4, "num_layers": 1})
    model = tiny_decoder(jax.random.key(0))
    with pytest.raises(ValueError, match="exceeds the model's max_len 8"):
        model(jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(jaxtyping.TypeCheckError):
        model(jnp.zeros((1, 4, 2), jnp.int32))


def test_config_round_trips_through_a_dict():
    config = TransformerConfig(vocab_size=8, d_model=16, num_heads=4, num_layers=1, positions="rope")
    assert TransformerConfig.from_dict(config.to_dict()) == config
    assert Transformer(config, key=jax.random.key(0)).config == config


def test_logical_axes_of_the_models():
    model = tiny_decoder(jax.random.key(0), tie_embeddings=False)
    axes = zoo.logical_axes(model)
    attn = axes.layers.layers.attention
    assert attn.q_proj.weight.names == ("layers", "embed", "heads")
    assert attn.k_proj.weight.names == ("layers", "embed", "kv_heads")
    assert attn.o_proj.weight.names == ("layers", "heads", "embed")
    assert axes.layers.layers.mlp.down.weight.names == ("layers", "mlp", "embed")
    assert axes.token_embedding.weight.names == ("vocab", "embed")
    assert axes.lm_head.weight.names == ("embed", "vocab")
    encoder = tiny_encoder_classifier(jax.random.key(0)).encoder
    enc_axes = zoo.logical_axes(encoder)
    assert enc_axes.embeddings.position_embeddings.weight.names == (None, "embed")
    assert enc_axes.embeddings.token_type_embeddings.weight.names == (None, "embed")
