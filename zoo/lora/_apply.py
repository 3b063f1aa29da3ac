"""Adding LoRA branches to a zoo model by tree surgery; trainability; merging."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PRNGKeyArray

from .._mismatch import shorten
from .._tree import dotted_name, is_array_like, node_at
from ..nn import Embedding, ExpertLinear, FourBitLinear, Linear, QuantizedLinear, Stacked, dequantize
from ._config import MUTATING, LoraConfig
from ._embedding import LoraEmbedding
from ._expert_layer import LoraExpertLinear
from ._layer import LoraLinear, mutated_init
from ._multi_expert import MultiLoraExpertLinear
from ._multi_linear import MultiLoraLinear
from ._names import hf_parameters, layer_names, matches, saves, select
from ._tokens import TrainableTokens

# `"all-linear"` leaves these out, as peft leaves out the output layer.
OUTPUT_LAYERS = ("lm_head", "head", "output_layer")
# ... and a mixture of experts' router (`zoo.nn.Experts.router`), zoo's choice: peft's
# "all-linear" takes it (transformers 4's `gate` Linear; on transformers 5, `gate.weight`).
NOT_ALL_LINEAR = (*OUTPUT_LAYERS, "router")

# The layers a branch can wrap: a float `Linear` or its int8 form; an `Embedding` when named.
LINEARS = (Linear, QuantizedLinear, FourBitLinear)
QUANTIZED = (QuantizedLinear, FourBitLinear)  # frozen bases stored in int8 or 4 bits
# The layers carrying a branch.
ADAPTED = (LoraLinear, LoraEmbedding, TrainableTokens, MultiLoraLinear, LoraExpertLinear, MultiLoraExpertLinear)
AdapterLayer = LoraLinear | LoraEmbedding | TrainableTokens | MultiLoraLinear | LoraExpertLinear | MultiLoraExpertLinear
# The name of a tied output head (the token embedding itself), as peft names it.
TIED_HEAD = "lm_head"


def is_adapter(x: Any) -> bool:
    """Whether `x` is an adapter wrapper: a layer carrying adapter weights beside the frozen
    base it wraps (`LoraLinear`, `LoraEmbedding`, `TrainableTokens`, `MultiLoraLinear`,
    `LoraExpertLinear`, `MultiLoraExpertLinear`)."""
    return isinstance(x, ADAPTED)


def modules(model: Any, kind: Any = (Linear, LoraLinear)) -> dict[str, tuple[tuple, int]]:
    """Dotted name → (key path, number of `Stacked` levels above it) of every `kind` module.

    `kind` is a type, a tuple of types or a predicate (e.g. `is_adapter`). Names are
    attribute paths, e.g. `layers.layers.attention.q_proj` (layers stacked for `lax.scan`
    share one module, whose arrays carry a leading `layers` axis).
    """
    found: dict[str, tuple[tuple, int]] = {}
    is_target = (lambda node: isinstance(node, kind)) if isinstance(kind, type | tuple) else kind
    _walk(model, (), 0, is_target, found)
    return found


def _walk(node: Any, path: tuple, stacked: int, is_target: Callable[[Any], bool], found: dict) -> None:
    """`modules`' search below `node` (at key path `path`, under `stacked` `Stacked`s)."""
    if is_target(node):
        found[dotted_name(path)] = (path, stacked)
        return
    if isinstance(node, ADAPTED):
        return  # an adapted layer's `base` is not a target of its own
    if isinstance(node, Stacked):
        stacked += 1
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    for key_path, child in children:
        if isinstance(child, eqx.Module | list | tuple | dict):
            _walk(child, path + key_path, stacked, is_target, found)


def disabled_adapters(model: Any) -> Any:
    """The model the adapters were added to (peft's `disable_adapter()`).

    **Arguments:**

    - `model`: a model holding adapter wrappers (`is_adapter`).

    **Returns:** `model` with every adapter wrapper replaced by its frozen base (after a
    PiSSA/OLoRA initialisation, as in peft, the residual base), sharing its arrays, no
    copy. A `ValueError` for a model with no adapter, and for a merged adapter, whose
    base already holds it.
    """
    if not modules(model, is_adapter):
        raise ValueError(
            f"this {type(model).__name__} has no adapters to disable (no LoRA layer, LoRA embedding or trainable "
            "tokens): add them with zoo.lora.add_lora, or use the model itself"
        )

    def base_of(x):
        if not is_adapter(x):
            return x
        if getattr(x, "merged", False):
            raise ValueError(
                f"a merged {type(x).__name__} cannot be disabled: its base weight already holds the adapter; "
                "disable the adapters before merging (zoo.lora.merge), or keep them unmerged while training"
            )
        return x.base

    return jax.tree.map(base_of, model, is_leaf=is_adapter)


def target_names(model: Any, config: LoraConfig) -> list[str]:
    """The names of the `Linear` layers `config` targets in `model` (errors if none).

    `target_modules` and `exclude_modules` match zoo names (`q_proj`,
    `layers.layers.mlp.up`) or, for models of a `zoo.hf` family, the Hugging Face / peft
    names of the module at every layer (`query`, `c_attn`, `gate_proj`,
    `model.layers.0.self_attn.q_proj`): a fused HF module (GPT-2's `c_attn`) picks each of
    its zoo parts (`q_proj`, `k_proj`, `v_proj`).
    """
    linears = modules(model, LINEARS)
    if not config.target_modules:  # the experts alone (`target_parameters`; the config checked that)
        return []
    if config.target_modules == "all-linear":
        chosen = [n for n in linears if n.split(".")[-1] not in NOT_ALL_LINEAR]
    else:
        experts = select(model, list(modules(model, ExpertLinear)), config.target_modules, "LoRA target_modules")
        if experts:  # never silently left out: a user who names the experts means to train them
            raise ValueError(
                f"LoRA target_modules={config.target_modules!r} name the stacked expert projections {experts} "
                "(zoo.nn.ExpertLinear of a mixture of experts), which are 3-D parameters, not Linear layers: name "
                "them in target_parameters, as peft does (e.g. target_parameters=['mlp.experts.gate_up_proj', "
                "'mlp.experts.down_proj'], or zoo's 'gate', 'up', 'down'), and leave them out of target_modules"
            )
        # Embeddings are targets too when named (peft's `lora_embedding_A/B`), never by "all-linear".
        candidates = list(linears) + list(modules(model, Embedding))
        chosen = select(model, candidates, config.target_modules, "LoRA target_modules")
    if config.exclude_modules is not None:
        excluded = set(select(model, chosen, config.exclude_modules, "LoRA exclude_modules"))
        chosen = [n for n in chosen if n not in excluded]
    if not chosen:
        adapted = sorted(modules(model, ADAPTED))
        already = f" These already carry LoRA branches: {adapted}." if adapted else ""
        raise ValueError(
            f"LoRA target_modules={config.target_modules!r} (exclude_modules={config.exclude_modules!r}) "
            f"match no Linear layer of this {type(model).__name__}. Its Linear layers are: "
            f"{sorted(linears)}{_hf_suffixes(model, linears)}.{already} Name them by suffix (e.g. 'q_proj', or "
            "the Hugging Face name such as 'query' or 'c_attn'), by a regex over the whole name, or use 'all-linear'."
        )
    return chosen


def _hf_suffixes(model: Any, linears: Any) -> str:
    """`", as Hugging Face names them: [...]"` (each module's last name part) where a model's
    adapters are written under other names than zoo's (a `zoo.hf` family's; a `Transformer`
    as Llama: `gate_proj` for `mlp.gate`); else `""`."""
    zoo_names = {n.rsplit(".", 1)[-1] for n in linears}
    hf = {h.rsplit(".", 1)[-1] for n in linears for h in layer_names(model, n)}
    return f", as Hugging Face names them: {sorted(hf)}" if hf - zoo_names else ""


def expert_targets(model: Any, config: LoraConfig) -> list[str]:
    """The names of the expert projections (`zoo.nn.ExpertLinear`) `config.target_parameters`
    picks in `model`: by zoo name (`"down"`, `"layers.layers.mlp.up"`) or by the
    transformers-5 parameter at every layer, as peft matches `target_parameters`
    (`"mlp.experts.gate_up_proj"`: gate and up). An entry that picks nothing is an error."""
    wanted = config.target_parameters
    if not wanted:
        return []
    experts = list(modules(model, (ExpertLinear, LoraExpertLinear)))
    hf = {name: hf_parameters(model, name) for name in experts}

    def picks(name: str, entries: tuple[str, ...]) -> bool:
        return matches(name, entries) or bool(hf[name]) and all(matches(n, entries) for n in hf[name])

    idle = [entry for entry in wanted if not any(picks(n, (entry,)) for n in experts)]
    if idle:
        example = sorted({n.split(".", 3)[-1] for names in hf.values() for n in names[:1]})
        router = [e for e in idle if e.endswith("gate.weight")]
        why = (
            f" ({router[0]!r} is the router's weight, which peft's 'all-linear' adds on a transformers-5 "
            "mixture of experts: zoo adapts its router as a Linear, target_modules=['router'] or the HF module name)"
            if router
            else ""
        )
        raise ValueError(
            f"LoRA target_parameters entries {idle} match no expert weight of this {type(model).__name__}{why}. "
            f"Its expert projections are {experts or 'none (no mixture of experts)'}"
            + (f", as Hugging Face parameters {example}" if example else "")
            + ": name them by zoo name or Hugging Face parameter name"
        )
    return [n for n in experts if picks(n, wanted)]


def tied_head(model: Any, config: LoraConfig) -> bool:
    """Whether `config` adapts `model`'s tied output head with its token embedding: the
    model's head is its token embedding (`lm_head` is `None`) and `target_modules` lists
    `"lm_head"` (peft's name), with `ensure_weight_tying` (else peft would give the head an
    adapter of its own, which a tied head cannot hold: refused)."""
    if getattr(model, TIED_HEAD, "absent") is not None or not hasattr(model, "token_embedding"):
        return False
    if isinstance(config.target_modules, str) or TIED_HEAD not in config.target_modules:
        return False
    if not config.ensure_weight_tying:
        raise ValueError(
            f"target_modules names {TIED_HEAD!r}, but this {type(model).__name__}'s head is its token embedding: "
            "set ensure_weight_tying=True (peft's option) so the head's branch is the embedding's and the two stay "
            "one weight (without it peft gives the tied head an adapter of its own)"
        )
    if "token_embedding" not in target_names(model, config):
        raise ValueError(
            f"ensure_weight_tying: the tied {TIED_HEAD!r} is the token embedding; target it too (its Hugging Face "
            "name, e.g. 'embed_tokens' or 'wte', or 'token_embedding')"
        )
    return True


def add_lora(model: Any, config: LoraConfig, *, key: PRNGKeyArray) -> Any:
    """`model` with a `LoraLinear` branch around every targeted `Linear`; base weights untouched.

    Works on any zoo model, including layers stacked for `lax.scan` (their A and B gain the
    same leading `layers` axis: `[L, in, r]`, `[L, r, out]`). Train only the branches (and
    `config.modules_to_save`) with `zoo.TrainStep(..., trainable=zoo.lora.trainable(model, config))`.
    """
    found = modules(model, LINEARS)
    names = target_names(model, config)
    _check_modules_to_save(model, config)
    found |= modules(model, Embedding)
    tie = tied_head(model, config)
    new = []
    for i, name in enumerate(names):
        path, stacked = found[name]
        base = node_at(model, path)
        if isinstance(base, Embedding):
            new.append(_embedding_branch(base, name, config, tie and name == "token_embedding", jr.fold_in(key, i)))
            continue
        wrap = functools.partial(_lora_linear, config)
        keys = jr.fold_in(key, i)
        for _ in range(stacked):  # one key per stacked layer, built like the layers were
            wrap = eqx.filter_vmap(wrap)
        lead = jax.tree.leaves(base)[0].shape[:stacked]  # the weight, or the codes of a 4-bit base
        keys = jr.split(keys, lead) if stacked else keys
        layer = eqx.tree_at(lambda layer: layer.base, wrap(base, keys), base)
        if config.init_lora_weights in MUTATING:
            layer = _mutate(layer, name, config)
        new.append(_place_branch(layer, stacked))
    experts = modules(model, ExpertLinear)
    for i, name in enumerate(expert_targets(model, config)):
        path, stacked = experts[name]
        names.append(name)
        found[name] = (path, stacked)
        new.append(_expert_branch(node_at(model, path), stacked, config, jr.fold_in(jr.fold_in(key, 0x7E7E), i)))
    paths = [found[n][0] for n in names]
    model = eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=new)
    return _add_tokens(model, config) if config.trainable_token_indices else model


def token_embedding_name(model: Any) -> str:
    """The zoo name of `model`'s token embedding (a `Transformer`'s `token_embedding`, an
    `Encoder`'s `embeddings.word_embeddings`), or an error saying there is none."""
    names = [
        n for n in modules(model, (Embedding, *ADAPTED)) if n.split(".")[-1] in ("token_embedding", "word_embeddings")
    ]
    if len(names) != 1:
        raise ValueError(
            f"trainable_token_indices trains rows of the token embedding, but this {type(model).__name__} has "
            f"{'none' if not names else names}"
        )
    return names[0]


def _add_tokens(model: Any, config: LoraConfig) -> Any:
    """The token embedding's listed rows made trainable (peft's TrainableTokens)."""
    name = token_embedding_name(model)
    path = modules(model, (Embedding, *ADAPTED))[name][0]
    base = node_at(model, path)
    if not isinstance(base, Embedding):
        raise ValueError(
            f"trainable_token_indices and a LoRA branch on {name!r} at once: peft trains one or the other on a "
            "layer; leave the embedding out of target_modules"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or base.num_embeddings
    wrong = [i for i in config.trainable_token_indices if i >= vocab]
    if wrong:
        raise ValueError(
            f"trainable_token_indices {wrong} are out of range for the vocabulary of {vocab} tokens ({name!r}): "
            f"token ids run from 0 to {vocab - 1}; add the new tokens to the tokenizer and the model first"
        )
    tie = getattr(model, TIED_HEAD, "absent") is None and name == "token_embedding"
    return eqx.tree_at(
        lambda m: node_at(m, path), model, TrainableTokens(base, config.trainable_token_indices, tie_head=tie)
    )


def _embedding_branch(base: Embedding, name: str, config: LoraConfig, tie: bool, key: PRNGKeyArray) -> LoraEmbedding:
    """The branch on an embedding, or a clear refusal of what peft's `lora.Embedding` lacks here."""
    if config.use_dora:
        raise ValueError(
            f"use_dora: zoo's DoRA wraps Linear layers only, and {name!r} is an Embedding; leave it out of "
            "target_modules or set use_dora=False"
        )
    if config.init_lora_weights in MUTATING:
        raise ValueError(
            f"init_lora_weights={config.init_lora_weights!r} decomposes Linear weights; {name!r} is an Embedding: "
            "leave it out of target_modules or use init_lora_weights=True"
        )
    layer = LoraEmbedding(base, config.r, scaling=config.scaling, init=config.init_lora_weights, tie_head=tie, key=key)
    weight = base.weight
    if isinstance(weight, jax.core.Tracer) or not isinstance(weight.sharding, NamedSharding):
        return layer
    spec = tuple(weight.sharding.spec) + (None,) * (2 - len(weight.sharding.spec))
    placed = (
        jax.device_put(layer.lora_embedding_A, NamedSharding(weight.sharding.mesh, P(spec[0], None))),
        jax.device_put(layer.lora_embedding_B, NamedSharding(weight.sharding.mesh, P(None, spec[1]))),
    )
    return eqx.tree_at(lambda l: (l.lora_embedding_A, l.lora_embedding_B), layer, placed)


def _mutate(layer: LoraLinear, name: str, config: LoraConfig) -> LoraLinear:
    """PiSSA / OLoRA: the branch from the base weight, the base keeping the residual."""
    if isinstance(layer.base, QUANTIZED):
        bits = "int8" if isinstance(layer.base, QuantizedLinear) else layer.base.kind
        raise ValueError(
            f"init_lora_weights={config.init_lora_weights!r} decomposes the base weight of {name!r}, which is {bits}: "
            f"add the branches to the float model, then store the residual base in {bits} with "
            f"zoo.lora.cast_frozen(model, {'jnp.int8' if bits == 'int8' else repr(bits)}, config=config)"
        )
    weight = layer.base.weight
    a, b, residual = mutated_init(weight, config.r, config.scaling, config.init_lora_weights)
    dtype = layer.lora_A.dtype
    return eqx.tree_at(
        lambda l: (l.lora_A, l.lora_B, l.base.weight),
        layer,
        (a.astype(dtype), b.astype(dtype), residual.astype(weight.dtype)),
    )


def branch_shardings(weight: jax.Array, stacked: int) -> tuple[Any, Any]:
    """Where the branch of a base `weight` `[*layers, in, out]` belongs: `(A's, B's)` sharding.

    On a mesh, A `[*layers, in, r]` keeps the weight's layer and input-axis sharding and B
    `[*layers, r, out]` its layer and output-axis sharding (the rank axis is whole), as
    the annotations give under the rules that placed the weight; on one device, that
    device. `(None, None)` for a traced weight.
    """
    if isinstance(weight, jax.core.Tracer):
        return None, None
    sharding = weight.sharding
    if not isinstance(sharding, NamedSharding):
        return sharding, sharding
    spec = tuple(sharding.spec) + (None,) * (weight.ndim - len(sharding.spec))
    lead, (into, out) = spec[:stacked], spec[stacked:]
    return NamedSharding(sharding.mesh, P(*lead, into, None)), NamedSharding(sharding.mesh, P(*lead, None, out))


def _place_branch(layer: LoraLinear, stacked: int) -> LoraLinear:
    """The new branch on its base weight's devices (random keys make it wherever the
    default device or an active mesh puts new arrays)."""
    a_sharding, b_sharding = branch_shardings(jax.tree.leaves(layer.base)[0], stacked)  # weight or 4-bit codes
    if a_sharding is None:
        return layer
    placed = (jax.device_put(layer.lora_A, a_sharding), jax.device_put(layer.lora_B, b_sharding))
    layer = eqx.tree_at(lambda l: (l.lora_A, l.lora_B), layer, placed)
    if layer.lora_magnitude_vector is None:
        return layer
    # DoRA's magnitude `[*layers, out]`: B's layer and output-axis sharding.
    m_sharding = b_sharding
    if isinstance(b_sharding, NamedSharding):
        spec = tuple(b_sharding.spec)
        m_sharding = NamedSharding(b_sharding.mesh, P(*spec[:stacked], spec[-1]))
    return eqx.tree_at(
        lambda l: l.lora_magnitude_vector, layer, jax.device_put(layer.lora_magnitude_vector, m_sharding)
    )


def _expert_branch(base: ExpertLinear, stacked: int, config: Any, key: PRNGKeyArray) -> LoraExpertLinear:
    """`base` (under `stacked` `Stacked` levels) with a branch of `config`'s rank, placed
    like its weight (A its expert and input axes, B its expert and output axes)."""
    if config.init_lora_weights not in (True, False, "gaussian"):
        raise ValueError(
            f"init_lora_weights={config.init_lora_weights!r} on the experts: peft's target_parameters support "
            "True, False and 'gaussian' there; use one of those"
        )

    def wrap(b, k):
        return LoraExpertLinear(b, config.r, scaling=config.scaling, init=config.init_lora_weights, key=k)

    for _ in range(stacked):
        wrap = eqx.filter_vmap(wrap)
    lead = base.weight.shape[:stacked]
    keys = jr.split(key, lead) if stacked else key
    layer = eqx.tree_at(lambda layer: layer.base, wrap(base, keys), base)
    a_sharding, b_sharding = branch_shardings(base.weight, stacked + 1)  # the expert axis leads like a layer's
    if a_sharding is None:
        return layer
    placed = (jax.device_put(layer.lora_A, a_sharding), jax.device_put(layer.lora_B, b_sharding))
    return eqx.tree_at(lambda l: (l.lora_A, l.lora_B), layer, placed)


def _check_modules_to_save(model: Any, config: LoraConfig) -> None:
    """Refuse a `config.modules_to_save` entry that picks no module of `model`."""
    if not config.modules_to_save:
        return
    names = _all_module_names(model)
    for wanted in config.modules_to_save:
        if not select(model, names, (wanted,), "LoRA modules_to_save", rule=saves):
            hf = sorted({n for name in names for n in layer_names(model, name)[:1]} - set(names))  # layer 0's
            raise ValueError(
                f"LoRA modules_to_save entry {wanted!r} matches no module of this {type(model).__name__}: an entry "
                "picks every module whose name is it or ends with .it (peft's rule), by zoo name "
                f"{sorted(names)}" + (f" or by Hugging Face name {shorten(hf, 12)}" if hf else "")
            )


def saved_modules(model: Any, config: LoraConfig | None) -> list[str]:
    """Zoo names of the outermost modules `config.modules_to_save` picks: those whose zoo
    name or (for models of a `zoo.hf` family) Hugging Face names at every layer are an
    entry or end with `.entry`, as peft 0.22 on matches them (`"classifier"`; `"norm"`
    picks `model.norm`; `"input_layernorm"` each layer's)."""
    if config is None or not config.modules_to_save:
        return []
    return outermost(
        select(model, _all_module_names(model), config.modules_to_save, "LoRA modules_to_save", rule=saves)
    )


def outermost(names: list[str]) -> list[str]:
    """`names` without those inside another of them (a saved module is saved whole)."""
    return [n for n in names if not any(n.startswith(p + ".") for p in names)]


def _all_module_names(model: Any) -> list[str]:
    names: list[str] = []

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, eqx.Module) and path:
            names.append(dotted_name(path))
        if isinstance(node, eqx.Module | list | tuple | dict):
            children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
            for key_path, child in children:
                walk(child, path + key_path)

    walk(model, ())
    return names


def trainable(model: Any, config: LoraConfig | None = None) -> Any:
    """The trainable filter of a LoRA model: `True` at every `lora_A`/`lora_B` leaf (and
    DoRA's `lora_magnitude_vector`) and at
    every leaf of `config.modules_to_save`, `False` elsewhere (a bool pytree for
    `zoo.TrainStep(trainable=...)`). The frozen base gets no gradient and no communication.
    An abstract model's leaves (`jax.ShapeDtypeStruct`) are read as the arrays they stand for."""
    saved = set(saved_modules(model, config))

    def one(path, leaf):
        if not is_array_like(leaf):
            return False
        name = dotted_name(path)
        last = name.split(".")[-1]
        if last in (
            "lora_A",
            "lora_B",
            "lora_magnitude_vector",
            "lora_embedding_A",
            "lora_embedding_B",
            "trainable_tokens_delta",
        ):
            return True
        prefix = name
        while "." in prefix:
            prefix = prefix.rsplit(".", 1)[0]
            if prefix in saved:
                return True
        return False

    return jax.tree_util.tree_map_with_path(one, model)


def _replace_lora(model: Any, fn) -> Any:
    found = modules(model, ADAPTED)
    if not found:
        return model
    paths = [p for p, _ in found.values()]
    return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, replace=[fn(node_at(model, p)) for p in paths])


def _with(layer: eqx.Module, **changes: Any) -> eqx.Module:
    """A copy of `layer` (a branch-carrying module: LoRA, embedding LoRA, trainable tokens,
    expert LoRA, the serving bank's stacked ones) with some fields (static ones too)
    replaced, without re-initialising."""
    new = object.__new__(type(layer))
    for f in dataclasses.fields(layer):
        object.__setattr__(new, f.name, changes.get(f.name, getattr(layer, f.name)))
    return new


def _fold(layer: LoraLinear | LoraExpertLinear, sign: float) -> tuple[Linear | ExpertLinear, Any]:
    """The base with the branch folded in (`sign=+1`) or taken out of a merged base
    (`sign=-1`); and, for DoRA, the column norms the merge divided by (else `None`).

    DoRA (peft's `DoraLinearVariant.merge`): `W' = m / ‖W + Δ‖ · (W + Δ)`; unmerging
    `W = W' · ‖W + Δ‖ / m - Δ` with the norms kept from the merge.
    """
    base = layer.base
    if isinstance(base, QUANTIZED):
        # W + ΔW is no int8 or 4-bit matrix: the merged layer is the dequantised float32 Linear.
        base = base.dequantize()
    weight = base.weight
    w, delta = weight.astype(jnp.float32), layer.delta()
    norm = None
    if not layer.use_dora:
        folded = w + sign * delta
    elif sign > 0:
        norm = jnp.sqrt(jnp.sum(jnp.square(w + delta), axis=-2))
        factor = layer.lora_magnitude_vector.astype(jnp.float32) / norm
        folded = factor[..., None, :] * (w + delta)
    else:
        factor = layer.lora_magnitude_vector.astype(jnp.float32) / layer.dora_norm.astype(jnp.float32)
        folded = w / factor[..., None, :] - delta
    return eqx.tree_at(lambda lin: lin.weight, base, folded.astype(weight.dtype)), norm


def _fold_table(layer: LoraEmbedding, sign: float) -> Embedding:
    weight = layer.base.weight
    folded = (weight.astype(jnp.float32) + sign * layer.delta()).astype(weight.dtype)
    return eqx.tree_at(lambda e: e.weight, layer.base, folded)


def merge(model: Any, *, unload: bool = True) -> Any:
    """Fold every branch into its base weight (`W + scaling · A B`, computed in float32, cast
    back to W's dtype; DoRA: `m / ‖W + scaling · A B‖ · (W + scaling · A B)`, per output).

    `unload=True` (peft's `merge_and_unload`) returns a plain model without branches;
    `unload=False` (peft's `merge_adapter`) keeps them, marked merged, for `unmerge`.
    An int8 or 4-bit base (`cast_frozen(model, jnp.int8 | "nf4" | "int4")`) is
    dequantised: the merged layer is a float32 `Linear` (`unload=True` only; requantising
    the merged weight would lose the update to rounding), and so is every other int8 or
    4-bit projection of such a model (a quantised base stores the unadapted ones too), so
    the merged model is a float one that `zoo.hf.save_pretrained` writes.
    """

    def one(layer: AdapterLayer):
        if isinstance(layer, MultiLoraExpertLinear):
            raise ValueError(
                "merge: this model holds several adapters' expert branches (a serving bank): merge each "
                "adapter's own single-adapter model instead"
            )
        if isinstance(layer, MultiLoraLinear):
            raise ValueError(
                f"merge: this model holds several named adapters {layer.names}; merge one of them: "
                "zoo.lora.merge(zoo.lora.adapter(model, name))"
            )
        if layer.merged:
            return layer.base if unload else layer
        if isinstance(layer, TrainableTokens):
            base = eqx.tree_at(lambda e: e.weight, layer.base, layer.table(layer.trainable_tokens_delta))
            return base if unload else _with(layer, base=base, merged=True)
        if isinstance(layer, LoraEmbedding):
            # One table: a tied head (the same weight) gets the update too, as in peft's merge.
            base = _fold_table(layer, +1.0)
            return base if unload else _with(layer, base=base, merged=True)
        if not unload and isinstance(layer.base, QUANTIZED):
            bits = "int8" if isinstance(layer.base, QuantizedLinear) else layer.base.kind
            raise ValueError(
                f"merge(model, unload=False) cannot fold a LoRA branch into an {bits} base (the merged weight is no "
                f"{bits} matrix and unmerge could not restore the base): keep the branches unmerged (the {bits} "
                "model computes them as they are), merge with unload=True for a float32 model, or dequantise the "
                "base first with zoo.lora.cast_frozen(model, jnp.float32, config=config)"
            )
        base, norm = _fold(layer, +1.0)
        if unload:
            return base
        return _with(layer, base=base, merged=True, dora_norm=norm)

    quantized = any(
        isinstance(getattr(node_at(model, p), "base", None), QUANTIZED) for p, _ in modules(model, ADAPTED).values()
    )
    merged = _replace_lora(model, one)
    return dequantize(merged) if unload and quantized else merged


def unmerge(model: Any) -> Any:
    """Undo `merge(model, unload=False)`: subtract each branch from its base weight again."""

    def one(layer: AdapterLayer):
        if not layer.merged:  # MultiLoraLinear and MultiLoraExpertLinear never are
            return layer
        if isinstance(layer, TrainableTokens):
            base = eqx.tree_at(lambda e: e.weight, layer.base, layer.table(layer.trainable_tokens_original))
            return _with(layer, base=base, merged=False)
        if isinstance(layer, LoraEmbedding):
            return _with(layer, base=_fold_table(layer, -1.0), merged=False)
        return _with(layer, base=_fold(layer, -1.0)[0], merged=False, dora_norm=None)

    return _replace_lora(model, one)


def unload(model: Any) -> Any:
    """The base model: every branch dropped without merging (merged branches are subtracted first)."""
    return _replace_lora(unmerge(model), lambda layer: layer.base)


def _lora_linear(config: LoraConfig, base: Any, key: PRNGKeyArray) -> LoraLinear:
    """`base` with a LoRA branch as `config` says (`add_lora`; vmapped over a stack)."""
    return LoraLinear(
        base,
        config.r,
        scaling=config.scaling,
        dropout_rate=config.lora_dropout,
        init=config.init_lora_weights,
        use_dora=config.use_dora,
        key=key,
    )
