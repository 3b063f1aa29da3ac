"""Rules that map logical axes to mesh axes, and placing a model on a mesh."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._axes import LogicalAxes, is_array_like, logical_axes
from ._axis_names import MeshAxes, Rules
from ._tree import path_str


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


class PlacementError(ValueError):
    """Rules that cannot place an array on a mesh. `problem` is what is wrong (the message
    up to the fix it suggests); `size` and `divisor`, when a size the mesh axes do not
    divide is the cause (a dimension, a head count), say which; `where`, the array's path
    when one array is the cause."""

    def __init__(
        self, problem: str, fix: str, *, size: int | None = None, divisor: int | None = None, where: str | None = None
    ):
        super().__init__(f"{problem}. {fix}")
        self.problem, self.size, self.divisor, self.where = problem, size, divisor, where


def spec_for(
    names: tuple[str | None, ...],
    rules: Rules,
    *,
    shape: tuple[int, ...] | None = None,
    mesh: Any = None,
    where: str = "array",
) -> P:
    """The `PartitionSpec` for one array with these logical axes under `rules`.

    Checks (with errors that name `where` and the fix) that every logical axis has a
    rule, that no mesh axis is used twice, and, when `mesh` is given, that every mesh axis
    exists and divides its dimension.
    """
    entries: list[MeshAxes] = []
    used: dict[str, str | None] = {}
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise PlacementError(
                f"{where}: logical axis {name!r} has no sharding rule. Known logical axes in these rules: {sorted(rules)}",
                f"Add {name!r} to the rules, e.g. rules[{name!r}] = None to replicate it or = 'data' to shard it.",
            )
        mesh_axes = _as_tuple(rules[name])
        for ax in mesh_axes:
            if ax in used:
                raise PlacementError(
                    f"{where}: mesh axis {ax!r} is used by logical axes {used[ax]!r} and {name!r} of the same "
                    "array; a mesh axis can shard only one dimension",
                    "Map one of them to None (or another mesh axis) in the rules.",
                )
            used[ax] = name
        if mesh is not None and mesh_axes:
            missing = [ax for ax in mesh_axes if ax not in mesh.shape]
            if missing:
                raise PlacementError(
                    f"{where}: rules map logical axis {name!r} to mesh axes {missing} that the mesh "
                    f"{dict(mesh.shape)} does not have",
                    f"Build the mesh with those axes or map {name!r} to one of {list(mesh.shape)} (or None).",
                )
            size = math.prod(mesh.shape[ax] for ax in mesh_axes)
            if shape is not None and shape[dim] % size != 0:
                raise PlacementError(
                    f"{where}: dimension {dim} ({name!r}) has size {shape[dim]}, which mesh axes {mesh_axes} "
                    f"(size {size}) do not divide",
                    f"Choose a size divisible by {size}, or map {name!r} to None to replicate it.",
                    size=shape[dim],
                    divisor=size,
                    where=where,
                )
        entries.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return P(*entries)


def check_rules(rules: Any) -> None:
    """Refuse `rules` that are not a mapping of logical axis names to mesh axes (a preset's
    name, None): a `TypeError` naming the fix."""
    if isinstance(rules, Mapping) and all(isinstance(k, str) for k in rules):
        return
    if isinstance(rules, str):
        fix = f"for the preset pass zoo.rules({rules!r})"
    else:
        fix = "e.g. zoo.rules('dp'), or a dict such as {'embed': None, 'batch': 'data', ...}"
    raise TypeError(
        f"rules must be a mapping of logical axis name -> mesh axes, got {type(rules).__name__} {rules!r}; {fix}"
    )


def partition_specs(model: Any, rules: Rules, mesh: Any = None) -> Any:
    """The `PartitionSpec` of every array leaf of `model` under `rules`.

    **Arguments:**

    - `model`: a pytree whose array fields carry `zoo.field(axes=...)` annotations.
    - `rules`: logical axis → mesh axes (see `zoo.rules`).
    - `mesh`: if given (a `Mesh` or `AbstractMesh`), also check that the mesh has the axes
      and that they divide the dimensions they shard.

    **Returns:** a pytree like `model` with a `PartitionSpec` at each array leaf and `None`
    elsewhere.
    """
    check_rules(rules)
    axes = logical_axes(model)

    def one(path, leaf, names):
        if names is None:
            return None
        return spec_for(names.names, rules, shape=leaf.shape, mesh=mesh, where=path_str(path))

    return jax.tree_util.tree_map_with_path(one, model, axes, is_leaf=lambda x: x is None or isinstance(x, LogicalAxes))


def _concrete_mesh(mesh: Any) -> Any:
    if mesh is None:
        mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("no mesh to place the model on: pass mesh=... or call this under `with jax.set_mesh(mesh):`.")
    return mesh


def shard(model: Any, rules: Rules, mesh: Any = None) -> Any:
    """Place every array leaf of `model` on `mesh` with the sharding its annotations ask for.

    **Arguments:**

    - `model`: an annotated pytree (host arrays or arrays on any devices), or its
      abstract form (`eqx.filter_eval_shape(...)`, leaves `jax.ShapeDtypeStruct`).
    - `rules`: logical axis → mesh axes.
    - `mesh`: a concrete `jax.sharding.Mesh`; defaults to the one set by `jax.set_mesh`.

    **Returns:** the same pytree with each array a global `jax.Array` laid out on the mesh;
    abstract leaves become `jax.ShapeDtypeStruct`s carrying that sharding (nothing is
    allocated: e.g. the `like` of `zoo.Checkpointer.restore` on a new mesh).
    """
    check_rules(rules)
    mesh = _concrete_mesh(mesh)
    check_head_split(model, rules, mesh)
    specs = partition_specs(model, rules, mesh)
    arrays, static = eqx.partition(model, is_array_like)

    def put(x, spec):
        if x is None:
            return None
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return jax.device_put(x, NamedSharding(mesh, spec))

    placed = jax.tree.map(put, arrays, specs, is_leaf=lambda x: x is None)
    return eqx.combine(placed, static)


def axis_size(rules: Rules, name: str, mesh: Any) -> tuple[int, tuple[str, ...]]:
    """How many devices the mesh axes `rules[name]` maps to span, and those axes."""
    axes = _as_tuple(rules.get(name))
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape), axes


def check_head_counts(num_heads: int, kv_heads: int, rules: Rules, mesh: Any, where: str = "") -> None:
    """Refuse (naming the fix) query or key/value head counts that the mesh axes of
    `rules["heads"]` / `rules["kv_heads"]` cannot split: the flattened projections would
    split, but the per-head reshape of the first forward would not."""
    for name, count in (("heads", num_heads), ("kv_heads", kv_heads)):
        size, axes = axis_size(rules, name, mesh)
        if size > 1 and count % size:
            what = "attention heads" if name == "heads" else "key/value heads"
            raise PlacementError(
                f"{where}{': ' if where else ''}the model has {count} {what}, which the mesh axes {list(axes)} "
                f"(size {size}) that rules[{name!r}] names cannot split evenly",
                f"Use a model axis whose size divides {count}, or rules without tensor parallelism for heads "
                f"(e.g. zoo.rules('fsdp'), or rules[{name!r}] = None).",
                size=count,
                divisor=size,
            )


def check_head_split(model: Any, rules: Rules, mesh: Any) -> None:
    """`check_head_counts` for the attention layers of `model` (they share their head counts)."""

    def is_attention(x: Any) -> bool:
        return hasattr(x, "num_kv_heads") and hasattr(x, "q_proj")

    for node in jax.tree.leaves(model, is_leaf=is_attention):
        if is_attention(node):
            check_head_counts(node.num_heads, node.num_kv_heads, rules, mesh)
            return
