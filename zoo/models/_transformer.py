"""Decoder-only transformer language model (GPT-2 / Llama family), layers scanned."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._checks import check_array
from ..nn import (
    Attention,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    RMSNorm,
    Stacked,
    TransformerBlock,
    broadcast_like,
    dropout,
    fold_in,
)
from ..nn._dropout import EMBEDDING_STREAM, ExampleKeys
from ._config import TransformerConfig


def make_norm(kind: str, dim: int, eps: float) -> LayerNorm | RMSNorm:
    """A `LayerNorm` or `RMSNorm` over the embed axis."""
    return LayerNorm(dim, eps=eps) if kind == "layernorm" else RMSNorm(dim, eps=eps)


def make_block(config, *, causal: bool, norm: str, pre_norm: bool, rope: bool, key: PRNGKeyArray) -> TransformerBlock:
    """One `TransformerBlock` as a config describes it."""
    ka, km = jr.split(key)
    attention = Attention(
        config.d_model,
        config.num_heads,
        num_kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        causal=causal,
        rope_theta=getattr(config, "rope_theta", None) if rope else None,
        dropout_rate=config.attention_dropout,
        use_bias=config.use_bias,
        init_std=config.init_std,
        key=ka,
    )
    mlp = FeedForward(
        config.d_model,
        config.hidden_dim,
        activation=config.activation,
        use_bias=config.use_bias,
        init_std=config.init_std,
        key=km,
    )
    return TransformerBlock(
        attention,
        mlp,
        make_norm(norm, config.d_model, config.norm_eps),
        make_norm(norm, config.d_model, config.norm_eps),
        pre_norm=pre_norm,
        dropout_rate=config.dropout,
    )


class Transformer(eqx.Module):
    """A decoder-only language model: tokens `[batch, seq]` → logits `[batch, seq, vocab]`.

    Token embedding (+ learned positions) → `num_layers` causal `TransformerBlock`s stacked
    on a leading `"layers"` axis and run by `lax.scan` → final norm → output head (the
    token embedding itself when `tie_embeddings`). Parameters are float32; activations
    run in `config.dtype`; logits come out float32.
    """

    token_embedding: Embedding
    position_embedding: Embedding | None
    layers: Stacked[TransformerBlock]
    final_norm: LayerNorm | RMSNorm
    lm_head: Linear | None
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        """**Arguments:** a `TransformerConfig` and a PRNG `key`."""
        kt, kp, kl, kh = jr.split(key, 4)
        d = config.d_model
        self.token_embedding = Embedding(config.vocab_size, d, init_std=config.init_std, key=kt)
        self.position_embedding = (
            Embedding(config.max_len, d, init_std=config.init_std, row_axis=None, key=kp)
            if config.positions == "learned"
            else None
        )
        self.layers = Stacked(
            lambda k: make_block(
                config, causal=True, norm=config.norm, pre_norm=config.pre_norm, rope=config.positions == "rope", key=k
            ),
            config.num_layers,
            remat=config.remat,
            key=kl,
        )
        self.final_norm = make_norm(config.norm, d, config.norm_eps)
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(d, config.vocab_size, use_bias=False, in_axis="embed", out_axis="vocab", init_std=config.init_std, key=kh)
        )
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch seq {self.config.vocab_size}"]:
        """Next-token logits.

        **Arguments:**

        - `tokens`: `[batch, seq]` integer ids, `seq ≤ max_len`.
        - `mask`: optional `[batch, seq]`, `True` at real tokens (padded keys are ignored).
        - `key`: one PRNG key per example (`[batch]`, see `zoo.nn.example_keys`) to turn
          dropout on; `None` for inference.

        **Returns:** float32 logits `[batch, seq, vocab]`.
        """
        check_array(tokens, where="Transformer", name="tokens", kind="int", ndim=2)
        seq = tokens.shape[1]
        if seq > self.config.max_len:
            raise ValueError(f"sequence length {seq} exceeds the model's max_len {self.config.max_len}")
        dtype = self.config.compute_dtype
        h = self.token_embedding(tokens).astype(dtype)
        if self.position_embedding is not None:
            h = h + broadcast_like(self.position_embedding.weight[:seq].astype(dtype), h)
        h = dropout(h, self.config.dropout, None if key is None else fold_in(key, EMBEDDING_STREAM))
        h = self.layers(h, mask=mask, key=key)
        h = self.final_norm(h)
        logits = self.token_embedding.attend(h) if self.lm_head is None else self.lm_head(h)
        return logits.astype(jnp.float32)
