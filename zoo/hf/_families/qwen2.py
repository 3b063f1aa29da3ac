"""Hugging Face Qwen2 ↔ `zoo.models.Transformer`: Llama with q/k/v biases.

Qwen2 is `llama.py` with biases on the q, k and v projections only (none on o or the
feed-forward), the head usually tied in small models (`tie_word_embeddings`), and a
sliding window that is off unless `use_sliding_window` (zoo's layers share one attention
pattern, so the window must apply to every layer: `max_window_layers` 0, or
`layer_types` all `"sliding_attention"`). Tensor names are Llama's.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import Llama, _bias


@register
class Qwen2(Llama):
    """Qwen2 (`Qwen2ForCausalLM`) ↔ a `zoo.models.Transformer` with q/k/v biases."""

    name = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        return super().unsupported(values) + window_problems(values)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        return super().fields(values) | {
            "qkv_bias": True,
            "o_bias": None,
            "mlp_bias": None,
            "sliding_window": window_of(values),
        }

    def export_problems(self, config: Any) -> list[str]:
        problems = [p for p in super().export_problems(config) if not p.startswith(("qkv_bias", "sliding_window"))]
        if not _bias(config, "qkv_bias") or _bias(config, "o_bias") or _bias(config, "mlp_bias"):
            problems.append(
                f"qkv_bias={config.qkv_bias}, o_bias={config.o_bias}, mlp_bias={config.mlp_bias} (Qwen2 has "
                "biases on q, k and v only: qkv_bias=True, o_bias and mlp_bias off)"
            )
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        del out["attention_bias"], out["mlp_bias"]
        return out | window_to_hf(config)

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and _bias(config, "qkv_bias")
            and not _bias(config, "o_bias")
            and self.norms_match(config)
        )


def _layer_types(values: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, `"sliding_attention"` or `"full_attention"`, as
    transformers derives it (`layer_types`, else `use_sliding_window` from layer
    `max_window_layers` on)."""
    layers = values.get("num_hidden_layers", 0)
    if values.get("layer_types"):
        return list(values["layer_types"])
    sliding = values.get("use_sliding_window", False) and values.get("sliding_window") is not None
    first = values.get("max_window_layers", layers)
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]


def window_problems(values: dict[str, Any]) -> list[str]:
    """A Qwen config's window options zoo's layers cannot hold: a window on some layers only."""
    if len(set(_layer_types(values))) <= 1:
        return []
    return [
        "use_sliding_window=True with only some layers sliding (max_window_layers / layer_types): zoo's "
        "scanned layers share one attention pattern; set max_window_layers to 0 or use_sliding_window false"
    ]


def window_of(values: dict[str, Any]) -> int | None:
    """`TransformerConfig.sliding_window` of a Qwen config (every layer sliding, or None)."""
    return values.get("sliding_window") if _layer_types(values)[:1] == ["sliding_attention"] else None


def window_to_hf(config: Any) -> dict[str, Any]:
    """A Qwen config's window options for `config.sliding_window` (on every layer, or off)."""
    sliding = config.sliding_window is not None
    return {
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window,
        "max_window_layers": 0 if sliding else config.num_layers,
        "layer_types": [("sliding_attention" if sliding else "full_attention")] * config.num_layers,
    }
