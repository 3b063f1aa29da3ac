"""BERT-style encoder with mean or CLS pooling, laid out to hold Hugging Face BERT weights."""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._checks import check_array
from ..nn import Embedding, LayerNorm, Linear, Stacked, TransformerBlock, broadcast_like, dropout, fold_in
from ..nn._dropout import EMBEDDING_STREAM, ExampleKeys
from ..nn._inputs import place_inputs
from ._config import EncoderConfig
from ._transformer import make_block

# A dropout stream of its own for the pooled vector (the layers use theirs).
_POOLER_STREAM = EMBEDDING_STREAM - 1


class EncoderEmbeddings(eqx.Module):
    """Word + position + token-type embeddings, then LayerNorm (BERT's `embeddings`;
    RoBERTa's with `positions_after_pad`: position ids from the tokens, `roberta_positions`)."""

    word_embeddings: Embedding
    position_embeddings: Embedding
    token_type_embeddings: Embedding
    norm: LayerNorm
    positions_after_pad: bool = eqx.field(static=True, default=False)
    pad_token_id: int = eqx.field(static=True, default=0)

    def __init__(self, config: EncoderConfig, *, key: PRNGKeyArray):
        """**Arguments:** an `EncoderConfig` and a PRNG `key`."""
        kw, kp, kt = jr.split(key, 3)
        self.positions_after_pad, self.pad_token_id = config.positions_after_pad, config.pad_token_id
        d, std = config.d_model, config.init_std
        self.word_embeddings = Embedding(config.padded_vocab, d, init_std=std, key=kw)
        self.position_embeddings = Embedding(config.max_len, d, init_std=std, row_axis=None, key=kp)
        self.token_type_embeddings = Embedding(config.type_vocab_size, d, init_std=std, row_axis=None, key=kt)
        self.norm = LayerNorm(d, eps=config.norm_eps)

    def __call__(
        self, tokens: Int[Array, "batch seq"], token_types: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq embed"]:
        """Sum the three embeddings of each position and normalise."""
        # Summed in float32 (at least) so tables stored in bfloat16 (`zoo.lora.cast_frozen`)
        # are rounded once, not again in the sum and the norm's output.
        dtype = jnp.promote_types(self.word_embeddings.weight.dtype, jnp.float32)
        h = self.word_embeddings(tokens).astype(dtype) + self.token_type_embeddings(token_types).astype(dtype)
        if self.positions_after_pad:
            h = h + self.position_embeddings(roberta_positions(tokens, self.pad_token_id)).astype(dtype)
        else:
            h = h + broadcast_like(self.position_embeddings.weight[: tokens.shape[1]].astype(dtype), h)
        return self.norm(h)


def roberta_positions(tokens: Int[Array, "batch seq"], pad_token_id: int) -> Int[Array, "batch seq"]:
    """RoBERTa's position ids (transformers' `create_position_ids_from_input_ids`): the
    real tokens numbered `pad_token_id + 1, + 2, …` (pad tokens not counted), pad tokens
    `pad_token_id`."""
    real = (tokens != pad_token_id).astype(tokens.dtype)
    return jnp.cumsum(real, axis=1) * real + pad_token_id


class Encoder(eqx.Module):
    """A BERT-style encoder: tokens `[batch, seq]` → hidden states `[batch, seq, d_model]`.

    Post-LN blocks with GELU, learned positions, token types, a padding mask; layers stacked
    on a leading `"layers"` axis and run by `lax.scan`. Leaves map one-to-one onto HF
    `BertModel` tensors (`embeddings.word_embeddings.weight` ↔
    `embeddings.word_embeddings.weight`; `encoder.layer.{i}.attention.self.query.weight` ↔
    `layers.layers.attention.q_proj.weight[i]` transposed; …; see docs/models.md).
    """

    embeddings: EncoderEmbeddings
    layers: Stacked[TransformerBlock]
    config: EncoderConfig = eqx.field(static=True)

    def __init__(self, config: EncoderConfig, *, key: PRNGKeyArray):
        """**Arguments:** an `EncoderConfig` and a PRNG `key`."""
        ke, kl = jr.split(key)
        self.embeddings = EncoderEmbeddings(config, key=ke)
        self.layers = Stacked(
            lambda k: make_block(config, causal=False, norm="layernorm", pre_norm=False, rope=False, key=k),
            config.num_layers,
            remat=config.remat,
            key=kl,
        )
        self.config = config

    @place_inputs
    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        token_types: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch seq {self.config.d_model}"]:
        """Contextual embeddings of every position.

        **Arguments:**

        - `tokens`: `[batch, seq]` ids, `seq ≤ max_len`.
        - `mask`: `[batch, seq]`, `True` at real tokens (default: `tokens != pad_token_id`).
        - `token_types`: `[batch, seq]` segment ids (default zeros).
        - `key`: one PRNG key per example for dropout, or `None`.

        **Returns:** `[batch, seq, d_model]` hidden states in `config.dtype`.
        """
        check_array(tokens, where="Encoder", name="tokens", kind="int", ndim=2)
        seq = tokens.shape[1]
        if seq > self.config.max_seq:
            offset = " (max_len less RoBERTa's pad_token_id + 1)" if self.config.positions_after_pad else ""
            raise ValueError(f"sequence length {seq} exceeds the model's max_len {self.config.max_seq}{offset}")
        if mask is None:
            mask = tokens != self.config.pad_token_id
        if token_types is None:
            token_types = jnp.zeros_like(tokens)
        h = self.embeddings(tokens, token_types).astype(self.config.compute_dtype)
        h = dropout(h, self.config.dropout, None if key is None else fold_in(key, EMBEDDING_STREAM))
        return self.layers(h, mask=mask, key=key)


def mean_pool(hidden: Float[Array, "batch seq embed"], mask: Bool[Array, "batch seq"]) -> Float[Array, "batch embed"]:
    """Average of the hidden states at real tokens (sentence-transformers' mean pooling), float32."""
    weights = mask.astype(jnp.float32)
    summed = jnp.einsum("bsd,bs->bd", hidden.astype(jnp.float32), weights)
    return summed / jnp.maximum(jnp.sum(weights, axis=1), 1e-9)[:, None]


class EncoderClassifier(eqx.Module):
    """An `Encoder`, a pooling of its hidden states, and a linear classification head (`head`).

    `pooling="mean"` (the default) averages the hidden states at real tokens
    (sentence-transformers' way). `pooling="cls"` is Hugging Face
    `BertForSequenceClassification`: the first (`[CLS]`) token's hidden state through
    `pooler` (a dense layer, then tanh: BERT's `bert.pooler.dense`), then the head
    (`classifier`). `zoo.hf.load_bert_classifier` loads such a checkpoint.
    """

    encoder: Encoder
    pooler: Linear | None
    head: Linear
    num_labels: int = eqx.field(static=True)
    pooling: Literal["mean", "cls"] = eqx.field(static=True)

    def __init__(
        self, encoder: Encoder, num_labels: int, *, pooling: Literal["mean", "cls"] = "mean", key: PRNGKeyArray
    ):
        """**Arguments:** the `encoder`, the number of classes, `pooling` (`"mean"` or
        `"cls"`, see above), a PRNG `key` for the head (and the pooler)."""
        if pooling not in ("mean", "cls"):
            raise ValueError(f"EncoderClassifier pooling must be 'mean' or 'cls', got {pooling!r}")
        d, std = encoder.config.d_model, encoder.config.init_std
        self.encoder = encoder
        # The pooler's key is folded off, so the head of a mean-pooling classifier is what it always was.
        self.pooler = (
            Linear(d, d, in_axis="embed", out_axis=None, init_std=std, key=jr.fold_in(key, 1))
            if pooling == "cls"
            else None
        )
        self.head = Linear(d, num_labels, in_axis="embed", out_axis=None, init_std=std, key=key)
        self.num_labels = num_labels
        self.pooling = pooling

    @place_inputs
    def features(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        token_types: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch {self.encoder.config.d_model}"]:
        """What the head reads, `[batch, d_model]` (float32): the mean of the hidden states
        at real tokens, or the `[CLS]` state through the pooler and tanh (then dropout,
        with `key`). Arguments as `__call__`'s."""
        if mask is None:
            mask = tokens != self.encoder.config.pad_token_id
        hidden = self.encoder(tokens, mask=mask, token_types=token_types, key=key)
        if self.pooler is None:
            return mean_pool(hidden, mask)
        pooled = jnp.tanh(self.pooler(hidden[:, 0].astype(jnp.float32)))
        # BertForSequenceClassification's dropout sits between the pooler and the head.
        return dropout(pooled, self.encoder.config.dropout, None if key is None else fold_in(key, _POOLER_STREAM))

    @place_inputs
    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        token_types: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch {self.num_labels}"]:
        """Class logits `[batch, num_labels]` (float32): the head on `features`.

        **Arguments:** `tokens` `[batch, seq]`; `mask` (default: `tokens !=
        pad_token_id`), `token_types` and `key` as the `Encoder`'s."""
        return self.head(self.features(tokens, mask=mask, token_types=token_types, key=key))
