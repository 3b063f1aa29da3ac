"""Adding named adapters to a model: a new one (`add_adapter`) or a weighted combination of
those it holds (`add_weighted_adapter`, peft's `linear`, `cat` and `svd`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import PRNGKeyArray

from .._tree import node_at
from ._apply import add_lora, modules, unload
from ._config import LoraConfig
from ._layer import LoraLinear
from ._multi_linear import MultiLoraLinear
from ._named import (
    _first,
    _replace,
    _strip_multi,
    adapter,
    adapter_layers,
    adapter_names,
    branch,
    plain_branch,
    set_adapter,
    stack_adapters,
)

COMBINATIONS = ("linear", "cat", "svd")


def named(model: Any) -> tuple[dict[str, Any], str | None, Any]:
    """`model`'s adapters as `{name: single-adapter model}`, the active name, and the bare
    base: a `stack_adapters` model, a plain LoRA model (one adapter, peft's `"default"`),
    or a bare base (none)."""
    names = adapter_names(model)
    if names:
        active = _first(model).active
        return {n: adapter(model, n) for n in names}, None if active is None else names[active], _strip_multi(model)
    if modules(model, LoraLinear):
        return {"default": model}, "default", unload(model)
    return {}, None, model


def add_adapter(model: Any, name: str, config: LoraConfig, *, key: PRNGKeyArray) -> Any:
    """`model` with one more named adapter, `name`, added with `config` (peft's `add_adapter`).

    **Arguments:**

    - `model`: a model holding named adapters (`stack_adapters`, `add_adapter`), a plain
      LoRA model (`add_lora`, `load_adapter`: its adapter is named `"default"`, as peft
      names it), or a bare base (`name` is its first adapter).
    - `name`: a name the model does not hold yet.
    - `config`: plain LoRA on `Linear` layers (no DoRA, embedding LoRA or trainable tokens).
    - `key`: initialises the new branches as `add_lora` does.

    **Returns:** a model whose adapted layers are `MultiLoraLinear`s; the active adapter
    stays the one it was (peft's: a new adapter is not made active), the new one for a
    bare base. Train it alone with `zoo.lora.route`, or select it with `set_adapter`.
    """
    adapters, active, base = named(model)
    if name in adapters:
        raise ValueError(f"an adapter named {name!r} exists already ({list(adapters)}): choose another name")
    adapters[name] = add_lora(base, config, key=key)
    return stack_adapters(adapters, active=active if active is not None else name)


def _rank(model: Any, name: str) -> int:
    k = adapter_names(model).index(name)
    return max(layer.ranks[k] for layer in _layers(model))


def _layers(model: Any) -> list[MultiLoraLinear]:
    return [node_at(model, p) for p, _ in adapter_layers(model).values()]


def _new_config(
    model: Any, adapters: list[str], rank: int, configs: dict[str, LoraConfig] | None
) -> tuple[LoraConfig, float]:
    """The combined adapter's config as peft writes it (the first adapter's, with `r` and
    `lora_alpha` both the new rank, the union of the targets and `use_rslora` off: a
    scaling of 1, the sources' scalings being inside A and B, as peft 0.22 on) and its
    scaling."""
    if configs is None:
        ks = [adapter_names(model).index(a) for a in adapters]
        targets = sorted(
            {n for n, (p, _) in adapter_layers(model).items() if any(node_at(model, p).present[k] for k in ks)}
        )
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=tuple(targets))
    else:
        missing = [a for a in adapters if a not in configs]
        if missing:
            raise ValueError(f"add_weighted_adapter: configs lacks {missing}: give every combined adapter's LoraConfig")
        kinds = {isinstance(configs[a].target_modules, str) for a in adapters}
        if len(kinds) > 1:
            raise ValueError(
                "add_weighted_adapter: the adapters' target_modules mix a regex string and a list; peft refuses "
                "that mix too: give them the same kind"
            )
        if kinds == {True}:
            targets = "|".join(f"({configs[a].target_modules})" for a in adapters)
        else:
            targets = tuple(sorted(set().union(*(configs[a].target_modules for a in adapters))))
        # peft up to 0.21 kept the first adapter's use_rslora: a scaling of √r on top (its bug, fixed in 0.22).
        config = dataclasses.replace(
            configs[adapters[0]], r=rank, lora_alpha=rank, target_modules=targets, use_rslora=False
        )
    return config, config.scaling


def add_weighted_adapter(
    model: Any,
    adapters: Sequence[str],
    weights: Sequence[float | int],
    adapter_name: str,
    combination_type: str = "svd",
    svd_rank: int | None = None,
    *,
    configs: dict[str, LoraConfig] | None = None,
) -> tuple[Any, LoraConfig]:
    """`model` with a new adapter, `adapter_name`, combining `adapters` with `weights`
    as peft's `LoraModel.add_weighted_adapter` does; returns `(model, config)`.

    **Arguments:**

    - `model`: a model holding named adapters (`stack_adapters`, `add_adapter`,
      `load_adapters`).
    - `adapters`, `weights`: the names to combine and one weight each (negative
      subtracts).
    - `adapter_name`: the new adapter's name (one the model does not hold).
    - `combination_type`: `"linear"` (same rank only: A = Σ sign·√|w·s| A, B = Σ √|w·s| B,
      a rough approximation), `"cat"` (exact: the branches side by side, rank Σ r),
      `"svd"` (exact up to truncation: the rank-`svd_rank` SVD of Σ w·s·A B). One
      adapter is always `"linear"`, as in peft.
    - `svd_rank`: the `"svd"` rank (default: the largest rank combined).
    - `configs`: name → `LoraConfig` of the combined adapters (as `load_adapters`
      returns): the new config is the first one's with `r = lora_alpha =` the new rank
      and the union of the targets, peft's rule, `use_rslora` off (peft 0.22 on: up to
      0.21 it kept the first one's, a scaling of √r on top of the sources' own). Without
      it: a plain config over the combined layers.

    **Returns:** the model (the active adapter unchanged) and the new adapter's
    `LoraConfig` (its scaling is 1: the weights and scalings are inside A and B).
    """
    adapters, weights = list(adapters), [float(w) for w in weights]
    names = adapter_names(model)
    if not names:
        raise ValueError("add_weighted_adapter: this model holds no named adapters (zoo.lora.add_adapter adds them)")
    unknown = [a for a in adapters if a not in names]
    if unknown or not adapters:
        raise ValueError(
            f"add_weighted_adapter: no adapter named {unknown or adapters}: this model holds {list(names)}"
        )
    if adapter_name in names:
        raise ValueError(f"add_weighted_adapter: an adapter named {adapter_name!r} exists already: choose another name")
    if len(weights) != len(adapters):
        raise ValueError(f"add_weighted_adapter: {len(adapters)} adapters but {len(weights)} weights: give one each")
    if combination_type not in COMBINATIONS:
        raise ValueError(
            f"add_weighted_adapter: combination_type {combination_type!r} is not supported; zoo has {COMBINATIONS} "
            "(peft's ties / dare / magnitude_prune variants are not implemented)"
        )
    combination_type = "linear" if len(adapters) == 1 else combination_type
    ranks = [_rank(model, a) for a in adapters]
    if combination_type == "linear" and len(set(ranks)) != 1:
        raise ValueError(
            f"add_weighted_adapter: 'linear' needs adapters of one rank, got r={dict(zip(adapters, ranks))}; "
            "use 'cat' or 'svd' (exact), as peft requires"
        )
    rank = {"linear": ranks[0], "cat": sum(ranks), "svd": svd_rank or max(ranks)}[combination_type]
    config, scaling = _new_config(model, adapters, rank, configs)
    ks = [names.index(a) for a in adapters]

    def one(layer: MultiLoraLinear) -> Any:
        parts = [(k, w) for k, w in zip(ks, weights) if layer.present[k]]
        if not parts:
            return layer.base
        a, b = _combine(layer, parts, combination_type, rank)
        return plain_branch(layer.base, a, b, scaling, layer.dropout_rates[ks[0]])

    combined = _replace(model, one)
    active = _first(model).active
    out = stack_adapters(
        {**{n: adapter(model, n) for n in names}, adapter_name: combined},
        active=None if active is None else names[active],
    )
    return (out if active is not None else _disable(out)), config


def _disable(model: Any) -> Any:
    return set_adapter(model, None)


def _combine(
    layer: MultiLoraLinear, parts: list[tuple[int, float]], kind: str, rank: int
) -> tuple[ArrayLike, ArrayLike]:
    """The combined A `[..., in, rank]` and B `[..., rank, out]` of `parts` (adapter index,
    weight) at `layer`, computed as peft computes them (peft's A is zoo's A transposed)."""
    branches = [(*branch(layer, k), w * layer.scalings[k]) for k, w in parts]
    if kind == "linear":
        # peft: the sign on A only, √|w·s| on both, so B·A carries w·s.
        a = sum(math.copysign(math.sqrt(abs(ws)), ws) * a for a, _, ws in branches)
        b = sum(math.sqrt(abs(ws)) * b for _, b, ws in branches)
        return a, b
    if kind == "cat":
        a = jnp.concatenate([a * ws for a, _, ws in branches], axis=-1)
        b = jnp.concatenate([b for _, b, _ in branches], axis=-2)
        pad = rank - a.shape[-1]  # adapters absent here leave zeros at the end, as peft's
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
        return a, b
    delta = sum(ws * jnp.einsum("...ir,...ro->...oi", a, b, precision=lax.Precision.HIGHEST) for a, b, ws in branches)
    if rank > min(delta.shape[-2:]):
        raise ValueError(
            f"add_weighted_adapter: svd_rank {rank} exceeds a combined layer's size {delta.shape[-2:]}: lower svd_rank"
        )
    u, s, vh = jnp.linalg.svd(delta, full_matrices=False)  # delta is peft's [out, in]
    b_peft = u[..., :rank] * s[..., None, :rank]
    return jnp.swapaxes(vh[..., :rank, :], -1, -2), jnp.swapaxes(b_peft, -1, -2)
