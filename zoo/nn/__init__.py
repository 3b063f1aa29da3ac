"""Zoo modules: batched, global-view, annotated, and safe with reduced parameters."""

from ._broadcast import broadcast_like, sharding_spec
from ._embedding import Embedding
from ._linear import Linear
from ._mlp import MLP, MLPBlock
from ._norm import LayerNorm, RMSNorm
from ._stacked import REMAT_POLICIES, Stacked

__all__ = [
    "MLP",
    "REMAT_POLICIES",
    "Embedding",
    "LayerNorm",
    "Linear",
    "MLPBlock",
    "RMSNorm",
    "Stacked",
    "broadcast_like",
    "sharding_spec",
]
