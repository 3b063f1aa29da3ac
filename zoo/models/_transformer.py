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
    Experts,
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
from ..nn._cache import KVCache
from ..nn._dropout import EMBEDDING_STREAM, ExampleKeys
from ..nn._experts import RouterChoice
from ..nn._inputs import place_inputs
from ..nn._pattern import LayerPattern
from ..nn._rope import RopeScaling
from ..nn._stacked import Unstacked
from ._config import TransformerConfig, rope_scaling_of


def make_norm(kind: str, dim: int, eps: float) -> LayerNorm | RMSNorm:
    """A `LayerNorm` or `RMSNorm` over the embed axis."""
    return LayerNorm(dim, eps=eps) if kind == "layernorm" else RMSNorm(dim, eps=eps)


def _bias(config, name: str) -> bool:
    value = getattr(config, name, None)
    return config.use_bias if value is None else value


def _llama3(config) -> tuple[float, float, float, int] | None:
    if getattr(config, "rope_scaling", None) != "llama3":
        return None
    return (config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_original_max_len)


def _uniform_linear(factors: tuple[float, ...]) -> RopeScaling | None:
    """Every layer's linear RoPE factor when they are one (not 1): the block's own scaling,
    where differing ones come per layer (`LayerPattern.rope_factor`)."""
    if len(set(factors)) != 1 or factors[0] == 1.0:
        return None
    return RopeScaling("linear", factor=factors[0])


def rotary_dim(config) -> int | None:
    """The head dimensions RoPE rotates, `int(head_dim · partial_rotary_factor)` as
    transformers computes it; `None`: all of them."""
    factor = getattr(config, "partial_rotary_factor", 1.0)
    if factor == 1.0:
        return None
    return int((config.head_dim or config.d_model // config.num_heads) * factor)


def layer_settings(config) -> dict[str, tuple]:
    """Each layer's attention settings (`window`: `None` on a global layer; `rope`;
    `rope_theta`; `rope_factor`, its linear RoPE scaling), one value per layer, from a
    config's per-layer patterns."""
    layers = range(config.num_layers)
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "sliding_layers", None) or (True,) * config.num_layers
    rope = getattr(config, "rope_layers", None) or (getattr(config, "positions", None) == "rope",) * config.num_layers
    thetas = getattr(config, "rope_thetas", None) or (getattr(config, "rope_theta", None),) * config.num_layers
    factors = getattr(config, "rope_factors", None) or (1.0,) * config.num_layers
    return {
        "window": tuple(window if sliding[i] else None for i in layers),
        "rope": tuple(rope),
        "rope_theta": tuple(thetas),
        "rope_factor": tuple(factors),
    }


def layer_pattern(config) -> LayerPattern | None:
    """The settings in which a config's layers differ, as the arrays `Stacked` scans
    (`LayerPattern`), or `None`: every layer alike."""
    return LayerPattern.of_layers(**layer_settings(config))


def make_block(config, *, causal: bool, norm: str, pre_norm: bool, rope: bool, key: PRNGKeyArray) -> TransformerBlock:
    """One `TransformerBlock` as a config describes it: the attention settings its layers
    share are the block's own; those that differ come per layer (`layer_pattern`)."""
    ka, km = jr.split(key)
    settings = layer_settings(config)
    window = settings["window"][0] if len(set(settings["window"])) == 1 else None
    rope = rope and any(settings["rope"])
    attention = Attention(
        config.d_model,
        config.num_heads,
        num_kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        causal=causal,
        rope_theta=settings["rope_theta"][0] if rope else None,
        dropout_rate=config.attention_dropout,
        use_bias=config.use_bias,
        init_std=config.init_std,
        rope_llama3=_llama3(config) if rope else None,
        rope_scaling=(rope_scaling_of(config) or _uniform_linear(settings["rope_factor"])) if rope else None,
        sliding_window=window,
        qk_norm=getattr(config, "qk_norm", False) and getattr(config, "qk_norm_scope", "head"),
        norm_eps=config.norm_eps,
        logit_softcap=getattr(config, "attn_logit_softcapping", None),
        query_scale=getattr(config, "query_pre_attn_scalar", None),
        rope_dim=rotary_dim(config) if rope else None,
        key=ka,
    )
    experts = getattr(config, "num_experts", None)
    mlp = (
        FeedForward(
            config.d_model,
            config.hidden_dim,
            activation=config.activation,
            use_bias=_bias(config, "mlp_bias"),
            init_std=config.init_std,
            key=km,
        )
        if experts is None
        else Experts(
            config.d_model,
            config.expert_dim,
            experts,
            config.num_experts_per_tok,
            normalize=config.norm_topk_prob,
            dispatch=config.moe_dispatch,
            init_std=config.init_std,
            key=km,
        )
    )
    # Per-group biases (Qwen2: q/k/v only): drop the ones the config turns off, add the
    # ones it turns on.
    for name, projections in (("qkv_bias", ("q_proj", "k_proj", "v_proj")), ("o_bias", ("o_proj",))):
        want = _bias(config, name)
        if want == config.use_bias:
            continue

        def where(a, ps=projections):
            return [getattr(a, p).bias for p in ps]

        biases = [jnp.zeros((getattr(attention, p).out_features,)) if want else None for p in projections]
        attention = eqx.tree_at(where, attention, biases, is_leaf=lambda x: x is None)
    # Where the layer's norms sit: on each sub-layer's input, its output (OLMo 2), or both.
    placement = getattr(config, "norm_placement", "input")
    inputs, outputs = placement in ("input", "sandwich"), placement in ("output", "sandwich")

    def norms(wanted: bool) -> list[LayerNorm | RMSNorm | None]:
        return [make_norm(norm, config.d_model, config.norm_eps) if wanted else None for _ in range(2)]

    (attention_norm, mlp_norm), (attention_out_norm, mlp_out_norm) = norms(inputs), norms(outputs)
    return TransformerBlock(
        attention,
        mlp,
        attention_norm,
        mlp_norm,
        pre_norm=pre_norm,
        dropout_rate=config.dropout,
        attention_out_norm=attention_out_norm,
        mlp_out_norm=mlp_out_norm,
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
    layers: Stacked[TransformerBlock] | Unstacked[TransformerBlock]
    final_norm: LayerNorm | RMSNorm
    lm_head: Linear | None
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray):
        """**Arguments:** a `TransformerConfig` and a PRNG `key`."""
        kt, kp, kl, kh = jr.split(key, 4)
        d = config.d_model
        self.token_embedding = Embedding(config.padded_vocab, d, init_std=config.init_std, key=kt)
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
            else Linear(
                d,
                config.padded_vocab,
                use_bias=False,
                in_axis="embed",
                out_axis="vocab",
                init_std=config.init_std,
                key=kh,
            )
        )
        self.config = config

    @place_inputs
    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch seq {self.config.padded_vocab}"]:
        """Next-token logits.

        **Arguments:**

        - `tokens`: `[batch, seq]` integer ids, `seq ≤ max_len`.
        - `mask`: optional `[batch, seq]`, `True` at real tokens (padded keys are ignored).
        - `segment_ids`: optional `[batch, seq]` ids of the documents packed into each row
          (`zoo.data.pack`): attention never crosses from one segment to another.
        - `positions`: optional `[batch, seq]` positions (restarting at 0 at each packed
          document), for RoPE or the learned position table; default `0..seq-1`.
        - `key`: one PRNG key per example (`[batch]`, see `zoo.nn.example_keys`) to turn
          dropout on; `None` for inference.

        A packed row's logits equal those of each of its documents run alone.

        **Returns:** float32 logits `[batch, seq, padded_vocab]` (`padded_vocab` =
        `vocab_size` unless `config.vocab_multiple` pads it; padded entries are the float32
        minimum, so softmax, cross-entropy and argmax equal the unpadded model's).
        """
        return self._forward(tokens, mask, segment_ids, positions, key, router=False)

    @place_inputs
    def hidden(
        self, tokens: Int[Array, "batch seq"], *, router: bool = False, **inputs: Array | None
    ) -> Float[Array, "batch seq embed"] | tuple[Float[Array, "batch seq embed"], RouterChoice]:
        """The last layer's output, `head`'s input: `__call__` without the head (`inputs`,
        its keyword inputs: `mask=`, `segment_ids=`, `positions=`, `key=`), for losses that
        apply the head a chunk of positions at a time (the full logits `[batch, seq,
        vocab]` never held); with `router` (a mixture of experts), `(hidden,
        RouterChoice)` as `with_router`."""
        return self._forward(tokens, **inputs, router=router, head=False)

    def _forward(
        self, tokens, mask=None, segment_ids=None, positions=None, key=None, *, router: bool, head: bool = True
    ):
        """`__call__`'s logits (the last layer's output without `head`); with `router`,
        `(logits, RouterChoice)` (`with_router`)."""
        check_array(tokens, where="Transformer", name="tokens", kind="int", ndim=2)
        seq = tokens.shape[1]
        if seq > self.config.max_len:
            raise ValueError(f"sequence length {seq} exceeds the model's max_len {self.config.max_len}")
        h = self.embed(tokens, positions, key=key)
        packing = (
            {} if segment_ids is None and positions is None else dict(segment_ids=segment_ids, positions=positions)
        )
        out = self.head if head else (lambda x: x)
        if not router:
            return out(self.layers(h, mask=mask, key=key, **packing, **self._pattern()))
        h, choice = self.layers(h, mask=mask, key=key, router=True, **packing, **self._pattern())
        return out(h), choice

    @place_inputs
    def with_router(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
    ) -> tuple[Float[Array, "batch seq {self.config.padded_vocab}"], RouterChoice]:
        """The logits (as `__call__`, the same arguments) and what every layer's router
        chose, for the load-balancing loss (`zoo.nn.load_balancing_loss(choice.probs,
        choice.chosen, mask)`, transformers' `aux_loss`); a mixture-of-experts model only
        (`config.num_experts`).

        **Returns:** `(logits, RouterChoice)` whose fields are `[layers, batch, seq,
        experts]`.
        """
        if self.config.num_experts is None:
            raise ValueError("Transformer.with_router: this model has no experts (config.num_experts is None)")
        return self._forward(tokens, mask, segment_ids, positions, key, router=True)

    def embed(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"] | None = None,
        *,
        key: ExampleKeys | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """The layers' input: the token embedding in the compute dtype (times `embed_scale`),
        plus the learned positions (at `positions`, default `0..seq-1`), dropout with `key`."""
        dtype = self.config.compute_dtype
        h = self.token_embedding(tokens).astype(dtype)
        if self.config.embed_scale != 1.0:
            h = h * jnp.asarray(self.config.embed_scale, dtype)
        if self.position_embedding is not None and positions is not None:
            h = h + self.position_embedding(positions).astype(dtype)
        elif self.position_embedding is not None:
            h = h + broadcast_like(self.position_embedding.weight[: tokens.shape[1]].astype(dtype), h)
        return dropout(h, self.config.dropout, None if key is None else fold_in(key, EMBEDDING_STREAM))

    def head(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch {self.config.padded_vocab}"]:
        """The last layer's output `h` → float32 logits: final norm, output head (the token
        embedding when tied), soft-capped with `final_logit_softcapping` (`cap * tanh(logits /
        cap)`), the padded vocabulary's entries at the float32 minimum."""
        h = self.final_norm(h)
        logits = self.token_embedding.attend(h) if self.lm_head is None else self.lm_head(h)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * jnp.tanh(logits / cap)
        if self.config.padded_vocab != self.config.vocab_size:
            real = jnp.arange(self.config.padded_vocab) < self.config.vocab_size
            logits = jnp.where(real, logits, jnp.finfo(jnp.float32).min)
        return logits

    def extend(
        self, tokens: Int[Array, "batch seq"], cache: KVCache, *, mask: Bool[Array, "batch seq"] | None = None
    ) -> tuple[Float[Array, "batch seq embed"], KVCache]:
        """The forward pass of inference: `tokens` after the columns `cache` holds.

        The same embedding and layers as `__call__` (no dropout), each layer reading and
        writing its keys and values in `cache` (`KVCache`: stacked for the scanned layers;
        split or in blocks when `layers` is `Unstacked`). A prompt's prefill is an empty
        cache extended by the prompt; a decode step, the cache extended by one token.

        **Arguments:** `tokens` `[batch, seq]` (written at the cache's columns `index …
        index+seq`), the `cache`, `mask` `[batch, seq]` (`True` at real tokens; default
        all): each row's positions count on from the cache's.

        **Returns:** `(the last layer's output [batch, seq, embed] (`head` gives the
        logits), the cache holding the new columns, its positions and index moved on)`.
        """
        mask = jnp.ones_like(tokens, dtype=bool) if mask is None else mask
        cache, positions = cache.extend(mask)
        h, cache = self.layers(self.embed(tokens, positions), positions=positions, cache=cache, **self._pattern())
        return h, cache.advance(mask)

    def _pattern(self) -> dict[str, LayerPattern]:
        """`pattern=` the layers' `LayerPattern` where they differ (none: uniform layers)."""
        pattern = layer_pattern(self.config)
        return {} if pattern is None else {"pattern": pattern}
