"""Hugging Face OLMo 2 ↔ `zoo.models.Transformer`: Llama with its norms moved.

OLMo 2 is `llama.py` with two changes. Each layer normalises its sub-layers' outputs, not
their inputs: `h = x + norm(attn(x)); out = h + norm(mlp(h))` (`post_attention_layernorm`,
`post_feedforward_layernorm`: `TransformerConfig.norm_placement="output"`). And the query
and key projections are RMS-normalised whole, over `heads × head_dim` and `kv_heads ×
head_dim`, before the split into heads and RoPE (`self_attn.q_norm` / `k_norm`:
`qk_norm=True, qk_norm_scope="projection"`). One `attention_bias` for q, k, v and o; the
feed-forward has no biases; `rms_norm_eps` defaults to 1e-5.

| zoo `Transformer`, layer `i` | OLMo 2 (`Olmo2ForCausalLM`) |
|---|---|
| `layers.layers.attention.{q,k}_norm.weight` | `model.layers.{i}.self_attn.{q,k}_norm.weight` |
| `layers.layers.attention_out_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
| `layers.layers.mlp_out_norm.weight` | `model.layers.{i}.post_feedforward_layernorm.weight` |

The rest as Llama's table.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import LLAMA_NAMES, Llama

_LAYER = {
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}
# Llama's input norms are absent (and Llama's `post_attention_layernorm` is the mlp's input norm).
_NAMES = {k: v for k, v in LLAMA_NAMES.items() if k not in ("layers.layers.attention_norm", "layers.layers.mlp_norm")}


@register
class Olmo2(Llama):
    """OLMo 2 (`Olmo2ForCausalLM`) ↔ a `zoo.models.Transformer` with output norms and
    whole-projection q/k norms."""

    feed_forward_bias = False

    name = "olmo2"
    architecture = "Olmo2ForCausalLM"
    qk_norm_scope = "projection"
    norm_placement = "output"
    module_names = _NAMES | {f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _LAYER.items()}

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        # transformers' Olmo2Config has its own eps default (and no mlp_bias: feed_forward_bias).
        return super().fields(values) | {
            "norm_eps": values.get("rms_norm_eps", 1e-5),
            "qk_norm": True,
            "qk_norm_scope": "projection",
            "norm_placement": "output",
        }

    # `claims`: Llama's (no window, one attention_bias) with this class's norms.
