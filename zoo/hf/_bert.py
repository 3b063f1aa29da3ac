"""Hugging Face BERT ↔ `zoo.models.Encoder`: the config conversion and the tensor names.

The names are `zoo.lora.BERT_NAMES` (the one BERT table of the package) plus the
parameter name; a `Linear`'s weight is transposed (torch `[out, in]`). A BERT checkpoint's
`embeddings.position_ids` (a buffer) and `pooler.*` (the zoo encoder has no pooler:
sentence embeddings mean-pool instead) are skipped.
"""

from __future__ import annotations

from typing import Any

from ..lora._io import BERT_NAMES
from ..models import Encoder, EncoderConfig
from ._layout import Layout, Source, is_linear_weight

# Hugging Face `hidden_act` ↔ zoo activation (the same function, not an approximation).
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _require(values: dict[str, Any], key: str, what: str) -> Any:
    if key not in values:
        raise ValueError(f"the {what} config has no {key!r}; it is required")
    return values[key]


def encoder_config_from_hf(values: dict[str, Any], **overrides: Any) -> EncoderConfig:
    """An `EncoderConfig` from a Hugging Face `BertConfig` dict (`config.json`).

    **Arguments:**

    - `values`: the dict; `model_type` must be `"bert"` when present.
    - `overrides`: `EncoderConfig` fields to set on top (e.g. `dropout=0.0`,
      `remat="dots_saveable"`, `dtype="bfloat16"` for the compute dtype).

    `hidden_dropout_prob` becomes `dropout`, `attention_probs_dropout_prob`
    `attention_dropout` (both apply only when a dropout key is passed). Options the zoo
    encoder cannot reproduce raise a `ValueError` naming them: `position_embedding_type`
    other than `"absolute"`, a `hidden_act` outside gelu / gelu_new / relu, `is_decoder`,
    `add_cross_attention`.
    """
    model_type = values.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(f"encoder_config_from_hf reads BERT configs (model_type 'bert'), got model_type {model_type!r}")
    unsupported = []
    position = values.get("position_embedding_type", "absolute")
    if position != "absolute":
        unsupported.append(f"position_embedding_type={position!r} (only 'absolute' is supported)")
    act = values.get("hidden_act", "gelu")
    if act not in _ACT_FROM_HF:
        unsupported.append(f"hidden_act={act!r} (supported: {sorted(_ACT_FROM_HF)})")
    for flag in ("is_decoder", "add_cross_attention"):
        if values.get(flag):
            unsupported.append(f"{flag}=True (zoo's Encoder is a bidirectional encoder without cross-attention)")
    if unsupported:
        raise ValueError("this BERT config uses options zoo's Encoder does not support: " + "; ".join(unsupported))
    pad = values.get("pad_token_id")
    fields = dict(
        vocab_size=_require(values, "vocab_size", "BERT"),
        d_model=_require(values, "hidden_size", "BERT"),
        num_heads=_require(values, "num_attention_heads", "BERT"),
        num_layers=_require(values, "num_hidden_layers", "BERT"),
        mlp_dim=values.get("intermediate_size", 4 * values["hidden_size"]),
        max_len=values.get("max_position_embeddings", 512),
        activation=_ACT_FROM_HF[act],
        norm_eps=values.get("layer_norm_eps", 1e-12),
        dropout=values.get("hidden_dropout_prob", 0.1),
        attention_dropout=values.get("attention_probs_dropout_prob", 0.1),
        init_std=values.get("initializer_range", 0.02),
        type_vocab_size=values.get("type_vocab_size", 2),
        pad_token_id=0 if pad is None else pad,
    )
    return EncoderConfig(**(fields | overrides))


def encoder_config_to_hf(config: EncoderConfig) -> dict[str, Any]:
    """A Hugging Face `BertConfig` dict (for `config.json`) from an `EncoderConfig`.

    Raises a `ValueError` naming every field BERT cannot express: grouped-query attention,
    a `head_dim` other than `d_model // num_heads`, `use_bias=False`, the `swiglu`
    activation. `dtype` and `remat` have no BERT equivalent and are not written.
    """
    problems = []
    if config.kv_heads != config.num_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} (BERT has as many key/value heads as query heads)")
    if config.head_dim is not None and config.head_dim * config.num_heads != config.d_model:
        problems.append(f"head_dim={config.head_dim} (BERT's is d_model // num_heads = {config.d_model // config.num_heads})")
    if not config.use_bias:
        problems.append("use_bias=False (BERT's projections have biases)")
    if config.activation not in _ACT_TO_HF:
        problems.append(f"activation={config.activation!r} (BERT supports {sorted(_ACT_TO_HF)})")
    if problems:
        raise ValueError("this EncoderConfig cannot be written as a BERT config: " + "; ".join(problems))
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.hidden_dim,
        "hidden_act": _ACT_TO_HF[config.activation],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_len,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.init_std,
        "layer_norm_eps": config.norm_eps,
        "pad_token_id": config.pad_token_id,
        "position_embedding_type": "absolute",
    }


def _source(module: str, param: str, parent: Any, shape: tuple[int, ...], config: EncoderConfig) -> Source | None:
    hf_module = BERT_NAMES.get(module)
    if hf_module is None or param not in ("weight", "bias"):
        return None
    stacked = "{0}" in hf_module
    transpose = is_linear_weight(parent, param)
    core = shape[1:] if stacked else shape
    file_shape = core[::-1] if transpose else core
    names = tuple(f"{hf_module.format(i)}.{param}" for i in range(shape[0])) if stacked else (f"{hf_module}.{param}",)
    return Source(names, stacked, transpose, tuple(file_shape))


def _ignored(name: str, config: EncoderConfig) -> bool:
    return name == "embeddings.position_ids" or name.startswith("pooler.")


BERT = Layout(
    model_type="bert",
    model_class=Encoder,
    prefix="bert.",
    canonical_prefixed=False,
    config_from_hf=encoder_config_from_hf,
    config_to_hf=encoder_config_to_hf,
    source=_source,
    ignored=_ignored,
)
