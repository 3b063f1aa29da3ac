"""The next-token losses without the full logits (`TransformerConfig.loss_chunk`): SFT's,
DPO/ORPO's and GRPO's loss and gradients equal the unchunked ones within float32 rounding
for every kind of head (LoRA-wrapped, in NF4, tied, soft-capped, a mixture of experts' router
loss beside it), with chunks that do not divide the sequence; no array of the program is
`[batch, seq, vocab]`; the compiled step on a mesh keeps its one gradient all-reduce."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_rounding_close, data_mesh, lm_batch, preset_mesh, tiny_decoder
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_preference import pair_batch

import zoo
from zoo.models._loss import target_weights
from zoo.models._next_token import AUTO_ABOVE, CHUNK_BYTES, _vocab_shards, chunk_length

BATCH, SEQ, VOCAB = 4, 8, 48  # a vocabulary no other width of the decoder shares
# Chunked and unchunked sum the same terms in another order: the longest sum is a
# gradient's over the batch's tokens, through 2 layers of ~6 chained sums plus the head,
# twice for the backward pass (tests/test_presets.py's bound).
SUMS = {"terms": BATCH * SEQ, "depth": 2 * (2 * 6 + 1)}
LORA_HEAD = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj", "lm_head"), init_lora_weights=False)  # fmt: skip


@functools.cache
def _decoder(kind: str, loss_chunk):
    """(model, trainable filter) of one head kind, the same weights at any `loss_chunk`
    (built once per file: the parametrized cases and the metric tests read the same)."""
    key = jax.random.key(0)
    if kind in ("lora-head", "nf4-head"):  # the untied head wrapped by LoRA (its base in NF4: QLoRA)
        model = zoo.lora.add_lora(
            tiny_decoder(key, vocab_size=VOCAB, loss_chunk=loss_chunk), LORA_HEAD, key=jax.random.key(1)
        )
        if kind == "nf4-head":
            model = zoo.lora.cast_frozen(model, "nf4", config=LORA_HEAD, block_size=8)
        return model, zoo.lora.trainable(model, LORA_HEAD)
    settings = {
        "tied": dict(tie_embeddings=True),
        # Gemma 2's: tied, the logits soft-capped, sandwich norms, capped attention scores.
        "gemma2": dict(tie_embeddings=True, final_logit_softcapping=3.0, attn_logit_softcapping=2.0,
                       norm_placement="sandwich", embed_scale=4.0),
        "moe": dict(num_experts=4, num_experts_per_tok=2, moe_mlp_dim=24, output_router_logits=True,
                    router_aux_loss_coef=0.1),
    }[kind]  # fmt: skip
    return tiny_decoder(key, vocab_size=VOCAB, loss_chunk=loss_chunk, **settings), eqx.is_inexact_array


def _objective(name: str):
    """(loss function, batch) of an objective on the tiny decoders' vocabulary."""
    if name == "sft":
        return zoo.models.next_token_loss, lm_batch(jax.random.key(1), BATCH, seq=SEQ, vocab=VOCAB)
    if name in ("dpo", "orpo"):
        batch = {k: jnp.asarray(v) for k, v in pair_batch(seed=3, pairs=BATCH, seq=SEQ, vocab=VOCAB).items()}
        return zoo.models.PreferenceLoss(name, beta=0.5, reference=zoo.lora.disabled_adapters), batch
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, VOCAB, (BATCH, SEQ)).astype(np.int32)
    completion = (np.arange(SEQ)[None] >= 3) & (np.arange(SEQ)[None] < 4 + np.arange(BATCH)[:, None])
    batch = {
        "tokens": tokens,
        "completion": completion.astype(np.int32),
        "advantages": rng.normal(size=BATCH).astype(np.float32),
        "old_logps": rng.uniform(-3.6, -3.2, (BATCH, SEQ - 1)).astype(np.float32),  # some ratios clipped
    }
    beta = 0.04 if name == "grpo-kl" else 0.0
    loss = zoo.models.GRPOLoss(
        beta=beta, temperature=0.7, max_completion_length=5, reference=zoo.lora.disabled_adapters
    )
    return loss, {k: jnp.asarray(v) for k, v in batch.items()}


def _mean_loss(loss_fn, batch, frozen):
    def mean_loss(params):
        out = loss_fn(eqx.combine(params, frozen), batch)
        return out[0].sum() / out[1].sum() if isinstance(out, tuple) else out.mean()

    return mean_loss


def _compiled(fn, model, *args):
    """`fn(model, *args)` jitted (the model's arrays traced, the rest static) from one trace:
    (its outputs, its jaxpr). The program checked for `[batch, seq, vocab]` arrays is the one
    that ran, traced once instead of again by `jax.make_jaxpr`."""
    arrays, static = eqx.partition(model, eqx.is_array)
    traced = jax.jit(lambda a, *rest: fn(eqx.combine(a, static), *rest)).trace(arrays, *args)
    return traced.lower().compile()(arrays, *args), traced.jaxpr


@functools.cache
def _loss_and_grads(kind: str, objective: str, loss_chunk):
    model, trainable = _decoder(kind, loss_chunk)
    loss_fn, batch = _objective(objective)
    params, frozen = eqx.partition(model, trainable)
    (loss, grads), jaxpr = _compiled(jax.value_and_grad(_mean_loss(loss_fn, batch, frozen)), params)
    return loss, grads, jaxpr


def _assert_leaves_rounding_close(got, want, **sums):
    """The gradients of two models differing only in their static config leaf by leaf."""
    pairs = zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves_with_path(eqx.filter(want, eqx.is_array)), strict=True)  # fmt: skip
    for g, (path, w) in pairs:
        assert_rounding_close(g, w, **sums, what=f"gradient{jax.tree_util.keystr(path)}")


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shape of every value a jaxpr computes, its sub-programs' (scan bodies,
    checkpointed functions) included."""
    out = set()
    for eqn in jaxpr.eqns:
        out |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out |= _shapes(inner)
    return out


def _holds_full_logits(closed) -> bool:
    return any(len(s) >= 3 and s[-1] == VOCAB and s[-2] >= SEQ - 1 for s in _shapes(closed.jaxpr))


# Every objective meets every head it runs on (DPO and GRPO's KL term need LoRA's base as
# their reference): chunks of 2 and 3 positions, neither dividing the 7 targets.
CASES = [
    ("lora-head", "sft", 3), ("tied", "sft", 2), ("gemma2", "sft", 3), ("moe", "sft", 2), ("nf4-head", "sft", 2),
    ("lora-head", "dpo", 2), ("tied", "orpo", 3), ("gemma2", "orpo", 2),
    ("lora-head", "grpo-kl", 3), ("gemma2", "grpo", 2),
]  # fmt: skip


@pytest.mark.parametrize("kind,objective,chunk", CASES, ids=[f"{k}-{o}-{c}" for k, o, c in CASES])
def test_chunked_loss_and_gradients_equal_the_full_logits(kind, objective, chunk):
    want_loss, want, full = _loss_and_grads(kind, objective, None)
    loss, grads, chunked = _loss_and_grads(kind, objective, chunk)
    assert _holds_full_logits(full) and not _holds_full_logits(chunked)
    assert abs(float(want_loss)) > 1e-3 and max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want)) > 1e-4
    assert_rounding_close(loss, want_loss, **SUMS, what="loss")
    _assert_leaves_rounding_close(grads, want, **SUMS)


def test_grpo_entropy_is_computed_per_chunk_and_equals_the_full_logits():
    loss_fn, batch = _objective("grpo")
    (want, _), (got, _) = (_compiled(loss_fn.metrics, _decoder("gemma2", c)[0], batch) for c in (None, 3))
    assert float(want["entropy"]) > 0.1
    for name in want:
        assert_rounding_close(got[name], want[name], **SUMS, what=name)


def test_auto_chunks_large_logits_only():
    small = tiny_decoder(jax.random.key(0))
    assert small.config.loss_chunk == "auto"
    assert chunk_length(small, jnp.zeros((BATCH, SEQ), jnp.int32)) is None  # the suite's programs unchanged
    config = zoo.models.TransformerConfig(vocab_size=151936, d_model=64, num_heads=2, num_layers=1, max_len=2048)
    qwen_sized = eqx.filter_eval_shape(zoo.models.Transformer, config, key=jax.random.key(0))
    tokens = jnp.zeros((8, 2048), jnp.int32)
    chunk = chunk_length(qwen_sized, tokens)
    row = 8 * 151936 * 4  # float32 logits of one position of each row
    assert chunk is not None and row * 2047 > AUTO_ABOVE and chunk * row <= CHUNK_BYTES
    # The boundary, at the batch `row` counts: AUTO_ABOVE // row targets fit, one more does not.
    assert chunk_length(qwen_sized, jnp.zeros((8, AUTO_ABOVE // row + 1), jnp.int32)) is None
    assert chunk_length(qwen_sized, jnp.zeros((8, AUTO_ABOVE // row + 2), jnp.int32)) is not None
    forced = eqx.filter_eval_shape(
        zoo.models.Transformer, dataclasses.replace(config, loss_chunk=5), key=jax.random.key(0)
    )
    assert chunk_length(forced, tokens) == 5
    assert chunk_length(tiny_decoder(jax.random.key(0), loss_chunk=None), tokens) is None


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_auto_chunk_counts_one_devices_logits(preset):
    # dp (data=4): each device holds a quarter of the rows; tp (data=2, model=2): half the
    # rows and half of the vocabulary (the tied table split over model).
    # The model's shapes and shardings are what chunk_length reads: its arrays are zeros put
    # on the mesh as zoo.shard puts them (not a 151,936-row table initialised op by op).
    mesh = preset_mesh(preset, 4)
    config = zoo.models.TransformerConfig(vocab_size=151936, d_model=16, num_heads=2, num_layers=1, max_len=2048)
    placed = zoo.shard(eqx.filter_eval_shape(zoo.models.Transformer, config, key=jax.random.key(0)), zoo.rules(preset), mesh)  # fmt: skip
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    zeros = lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding) if is_abstract(x) else x  # noqa: E731
    model = jax.tree.map(zeros, placed, is_leaf=is_abstract)
    assert _vocab_shards(model, 151936) == {"dp": 1, "tp": 2}[preset]  # the arrays hold the shardings
    per_device = 8 * 151936 * 4 // 4  # float32 logits of one position of every row, on one device
    seen = []

    @eqx.filter_jit
    def traced(model, tokens):
        seen.append(chunk_length(model, tokens))
        return tokens.sum()

    def chunk(targets):
        tokens = jax.device_put(jnp.zeros((8, targets + 1), jnp.int32), NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            traced(model, tokens)
        return seen[-1]

    assert chunk(2047) == CHUNK_BYTES // per_device  # 4x the chunk the global batch would give
    assert chunk(AUTO_ABOVE // per_device) is None and chunk(AUTO_ABOVE // per_device + 1) is not None
    assert chunk_length(model, np.zeros((8, 2048), np.int32)) == CHUNK_BYTES // (
        8 * 151936 * 4 // {"dp": 1, "tp": 2}[preset]
    )


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_padded_vocabulary_under_a_temperature_keeps_finite_log_probabilities(chunk):
    """GRPO divides the logits by its sampling temperature; a vocabulary padded for a model
    axis (`vocab_multiple`) holds float32-minimum logits that a temperature below 1 took to
    -inf, and the one-hot contraction to NaN. Full or chunked, the terms equal the unpadded
    model's (the same weights' real rows) within float32 rounding."""
    from zoo.models._next_token import next_token_terms

    padded = tiny_decoder(jax.random.key(0), vocab_multiple=24, loss_chunk=chunk)  # 32 -> 48 rows
    assert padded.config.padded_vocab == 48
    plain = tiny_decoder(jax.random.key(0), loss_chunk=chunk)
    real = lambda w: w[: plain.config.padded_vocab]  # noqa: E731
    plain = eqx.tree_at(lambda m: m.token_embedding.weight, plain, real(padded.token_embedding.weight))
    plain = eqx.tree_at(lambda m: m.lm_head.weight, plain, padded.lm_head.weight[:, :32])
    plain = eqx.tree_at(lambda m: m.layers, plain, padded.layers)
    tokens = lm_batch(jax.random.key(1), BATCH, vocab=32)["tokens"]
    terms = functools.partial(next_token_terms, inputs={}, temperature=0.7, entropy=True)
    (got, _), (want, _) = (_compiled(terms, model, tokens) for model in (padded, plain))
    assert np.isfinite(np.asarray(got.logps)).all() and np.isfinite(np.asarray(got.entropy)).all()
    assert_rounding_close(got.logps, want.logps, terms=48, depth=4)
    assert_rounding_close(got.entropy, want.entropy, terms=48, depth=4)


@pytest.mark.parametrize("value", [0, -1, True, "always"])
def test_bad_loss_chunk_is_refused_with_the_choices(value):
    with pytest.raises(ValueError, match="loss_chunk must be 'auto', None"):
        tiny_decoder(jax.random.key(0), loss_chunk=value)


@functools.cache
def _step(loss_chunk):
    """(loss, gradients, collectives) of a 2-microbatch dp step of the LoRA-headed decoder
    on a data=4 mesh: its optimizer keeps the gradients as its state (a trace of decay 0)."""
    model, trainable = _decoder("lora-head", loss_chunk)
    loss_fn, batch = _objective("sft")
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)  # 8 rows: 4 devices x 2 microbatches
    mesh = data_mesh(4)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(loss_fn, optax.trace(decay=0.0), microbatches=2, trainable=trainable, preset="dp")
        opt_state = step.init(placed)
        compiled = step.compile(placed, opt_state, batch)
        _, opt_state, loss = compiled(placed, opt_state, batch)
    return float(loss), jax.tree.map(np.asarray, opt_state.trace), zoo.collectives(compiled, mesh=mesh)


def test_chunked_step_on_a_mesh_keeps_one_all_reduce_outside_loops_and_the_gradients():
    want_loss, want, unchunked = _step(None)
    loss, grads, colls = _step(3)
    assert zoo.count(colls, "all-reduce", in_loop=True) == 0, zoo.report(colls)
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1, zoo.report(colls)
    assert not any(c.in_loop for c in colls), zoo.report(colls)
    summary = sorted((c.kind, c.in_loop, c.mesh_axes, c.bytes) for c in colls)
    assert summary == sorted((c.kind, c.in_loop, c.mesh_axes, c.bytes) for c in unchunked), zoo.report(colls)
    assert_rounding_close(loss, want_loss, terms=2 * BATCH * SEQ, depth=SUMS["depth"], what="loss")
    _assert_leaves_rounding_close(grads, want, terms=2 * BATCH * SEQ, depth=SUMS["depth"])


@pytest.mark.parametrize("kind", ["lora-head", "moe"])
def test_held_out_metrics_read_the_head_in_chunks(kind):
    # The evaluation's loss, weight and accuracy with the head applied 3 positions at a
    # time equal the full logits' (the accuracy exactly: argmax of the same logits), and
    # its program holds no [batch, seq, vocab] array.
    # Each program compiled once: the forward (its 4 calls here and the cross-entropy's
    # logits), lm_metrics chunked and full (their jaxprs from the same trace).
    batch = {k: np.array(v) for k, v in lm_batch(jax.random.key(1), BATCH, seq=SEQ, vocab=VOCAB).items()}
    batch["weight"] = np.asarray([1.0, 1.0, 0.5, 0.0], np.float32)
    (chunked, _), (full, _) = _decoder(kind, 3), _decoder(kind, None)
    for t in range(0, SEQ - 1, 2):  # every other target the model's own argmax: some hits, some misses
        batch["tokens"][:, t + 1] = np.argmax(np.asarray(_forward(full, batch["tokens"]))[:, t], axis=-1)
    (got, chunked_jaxpr), (want, full_jaxpr) = (_compiled(zoo.train.lm_metrics, m, batch) for m in (chunked, full))
    assert 0 < float(want["correct"].sum()) < float(want["weight"].sum())
    np.testing.assert_array_equal(got["correct"], want["correct"])
    np.testing.assert_array_equal(got["weight"], want["weight"])
    assert_rounding_close(got["loss"], want["loss"], **SUMS, what="loss")
    # The held-out loss is the data's cross-entropy alone: a MoE's router term, which the
    # training loss adds, is not in it (the cross-entropy in float64 from the full logits).
    logits = np.asarray(_forward(full, batch["tokens"]), np.float64)[:, :-1]
    top = logits.max(axis=-1, keepdims=True)
    logps = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logps, batch["tokens"][:, 1:, None], axis=-1)[..., 0]
    data_loss = np.sum(nll * np.asarray(target_weights(jax.tree.map(jnp.asarray, batch))), axis=1) * batch["weight"]
    assert_rounding_close(want["loss"], data_loss, **SUMS, what="held-out loss = cross-entropy")
    assert not _holds_full_logits(chunked_jaxpr) and _holds_full_logits(full_jaxpr)  # the check can fail


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)
