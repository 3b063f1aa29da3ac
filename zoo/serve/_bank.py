"""A fixed number of adapter slots beside a base, filled and emptied while serving.

The bank is the base with a `MultiLoraLinear` (zoo.lora's stacked branches) on every layer an
adapter may target, `capacity` branches of `max_rank` each, zero when free. Its static
metadata (names, ranks, scalings) never changes: loading an adapter writes its A and B
(zero-padded to `max_rank`, each layer's scaling relative to the adapter's folded into B)
into a free slot's rows of the same arrays, so the engine's compiled programs serve it as
they are. Each row of a batch picks its slot through `row_scale` `[rows, capacity]`
(the slot's scaling at its adapter, zeros for the bare base), bound as data by
`bind_rows`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._finite import check_finite
from .._tree import node_at
from ..lora import (
    LoraConfig,
    LoraExpertLinear,
    LoraLinear,
    MultiLoraLinear,
    add_lora,
    is_adapter,
    modules,
    stack_adapters,
    unload,
)


def _with(layer: MultiLoraLinear, **changes: Any) -> MultiLoraLinear:
    new = object.__new__(MultiLoraLinear)
    for f in dataclasses.fields(layer):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(layer, f.name)))
    return new


def bind_rows(model: Any, row_scale: jax.Array) -> Any:
    """`model` with every bank layer using `row_scale` `[rows, capacity]` (row `i`'s adapter
    weight per slot), broadcast over stacked layer axes. Traceable: one program for any mix."""
    found = modules(model, MultiLoraLinear)
    paths = [p for p, _ in found.values()]

    def bind(layer: MultiLoraLinear, stacked: int) -> MultiLoraLinear:
        lead = layer.lora_A.shape[:stacked]
        return _with(layer, row_scale=jnp.broadcast_to(row_scale, (*lead, *row_scale.shape)))

    new = [bind(node_at(model, p), s) for p, s in found.values()]
    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)


def lora_layers(model: Any) -> dict[str, LoraLinear]:
    """The `LoraLinear` layers of a single-adapter model, by dotted name; a clear refusal of
    an adapter kind the bank cannot hold (DoRA, merged, embedding LoRA, trainable tokens)."""
    out = {}
    for name, (path, _) in modules(model, is_adapter).items():
        layer = node_at(model, path)
        if isinstance(layer, LoraExpertLinear):
            raise ValueError(
                f"the adapter has LoRA on a mixture of experts' expert weights at {name!r} (target_parameters): the "
                "engine's adapter bank holds branches on Linear layers only, not per-expert ones. Serve the merged "
                "model (zoo.lora.merge(model)) as the base, or decode it with zoo.generate"
            )
        if not isinstance(layer, LoraLinear):
            raise ValueError(
                f"the adapter has a {type(layer).__name__} at {name!r}: served adapters are plain LoRA on Linear "
                "layers (no embedding LoRA, trainable tokens or stacked named adapters)"
            )
        if layer.use_dora or layer.merged:
            kind = "DoRA" if layer.use_dora else "merged"
            raise ValueError(f"the adapter is {kind} at {name!r}: served adapters are plain, unmerged LoRA")
        out[name] = layer
    if not out:
        raise ValueError("the model carries no LoRA branch: give a model from zoo.lora.add_lora or load_adapter")
    return out


class AdapterBank:
    """`capacity` adapter slots of rank up to `max_rank` on `base`'s `targets` layers.

    `model` is the base with the bank's layers (every slot zero until `write`);
    `names[k]` the adapter in slot `k` (None: free); `scalings[k]` its scaling (data the
    engine puts in `row_scale`). `write` and `clear` swap in new arrays of the same shapes.
    """

    def __init__(self, base: Any, *, capacity: int, max_rank: int, targets: Any = "all-linear"):
        if capacity < 1:
            raise ValueError(f"max_adapters must be >= 1 to hold adapters, got {capacity}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.capacity, self.max_rank = int(capacity), int(max_rank)
        config = LoraConfig(r=self.max_rank, lora_alpha=self.max_rank, target_modules=targets)
        one = add_lora(base, config, key=jax.random.key(0))
        bank = stack_adapters({f"slot{k}": one for k in range(self.capacity)})
        zero = {id(x) for x in _branch_arrays(bank)}
        self.model = jax.tree.map(lambda x: jnp.zeros_like(x) if id(x) in zero else x, bank)
        self.layers = modules(self.model, MultiLoraLinear)  # dotted name → (path, stacked)
        self.names: list[str | None] = [None] * self.capacity
        self.scalings = np.zeros((self.capacity,), np.float32)

    @property
    def base(self) -> Any:
        """The bare base (the bank's branches dropped)."""
        return unload(self.model)

    def free(self) -> int | None:
        """A free slot's index, or None when all are taken."""
        return next((k for k, n in enumerate(self.names) if n is None), None)

    def check(self, lora_model: Any) -> dict[str, LoraLinear]:
        """The adapter's layers, refused (ValueError, the fix in it) when the bank cannot
        hold them: a rank above `max_rank`, a layer the bank has no room on, other shapes."""
        layers = lora_layers(lora_model)
        for name, layer in layers.items():
            if layer.r > self.max_rank:
                raise ValueError(
                    f"the adapter's rank {layer.r} (at {name!r}) is above the server's max LoRA rank "
                    f"{self.max_rank}; restart it with a larger --max-lora-rank"
                )
            if name not in self.layers:
                raise ValueError(
                    f"the adapter targets {name!r}, where the server holds no adapter room (it holds "
                    f"{sorted(self.layers)[:3]}...); restart it with that layer among its LoRA targets (--lora-targets)"
                )
            bank = node_at(self.model, self.layers[name][0])
            stacked = self.layers[name][1]
            want = (*bank.lora_A.shape[:stacked], bank.in_features, layer.r)
            if layer.lora_A.shape != want or layer.lora_B.shape[-1] != bank.out_features:
                raise ValueError(
                    f"the adapter's branch at {name!r} has shapes {layer.lora_A.shape} / {layer.lora_B.shape}, "
                    "not those of the served base: load adapters trained on this base model"
                )
        return layers

    def write(self, slot: int, name: str, lora_model: Any) -> None:
        """Put adapter `name` (a single-adapter LoRA model over the base) in `slot`."""
        layers = self.check(lora_model)
        scaling = float(next(iter(layers.values())).scaling)
        news = {}
        for where, (path, stacked) in self.layers.items():
            layer = layers.get(where)
            a = b = None
            if layer is not None:
                ratio = layer.scaling / scaling if scaling else 0.0
                a = np.asarray(layer.lora_A)
                b = np.asarray(layer.lora_B) * np.asarray(ratio, np.asarray(layer.lora_B).dtype)
            news[path] = self._slot_arrays(node_at(self.model, path), stacked, slot, a, b)
        self._swap(news)
        self.names[slot], self.scalings[slot] = name, scaling

    def clear(self, slot: int) -> None:
        """Zero `slot` and mark it free."""
        self._swap({p: self._slot_arrays(node_at(self.model, p), s, slot, None, None) for p, s in self.layers.values()})
        self.names[slot], self.scalings[slot] = None, 0.0

    def row_scale(self, slots: np.ndarray) -> np.ndarray:
        """`[rows, capacity]`: row `i` weighs slot `slots[i]` by its scaling (-1: no adapter)."""
        scale = np.zeros((len(slots), self.capacity), np.float32)
        rows = np.flatnonzero(slots >= 0)
        scale[rows, slots[rows]] = self.scalings[slots[rows]]
        return scale

    @staticmethod
    def _slot_arrays(layer: MultiLoraLinear, stacked: int, slot: int, a, b) -> tuple[jax.Array, jax.Array]:
        """The layer's A and B with `slot` replaced by `a` / `b` zero-padded (None: zeros),
        on the host, put back where the old arrays live (same shapes: no new program)."""
        out = []
        for old, new, axis in ((layer.lora_A, a, -1), (layer.lora_B, b, -2)):
            host = np.array(old)  # a copy: the old array may still be in a running step
            index = (slice(None),) * stacked + (slot,)
            host[index] = 0
            if new is not None:
                cut = [slice(None)] * new.ndim
                cut[axis] = slice(0, new.shape[axis])
                host[index][tuple(cut)] = new.astype(host.dtype)
            out.append(jax.device_put(host, old.sharding))
        return out[0], out[1]

    def _swap(self, news: dict[tuple, tuple[jax.Array, jax.Array]]) -> None:
        paths = list(news)
        layers = [_with(node_at(self.model, p), lora_A=news[p][0], lora_B=news[p][1]) for p in paths]
        self.model = eqx.tree_at(lambda m: [node_at(m, p) for p in paths], self.model, replace=layers)


def _branch_arrays(model: Any) -> list[jax.Array]:
    out = []
    for path, _ in modules(model, MultiLoraLinear).values():
        layer = node_at(model, path)
        out += [layer.lora_A, layer.lora_B]
    return out


def adapter_folder(path: str | Path) -> Path:
    """The peft adapter folder of `path`: itself, or a `zoo finetune` run's `adapter/`."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise ValueError(
        f"{path}: no adapter_config.json there or in its adapter/ (a peft adapter folder, or a zoo finetune run)"
    )


def read_adapter(base: Any, path: str | Path) -> Any:
    """The adapter at `path` (a peft folder or a zoo run folder) on `base`, as a
    single-adapter LoRA model; ValueError (one line) for anything it cannot read."""
    from ..lora import load_adapter

    folder = adapter_folder(path)
    try:
        model, _ = load_adapter(base, folder)
        check_finite(model, where=str(folder))
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ValueError(f"adapter {folder}: {str(e).splitlines()[0]}") from None
    return model
