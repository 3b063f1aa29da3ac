"""Hugging Face Qwen2 ↔ `zoo.models.Transformer`: Llama with q/k/v biases.

Qwen2 is `llama.py` with biases on the q, k and v projections only (none on o or the
feed-forward), the head usually tied in small models (`tie_word_embeddings`), and a
sliding window that is off unless `use_sliding_window`, on the layers from
`max_window_layers` on (or those `layer_types` marks `"sliding_attention"`):
`TransformerConfig.sliding_layers`, a pattern the scanned layers read as data. Tensor
names are Llama's.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import Llama, _bias, uniform_rope


@register
class Qwen2(Llama):
    """Qwen2 (`Qwen2ForCausalLM`) ↔ a `zoo.models.Transformer` with q/k/v biases."""

    name = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        return super().unsupported(values) + window_problems(values)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        return (
            super().fields(values)
            | {
                "qkv_bias": True,
                "o_bias": None,
                "mlp_bias": None,
            }
            | window_fields(values)
        )

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
            and uniform_rope(config)
        )


def _layer_types(values: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, `"sliding_attention"` or `"full_attention"`, as
    transformers derives it (`layer_types`, else `use_sliding_window` from layer
    `max_window_layers` on)."""
    layers = values.get("num_hidden_layers", 0)
    if values.get("layer_types"):
        return layer_types(values)
    sliding = values.get("use_sliding_window", False) and values.get("sliding_window") is not None
    first = values.get("max_window_layers", layers)
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]


def layer_types(values: dict[str, Any]) -> list[str]:
    """A config's `layer_types` in transformers' current spelling (`"attention"` is
    `"full_attention"`)."""
    return ["full_attention" if t == "attention" else t for t in values["layer_types"]]


def types_problems(types: list[str], values: dict[str, Any]) -> list[str]:
    """What of per-layer attention kinds `types` zoo cannot build: kinds other than full and
    sliding attention, sliding layers without a window (`use_sliding_window` and
    `sliding_window`), or a count other than `num_hidden_layers`."""
    problems = []
    other = sorted(set(types) - {"sliding_attention", "full_attention"})
    if other:
        problems.append(f"layer_types {other} (zoo builds 'full_attention' and 'sliding_attention' layers)")
    if "sliding_attention" in types and not (values.get("use_sliding_window") and values.get("sliding_window")):
        problems.append(
            "layer_types marks sliding layers without use_sliding_window and a sliding_window (transformers' "
            "attention kernels disagree on what they attend to): set both, or mark them 'full_attention'"
        )
    if len(types) != values.get("num_hidden_layers", len(types)):
        problems.append(f"layer_types holds {len(types)} layers for num_hidden_layers={values['num_hidden_layers']}")
    return problems


def types_fields(types: list[str], values: dict[str, Any]) -> dict[str, Any]:
    """`TransformerConfig.sliding_window` and `sliding_layers` of per-layer attention kinds
    `types` (checked by `types_problems`): no window, one on every layer, or a pattern."""
    sliding = tuple(t == "sliding_attention" for t in types)
    if not any(sliding):
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": values["sliding_window"], "sliding_layers": None if all(sliding) else sliding}


def types_to_hf(config: Any) -> dict[str, Any]:
    """`use_sliding_window`, `sliding_window` and `layer_types` of `config`'s windows (one
    on every layer, on the `sliding_layers`, or none)."""
    sliding = config.sliding_layers or (config.sliding_window is not None,) * config.num_layers
    on = config.sliding_window is not None and any(sliding)
    return {
        "use_sliding_window": on,
        "sliding_window": config.sliding_window,
        "layer_types": ["sliding_attention" if on and s else "full_attention" for s in sliding],
    }


def window_problems(values: dict[str, Any]) -> list[str]:
    """A Qwen config's window options zoo's layers cannot hold."""
    return types_problems(_layer_types(values), values)


def window_fields(values: dict[str, Any]) -> dict[str, Any]:
    """`TransformerConfig.sliding_window` and `sliding_layers` of a Qwen config: the layers
    from `max_window_layers` on slide (or those `layer_types` marks)."""
    return types_fields(_layer_types(values), values)


def window_to_hf(config: Any) -> dict[str, Any]:
    """A Qwen config's window options for `config`'s windows; `max_window_layers` is the
    first sliding layer when the sliding layers are the last ones (what it can say;
    `layer_types`, which transformers reads first, holds any pattern)."""
    out = types_to_hf(config)
    sliding = [t == "sliding_attention" for t in out["layer_types"]]
    first = sliding.index(True) if any(sliding) else config.num_layers
    tail = all(sliding[first:])
    return out | {"max_window_layers": first if tail else config.num_layers}
