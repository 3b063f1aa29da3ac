"""Hugging Face Phi-3 ↔ `zoo.models.Transformer`: Mistral with fused projections.

Phi-3 (`Phi3ForCausalLM`) is `mistral.py` (Llama's blocks, no biases, an optional sliding
window on every layer) with q, k and v fused into one `self_attn.qkv_proj` (outputs
q | k | v: `heads·head_dim`, `kv_heads·head_dim` and `kv_heads·head_dim` wide, unequal
under grouped-query attention) and the gate and up projections into one
`mlp.gate_up_proj` (outputs gate | up), plus residual dropout (training only; zoo loads it
with dropout 0, as every decoder family). Each zoo projection reads its block of the fused
tensor (`Family.fused`, `_layout.Block`); LoRA branches on q/k/v (or gate/up) are written
as one peft branch on the fused module, as GPT-2's `c_attn`.

`partial_rotary_factor` (Phi-4-mini's 0.75; in `rope_parameters` in transformers 5, at the
top level in older files) is read and written: RoPE rotates the first
`int(head_dim · factor)` dimensions of each head (`TransformerConfig.partial_rotary_factor`).
`rope_scaling` of type `longrope` (`su` / `yarn` in older files; Phi-3.5 and Phi-4-mini's
per-frequency short and long factors, switched by the sequence's length against
`original_max_position_embeddings`) is read and written (`zoo.nn.RopeScaling`); a
generation that passes that length from within it is refused (transformers' `generate`
then drops the KV cache and runs the whole sequence again with the long factors, which a
decode loop over a cache does not).

Refused by name: a `hidden_act` other than `silu`.

| zoo `Transformer`, layer `i` | Phi-3 (`Phi3ForCausalLM`) |
|---|---|
| `layers.layers.attention.{q,k,v}_proj.weight` | `model.layers.{i}.self_attn.qkv_proj.weight`, blocks 0, 1, 2 |
| `layers.layers.mlp.{gate,up}.weight` | `model.layers.{i}.mlp.gate_up_proj.weight`, blocks 0, 1 |
| every other leaf | as Llama (`o_proj`, `down_proj`, the norms, `embed_tokens`, `lm_head`) |
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .._layout import fused_group
from .llama import LLAMA_NAMES
from .mistral import Mistral

_QKV, _GATE_UP = "model.layers.{0}.self_attn.qkv_proj", "model.layers.{0}.mlp.gate_up_proj"


@register
class Phi3(Mistral):
    """Phi-3 (`Phi3ForCausalLM`) ↔ a `zoo.models.Transformer` read from fused `qkv_proj` and
    `gate_up_proj` tensors."""

    name = "phi3"
    architecture = "Phi3ForCausalLM"
    module_names = LLAMA_NAMES | {
        "layers.layers.attention.q_proj": _QKV,
        "layers.layers.attention.k_proj": _QKV,
        "layers.layers.attention.v_proj": _QKV,
        "layers.layers.mlp.gate": _GATE_UP,
        "layers.layers.mlp.up": _GATE_UP,
    }
    fused = fused_group("layers.layers.attention", "q_proj", "k_proj", "v_proj") | fused_group(
        "layers.layers.mlp", "gate", "up"
    )
    lora_names = Mistral.lora_names | {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate": "gate_up_proj",
        "up": "gate_up_proj",
    }

    partial_rotary = True

    def config_from_hf(self, values: dict[str, Any], **overrides: Any):
        # Older Phi-3 files name longrope "su" or "yarn" (transformers' Phi3Config reads both as it).
        for key in ("rope_parameters", "rope_scaling"):
            rope = values.get(key)
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
                values = values | {key: {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}}
        return super().config_from_hf(values, **overrides)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        params = values.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
        return super().fields(values) | {"partial_rotary_factor": 1.0 if partial is None else float(partial)}

    def export_problems(self, config: Any) -> list[str]:
        return [p for p in super().export_problems(config) if not p.startswith("partial_rotary_factor")]

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        factor = config.partial_rotary_factor
        out = out | {
            "rope_parameters": out["rope_parameters"] | {"partial_rotary_factor": factor},
            "partial_rotary_factor": factor,
        }
        if config.rope_scaling == "longrope":  # Phi-3's own key, which transformers reads before the scaling's
            out["original_max_position_embeddings"] = config.rope_original_max_len
        return out

    def claims(self, config: Any) -> bool:
        return False  # a model built from scratch is written as Llama / Mistral; Phi-3 when loaded as one
