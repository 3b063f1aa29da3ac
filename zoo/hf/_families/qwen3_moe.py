"""Hugging Face Qwen3-MoE ↔ `zoo.models.Transformer`: Qwen3 with a mixture of experts.

Qwen3-MoE is `qwen3.py` (q/k norms per head, an explicit `head_dim`) with every layer's
feed-forward a sparse mixture of `num_experts` SwiGLU experts (`zoo.nn.Experts`), each
`moe_intermediate_size` wide (`TransformerConfig.moe_mlp_dim`; `intermediate_size`, the
width of its dense layers, is kept as `mlp_dim`): a router (`mlp.gate`) whose softmax's
`num_experts_per_tok` largest probabilities weight each token's experts, renormalised
only when `norm_topk_prob` (`TransformerConfig.norm_topk_prob`). Refused by name: dense
layers among the sparse ones (`decoder_sparse_step` other than 1, `mlp_only_layers`: the
zoo's one scanned stack holds one kind of layer) and `use_sliding_window`.

| zoo `Transformer`, layer `i`, expert `j` | Qwen3-MoE (`Qwen3MoeForCausalLM`) |
|---|---|
| `layers.layers.mlp.router.weight` | `model.layers.{i}.mlp.gate.weight` |
| `layers.layers.mlp.{gate,up,down}.weight[j]` | `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` |

The rest is Qwen3's names.
"""

from __future__ import annotations

from typing import Any

from .._family import register
from .llama import LLAMA_NAMES
from .mixtral import ExpertsFamily, expert_names
from .qwen3 import _NORMS, Qwen3

_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@register
class Qwen3Moe(ExpertsFamily, Qwen3):
    """Qwen3-MoE (`Qwen3MoeForCausalLM`) ↔ a `zoo.models.Transformer` with `qk_norm` and
    `num_experts`."""

    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    experts_at = "model.layers.{0}.mlp.experts.{1}"
    expert_projections = _PROJECTIONS
    experts_key = "num_experts"
    expert_width_key = "moe_intermediate_size"
    module_names = (
        LLAMA_NAMES
        | {f"layers.layers.{zoo}": f"model.layers.{{0}}.{hf}" for zoo, hf in _NORMS.items()}
        | expert_names("mlp", "mlp.gate", _PROJECTIONS)
    )

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        problems = super().unsupported(values) + self.moe_problems(values)
        step, dense = values.get("decoder_sparse_step", 1), values.get("mlp_only_layers") or []
        if step != 1 or dense:
            problems.append(
                f"decoder_sparse_step={step}, mlp_only_layers={dense} (dense feed-forward layers among the sparse "
                "ones: zoo's scanned stack holds one kind of layer; it builds decoder_sparse_step=1 and "
                "mlp_only_layers=[], every layer a mixture of experts, as the released Qwen3-MoE models)"
            )
        if values.get("use_sliding_window"):
            problems.append("use_sliding_window=True (zoo builds Qwen3-MoE without a sliding window: set it false)")
        return problems

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        if "moe_intermediate_size" not in values:
            raise ValueError("the qwen3_moe config has no 'moe_intermediate_size'; it is required")
        return (
            super().fields(values)
            | self.moe_fields(values)
            | {"norm_topk_prob": bool(values.get("norm_topk_prob", False))}
        )

    def export_problems(self, config: Any) -> list[str]:
        problems = super().export_problems(config)
        if config.sliding_window is not None:
            problems.append(f"sliding_window={config.sliding_window} (zoo writes Qwen3-MoE without a sliding window)")
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        for key in ("max_window_layers", "layer_types"):
            out.pop(key, None)
        return (
            out
            | {
                "moe_intermediate_size": config.expert_dim,
                "norm_topk_prob": config.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "use_sliding_window": False,
            }
            | self.moe_to_hf(config)
        )
