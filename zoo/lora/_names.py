"""Module names: zoo attribute paths, their layer counts, and their Hugging Face / peft
names (from the `zoo.hf` family registry, through `zoo.hf._peft.adapter_names`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from .._tree import child, child_named, key_path
from ..nn import Stacked


def lead_at(model: Any, path: tuple) -> tuple[int, ...]:
    """The layer counts of the `Stacked` modules the key path `path` passes through."""
    lead: list[int] = []
    node = model
    for key in path:
        if isinstance(node, Stacked):
            lead.append(node.num_layers)
        node = child(node, key)
    return tuple(lead)


def lead(model: Any, name: str) -> tuple[int, ...]:
    """The layer counts of the `Stacked` levels above module `name`."""
    return lead_at(model, key_path(model, name))


def generic_name(model: Any, name: str, index: tuple[int, ...]) -> str:
    """The zoo name with each `Stacked`'s `layers` attribute replaced by its layer number."""
    parts: list[str] = []
    node, rest = model, list(index)
    for part in name.split(".") if name else []:
        if isinstance(node, Stacked) and part == "layers":
            if not rest:
                raise ValueError(f"module {name!r} lies under more Stacked levels than index {index} gives")
            parts.append(str(int(rest.pop(0))))
        else:
            parts.append(part)
        node = child_named(node, part)
    if rest:
        raise ValueError(f"module {name!r} lies under fewer Stacked levels than index {index} gives")
    return ".".join(parts)


def adapter_names(model: Any) -> Any:
    """`zoo.hf`'s peft naming of `model` (an `AdapterNames`), or `None` when no Hugging
    Face family describes it."""
    from ..hf._peft import (
        adapter_names as lookup,  # zoo.hf imports zoo.models; imported late
    )

    return lookup(model)


def hf_module_name(model: Any, name: str, index: tuple[int, ...] = ()) -> str:
    """The Hugging Face / peft name of zoo module `name` (layer `index` if stacked) of `model`.

    `name` is a dotted zoo path as `zoo.lora.modules` reports it (e.g.
    `layers.layers.attention.q_proj`); `index` holds one layer number per `Stacked` above
    the module. Models of a `zoo.hf` family take the family's names (a `Transformer` as
    GPT-2 → `transformer.h.{i}.attn.c_attn`, as Llama → `model.layers.{i}.self_attn.q_proj`;
    an `Encoder` as `BertModel`; an `EncoderClassifier` as
    `BertForSequenceClassification`); others get the zoo name with the layer numbers in
    place of each `Stacked`'s `layers` attribute (`hidden.layers.linear` → `hidden.0.linear`).
    """
    generic = generic_name(model, name, index)  # also checks `index` against the stacking
    names = adapter_names(model)
    hf = None if names is None else names.module(name, index)
    return generic if hf is None else hf


def hf_parameters(model: Any, name: str) -> list[str]:
    """The Hugging Face names (peft's `target_parameters` keys) of expert module `name` at
    every layer (`model.layers.{i}.mlp.experts.gate_up_proj`), or `[]` without a family."""
    names = adapter_names(model)
    table = getattr(getattr(names, "family", None), "lora_expert_parameters", None)
    projection = name.rsplit(".", 1)[-1]
    if table is None or projection not in table:
        return []
    container = names.family.lora_experts
    return [f"{container.format(*idx)}.{table[projection][0]}" for idx in np.ndindex(lead(model, name))]


def layer_names(model: Any, name: str) -> list[str]:
    """The HF / peft names of module `name` at every layer of its stack."""
    return [hf_module_name(model, name, idx) for idx in np.ndindex(lead(model, name))]


def matches(name: str, patterns: tuple[str, ...] | str | None) -> bool:
    """peft's rule: a list matches a name equal to an entry or ending in `.entry`; a
    string is a regex over the whole name."""
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def saves(name: str, patterns: tuple[str, ...] | None) -> bool:
    """peft's `modules_to_save` rule since peft 0.22 (its `_is_valid_match`): a name equal
    to an entry or ending in `.entry`, as `target_modules`' list entries match (`"norm"`
    matches `model.norm`, not `model.layers.0.input_layernorm`)."""
    return patterns is not None and matches(name, tuple(patterns))


def saved_by_older_peft(name: str, patterns: tuple[str, ...] | None) -> bool:
    """peft's `modules_to_save` rule up to 0.21: a name ending with an entry as a plain
    string (`"norm"` matched each layer's `input_layernorm` too). An adapter those
    versions saved holds every module this rule picked."""
    return patterns is not None and any(name.endswith(p) for p in patterns)


def select(
    model: Any,
    names: list[str],
    patterns: Any,
    what: str,
    *,
    rule: Callable[[str, Any], bool] = matches,
    zoo_names: bool = True,
) -> list[str]:
    """The zoo modules among `names` that `patterns` picks under `rule` (`matches` for
    `target_modules`, `saves` for `modules_to_save`): by their zoo name (unless
    `zoo_names=False`, for names peft wrote) or by their HF / peft names at every layer.
    Raises when the HF names of only some layers of a stacked module match (zoo stores a
    stack's layers as one module: it adapts or saves all of them or none)."""
    out = []
    for name in names:
        if zoo_names and rule(name, patterns):
            out.append(name)
            continue
        hf = layer_names(model, name)
        hits = [rule(n, patterns) for n in hf]
        if all(hits):
            out.append(name)
        elif any(hits):
            raise ValueError(
                f"{what} {patterns!r} match only some layers of the stacked module {name!r} "
                f"({[n for n, h in zip(hf, hits, strict=True) if h]}); zoo stores a stack's layers as one "
                "module, so it adapts or saves a module at all of them or at none: name it at every layer "
                "(an adapter peft made for some layers only does not load into zoo)"
            )
    return out
