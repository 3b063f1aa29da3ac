"""Zoo modules: batched, global-view, annotated, and safe with reduced parameters."""

from ._attention import Attention
from ._block import TransformerBlock
from ._dropout import ExampleKeys, dropout, example_keys, fold_in
from ._embedding import Embedding
from ._feedforward import ACTIVATIONS, FeedForward
from ._inputs import place_inputs
from ._linear import Linear, project
from ._mlp import MLP, MLPBlock
from ._norm import LayerNorm, RMSNorm
from ._quantized import QuantizedLinear, dequantize
from ._rope import apply_rope, rope_tables
from ._sharding import broadcast_like
from ._stacked import REMAT_POLICIES, Stacked

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "REMAT_POLICIES",
    "Attention",
    "Embedding",
    "ExampleKeys",
    "FeedForward",
    "LayerNorm",
    "Linear",
    "MLPBlock",
    "QuantizedLinear",
    "RMSNorm",
    "Stacked",
    "TransformerBlock",
    "apply_rope",
    "broadcast_like",
    "dequantize",
    "dropout",
    "example_keys",
    "fold_in",
    "place_inputs",
    "project",
    "rope_tables",
]
