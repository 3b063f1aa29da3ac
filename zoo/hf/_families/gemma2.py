"""Hugging Face Gemma 2 ↔ `zoo.models.Transformer`: Gemma with norms around each
sub-layer, alternating windows and soft-capping.

Gemma 2 is `gemma.py` with four changes. Each sub-layer's input and output are
RMS-normalised (`TransformerConfig.norm_placement="sandwich"`; every norm scales by
`1 + weight`, which the zoo leaf holds). Layers alternate between a sliding window and
global attention (`layer_types`, by default sliding on the even layers 0, 2, …:
`TransformerConfig.sliding_layers`). Attention scores and the logits are soft-capped,
`cap * tanh(x / cap)` (`attn_logit_softcapping`, `final_logit_softcapping`), and the
scores are scaled by `query_pre_attn_scalar ** -0.5` instead of `head_dim`'s.

| zoo `Transformer`, layer `i` | Gemma 2 (`Gemma2ForCausalLM`) |
|---|---|
| `layers.layers.attention_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
| `layers.layers.attention_out_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
| `layers.layers.mlp_norm.weight` | `model.layers.{i}.pre_feedforward_layernorm.weight` |
| `layers.layers.mlp_out_norm.weight` | `model.layers.{i}.post_feedforward_layernorm.weight` |

The rest as Llama's table.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .._family import register
from .gemma import _NORMS, Gemma
from .llama import LLAMA_NAMES
from .qwen2 import layer_types, types_fields, types_problems, types_to_hf

_LAYER = {
    "mlp_norm": "pre_feedforward_layernorm",
    "attention_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}
SANDWICH_NAMES = LLAMA_NAMES | {f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _LAYER.items()}
SANDWICH_NORMS = _NORMS + ("layers.layers.attention_out_norm", "layers.layers.mlp_out_norm")
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def gemma_types(values: dict[str, Any], every: int, every_key: str | None = None) -> list[str]:
    """Each layer's attention kind: `layer_types`, else every `every`-th layer global (or
    the config's `every_key`: Gemma 3's older `sliding_window_pattern`) and the others
    sliding (transformers' default: Gemma 2 every 2nd, Gemma 3 every 6th)."""
    if values.get("layer_types"):
        return layer_types(values)
    every = values.get(every_key, every) if every_key else every
    kinds = ("full_attention", "sliding_attention")
    return [kinds[bool((i + 1) % every)] for i in range(values.get("num_hidden_layers", 0))]


@register
class Gemma2(Gemma):
    """Gemma 2 (`Gemma2ForCausalLM`) ↔ a `zoo.models.Transformer` with sandwich norms,
    `sliding_layers`, soft-capping and `query_pre_attn_scalar`."""

    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    norm_placement = "sandwich"
    soft_caps = True
    module_names = SANDWICH_NAMES
    offset_norms = SANDWICH_NORMS
    global_every: ClassVar[int] = 2  # the default pattern: every 2nd layer global
    global_every_key: ClassVar[str | None] = None  # a config key that overrides it
    cap_defaults: ClassVar[dict[str, float | None]] = {  # transformers' Gemma2Config defaults
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }

    def _types(self, values: dict[str, Any]) -> list[str]:
        return gemma_types(values, self.global_every, self.global_every_key)

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        # Gemma's window needs no use_sliding_window: a sliding layer uses sliding_window.
        windowed = values | {"use_sliding_window": values.get("sliding_window") is not None}
        return super().unsupported(values) + types_problems(self._types(values), windowed)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        caps = {k: values.get(k, v) for k, v in self.cap_defaults.items()}
        return (
            super().fields(values)
            | types_fields(self._types(values), values)
            | {k: None if v is None else float(v) for k, v in caps.items()}
            | {"query_pre_attn_scalar": float(values.get("query_pre_attn_scalar", 256)), "norm_placement": "sandwich"}
        )

    def export_problems(self, config: Any) -> list[str]:
        return [p for p in super().export_problems(config) if not p.startswith("sliding_window")]

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        act = out.pop("hidden_act")
        types = types_to_hf(config)
        del types["use_sliding_window"]
        scalar = config.query_pre_attn_scalar or config.head_dim or config.d_model // config.num_heads
        scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers types it int
        return (
            out
            | types
            | {"hidden_activation": act, "query_pre_attn_scalar": scalar}
            | {k: getattr(config, k) for k in _CAPS}
        )

    # `claims`: Gemma's (one RoPE base) with this class's norms (sandwich, no q/k norms).
