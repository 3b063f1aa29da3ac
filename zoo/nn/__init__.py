"""Zoo modules: batched, global-view, annotated, and safe with reduced parameters."""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._attention": ("Attention",),
        "._block": ("TransformerBlock",),
        "._dropout": ("ExampleKeys", "dropout", "example_keys", "fold_in"),
        "._embedding": ("Embedding",),
        "._experts": (
            "ExpertLinear",
            "Experts",
            "RouterChoice",
            "load_balancing_loss",
            "load_balancing_loss_per_device",
        ),
        "._feedforward": ("ACTIVATIONS", "FeedForward"),
        "._four_bit_linear": ("FourBitLinear",),
        "._inputs": ("place_inputs",),
        "._linear": ("Linear", "project"),
        "._mlp": ("MLP", "MLPBlock"),
        "._norm": ("LayerNorm", "RMSNorm"),
        "._quantized": ("QuantizedLinear", "dequantize"),
        "._rope": ("RopeScaling", "apply_rope", "rope_tables"),
        "._sharding": ("broadcast_like",),
        "._remat": ("REMAT_POLICIES",),
        "._stacked": ("Stacked",),
    },
)

if TYPE_CHECKING:
    from ._attention import Attention
    from ._block import TransformerBlock
    from ._dropout import ExampleKeys, dropout, example_keys, fold_in
    from ._embedding import Embedding
    from ._experts import ExpertLinear, Experts, RouterChoice, load_balancing_loss, load_balancing_loss_per_device
    from ._feedforward import ACTIVATIONS, FeedForward
    from ._four_bit_linear import FourBitLinear
    from ._inputs import place_inputs
    from ._linear import Linear, project
    from ._mlp import MLP, MLPBlock
    from ._norm import LayerNorm, RMSNorm
    from ._quantized import QuantizedLinear, dequantize
    from ._remat import REMAT_POLICIES
    from ._rope import RopeScaling, apply_rope, rope_tables
    from ._sharding import broadcast_like
    from ._stacked import Stacked

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "REMAT_POLICIES",
    "Attention",
    "Embedding",
    "ExampleKeys",
    "ExpertLinear",
    "Experts",
    "FeedForward",
    "FourBitLinear",
    "LayerNorm",
    "Linear",
    "MLPBlock",
    "QuantizedLinear",
    "RMSNorm",
    "RopeScaling",
    "RouterChoice",
    "Stacked",
    "TransformerBlock",
    "apply_rope",
    "broadcast_like",
    "dequantize",
    "dropout",
    "example_keys",
    "fold_in",
    "load_balancing_loss",
    "load_balancing_loss_per_device",
    "place_inputs",
    "project",
    "rope_tables",
]
