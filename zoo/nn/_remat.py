"""Rematerialisation policies of a layer stack, the values the `"projections"` policy keeps,
and the choice `"auto"` makes."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ._sharding import held_shape

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

# `remat="auto"` (the transformer configs' default) checkpoints the stack with `"projections"`
# when the residuals it would keep without remat exceed REMAT_AUTO_ABOVE bytes (one device's
# share), else not at all: the program of `remat=None`, so small models (the test suite's)
# compile what they always did. Measured (benchmarks/real_size.py, docs/performance.md
# "Fine-tuning at real size"): at Llama-3.2-1B's shape (16 layers, batch 4 x 256, float32,
# LoRA on every linear layer) `"projections"` cut the step's peak 24% (9,214 to 7,004 MB) at
# the same step time (25.99 vs 25.91 s); at 0.4B it cost ~1.04x step time for 0.40x torch's
# peak instead of 0.56x. Below about a GiB of residuals the saving is too small to matter.
REMAT_AUTO_ABOVE = 2**30
# The residuals of one layer without remat, in layer inputs' worth: at 1B a layer kept
# 213 MiB for a float32 input [4, 256, 2048] of 8 MiB; of it, the attention's float32 scores
# and probabilities [batch, heads, seq, seq] (32 heads: 2 x 32 MiB, counted apart, below),
# and 149 MiB, about 18 inputs: the norms' outputs, q, k, v, the attention's output, the
# residual, and the feed-forward's gate, up, activation and product at 4x the width.
INPUTS_KEPT = 18
PROBABILITIES_KEPT = 2


def kept_without_remat(x: Any, num_layers: int, heads: int | None) -> int:
    """An estimate of the bytes a stack of `num_layers` layers keeps for the backward pass
    without remat, from the static shape of its input `x` (`[..., seq, embed]`, one device's
    share where its sharding is known): `INPUTS_KEPT` inputs per layer, plus the attention's
    float32 scores and probabilities `[batch, heads, seq, seq]` when `heads` is known."""
    shape = held_shape(x)
    per_layer = INPUTS_KEPT * math.prod(shape) * jnp.dtype(x.dtype).itemsize
    if heads is not None and len(shape) >= 2:
        per_layer += PROBABILITIES_KEPT * math.prod(shape[:-2]) * heads * shape[-2] ** 2 * 4
    return num_layers * per_layer


def resolve_remat(remat: str | None, x: Any, num_layers: int, heads: int | None) -> str | None:
    """The policy name a stack runs with: `remat` itself, or for `"auto"`, `"projections"`
    when `kept_without_remat` exceeds `REMAT_AUTO_ABOVE`, else `None` (no checkpoint)."""
    if remat != "auto":
        return remat
    return "projections" if kept_without_remat(x, num_layers, heads) > REMAT_AUTO_ABOVE else None
