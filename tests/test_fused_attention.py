"""Attention through `jax.nn.dot_product_attention` (`zoo.nn._attention.fused_attention`, cuDNN's
fused kernel on a GPU in half precision) equals zoo's einsum attention: run here on CPU
with jax's `"xla"` implementation in its place, a decoder's loss and gradients agree
within float32 rounding for every mask kind (causal with grouped-query heads, a sliding
window, per-layer windows, padding, packed documents); soft-capped scores keep the einsum
path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_rounding_close, lm_batch, tiny_decoder

import zoo
import zoo.nn._attention as attention_module

BATCH, SEQ = 4, 8
# Two orders of the same sums: the longest a gradient's over the batch's tokens, through 2
# layers of ~6 chained sums and the head, twice for the backward pass.
SUMS = {"terms": BATCH * SEQ, "depth": 2 * (2 * 6 + 1)}

MODELS = {
    "causal-gqa": {},
    "sliding": dict(sliding_window=3),
    "per-layer-windows": dict(sliding_window=3, sliding_layers=(True, False)),  # a traced window
    "softcapped": dict(attn_logit_softcapping=2.0),
}


def _batch(kind: str):
    batch = lm_batch(jax.random.key(1), BATCH, seq=SEQ)  # right-padded rows: a padding mask
    if kind == "packed":
        segments = (jnp.arange(SEQ)[None] >= 3 + jnp.arange(BATCH)[:, None] % 2).astype(jnp.int32)
        starts = jnp.where(segments == 0, 0, 3 + jnp.arange(BATCH)[:, None] % 2)
        return {"tokens": batch["tokens"], "segment_ids": segments, "positions": jnp.arange(SEQ)[None] - starts}
    return batch


def _loss_and_grads(settings: dict, batch: dict):
    model = tiny_decoder(jax.random.key(0), **settings)

    def mean_loss(m):
        sums, counts = zoo.models.next_token_loss(m, batch)
        return sums.sum() / counts.sum()

    return eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model)


@pytest.mark.parametrize("kind", [*MODELS, "packed"])
def test_dot_product_attention_equals_the_einsum_attention(kind, monkeypatch):
    settings, batch = MODELS.get(kind, {}), _batch(kind)
    want_loss, want = _loss_and_grads(settings, batch)
    calls = []

    def xla_here(dtype, head_dim):
        calls.append(dtype)
        return "xla"

    monkeypatch.setattr(attention_module, "fused_implementation", xla_here)
    loss, grads = _loss_and_grads(settings, batch)
    if kind == "softcapped":  # the fused kernels take no soft-capping: the einsum path, unchanged
        assert calls == [] and float(loss) == float(want_loss)
        return
    assert calls, "the decoder never took the fused path"
    assert_rounding_close(loss, want_loss, **SUMS, what="loss")
    for (path, w), g in zip(jax.tree.leaves_with_path(eqx.filter(want, eqx.is_array)), jax.tree.leaves(eqx.filter(grads, eqx.is_array)), strict=True):  # fmt: skip
        assert_rounding_close(g, w, **SUMS, what=f"gradient{jax.tree_util.keystr(path)}")


def test_cudnn_only_on_a_gpu_in_half_precision():
    from zoo.nn._attention import fused_implementation

    assert jax.default_backend() != "gpu" or fused_implementation(jnp.bfloat16, 64) == "cudnn"
    assert fused_implementation(jnp.bfloat16, 12) is None and fused_implementation(jnp.bfloat16, 256) is None
    assert fused_implementation(jnp.float32) is None
    if jax.default_backend() == "cpu":
        assert fused_implementation(jnp.bfloat16) is None  # the CPU programs stay zoo's own
