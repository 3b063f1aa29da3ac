"""Refusing weights that hold NaN or inf where they are loaded: a model with one computes
NaN logits, and `argmax` of those is token 0 — text that looks like an answer."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._tree import path_str


def check_finite(tree: Any, *, where: str) -> None:
    """Raise `ValueError` naming the first floating leaf of `tree` that holds NaN or inf:
    its path, how many of its values, and `where` the weights came from.

    **Arguments:** `tree`, a model or any pytree of arrays; `where`, the file or folder
    read (the message's start).

    One compiled reduction over every leaf (the host reads one flag per leaf)."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_inexact_array))
    if not leaves:
        return
    arrays = [leaf for _, leaf in leaves]
    finite = jax.device_get(jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]))(arrays))
    if finite.all():
        return
    i = int(finite.argmin())
    path, leaf = leaves[i]
    bad = int(jax.device_get(jnp.sum(~jnp.isfinite(leaf))))
    raise ValueError(
        f"{where}: the weight {path_str(path)} holds NaN or inf ({bad} of its {leaf.size} values), so every output "
        "would be NaN; the checkpoint is damaged or was saved from a diverged run: use another checkpoint"
    )
