"""Hugging Face GPT-2 ↔ `zoo.models.Transformer`: the config conversion and the tensor names.

Names follow `GPT2LMHeadModel` (`transformer.…`, plus `lm_head.weight` when the head is
untied); bare `GPT2Model` files (no `transformer.` prefix) load too. GPT-2's projections
are `Conv1D` layers whose weights are already `[in, out]` (no transpose); its fused
`attn.c_attn` (`[d, 3d]`, q | k | v along the last axis) is split into the zoo's
`q_proj`/`k_proj`/`v_proj`. The `attn.bias` / `attn.masked_bias` buffers of older files
(the causal mask) and a tied `lm_head.weight` (the token embedding again) are skipped.

| zoo `Transformer`, layer `i` | GPT-2 |
|---|---|
| `token_embedding.weight` | `transformer.wte.weight` |
| `position_embedding.weight` | `transformer.wpe.weight` |
| `layers.layers.attention_norm.*` | `transformer.h.{i}.ln_1.*` |
| `layers.layers.attention.{q,k,v}_proj.*` | `transformer.h.{i}.attn.c_attn.*`, blocks 0, 1, 2 of the last axis |
| `layers.layers.attention.o_proj.*` | `transformer.h.{i}.attn.c_proj.*` |
| `layers.layers.mlp_norm.*` | `transformer.h.{i}.ln_2.*` |
| `layers.layers.mlp.up.*` / `mlp.down.*` | `transformer.h.{i}.mlp.c_fc.*` / `mlp.c_proj.*` |
| `final_norm.*` | `transformer.ln_f.*` |
| `lm_head.weight` (untied only) | `lm_head.weight`, transposed |
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ... import models
from .._family import Family, register
from .._layout import fused_group

if TYPE_CHECKING:
    from ...models import TransformerConfig

_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}

PREFIX = "transformer."

# zoo module → GPT-2 module (`{0}`: the layer number).
GPT2_NAMES: dict[str, str] = {
    "token_embedding": "transformer.wte",
    "position_embedding": "transformer.wpe",
    "layers.layers.attention_norm": "transformer.h.{0}.ln_1",
    "layers.layers.attention.o_proj": "transformer.h.{0}.attn.c_proj",
    "layers.layers.mlp_norm": "transformer.h.{0}.ln_2",
    "layers.layers.mlp.up": "transformer.h.{0}.mlp.c_fc",
    "layers.layers.mlp.down": "transformer.h.{0}.mlp.c_proj",
    "final_norm": "transformer.ln_f",
    "lm_head": "lm_head",
    # containers peft may name, and the fused q/k/v (blocks 0, 1, 2 of c_attn's last axis)
    "layers": "transformer.h",
    "layers.layers": "transformer.h.{0}",
    "layers.layers.attention": "transformer.h.{0}.attn",
    "layers.layers.mlp": "transformer.h.{0}.mlp",
    "layers.layers.attention.q_proj": "transformer.h.{0}.attn.c_attn",
    "layers.layers.attention.k_proj": "transformer.h.{0}.attn.c_attn",
    "layers.layers.attention.v_proj": "transformer.h.{0}.attn.c_attn",
}
_FUSED = fused_group("layers.layers.attention", "q_proj", "k_proj", "v_proj")
_BUFFER = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)")


def transformer_config_from_hf(values: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """A `TransformerConfig` from a Hugging Face `GPT2Config` dict (`config.json`).

    **Arguments:**

    - `values`: the dict; `model_type` must be `"gpt2"` when present.
    - `overrides`: `TransformerConfig` fields to set on top (e.g. `remat=...`).

    The result is GPT-2's architecture: learned positions, pre-LN LayerNorm blocks with
    biases, `activation_function` (`gelu_new` → `"gelu_tanh"`), the head tied to the token
    embedding unless `tie_word_embeddings` is false. `resid_pdrop` (which must equal
    `embd_pdrop`: the zoo has one rate for both) becomes `dropout`, `attn_pdrop`
    `attention_dropout`. Options the zoo cannot reproduce raise a `ValueError` naming
    them: `scale_attn_weights=False`, `scale_attn_by_inverse_layer_idx=True`,
    `reorder_and_upcast_attn=True`, `add_cross_attention=True`, another activation.
    """
    model_type = values.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(
            f"transformer_config_from_hf reads GPT-2 configs (model_type 'gpt2'), got model_type {model_type!r}"
        )
    unsupported = []
    if not values.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False (zoo always scales attention scores by 1/sqrt(head_dim))")
    if values.get("scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=True (zoo does not scale scores by layer)")
    if values.get("reorder_and_upcast_attn", False):
        unsupported.append("reorder_and_upcast_attn=True (set it to false: zoo computes scores in float32 its own way)")
    if values.get("add_cross_attention", False):
        unsupported.append("add_cross_attention=True (zoo's Transformer has no cross-attention)")
    act = values.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        unsupported.append(f"activation_function={act!r} (supported: {sorted(_ACT_FROM_HF)})")
    resid, embd = values.get("resid_pdrop", 0.1), values.get("embd_pdrop", 0.1)
    if resid != embd and "dropout" not in overrides:
        unsupported.append(
            f"resid_pdrop={resid} != embd_pdrop={embd} (zoo has one rate for both; pass dropout=... to choose)"
        )
    if unsupported:
        raise ValueError("this GPT-2 config uses options zoo's Transformer does not support: " + "; ".join(unsupported))
    for key in ("vocab_size", "n_embd", "n_head", "n_layer"):
        if key not in values:
            raise ValueError(f"the GPT-2 config has no {key!r}; it is required")
    fields = dict(
        vocab_size=values["vocab_size"],
        d_model=values["n_embd"],
        num_heads=values["n_head"],
        num_layers=values["n_layer"],
        mlp_dim=values.get("n_inner"),
        max_len=values.get("n_positions", 1024),
        activation=_ACT_FROM_HF[act],
        norm_eps=values.get("layer_norm_epsilon", 1e-5),
        dropout=resid,
        attention_dropout=values.get("attn_pdrop", 0.1),
        init_std=values.get("initializer_range", 0.02),
        norm="layernorm",
        positions="learned",
        tie_embeddings=bool(values.get("tie_word_embeddings", True)),
        pre_norm=True,
        use_bias=True,
    )
    return models.TransformerConfig(**(fields | overrides))


def transformer_config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """A Hugging Face `GPT2Config` dict (for `config.json`, architecture `GPT2LMHeadModel`).

    Raises a `ValueError` naming every field GPT-2 cannot express: `positions` other than
    `"learned"` (RoPE, none), `norm="rmsnorm"`, grouped-query attention, a `head_dim` other
    than `d_model // num_heads`, the `swiglu` activation, `use_bias=False`,
    `pre_norm=False`. An untied head is written as `tie_word_embeddings: false` with its
    own `lm_head.weight`. `dtype` and `remat` are not written.
    """
    problems = []
    if config.positions != "learned":
        problems.append(f"positions={config.positions!r} (GPT-2 has learned positions)")
    if config.norm != "layernorm":
        problems.append(f"norm={config.norm!r} (GPT-2 uses LayerNorm)")
    if config.kv_heads != config.num_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads} (GPT-2 has no grouped-query attention)")
    if config.head_dim is not None and config.head_dim * config.num_heads != config.d_model:
        problems.append(
            f"head_dim={config.head_dim} (GPT-2's is d_model // num_heads = {config.d_model // config.num_heads})"
        )
    if config.activation not in _ACT_TO_HF:
        problems.append(f"activation={config.activation!r} (GPT-2 supports {sorted(_ACT_TO_HF)})")
    if not config.use_bias:
        problems.append("use_bias=False (GPT-2's projections have biases)")
    if not config.pre_norm:
        problems.append("pre_norm=False (GPT-2 is pre-LN)")
    for name in ("qkv_bias", "o_bias", "mlp_bias"):
        if getattr(config, name) is False:
            problems.append(f"{name}=False (GPT-2's projections have biases)")
    if config.sliding_window is not None:
        problems.append(f"sliding_window={config.sliding_window} (GPT-2 attends to every earlier position)")
    if config.embed_scale != 1.0:
        problems.append(f"embed_scale={config.embed_scale} (GPT-2 does not scale its embeddings)")
    if config.qk_norm:
        problems.append("qk_norm=True (GPT-2 does not normalise queries and keys)")
    if config.norm_placement != "input":
        problems.append(f"norm_placement={config.norm_placement!r} (GPT-2 normalises each sub-layer's input)")
    if problems:
        raise ValueError("this TransformerConfig cannot be written as a GPT-2 config: " + "; ".join(problems))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.mlp_dim,
        "n_positions": config.max_len,
        "activation_function": _ACT_TO_HF[config.activation],
        "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention_dropout,
        "initializer_range": config.init_std,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


@register
class GPT2(Family):
    """GPT-2 (`GPT2LMHeadModel`, bare `GPT2Model`) ↔ a GPT-2-shaped `zoo.models.Transformer`.

    Projections are `Conv1D` (`[in, out]`, no transpose) except the untied `lm_head`.
    """

    name = "gpt2"
    model_class = "zoo.models.Transformer"
    config_class = "zoo.models.TransformerConfig"
    architecture = "GPT2LMHeadModel"
    prefix = PREFIX
    canonical_prefixed = True
    head_names = ("lm_head.weight",)
    module_names = GPT2_NAMES
    fused = _FUSED
    lora_names = {
        "q_proj": "c_attn",
        "k_proj": "c_attn",
        "v_proj": "c_attn",
        "o_proj": "c_proj",
        "up": "c_fc",
        "down": "c_proj",
    }
    vocab_axes = {"token_embedding.weight": 0, "lm_head.weight": 1}

    def config_from_hf(self, values, **overrides):
        return transformer_config_from_hf(values, **overrides)

    def config_to_hf(self, config, base=None):
        out = transformer_config_to_hf(config)
        if base and _ACT_FROM_HF.get(base.get("activation_function")) == config.activation:
            out["activation_function"] = base["activation_function"]  # keep the file's spelling
        return out

    def claims(self, config):
        return isinstance(config, self.config_class) and config.positions == "learned"

    def transposed(self, module, param, parent):
        return module == "lm_head" and param == "weight"  # nn.Linear; the rest are Conv1D

    def ignored(self, name, config):
        return bool(_BUFFER.fullmatch(name)) or (name == "lm_head.weight" and config.tie_embeddings)
