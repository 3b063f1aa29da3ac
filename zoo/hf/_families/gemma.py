"""Gemma (`gemma`, `gemma2`, `gemma3_text`): refused, with the reason.

Gemma's config cannot be expressed by `zoo.models.Transformer`: its RMSNorm scales by
`1 + weight`, the token embedding is multiplied by `sqrt(hidden_size)` before the first
layer, and its gated feed-forward is GeGLU (`gelu_pytorch_tanh` on the gate) where the
zoo's gate is SiLU only; Gemma 2 and 3 also soft-cap attention scores and logits and
alternate sliding-window and global layers, which the zoo's scanned layers (one shared
attention pattern) cannot.
"""

from __future__ import annotations

from .._family import refuse

_WHY = (
    "zoo.models.Transformer cannot express Gemma: RMSNorm scaled by (1 + weight), embeddings multiplied by "
    "sqrt(hidden_size), and a GeGLU feed-forward (zoo's gated feed-forward is SwiGLU only)"
)
refuse("gemma", _WHY)
refuse("gemma2", _WHY + "; also attention/logit soft-capping and alternating local/global layers")
refuse("gemma3_text", _WHY + "; also alternating local/global layers with two RoPE bases")
