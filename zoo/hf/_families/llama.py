"""Hugging Face Llama (Llama 2 / 3 / 3.1 configs) ↔ `zoo.models.Transformer`.

Pre-norm RMSNorm blocks, RoPE (`rope_theta`; `rope_scaling` of type `"llama3"`, `"linear"`,
`"yarn"` or `"longrope"` rescales the frequencies, and the last two `cos`/`sin`, as
transformers does (`zoo.nn.RopeScaling`); other types, and yarn's DeepSeek `mscale`, are
refused by name), grouped-query
attention (`num_key_value_heads`), an explicit `head_dim`, a SwiGLU feed-forward
(`hidden_act: "silu"`: `down(silu(gate(x)) * up(x))`), optional `attention_bias` (q, k, v,
o) and `mlp_bias`, the head tied to the token embedding or not (`tie_word_embeddings`).
Every projection is a torch `nn.Linear` (`[out, in]`, transposed). Old files' rotary
`inv_freq` buffers and a tied `lm_head.weight` are skipped.

| zoo `Transformer`, layer `i` | Llama (`LlamaForCausalLM`) |
|---|---|
| `token_embedding.weight` | `model.embed_tokens.weight` |
| `layers.layers.attention_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
| `layers.layers.attention.{q,k,v,o}_proj.*` | `model.layers.{i}.self_attn.{q,k,v,o}_proj.*` |
| `layers.layers.mlp_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
| `layers.layers.mlp.{gate,up,down}.*` | `model.layers.{i}.mlp.{gate,up,down}_proj.*` |
| `final_norm.weight` | `model.norm.weight` |
| `lm_head.weight` (untied only) | `lm_head.weight` |

`Mistral` and `Qwen2` (`mistral.py`, `qwen2.py`) are this class with a few changes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

from .._family import Family, register

if TYPE_CHECKING:
    from ...models import TransformerConfig

_LAYER = {
    "attention": "self_attn",
    "attention.q_proj": "self_attn.q_proj",
    "attention.k_proj": "self_attn.k_proj",
    "attention.v_proj": "self_attn.v_proj",
    "attention.o_proj": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "mlp": "mlp",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
    "mlp_norm": "post_attention_layernorm",
}

# zoo module → Llama module (`{0}`: the layer number).
LLAMA_NAMES: dict[str, str] = {
    "token_embedding": "model.embed_tokens",
    "layers": "model.layers",
    "layers.layers": "model.layers.{0}",
    **{f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _LAYER.items()},
    "final_norm": "model.norm",
    "lm_head": "lm_head",
}

_PLACEMENT = {"input": "input", "output": "output", "sandwich": "input and output"}
_BUFFER = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _require(values: dict[str, Any], key: str, what: str) -> Any:
    if key not in values:
        raise ValueError(f"the {what} config has no {key!r}; it is required")
    return values[key]


def rope_fields(values: dict[str, Any], what: str, unsupported: list[str]) -> dict[str, Any]:
    """The zoo RoPE fields of a config dict: transformers 5's `rope_parameters`, or the
    older `rope_theta` + `rope_scaling`. Unsupported scaling types go to `unsupported`."""
    params = dict(values.get("rope_parameters") or {})
    scaling = dict(values.get("rope_scaling") or {})
    theta = params.get("rope_theta", values.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    source = params if params.get("rope_type", params.get("type")) not in (None, "default") else scaling
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in source]
        if missing:
            unsupported.append(f"rope_scaling of type 'llama3' without {missing}")
            return fields
        fields |= {
            "rope_scaling": "llama3",
            "rope_factor": float(source["factor"]),
            "rope_low_freq_factor": float(source["low_freq_factor"]),
            "rope_high_freq_factor": float(source["high_freq_factor"]),
            "rope_original_max_len": int(source["original_max_position_embeddings"]),
        }
    elif kind in ("linear", "yarn", "longrope"):
        fields |= _scaling_fields(kind, source, values, unsupported)
    elif kind != "default":
        unsupported.append(
            f"rope_scaling of type {kind!r} (zoo implements 'default', 'llama3', 'linear', 'yarn' and 'longrope'; "
            f"{kind!r} changes the rotary frequencies or the attention scale in a way zoo's RoPE does not)"
        )
    return fields


def _scaling_fields(kind: str, source: dict[str, Any], values: dict[str, Any], unsupported: list[str]) -> dict:
    """The `TransformerConfig` fields of a linear, yarn or longrope `rope_scaling`, as
    transformers 5 reads it (`standardize_rope_params`: a top-level
    `original_max_position_embeddings` first, then the scaling's own, then
    `max_position_embeddings`; a missing `factor` is their ratio)."""
    longest = values.get("max_position_embeddings", 2048)
    original = values.get("original_max_position_embeddings") or source.get("original_max_position_embeddings")
    original = int(original or longest)
    factor = source.get("factor")
    if kind == "linear" and factor is None:
        unsupported.append("rope_scaling of type 'linear' without 'factor'")
        return {}
    if source.get("mscale") or source.get("mscale_all_dim"):
        unsupported.append("rope_scaling of type 'yarn' with mscale / mscale_all_dim (DeepSeek's attention factor)")
        return {}
    fields: dict[str, Any] = {
        "rope_scaling": kind,
        "rope_factor": float(longest / original if factor is None else factor),
        "rope_original_max_len": original,
        "rope_attention_factor": None if source.get("attention_factor") is None else float(source["attention_factor"]),
    }
    if kind == "yarn":
        fields |= {
            "rope_beta_fast": float(source.get("beta_fast") or 32),
            "rope_beta_slow": float(source.get("beta_slow") or 1),
            "rope_truncate": bool(source.get("truncate", True)),
        }
    if kind == "longrope":
        missing = [k for k in ("short_factor", "long_factor") if not source.get(k)]
        if missing:
            unsupported.append(f"rope_scaling of type 'longrope' without {missing}")
            return {}
        fields |= {"rope_short_factor": tuple(source["short_factor"]), "rope_long_factor": tuple(source["long_factor"])}
    return fields


def rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """`rope_parameters` (transformers 5) plus the older `rope_theta` / `rope_scaling`."""
    params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    scaling = None
    if config.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": config.rope_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_len,
        }
        params |= scaling
    elif config.rope_scaling in ("linear", "yarn", "longrope"):
        scaling = {"rope_type": config.rope_scaling, "factor": config.rope_factor}
        if config.rope_scaling != "linear":
            scaling["original_max_position_embeddings"] = config.rope_original_max_len
        if config.rope_attention_factor is not None:
            scaling["attention_factor"] = config.rope_attention_factor
        if config.rope_scaling == "yarn":
            scaling |= {"beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow}
            scaling |= {"truncate": config.rope_truncate}
        if config.rope_scaling == "longrope":
            scaling |= {"short_factor": list(config.rope_short_factor), "long_factor": list(config.rope_long_factor)}
        params |= scaling
    return {"rope_parameters": params, "rope_theta": config.rope_theta, "rope_scaling": scaling}


@register
class Llama(Family):
    """Llama (`LlamaForCausalLM`, bare `LlamaModel`) ↔ a Llama-shaped `zoo.models.Transformer`."""

    name = "llama"
    model_class = "zoo.models.Transformer"
    config_class = "zoo.models.TransformerConfig"
    architecture = "LlamaForCausalLM"
    prefix = "model."
    canonical_prefixed = True
    head_names = ("lm_head.weight",)
    module_names = LLAMA_NAMES
    lora_names = {
        "q_proj": "q_proj",
        "k_proj": "k_proj",
        "v_proj": "v_proj",
        "o_proj": "o_proj",
        "gate": "gate_proj",
        "up": "up_proj",
        "down": "down_proj",
    }
    vocab_axes = {"token_embedding.weight": 0, "lm_head.weight": 1}
    tie_default = False  # transformers' default for tie_word_embeddings
    qk_norm_scope: ClassVar[str | None] = None  # q/k norms: None, "head" (Qwen3) or "projection" (OLMo 2)
    norm_placement: ClassVar[str] = "input"  # where the layer norms sit (TransformerConfig.norm_placement)
    partial_rotary: ClassVar[bool] = False  # reads partial_rotary_factor (Phi-3); else refuses one below 1
    soft_caps: ClassVar[bool] = False  # soft-capping and query_pre_attn_scalar expressible (Gemma 2/3)
    feed_forward_bias: ClassVar[bool] = True  # config.json's mlp_bias read and written; False: the family has none
    experts: ClassVar[bool] = False  # a mixture-of-experts feed-forward (num_experts) in every layer (Mixtral)

    # -- config.json → zoo --

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        """Options of `values` the zoo cannot reproduce, each with why."""
        problems = []
        act = values.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act={act!r} (zoo's gated feed-forward is SwiGLU: hidden_act 'silu')")
        params = values.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0) and not self.partial_rotary:  # None: transformers reads 1
            problems.append(
                f"partial_rotary_factor={partial} ({self.name} rotates every head dimension; Phi-3 and Phi-4-mini "
                "rotate part of each head)"
            )
        return problems

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The zoo `TransformerConfig` fields of `values` (checked by `unsupported`)."""
        what = self.name
        d, heads = _require(values, "hidden_size", what), _require(values, "num_attention_heads", what)
        head_dim = values.get("head_dim") or d // heads
        attention_bias, mlp_bias = bool(values.get("attention_bias", False)), bool(values.get("mlp_bias", False))
        return dict(
            vocab_size=_require(values, "vocab_size", what),
            d_model=d,
            num_heads=heads,
            num_layers=_require(values, "num_hidden_layers", what),
            mlp_dim=_require(values, "intermediate_size", what),
            num_kv_heads=values.get("num_key_value_heads") or heads,
            head_dim=None if head_dim * heads == d else head_dim,
            max_len=values.get("max_position_embeddings", 2048),
            activation="swiglu",
            norm="rmsnorm",
            norm_eps=values.get("rms_norm_eps", 1e-6),
            positions="rope",
            use_bias=False,
            qkv_bias=attention_bias or None,
            o_bias=attention_bias or None,
            mlp_bias=(mlp_bias or None) if self.feed_forward_bias else None,
            dropout=0.0,
            attention_dropout=float(values.get("attention_dropout", 0.0)),
            init_std=values.get("initializer_range", 0.02),
            tie_embeddings=bool(values.get("tie_word_embeddings", self.tie_default)),
            pre_norm=True,
        )

    def config_from_hf(self, values: dict[str, Any], **overrides: Any) -> TransformerConfig:
        """A `TransformerConfig` from this family's `config.json` dict; options the zoo
        cannot reproduce raise one `ValueError` naming each and why."""
        model_type = values.get("model_type", self.name)
        if model_type != self.name:
            raise ValueError(f"the {self.name} family reads model_type {self.name!r} configs, got {model_type!r}")
        problems = self.unsupported(values)
        rope = rope_fields(values, self.name, problems)
        if problems:
            raise ValueError(
                f"this {self.name} config uses options zoo's Transformer does not support: " + "; ".join(problems)
            )
        return self.config_class(**(self.fields(values) | rope | overrides))

    # -- zoo → config.json --

    def export_problems(self, config: TransformerConfig) -> list[str]:
        """Fields of `config` this architecture cannot express."""
        problems = []
        if config.positions != "rope":
            problems.append(f"positions={config.positions!r} ({self.name} uses RoPE)")
        if config.norm != "rmsnorm":
            problems.append(f"norm={config.norm!r} ({self.name} uses RMSNorm)")
        if config.activation != "swiglu":
            problems.append(f"activation={config.activation!r} ({self.name}'s feed-forward is SwiGLU)")
        if config.embed_scale != 1.0:
            problems.append(f"embed_scale={config.embed_scale} ({self.name} does not scale its embeddings)")
        if not config.pre_norm:
            problems.append(f"pre_norm=False ({self.name} is pre-norm)")
        qkv, o = _bias(config, "qkv_bias"), _bias(config, "o_bias")
        if qkv != o:
            problems.append(f"qkv_bias={qkv} with o_bias={o} ({self.name} has one attention_bias for q, k, v and o)")
        if config.sliding_window is not None:
            problems.append(f"sliding_window={config.sliding_window} ({self.name} has no sliding window; Mistral has)")
        if config.rope_layers is not None:
            problems.append(f"rope_layers=... ({self.name} applies RoPE on every layer; SmolLM3 has layers without)")
        if config.rope_thetas is not None:
            problems.append(f"rope_thetas=... ({self.name} has one RoPE base for every layer)")
        if config.partial_rotary_factor != 1.0:
            problems.append(
                f"partial_rotary_factor={config.partial_rotary_factor} ({self.name} rotates every head dimension; "
                "Phi-3 rotates part)"
            )
        if not self.feed_forward_bias and _bias(config, "mlp_bias"):
            problems.append(f"mlp_bias=True ({self.name}'s feed-forward has no biases)")
        return problems + self.norm_problems(config)

    def norm_problems(self, config: TransformerConfig) -> list[str]:
        """`config`'s q/k norms, norm placement, score scaling and experts where they are not
        this architecture's (`qk_norm_scope`, `norm_placement`, `soft_caps`, `experts` of
        the class)."""
        problems = []
        experts = getattr(config, "num_experts", None)
        if (experts is not None) != self.experts:
            problems.append(
                f"num_experts={experts} ({self.name}'s feed-forward is dense; Mixtral and Qwen3-MoE have experts)"
                if experts is not None
                else f"num_experts=None ({self.name}'s feed-forward is a mixture of experts: set num_experts)"
            )
        for field in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            if not self.soft_caps and getattr(config, field) is not None:
                problems.append(f"{field}={getattr(config, field)} ({self.name} has none; Gemma 2 and 3 have)")
        if (config.qk_norm_scope if config.qk_norm else None) != self.qk_norm_scope:
            want = {
                None: "no q/k norms: qk_norm=False",
                "head": "each query and key head normalised: qk_norm=True, qk_norm_scope='head'",
                "projection": "the whole query and key projections normalised: qk_norm=True, "
                "qk_norm_scope='projection'",
            }[self.qk_norm_scope]
            problems.append(
                f"qk_norm={config.qk_norm}, qk_norm_scope={config.qk_norm_scope!r} ({self.name} has {want}; "
                "Qwen3 does per head, OLMo 2 over the whole projections)"
            )
        if config.norm_placement != self.norm_placement:
            problems.append(
                f"norm_placement={config.norm_placement!r} ({self.name} normalises each sub-layer's "
                f"{_PLACEMENT[self.norm_placement]}: {self.norm_placement!r})"
            )
        return problems

    def norms_match(self, config: TransformerConfig) -> bool:
        """Whether `config`'s q/k norms and norm placement are this architecture's."""
        return not self.norm_problems(config)

    def config_to_hf(self, config: TransformerConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """This family's `config.json` dict for `config`; fields it cannot express raise one
        `ValueError` naming each."""
        problems = self.export_problems(config)
        if problems:
            raise ValueError(
                f"this TransformerConfig cannot be written as a {self.name} config: " + "; ".join(problems)
            )
        out = {
            "architectures": [self.architecture],
            "model_type": self.name,
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.hidden_dim,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim or config.d_model // config.num_heads,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_len,
            "rms_norm_eps": config.norm_eps,
            "initializer_range": config.init_std,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": _bias(config, "qkv_bias"),
            "mlp_bias": _bias(config, "mlp_bias"),
            "attention_dropout": config.attention_dropout,
            **rope_to_hf(config),
        }
        if not self.feed_forward_bias:
            del out["mlp_bias"]
        return out

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and config.sliding_window is None
            and self.norms_match(config)
            and _bias(config, "qkv_bias") == _bias(config, "o_bias")
            and uniform_rope(config)
        )

    def ignored(self, name: str, config: Any) -> bool:
        return bool(_BUFFER.fullmatch(name)) or (name == "lm_head.weight" and config.tie_embeddings)


def uniform_rope(config: TransformerConfig) -> bool:
    """Whether every layer of `config` applies RoPE, with one base, to every head dimension."""
    return config.rope_layers is None and config.rope_thetas is None and config.partial_rotary_factor == 1.0


def _bias(config: TransformerConfig, name: str) -> bool:
    value = getattr(config, name)
    return config.use_bias if value is None else value
