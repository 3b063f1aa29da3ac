"""Key paths of pytrees: their names (via `jax.tree_util.keystr`) and walking them; the
sizes of their array leaves (`tree_bytes`, `tree_size`, `human_bytes`)."""

from __future__ import annotations

from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

KeyPath = tuple[Any, ...]

_MISSING = object()


def path_str(path: KeyPath, root: str = "model") -> str:
    """`model.layers[0].weight`-style text of a key path, for error messages.

    **Arguments:**

    - `path`: a key path (from `jax.tree_util.tree_flatten_with_path` and friends).
    - `root`: the name the path starts from.

    **Returns:** `root` followed by `jax.tree_util.keystr(path)`.
    """
    return root + jax.tree_util.keystr(path)


def dotted_name(path: KeyPath) -> str:
    """The dotted name of a key path: `layers.0.attention.q_proj` (attribute names, list
    indices and dict keys joined by dots), as module names are written."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def child(node: Any, key: Any, default: Any = _MISSING) -> Any:
    """The child of `node` at one path key (`GetAttrKey`, `SequenceKey` or `DictKey`).

    Other keys (e.g. `FlattenedIndexKey` of a custom pytree node) have no way back to the
    child: they return `default`, or raise `TypeError` without one.
    """
    if isinstance(key, GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, SequenceKey):
        return node[key.idx]
    if isinstance(key, DictKey):
        return node[key.key]
    if default is _MISSING:
        raise TypeError(f"cannot follow path key {key!r} of a {type(node).__name__}")
    return default


def node_at(tree: Any, path: KeyPath) -> Any:
    """The subtree of `tree` at key path `path`."""
    for key in path:
        tree = child(tree, key)
    return tree


def child_named(node: Any, part: str) -> Any:
    """The child of `node` named by one part of a dotted name (list index, dict key or attribute)."""
    if isinstance(node, list | tuple):
        return node[int(part)]
    if isinstance(node, dict):
        return node[part]
    return getattr(node, part)


def key_path(tree: Any, name: str) -> KeyPath:
    """The key path of the subtree with dotted name `name` (inverse of `dotted_name`)."""
    path: list = []
    node = tree
    for part in name.split(".") if name else []:
        if isinstance(node, list | tuple):
            path.append(SequenceKey(int(part)))
        elif isinstance(node, dict):
            path.append(DictKey(part))
        else:
            path.append(GetAttrKey(part))
        node = child_named(node, part)
    return tuple(path)


def is_array_like(x: Any) -> bool:
    """An array, or the shape-and-dtype of one (`jax.ShapeDtypeStruct`)."""
    import equinox as eqx

    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_inexact_array_like(x: Any) -> bool:
    """A float (or complex) array, or the shape-and-dtype of one: `eqx.is_inexact_array`
    for a model built as shapes alone too (`zoo.train.abstract_models`)."""
    import jax.numpy as jnp

    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def is_abstract(tree: Any) -> bool:
    """Whether `tree` holds shapes alone somewhere (a `jax.ShapeDtypeStruct` leaf)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def on_shapes_too(fn: Any, tree: Any) -> Any:
    """`fn(tree)`; for a tree of shapes alone (`is_abstract`), `fn` traced on them and its
    result shapes too: nothing computed (a DoRA magnitude or a quantised weight reads the
    values it does not have)."""
    import equinox as eqx

    return eqx.filter_eval_shape(fn, tree) if is_abstract(tree) else fn(tree)


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree (an abstract leaf, `jax.ShapeDtypeStruct`,
    counts the bytes its array would hold)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if is_array_like(x))


def tree_size(tree) -> int:
    """Number of elements in the array leaves of a pytree (abstract leaves counted as their
    arrays would be)."""
    return sum(x.size for x in jax.tree.leaves(tree) if is_array_like(x))


def human_bytes(n: int | float) -> str:
    """1234567 → '1.2 MB' (decimal units)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable: TB takes every size


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, the noun singular when `n` is 1: (1, 'step') → '1 step',
    (3, 'step') → '3 steps'. `plural`: the plural where it is not `noun + 's'`."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
