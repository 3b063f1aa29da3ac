"""Hugging Face Mistral ↔ `zoo.models.Transformer`: Llama with a sliding window.

Mistral is `llama.py` with `sliding_window` (every layer attends only to the last
`sliding_window` positions: `TransformerConfig.sliding_window`, a banded causal mask) and
no `attention_bias` / `mlp_bias` options. Tensor names are Llama's.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import Llama, _bias, uniform_rope


@register
class Mistral(Llama):
    """Mistral (`MistralForCausalLM`) ↔ a `zoo.models.Transformer` with a sliding window."""

    name = "mistral"
    architecture = "MistralForCausalLM"

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields(values)
        return fields | {
            "qkv_bias": None,
            "o_bias": None,
            "mlp_bias": None,
            "sliding_window": values.get("sliding_window"),
        }

    def export_problems(self, config: Any) -> list[str]:
        problems = [p for p in super().export_problems(config) if not p.startswith("sliding_window")]
        for name in ("qkv_bias", "o_bias", "mlp_bias"):
            if _bias(config, name):  # `None` is `use_bias`
                problems.append(f"{name}=True (Mistral's projections have no biases)")
        if config.sliding_layers is not None:
            problems.append(f"sliding_layers=... ({self.name}'s window applies to every layer; Qwen2 has it on some)")
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        del out["attention_bias"], out["mlp_bias"]
        return out | {"sliding_window": config.sliding_window}

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and config.sliding_window is not None
            and self.norms_match(config)
            and config.sliding_layers is None
            and uniform_rope(config)
        )
