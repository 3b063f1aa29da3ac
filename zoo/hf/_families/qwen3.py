"""Hugging Face Qwen3 ↔ `zoo.models.Transformer`: Llama with q/k norms.

Qwen3 is `llama.py` with each query and key head RMS-normalised over its `head_dim`
before RoPE (`self_attn.q_norm`, `self_attn.k_norm`: `TransformerConfig.qk_norm`), one
`attention_bias` for q, k, v and o as Llama's (off in the released models), an explicit
`head_dim` (128 in the released models, whatever the width), and Qwen2's sliding window,
off unless `use_sliding_window`, on the layers from `max_window_layers` on or those
`layer_types` marks (`TransformerConfig.sliding_layers`).
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import LLAMA_NAMES, Llama, _bias, uniform_rope
from .qwen2 import window_fields, window_problems, window_to_hf

_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}


@register
class Qwen3(Llama):
    """Qwen3 (`Qwen3ForCausalLM`) ↔ a `zoo.models.Transformer` with `qk_norm`."""

    feed_forward_bias = False

    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm_scope = "head"
    module_names = LLAMA_NAMES | {f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _NORMS.items()}

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        return super().unsupported(values) + window_problems(values)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        return super().fields(values) | {"qk_norm": True} | window_fields(values)

    def export_problems(self, config: Any) -> list[str]:
        problems = [p for p in super().export_problems(config) if not p.startswith("sliding_window")]
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        return out | window_to_hf(config)

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and self.norms_match(config)
            and _bias(config, "qkv_bias") == _bias(config, "o_bias")
            and uniform_rope(config)
        )
