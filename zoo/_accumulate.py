"""Gradient accumulation: a scan over microbatches that sums unreduced loss and gradients,
then one reduction after the loop. One routine for both modes (explicit and shard_map)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ._batch import batch_spec, shard_batch, split_local_microbatches, split_microbatches
from ._reduced import (
    gather_over,
    manual_specs,
    pcast_unreduced,
    pcast_varying,
    plain_spec,
    reduce_unreduced,
    reduced_cast,
    sharded_over,
    unreduced_zeros,
)

# `per_example(model, microbatch)` → `(losses [b], weights [b] or None, metrics)`: the
# step's loss under its contract (see `zoo._step`); `metrics` maps names to per-example
# sums `[b]` reported beside the loss (divided by the same weights), `{}` for none.
PerExample = Callable[[Any, Any], tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]]


def _sum(x: jax.Array | None, axes: tuple[str, ...] | None) -> jax.Array | None:
    """Sum to a scalar; with `axes`, leave the cross-device part unreduced (no collective)."""
    if x is None:
        return None
    x = x.astype(jnp.float32)
    out_sharding = None if axes is None else P(unreduced=set(axes))
    return lax.reduce_sum(x, tuple(range(x.ndim)), out_sharding=out_sharding)


def _returns_weights(
    per_example: PerExample, params: Any, frozen: Any, batch: Any, microbatches: int
) -> tuple[bool, tuple[str, ...]]:
    """Whether the loss returns weights, and the names of the metrics it returns (decided
    by abstract evaluation, no computation)."""
    rows = jax.tree.leaves(batch)[0].shape[0] // microbatches

    def like(x):
        # A microbatch as the loop sees it: same dtype and sharding, fewer rows.
        return jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=jax.typeof(x).sharding)

    example = jax.tree.map(like, batch)
    out = jax.eval_shape(lambda p, mb: per_example(eqx.combine(p, frozen), mb), params, example)
    return out[1] is not None, tuple(sorted(out[2]))


def _scan(per_example, params, frozen, microbatches, *, weighted, zero, grad_zeros, sum_axes, metrics=()):
    """The loop: add each microbatch's loss (and weight, and `metrics`') sums and gradients
    to the carry.

    `zero`/`grad_zeros` start the carry in the state the loop's sums come out in
    (unreduced in explicit mode, varying inside `shard_map`, plain without a mesh);
    `sum_axes` leaves the per-microbatch sums unreduced over those axes (explicit mode).
    """

    def objective(p, mb):
        losses, weights, values = per_example(eqx.combine(p, frozen), mb)
        # Metrics are reported, not trained: no gradient flows from them.
        sums = {k: _sum(jax.lax.stop_gradient(v), sum_axes) for k, v in values.items()}
        return _sum(losses, sum_axes), (_sum(weights, sum_axes), sums)

    def body(carry, microbatch):
        (loss, (weight, sums)), grads = jax.value_and_grad(objective, has_aux=True)(params, microbatch)
        new = {"loss": carry["loss"] + loss, "grads": jax.tree.map(jnp.add, carry["grads"], grads)}
        if "weight" in carry:
            new["weight"] = carry["weight"] + weight
        if "metrics" in carry:
            new["metrics"] = {k: carry["metrics"][k] + sums[k] for k in carry["metrics"]}
        return new, None

    init = {"loss": zero, "grads": grad_zeros}
    if weighted:
        init["weight"] = zero
    if metrics:
        init["metrics"] = dict.fromkeys(metrics, zero)
    carry, _ = lax.scan(body, init, microbatches)
    return carry


def _require_replicated_off_data(params, frozen, data_axes) -> None:
    """shard_map mode is manual over every mesh axis, so no array may be split over one."""
    mesh = jax.sharding.get_abstract_mesh()
    others = frozenset(mesh.axis_names) - set(data_axes)
    for leaf in jax.tree.leaves(eqx.filter((params, frozen), eqx.is_array)):
        if sharded_over(leaf, others):
            raise ValueError(
                f"a parameter of shape {leaf.shape} is sharded over mesh axes "
                f"{sorted(others & set(jax.tree.leaves(tuple(plain_spec(leaf)))))}; shard_map mode "
                "runs manual over every mesh axis (jax 0.10.2 takes reduced in_specs only in full "
                "manual mode), so parameters must be replicated off the data axes. Use "
                "mode='explicit' for tensor-parallel layouts."
            )


def _out_specs(carry: dict, params: Any, grad_specs: Any = None) -> dict:
    """Where the reduced carry lands: scalars replicated, gradients in their params' layout
    or in `grad_specs` (for a layout split over the data axes that reduction is a
    reduce-scatter: FSDP parameters, or the optimizer-state shards of ZeRO)."""
    out = {name: jax.tree.map(lambda _: P(), value) for name, value in carry.items() if name != "grads"}
    out["grads"] = jax.tree.map(plain_spec, params) if grad_specs is None else grad_specs
    return out


def accumulate(
    per_example: PerExample,
    params: Any,
    frozen: Any,
    batch: Any,
    *,
    microbatches: int,
    axes: tuple[str, ...] | None,
    data_size: int = 1,
    mode: str = "explicit",
    gather_once: bool = False,
    grad_specs: Any = None,
) -> tuple[jax.Array, jax.Array | None, Any, dict[str, jax.Array]]:
    """Loss, weight, gradients and metrics summed over the global batch, reduced once after
    the loop.

    **Arguments:**

    - `per_example`: the step's loss, `(model, microbatch)` → `(losses, weights or None,
      metrics)`.
    - `params`, `frozen`: the trainable float leaves (plain) and the rest of the model.
    - `batch`: the global batch.
    - `microbatches`: M, the loop's length.
    - `axes`: the data axes the batch is split over; `None` without a mesh (no reduction).
    - `data_size`: the data-parallel size N (the product of the data axes' sizes).
    - `mode`: `"explicit"` (global-view loop, sums unreduced over `axes`) or `"shard_map"`
      (the loop runs per device; its varying sums leave `shard_map` unreduced).
    - `gather_once`: all-gather parameters (and frozen arrays) split over `axes` once,
      before the loop, instead of per use.
    - `grad_specs`: the layout the gradients are reduced into (default: the params').

    **Returns:** `(loss_sum, weight_sum or None, grad_sums, metric_sums)`, plain arrays;
    `weight_sum` is `None` when the loss returns per-example losses alone; `metric_sums`
    maps each metric's name to its sum (carried and reduced with the loss sum: no
    collective of its own).
    """
    if axes is None:
        weighted, metrics = _returns_weights(per_example, params, frozen, batch, microbatches)
        zero = jnp.zeros((), jnp.float32)
        mbs = split_local_microbatches(batch, microbatches)
        carry = _scan(
            per_example,
            params,
            frozen,
            mbs,
            weighted=weighted,
            zero=zero,
            grad_zeros=jax.tree.map(jnp.zeros_like, params),
            sum_axes=None,
            metrics=metrics,
        )
        return carry["loss"], carry.get("weight"), carry["grads"], carry.get("metrics", {})

    batch = shard_batch(batch, axes)
    weighted, metrics = _returns_weights(per_example, params, frozen, batch, microbatches)
    view = reduced_cast(params, axes=axes, gather=gather_once)  # free, or the one gather
    if gather_once:
        frozen = gather_over(frozen, axes=axes)  # once, not per layer per microbatch
    if mode == "explicit":
        zero = jax.reshard(jnp.zeros((), jnp.float32), P(unreduced=set(axes)))
        mbs = split_microbatches(batch, microbatches, data_size, axes)
        carry = _scan(
            per_example,
            view,
            frozen,
            mbs,
            weighted=weighted,
            zero=zero,
            grad_zeros=unreduced_zeros(view, axes=axes),
            sum_axes=axes,
            metrics=metrics,
        )
    else:
        carry = _scan_per_device(per_example, view, frozen, batch, microbatches, axes, weighted, metrics)
    carry = reduce_unreduced(carry, _out_specs(carry, params, grad_specs))  # the one all-reduce
    return carry["loss"], carry.get("weight"), carry["grads"], carry.get("metrics", {})


def _scan_per_device(per_example, view, frozen, batch, microbatches, axes, weighted, metrics=()) -> dict:
    """shard_map mode: the same loop on each device's rows; the carry leaves unreduced."""
    param_specs = manual_specs(view, axes=axes, state="reduced")  # checks the layout
    _require_replicated_off_data(view, frozen, axes)
    frozen_arrays, frozen_static = eqx.partition(frozen, eqx.is_array)

    def body_fn(p_reduced, frozen_arrays, local_batch):
        p = pcast_varying(p_reduced, axes=axes)
        mbs = split_local_microbatches(local_batch, microbatches)
        zero = pcast_varying(jnp.zeros((), jnp.float32), axes=axes)
        carry = _scan(
            per_example,
            p,
            eqx.combine(frozen_arrays, frozen_static),
            mbs,
            weighted=weighted,
            zero=zero,
            grad_zeros=jax.tree.map(jnp.zeros_like, p),
            sum_axes=None,
            metrics=metrics,
        )
        return pcast_unreduced(carry, axes=axes)

    unreduced = P(unreduced=set(axes))
    out_specs = {"loss": unreduced, "grads": manual_specs(view, axes=axes, state="unreduced")}
    if weighted:
        out_specs["weight"] = unreduced
    if metrics:
        out_specs["metrics"] = dict.fromkeys(metrics, unreduced)
    in_specs = (
        param_specs,
        jax.tree.map(lambda x: P(*([None] * x.ndim)), frozen_arrays),
        jax.tree.map(lambda x: batch_spec(x.ndim, axes), batch),
    )
    # Manual over every mesh axis: jax 0.10.2 accepts reduced in_specs only then.
    return jax.shard_map(body_fn, in_specs=in_specs, out_specs=out_specs)(view, frozen_arrays, batch)
