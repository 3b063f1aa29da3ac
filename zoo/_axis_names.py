"""The logical axis names of the zoo's modules and the types of rules (logical axis →
mesh axes): plain Python, no jax, so the presets, and the `zoo` command's flags built
from them, load without it."""

from __future__ import annotations

from collections.abc import Mapping

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Every logical axis name the zoo's own modules use. A preset maps each of them.
LOGICAL_AXES = (
    "batch",  # activations: the global batch
    "seq",  # activations: sequence positions
    "layers",  # leading axis of stacked (scanned) layers
    "embed",  # model width
    "mlp",  # hidden width of feed-forward / MLP layers
    "mlp_in",  # input side of an MLP's width→width layers (so "mlp" is not used twice)
    "vocab",  # vocabulary (embedding rows, output head columns)
    "heads",  # attention query heads (flattened heads × head_dim of projections)
    "kv_heads",  # attention key/value heads (fewer than "heads" with grouped queries)
    "expert",  # the experts of a mixture-of-experts layer (stacked expert weights)
)
