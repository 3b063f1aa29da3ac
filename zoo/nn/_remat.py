"""Rematerialisation policies of a layer stack, and the values the `"projections"` policy keeps."""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

# The name `saved` gives a layer's values: the outputs of its projections (q, k, v, gate, up),
# the attention's output and the residual stream between attention and feed-forward.
SAVED = "zoo_saved"


def saved(x):
    """`x` unchanged, named for the `"projections"` policy: the values it keeps for the
    backward pass (without a `jax.checkpoint` around it, the name changes nothing)."""
    return checkpoint_name(x, SAVED)


_REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    # Keep what a matmul made (each projection's output, the attention's output, the residual
    # between attention and feed-forward, which the output projection made); recompute the
    # norms, RoPE, the attention's scores and probabilities, the activation and its
    # derivative, and the LoRA branches' rank-r products: no large matmul runs twice.
    "projections": jax.checkpoint_policies.save_only_these_names(SAVED),
}

REMAT_POLICIES = tuple(_REMAT_POLICIES)
