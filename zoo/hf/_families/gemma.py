"""Hugging Face Gemma ↔ `zoo.models.Transformer`: Llama with three changes.

Gemma (1) is `llama.py` with: the token embeddings multiplied by `sqrt(hidden_size)`
(`TransformerConfig.embed_scale`), RMSNorm scaling by `1 + weight` (the zoo leaf holds
`1 + weight`: `Source.offset` adds 1 on reading and subtracts it on writing), and a GeGLU
feed-forward (`hidden_act: "gelu_pytorch_tanh"` on the gate: activation `"geglu"`); the
head is tied by default. Tensor names are Llama's.

Gemma 2 and Gemma 3's text decoder are this class with more changes (`gemma2.py`,
`gemma3.py`, which also reads the text decoder of the multimodal Gemma 3 checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from .._family import register
from .._layout import Source
from .llama import Llama, uniform_rope

if TYPE_CHECKING:
    from ...models import TransformerConfig

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
_NORMS = ("layers.layers.attention_norm", "layers.layers.mlp_norm", "final_norm")


@register
class Gemma(Llama):
    """Gemma (`GemmaForCausalLM`) ↔ a `zoo.models.Transformer` with `embed_scale`, `geglu`."""

    feed_forward_bias = False

    name = "gemma"
    architecture = "GemmaForCausalLM"
    tie_default = True
    offset_norms: ClassVar[tuple[str, ...]] = _NORMS  # zoo modules whose scale is `1 + weight`

    def _act(self, values: dict[str, Any]) -> str:
        return values.get("hidden_activation") or values.get("hidden_act", "gelu_pytorch_tanh")

    def unsupported(self, values: dict[str, Any]) -> list[str]:
        problems = []
        act = self._act(values)
        if act not in _GELU_TANH:
            problems.append(f"hidden_act={act!r} (zoo's GeGLU gate is the tanh GELU: {list(_GELU_TANH)})")
        if values.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention=True (zoo's Transformer is causal)")
        return problems

    def fields(self, values: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields(values)
        return fields | {"activation": "geglu", "embed_scale": float(math.sqrt(fields["d_model"]))}

    def export_problems(self, config: TransformerConfig) -> list[str]:
        problems = [p for p in super().export_problems(config) if not p.startswith(("activation=", "embed_scale="))]
        if config.activation != "geglu":
            problems.append(f"activation={config.activation!r} (Gemma's feed-forward is GeGLU: 'geglu')")
        if config.embed_scale != math.sqrt(config.d_model):
            problems.append(
                f"embed_scale={config.embed_scale} (Gemma's is sqrt(d_model) = {math.sqrt(config.d_model)})"
            )
        return problems

    def config_to_hf(self, config: TransformerConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
        out = super().config_to_hf(config, base)
        act = self._act(base) if base else "gelu_pytorch_tanh"
        return out | {"hidden_act": act if act in _GELU_TANH else "gelu_pytorch_tanh"}

    def claims(self, config: Any) -> bool:
        return (
            isinstance(config, self.config_class)
            and config.positions == "rope"
            and config.activation == "geglu"
            and self.norms_match(config)
            and uniform_rope(config)
        )

    def source(self, module: str, param: str, parent: Any, shape: tuple[int, ...], config: Any) -> Source | None:
        source = super().source(module, param, parent, shape, config)
        if source is not None and module in self.offset_norms:
            source = dataclasses.replace(source, offset=1.0)
        return source
