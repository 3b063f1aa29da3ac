"""The manifest of a checkpoint: what each leaf of a state is, and how a saved leaf fits
(or does not fit) the leaf of a `like` tree it is restored into."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._mismatch import section

FORMAT = "zoo-checkpoint"
FORMAT_VERSION = 1

# Leaf kinds recorded in the manifest.
ARRAY, NUMPY, KEY, PYTHON, STATIC = "array", "numpy", "key", "python", "static"


class CheckpointError(Exception):
    """A checkpoint that cannot be restored: missing, damaged, or not matching the target."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint that can never be restored: unreadable, truncated, not a zoo checkpoint.

    `step` is the damaged step and `reason` says what is wrong with it; raised by
    `Checkpointer.restore_intact` for a whole directory of them, `step` is None and
    `reason` lists each.
    """

    def __init__(self, message: str, *, step: int | None, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_kind(x: Any) -> str:
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return KEY if _is_key(x) else ARRAY
    if isinstance(x, np.ndarray | np.generic):
        return NUMPY
    if isinstance(x, bool | int | float | str):
        return PYTHON
    return STATIC


def describe_leaf(x: Any) -> dict[str, Any]:
    """The manifest entry of one leaf, less its fingerprint."""
    kind = leaf_kind(x)
    if kind == KEY:
        entry = {"kind": kind, "shape": list(x.shape), "dtype": str(x.dtype)}
        if isinstance(x, jax.Array):  # the name `wrap_key_data` takes; the dtype tells kinds apart
            entry["impl"] = str(jax.random.key_impl(x))
        return entry
    if kind in (ARRAY, NUMPY):
        return {"kind": kind, "shape": list(np.shape(x)), "dtype": str(np.dtype(x.dtype))}
    if kind == PYTHON:
        return {"kind": kind, "type": type(x).__name__, "value": x}
    return {"kind": kind, "type": type(x).__name__}


def flatten(tree: Any, what: str) -> tuple[dict[str, Any], Any]:
    """(`keystr` path → leaf, treedef) of a pytree, refusing paths that print alike."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat: dict[str, Any] = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if name in flat:
            raise CheckpointError(f"two leaves of the {what} have the same path {name!r}; rename one of them")
        flat[name] = leaf
    return flat, treedef


def configs(tree: Any) -> dict[str, Any]:
    """`path → config` of the outermost modules in `tree` that carry a dataclass `config`."""

    def has_config(x):
        return isinstance(x, eqx.Module) and dataclasses.is_dataclass(getattr(x, "config", None))

    out = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=has_config)[0]:
        if has_config(node):
            out[jax.tree_util.keystr(path)] = json.loads(json.dumps(dataclasses.asdict(node.config), default=str))
    return out


def abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def canonical(dtype: Any) -> str:
    """The dtype jax gives an array of `dtype` (64-bit types narrow without x64)."""
    return str(np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype))))


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
    if entry["kind"] in (ARRAY, NUMPY):
        return f"{entry['dtype']}{entry['shape']}"
    if entry["kind"] == KEY:
        return f"PRNG key {entry['dtype']}{entry['shape']}"
    return f"{entry['kind']} {entry.get('type')}"


def problems(path: str, saved: Mapping[str, Any], like_leaf: Any) -> list[tuple[str, str]]:
    """(category, line) for each reason the saved leaf cannot be restored into `like_leaf`.

    An abstract `like` leaf (`jax.ShapeDtypeStruct`, as `jax.eval_shape` makes even of
    Python scalars and NumPy arrays) matches any saved leaf of its shape and jax dtype.
    """
    kind, had = leaf_kind(like_leaf), saved["kind"]
    if kind == STATIC:
        return []  # comes from `like`, whatever the checkpoint held there
    mistyped = [
        (
            "mis-typed",
            f"{path}: checkpoint {_describe_entry(saved)}, `like` {_describe_entry(describe_leaf(like_leaf))}",
        )
    ]
    if had == PYTHON:
        if kind == PYTHON and type(like_leaf).__name__ == saved["type"]:
            return []
        if abstract(like_leaf) and kind == ARRAY and like_leaf.shape == () and not isinstance(saved["value"], str):
            if str(np.dtype(like_leaf.dtype)) == canonical(np.asarray(saved["value"]).dtype):
                return []
        return mistyped
    if had == STATIC or kind == PYTHON or (had == KEY) != (kind == KEY):
        return mistyped
    out = []
    if list(like_leaf.shape) != saved["shape"]:
        out.append(("mis-shaped", f"{path}: checkpoint {saved['shape']}, `like` {list(like_leaf.shape)}"))
    want = str(like_leaf.dtype) if kind == KEY else str(np.dtype(like_leaf.dtype))
    have = canonical(saved["dtype"]) if had == NUMPY and abstract(like_leaf) else saved["dtype"]
    if want != have:
        out.append(("mis-typed", f"{path}: checkpoint {saved['dtype']}, `like` {want}"))
    return out


def mismatch(
    step: int, directory: str, saved: Mapping[str, Any], flat: Mapping[str, Any], manifest: Mapping[str, Any], like: Any
) -> CheckpointError | None:
    """The error listing everything the checkpoint's leaves (`saved`) and the flat `like`
    tree disagree on (missing, unexpected, mis-shaped, mis-typed leaves, config
    differences), or `None` when every leaf fits."""
    found: dict[str, list[str]] = {"mis-shaped": [], "mis-typed": []}
    for path, leaf in flat.items():
        for category, line in problems(path, saved[path], leaf) if path in saved else ():
            found[category].append(line)
    missing = [p for p in flat if p not in saved]
    unexpected = [p for p in saved if p not in flat]
    if not (missing or unexpected or found["mis-shaped"] or found["mis-typed"]):
        return None
    lines = [f"checkpoint step {step} in {directory} does not match the `like` tree:"]
    lines += section("missing from the checkpoint (in `like` only)", missing)
    lines += section("unexpected (in the checkpoint only)", unexpected)
    lines += section("mis-shaped", found["mis-shaped"])
    lines += section("mis-typed", found["mis-typed"])
    lines += section("config differences", _config_lines(manifest.get("configs", {}), configs(like)))
    lines.append(
        "Build `like` the way the saved state was built (same model config, optimizer "
        "and trainable filter), or restore a checkpoint saved from such a state."
    )
    return CheckpointError("\n".join(lines))
