"""A fixed number of adapter slots beside a base, filled and emptied while serving.

The bank is the base with a `MultiLoraLinear` (zoo.lora's stacked branches) on every layer an
adapter may target, `capacity` branches of `max_rank` each, zero when free. Its static
metadata (names, ranks, scalings) never changes: loading an adapter writes its A and B
(zero-padded to `max_rank`, each layer's scaling relative to the adapter's folded into B)
into a free slot's rows of the same arrays, so the engine's compiled programs serve it as
they are. Each row of a batch picks its slot through `row_scale` `[rows, capacity]`
(the slot's scaling at its adapter, zeros for the bare base), bound as data by
`bind_rows`. On a mixture of experts the bank also holds room on expert weights (peft's
`target_parameters`) when asked: a `MultiLoraExpertLinear` per expert projection, filled
the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._finite import NonFiniteWeightsError
from .._tree import node_at
from ..lora import (
    LoraConfig,
    LoraExpertLinear,
    LoraLinear,
    MultiLoraExpertLinear,
    MultiLoraLinear,
    add_lora,
    is_adapter,
    modules,
    stack_adapters,
    unload,
)
from ..lora._apply import _with
from ..nn import Experts

BANKED = (MultiLoraLinear, MultiLoraExpertLinear)  # the layers holding the slots' branches
DEFAULT_MAX_ADAPTERS = 4  # adapter slots when adapters are served and max_adapters is not given
DEFAULT_MAX_LORA_RANK = 16


def bind_rows(model: Any, row_scale: jax.Array) -> Any:
    """`model` with every bank layer using `row_scale` `[rows, capacity]` (row `i`'s adapter
    weight per slot), broadcast over stacked layer axes. Traceable: one program for any mix."""
    found = modules(model, BANKED)
    paths = [p for p, _ in found.values()]

    def bind(layer: MultiLoraLinear | MultiLoraExpertLinear, stacked: int) -> MultiLoraLinear | MultiLoraExpertLinear:
        lead = layer.lora_A.shape[:stacked]
        return _with(layer, row_scale=jnp.broadcast_to(row_scale, (*lead, *row_scale.shape)))

    new = [bind(node_at(model, p), s) for p, s in found.values()]
    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)


def lora_layers(model: Any) -> dict[str, LoraLinear | LoraExpertLinear]:
    """The `LoraLinear` (and expert `LoraExpertLinear`) layers of a single-adapter model, by
    dotted name; a clear refusal of an adapter kind the bank cannot hold (DoRA, merged,
    embedding LoRA, trainable tokens)."""
    out = {}
    for name, (path, _) in modules(model, is_adapter).items():
        layer = node_at(model, path)
        if not isinstance(layer, LoraLinear | LoraExpertLinear):
            raise ValueError(
                f"the adapter has a {type(layer).__name__} at {name!r}: served adapters are plain LoRA on Linear "
                "layers and expert weights (no embedding LoRA, trainable tokens or stacked named adapters)"
            )
        if layer.use_dora or layer.merged:
            kind = "DoRA" if layer.use_dora else "merged"
            raise ValueError(f"the adapter is {kind} at {name!r}: served adapters are plain, unmerged LoRA")
        out[name] = layer
    if not out:
        raise ValueError("the model carries no LoRA branch: give a model from zoo.lora.add_lora or load_adapter")
    return out


class AdapterBank:
    """`capacity` adapter slots of rank up to `max_rank` on `base`'s `targets` layers (and,
    on a mixture of experts, its `parameters` expert weights).

    `model` is the base with the bank's layers (every slot zero until `write`);
    `names[k]` the adapter in slot `k` (None: free); `scalings[k]` its scaling (data the
    engine puts in `row_scale`). `write` and `clear` swap in new arrays of the same shapes.
    `targets` is `LoraConfig.target_modules` (empty: no `Linear` room), `parameters` its
    `target_parameters` (None: no expert room).
    """

    def __init__(self, base: Any, *, capacity: int, max_rank: int, targets: Any = "all-linear", parameters=None):
        if capacity < 1:
            raise ValueError(f"max_adapters must be >= 1 to hold adapters, got {capacity}")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.capacity, self.max_rank = int(capacity), int(max_rank)
        config = LoraConfig(
            r=self.max_rank, lora_alpha=self.max_rank, target_modules=targets or [], target_parameters=parameters
        )
        one = add_lora(base, config, key=jax.random.key(0))
        experts = {n: node_at(one, p).base for n, (p, _) in modules(one, LoraExpertLinear).items()}
        if experts and any(node_at(base, p).dispatch == "sorted" for p, _ in modules(base, Experts).values()):
            raise ValueError(
                "expert LoRA room needs the dense token dispatch: the sorted one computes every row with one folded "
                "weight, and the bank's rows use different adapters. Serve a model built with "
                "TransformerConfig(moe_dispatch='dense') (the default, and zoo.hf.from_pretrained's)"
            )
        plain = unload(one) if not modules(one, LoraLinear) else None
        bank = plain if plain is not None else stack_adapters({f"slot{k}": _linears(one) for k in range(capacity)})
        zero = {id(x) for x in _branch_arrays(bank)}
        bank = jax.tree.map(lambda x: jnp.zeros_like(x) if id(x) in zero else x, bank)
        found = modules(one, LoraExpertLinear)
        rooms = [
            MultiLoraExpertLinear(experts[n], self.capacity, self.max_rank, lead=experts[n].weight.shape[:stacked])
            for n, (_, stacked) in found.items()
        ]
        paths = [p for p, _ in found.values()]
        self.model = eqx.tree_at(lambda m: [node_at(m, p) for p in paths], bank, replace=rooms) if rooms else bank
        self.layers = modules(self.model, BANKED)  # dotted name → (path, stacked)
        self.names: list[str | None] = [None] * self.capacity
        self.scalings = np.zeros((self.capacity,), np.float32)

    @property
    def base(self) -> Any:
        """The bare base (the bank's branches dropped)."""
        return unload(self.model)

    def free(self) -> int | None:
        """A free slot's index, or None when all are taken."""
        return next((k for k, n in enumerate(self.names) if n is None), None)

    def check(self, lora_model: Any, *, where: str = "the adapter") -> dict[str, LoraLinear | LoraExpertLinear]:
        """The adapter's layers, refused (ValueError, the fix in it) when the bank cannot
        hold them: a rank above `max_rank`, a layer or expert weight the bank has no room
        on, other shapes; `NonFiniteWeightsError` (a ValueError starting with `where`) for a
        branch holding NaN or inf. The branches are read on the host, small: loading an
        adapter into a running engine compiles no program."""
        layers = lora_layers(lora_model)
        for name, layer in layers.items():
            if layer.r > self.max_rank:
                raise ValueError(
                    f"the adapter's rank {layer.r} (at {name!r}) is above the server's max LoRA rank "
                    f"{self.max_rank}; restart it with a larger --max-lora-rank"
                )
            if name not in self.layers:
                if isinstance(layer, LoraExpertLinear):
                    raise ValueError(
                        f"the adapter has LoRA on the expert weights {name!r} (target_parameters), where the server "
                        "holds no adapter room; restart it with room there: lora_parameters=[...] (zoo serve "
                        f"--lora-parameters gate+up+down), or serve this adapter from the start (adapters=)"
                    )
                raise ValueError(
                    f"the adapter targets {name!r}, where the server holds no adapter room (it holds "
                    f"{sorted(self.layers)[:3]}...); restart it with that layer among its LoRA targets (--lora-targets)"
                )
            path, stacked = self.layers[name]
            bank = node_at(self.model, path)
            shape = bank.lora_A.shape  # [*layers, K, (experts,) in, r]
            want = (*shape[:stacked], *shape[stacked + 1 : -1], layer.r)
            if layer.lora_A.shape != want or layer.lora_B.shape[-1] != bank.lora_B.shape[-1]:
                raise ValueError(
                    f"the adapter's branch at {name!r} has shapes {layer.lora_A.shape} / {layer.lora_B.shape}, "
                    "not those of the served base: load adapters trained on this base model"
                )
            for field in ("lora_A", "lora_B"):
                values = np.asarray(getattr(layer, field))
                if not np.isfinite(values).all():
                    raise NonFiniteWeightsError(
                        f"{where}: its LoRA weight {field} at {name!r} holds NaN or inf "
                        f"({int((~np.isfinite(values)).sum())} of its {values.size} values), so every request it "
                        "serves would generate from NaN logits; it was saved from a diverged run or is damaged: "
                        "use another checkpoint of it"
                    )
        return layers

    def write(self, slot: int, name: str, lora_model: Any) -> None:
        """Put adapter `name` (a single-adapter LoRA model over the base) in `slot`."""
        layers = self.check(lora_model, where=f"adapter {name!r}")
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
    def _slot_arrays(
        layer: MultiLoraLinear | MultiLoraExpertLinear, stacked: int, slot: int, a, b
    ) -> tuple[jax.Array, jax.Array]:
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


def _linears(model: Any) -> Any:
    """`model` with its expert branches dropped (its `Linear` branches kept)."""
    found = modules(model, LoraExpertLinear)
    paths = [p for p, _ in found.values()]
    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=[node_at(model, p).base for p in paths])


def _branch_arrays(model: Any) -> list[jax.Array]:
    out = []
    for path, _ in modules(model, MultiLoraLinear).values():
        layer = node_at(model, path)
        out += [layer.lora_A, layer.lora_B]
    return out


def build_bank(model, adapters: dict, max_adapters, max_lora_rank, targets, parameters) -> AdapterBank | None:
    """The engine's adapter slots holding `adapters` (None: no slots asked for). Expert room
    (`parameters`, None): the expert weights the `adapters` given have branches on."""
    if not adapters and not max_adapters:
        return None
    if modules(model, is_adapter):
        raise ValueError(
            "serve adapters over the bare base: the engine's model already carries LoRA branches; pass "
            "zoo.lora.unload(model) as the model and the adapter models in adapters={name: model}"
        )
    adapters = {n: read_adapter(model, m) if isinstance(m, str | os.PathLike) else m for n, m in adapters.items()}
    layers = [(n, layer) for m in adapters.values() for n, layer in lora_layers(m).items()]
    capacity = max(DEFAULT_MAX_ADAPTERS, len(adapters)) if max_adapters is None else int(max_adapters)
    if capacity < len(adapters):
        raise ValueError(f"max_adapters={capacity} cannot hold the {len(adapters)} adapters given; raise it")
    rank = max([DEFAULT_MAX_LORA_RANK, *(x.r for _, x in layers)]) if max_lora_rank is None else int(max_lora_rank)
    if parameters is None:  # the expert weights the adapters given adapt, if any
        parameters = sorted({n for n, x in layers if isinstance(x, LoraExpertLinear)}) or None
    bank = AdapterBank(model, capacity=capacity, max_rank=rank, targets=targets, parameters=parameters)
    for k, (name, lora_model) in enumerate(adapters.items()):
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        bank.write(k, name, lora_model)
    return bank


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
        model, _ = load_adapter(base, folder)  # its branches' values: AdapterBank.check
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ValueError(f"adapter {folder}: {str(e).splitlines()[0]}") from None
    return model
