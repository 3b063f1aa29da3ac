"""Expert LoRA branches in peft's adapter files (`target_parameters`): transformers 5's
3-D expert parameters, one `lora.ParamWrapper` each (nested on one module: the later
parameter's wrapper around the earlier's, so its keys sit a `base_layer` higher), with
peft's per-expert layout of `lora_A` / `lora_B`; gate and up, fused in `gate_up_proj`, as
one branch (`zoo.lora._fused`'s rule, per expert)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from .._files import to_host
from .._tree import node_at
from ..hf._layout import Block
from ._apply import modules
from ._expert_layer import LoraExpertLinear
from ._fused import _fuse, _unfuse
from ._peft_config import PREFIX, _peft_scaling


def _table(model: Any, names: Any, what: str) -> tuple[str, dict[str, tuple[str, int | None]]]:
    """The family's transformers-5 expert parameters (`lora_experts`, `lora_expert_parameters`),
    or a `ValueError` saying why an expert adapter cannot be written or read here."""
    family = None if names is None else names.family
    table = getattr(family, "lora_expert_parameters", None)
    if table is None:
        raise ValueError(
            f"{what} LoRA on the experts of this {type(model).__name__}: an expert adapter is written under the "
            "Hugging Face parameter names peft uses (transformers 5's mlp.experts.gate_up_proj / down_proj), and no "
            "zoo.hf mixture-of-experts family (mixtral, qwen3_moe) describes this model"
        )
    return family.lora_experts, table


def _key(container: str, position: int, count: int, leaf: str) -> str:
    """peft's file key of the `position`-th of `count` wrapped parameters of one module:
    the last one wraps the module itself, each earlier one sits a `base_layer` deeper."""
    return f"{PREFIX}{container}{'.base_layer' * (count - 1 - position)}.{leaf}.weight"


def _groups(model: Any, names: Any, what: str) -> tuple[str, list[tuple[str, dict[int | None, str]]]]:
    """`(container, [(parameter, {block: zoo name})])` of `model`'s expert branches, the
    parameters in the module's order."""
    container, table = _table(model, names, what)
    found = modules(model, LoraExpertLinear)
    groups: dict[str, dict[int | None, str]] = {}
    for param, _ in table.values():
        groups.setdefault(param, {})
    for name in found:
        param, block = table[name.rsplit(".", 1)[-1]]
        groups[param][block] = name
    return container, [(p, g) for p, g in groups.items() if g]


def expert_tensors(
    model: Any, config: Any, names: Any
) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, float], list[str]]:
    """The expert branches as peft's file holds them: per layer and targeted parameter,
    `lora_A` `[experts·R, in]` (expert-major rows: expert `e`'s A is rows `e·R …`) and
    `lora_B` `[out, R·experts]` (rank-major columns: `B.reshape(out, R, experts)[..., e]`),
    torch's orientation; gate and up, fused in `gate_up_proj`, as one branch of rank
    `R = m·r` (A's stacked, B block-diagonal). Also the `rank_pattern` / `alpha_pattern`
    that keep peft's scaling zoo's, and the `target_parameters`."""
    found = modules(model, LoraExpertLinear)
    if not found:
        return {}, {}, {}, []
    container, groups = _groups(model, names, "saving")
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for position, (param, parts) in enumerate(groups):
        layers = {blk: node_at(model, found[n][0]) for blk, n in parts.items()}
        host = {blk: (to_host(layer.lora_A), to_host(layer.lora_B)) for blk, layer in layers.items()}
        first = next(iter(host.values()))[0]
        stacked = first.ndim - 3
        for idx in np.ndindex(first.shape[:stacked]):
            a_rows, b_cols = [], []
            for e in range(first.shape[stacked]):
                one = {blk or 0: (a[idx][e].T, b[idx][e].T) for blk, (a, b) in host.items()}
                if None in parts:
                    a_e, b_e = one[0]
                else:
                    width = next(iter(one.values()))[1].shape[0]
                    a_e, b_e = _fuse(one, Block(0, (width, width)))
                a_rows.append(a_e)
                b_cols.append(b_e)
            rank = a_rows[0].shape[0]
            module = container.format(*idx)
            # C order: safetensors writes an array's memory as it lies (the transposes are F order).
            a_file, b_file = np.concatenate(a_rows, axis=0), np.stack(b_cols, axis=-1).reshape(-1, rank * len(b_cols))
            tensors[_key(module, position, len(groups), "lora_A")] = np.ascontiguousarray(a_file)
            tensors[_key(module, position, len(groups), "lora_B")] = np.ascontiguousarray(b_file)
            if rank != config.r:
                if config.use_rslora:
                    raise ValueError(
                        "use_rslora with LoRA on both gate and up of the experts: peft writes them as one branch of "
                        "rank 2r on gate_up_proj, whose scaling rsLoRA cannot keep zoo's (peft refuses rank_pattern "
                        "with use_rslora); drop use_rslora or target one of them"
                    )
                ranks[f"{module}.{param}"] = rank
                alphas[f"{module}.{param}"] = config.scaling * rank
    suffix = container.split("}.", 1)[-1]
    return tensors, ranks, alphas, [f"{suffix}.{p}" for p, _ in groups]


def expert_values(
    model: Any, tensors: dict[str, np.ndarray], values: dict[str, Any], config: Any, names: Any, where: Any
) -> tuple[list[tuple], list[jax.Array], dict[str, np.ndarray]]:
    """The new `lora_A` / `lora_B` of `model`'s expert branches from peft's file tensors
    (`expert_tensors`' layout; one peft branch of rank r on `gate_up_proj` gives gate and
    up the same A, B split by rows; a block-structured rank-2r one as zoo writes it splits
    back), checked key by key; returns `(paths, values, the other tensors)`."""
    found = modules(model, LoraExpertLinear)
    if not found:
        return [], [], tensors
    container, groups = _groups(model, names, "loading")
    rest = dict(tensors)
    paths, new = [], []
    problems: list[str] = []
    for position, (param, parts) in enumerate(groups):
        layers = {blk: node_at(model, found[n][0]) for blk, n in parts.items()}
        first = next(iter(layers.values()))
        stacked = first.lora_A.ndim - 3
        experts, n_in = first.lora_A.shape[stacked : stacked + 2]
        outs = {blk: layer.lora_B.shape[-1] for blk, layer in layers.items()}
        a_new = {blk: np.zeros(layer.lora_A.shape, np.float32) for blk, layer in layers.items()}
        b_new = {blk: np.zeros(layer.lora_B.shape, np.float32) for blk, layer in layers.items()}
        total = sum(outs.values()) if None in parts else 2 * next(iter(outs.values()))
        for idx in np.ndindex(first.lora_A.shape[:stacked]):
            module = container.format(*idx)
            ka, kb = (_key(module, position, len(groups), leaf) for leaf in ("lora_A", "lora_B"))
            if ka not in rest or kb not in rest:
                problems.append(f"missing {ka if ka not in rest else kb}")
                continue
            a, b = rest.pop(ka), rest.pop(kb)
            rank = a.shape[0] // experts
            if a.shape != (rank * experts, n_in) or b.shape != (total, rank * experts) or rank == 0:
                problems.append(
                    f"{ka}: {list(a.shape)} and {list(b.shape)}, expected [{experts}·R, {n_in}] and [{total}, R·{experts}]"
                )
                continue
            scaling = _peft_scaling(values, f"{module}.{param}", rank)
            if not math.isclose(scaling, config.scaling, rel_tol=1e-9):
                problems.append(f"{module}.{param}: rank {rank}, scaling {scaling}, zoo's is {config.scaling}")
                continue
            a3, b3 = a.reshape(experts, rank, n_in), b.reshape(total, rank, experts)
            for e in range(experts):
                if None in parts:
                    if rank != config.r:
                        problems.append(f"{module}.{param}: rank {rank}, zoo's branches have r={config.r}")
                        break
                    split = {None: (a3[e], b3[:, :, e])}
                else:
                    width = total // 2
                    block, what = Block(0, (width, width)), f"{module}.{param}"
                    split = _unfuse(a3[e], b3[:, :, e], sorted(parts), block, config.r, what, f"{where}: {what}")
                for blk in parts:
                    a_new[blk][idx][e], b_new[blk][idx][e] = split[blk][0].T, split[blk][1].T
        for blk, n in parts.items():
            for leaf, value in (("lora_A", a_new[blk]), ("lora_B", b_new[blk])):
                old = getattr(layers[blk], leaf)
                paths.append(found[n][0] + (GetAttrKey(leaf),))
                value = value.astype(old.dtype)
                sharding = old.sharding if isinstance(old, jax.Array) else None
                new.append(jnp.asarray(value) if sharding is None else jax.device_put(value, sharding))
    if problems:
        raise ValueError(
            f"the expert branches in {where} do not fit this {type(model).__name__}: " + "; ".join(problems[:6])
        )
    return paths, new, rest
