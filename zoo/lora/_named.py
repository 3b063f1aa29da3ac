"""Several named LoRA adapters on one frozen base, chosen per row of a batch.

`stack_adapters({"a": model_a, "b": model_b})` turns models that carry one adapter each
over the same base (`add_lora`, `load_adapter`) into one model whose adapted layers are
`MultiLoraLinear`s holding every adapter's branch stacked on an `adapters` axis;
`adapter(model, name)` gives one of them back as a plain LoRA model (to merge, save or
export). `route(model, index)` picks the adapter of each row (peft's `adapter_names=`);
`set_adapter` picks the one used when no row is routed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from .._tree import node_at
from ..nn import FourBitLinear, Linear, QuantizedLinear
from ..nn._sharding import sharding_spec
from ._apply import ADAPTED, LINEARS, modules, unload
from ._embedding import LoraEmbedding
from ._layer import LoraLinear
from ._multi_linear import MultiLoraLinear


def adapter_layers(model: Any) -> dict[str, tuple[tuple, int]]:
    """Dotted name → (key path, stacked levels) of every `MultiLoraLinear` in `model`."""
    return modules(model, MultiLoraLinear)


def adapter_names(model: Any) -> tuple[str, ...]:
    """The names of the adapters a `stack_adapters` model holds, in index order."""
    layers = adapter_layers(model)
    if not layers:
        return ()
    path, _ = next(iter(layers.values()))
    return node_at(model, path).names


def _check_name(model: Any, name: str | None) -> int | None:
    names = adapter_names(model)
    if not names:
        raise ValueError(
            "this model holds no named adapters: build one with zoo.lora.stack_adapters({name: lora_model, ...}) "
            "or zoo.lora.add_adapter"
        )
    if name is None:
        return None
    if name not in names:
        raise ValueError(f"no adapter named {name!r}: this model holds {list(names)}")
    return names.index(name)


def set_adapter(model: Any, name: str | None) -> Any:
    """`model` using adapter `name` for every row not routed by `route` (peft's
    `set_adapter`); `None`: the bare base (peft's `disable_adapter`). Static: a jitted
    function compiles once per choice."""
    k = _check_name(model, name)
    return _replace(model, lambda layer: _with(layer, active=k))


def route(model: Any, index: Int[Array, " batch"] | np.ndarray | list[int]) -> Any:
    """`model` with each row of the next batch using adapter `index[row]` (an index into
    `adapter_names(model)`; `-1`: the bare base), as peft's `adapter_names=` does per row.

    The index is data: a jitted call compiles once for any mix. Rows are the first axis of
    the inputs the model is called with (`[batch, seq]` tokens: the batch).
    """
    names = adapter_names(model)
    if not names:
        _check_name(model, None)
    if not isinstance(index, jax.core.Tracer):  # a traced index is checked by its caller
        concrete = np.asarray(index)
        if concrete.ndim != 1:
            raise ValueError(f"route: index must be one adapter index per row, [batch]; got shape {concrete.shape}")
        wrong = concrete[(concrete < -1) | (concrete >= len(names))]
        if wrong.size:
            raise ValueError(
                f"route: adapter index {int(wrong[0])} is out of range: this model holds {len(names)} adapters "
                f"{list(names)} (indices 0..{len(names) - 1}; -1 is the bare base)"
            )
        if not isinstance(index, jax.Array):
            index = jnp.asarray(concrete, jnp.int32)
    scalings = jnp.asarray(_first(model).scalings, jnp.float32)
    spec = sharding_spec(index)
    one_hot = jax.nn.one_hot(index, len(names), dtype=jnp.float32)  # -1: a row of zeros
    row_scale = one_hot * lax.broadcast_in_dim(
        scalings, one_hot.shape, (1,), out_sharding=None if spec is None else P(*spec, None)
    )

    def bind(layer: MultiLoraLinear, stacked: int) -> MultiLoraLinear:
        scale = row_scale
        if stacked:
            shape = layer.lora_A.shape[:stacked] + row_scale.shape
            out = None if spec is None else P(*((None,) * stacked), *sharding_spec(row_scale))
            scale = lax.broadcast_in_dim(row_scale, shape, (stacked, stacked + 1), out_sharding=out)
        return _with(layer, row_scale=scale)

    return _replace(model, bind, stacked=True)


def _first(model: Any) -> MultiLoraLinear:
    path, _ = next(iter(adapter_layers(model).values()))
    return node_at(model, path)


def _replace(model: Any, fn, *, stacked: bool = False) -> Any:
    found = adapter_layers(model)
    if not found:
        return model
    paths = [p for p, _ in found.values()]
    levels = [s for _, s in found.values()]
    new = [fn(node_at(model, p), s) if stacked else fn(node_at(model, p)) for p, s in zip(paths, levels)]
    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)


def _with(layer: MultiLoraLinear, **changes: Any) -> MultiLoraLinear:
    new = object.__new__(MultiLoraLinear)
    for f in dataclasses.fields(layer):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(layer, f.name)))
    return new


def _plain_lora(layer: Any, name: str, where: str) -> LoraLinear | None:
    """`layer` as one adapter's branch (`None`: that adapter leaves it alone), or a clear
    refusal of what a stacked layer cannot hold."""
    if isinstance(layer, Linear | QuantizedLinear | FourBitLinear):
        return None
    if isinstance(layer, MultiLoraLinear):
        raise ValueError(f"adapter {name!r} already holds named adapters at {where!r}: pass single-adapter models")
    if not isinstance(layer, LoraLinear):
        kind = type(layer).__name__ if isinstance(layer, ADAPTED) else "module"
        raise ValueError(
            f"adapter {name!r} has a {kind} at {where!r}: named adapters stack plain LoRA branches on Linear layers "
            "(no embedding LoRA, trainable tokens, DoRA, expert LoRA); leave those out of the adapters you stack"
        )
    if layer.use_dora:
        raise ValueError(f"adapter {name!r} is a DoRA adapter ({where!r}): named adapters stack plain LoRA only")
    if layer.merged:
        raise ValueError(f"adapter {name!r} is merged at {where!r}: stack unmerged adapters (zoo.lora.unmerge)")
    return layer


def stack_adapters(models: Mapping[str, Any], *, active: str | None = None) -> Any:
    """One model holding the adapters of `models` (name → a model carrying one LoRA
    adapter, e.g. from `zoo.lora.add_lora` or `load_adapter`, all on the same base).

    Adapters may target different layers and have different ranks, scalings and dropout
    (a layer holds the largest rank; the rest is zero). `active` (default: the first name)
    is used for rows not routed by `route`. Returns a model whose adapted layers are
    `MultiLoraLinear`s sharing the first model's base arrays; errors name an adapter of a
    kind that cannot be stacked, or models whose bases differ in structure.
    """
    names = tuple(models)
    if not names:
        raise ValueError("stack_adapters needs at least one named adapter model")
    trees = [models[n] for n in names]
    first = trees[0]
    layers = [modules(t, (*LINEARS, LoraLinear)) for t in trees]
    where = sorted(set().union(*layers))
    for n, found in zip(names, layers):
        if sorted(found) != where:
            missing = sorted(set(where) - set(found))
            raise ValueError(
                f"adapter {n!r} sits on a different model: its Linear layers {sorted(found)[:4]}... "
                f"lack {missing[:4]}; stack adapters of one base model"
            )
    for n, t in zip(names, trees):  # embedding LoRA, trainable tokens: refused, not dropped
        for w, (path, _) in modules(t, ADAPTED).items():
            if not isinstance(node_at(t, path), LoraLinear | MultiLoraLinear):
                _plain_lora(node_at(t, path), n, w)
    adapted, replacements = [], []
    for w in where:
        path, stacked = layers[0][w]
        branches = [_plain_lora(node_at(t, path), n, w) for t, n in zip(trees, names)]
        if all(b is None for b in branches):
            continue
        adapted.append(path)
        replacements.append(_stack_layer(branches, names, stacked, active))
    _check_bases(trees, names)
    base = _strip(first)
    return eqx.tree_at(lambda m: [node_at(m, p) for p in adapted], base, replace=replacements)


def _strip(model: Any) -> Any:
    """`model` with every LoRA branch dropped (the bases stay)."""
    return unload(model)


def _check_bases(trees: list[Any], names: tuple[str, ...]) -> None:
    """The models must share one base: their non-adapter arrays have the same shapes."""
    base_shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), eqx.filter(_strip(t), eqx.is_array)) for t in trees]
    for n, shapes in zip(names[1:], base_shapes[1:]):
        if shapes != base_shapes[0]:
            raise ValueError(
                f"adapter {n!r} sits on a base whose arrays differ in shape or dtype from {names[0]!r}'s: "
                "stack adapters of one base model"
            )


def _stack_layer(
    branches: list[LoraLinear | None], names: tuple[str, ...], stacked: int, active: str | None
) -> MultiLoraLinear:
    some = next(b for b in branches if b is not None)
    rank = max(b.r for b in branches if b is not None)
    lead = some.lora_A.shape[:stacked]

    def padded(b: LoraLinear | None, which: str) -> Array:
        if b is None:
            shape = (*lead, some.in_features, rank) if which == "A" else (*lead, rank, some.out_features)
            return jnp.zeros(shape, some.lora_A.dtype)
        x = b.lora_A if which == "A" else b.lora_B
        axis = x.ndim - 1 if which == "A" else x.ndim - 2
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, rank - b.r)
        return jnp.pad(x, pad)

    a = jnp.stack([padded(b, "A") for b in branches], axis=stacked)
    b = jnp.stack([padded(b, "B") for b in branches], axis=stacked)
    layer = object.__new__(MultiLoraLinear)
    fields = dict(
        base=some.base,
        lora_A=a,
        lora_B=b,
        row_scale=None,
        names=names,
        ranks=tuple(0 if x is None else x.r for x in branches),
        scalings=tuple(0.0 if x is None else x.scaling for x in branches),
        dropout_rates=tuple(0.0 if x is None else x.dropout_rate for x in branches),
        present=tuple(x is not None for x in branches),
        active=names.index(active) if active is not None else 0,
    )
    for k, v in fields.items():
        object.__setattr__(layer, k, v)
    return layer


def adapter(model: Any, name: str) -> Any:
    """Adapter `name` of a `stack_adapters` model as a plain LoRA model (`LoraLinear`
    branches of its own rank on the layers it targets; the bare base elsewhere): what
    `zoo.lora.save_adapter`, `merge` and `zoo.generate` take."""
    k = _check_name(model, name)

    def one(layer: MultiLoraLinear) -> Any:
        if not layer.present[k]:
            return layer.base
        a, b = branch(layer, k)
        return plain_branch(layer.base, a, b, layer.scalings[k], layer.dropout_rates[k])

    return _replace(model, one)


def branch(layer: MultiLoraLinear, k: int) -> tuple[Array, Array]:
    """Adapter `k`'s A `[..., in, r_k]` and B `[..., r_k, out]` at `layer` (its own rank)."""
    stacked = layer.lora_A.ndim - 3
    r = layer.ranks[k]
    return jnp.take(layer.lora_A, k, axis=stacked)[..., :r], jnp.take(layer.lora_B, k, axis=stacked)[..., :r, :]


def plain_branch(base: Any, a: Array, b: Array, scaling: float, dropout_rate: float) -> LoraLinear:
    """A plain (unmerged, non-DoRA) `LoraLinear` on `base` holding `a`, `b` as they are."""
    single = object.__new__(LoraLinear)
    for f, v in dict(
        base=base,
        lora_A=a,
        lora_B=b,
        lora_magnitude_vector=None,
        dora_norm=None,
        r=a.shape[-1],
        scaling=scaling,
        dropout_rate=dropout_rate,
        merged=False,
        use_dora=False,
    ).items():
        object.__setattr__(single, f, v)
    return single


def delete_adapter(model: Any, name: str) -> Any:
    """`model` without adapter `name` (peft's `delete_adapter`); the last one: the bare base."""
    k = _check_name(model, name)
    names = adapter_names(model)
    rest = {n: adapter(model, n) for n in names if n != name}
    if not rest:
        return _strip_multi(model)
    current = _first(model).active
    keep = names[current] if current is not None and current != k else None
    return set_adapter(stack_adapters(rest), keep)  # deleting the active one leaves the bare base


def _strip_multi(model: Any) -> Any:
    return _replace(model, lambda layer: layer.base)


def lora_json(model: Any, config: Any) -> dict[str, Any]:
    """The config (peft's field names), its scaling, and the modules that got a branch."""

    def plain(value):
        return list(value) if isinstance(value, tuple) else value

    fields = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    names = adapter_names(model)  # several adapters of this config, trained at once
    return fields | {
        "scaling": config.scaling,
        "adapted_modules": sorted(modules(model, (LoraLinear, LoraEmbedding, MultiLoraLinear))),
        **({"adapters": list(names)} if names else {}),
    }
