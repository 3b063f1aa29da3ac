"""How a parameter meets an activation under explicit sharding, without extra collectives.

Three helpers every zoo module uses on its parameters:

- `for_use`: all-gather the dimensions of a parameter that are split over a mesh axis the
  activation's batch dimensions already use (FSDP layouts), into a *reduced* copy, so the
  gradient comes back as one reduce-scatter instead of an all-reduce.
- `broadcast_like`: the reduced-safe broadcast for biases and norm scales.
- `contract_spec`: the output sharding of a projection (Megatron row-parallel layers contract
  a model-sharded dimension and need it spelled out).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from .._reduced import without_axes


def sharding_spec(x: jax.Array) -> P | None:
    """The `PartitionSpec` in `x`'s type, or `None` when no mesh is in use.

    Outside `jax.set_mesh` (arrays placed on a mesh, called without it) specs cannot be
    passed to ops either, so this is `None` then too and jax places results by itself.
    """
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty or jax.sharding.get_abstract_mesh().empty:
        return None
    return sharding.spec


def shard_count(x, axis: int) -> int:
    """Over how many devices `x`'s sharding (an array's, or a `jax.ShapeDtypeStruct`'s)
    splits dimension `axis`: 1 when unknown (no mesh), and inside `shard_map`, whose
    manual axes leave `x` one device's already."""
    try:
        sharding = x.sharding if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x).sharding
    except TypeError:  # not an array jax knows
        return 1
    spec, mesh = getattr(sharding, "spec", ()), getattr(sharding, "mesh", None)
    spec = tuple(getattr(spec, "partitions", spec))  # a spec with unreduced axes refuses spec[i]
    if mesh is None or len(spec) <= axis or spec[axis] is None:
        return 1
    manual = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}
    count = 1
    for name in _entry_axes(spec[axis]):
        count *= 1 if name in manual else mesh.shape[name]
    return count


def held_shape(x) -> tuple[int, ...]:
    """`x`'s shape on one device (`shard_count` of each dimension, rounded up)."""
    return tuple(-(-n // shard_count(x, i)) for i, n in enumerate(x.shape))


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entries(x: jax.Array) -> list:
    """`x`'s `PartitionSpec` entries, one per dimension (no mesh: all `None`)."""
    spec = sharding_spec(x)
    parts = list(spec.partitions) if spec is not None else []
    return parts + [None] * (x.ndim - len(parts))


def mesh_axes_of(x: jax.Array, dims: range | tuple[int, ...] | None = None) -> frozenset[str]:
    """The mesh axes that split `x` (only over `dims`, when given)."""
    parts = entries(x)
    dims = range(x.ndim) if dims is None else dims
    return frozenset(ax for d in dims for ax in _entry_axes(parts[d]))


def for_use(param: jax.Array, x: jax.Array, lead_ndim: int | None = None) -> jax.Array:
    """`param` ready to meet activation `x`: gathered over the mesh axes `x`'s batch uses.

    **Arguments:**

    - `param`: a parameter (plain, reduced, or split over some mesh axes).
    - `x`: the activation it is used with.
    - `lead_ndim`: how many leading dimensions of `x` are batch-like (default: all but
      the last `param.ndim`).

    **Returns:** `param` unchanged when none of its dimensions is split over a mesh axis
    that `x`'s leading dimensions use (data-parallel and tensor-parallel layouts). Otherwise
    (FSDP: the embed axis sharded over `data`, like the batch) an all-gathered copy typed
    *reduced* over those axes: its gradient comes out unreduced and transposes into a
    reduce-scatter back to `param`'s layout, never an all-reduce per use.
    """
    pspec = sharding_spec(param)
    if pspec is None or sharding_spec(x) is None:
        return param
    lead = x.ndim - param.ndim if lead_ndim is None else lead_ndim
    busy = mesh_axes_of(x, range(max(lead, 0)))
    clash = busy & mesh_axes_of(param)
    if not clash:
        return param
    return jax.reshard(
        param,
        P(*without_axes(param, clash), reduced=set(pspec.reduced) | clash, unreduced=set(pspec.unreduced)),
    )


def broadcast_like(param: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcast `param` over the leading dims of `x` (its own dims are `x`'s last ones).

    `x + param` fails when `x` is sharded on the data axis and `param` is reduced over it
    ("Inputs cannot be sharded/varying on the same axes that another input is reduced
    on"). Broadcasting first, into `x`'s own sharding, makes the elementwise op one between
    equally sharded arrays; its transpose is a local sum into an unreduced gradient, so no
    all-reduce is added to the loop (see docs/design.md, "The traps"). A parameter split
    over the data axis (FSDP) is gathered first (`for_use`).
    """
    param = for_use(param, x)
    dims = tuple(range(x.ndim - param.ndim, x.ndim))
    return lax.broadcast_in_dim(param, x.shape, dims, out_sharding=sharding_spec(x))


def like_rows(param: jax.Array, x: jax.Array) -> jax.Array:
    """`param` ready for an elementwise op with `x` (its dims are `x`'s last ones).

    With no mesh in use, `param` with leading size-1 dims (`[1, ..., 1, *param.shape]`):
    elementwise ops broadcast it themselves, so a product `x * param` keeps the small
    `param` for the backward pass rather than a full-size broadcast copy
    (docs/performance.md). Under a mesh, `broadcast_like(param, x)`.
    """
    if sharding_spec(x) is None:
        return param.reshape((1,) * (x.ndim - param.ndim) + param.shape)
    return broadcast_like(param, x)


def contract_spec(x: jax.Array, out_entries: tuple, lead_ndim: int) -> P | None:
    """Output sharding of a contraction of `x`'s trailing dims into new `out_entries` dims.

    The leading `lead_ndim` dims keep `x`'s sharding; each new dim takes its entry from the
    weight unless a leading dim already uses that mesh axis. A contracted dimension split
    over a mesh axis (a row-parallel layer) then becomes one all-reduce over that axis.
    """
    if sharding_spec(x) is None:
        return None
    lead = entries(x)[:lead_ndim]
    busy = mesh_axes_of(x, range(lead_ndim))
    out = []
    for entry in out_entries:
        axes = _entry_axes(entry)
        out.append(None if not axes or busy & set(axes) else entry)
    return P(*lead, *out)
