"""Hugging Face BERT ↔ `zoo.models.Encoder`: the config conversion and the tensor names.

The names are `BERT_NAMES` (the one BERT table of the package, also peft's module names)
plus the parameter name; a `Linear`'s weight is transposed (torch `[out, in]`). A BERT
checkpoint's `embeddings.position_ids` (a buffer) and `pooler.*` (the zoo encoder has no
pooler: sentence embeddings mean-pool instead) are skipped.

| zoo `Encoder` module, layer `i` | HF BERT module |
|---|---|
| `embeddings`, `embeddings.word_embeddings` / `position_embeddings` / `token_type_embeddings` | same |
| `embeddings.norm` | `embeddings.LayerNorm` |
| `layers` / `layers.layers` / `layers.layers.attention` | `encoder.layer` / `encoder.layer.{i}` / `encoder.layer.{i}.attention` |
| `layers.layers.attention.q_proj` / `k_proj` / `v_proj` | `encoder.layer.{i}.attention.self.query` / `key` / `value` |
| `layers.layers.attention.o_proj` | `encoder.layer.{i}.attention.output.dense` |
| `layers.layers.attention_norm` | `encoder.layer.{i}.attention.output.LayerNorm` |
| `layers.layers.mlp.up` | `encoder.layer.{i}.intermediate.dense` |
| `layers.layers.mlp.down` | `encoder.layer.{i}.output.dense` |
| `layers.layers.mlp_norm` | `encoder.layer.{i}.output.LayerNorm` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ... import models
from .._family import Family, register

if TYPE_CHECKING:
    from ...models import EncoderConfig

_BERT_LAYER = {
    "attention.q_proj": "attention.self.query",
    "attention.k_proj": "attention.self.key",
    "attention.v_proj": "attention.self.value",
    "attention.o_proj": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "mlp.up": "intermediate.dense",
    "mlp.down": "output.dense",
    "mlp_norm": "output.LayerNorm",
}

# zoo `Encoder` module name → HF `BertModel` module name (`{0}`: the layer number).
BERT_NAMES: dict[str, str] = {
    "embeddings": "embeddings",
    "embeddings.word_embeddings": "embeddings.word_embeddings",
    "embeddings.position_embeddings": "embeddings.position_embeddings",
    "embeddings.token_type_embeddings": "embeddings.token_type_embeddings",
    "embeddings.norm": "embeddings.LayerNorm",
    "layers": "encoder.layer",
    "layers.layers": "encoder.layer.{0}",
    "layers.layers.attention": "encoder.layer.{0}.attention",
    **{f"layers.layers.{zoo}": f"encoder.layer.{{0}}.{hf}" for zoo, hf in _BERT_LAYER.items()},
}

# Hugging Face `hidden_act` ↔ zoo activation (the same function, not an approximation).
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _require(values: dict[str, Any], key: str, what: str) -> Any:
    if key not in values:
        raise ValueError(f"the {what} config has no {key!r}; it is required")
    return values[key]


def encoder_config_from_hf(values: dict[str, Any], *, model_type: str = "bert", **overrides: Any) -> EncoderConfig:
    """An `EncoderConfig` from a Hugging Face `BertConfig` dict (`config.json`).

    **Arguments:**

    - `values`: the dict; its `model_type` must be the `model_type` argument when present
      (`"bert"`; `"roberta"` and `"xlm-roberta"`, whose positions start after the pad id,
      are read by their family, `zoo/hf/_families/roberta.py`).
    - `overrides`: `EncoderConfig` fields to set on top (e.g. `dropout=0.0`,
      `remat="dots_saveable"`, `dtype="bfloat16"` for the compute dtype).

    `hidden_dropout_prob` becomes `dropout`, `attention_probs_dropout_prob`
    `attention_dropout` (both apply only when a dropout key is passed). Options the zoo
    encoder cannot reproduce raise a `ValueError` naming them: `position_embedding_type`
    other than `"absolute"`, a `hidden_act` outside gelu / gelu_new / relu, `is_decoder`,
    `add_cross_attention`.
    """
    found = values.get("model_type", model_type)
    if found != model_type:
        raise ValueError(
            f"encoder_config_from_hf reads {model_type!r} configs here (model_type {model_type!r}), "
            f"got model_type {found!r}"
        )
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
        positions_after_pad=model_type != "bert",
    )
    return models.EncoderConfig(**(fields | overrides))


def encoder_config_to_hf(
    config: EncoderConfig, *, model_type: str = "bert", architecture: str = "BertModel"
) -> dict[str, Any]:
    """A Hugging Face `BertConfig` dict (for `config.json`) from an `EncoderConfig`.

    Raises a `ValueError` naming every field BERT cannot express: grouped-query attention,
    a `head_dim` other than `d_model // num_heads`, `use_bias=False`, the `swiglu`
    activation. `dtype` and `remat` have no BERT equivalent and are not written.
    """
    problems = []
    if config.kv_heads != config.num_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} (BERT has as many key/value heads as query heads)")
    if config.head_dim is not None and config.head_dim * config.num_heads != config.d_model:
        problems.append(
            f"head_dim={config.head_dim} (BERT's is d_model // num_heads = {config.d_model // config.num_heads})"
        )
    if not config.use_bias:
        problems.append("use_bias=False (BERT's projections have biases)")
    if config.activation not in _ACT_TO_HF:
        problems.append(f"activation={config.activation!r} (BERT supports {sorted(_ACT_TO_HF)})")
    if config.positions_after_pad != (model_type != "bert"):
        problems.append(
            f"positions_after_pad={config.positions_after_pad} ({model_type!r} numbers positions "
            + ("after the pad id)" if model_type != "bert" else "from 0; RoBERTa's are written as 'roberta')")
        )
    if problems:
        raise ValueError(f"this EncoderConfig cannot be written as a {model_type!r} config: " + "; ".join(problems))
    return {
        "architectures": [architecture],
        "model_type": model_type,
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


@register
class Bert(Family):
    """BERT (`BertModel`; the `bert.` part of task models) ↔ `zoo.models.Encoder`."""

    name = "bert"
    model_class = "zoo.models.Encoder"
    config_class = "zoo.models.EncoderConfig"
    architecture = "BertModel"
    auto_class = "AutoModel"
    prefix = "bert."
    canonical_prefixed = False
    module_names = BERT_NAMES
    lora_names = {
        "q_proj": "query",
        "k_proj": "key",
        "v_proj": "value",
        "o_proj": "dense",
        "up": "dense",
        "down": "dense",
    }
    vocab_axes = {"embeddings.word_embeddings.weight": 0}
    # peft adapters (zoo/hf/_peft.py): BertModel modules zoo's Encoder lacks, and why their
    # branches may be skipped; BertForSequenceClassification's own modules around the
    # encoder, as zoo.models.EncoderClassifier names them.
    lora_absent = {
        "pooler.dense": (
            "BertModel's pooler.dense only computes pooler_output (the tanh of the [CLS] state), which "
            "zoo's Encoder does not compute; its hidden states (last_hidden_state) are unaffected"
        )
    }
    lora_task_modules = {"pooler": "bert.pooler.dense", "head": "classifier"}
    # The sequence classifier (`zoo.hf.load_bert_classifier` / `save_bert_classifier`): its
    # class, and the module names of zoo's `EncoderClassifier(pooling="cls")` leaves there
    # (the first written; the others read too: a bare `BertModel`'s pooler). A folder
    # without the pooler is refused (BERT's is pretrained), unless `new_pooler`.
    sequence_classifier = "BertForSequenceClassification"
    classifier_modules = {"pooler": ("bert.pooler.dense", "pooler.dense"), "head": ("classifier",)}
    new_pooler = False

    def config_from_hf(self, values, **overrides):
        return encoder_config_from_hf(values, model_type=self.name, **overrides)

    def config_to_hf(self, config, base=None):
        out = encoder_config_to_hf(config, model_type=self.name, architecture=self.architecture)
        if base and _ACT_FROM_HF.get(base.get("hidden_act")) == config.activation:
            out["hidden_act"] = base["hidden_act"]  # keep the file's spelling (gelu_pytorch_tanh)
        return out

    def claims(self, config):
        return isinstance(config, self.config_class) and not config.positions_after_pad

    def generation_config(self, values):
        return None  # an encoder generates nothing: transformers' BertModel folders hold no generation_config.json

    def ignored(self, name, config):
        return name == "embeddings.position_ids" or name.startswith("pooler.")
