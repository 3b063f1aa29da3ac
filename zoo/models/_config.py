"""Configs of the zoo's transformer models: frozen dataclasses, validated on creation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax.numpy as jnp

from ..nn import ACTIVATIONS, REMAT_POLICIES
from ..nn._rope import RopeScaling

Norm = Literal["layernorm", "rmsnorm"]
Positions = Literal["learned", "rope", "none"]


def rope_scaling_of(config: Any) -> RopeScaling | None:
    """The `zoo.nn.RopeScaling` of a config's `rope_scaling` "linear", "yarn" or "longrope"
    fields (None otherwise: no scaling, or Llama 3.1's, which `Attention` takes apart)."""
    kind = getattr(config, "rope_scaling", None)
    if kind not in ("linear", "yarn", "longrope"):
        return None
    return RopeScaling(
        kind,
        factor=config.rope_factor,
        original_max_len=None if kind == "linear" else config.rope_original_max_len,
        attention_factor=config.rope_attention_factor,
        beta_fast=config.rope_beta_fast,
        beta_slow=config.rope_beta_slow,
        truncate=config.rope_truncate,
        short_factor=config.rope_short_factor,
        long_factor=config.rope_long_factor,
    )


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class _Common:
    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    mlp_dim: int | None = None  # default 4 * d_model
    max_len: int = 512
    num_kv_heads: int | None = None  # default num_heads
    head_dim: int | None = None  # default d_model // num_heads
    activation: str = "gelu"
    norm_eps: float = 1e-5
    use_bias: bool = True
    dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype; parameters stay float32
    remat: str | None = "auto"  # the stacked layers' jax.checkpoint policy: a name, "auto" or None (off)
    vocab_multiple: int = 1  # embedding rows (and logits) padded to a multiple of this
    family: str | None = None  # the Hugging Face architecture (model_type) it reads/writes
    source_dir: str | None = None  # the Hugging Face folder it was loaded from

    def __post_init__(self):
        name = type(self).__name__
        for field in ("vocab_size", "d_model", "num_heads", "num_layers", "max_len"):
            _check(getattr(self, field) >= 1, f"{name}.{field} must be >= 1, got {getattr(self, field)}")
        _check(
            self.head_dim is not None or self.d_model % self.num_heads == 0,
            f"{name}: d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}), "
            "or set head_dim explicitly",
        )
        _check(
            self.num_heads % self.kv_heads == 0,
            f"{name}: num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads})",
        )
        _check(
            self.activation in ACTIVATIONS,
            f"{name}.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}",
        )
        _check(
            0.0 <= self.dropout < 1.0 and 0.0 <= self.attention_dropout < 1.0,
            f"{name}: dropout rates must be in [0, 1)",
        )
        _check(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"{name}.dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}",
        )
        _check(self.vocab_multiple >= 1, f"{name}.vocab_multiple must be >= 1, got {self.vocab_multiple}")
        _check(
            self.remat is None or self.remat == "auto" or self.remat in REMAT_POLICIES,
            f"{name}.remat must be 'auto', None (no remat) or one of {list(REMAT_POLICIES)}, got {self.remat!r}",
        )

    @property
    def hidden_dim(self) -> int:
        """The feed-forward width (`mlp_dim`, default `4 * d_model`)."""
        return 4 * self.d_model if self.mlp_dim is None else self.mlp_dim

    @property
    def expert_dim(self) -> int:
        """Each expert's hidden width (`moe_mlp_dim`, default the feed-forward width)."""
        return getattr(self, "moe_mlp_dim", None) or self.hidden_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding (and logits): `vocab_size` rounded up to a multiple of
        `vocab_multiple`, so the vocabulary splits evenly over a model axis."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    @property
    def kv_heads(self) -> int:
        """Key/value heads (`num_kv_heads`, default `num_heads`)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def compute_dtype(self) -> Any:
        """The activations' dtype as a numpy dtype."""
        return jnp.dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Build a config from a dict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(_Common):
    """A decoder-only (GPT-style) language model.

    Sizes: `vocab_size`, `d_model`, `num_heads`, `num_layers`, `mlp_dim` (default
    4·d_model), `max_len`, `num_kv_heads` (grouped-query attention), `head_dim`.
    Choices: `norm` (`"layernorm"`/`"rmsnorm"`), `positions` (`"learned"`, `"rope"`,
    `"none"`), `rope_theta`, `activation` (`"gelu"`, `"gelu_tanh"`, `"relu"`, `"swiglu"`, `"geglu"`),
    `tie_embeddings` (the output head is the token embedding), `use_bias` (with
    `qkv_bias`, `o_bias`, `mlp_bias` overriding it per projection group), `sliding_window`
    (banded causal attention), per-layer patterns (one value per layer, scanned as data:
    one compiled layer body): `sliding_layers` (which layers use `sliding_window`; default
    all), `rope_layers` (which layers apply RoPE; SmolLM3's NoPE layers are `False`),
    `rope_thetas` (each layer's RoPE base), `rope_factors` (each layer's linear RoPE factor:
    Gemma 3 scales its global layers only), `rope_scaling="llama3"` with `rope_factor`,
    `rope_low_freq_factor`, `rope_high_freq_factor`, `rope_original_max_len`, or
    `"linear"` / `"yarn"` / `"longrope"` (`zoo.nn.RopeScaling`: `rope_factor`,
    `rope_original_max_len`, `rope_attention_factor`, yarn's `rope_beta_fast`,
    `rope_beta_slow`, `rope_truncate`, longrope's `rope_short_factor`, `rope_long_factor`), `embed_scale`
    (the token embeddings' multiplier, Gemma's `sqrt(d_model)`), `qk_norm` (each query and
    key head RMS-normalised over `head_dim` before RoPE, Qwen3's; with
    `qk_norm_scope="projection"`, the whole query and key projections, OLMo 2's), `pre_norm`
    (post-LN when false), `norm_placement` (where a pre-LN layer's norms sit: `"input"`, on
    each sub-layer's input, Llama's; `"output"`, on each sub-layer's output before its
    residual add, OLMo 2's; `"sandwich"`, both, Gemma 2/3's), `attn_logit_softcapping` and
    `final_logit_softcapping` (attention scores and logits soft-capped, `cap * tanh(x / cap)`,
    Gemma 2's), `query_pre_attn_scalar` (scores divided by its square root instead of
    `head_dim`'s, Gemma 2/3's), `partial_rotary_factor` (RoPE rotates the first
    `int(head_dim · factor)` dimensions of each head, its frequencies those of a head that
    wide, and passes the rest through: Phi-4-mini's 0.75), `dropout`/`attention_dropout`, `init_std`, `dtype` (compute dtype;
    parameters, gradients and their all-reduce stay float32), `remat` (the stacked layers'
    `jax.checkpoint` policy, one of `zoo.nn.REMAT_POLICIES`; `None`, none; `"auto"`, the
    default, `"projections"` when the residuals the layers would keep without remat are
    estimated above 1 GiB from the input's shape at trace time, else none: see
    `zoo.nn.Stacked`),
    `vocab_multiple` (pad the vocabulary so it splits over a model axis; padded logits are
    the float32 minimum, so softmax, loss and argmax equal the unpadded model's),
    `num_experts` (a sparse mixture-of-experts SwiGLU feed-forward in every layer,
    `zoo.nn.Experts`: `num_experts_per_tok` experts per token, each `moe_mlp_dim` wide,
    the top-k router weights renormalised when `norm_topk_prob`; `router_aux_loss_coef`, the
    load-balancing loss's weight, added to `next_token_loss` when `output_router_logits`
    (transformers' condition); `moe_dispatch`, how tokens reach their experts),
    `loss_chunk` (how the next-token losses, `zoo.models.next_token_loss`, DPO/ORPO's and
    GRPO's, apply the output head: an int `n`, `n` positions at a time under
    `jax.checkpoint`, so the logits `[batch, seq, vocab]` are never held whole, forward or
    backward; `None`, all at once, the full logits; `"auto"`, the default, chunked when a
    batch's float32 logits would exceed 128 MiB, in chunks of about 64 MiB), `family`
    and `source_dir` (the Hugging Face architecture and folder, set by `zoo.hf`).
    """

    activation: str = "gelu_tanh"
    norm: Norm = "layernorm"
    positions: Positions = "learned"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    pre_norm: bool = True
    qkv_bias: bool | None = None  # biases on q/k/v (default use_bias)
    o_bias: bool | None = None  # bias on the attention output (default use_bias)
    mlp_bias: bool | None = None  # biases in the feed-forward (default use_bias)
    sliding_window: int | None = None  # banded causal attention (Mistral)
    rope_scaling: str | None = None  # None, "llama3", "linear", "yarn" or "longrope", with the fields below
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_attention_factor: float | None = None  # yarn / longrope: cos and sin times this (None: the kind's default)
    rope_beta_fast: float = 32.0  # yarn's ramp, in rotations per original context
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_short_factor: Sequence[float] | None = None  # longrope: per-frequency factors within the original context
    rope_long_factor: Sequence[float] | None = None  # longrope: past it
    embed_scale: float = 1.0  # token embeddings multiplied by this (Gemma: sqrt(d_model))
    qk_norm: bool = False  # each query/key head RMS-normalised before RoPE (Qwen3)
    qk_norm_scope: str = "head"  # "head" (over head_dim: Qwen3) or "projection" (over heads × head_dim: OLMo 2)
    norm_placement: str = "input"  # "input" (pre-LN), "output" (OLMo 2) or "sandwich" (Gemma 2/3)
    sliding_layers: Sequence[bool] | None = None  # per layer: uses sliding_window (default: all)
    rope_layers: Sequence[bool] | None = None  # per layer: applies RoPE (default: all, with positions="rope")
    rope_thetas: Sequence[float] | None = None  # per layer: its RoPE base (default: rope_theta)
    rope_factors: Sequence[float] | None = None  # per layer: its linear RoPE factor (Gemma 3's global layers; 1: none)
    attn_logit_softcapping: float | None = None  # scores soft-capped: cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits soft-capped the same way (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores / sqrt(this) instead of sqrt(head_dim) (Gemma 2/3)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * this) dims of each head (Phi-4-mini)
    num_experts: int | None = None  # a sparse mixture-of-experts feed-forward in every layer (Mixtral); None: dense
    num_experts_per_tok: int = 2  # the experts each token is routed to (top-k)
    moe_mlp_dim: int | None = None  # each expert's hidden width (default mlp_dim; Qwen3-MoE's moe_intermediate_size)
    norm_topk_prob: bool = True  # the top-k router weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's option)
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in the training loss
    output_router_logits: bool = False  # add that loss to next_token_loss (transformers' switch)
    moe_dispatch: str = "dense"  # "dense" (every expert on every token, weighted) or "sorted" (ragged_dot, one device)
    loss_chunk: int | str | None = "auto"  # next-token losses' head applied this many positions at a time (see above)

    def __post_init__(self):
        super().__post_init__()
        for field, kind in (
            ("sliding_layers", bool),
            ("rope_layers", bool),
            ("rope_thetas", float),
            ("rope_factors", float),
        ):
            values = getattr(self, field)
            if values is None:
                continue
            # A config read back from JSON holds lists: tuples keep it hashable (a static field).
            object.__setattr__(self, field, tuple(kind(v) for v in values))
            _check(
                len(getattr(self, field)) == self.num_layers,
                f"TransformerConfig.{field} holds {len(values)} values for {self.num_layers} layers: give one per layer",
            )
        _check(
            self.sliding_layers is None or self.sliding_window is not None,
            "TransformerConfig.sliding_layers is set without a sliding_window: set the window its layers use",
        )
        _check(
            (self.rope_layers is None and self.rope_thetas is None and self.rope_factors is None)
            or self.positions == "rope",
            f"TransformerConfig.rope_layers / rope_thetas / rope_factors need positions='rope', got {self.positions!r}",
        )
        _check(
            self.rope_factors is None or (self.rope_scaling is None and all(f > 0 for f in self.rope_factors)),
            "TransformerConfig.rope_factors (each layer's linear RoPE factor, > 0) cannot be combined with "
            f"rope_scaling={self.rope_scaling!r}; give one or the other",
        )
        _check(
            self.sliding_window is None or self.sliding_window >= 1,
            f"TransformerConfig.sliding_window must be None or >= 1, got {self.sliding_window}",
        )
        _check(
            self.rope_scaling in (None, "llama3", "linear", "yarn", "longrope"),
            "TransformerConfig.rope_scaling must be None, 'llama3', 'linear', 'yarn' or 'longrope', "
            f"got {self.rope_scaling!r}",
        )
        for field in ("rope_short_factor", "rope_long_factor"):
            if getattr(self, field) is not None:  # from JSON: lists; a static field must hash
                object.__setattr__(self, field, tuple(float(v) for v in getattr(self, field)))
        if self.rope_scaling in ("linear", "yarn", "longrope"):
            try:
                scaling = rope_scaling_of(self)
            except ValueError as e:
                raise ValueError(f"TransformerConfig.rope_scaling={self.rope_scaling!r}: {e}") from None
            rotary = int((self.head_dim or self.d_model // self.num_heads) * self.partial_rotary_factor)
            _check(
                scaling.short_factor is None or len(scaling.short_factor) == rotary // 2,
                f"TransformerConfig.rope_short_factor / rope_long_factor (longrope) holds "
                f"{len(scaling.short_factor or ())} factors for a rotation of {rotary // 2} frequencies "
                "(head_dim x partial_rotary_factor / 2): give one per frequency",
            )
        rotary = int((self.head_dim or self.d_model // self.num_heads) * self.partial_rotary_factor)
        _check(
            self.partial_rotary_factor == 1.0
            or (0.0 < self.partial_rotary_factor < 1.0 and rotary >= 2 and rotary % 2 == 0),
            f"TransformerConfig.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and rotate an "
            f"even number (>= 2) of head dimensions, int(head_dim * factor); it rotates {rotary}",
        )
        _check(
            self.qk_norm_scope in ("head", "projection"),
            f"TransformerConfig.qk_norm_scope must be 'head' or 'projection', got {self.qk_norm_scope!r}",
        )
        _check(
            self.norm_placement in ("input", "output", "sandwich"),
            f"TransformerConfig.norm_placement must be 'input', 'output' or 'sandwich', got {self.norm_placement!r}",
        )
        _check(
            self.pre_norm or self.norm_placement == "input",
            f"TransformerConfig.norm_placement={self.norm_placement!r} places norms in a pre-LN layer; "
            "pre_norm=False (post-LN) takes norm_placement='input'",
        )
        chunk = self.loss_chunk
        _check(
            chunk is None or chunk == "auto" or (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1),
            f"TransformerConfig.loss_chunk must be 'auto', None (the full logits) or an int >= 1 (positions per "
            f"chunk), got {chunk!r}",
        )
        for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, field)
            _check(value is None or value > 0, f"TransformerConfig.{field} must be None or > 0, got {value}")
        if self.num_experts is not None:
            _check_experts(self)
        _check(
            self.norm in ("layernorm", "rmsnorm"),
            f"TransformerConfig.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}",
        )
        _check(
            self.positions in ("learned", "rope", "none"),
            f"TransformerConfig.positions must be 'learned', 'rope' or 'none', got {self.positions!r}",
        )


def _check_experts(config: TransformerConfig) -> None:
    """Refuse, naming the fix, a mixture-of-experts config the zoo's `Experts` cannot build."""
    _check(
        config.activation == "swiglu",
        f"TransformerConfig.num_experts={config.num_experts} builds SwiGLU experts: set activation='swiglu', "
        f"got {config.activation!r}",
    )
    _check(
        1 <= config.num_experts_per_tok <= config.num_experts,
        f"TransformerConfig.num_experts_per_tok={config.num_experts_per_tok} routes each token to more experts "
        f"than the {config.num_experts} there are (or none): give 1..num_experts",
    )
    _check(
        config.moe_dispatch in ("dense", "sorted"),
        f"TransformerConfig.moe_dispatch must be 'dense' or 'sorted', got {config.moe_dispatch!r}",
    )


@dataclasses.dataclass(frozen=True)
class EncoderConfig(_Common):
    """A BERT-style encoder: post-LN, learned positions, token types, padding mask.

    Field names follow Hugging Face's `BertConfig` where they differ only in spelling:
    `d_model` = `hidden_size`, `num_heads` = `num_attention_heads`, `num_layers` =
    `num_hidden_layers`, `mlp_dim` = `intermediate_size`, `max_len` =
    `max_position_embeddings`, `type_vocab_size`, `norm_eps` = `layer_norm_eps`,
    `pad_token_id`. `remat` as `TransformerConfig`'s (default `"auto"`).
    `positions_after_pad`: RoBERTa's position ids (transformers'
    `create_position_ids_from_input_ids`): the real tokens numbered from `pad_token_id + 1`
    (counting only tokens other than `pad_token_id`), pad tokens at `pad_token_id`; so
    `max_len` (the table's rows, `max_position_embeddings`) holds sequences of at most
    `max_len - pad_token_id - 1` tokens. Off (BERT): position `i` reads row `i`.
    """

    norm_eps: float = 1e-12
    type_vocab_size: int = 2
    pad_token_id: int = 0
    positions_after_pad: bool = False

    @property
    def max_seq(self) -> int:
        """The longest sequence the position table holds (`max_len`, less RoBERTa's offset)."""
        return self.max_len - self.pad_token_id - 1 if self.positions_after_pad else self.max_len

    def __post_init__(self):
        super().__post_init__()
        _check(
            not self.positions_after_pad or self.max_seq >= 1,
            f"EncoderConfig: with positions_after_pad, max_len ({self.max_len}) must exceed pad_token_id + 1 "
            f"({self.pad_token_id + 1}): RoBERTa's positions start after the pad id",
        )
