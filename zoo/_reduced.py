"""Filtered transforms between plain, reduced and unreduced leaves.

Explicit mode: `reduced_cast` (free) → gradients come out unreduced → `unreduced_zeros`
starts the accumulator → `reduce_unreduced` is the one all-reduce.
Manual mode (`jax.shard_map`): `manual_specs` for in/out specs, `pcast_varying` at the top
of the body (free), `pcast_unreduced` on the way out (free).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

FilterSpec = bool | Callable[[Any], bool] | Any


def _axes_set(axes: str | Iterable[str]) -> frozenset[str]:
    return frozenset((axes,) if isinstance(axes, str) else axes)


def _spec(x: jax.Array) -> P:
    sharding = jax.typeof(x).sharding
    return sharding.spec if sharding is not None else P()


def plain_spec(x: jax.Array) -> P:
    """`x`'s `PartitionSpec`, one entry per dimension, reduced/unreduced dropped."""
    parts = tuple(_spec(x).partitions)
    return P(*parts, *([None] * (x.ndim - len(parts))))


def sharded_over(x: jax.Array, axes: frozenset[str]) -> bool:
    """Whether any dimension of `x` is split over one of the mesh `axes`."""
    for entry in plain_spec(x):
        names = (entry,) if isinstance(entry, str) else (entry or ())
        if axes & set(names):
            return True
    return False


def _map_selected(fn, tree: Any, filter_spec: FilterSpec) -> Any:
    selected, rest = eqx.partition(tree, filter_spec)
    selected = jax.tree.map(lambda x: fn(x) if eqx.is_array(x) else x, selected)
    return eqx.combine(selected, rest)


def reduced_cast(
    tree: Any, filter_spec: FilterSpec = eqx.is_inexact_array, *, axes="data", gather: bool = False
) -> Any:
    """Cast the selected array leaves to *reduced* over mesh `axes` (no data moves).

    **Arguments:**

    - `tree`: a pytree of global arrays (a model or a partition of one).
    - `filter_spec`: which leaves, as in `eqx.partition` (a bool pytree prefix or a
      callable on leaves). Unselected leaves are returned unchanged.
    - `axes`: the data-parallel mesh axis name(s).
    - `gather`: also all-gather leaves split over `axes` (FSDP layouts) into a reduced
      full copy. Without it such leaves are left as they are (their gradients come out
      split like them); with it their gradients come out unreduced too, and reducing them
      to the leaf's own layout (`reduce_unreduced(..., out_specs)`) is a reduce-scatter.

    **Returns:** the same pytree; selected leaves are typed `{R:axes}`, so `jax.grad`
    returns their gradients *unreduced* (`{U:axes}`) instead of all-reducing them.
    """
    axes = _axes_set(axes)

    def cast(x):
        if sharded_over(x, axes) and not gather:
            return x
        return jax.reshard(x, P(*without_axes(x, axes), reduced=set(_spec(x).reduced) | axes))

    return _map_selected(cast, tree, filter_spec)


def without_axes(x: jax.Array, axes: frozenset[str]) -> list:
    """`x`'s spec entries with the mesh `axes` taken out: the layout of `x` gathered over them."""
    parts = []
    for entry in plain_spec(x):
        names = tuple(a for a in ((entry,) if isinstance(entry, str) else (entry or ())) if a not in axes)
        parts.append(None if not names else names[0] if len(names) == 1 else names)
    return parts


def gather_over(tree: Any, *, axes="data") -> Any:
    """All-gather the array leaves of `tree` that are split over mesh `axes` (plain copies).

    For frozen parameters under `gather="once"`: they need no gradient, so a plain
    replicated copy gathered once before the loop serves every microbatch.
    """
    axes = _axes_set(axes)

    def one(x):
        if not eqx.is_array(x) or not sharded_over(x, axes):
            return x
        return jax.reshard(x, P(*without_axes(x, axes), reduced=set(_spec(x).reduced)))

    return jax.tree.map(one, tree)


def unreduced_zeros(tree: Any, filter_spec: FilterSpec = eqx.is_inexact_array, *, axes="data") -> Any:
    """Zeros shaped like the selected leaves, typed *unreduced* over `axes`.

    The starting value of a gradient accumulator: adding unreduced gradients to it keeps
    it unreduced, so a `lax.scan` carry of it holds no all-reduce. Unselected leaves are
    replaced by `None`; leaves sharded over `axes` get plain zeros sharded like them (see
    `reduced_cast`).
    """
    axes = _axes_set(axes)
    selected, _ = eqx.partition(tree, filter_spec)

    def zeros(x):
        unreduced = frozenset() if sharded_over(x, axes) else axes
        return jax.reshard(jnp.zeros(x.shape, x.dtype), P(*plain_spec(x), unreduced=unreduced))

    return jax.tree.map(lambda x: zeros(x) if eqx.is_array(x) else None, selected)


def reduce_unreduced(tree: Any, out_specs: Any = None) -> Any:
    """All-reduce every unreduced leaf of `tree` into a plain array: the one collective.

    **Arguments:**

    - `tree`: a pytree whose array leaves are typed unreduced.
    - `out_specs`: optional pytree of target `PartitionSpec`s (e.g. sharded on `data` for a
      ZeRO-style reduce-scatter). Defaults to each leaf's own spec without `unreduced`.

    **Returns:** the reduced pytree. All leaves go through a single `jax.reshard`, which
    XLA lowers to one (tuple) all-reduce.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    if out_specs is None:
        specs = [plain_spec(x) for x in leaves]
    else:
        specs = jax.tree.leaves(out_specs, is_leaf=lambda s: isinstance(s, P))
    return jax.tree.unflatten(treedef, jax.reshard(leaves, specs))


def manual_specs(tree: Any, *, axes="data", state: str = "reduced") -> Any:
    """`shard_map` in/out specs for the array leaves of `tree` over manual `axes`.

    A spec inside `shard_map` may name only manual axes, so each leaf gets an all-`None`
    spec plus `reduced=axes` (parameters going in) or `unreduced=axes` (gradients coming
    out); a layout over other, non-manual mesh axes passes through untouched. Leaves
    sharded *over* a manual axis cannot be reduced over it: that is an error.
    """
    axes = _axes_set(axes)
    if state not in ("reduced", "unreduced"):
        raise ValueError(f"state must be 'reduced' or 'unreduced', got {state!r}")

    def one(x):
        spec = plain_spec(x)
        if sharded_over(x, axes):
            raise ValueError(
                f"a leaf of shape {x.shape} is sharded over the data axes {sorted(axes)} "
                f"(spec {spec}); shard_map mode needs parameters replicated over the data "
                "axes. Gather them once per step (TrainStep(gather='once'), the 'fsdp-once' "
                "preset) or use mode='explicit'."
            )
        # Inside shard_map, only manual axes may appear in specs.
        return P(*([None] * len(spec)), **{state: axes})

    return jax.tree.map(one, tree)


def pcast_varying(tree: Any, *, axes="data") -> Any:
    """Inside `shard_map`: cast reduced (or invariant) leaves to varying over `axes` (free).

    Needed before a reduced leaf enters a scan with varying values; its transpose is the
    free varying→unreduced cast, so gradients w.r.t. the result need no psum.
    """
    axes = tuple(sorted(_axes_set(axes)))

    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def pcast_unreduced(tree: Any, *, axes="data") -> Any:
    """Inside `shard_map`: declare varying per-device partial sums unreduced (free)."""
    axes = tuple(sorted(_axes_set(axes)))
    return jax.tree.map(lambda x: lax.pcast(pcast_varying(x, axes=axes), axes, to="unreduced"), tree)


def split_spec(x: Any, axes="data", size: int | None = None) -> P:
    """The ZeRO layout of one leaf: its own spec with one more dimension split over `axes`.

    The dimension is the first one that is not already sharded (over any mesh axis) and
    whose size `size` (the data-parallel size; the mesh's, when omitted) divides. A leaf
    already split over `axes` keeps its spec (it is 1/N already); a leaf with no such
    dimension (scalars, odd sizes) stays as it is, i.e. replicated over `axes`.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if size is None:
        mesh = jax.sharding.get_abstract_mesh()
        size = 1 if mesh.empty else int(np.prod([mesh.shape[a] for a in axes]))
    spec = plain_spec(x)
    if size <= 1 or sharded_over(x, frozenset(axes)):
        return spec
    entry = axes[0] if len(axes) == 1 else axes
    for dim, (part, length) in enumerate(zip(spec, x.shape)):
        if part is None and length > 0 and length % size == 0:
            return P(*spec[:dim], entry, *spec[dim + 1 :])
    return spec


def reshard_tree(tree: Any, specs: Any) -> Any:
    """`jax.reshard` every array leaf of `tree` to the spec at the same place in `specs`
    (a pytree with a `PartitionSpec` where `tree` has an array), in one call."""
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    if len(spec_leaves) != len(arrays):
        raise ValueError(f"{len(arrays)} array leaves but {len(spec_leaves)} specs")
    if not arrays:
        return tree
    moved = jax.reshard([leaves[i] for i in arrays], spec_leaves)
    for i, x in zip(arrays, moved):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
