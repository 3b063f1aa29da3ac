"""LoRA: low-rank adapter branches on any zoo model, trained and communicated alone.

`add_lora(model, config, key=)` → `TrainStep(..., trainable=trainable(model, config))` →
`merge` / `unmerge` / `unload`; `save_adapter` / `load_adapter` in peft's layout, with Hugging Face module names.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._apply": (
            "OUTPUT_LAYERS",
            "add_lora",
            "disabled_adapters",
            "is_adapter",
            "merge",
            "modules",
            "target_names",
            "trainable",
            "unload",
            "unmerge",
        ),
        "._cast": ("cast_frozen",),
        "._config": ("LoraConfig",),
        "._embedding": ("LoraEmbedding",),
        "._expert_layer": ("LoraExpertLinear",),
        "._folders": ("load_adapters", "save_adapters"),
        "._io": ("load_adapter", "save_adapter"),
        "._layer": ("LoraLinear",),
        "._multi_expert": ("MultiLoraExpertLinear",),
        "._multi_linear": ("MultiLoraLinear",),
        "._named": (
            "adapter",
            "adapter_names",
            "delete_adapter",
            "route",
            "set_adapter",
            "stack_adapters",
        ),
        "._names": ("hf_module_name",),
        "._routed": ("adapter_norms", "clip_per_adapter", "routed"),
        "._safetensors": ("tensors_sha256",),
        "._tokens": ("TrainableTokens",),
        "._weighted": ("add_adapter", "add_weighted_adapter"),
    },
)

if TYPE_CHECKING:
    from ._apply import (
        OUTPUT_LAYERS,
        add_lora,
        disabled_adapters,
        is_adapter,
        merge,
        modules,
        target_names,
        trainable,
        unload,
        unmerge,
    )
    from ._cast import cast_frozen
    from ._config import LoraConfig
    from ._embedding import LoraEmbedding
    from ._expert_layer import LoraExpertLinear
    from ._folders import load_adapters, save_adapters
    from ._io import load_adapter, save_adapter
    from ._layer import LoraLinear
    from ._multi_expert import MultiLoraExpertLinear
    from ._multi_linear import MultiLoraLinear
    from ._named import (
        adapter,
        adapter_names,
        delete_adapter,
        route,
        set_adapter,
        stack_adapters,
    )
    from ._names import hf_module_name
    from ._routed import adapter_norms, clip_per_adapter, routed
    from ._safetensors import tensors_sha256
    from ._tokens import TrainableTokens
    from ._weighted import add_adapter, add_weighted_adapter

__all__ = [
    "OUTPUT_LAYERS",
    "LoraConfig",
    "LoraEmbedding",
    "LoraExpertLinear",
    "LoraLinear",
    "MultiLoraExpertLinear",
    "MultiLoraLinear",
    "TrainableTokens",
    "adapter",
    "adapter_names",
    "adapter_norms",
    "add_adapter",
    "add_lora",
    "add_weighted_adapter",
    "cast_frozen",
    "clip_per_adapter",
    "delete_adapter",
    "disabled_adapters",
    "hf_module_name",
    "is_adapter",
    "load_adapter",
    "load_adapters",
    "merge",
    "modules",
    "route",
    "routed",
    "save_adapter",
    "save_adapters",
    "set_adapter",
    "stack_adapters",
    "target_names",
    "tensors_sha256",
    "trainable",
    "unload",
    "unmerge",
]
