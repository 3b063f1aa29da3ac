"""Hugging Face SmolLM3 ↔ `zoo.models.Transformer`: Llama with layers without RoPE.

SmolLM3 is `llama.py` with `no_rope_layers` (one flag a layer, `1`: the layer rotates its
queries and keys, `0`: a NoPE layer that does not; when absent, every
`no_rope_layer_interval`-th layer, the 4th, 8th, …, is NoPE): `TransformerConfig.rope_layers`,
a pattern the scanned layers read as data. Its optional sliding window
(`use_sliding_window`, `sliding_window`) applies to the layers `layer_types` marks
`"sliding_attention"`, by default the NoPE layers: `TransformerConfig.sliding_layers`.
The head is tied by default; RoPE's default base is 2,000,000. Tensor names are Llama's.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import Llama, _bias
from .qwen2 import layer_types, types_fields, types_problems, types_to_hf

_THETA = 2_000_000.0  # transformers' SmolLM3Config.default_theta


def _rope_flags(values: dict[str, Any]) -> list[int]:
    """Each layer's `no_rope_layers` flag (`1`: RoPE), as transformers derives it."""
    layers = values.get("num_hidden_layers", 0)
    if values.get("no_rope_layers") is not None:
        return [int(v) for v in values["no_rope_layers"][:layers]]
    interval = values.get("no_rope_layer_interval", 4)
    return [int((i + 1) % interval != 0) for i in range(layers)]


def _types(values: dict[str, Any]) -> list[str]:
    """Each layer's attention kind: `layer_types`, else sliding on the NoPE layers when
    `use_sliding_window` (transformers' `SmolLM3Config`)."""
    if values.get("layer_types"):
        return layer_types(values)
    window = values.get("use_sliding_window", False) and values.get("sliding_window") is not None
    return ["sliding_attention" if window and not rope else "full_attention" for rope in _rope_flags(values)]


@register
class SmolLM3(Llama):
    """SmolLM3 (`SmolLM3ForCausalLM`) ↔ a `zoo.models.Transformer` with `rope_layers`."""

    name = "smollm3"
    architecture = "SmolLM3ForCausalLM"
    tie_default = True

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        problems = super().unsupported(values)
        flags, layers = values.get("no_rope_layers"), values.get("num_hidden_layers", 0)
        if flags is not None and (len(flags) < layers or set(flags) - {0, 1}):
            problems.append(f"no_rope_layers={flags} (one 0 or 1 for each of the {layers} layers)")
        interval = values.get("no_rope_layer_interval", 4)
        if flags is None and (not isinstance(interval, int) or interval < 1):
            problems.append(f"no_rope_layer_interval={interval!r} (a positive number of layers)")
        return problems + types_problems(_types(values), values)

    def config_from_hf(self, values: dict[str, Any], **overrides: Any):
        params = values.get("rope_parameters") or {}
        if "rope_theta" not in params and "rope_theta" not in values:  # SmolLM3's own default base
            values = values | {"rope_theta": _THETA}
        return super().config_from_hf(values, **overrides)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields(values) | types_fields(_types(values), values)
        rope = tuple(bool(f) for f in _rope_flags(values))
        return fields | {"rope_layers": None if all(rope) else rope}

    def export_problems(self, config: Any) -> list[str]:
        return [p for p in super().export_problems(config) if not p.startswith(("rope_layers", "sliding_window"))]

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        rope = config.rope_layers or (True,) * config.num_layers
        interval = (base or {}).get("no_rope_layer_interval", 4)
        return (
            out | {"no_rope_layers": [int(r) for r in rope], "no_rope_layer_interval": interval} | types_to_hf(config)
        )

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and self.norms_match(config)
            and _bias(config, "qkv_bias") == _bias(config, "o_bias")
            and config.rope_thetas is None
            and (config.rope_layers is not None or config.sliding_layers is not None)
        )
