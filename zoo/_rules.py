"""Rules that map logical axes to mesh axes, and placing a model on a mesh."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._axes import LogicalAxes, is_array_like, logical_axes, path_str

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Every logical axis name the zoo's own modules use. A preset maps each of them.
LOGICAL_AXES = (
    "batch",  # activations: the global batch
    "seq",  # activations: sequence positions
    "layers",  # leading axis of stacked (scanned) layers
    "embed",  # model width
    "mlp",  # hidden width of feed-forward / MLP layers
    "mlp_in",  # input side of an MLP's width→width layers (so "mlp" is not used twice)
    "vocab",  # vocabulary (embedding rows, output head columns)
    "heads",  # attention query heads (flattened heads × head_dim of projections)
    "kv_heads",  # attention key/value heads (fewer than "heads" with grouped queries)
)

_DP: dict[str, MeshAxes] = {name: None for name in LOGICAL_AXES} | {"batch": "data"}
_TP: dict[str, MeshAxes] = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}

_PRESETS: dict[str, dict[str, MeshAxes]] = {
    # Pure data parallelism: every parameter replicated, the batch split over `data`.
    "dp": _DP,
    # Fully sharded data parallelism: every parameter split over `data` along its embed
    # axis; layers gather each weight when they use it, gradients are reduce-scattered.
    "fsdp": _DP | {"embed": "data"},
    # The same layout; the step gathers every parameter once per step into a reduced copy
    # and reduce-scatters the accumulated gradients once (see `step_options`).
    "fsdp-once": _DP | {"embed": "data"},
    # ZeRO-1: parameters replicated as in "dp"; the step keeps the optimizer state split
    # over `data`, reduce-scatters the gradients and all-gathers the updated parameters
    # once per step (see `step_options`).
    "zero1": _DP,
    # Megatron tensor parallelism on a (data, model) mesh: heads, mlp width and vocab
    # split over `model` (column-parallel in, row-parallel out), batch over `data`.
    "tp": _DP | _TP,
    # Both: embed over `data`, heads/mlp/vocab over `model`.
    "fsdp+tp": _DP | _TP | {"embed": "data"},
}

# TrainStep keyword arguments a preset implies beyond its layout.
_STEP_OPTIONS: dict[str, dict[str, Any]] = {"fsdp-once": {"gather": "once"}, "zero1": {"shard_optimizer": True}}


def rules(preset: str = "dp", **overrides: MeshAxes) -> dict[str, MeshAxes]:
    """A copy of a named preset of sharding rules, optionally with some axes overridden.

    **Arguments:**

    - `preset`: one of `zoo.RULE_PRESETS`: `"dp"` (parameters replicated, batch on
      `data`), `"fsdp"` / `"fsdp-once"` (parameters split over `data` along their embed
      axis; the two differ in the step, see `zoo.step_options`), `"zero1"` (the "dp"
      layout; the step shards the optimizer state over `data`), `"tp"` (heads, mlp width
      and vocab over `model`), `"fsdp+tp"`.
    - `overrides`: logical axis → mesh axis (or tuple of mesh axes, or `None`).

    **Returns:** a plain `dict` a user can print, copy and edit.
    """
    if preset not in _PRESETS:
        raise ValueError(
            f"unknown rules preset {preset!r}; the presets are {sorted(_PRESETS)}. "
            "Pass one of them, or build your own dict of logical axis -> mesh axis."
        )
    return dict(_PRESETS[preset]) | dict(overrides)


RULE_PRESETS = tuple(_PRESETS)


def step_options(preset: str) -> dict[str, Any]:
    """The `zoo.TrainStep` keyword arguments a rules preset implies beyond its layout.

    `"fsdp-once"` → `{"gather": "once"}` (all-gather the parameters once per step,
    accumulate unreduced gradients, reduce-scatter once); `"zero1"` →
    `{"shard_optimizer": True}` (optimizer state split over `data`: reduce-scatter the
    gradients into it, update the shards, all-gather the parameters once); every other
    preset → `{}`.
    """
    rules(preset)  # validates the name
    return dict(_STEP_OPTIONS.get(preset, {}))


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


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
            raise ValueError(
                f"{where}: logical axis {name!r} has no sharding rule. Known logical axes in "
                f"these rules: {sorted(rules)}. Add {name!r} to the rules, e.g. "
                f"rules[{name!r}] = None to replicate it or = 'data' to shard it."
            )
        mesh_axes = _as_tuple(rules[name])
        for ax in mesh_axes:
            if ax in used:
                raise ValueError(
                    f"{where}: mesh axis {ax!r} is used by logical axes {used[ax]!r} and "
                    f"{name!r} of the same array; a mesh axis can shard only one dimension. "
                    f"Map one of them to None (or another mesh axis) in the rules."
                )
            used[ax] = name
        if mesh is not None and mesh_axes:
            missing = [ax for ax in mesh_axes if ax not in mesh.shape]
            if missing:
                raise ValueError(
                    f"{where}: rules map logical axis {name!r} to mesh axes {missing} that the "
                    f"mesh {dict(mesh.shape)} does not have. Build the mesh with those axes or "
                    f"map {name!r} to one of {list(mesh.shape)} (or None)."
                )
            size = math.prod(mesh.shape[ax] for ax in mesh_axes)
            if shape is not None and shape[dim] % size != 0:
                raise ValueError(
                    f"{where}: dimension {dim} ({name!r}) has size {shape[dim]}, which mesh "
                    f"axes {mesh_axes} (size {size}) do not divide. Choose a size divisible by "
                    f"{size}, or map {name!r} to None to replicate it."
                )
        entries.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return P(*entries)


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
    axes = logical_axes(model)

    def one(path, leaf, names):
        if names is None:
            return None
        return spec_for(names.names, rules, shape=leaf.shape, mesh=mesh, where=path_str(path))

    return jax.tree_util.tree_map_with_path(
        one, model, axes, is_leaf=lambda x: x is None or isinstance(x, LogicalAxes)
    )


def _concrete_mesh(mesh: Any) -> Any:
    if mesh is None:
        mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ValueError(
            "no mesh to place the model on: pass mesh=... or call this under "
            "`with jax.set_mesh(mesh):`."
        )
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


def check_head_split(model: Any, rules: Rules, mesh: Any) -> None:
    """Refuse (naming the fix) attention whose query or key/value head count the mesh axes
    of `rules["heads"]` / `rules["kv_heads"]` cannot split: the flattened projections
    would split, but the per-head reshape of the first forward would not."""

    def is_attention(x: Any) -> bool:
        return hasattr(x, "num_kv_heads") and hasattr(x, "q_proj")

    for node in jax.tree.leaves(model, is_leaf=is_attention):
        if not is_attention(node):
            continue
        for name, count in (("heads", node.num_heads), ("kv_heads", node.num_kv_heads)):
            axes = _as_tuple(rules.get(name))
            size = math.prod(mesh.shape[a] for a in axes if a in mesh.shape)
            if size > 1 and count % size:
                what = "attention heads" if name == "heads" else "key/value heads"
                raise ValueError(
                    f"the model has {count} {what}, which the mesh axes {list(axes)} (size {size}) that "
                    f"rules[{name!r}] names cannot split evenly. Use a model axis whose size divides {count}, "
                    f"or rules without tensor parallelism for heads (e.g. zoo.rules('fsdp'), or rules[{name!r}] = None)."
                )
        return  # every layer of a model shares its head counts


def batch_spec(ndim: int, data_axes: tuple[str, ...]) -> P:
    """`PartitionSpec` of a batch-leading array: dim 0 on the data axes, the rest replicated."""
    return P(data_entry(data_axes), *([None] * (ndim - 1)))


def data_entry(data_axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """The `PartitionSpec` entry that splits one dimension over the data axes."""
    return data_axes[0] if len(data_axes) == 1 else data_axes
