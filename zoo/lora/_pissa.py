"""PiSSA / OLoRA adapters as adapters of the original base (peft's
`path_initial_model_for_weight_conversion`): their base keeps a residual, so the file
holds `ΔW = A B − A₀ B₀` as one rank-2r branch, `r` and `lora_alpha` doubled as peft
doubles them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
import safetensors.numpy

from ._config import LoraConfig
from ._peft_config import WEIGHTS_NAME


def _convert_to_original(
    tensors: dict[str, np.ndarray], values: dict[str, Any], config: LoraConfig, initial: Any
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """peft's `path_initial_model_for_weight_conversion`: the adapter as one on the
    original base, `ΔW = A B − A₀ B₀` (`A₀`, `B₀` from the adapter saved in `initial` at
    initialisation): each branch rank 2r, `r` and `lora_alpha` (and the patterns) doubled
    as peft doubles them, so its scaling is the same. A fused module's blocks keep their
    own rank columns together (each block's `[A; A₀]`), so zoo splits it back."""
    path = "the initial model" if isinstance(initial, dict) else Path(initial) / WEIGHTS_NAME
    try:
        start = initial if isinstance(initial, dict) else safetensors.numpy.load_file(str(path))
    except Exception as e:  # safetensors raises its own error types; a missing file too
        raise ValueError(
            f"path_initial_model_for_weight_conversion: cannot read {path} ({e}); save the adapter there right "
            "after add_lora (zoo.lora.save_adapter(model, config, that_folder)), before training"
        ) from e
    branches = {k for k in tensors if ".lora_A." in k or ".lora_B." in k}
    if set(start) & branches != branches or any(start[k].shape != tensors[k].shape for k in branches):
        raise ValueError(
            f"path_initial_model_for_weight_conversion: {path} holds other branches than this adapter (keys or "
            "shapes differ): pass the folder this adapter was saved to right after add_lora"
        )
    if any(".lora_magnitude_vector" in k for k in tensors):
        raise ValueError("path_initial_model_for_weight_conversion converts plain LoRA adapters only, not DoRA")
    out = dict(tensors)
    for k in branches:
        if ".lora_A." not in k:
            continue
        b_key = k.replace(".lora_A.", ".lora_B.")
        a, a0, b, b0 = tensors[k], start[k], tensors[b_key], start[b_key]
        groups = a.shape[0] // config.r  # a fused module's blocks, r rank rows each
        rows = lambda x, j: x[j * config.r : (j + 1) * config.r]
        out[k] = np.concatenate([p for j in range(groups) for p in (rows(a, j), rows(a0, j))], axis=0)
        out[b_key] = np.concatenate([p for j in range(groups) for p in (rows(b.T, j).T, -rows(b0.T, j).T)], axis=1)
    values = dict(values)
    values.update(
        init_lora_weights=True,
        r=2 * config.r,
        lora_alpha=config.lora_alpha * (math.sqrt(2) if config.use_rslora else 2),
        rank_pattern={m: 2 * r for m, r in values.get("rank_pattern", {}).items()},
        alpha_pattern={m: 2 * a for m, a in values.get("alpha_pattern", {}).items()},
    )
    return out, values
