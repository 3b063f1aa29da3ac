"""Hugging Face Mixtral ↔ `zoo.models.Transformer`: Mistral with a mixture of experts.

Mixtral is `mistral.py` with every layer's feed-forward a sparse mixture of
`num_local_experts` SwiGLU experts (`zoo.nn.Experts`, `TransformerConfig.num_experts`),
each `intermediate_size` wide: a router (`block_sparse_moe.gate`) whose softmax's
`num_experts_per_tok` largest probabilities, renormalised, weight each token's experts.
`router_aux_loss_coef` (the load-balancing loss's weight) and `output_router_logits`
(whether the training loss adds it) are read and written;
`router_jitter_noise` (training-time noise on the router's input) is not built and
refused unless 0.

The files hold one tensor per expert (what transformers' `save_pretrained` writes and the
released checkpoints hold); the zoo stacks them on the `expert` axis:

| zoo `Transformer`, layer `i`, expert `j` | Mixtral (`MixtralForCausalLM`) |
|---|---|
| `layers.layers.mlp.router.weight` | `model.layers.{i}.block_sparse_moe.gate.weight` |
| `layers.layers.mlp.gate.weight[j]` | `model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight` |
| `layers.layers.mlp.up.weight[j]` | `model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight` |
| `layers.layers.mlp.down.weight[j]` | `model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight` |

Attention, norms, embeddings and head are Llama's names. `ExpertsFamily` is the part
Qwen3-MoE (`qwen3_moe.py`) shares.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np

from .._family import register
from .._layout import Source
from .llama import LLAMA_NAMES, _bias, uniform_rope
from .mistral import Mistral

EXPERT_MODULES = ("gate", "up", "down")


def expert_names(moe: str, router: str, projections: dict[str, str]) -> dict[str, str]:
    """`module_names` entries of a mixture-of-experts layer: the container `moe` and its
    `router` (names under `model.layers.{0}.`), each expert projection as its per-expert
    name without the expert number (`…experts.w1`: the file's `…experts.{j}.w1`)."""
    layer = "model.layers.{0}"
    return {
        "layers.layers.mlp": f"{layer}.{moe}",
        "layers.layers.mlp.router": f"{layer}.{router}",
        **{f"layers.layers.mlp.{zoo}": f"{layer}.{moe}.experts.{hf}" for zoo, hf in projections.items()},
    }


# transformers 5's fused expert tensors of layer `i` (its in-memory layout, and how
# `save_pretrained(save_original_format=False)` writes them): experts stacked, gate | up fused.
_FUSED = re.compile(r"(?P<layer>(?:.*\.)?layers\.\d+\.)mlp\.experts\.(?P<fused>gate_up_proj|down_proj)")


class PerExpertFiles:
    """A checkpoint whose experts are transformers 5's fused tensors (`mlp.experts.gate_up_proj`
    `[experts, 2·width, hidden]`, gate rows first; `mlp.experts.down_proj` `[experts, hidden,
    width]`), read as the one tensor per expert the family names (`…experts.{j}.w1.weight`):
    each a slice of the fused one, read only where a device's shard needs it. Other tensors
    pass through, renamed where the family's container differs (Mixtral's `mlp.` is
    `block_sparse_moe.`)."""

    def __init__(self, checkpoint: Any, family: ExpertsFamily):
        self._file = checkpoint
        # name -> (file name, expert or None, first row, rows)
        self._parts: dict[str, tuple[str, int | None, int, int]] = {}
        gate, up, down = (family.expert_projections[p] for p in EXPERT_MODULES)
        container = family.experts_at.split(".experts.")[0].split("}.", 1)[1]  # "block_sparse_moe" / "mlp"
        for key in checkpoint.keys():
            match = _FUSED.fullmatch(key)
            if match is None:
                shape = checkpoint.shape(key)
                renamed = re.sub(r"(layers\.\d+\.)mlp\.", rf"\g<1>{container}.", key)
                self._parts[renamed] = (key, None, 0, shape[0] if shape else 0)
                continue
            experts, rows, _ = checkpoint.shape(key)
            layer = f"{match['layer']}{container}.experts"
            if match["fused"] == "gate_up_proj":
                blocks = ((gate, 0, rows // 2), (up, rows // 2, rows // 2))
            else:
                blocks = ((down, 0, rows),)
            for j in range(experts):
                for name, first, count in blocks:
                    self._parts[f"{layer}.{j}.{name}.weight"] = (key, j, first, count)

    def keys(self) -> list[str]:
        """Every tensor name, the experts' one per expert."""
        return list(self._parts)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` (an expert's: `[rows, columns]` of its slice)."""
        key, expert, _, rows = self._parts[name]
        shape = self._file.shape(key)
        return shape if expert is None else (rows, shape[2])

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The part `index` of tensor `name` (an expert's: of its slice of the fused tensor)."""
        key, expert, first, rows = self._parts[name]
        if expert is None:
            return self._file.read(key, index)
        rows_index, cols = index or (slice(0, rows), slice(0, self._file.shape(key)[2]))
        start, stop, _ = rows_index.indices(rows)
        return self._file.read(key, (slice(expert, expert + 1), slice(first + start, first + stop), cols))[0]


class ExpertsFamily:
    """The mixture-of-experts part of a Llama-shaped family (a mixin before it): config
    fields, the per-expert tensor names (`experts_at`: the name of layer `{0}`'s expert
    `{1}`; `expert_projections`: zoo projection → its name there), refusals."""

    experts: ClassVar[bool] = True
    experts_at: ClassVar[str] = ""
    expert_projections: ClassVar[dict[str, str]] = {}
    experts_key: ClassVar[str] = "num_local_experts"  # config.json's number of experts
    # peft's `target_parameters` names the experts as transformers 5 holds them (both
    # families): layer `{0}`'s `mlp.experts`, whose 3-D parameters are zoo projection →
    # (parameter, block of its outputs or None), in the order the module defines them
    # (peft nests the wrapper of a later one around the earlier one's).
    lora_experts: ClassVar[str] = "model.layers.{0}.mlp.experts"
    lora_expert_parameters: ClassVar[dict[str, tuple[str, int | None]]] = {
        "gate": ("gate_up_proj", 0),
        "up": ("gate_up_proj", 1),
        "down": ("down_proj", None),
    }
    expert_width_key: ClassVar[str] = "intermediate_size"  # config.json's width of each expert

    def moe_problems(self, values: dict[str, Any]) -> list[str]:
        """The mixture-of-experts options of `values` the zoo does not build."""
        problems = []
        if values.get("router_jitter_noise"):
            problems.append(
                f"router_jitter_noise={values['router_jitter_noise']} (zoo's router takes no training noise; "
                "set it to 0 in config.json)"
            )
        return problems

    def moe_fields(self, values: dict[str, Any]) -> dict[str, Any]:
        """The zoo `TransformerConfig` expert fields of `values`."""
        experts = values.get(self.experts_key, values.get("num_local_experts", values.get("num_experts")))
        if experts is None:
            raise ValueError(f"the {self.name} config has no {self.experts_key!r}; it is required")
        width = values.get(self.expert_width_key)
        return {
            "num_experts": int(experts),
            "num_experts_per_tok": int(values.get("num_experts_per_tok", 2)),
            "moe_mlp_dim": None if self.expert_width_key == "intermediate_size" else width,
            "router_aux_loss_coef": float(values.get("router_aux_loss_coef", 0.001)),
            "output_router_logits": bool(values.get("output_router_logits", False)),
        }

    def moe_to_hf(self, config: Any) -> dict[str, Any]:
        """`config.json`'s expert options of `config`."""
        return {
            self.experts_key: config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.output_router_logits,
        }

    def file_view(self, checkpoint: Any) -> Any:
        """The checkpoint as this family's names read it: one tensor per expert, also from
        a file holding transformers 5's fused expert tensors (`PerExpertFiles`)."""
        if any(_FUSED.fullmatch(k) for k in checkpoint.keys()):
            return PerExpertFiles(checkpoint, self)
        return checkpoint

    def source(self, module: str, param: str, parent: Any, shape: tuple[int, ...], config: Any) -> Source | None:
        projection = module.removeprefix("layers.layers.mlp.")
        if param != "weight" or module == projection or projection not in self.expert_projections:
            return super().source(module, param, parent, shape, config)  # type: ignore[misc]
        layers, experts = shape[:2]
        hf = self.expert_projections[projection]
        names = tuple(f"{self.experts_at.format(i, j)}.{hf}.weight" for i, j in np.ndindex(layers, experts))
        return Source.of(names, tuple(shape[2:]), stacked=2, transpose=True)


@register
class Mixtral(ExpertsFamily, Mistral):
    """Mixtral (`MixtralForCausalLM`) ↔ a `zoo.models.Transformer` with `num_experts`."""

    name = "mixtral"
    architecture = "MixtralForCausalLM"
    experts_at = "model.layers.{0}.block_sparse_moe.experts.{1}"
    expert_projections = {"gate": "w1", "up": "w3", "down": "w2"}
    module_names = LLAMA_NAMES | expert_names("block_sparse_moe", "block_sparse_moe.gate", expert_projections)
    lora_names = Mistral.lora_names | {"gate": "w1", "up": "w3", "down": "w2"}

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        return super().unsupported(values) + self.moe_problems(values)

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        return super().fields(values) | self.moe_fields(values)

    def export_problems(self, config: Any) -> list[str]:
        problems = super().export_problems(config)
        if config.moe_mlp_dim not in (None, config.hidden_dim):
            problems.append(
                f"moe_mlp_dim={config.moe_mlp_dim} with mlp_dim={config.hidden_dim} (Mixtral's experts are "
                "intermediate_size wide: one width)"
            )
        if not config.norm_topk_prob:
            problems.append("norm_topk_prob=False (Mixtral renormalises each token's top-k router weights)")
        return problems

    def config_to_hf(self, config: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        return out | {"intermediate_size": config.expert_dim, "router_jitter_noise": 0.0} | self.moe_to_hf(config)

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "swiglu"
            and config.norm_topk_prob
            and self.norms_match(config)
            and not _bias(config, "qkv_bias")
            and config.sliding_layers is None
            and uniform_rope(config)
        )
