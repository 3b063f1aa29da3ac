"""Several adapters trained in one step over one frozen base, each row of the batch
training its own adapter.

A `stack_adapters` model holds `K` adapters; a batch says which one each row trains
(`batch["adapter"]`, an index into `adapter_names(model)`). `routed(loss_fn)` is the step's
loss: `loss_fn` on the model routed per row, each row's loss scaled by
`batch["adapter_norm"]` (from `adapter_norms`, on the host), so that each adapter's
gradient is its own rows' mean, as if it trained alone. `clip_per_adapter` clips each
adapter's gradient at its own global norm (`optax.clip_by_global_norm` would clip all `K`
together, coupling them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._tree import node_at
from ._apply import modules
from ._multi_linear import MultiLoraLinear
from ._named import route


def adapter_norms(adapter: Any, counts: Any, num_adapters: int) -> np.ndarray:
    """Per row of a step's global batch, `total / count of the row's adapter` (float32
    `[batch]`; 0 on rows of the bare base, index `-1`): the `"adapter_norm"` field that
    makes `routed`'s loss train each adapter as if alone.

    The step divides the sum of every row's loss by the sum of every row's count (its
    tokens for `zoo.models.next_token_loss`, 1 per row for per-example losses); scaling
    adapter `k`'s rows by `total / count_k` leaves adapter `k` with the gradient of its
    own rows' mean.

    **Arguments:**

    - `adapter`: `[batch]` adapter index per row (`-1`: the bare base).
    - `counts`: `[batch]` what the step counts per row (the loss's weights), or `None`:
      1 per row (a loss returning per-example losses).
    - `num_adapters`: `K`.

    **Returns:** float32 `[batch]`.
    """
    index = np.asarray(adapter)
    if index.ndim != 1:
        raise ValueError(f"adapter_norms: adapter must be one index per row, [batch]; got shape {index.shape}")
    bad = index[(index < -1) | (index >= num_adapters)]
    if bad.size:
        raise ValueError(f"adapter_norms: adapter index {int(bad[0])} is out of range for {num_adapters} adapters")
    counts = np.ones(len(index), np.float64) if counts is None else np.asarray(counts, np.float64)
    per_adapter = np.bincount(index[index >= 0], weights=counts[index >= 0], minlength=num_adapters)
    total = counts.sum()
    # An adapter whose rows count nothing (all padding) gets no gradient either way.
    ratio = np.where(per_adapter > 0, total / np.maximum(per_adapter, 1e-30), 0.0)
    return np.where(index >= 0, ratio[np.maximum(index, 0)], 0.0).astype(np.float32)


def routed(loss_fn: Callable[[Any, dict[str, Any]], Any]) -> Callable[[Any, dict[str, Any]], Any]:
    """`loss_fn` for a `zoo.TrainStep` training every adapter of a `stack_adapters`
    model at once: `loss_fn(route(model, batch["adapter"]), batch)`, each row's loss (or
    loss sum) times `batch["adapter_norm"]` when the batch has it (`adapter_norms`).

    With `adapter_norm`, each adapter's gradient equals the one it gets trained alone on
    its own rows (same loss, same rows), and the step's loss is the sum of the adapters'
    own losses. Without it, every row weighs the same in one mean over the batch.

    **Arguments:**

    - `loss_fn`: a `zoo.TrainStep` loss, `(model, batch) → losses [b]` or
      `(loss_sums [b], weights [b])`, e.g. `zoo.models.next_token_loss`.

    **Returns:** the wrapped loss, of the same contract.
    """

    def loss(model: Any, batch: dict[str, Any]) -> Any:
        if "adapter" not in batch:
            raise ValueError(
                "routed loss: the batch has no 'adapter' field: give each row its adapter's index "
                "(batch['adapter'], [batch] int32, an index into zoo.lora.adapter_names(model))"
            )
        out = loss_fn(route(model, batch["adapter"]), batch)
        norm = batch.get("adapter_norm")
        if norm is None:
            return out
        if isinstance(out, tuple | list):
            sums, weights = out
            return sums * norm.astype(sums.dtype), weights
        return out * norm.astype(out.dtype)

    return loss


def _adapter_axes(updates: Any) -> Any:
    """The adapters axis of each trainable leaf of `updates` (a model-shaped gradient
    tree): a `MultiLoraLinear`'s `lora_A` / `lora_B`; any other trainable leaf is refused."""
    layers = modules(updates, MultiLoraLinear)
    axes = {}
    for path, _ in layers.values():
        layer = node_at(updates, path)
        for name in ("lora_A", "lora_B"):
            leaf = getattr(layer, name)
            if leaf is not None:
                axes[id(leaf)] = leaf.ndim - 3
    found = jax.tree_util.tree_leaves_with_path(updates)
    outside = [jax.tree_util.keystr(p) for p, leaf in found if eqx.is_array(leaf) and id(leaf) not in axes]
    if outside:
        raise ValueError(
            f"clip_per_adapter: trainable leaves outside the stacked adapters ({outside[:3]}) belong to no one "
            "adapter; train only the adapters (zoo.lora.trainable(model)), or clip with optax.clip_by_global_norm"
        )
    return jax.tree.map(lambda leaf: axes[id(leaf)], updates)


def clip_per_adapter(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm(max_norm)` applied to each adapter of a `stack_adapters`
    model apart: adapter `k`'s gradient (its slices of every `lora_A` / `lora_B`) is
    scaled by `max_norm / ‖g_k‖` when its own norm `‖g_k‖` exceeds `max_norm`, as if it
    were trained alone. The updates must be the trainable leaves of such a model (the
    adapters only).

    **Returns:** an `optax.GradientTransformation` without state.
    """

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        axes = _adapter_axes(updates)
        leaves, treedef = jax.tree.flatten(updates)
        leaf_axes = treedef.flatten_up_to(axes)
        k = leaves[0].shape[leaf_axes[0]]
        norm = jnp.stack(
            [optax.tree.norm([jnp.take(g, i, axis=a) for g, a in zip(leaves, leaf_axes)]) for i in range(k)]
        )

        def clipped(g: Any, a: int) -> Any:
            # optax's own rule, per adapter: unchanged below the limit, else g / ‖g‖ · max_norm.
            shape = [1] * g.ndim
            shape[a] = norm.shape[0]
            n = norm.reshape(shape).astype(g.dtype)
            return jnp.where(n < max_norm, g, g / n * max_norm)

        return treedef.unflatten([clipped(g, a) for g, a in zip(leaves, leaf_axes)]), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
