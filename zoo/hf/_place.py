"""Placing checkpoint tensors straight into a model's leaves, each with its sharding.

Every leaf is made by `jax.make_array_from_callback`: for each device's shard the
callback reads only that shard's slice of the file (of the layers it holds, transposed
and split as the leaf's `Source` says); devices holding the same shard share one read. The
stacks of layers are placed together one layer at a time into arrays made on the devices
(two compiled programs for all of them). A process holds on the host at most the shards
of one layer of each stack (of an unstacked leaf: of the leaf) that its own devices hold,
never the whole model, never a copy per device, and no page of the file (`Checkpoint`
reads, it does not keep a memory map). What is read is 64-byte aligned, so that on a CPU
the array read becomes the device's buffer, not a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._mismatch import mismatch_lines, shorten, summary
from .._tree import dotted_name, key_path, node_at
from ._family import Family
from ._files import TensorFile
from ._layout import Source, leaf_sources


def check_tensors(
    family: Family, sources: list[Source], checkpoint: TensorFile, config: Any, where: str
) -> dict[str, str]:
    """Check the checkpoint holds exactly the tensors `sources` need, with their shapes.

    **Returns:** canonical name → file name. Raises one `ValueError` listing every
    missing, unexpected and mis-shaped tensor. Known non-parameters (`family.ignored`)
    are skipped silently; task-head tensors outside the base model's prefix are skipped
    with a warning.
    """
    mapping, heads = family.canonical_names(checkpoint.keys())
    expected: dict[str, tuple[int, ...]] = {}
    for source in sources:
        for name in source.names:
            expected[name] = source.file_shape
    present = {n for n in mapping if not family.ignored(n, config)}
    missing = sorted(set(expected) - present, key=_natural)
    unexpected = sorted(present - set(expected), key=_natural)
    misshaped = []
    for name in sorted(set(expected) & present, key=_natural):
        found = checkpoint.shape(mapping[name])
        if found != expected[name]:
            misshaped.append(f"{mapping[name]}: expected {list(expected[name])}, found {list(found)}")
    if missing or unexpected or misshaped:
        found = [mapping[n] for n in unexpected]
        lines = [
            f"the checkpoint in {str(where)!r} does not fit a zoo {family.model_class.__name__} with its config.json: "
            f"{summary('tensors', missing, found, misshaped)} (is it a {family.name} checkpoint whose config.json "
            "matches its weights?)"
        ]
        lines += mismatch_lines("tensors", missing, found, misshaped)
        lines.append(
            f"  (is it a {family.name} checkpoint whose config.json matches its weights? "
            "The names above are the file's.)"
        )
        raise ValueError("\n".join(lines))
    if heads:
        warnings.warn(
            f"{where}: skipping {len(heads)} tensors of a task head the zoo "
            f"{family.model_class.__name__} does not have: {shorten(sorted(heads), 8)}",
            stacklevel=3,
        )
    return mapping


def _natural(name: str) -> tuple:
    """Sort key putting `layer.2` before `layer.10`."""
    return tuple(int(p) if p.isdigit() else p for p in name.replace(".", " . ").split())


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (a device's shard, as `make_array_from_callback` gives it) with one slice
    per dimension and every start and stop filled in."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append(slice(start, stop))
    return tuple(out)


def read_leaf(
    checkpoint: TensorFile,
    mapping: dict[str, str],
    source: Source,
    index: tuple[slice, ...],
    dtype: Any,
    shape: tuple[int, ...],
    reuse: dict[tuple, np.ndarray] | None = None,
) -> np.ndarray:
    """The part `index` (bounded slices, one per leaf dimension) of a leaf of shape `shape`,
    read from the checkpoint as `dtype`: only those layers (stacked experts: those layers'
    experts), only that slice of each file tensor.

    `reuse` (a stack placed layer by layer): the host arrays of earlier calls, by the part
    they held; a part of the same place and size is read into the same array again instead
    of into fresh memory (at 1B each layer's arrays are 64 MB, which the C library maps
    afresh and the kernel zero-fills every time). The caller hands in an array again only
    once the layer read into it is placed."""
    stacked = source.stacked
    lead, core = index[:stacked], index[stacked:]
    # The file tensors of those layers, numbered as `source.names` (row-major over the stacked axes).
    held = np.ndindex(*(s.stop - s.start for s in lead))
    starts = tuple(s.start for s in lead)
    layers = [int(np.ravel_multi_index(np.add(starts, i), shape[:stacked])) for i in held] if stacked else [0]
    wanted = tuple(s.stop - s.start for s in core)
    if source.valid is not None:  # a padded vocabulary: read what the file has, zeros after
        core = tuple(slice(min(s.start, v), min(s.stop, v)) for s, v in zip(core, source.valid, strict=True))
    one = functools.partial(_read_layer, checkpoint, mapping, source, source.file_index(core), dtype, wanted)
    if not source.stacked:
        value = one(0)
        return value if value.flags.c_contiguous else _copy_into(_aligned_empty(value.shape, dtype), value)
    # Filled layer by layer: no second copy of the stack; aligned, so that on a CPU jax takes
    # it as the device's buffer instead of copying it into one.
    size = (len(layers), *wanted)
    # The part's place: the same bounds in every layer (`index` before a padded vocabulary's cut).
    place = (tuple((s.start, s.stop) for s in index[stacked:]), size, np.dtype(dtype).str)
    out = None if reuse is None else reuse.get(place)
    if out is None:
        out = _aligned_empty(size, dtype)
        if reuse is not None:
            reuse[place] = out
    for n, i in enumerate(layers):
        _copy_into(out[n], one(i))
    return out.reshape(*(s.stop - s.start for s in lead), *wanted)


# Module-level functions, not closures, on the loading path: the tests' runtime type checks
# decorate a nested function each time its `def` runs (milliseconds, per leaf and shard).
def _read_layer(
    checkpoint: TensorFile,
    mapping: dict[str, str],
    source: Source,
    file_index: Any,
    dtype: Any,
    wanted: tuple[int, ...],
    i: int,
) -> np.ndarray:
    """File tensor `i` of `source` (numbered as `source.names`), its part `file_index`,
    as `dtype` in the leaf's layout (`wanted`: the part's shape)."""
    return source.from_file(checkpoint.read(mapping[source.names[i]], file_index).astype(dtype, copy=False), wanted)


def _copy_into(out: np.ndarray, value: np.ndarray, tile: int = 256) -> np.ndarray:
    """`out[...] = value`, a transposed `value` (a torch weight read as zoo's `[in, out]`)
    copied in square tiles of its last two dims: numpy's element-order copy of a large
    transposed matrix misses the cache on every element, about 2.5× slower. A large one is
    split by rows over up to four threads (numpy lets go of the GIL while it copies)."""
    if value.ndim < 2 or value.flags.c_contiguous:
        out[...] = value
        return out
    rows = value.shape[-2]
    parts = min(_COPY_THREADS, max(value.size // _ELEMENTS_A_THREAD, 1), -(-rows // tile))
    if parts == 1:
        return _copy_tiles(out, value, 0, rows, tile)
    step = -(-rows // parts // tile) * tile  # whole tiles per thread
    spans = [(start, min(start + step, rows)) for start in range(0, rows, step)]
    others = [_copier().submit(_copy_tiles, out, value, a, b, tile) for a, b in spans[1:]]
    _copy_tiles(out, value, *spans[0], tile)
    for other in others:
        other.result()
    return out


# A transposed copy gets a thread per this many elements (float32: 4 MB), at most
# `_COPY_THREADS` threads.
_ELEMENTS_A_THREAD = 1 << 20
_COPY_THREADS = min(4, os.cpu_count() or 1)


@functools.cache
def _copier() -> ThreadPoolExecutor:
    """The threads that copy parts of a large transposed weight beside the loading thread."""
    return ThreadPoolExecutor(max_workers=_COPY_THREADS - 1, thread_name_prefix="zoo-copy")


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: new ones
    os.register_at_fork(after_in_child=_copier.cache_clear)


def _copy_tiles(out: np.ndarray, value: np.ndarray, start: int, stop: int, tile: int) -> np.ndarray:
    """Rows `start:stop` of `value` (transposed: columns of the file) copied into `out` in
    `tile` × `tile` squares."""
    cols = value.shape[-1]
    for i in range(start, stop, tile):
        for j in range(0, cols, tile):
            out[..., i : i + tile, j : j + tile] = value[..., i : i + tile, j : j + tile]
    return out


def _aligned_empty(shape: tuple[int, ...], dtype: Any, alignment: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `alignment`-byte boundary:
    XLA's CPU client places such an array without a copy (it becomes the device buffer)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _finite(value: np.ndarray) -> bool:
    """Whether a floating array holds no NaN or inf: a float32 sum first (one fast pass;
    NaN and inf carry into it, an overflow of finite values is checked element by element)."""
    if value.dtype.kind in "iub":
        return True
    if value.dtype == np.float32 and np.isfinite(np.sum(value)):
        return True
    return bool(np.isfinite(value).all())


def _target_dtype(leaf_dtype: Any, dtype: Any) -> Any:
    return jnp.dtype(dtype) if jnp.issubdtype(leaf_dtype, jnp.floating) else jnp.dtype(leaf_dtype)


def place(
    family: Family,
    skeleton: Any,
    config: Any,
    checkpoint: TensorFile,
    *,
    specs: Any,
    mesh: Any,
    dtype: Any,
    where: str,
    convert: Mapping[str, Callable[[Any], Any]] | None = None,
) -> Any:
    """The model `skeleton` describes (leaves: `jax.ShapeDtypeStruct`), its leaves read
    from `checkpoint`.

    **Arguments:**

    - `family`: the architecture (its tensor-name table).
    - `skeleton`: the model from `eqx.filter_eval_shape`.
    - `config`: its config (for `family.ignored`).
    - `checkpoint`: the open checkpoint.
    - `specs`: a `PartitionSpec` per leaf (a pytree like `skeleton`), or `None` for
      single-device arrays on the default device.
    - `mesh`: the concrete mesh the specs refer to (unused without specs).
    - `dtype`: the dtype of the floating leaves.
    - `where`: the checkpoint's path, for messages.
    - `convert`: dotted module name → a function of that module once its leaves are read
      (`from_pretrained(quantize=...)`: a `Linear` to its 4-bit or int8 form). Each
      module is converted as soon as its last leaf is read and its float arrays dropped,
      so the process holds one such module's float arrays at a time, not the model's.
      The converted module's arrays are returned where the function put them.

    **Returns:** the model, and the dotted names of the leaves whose values read hold NaN
    or inf (checked on the host as they are read; `zoo.internal.check_finite` names them).
    """
    entries = list(leaf_sources(family, skeleton, config))
    mapping = check_tensors(family, [s for _, _, s in entries], checkpoint, config, where)
    spec_leaves = {}
    if specs is not None:
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[
            0
        ]
        spec_leaves = {dotted_name(p): s for p, s in flat}
    single = SingleDeviceSharding(jax.local_devices()[0])
    built: dict[str, jax.Array] = {}
    convert = dict(convert or {})
    pending = {owner: 0 for owner in convert}  # each converted module's leaves not read yet
    for path, _, _ in entries:
        if (owner := _owner(dotted_name(path), pending)) is not None:
            pending[owner] += 1
    converted: dict[str, Any] = {}
    nonfinite: list[str] = []
    together: list[_Stack] = []
    for path, leaf, source in entries:
        name = dotted_name(path)
        shape, target = tuple(leaf.shape), _target_dtype(leaf.dtype, dtype)
        sharding = single if specs is None else NamedSharding(mesh, spec_leaves[name])
        read = functools.partial(read_leaf, checkpoint, mapping, source, dtype=target, shape=shape)
        if source.stacked and shape[0] > 1 and not _split(sharding, 0) and _owner(name, pending) is None:
            together.append(_Stack(name, shape, target, sharding, read))  # placed below, layer by layer
            continue
        built[name], finite = _place_leaf(read, shape, target, sharding, stacked=bool(source.stacked))
        if not finite:
            nonfinite.append(name)
        owner = _owner(name, pending)
        if owner is not None:
            pending[owner] -= 1
            if not pending[owner]:  # its last leaf: convert it now, drop its float arrays
                module = node_at(skeleton, key_path(skeleton, owner))
                module = jax.tree_util.tree_map_with_path(
                    lambda p, x, owner=owner: built.pop(f"{owner}.{dotted_name(p)}", x), module
                )
                converted[owner] = convert[owner](module)
    for name, stack, finite in _place_stacks(together):
        built[name] = stack
        if not finite:
            nonfinite.append(name)
    order = {dotted_name(path): n for n, (path, _, _) in enumerate(entries)}
    nonfinite.sort(key=order.__getitem__)
    model = jax.tree_util.tree_map_with_path(lambda p, x: built.get(dotted_name(p), x), skeleton)
    for owner, module in converted.items():
        model = eqx.tree_at(lambda m, owner=owner: node_at(m, key_path(m, owner)), model, module)
    return model, nonfinite


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A stack of layers (`[layers, ...]`, the layer axis not split over devices) to place:
    its dotted name, shape, dtype, sharding and reader of parts (`read_leaf`)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    read: Callable[[tuple[slice, ...]], np.ndarray]


def _place_stacks(stacks: list[_Stack]) -> Iterator[tuple[str, jax.Array, bool]]:
    """The stacks placed together, layer by layer: one program makes every stack of the
    same depth on the devices, and one writes layer `i` of each into them in place (two
    compiled programs, not two per leaf shape: ~25 ms each on a CPU). The host holds one
    layer of each stack at a time. Yields (name, placed stack, whether every value read is
    finite)."""
    by_depth: dict[int, list[_Stack]] = {}
    for stack in stacks:
        by_depth.setdefault(stack.shape[0], []).append(stack)
    for depth, group in by_depth.items():
        shardings = tuple(x.sharding for x in group)
        placed = _zero_stacks(tuple((x.shape, x.dtype) for x in group), shardings)()
        finite = [[True] for _ in group]
        # Each stack's host arrays (one per part), in two sets: layer i is read into set i % 2
        # while layer i - 1 is written into the stacks, from the arrays it may still be (a CPU
        # takes an aligned array as its buffer); layer i - 2's, done by then, are refilled.
        reuse = [({}, {}) for _ in group]
        for i in range(depth):
            layer = [
                _placed(functools.partial(x.read, reuse=r[i % 2]), (1, *x.shape[1:]), x.sharding, f, i)
                for x, f, r in zip(group, finite, reuse, strict=True)
            ]
            jax.block_until_ready(placed)  # layer i - 1 in place: its arrays free for layer i + 1
            placed = _put_layers(shardings)(placed, layer, np.int32(i))
        yield from ((x.name, p, f[0]) for x, p, f in zip(group, placed, finite, strict=True))


def _place_leaf(
    read: Callable[[tuple[slice, ...]], np.ndarray], shape: tuple, dtype: Any, sharding: Any, *, stacked: bool
) -> tuple[jax.Array, bool]:
    """One leaf of shape `shape` and `dtype` placed with `sharding`, its parts read by
    `read(bounds)` (`read_leaf`); and whether every value read is finite.

    A stack of layers (`[layers, ...]`, the layer axis not split over devices) is placed
    layer by layer into a stack made on the devices (`_place_stacks`, in place): the host
    holds one layer's slices at a time, never the whole stack beside its placed copy.
    """
    if not stacked or shape[0] == 1 or _split(sharding, 0):
        finite = [True]
        return _placed(read, shape, sharding, finite), finite[0]
    ((_, stack, finite_stack),) = _place_stacks([_Stack("", shape, dtype, sharding, read)])
    return stack, finite_stack


def _placed(read: Callable, shape: tuple, sharding: Any, finite: list[bool], layer: int = 0) -> jax.Array:
    """The array of `shape` placed with `sharding`, each device's shard `read(bounds)` (of
    layer `layer` onwards of a stack); `finite[0]` set `False` if a value read is not."""
    part = functools.partial(_read_part, read, shape, layer, {}, finite)
    return jax.make_array_from_callback(shape, sharding, part)


def _read_part(
    read: Callable, shape: tuple, layer: int, cache: dict[tuple, np.ndarray], finite: list[bool], index: Any
) -> np.ndarray:
    """`make_array_from_callback`'s callback for `_placed`: the shard `index` of `shape`."""
    bounds = _bounds(index, shape)
    if layer:
        bounds = (slice(bounds[0].start + layer, bounds[0].stop + layer), *bounds[1:])
    # Devices that hold the same shard (replicated over some mesh axes) share one read.
    key = tuple((s.start, s.stop) for s in bounds)
    if key not in cache:
        cache[key] = read(bounds)
        finite[0] = finite[0] and _finite(cache[key])
    return cache[key]


def _split(sharding: Any, axis: int) -> bool:
    """Whether `sharding` splits dimension `axis` over more than one device."""
    spec = tuple(getattr(getattr(sharding, "spec", ()), "partitions", ()))
    if len(spec) <= axis or spec[axis] is None:
        return False
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
    return int(np.prod([sharding.mesh.shape[n] for n in names])) > 1


@functools.lru_cache(maxsize=16)  # one per model's stack shapes and placement; bounded across loads
def _zero_stacks(shapes: tuple[tuple[tuple[int, ...], Any], ...], shardings: tuple) -> Callable:
    """A program making zero arrays of `shapes` ((shape, dtype) each) with `shardings`."""

    def zero_stacks():
        return [jnp.zeros(shape, dtype) for shape, dtype in shapes]

    return jax.jit(zero_stacks, out_shardings=list(shardings))


@functools.lru_cache(maxsize=16)
def _put_layers(shardings: tuple) -> Callable:
    """`stacks` with `values[k]` (`[1, ...]`) at layer `i` of `stacks[k]`, each written into
    its stack's buffer (donated)."""

    def put_layers(stacks, values, i):
        return [jax.lax.dynamic_update_slice_in_dim(s, v, i, 0) for s, v in zip(stacks, values, strict=True)]

    return jax.jit(put_layers, donate_argnums=0, out_shardings=list(shardings))


def _owner(name: str, modules: Mapping[str, int]) -> str | None:
    """The module of `modules` (dotted names) that holds leaf `name`, if any."""
    parts = name.split(".")
    for n in range(len(parts) - 1, 0, -1):
        if (prefix := ".".join(parts[:n])) in modules:
            return prefix
    return None
