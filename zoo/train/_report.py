"""What a run reports about its model and its compiled step: array sizes and the
collectives the step holds, by kind and place."""

from __future__ import annotations

from typing import Any

from .._inspect import count as count_collectives


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree."""
    import equinox as eqx
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def tree_size(tree) -> int:
    """Number of elements in the array leaves of a pytree."""
    import equinox as eqx
    import jax

    return sum(x.size for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def collective_summary(colls) -> dict[str, Any]:
    """Counts of the collectives by kind and place, and the mesh axes they span."""

    def axes(in_loop: bool) -> list[str]:
        return sorted({a for c in colls if c.in_loop == in_loop for a in c.mesh_axes})

    return {
        "all_reduce_in_loop": count_collectives(colls, "all-reduce", in_loop=True),
        "all_reduce_outside": count_collectives(colls, "all-reduce", in_loop=False),
        "all_gather_in_loop": count_collectives(colls, "all-gather", in_loop=True),
        "all_gather_outside": count_collectives(colls, "all-gather", in_loop=False),
        "reduce_scatter_in_loop": count_collectives(colls, "reduce-scatter", in_loop=True),
        "reduce_scatter_outside": count_collectives(colls, "reduce-scatter", in_loop=False),
        "collectives_in_loop": sum(c.in_loop for c in colls),
        "collectives_total": len(colls),
        "in_loop_mesh_axes": axes(True),
        "outside_mesh_axes": axes(False),
    }
