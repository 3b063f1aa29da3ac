"""Checkpoints of a whole training state: sharded, atomic, checked, keep-last-k.

A checkpoint is one orbax-checkpoint step directory `<directory>/<step>/` holding two
items committed together:

- `state/`: every array leaf of the state, written shard by shard by the processes that
  hold them (tensorstore, OCDBT layout), keyed by the leaf's `jax.tree_util.keystr` path.
  Typed PRNG keys are stored as their key data (`uint32`).
- `manifest/`: JSON: format version, zoo / jax versions, the step, each leaf's path, kind,
  shape, dtype (and key implementation), a 32-bit fingerprint of its bits, the values of
  Python scalar leaves, the configs of the models in the state, and the user's metadata.

Orbax writes a step into `<step>.orbax-checkpoint-tmp*/` and renames it to `<step>/`
once every item of every process is written, so an interrupted save never shows up as a
step. Restores read the manifest first and compare it with the target structure before
touching array data, then recompute the fingerprints of what was read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

FORMAT = "zoo-checkpoint"
FORMAT_VERSION = 1

# Leaf kinds recorded in the manifest.
_ARRAY, _NUMPY, _KEY, _PYTHON, _STATIC = "array", "numpy", "key", "python", "static"

_MAX_LISTED = 20


class CheckpointError(Exception):
    """A checkpoint that cannot be restored: missing, damaged, or not matching the target."""


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns: unpack it as `step, state, metadata = ...`."""

    step: int
    state: Any
    metadata: dict[str, Any]


# --------------------------------------------------------------------------- leaves


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _kind(x: Any) -> str:
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return _KEY if _is_key(x) else _ARRAY
    if isinstance(x, np.ndarray | np.generic):
        return _NUMPY
    if isinstance(x, bool | int | float | str):
        return _PYTHON
    return _STATIC


def _describe_leaf(x: Any) -> dict[str, Any]:
    """The manifest entry of one leaf, less its fingerprint."""
    kind = _kind(x)
    if kind == _KEY:
        entry = {"kind": kind, "shape": list(x.shape), "dtype": str(x.dtype)}
        if isinstance(x, jax.Array):  # the name `wrap_key_data` takes; the dtype tells kinds apart
            entry["impl"] = str(jax.random.key_impl(x))
        return entry
    if kind in (_ARRAY, _NUMPY):
        return {"kind": kind, "shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype))}
    if kind == _PYTHON:
        return {"kind": kind, "type": type(x).__name__, "value": x}
    return {"kind": kind, "type": type(x).__name__}


def _flatten(tree: Any, what: str) -> tuple[dict[str, Any], Any]:
    """(`keystr` path → leaf, treedef) of a pytree, refusing paths that print alike."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat: dict[str, Any] = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if name in flat:
            raise CheckpointError(f"two leaves of the {what} have the same path {name!r}; rename one of them")
        flat[name] = leaf
    return flat, treedef


def _configs(tree: Any) -> dict[str, Any]:
    """`path → config` of the outermost modules in `tree` that carry a dataclass `config`."""

    def has_config(x):
        return isinstance(x, eqx.Module) and dataclasses.is_dataclass(getattr(x, "config", None))

    out = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=has_config)[0]:
        if has_config(node):
            out[jax.tree_util.keystr(path)] = json.loads(json.dumps(dataclasses.asdict(node.config), default=str))
    return out


# --------------------------------------------------------------------------- fingerprints

_GOLDEN = 0x9E3779B1  # odd: multiplying by it is a bijection mod 2**32


def _bits(x: jax.Array) -> jax.Array:
    """A `uint32` array holding `x`'s bit pattern (one element per element of `x`)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    try:
        if size == 4:
            return lax.bitcast_convert_type(x, jnp.uint32)
        if size == 2:
            return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        if size == 1:
            return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
        if size == 8:
            halves = lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
            return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(_GOLDEN))
    except TypeError:
        pass
    # Sub-byte types (int4, float4, ...) convert exactly to a wider one.
    wide = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
    return lax.bitcast_convert_type(x.astype(wide), jnp.uint32)


def _host_bits(x: np.ndarray) -> np.ndarray:
    """`_bits` of a NumPy array, on the host (the device would round 64-bit types)."""
    x = np.asarray(x)
    if x.dtype == np.bool_ or x.dtype.itemsize not in (1, 2, 4, 8):
        return x.astype(np.uint32)
    if x.dtype.itemsize == 8:
        halves = np.ascontiguousarray(x).view(np.uint32).reshape(*x.shape, 2)
        return halves[..., 0] ^ (halves[..., 1] * np.uint32(_GOLDEN))
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return np.ascontiguousarray(x).view(unsigned).astype(np.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """Σ bits[i] · (2i+1) · φ mod 2**32 over flat positions i: a replicated `uint32` scalar.

    The weights are odd, so changing any one element changes the sum, and positions are
    weighted, so swapped elements do too. Computed where the shards lie (an all-reduce
    of one scalar), so it costs no transfer and every process gets the same value.
    """
    bits = _bits(x)
    sharding = jax.typeof(bits).sharding
    kwargs = {} if sharding.mesh.empty else {"out_sharding": sharding}
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(bits.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, bits.shape, dim, **kwargs)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[dim]
    weight = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_GOLDEN)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [_fingerprint(x) for x in leaves])


def _placement(x: Any) -> Any:
    """Leaves with the same placement are fingerprinted by one program."""
    if not isinstance(x, jax.Array) or not x.committed:
        return "default"
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return tuple(sorted(d.id for d in sharding.device_set))


def _compute_fingerprints(stored: Mapping[str, Any], host: set[str]) -> dict[str, int]:
    """`path → fingerprint` of stored leaves. Those in `host` (saved as NumPy arrays) are
    read bit for bit on the host first, as the device would narrow 64-bit types; the
    others were saved from jax arrays and are fingerprinted as jax arrays."""
    leaves = {name: jnp.asarray(_host_bits(x) if name in host else x) for name, x in stored.items()}
    groups: dict[Any, list[str]] = {}
    for name, x in leaves.items():
        groups.setdefault(_placement(x), []).append(name)
    out: dict[str, int] = {}
    for names in groups.values():
        values = jax.device_get(_fingerprints([leaves[n] for n in names]))
        out.update({n: int(v) for n, v in zip(names, values)})
    return out


# --------------------------------------------------------------------------- shardings


def _key_data_sharding(sharding: Any, ndim: int, extra: int) -> Any:
    """The sharding of a key array's data (`extra` trailing, unsharded dimensions)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(*spec, *([None] * extra)), memory_kind=sharding.memory_kind)
    return sharding


def _concrete(sharding: Any, path: str) -> Any:
    """`sharding` on a concrete mesh: `jax.eval_shape` under `jax.set_mesh(mesh)` gives
    shardings on the abstract mesh; the mesh set now supplies the devices."""
    if not isinstance(sharding, NamedSharding) or isinstance(sharding.mesh, jax.sharding.Mesh):
        return sharding
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.abstract_mesh != sharding.mesh:
        raise ValueError(
            f"`like` leaf {path} has a sharding on an abstract mesh {dict(sharding.mesh.shape)} (as "
            "jax.eval_shape gives), and no concrete mesh of that shape is set to supply its devices. Call "
            "restore under `with jax.set_mesh(mesh):` with the mesh `like` was built for, or give "
            "`like` leaves with concrete shardings."
        )
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _canonical(dtype: Any) -> str:
    """The dtype jax gives an array of `dtype` (64-bit types narrow without x64)."""
    return str(np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype))))


def _plan(saved: Mapping[str, Any], like_leaf: Any, path: str) -> tuple[Any, Callable[[Any], Any]]:
    """(what orbax reads this leaf into, or `None` if nothing is read; a function from
    what was read to the restored leaf)."""
    kind = _kind(like_leaf)
    if kind == _STATIC:
        return None, lambda _: like_leaf
    if saved["kind"] == _PYTHON:
        return None, lambda _: saved["value"]
    if saved["kind"] == _KEY:
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(saved["shape"]), like_leaf.dtype))
        shape, dtype = data.shape, np.dtype(data.dtype)

        def finish(value):
            return jax.random.wrap_key_data(value, impl=saved["impl"])
    else:
        shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])

        def finish(value):
            return value

    if kind == _NUMPY or (saved["kind"] == _NUMPY and _abstract(like_leaf)):
        return np.empty(shape, dtype), np.asarray  # NumPy in, NumPy out
    sharding = getattr(like_leaf, "sharding", None)
    if sharding is None or (isinstance(like_leaf, jax.Array) and not like_leaf.committed):
        # `like` fixes no placement: read on the host and let jax place it, as jnp.asarray.
        return np.empty(shape, dtype), lambda value: finish(jnp.asarray(value))
    sharding = _concrete(sharding, path)
    if saved["kind"] == _KEY:
        sharding = _key_data_sharding(sharding, len(saved["shape"]), len(shape) - len(saved["shape"]))
    if saved["kind"] == _NUMPY:
        return np.empty(shape, dtype), lambda value: jax.device_put(value, sharding)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), finish


# --------------------------------------------------------------------------- messages


def _short(error: BaseException, limit: int = 600) -> str:
    """The head of an error's text (tensorstore appends its whole JSON spec; the full
    error stays chained as the cause)."""
    text = str(error).split(" [tensorstore_spec")[0]
    return text if len(text) <= limit else text[:limit] + " …"


def _listed(items: list[str]) -> list[str]:
    lines = [f"    {item}" for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        lines.append(f"    … and {len(items) - _MAX_LISTED} more")
    return lines


def _config_lines(saved: Mapping[str, Any], like: Mapping[str, Any]) -> list[str]:
    """One line per config field that differs between the checkpoint and `like` (for
    modules at the same path in both)."""
    lines = []
    for path in [p for p in like if p in saved]:
        a, b = saved[path], like[path]
        for field in sorted(set(a) | set(b)):
            if a.get(field) != b.get(field):
                lines.append(f"{path}.config.{field}: checkpoint {a.get(field)!r}, `like` {b.get(field)!r}")
    return lines


def _describe_entry(entry: Mapping[str, Any]) -> str:
    if entry["kind"] in (_ARRAY, _NUMPY):
        return f"{entry['dtype']}{entry['shape']}"
    if entry["kind"] == _KEY:
        return f"PRNG key {entry['dtype']}{entry['shape']}"
    return f"{entry['kind']} {entry.get('type')}"


def _problems(path: str, saved: Mapping[str, Any], like_leaf: Any) -> list[tuple[str, str]]:
    """(category, line) for each reason the saved leaf cannot be restored into `like_leaf`.

    An abstract `like` leaf (`jax.ShapeDtypeStruct`, as `jax.eval_shape` makes even of
    Python scalars and NumPy arrays) matches any saved leaf of its shape and jax dtype.
    """
    kind, had = _kind(like_leaf), saved["kind"]
    if kind == _STATIC:
        return []  # comes from `like`, whatever the checkpoint held there
    mistyped = [("mis-typed", f"{path}: checkpoint {_describe_entry(saved)}, `like` "
                 f"{_describe_entry(_describe_leaf(like_leaf))}")]
    if had == _PYTHON:
        if kind == _PYTHON and type(like_leaf).__name__ == saved["type"]:
            return []
        if _abstract(like_leaf) and kind == _ARRAY and like_leaf.shape == () and not isinstance(saved["value"], str):
            if str(np.dtype(like_leaf.dtype)) == _canonical(np.asarray(saved["value"]).dtype):
                return []
        return mistyped
    if had == _STATIC or kind == _PYTHON or (had == _KEY) != (kind == _KEY):
        return mistyped
    out = []
    if list(like_leaf.shape) != saved["shape"]:
        out.append(("mis-shaped", f"{path}: checkpoint {saved['shape']}, `like` {list(like_leaf.shape)}"))
    want = str(like_leaf.dtype) if kind == _KEY else str(np.dtype(like_leaf.dtype))
    have = _canonical(saved["dtype"]) if had == _NUMPY and _abstract(like_leaf) else saved["dtype"]
    if want != have:
        out.append(("mis-typed", f"{path}: checkpoint {saved['dtype']}, `like` {want}"))
    return out


# --------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores whole training states in a directory of numbered checkpoints.

    A state is any pytree of arrays and Equinox modules, typically
    `{"model": model, "opt_state": opt_state, "key": key}`. What is saved: every array
    leaf (sharded `jax.Array`s shard by shard, NumPy arrays, typed PRNG keys) and every
    Python `bool`/`int`/`float`/`str` leaf. What is not: the tree's structure and static
    parts (configs, static fields, functions held as leaves), which come from the `like`
    tree given to `restore`.

    Built on orbax-checkpoint (`CheckpointManager`): every process writes its own shards,
    one commit makes the step visible, and restore reads into any target sharding. Every
    process must call `save` and `restore` with the same arguments.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        """**Arguments:**

        - `directory`: where the checkpoints live (created if missing): a local or shared
          path, or a `gs://` URL. Each step is a subdirectory named by its number.
        - `keep`: keep the newest `keep` checkpoints and delete older ones after each
          save; `None` keeps all.
        - `async_save`: if `True`, `save` returns once the arrays are copied to host
          memory and the files are written in the background (see `wait`).
        - `read_only`: only list and restore. Opening a directory otherwise deletes the
          temporary directories of unfinished saves, so a process that reads while
          another one trains into the same directory (an evaluator) must pass `True`.
        """
        import orbax.checkpoint as ocp  # here: its import is slow, `import zoo` stays quick

        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        self._ocp = ocp
        self.read_only = read_only
        path = os.fspath(directory)
        self.directory = path if "://" in path else os.path.abspath(path)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
            # Interrupted saves leave `<step>.orbax-checkpoint-tmp*` directories: never
            # steps, removed (by process 0) when a Checkpointer opens the directory.
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "manifest"))
        self._pending: int | None = None  # the step of the last save started

    # -- context manager ----------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for writes in flight, then release orbax's resources."""
        self._manager.close()

    def wait(self) -> None:
        """Block until every save started so far is written and committed.

        Errors of a background write are raised here (or by the next `save`).
        """
        self._manager.wait_until_finished()

    # -- listing ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps of the committed checkpoints in the directory, oldest first.

        A step being written (by an asynchronous save still in flight) is not one yet.
        """
        steps = sorted(self._manager.all_steps())
        # orbax lists a step as soon as its save starts.
        if self._pending in steps and self._manager.is_saving_in_progress():
            steps.remove(self._pending)
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or `None` if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving -------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Save `state` as checkpoint `step`.

        **Arguments:**

        - `step`: a non-negative int not saved before in this directory.
        - `state`: a pytree of arrays (any sharding), typed PRNG keys, Python scalars and
          Equinox modules.
        - `metadata`: a JSON-serialisable dict returned by `restore` (data-loader
          position, run name, ...).

        Returns once the arrays are copied off the devices (the caller may then donate
        or overwrite them); with `async_save=True` the files are written afterwards.
        The checkpoint appears in `steps()` only once completely written; then the
        oldest checkpoints beyond `keep` are deleted.
        """
        if self.read_only:
            raise CheckpointError(f"this Checkpointer of {self.directory} was opened with read_only=True: it cannot save")
        if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata must be JSON-serialisable (dicts, lists, str, numbers): {e}") from e

        flat, _ = _flatten(state, "state")
        abstract = [path for path, leaf in flat.items() if _abstract(leaf)]
        if abstract:
            raise TypeError(f"cannot save abstract leaves (jax.ShapeDtypeStruct), e.g. {abstract[0]}: save arrays")
        entries = {path: _describe_leaf(leaf) for path, leaf in flat.items()}
        stored = {}
        for path, leaf in flat.items():
            kind = entries[path]["kind"]
            if kind == _KEY:
                stored[path] = jax.random.key_data(leaf)
            elif kind in (_ARRAY, _NUMPY):
                stored[path] = leaf
        numpy = {path for path in stored if entries[path]["kind"] == _NUMPY}
        for path, value in _compute_fingerprints(stored, numpy).items():
            entries[path]["fingerprint"] = value

        from . import __version__

        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "zoo_version": __version__,
            "jax_version": jax.__version__,
            "step": step,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "leaves": entries,
            "configs": _configs(state),
            "metadata": metadata,
        }
        ocp = self._ocp
        if step in self.steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory}; steps there: {self.steps()}. "
                "Save under a new step number, or delete that step's directory first."
            )
        # Both items are written into the same temporary step directory and committed by
        # one rename: a manifest never exists without its arrays, nor arrays without it.
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(stored), manifest=ocp.args.JsonSave(manifest)),
            force=True,
        )
        self._pending = step

    # -- restoring ----------------------------------------------------------------------
    def _choose(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {self.directory}: nothing to restore")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; the steps there are {steps}"
            )
        return int(step)

    def _damaged(self, step: int, what: str, error: BaseException | None = None) -> CheckpointError:
        others = [s for s in self.steps() if s != step]
        fix = (
            f"Restore another step with restore(like, step=...); the others here are {others}."
            if others
            else "There is no other checkpoint in this directory."
        )
        detail = f"\n  cause: {type(error).__name__}: {_short(error)}" if error is not None else ""
        return CheckpointError(
            f"checkpoint step {step} in {os.path.join(self.directory, str(step))} is damaged: {what}{detail}\n{fix}"
        )

    def _read_manifest(self, step: int) -> dict[str, Any]:
        ocp = self._ocp
        try:
            args = ocp.args.Composite(manifest=ocp.args.JsonRestore())
            manifest = self._manager.restore(step, args=args)["manifest"]
        except Exception as e:  # orbax / json raise many types; the cause is chained
            raise self._damaged(step, "its manifest cannot be read", e) from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "leaves" not in manifest:
            raise self._damaged(step, "its manifest is not a zoo checkpoint manifest")
        if manifest.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has format version {manifest['format_version']}, "
                f"newer than this zoo reads ({FORMAT_VERSION}); upgrade zoo"
            )
        return manifest

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The manifest of checkpoint `step` (default: the newest), read without touching
        array data: `"leaves"` (path → kind, shape, dtype, fingerprint), `"configs"`,
        `"metadata"`, `"step"`, versions."""
        return self._read_manifest(self._choose(step))

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with checkpoint `step` (default: the newest)."""
        return dict(self.manifest(step).get("metadata", {}))

    def restore(self, like: Any, *, step: int | None = None) -> Restored:
        """Restore checkpoint `step` (default: the newest) into the structure of `like`.

        **Arguments:**

        - `like`: a pytree with the saved state's structure: a freshly initialised state
          placed on the target mesh (e.g. `zoo.shard(model, rules, mesh)` and its
          optimizer state), or `jax.eval_shape` of a function making one (leaves
          `jax.ShapeDtypeStruct` with `.sharding`). Each array is read straight into the
          sharding of its `like` leaf, which may differ from the saved one (another mesh,
          another number of devices). A leaf without a fixed placement (an uncommitted
          array, a `ShapeDtypeStruct` without sharding) is left for jax to place, like
          `jnp.asarray`. Static parts (configs, static fields) come from `like`.
        - `step`: which checkpoint; `None` for the newest.

        **Returns:** `Restored(step, state, metadata)`.

        **Raises:** `CheckpointError` if there is no such step, if the checkpoint's leaves
        do not match `like` (listing every missing, unexpected, mis-shaped and mis-typed
        leaf, checked before any array is read), if its files cannot be read, or if a
        leaf read back differs from what was saved (fingerprint mismatch).
        """
        step = self._choose(step)
        manifest = self._read_manifest(step)
        saved = manifest["leaves"]
        flat, treedef = _flatten(like, "`like` tree")

        # Everything `like` and the manifest disagree on, before any array is read.
        found: dict[str, list[str]] = {"mis-shaped": [], "mis-typed": []}
        for path, leaf in flat.items():
            for category, line in _problems(path, saved[path], leaf) if path in saved else ():
                found[category].append(line)
        missing = [p for p in flat if p not in saved]
        unexpected = [p for p in saved if p not in flat]
        if missing or unexpected or found["mis-shaped"] or found["mis-typed"]:
            lines = [f"checkpoint step {step} in {self.directory} does not match the `like` tree:"]
            for title, items in (
                ("missing from the checkpoint (in `like` only)", missing),
                ("unexpected (in the checkpoint only)", unexpected),
                ("mis-shaped", found["mis-shaped"]),
                ("mis-typed", found["mis-typed"]),
            ):
                if items:
                    lines.append(f"  {title} ({len(items)}):")
                    lines.extend(_listed(items))
            configs = _config_lines(manifest.get("configs", {}), _configs(like))
            if configs:
                lines.append("  config differences:")
                lines.extend(_listed(configs))
            lines.append(
                "Build `like` the way the saved state was built (same model config, optimizer "
                "and trainable filter), or restore a checkpoint saved from such a state."
            )
            raise CheckpointError("\n".join(lines))

        plans = {path: _plan(saved[path], leaf, path) for path, leaf in flat.items()}
        targets = {path: target for path, (target, _) in plans.items() if target is not None}
        ocp = self._ocp
        try:
            args = ocp.args.Composite(state=ocp.args.StandardRestore(targets))
            read = dict(self._manager.restore(step, args=args)["state"])
        except Exception as e:  # tensorstore / orbax errors; the cause is chained
            raise self._damaged(step, "its array data cannot be read (a file is missing, truncated or changed)", e) from e
        if set(read) != set(targets):
            raise self._damaged(
                step, f"it holds other arrays than its manifest lists ({len(read)} read, {len(targets)} listed)"
            )

        fingerprints = _compute_fingerprints(read, {p for p in read if saved[p]["kind"] == _NUMPY})
        corrupt = [p for p in targets if fingerprints[p] != saved[p].get("fingerprint")]
        if corrupt:
            raise self._damaged(
                step,
                f"the data of {len(corrupt)} leaves differs from what was saved (fingerprint mismatch):\n"
                + "\n".join(_listed(corrupt))
                + "\nA file of the checkpoint was changed after it was written.",
            )

        leaves = [finish(read.get(path)) for path, (_, finish) in plans.items()]
        return Restored(step, jax.tree.unflatten(treedef, leaves), dict(manifest.get("metadata", {})))


__all__ = ["CheckpointError", "Checkpointer", "Restored"]
