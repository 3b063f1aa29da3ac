"""Transformer building blocks and models against direct reference formulas, on one device."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import (
    UNIT_ROUNDOFF,
    assert_rounding_close,
    assert_within,
    largest,
    lm_batch,
    max_abs_diff,
    tiny_decoder,
    tiny_encoder_classifier,
)

import zoo
from zoo.models import Encoder, EncoderConfig, Transformer, TransformerConfig

# float32 rounding bounds (helpers.rounding_bound), from the sizes of the sums:
# the tiny models (d_model 16, MLP <= 64 wide, 2 layers of ~6 chained sums, plus a head or
# a pooling): the same model evaluated in another order (another batch, padding, program).
SUMS = {"terms": 64, "depth": 2 * 6 + 2}
# An attention layer: 16-wide projections, ~6 sums in a chain (q/k/v, scores, softmax's sum,
# probabilities x values, output projection).
ATTENTION = {"terms": 16, "depth": 6}
# A feed-forward layer (16 wide): up/gate and down sums plus the activation's ~4 roundings.
FEEDFORWARD = {"terms": 16, "depth": 6}
# RoPE's tables: the angle p * theta^(-2i/d) (<= 6 rad here) off by ~3 roundings, so cos/sin
# by ~18 ulps of 1, then two products and a sum: 13 x 2 ulps of (|a| + |b|).
ROPE_DEPTH = 13
# bfloat16 compute: every intermediate rounded to bfloat16 (u = 2^-8, sums accumulated in
# float32): a layer's chain holds ~17 roundings (norm, q/k/v, rope, scores, softmax, mixing,
# output, residual, norm, gate/up, silu, product, down, residual); 2 layers, the final norm
# and the head: ~37, each at most u x the output's scale; gradients chain twice as many.
BF16_ROUNDOFF = 2.0**-8
BF16_FORWARD_ROUNDINGS = 2 * 17 + 3


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
            scores = q[bi, :, head] @ k[bi, :, kv].T / np.sqrt(attn.query_scale or hd)
            if attn.logit_softcap is not None:  # Gemma 2's cap, before the mask
                scores = attn.logit_softcap * np.tanh(scores / attn.logit_softcap)
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


@eqx.filter_jit
def _attend(attn, x, mask):
    """An attention layer's output, compiled (eager calls compile every op alone)."""
    return attn(x, mask=mask)


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


@eqx.filter_jit
def _loss_grads(model, batch):
    """The gradients of the summed next-token loss, compiled."""
    return eqx.filter_grad(lambda m: zoo.models.next_token_loss(m, batch)[0].sum())(model)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rope", [None, 10000.0])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_matches_reference(causal, rope, kv_heads):
    k1, k2 = jax.random.split(jax.random.key(0))
    attn = zoo.nn.Attention(16, 4, num_kv_heads=kv_heads, causal=causal, rope_theta=rope, init_std=0.3, key=k1)
    x = jax.random.normal(k2, (2, 6, 16))
    mask = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    expected = np_attention(attn, x, mask)
    got = _attend(attn, x, mask)
    # Rows of fully masked queries are arbitrary (no key allowed); compare the real ones.
    assert_rounding_close(got, expected, **ATTENTION)


def test_partial_rope_rotates_the_first_dimensions_and_passes_the_rest():
    """Tables for 4 of 8 head dimensions (Phi-4-mini's partial rotary): the first 4 are
    rotated as a 4-wide head, the other 4 pass through, bit for bit."""
    x = jax.random.normal(jax.random.key(0), (2, 7, 2, 8))
    cos, sin = zoo.nn.rope_tables(7, 4)
    got = np.asarray(zoo.nn.apply_rope(x, cos, sin))
    np.testing.assert_array_equal(got[..., :4], np.asarray(zoo.nn.apply_rope(x[..., :4], cos, sin)))
    np.testing.assert_array_equal(got[..., 4:], np.asarray(x[..., 4:]))
    with pytest.raises(ValueError, match="rope_dim must be even and in"):
        zoo.nn.Attention(16, 2, rope_theta=1e4, rope_dim=3, key=jax.random.key(1))


def test_rope_matches_formula_and_depends_on_relative_position():
    x = jax.random.normal(jax.random.key(0), (1, 7, 2, 8))
    cos, sin = zoo.nn.rope_tables(7, 8)
    rope = jax.jit(zoo.nn.apply_rope)
    assert_rounding_close(rope(x, cos, sin), np_rope(x), terms=1, depth=ROPE_DEPTH, scale=2 * largest(x))
    # <rope(q, m), rope(k, n)> depends only on m - n.
    q = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (8,)), (1, 7, 1, 8))
    k = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (8,)), (1, 7, 1, 8))
    # The dots in numpy (float32): eagerly every jnp op compiles on its own.
    rq, rk = np.asarray(rope(q, cos, sin))[0, :, 0], np.asarray(rope(k, cos, sin))[0, :, 0]
    dots = rq @ rk.T
    # An 8-term dot of rotated vectors: its sum, and each side's rotation error (ROPE_DEPTH
    # ulps), all of |q| |k|.
    scale = float(np.linalg.norm(np.asarray(q)[0, 0, 0]) * np.linalg.norm(np.asarray(k)[0, 0, 0]))
    for offset in range(-3, 4):
        diag = np.diagonal(dots, offset)
        assert_rounding_close(diag, np.full_like(diag, diag[0]), terms=8, depth=1 + ROPE_DEPTH, scale=scale)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_decoder_is_causal(positions):
    model = tiny_decoder(jax.random.key(0), positions=positions)
    # Tokens edited and logits sliced in numpy: eagerly each position's index compiles anew.
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 8), 0, 32))
    forward = jax.jit(lambda t: model(t))
    logits = np.asarray(forward(tokens))
    for t in range(7):
        changed = tokens.copy()
        changed[:, t + 1] = (tokens[:, t + 1] + 5) % 32
        new_logits = np.asarray(forward(changed))
        np.testing.assert_array_equal(new_logits[:, : t + 1], logits[:, : t + 1])
        assert not np.allclose(new_logits[:, t + 1], logits[:, t + 1])


def test_encoder_ignores_padding():
    encoder = Encoder(
        EncoderConfig(vocab_size=32, d_model=16, num_heads=4, num_layers=2, max_len=10), key=jax.random.key(0)
    )
    # The inputs made in numpy: eagerly every jnp op compiles on its own.
    tokens = np.array([[5, 6, 7, 8, 0, 0, 0, 0], [9, 3, 4, 2, 11, 12, 0, 0]], np.int32)
    mask = tokens != 0
    forward = jax.jit(lambda t, m: encoder(t, mask=m))
    hidden = forward(tokens, mask)
    # Other ids at padded positions (still masked) change nothing at real positions.
    noisy = np.where(mask, tokens, 17).astype(np.int32)
    hidden_noisy = forward(noisy, mask)
    assert_rounding_close(np.asarray(hidden_noisy)[mask], np.asarray(hidden)[mask], **SUMS)
    # Mean pooling sees only real tokens: more padding, same sentence embedding.
    longer = np.pad(tokens, ((0, 0), (0, 2)))
    pooled = zoo.models.mean_pool(hidden, jnp.asarray(mask))
    pooled_longer = zoo.models.mean_pool(jax.jit(lambda t: encoder(t))(longer), jnp.asarray(longer != 0))
    assert_rounding_close(pooled_longer, pooled, **SUMS)


def test_feedforward_and_blocks_match_formulas():
    key = jax.random.key(0)
    x = jax.random.normal(key, (2, 3, 8))
    ff = zoo.nn.FeedForward(8, 16, activation="swiglu", init_std=0.3, key=key)
    ff_gelu = zoo.nn.FeedForward(8, 16, activation="gelu", init_std=0.3, key=key)
    attn = zoo.nn.Attention(8, 2, init_std=0.3, key=key)
    ln1, ln2 = zoo.nn.LayerNorm(8), zoo.nn.LayerNorm(8)
    # Norms on the sub-layers' outputs only (OLMo 2), and on inputs and outputs (Gemma 2/3).
    ln3, ln4 = (
        eqx.tree_at(lambda n: n.weight, zoo.nn.LayerNorm(8), 1 + 0.1 * jax.random.normal(jax.random.key(i), (8,)))
        for i in (3, 4)
    )

    def lin(layer, h):
        return h @ layer.weight + layer.bias

    @eqx.filter_jit  # every module and formula in one program (eager calls compile each op alone)
    def outputs_and_formulas(ff, ff_gelu, attn, ln1, ln2, ln3, ln4, x):
        out = {
            "swiglu": (ff(x), lin(ff.down, jax.nn.silu(lin(ff.gate, x)) * lin(ff.up, x))),
            "gelu": (ff_gelu(x), lin(ff_gelu.down, jax.nn.gelu(lin(ff_gelu.up, x), approximate=False))),
        }
        pre = zoo.nn.TransformerBlock(attn, ff, ln1, ln2, pre_norm=True)
        h = x + attn(ln1(x))
        out["pre"] = (pre(x), h + ff(ln2(h)))
        post = zoo.nn.TransformerBlock(attn, ff, ln1, ln2, pre_norm=False)
        h = ln1(x + attn(x))
        out["post"] = (post(x), ln2(h + ff(h)))
        after = zoo.nn.TransformerBlock(attn, ff, None, None, attention_out_norm=ln3, mlp_out_norm=ln4)
        h = x + ln3(attn(x))
        out["after"] = (after(x), h + ln4(ff(h)))
        sandwich = zoo.nn.TransformerBlock(attn, ff, ln1, ln2, attention_out_norm=ln3, mlp_out_norm=ln4)
        h = x + ln3(attn(ln1(x)))
        out["sandwich"] = (sandwich(x), h + ln4(ff(ln2(h))))
        return out

    out = outputs_and_formulas(ff, ff_gelu, attn, ln1, ln2, ln3, ln4, x)
    assert_rounding_close(*out["swiglu"], **FEEDFORWARD)
    assert_rounding_close(*out["gelu"], **FEEDFORWARD)
    block = {"terms": 16, "depth": ATTENTION["depth"] + FEEDFORWARD["depth"] + 2 * 2}  # + 2 norms' sums
    assert_rounding_close(*out["pre"], **block)
    assert_rounding_close(*out["post"], **block)
    assert_rounding_close(*out["after"], **block)
    assert_rounding_close(*out["sandwich"], **block | {"depth": block["depth"] + 2 * 2})
    with pytest.raises(ValueError, match="post-LN TransformerBlock.*no output norms"):
        zoo.nn.TransformerBlock(attn, ff, ln1, ln2, pre_norm=False, mlp_out_norm=ln4)


def test_dropout_follows_each_examples_key():
    """An example's dropout mask comes from its own key: it does not depend on which other
    examples share its batch (so splitting over devices/microbatches changes nothing)."""
    model = tiny_encoder_classifier(jax.random.key(0), dropout=0.3, attention_dropout=0.2)
    batch = lm_batch(jax.random.key(1), 6)
    keys = zoo.nn.example_keys(jax.random.key(2), 6)
    forward = jax.jit(lambda t, k: model(t, key=k))
    full = forward(batch["tokens"], keys)
    half = forward(batch["tokens"][3:], keys[3:])
    assert_rounding_close(full[3:], half, **SUMS)
    # Other keys, other masks: the output follows the keys (not one fixed mask).
    other = forward(batch["tokens"], zoo.nn.example_keys(jax.random.key(3), 6))
    assert not np.allclose(full, other)
    # Without keys dropout is off: the same weights with rates 0 (an independent model,
    # in which dropout cannot act) give the same outputs, and differ from training's.
    inference = jax.jit(lambda t: model(t))(batch["tokens"])
    no_dropout = tiny_encoder_classifier(jax.random.key(0), dropout=0.0, attention_dropout=0.0)
    assert max_abs_diff(no_dropout, model) == 0  # the rates are static: the weights are the same
    assert_rounding_close(inference, jax.jit(lambda t: no_dropout(t))(batch["tokens"]), **SUMS)
    assert_rounding_close(inference, jax.jit(lambda t, k: no_dropout(t, key=k))(batch["tokens"], keys), **SUMS)
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


@pytest.mark.parametrize("policy", ["nothing_saveable", "projections"])
def test_tied_head_is_the_embedding_and_remat_changes_nothing(policy):
    tied = tiny_decoder(jax.random.key(0), tie_embeddings=True)
    assert tied.lm_head is None
    h = jnp.ones((1, 1, 16))
    assert_rounding_close(tied.token_embedding.attend(h)[0, 0], tied.token_embedding.weight @ jnp.ones(16), terms=16)
    batch = lm_batch(jax.random.key(1), 4)
    remat = tiny_decoder(jax.random.key(0), remat=policy)
    plain = tiny_decoder(jax.random.key(0))
    # (The configs differ in `remat`, a static field, so compare the leaves.) Recomputed
    # activations: the same sums, perhaps in another order; a loss summed over 4 x 8 tokens.
    # Compiled, as a training step runs them (the remat policy acts on the compiled program).
    for a, b in zip(
        jax.tree.leaves(_loss_grads(remat, batch)), jax.tree.leaves(_loss_grads(plain, batch)), strict=True
    ):
        assert_rounding_close(a, b, terms=4 * 8, depth=2 * SUMS["depth"])


@functools.cache  # both presets' tests read it, neither changes it
def _projections_case():
    """The LoRA config, a batch of 8 rows (4 devices x 2 microbatches), the remat="projections"
    LoRA'd decoder, and the gradients of the same model without remat, on one device."""
    from zoo.lora import LoraConfig, add_lora, trainable

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    batch = lm_batch(jax.random.key(1), 8)
    plain = add_lora(tiny_decoder(jax.random.key(0)), config, key=jax.random.key(2))
    lora, frozen = eqx.partition(plain, trainable(plain, config))

    def mean_loss(lora):
        sums, counts = zoo.models.next_token_loss(eqx.combine(lora, frozen), batch)
        return sums.sum() / counts.sum()

    want = jax.tree.leaves(jax.jit(jax.grad(mean_loss))(lora))
    model = add_lora(tiny_decoder(jax.random.key(0), remat="projections"), config, key=jax.random.key(2))
    return config, batch, model, want


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_the_projections_policy_keeps_what_matmuls_made_and_lora_gradients_are_unchanged(preset):
    """`remat="projections"` keeps per layer only the values a matmul made (q, k, v, the
    attention's output, the residual after attention, gate, up: jax's own residual list of a
    LoRA'd layer); its step on data=4 with 2 microbatches holds one gradient all-reduce,
    outside every loop (dp: none inside), within the preset's budget (fsdp gathers each
    weight again for the backward pass instead of keeping it), and its LoRA gradients equal
    one device's without remat (rounding)."""
    import optax
    from helpers import preset_mesh
    from jax._src.ad_checkpoint import saved_residuals

    from zoo.lora import trainable

    config, batch, model, want = _projections_case()
    mesh = preset_mesh(preset, 4)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(
            zoo.models.next_token_loss,
            optax.trace(decay=0.0),
            microbatches=2,
            trainable=trainable(model, config),
            preset=preset,
        )
        opt_state = step.init(placed)
        compiled = step.compile(placed, opt_state, batch)
        _, opt_state, _ = compiled(placed, opt_state, batch)
        budget, sizes = step.budget_for(placed), step.budget_sizes(placed)
    colls = zoo.collectives(compiled, mesh=mesh)
    assert budget.breaches(colls, sizes) == [], budget.report(colls, sizes)
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1, zoo.report(colls)
    if preset == "dp":
        assert zoo.count(colls, "all-reduce", in_loop=True) == 0, zoo.report(colls)
    else:  # fsdp: the weights gathered inside the loop
        assert zoo.count(colls, "all-gather", in_loop=True) > 0, zoo.report(colls)
    for a, b in zip(jax.tree.leaves(opt_state.trace), want, strict=True):
        assert_rounding_close(np.asarray(a), b, terms=8 * 8, depth=2 * SUMS["depth"])
    if preset != "dp":
        return  # one layer's residuals do not depend on the preset: checked once (dp), below
    layer = eqx.combine(
        jax.tree.map(lambda x: x[0], eqx.filter(model.layers.layers, eqx.is_array)), model.layers.layers
    )
    lora, frozen = eqx.partition(layer, trainable(layer, config))
    x = jax.random.normal(jax.random.key(3), (4, 8, 16))
    policy = jax.checkpoint_policies.save_only_these_names(zoo.nn._remat.SAVED)
    body = jax.checkpoint(lambda lora, x: eqx.combine(lora, frozen)(x, mask=batch["mask"][:4]), policy=policy)
    kept = [
        (aval.shape, why)
        for aval, why in saved_residuals(lambda lora, x: body(lora, x).sum(), lora, x)
        if not any(word in why for word in ("argument", "constant", "literal"))
    ]
    assert all("zoo_saved" in why for _, why in kept), kept
    # q, the attention's output, the residual [4, 8, 16]; k, v [4, 8, 8] (2 of 4 heads); gate, up [32, 32].
    assert sorted(shape for shape, _ in kept) == sorted([(4, 8, 16)] * 3 + [(4, 8, 8)] * 2 + [(32, 32)] * 2), kept


def _grad_program(model, batch):
    """The program text of the summed next-token loss's gradients, lowered (not compiled)."""
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, batch):
        return zoo.models.next_token_loss(eqx.combine(params, static), batch)[0].sum()

    return jax.jit(jax.grad(loss)).lower(params, batch).as_text()


def test_auto_remat_below_the_threshold_is_no_remat():
    """`remat="auto"`, the default, lowers a small model (the suite's) to exactly the program
    of `remat=None`: the suite's programs are those it compiled before "auto"."""
    batch = lm_batch(jax.random.key(1), 4)
    auto = tiny_decoder(jax.random.key(0))
    assert auto.config.remat == "auto" and tiny_encoder_classifier(jax.random.key(0)).encoder.config.remat == "auto"
    plain = _grad_program(tiny_decoder(jax.random.key(0), remat=None), batch)
    assert _grad_program(auto, batch) == plain
    assert _grad_program(tiny_decoder(jax.random.key(0), remat="projections"), batch) != plain


def test_auto_remat_above_the_threshold_is_projections(monkeypatch):
    """Above `REMAT_AUTO_ABOVE` (set to 0 here) `"auto"` lowers to the program of
    `remat="projections"`; its gradients equal `remat=None`'s within rounding."""
    monkeypatch.setattr(zoo.nn._remat, "REMAT_AUTO_ABOVE", 0)
    batch = lm_batch(jax.random.key(1), 4)
    auto, plain = tiny_decoder(jax.random.key(0)), tiny_decoder(jax.random.key(0), remat=None)
    text = _grad_program(auto, batch)
    assert text == _grad_program(tiny_decoder(jax.random.key(0), remat="projections"), batch)
    assert text != _grad_program(plain, batch)  # an explicit None stays off at any size
    for a, b in zip(jax.tree.leaves(_loss_grads(auto, batch)), jax.tree.leaves(_loss_grads(plain, batch)), strict=True):
        assert_rounding_close(a, b, terms=4 * 8, depth=2 * SUMS["depth"])


def test_auto_remat_estimate_from_static_shapes():
    """The estimate `"auto"` resolves with, from abstract shapes: Llama-3.2-1B's stack (16
    layers, d 2048, 32 heads) at batch 4 x 256 keeps about the 213 MiB per layer measured
    without remat (docs/performance.md) and resolves to `"projections"`; one device's share
    of it over data=4 (under a GiB) and a tiny model resolve to none."""
    from helpers import data_mesh
    from jax.sharding import NamedSharding, PartitionSpec

    from zoo.nn._remat import REMAT_AUTO_ABOVE, kept_without_remat

    sizes = dict(vocab_size=128256, d_model=2048, num_heads=32, num_kv_heads=8, num_layers=16, mlp_dim=8192)
    config = TransformerConfig(**sizes, max_len=256, positions="rope", activation="swiglu", norm="rmsnorm")
    stack = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0)).layers
    x = jax.ShapeDtypeStruct((4, 256, 2048), jnp.float32)
    per_layer = kept_without_remat(x, 16, 32) / 16 / 2**20
    assert 0.9 * 213 <= per_layer <= 1.1 * 213, per_layer
    assert stack.remat_policy(x) == "projections"
    quarter = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(data_mesh(4), PartitionSpec("data")))
    assert kept_without_remat(quarter, 16, 32) * 4 == kept_without_remat(x, 16, 32) > REMAT_AUTO_ABOVE
    assert stack.remat_policy(quarter) is None
    off = eqx.filter_eval_shape(Transformer, dataclasses.replace(config, remat=None), key=jax.random.key(0))
    assert off.layers.remat_policy(x) is None
    encoder = eqx.filter_eval_shape(Encoder, EncoderConfig(**sizes, max_len=256), key=jax.random.key(0))
    assert encoder.layers.remat_policy(x) == "projections"
    assert tiny_decoder(jax.random.key(0)).layers.remat_policy(jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)) is None


def test_remat_config_accepts_auto_and_none():
    for cls in (TransformerConfig, EncoderConfig):
        small = dict(vocab_size=8, d_model=16, num_heads=4, num_layers=1)
        assert cls(**small).remat == "auto" and cls(**small, remat="projections").remat == "projections"
        assert cls.from_dict(cls(**small, remat=None).to_dict()).remat is None  # a config saved with remat off
        with pytest.raises(ValueError, match=r"remat must be 'auto', None \(no remat\) or one of \['nothing_saveable'"):
            cls(**small, remat="sometimes")


def test_mixed_precision_computes_in_bf16_keeps_f32_params_and_grads():
    f32 = tiny_decoder(jax.random.key(0))
    bf16 = tiny_decoder(jax.random.key(0), dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(eqx.filter(bf16, eqx.is_array)))
    batch = lm_batch(jax.random.key(1), 4)
    jaxpr = jax.make_jaxpr(lambda m: m(batch["tokens"]))(bf16)
    assert "bf16" in str(jaxpr)  # activations really run in bfloat16
    logits = _forward(bf16, batch["tokens"])
    assert logits.dtype == jnp.float32
    want = _forward(f32, batch["tokens"])
    bound = BF16_FORWARD_ROUNDINGS * BF16_ROUNDOFF * largest(want)
    assert_within(logits, want, bound + 2 * SUMS["depth"] * SUMS["terms"] * UNIT_ROUNDOFF * largest(want), "bf16")
    g16, g32 = _loss_grads(bf16, batch), _loss_grads(f32, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
    scale = max(largest(x) for x in jax.tree.leaves(g32))
    assert max_abs_diff(g16, g32) <= 2 * BF16_FORWARD_ROUNDINGS * BF16_ROUNDOFF * scale


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
    assert eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0)).config == config


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
    # OLMo 2's norms: q/k scales as wide as (and split as) their projections, output norms.
    olmo = zoo.logical_axes(tiny_decoder(jax.random.key(0), qk_norm=True, qk_norm_scope="projection",
                                         norm_placement="output")).layers.layers  # fmt: skip
    assert olmo.attention.q_norm.weight.names == ("layers", "heads")
    assert olmo.attention.k_norm.weight.names == ("layers", "kv_heads")
    assert olmo.attention_out_norm.weight.names == olmo.mlp_out_norm.weight.names == ("layers", "embed")
    assert olmo.attention_norm is None and olmo.mlp_norm is None
    sandwich = zoo.logical_axes(tiny_decoder(jax.random.key(0), norm_placement="sandwich")).layers.layers
    norms = (sandwich.attention_norm, sandwich.mlp_norm, sandwich.attention_out_norm, sandwich.mlp_out_norm)
    assert all(n.weight.names == ("layers", "embed") for n in norms)  # Gemma 2/3: all four
    # Without the options a layer has no new leaves.
    assert axes.layers.layers.attention_out_norm is None and axes.layers.layers.attention.q_norm is None
    encoder = tiny_encoder_classifier(jax.random.key(0)).encoder
    enc_axes = zoo.logical_axes(encoder)
    assert enc_axes.embeddings.position_embeddings.weight.names == (None, "embed")
    assert enc_axes.embeddings.token_type_embeddings.weight.names == (None, "embed")


# Layers 0-3: RoPE on 0 and 2 (base 10k and 100), none on 1 and 3; a window of 2 on 1 and 2
# (weights drawn wide enough that attention is far from uniform: each setting shows).
PATTERN = dict(
    init_std=0.3,
    num_layers=4,
    sliding_window=2,
    sliding_layers=(False, True, True, False),
    rope_layers=(True, False, True, False),
    rope_thetas=(1e4, 1e4, 1e2, 1e4),
)


def test_a_layer_pattern_is_each_layer_built_alone():
    """A patterned stack (one scanned layer body reading each layer's settings as data)
    equals its layers run one after another, each an `Attention` built with its own static
    settings (RoPE or none, its base, its window); the pattern adds no parameter leaf, and
    every field of it changes the output."""
    model = tiny_decoder(jax.random.key(3), **PATTERN)
    tokens = lm_batch(jax.random.key(4), 3)["tokens"]
    stacks = []
    for i in range(4):  # layer i of a uniform model with layer i's settings, the same weights
        alone = eqx.filter_eval_shape(
            tiny_decoder,
            jax.random.key(5),
            num_layers=4,
            positions="rope" if PATTERN["rope_layers"][i] else "none",
            rope_theta=PATTERN["rope_thetas"][i],
            sliding_window=PATTERN["sliding_window"] if PATTERN["sliding_layers"][i] else None,
        )
        stacks.append(eqx.tree_at(lambda s: jax.tree.leaves(s), alone.layers, jax.tree.leaves(model.layers)))

    @eqx.filter_jit
    def layer_by_layer(model, stacks, tokens):
        h = model.embed(tokens)
        for i, stack in enumerate(stacks):
            h = stack.unstack().layers[i](h)
        return model.head(h)

    want = layer_by_layer(model, stacks, tokens)
    got = _forward(model, tokens)
    assert_rounding_close(got, want, **SUMS)
    uniform = eqx.filter_eval_shape(tiny_decoder, jax.random.key(3), num_layers=4, init_std=0.3)
    assert [x.shape for x in jax.tree.leaves(model)] == [x.shape for x in jax.tree.leaves(uniform)]
    for field in ("sliding_layers", "rope_layers", "rope_thetas"):
        other = Transformer(dataclasses.replace(model.config, **{field: None}), key=jax.random.key(3))
        assert max_abs_diff(_forward(other, tokens), got) > 1e-3, field


def test_a_patterned_stack_is_one_scanned_layer_body():
    """The patterned 4-layer decoder lowers to the uniform one's program shape: one loop
    over the layers and the same matrix products (one layer's), not a layer per setting."""
    tokens = lm_batch(jax.random.key(4), 3)["tokens"]

    def program(model):
        text = eqx.filter_jit(lambda m, t: m(t)).lower(model, tokens).as_text()
        return text.count("stablehlo.while"), text.count("stablehlo.dot_general")

    patterned = program(tiny_decoder(jax.random.key(3), **PATTERN))
    assert patterned == program(tiny_decoder(jax.random.key(3), num_layers=4)) and patterned[0] == 1


def test_soft_capped_attention_matches_reference():
    """Gemma 2's attention: scores divided by sqrt(query_pre_attn_scalar) (12, not head_dim
    4) and soft-capped at 1.5 (low enough to bite: the scores reach several times that),
    before the mask and softmax; the cap's tanh adds two roundings to the chain."""
    k1, k2 = jax.random.split(jax.random.key(0))
    common = dict(num_kv_heads=2, causal=True, rope_theta=1e4, init_std=0.6, key=k1)
    attn = zoo.nn.Attention(16, 4, logit_softcap=1.5, query_scale=12.0, **common)
    x = jax.random.normal(k2, (2, 6, 16))
    mask = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    got = _attend(attn, x, mask)
    assert_rounding_close(got, np_attention(attn, x, mask), terms=16, depth=ATTENTION["depth"] + 2)
    plain = zoo.nn.Attention(16, 4, **common)  # the same weights
    assert np.abs(np.asarray(got) - np.asarray(_attend(plain, x, mask))).max() > 1e-2


def test_soft_capped_logits_and_their_config_errors():
    model = tiny_decoder(jax.random.key(1), final_logit_softcapping=0.5)
    logits = np.asarray(_forward(model, jnp.array([[3, 1, 4, 1, 5]])))
    assert np.abs(logits).max() < 0.5
    uncapped = Transformer(dataclasses.replace(model.config, final_logit_softcapping=None), key=jax.random.key(1))
    want = 0.5 * np.tanh(np.asarray(_forward(uncapped, jnp.array([[3, 1, 4, 1, 5]]))) / 0.5)
    assert_rounding_close(logits, want, terms=32, depth=2 * 6 + 3)
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        with pytest.raises(ValueError, match=f"TransformerConfig.{field} must be None or > 0, got 0.0"):
            dataclasses.replace(model.config, **{field: 0.0})


def test_layer_pattern_config_errors_say_what_to_fix():
    base = dict(vocab_size=8, d_model=16, num_heads=4, num_layers=2, positions="rope")
    with pytest.raises(ValueError, match="sliding_layers holds 3 values for 2 layers"):
        TransformerConfig(**base, sliding_window=2, sliding_layers=(True, False, True))
    with pytest.raises(ValueError, match="sliding_layers is set without a sliding_window"):
        TransformerConfig(**base, sliding_layers=(True, False))
    with pytest.raises(ValueError, match="rope_layers / rope_thetas / rope_factors need positions='rope'"):
        TransformerConfig(**base | {"positions": "learned"}, rope_layers=(True, False))
    with pytest.raises(ValueError, match="rope_factors .* cannot be combined with rope_scaling='llama3'"):
        TransformerConfig(**base, rope_factors=(1.0, 8.0), rope_scaling="llama3")
    with pytest.raises(ValueError, match="longrope.*holds 3 factors for a rotation of 2 frequencies"):
        TransformerConfig(**base, rope_scaling="longrope", rope_short_factor=(1.0,) * 3, rope_long_factor=(2.0,) * 3)
    config = TransformerConfig(**base, rope_layers=[True, False], rope_thetas=[1e4, 5e5], rope_factors=[1.0, 8.0])
    assert config.rope_layers == (True, False) and config.rope_factors == (1.0, 8.0) and hash(config)  # as JSON reads
    assert TransformerConfig.from_dict(config.to_dict()) == config
    longrope = TransformerConfig(
        **base, rope_scaling="longrope", rope_short_factor=[1.0, 1.0], rope_long_factor=[2.0, 3.0]
    )
    assert TransformerConfig.from_dict(longrope.to_dict()) == longrope and hash(longrope)
