"""A LoRA config as text and on a model: the `--lora KEY=VALUE,...` form of a
`zoo.lora.LoraConfig` (`parse_lora`, `lora_text`: what config.json holds), adapters added
by one compiled program (`add_lora`), and what a run reports about them (`lora_json`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..lora import LoraConfig
from ._errors import ConfigError

# The text forms need no jax (the `zoo` command's help shows `LORA_EXAMPLE`): the adapters'
# modules are imported by the functions that add or list them.

# `--lora` key → (LoraConfig field). Keys the user leaves out take the command's defaults
# (`parse_lora(defaults=)`), then LoraConfig's (peft's: r=8, lora_alpha=8, lora_dropout=0).
LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "target_modules",
    "exclude": "exclude_modules",
    "rslora": "use_rslora",
    "save": "modules_to_save",
    "use_dora": "use_dora",
    "init_lora_weights": "init_lora_weights",
    "ensure_weight_tying": "ensure_weight_tying",
    "trainable_token_indices": "trainable_token_indices",
}
LORA_EXAMPLE = "r=8,alpha=16,targets=q_proj+v_proj"
LORA_KEY_SALT = 0x10A  # the adapters' key: fold_in(key(seed), this), apart from the model's


def _lora_value(key: str, value: str) -> Any:
    """One `--lora` value, read as its LoraConfig field wants it; ValueError if it cannot."""
    if key == "r":
        if not value.isdigit():
            raise ValueError(f"r must be a positive integer, got {value!r}")
        return int(value)
    if key in ("alpha", "dropout"):
        number = float(value)  # ValueError names the value
        if not math.isfinite(number):
            raise ValueError(f"{key}={value} is not a finite number")
        if key == "alpha" and number == 0:  # the branches' scale: every adapter's output times 0
            raise ValueError(
                "alpha=0 scales every adapter's output by 0, so the run would learn nothing; give alpha > 0"
            )
        return int(number) if key == "alpha" and number.is_integer() and "." not in value else number
    if key == "trainable_token_indices":
        ids = [i.strip() for i in value.split("+")]
        if not all(i.isdigit() for i in ids):
            raise ValueError(f"trainable_token_indices must be token ids joined by '+', e.g. 3+9+20, got {value!r}")
        return tuple(int(i) for i in ids)
    if key in ("rslora", "use_dora", "ensure_weight_tying"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if key == "init_lora_weights":
        return {"true": True, "false": False}.get(value.lower(), value)  # LoraConfig checks the names
    names = tuple(n.strip() for n in value.split("+"))
    if key == "targets" and value == "all-linear":
        return value
    if key == "save" and value.lower() == "none":
        return None
    if not all(names):
        raise ValueError(f"{key} must be module names joined by '+', e.g. q_proj+v_proj, got {value!r}")
    return names


def parse_lora(text: str, defaults: dict[str, Any]):
    """`"r=8,alpha=16,targets=q_proj+v_proj"` → a `zoo.lora.LoraConfig`: `defaults`
    (LoraConfig field → value) where the text names no value. An empty text is the defaults."""

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"bad --lora {text!r}: {why}; write key=value pairs joined by commas, e.g. {LORA_EXAMPLE}; "
            f"keys: {', '.join(LORA_KEYS)}"
        )

    fields = dict(defaults)
    seen: set[str] = set()
    for part in text.split(",") if text.strip() else ():
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise bad(f"{part.strip()!r} is not key=value")
        if key not in LORA_KEYS:
            raise bad(f"unknown key {key!r}")
        if key in seen:
            raise bad(f"key {key!r} appears twice")
        seen.add(key)
        try:
            fields[LORA_KEYS[key]] = _lora_value(key, value)
        except ValueError as e:
            raise bad(str(e)) from e
    try:
        return LoraConfig(**fields)
    except ValueError as e:
        raise bad(str(e)) from e


def lora_text(config) -> str:
    """A `LoraConfig` written back as a `--lora` value (every key spelled out)."""

    def names(value) -> str:
        if value is None:
            return "none"
        return value if isinstance(value, str) else "+".join(value)

    parts = [f"r={config.r}", f"alpha={config.lora_alpha:g}", f"dropout={config.lora_dropout:g}"]
    parts.append(f"targets={names(config.target_modules)}")
    if config.exclude_modules:
        parts.append(f"exclude={names(config.exclude_modules)}")
    parts.append(f"rslora={'true' if config.use_rslora else 'false'}")
    parts.append(f"save={names(config.modules_to_save)}")
    if config.use_dora:
        parts.append("use_dora=true")
    if config.ensure_weight_tying:
        parts.append("ensure_weight_tying=true")
    if config.trainable_token_indices:
        parts.append("trainable_token_indices=" + "+".join(str(i) for i in config.trainable_token_indices))
    if config.init_lora_weights is not True:
        parts.append(f"init_lora_weights={str(config.init_lora_weights).lower()}")
    return ",".join(parts)


_LORA_WRAPPERS: dict[Any, tuple[Any, dict[str, Any]]] = {}


def add_lora(model: Any, config: Any, seed: int) -> Any:
    """`zoo.lora.add_lora(model, config, key=...)` as one jitted program compiled without
    LLVM's costly optimisations (like `init_compiled`), once per (model structure and
    placement, config).
    A target matching nothing, a rank too large, ... → ConfigError with zoo's message."""
    import equinox as eqx
    import jax
    import jax.random as jr

    from ..lora import add_lora as add_branches
    from ._task import ONCE_COMPILER_OPTIONS

    key = jr.fold_in(jr.key(seed), LORA_KEY_SALT)
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    # A compiled program takes only the placements it was compiled for: another mesh (a
    # second run in this process on other devices) is another program.
    cache_key = (treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves), config)
    if cache_key not in _LORA_WRAPPERS:
        out: dict[str, Any] = {}

        def wrap(arrays, k):
            lora_arrays, out["tree"] = eqx.partition(
                add_branches(eqx.combine(arrays, static), config, key=k), eqx.is_array
            )
            return lora_arrays

        try:
            compiled = jax.jit(wrap).lower(arrays, key).compile(compiler_options=ONCE_COMPILER_OPTIONS)
        except ValueError as e:
            raise ConfigError(f"--lora: {e}") from e
        _LORA_WRAPPERS[cache_key] = (compiled, out)
    compiled, out = _LORA_WRAPPERS[cache_key]
    return eqx.combine(compiled(arrays, key), out["tree"])


def lora_json(model: Any, config: Any) -> dict[str, Any]:
    """The config (peft's field names), its scaling, and the modules that got a branch."""
    from ..lora import LoraEmbedding, LoraLinear, MultiLoraLinear, adapter_names
    from ..lora import modules as lora_modules

    def plain(value):
        return list(value) if isinstance(value, tuple) else value

    fields = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    names = adapter_names(model)  # several adapters of this config, trained at once
    return fields | {
        "scaling": config.scaling,
        "adapted_modules": sorted(lora_modules(model, (LoraLinear, LoraEmbedding, MultiLoraLinear))),
        **({"adapters": list(names)} if names else {}),
    }
