"""Refusing weights that hold NaN or inf where they are loaded: a model with one computes
NaN logits, and `argmax` of those is token 0 — text that looks like an answer."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._tree import path_str


class NonFiniteWeightsError(ValueError):
    """Weights that hold NaN or inf: a damaged checkpoint or a diverged run's."""


# One compiled reduction per model structure (jit caches it): a flag per floating leaf.
_finite_flags = jax.jit(lambda leaves: jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def _floating(tree: Any) -> list:
    return jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_inexact_array))


def all_finite(tree: Any) -> bool:
    """Whether every floating leaf of `tree` is free of NaN and inf (one device reduction;
    the host reads one flag per leaf)."""
    leaves = [leaf for _, leaf in _floating(tree)]
    return not leaves or bool(jax.device_get(_finite_flags(leaves)).all())


def check_finite(tree: Any, *, where: str) -> None:
    """Raise `NonFiniteWeightsError` (a `ValueError`) naming the first floating leaf of
    `tree` that holds NaN or inf: its path, how many of its values, and `where` the
    weights came from.

    **Arguments:** `tree`, a model or any pytree of arrays; `where`, the file or folder
    read (the message's start)."""
    leaves = _floating(tree)
    if not leaves:
        return
    finite = jax.device_get(_finite_flags([leaf for _, leaf in leaves]))
    if finite.all():
        return
    path, leaf = leaves[int(finite.argmin())]
    bad = int(jax.device_get(jnp.sum(~jnp.isfinite(leaf))))
    raise NonFiniteWeightsError(
        f"{where}: the weight {path_str(path)} holds NaN or inf ({bad} of its {leaf.size} values), so every output "
        "would be NaN; the checkpoint is damaged or was saved from a diverged run: use another checkpoint"
    )


# Models already found finite, by id: a weak reference each (dropped with the model), so a
# model is checked once however many times it generates.
_FINITE: dict[int, Any] = {}


def check_finite_once(model: Any, *, where: str) -> None:
    """`check_finite(model, where=where)`, once per model object: later calls with the same
    (immutable) model cost a dictionary look-up."""
    import weakref

    ref = _FINITE.get(id(model))
    if ref is not None and ref() is model:
        return
    check_finite(model, where=where)
    key = id(model)
    try:
        _FINITE[key] = weakref.ref(model, lambda _, key=key: _FINITE.pop(key, None))
    except TypeError:  # not weakly referable: checked at every call
        pass
