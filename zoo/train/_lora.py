"""A run's LoRA config on its model: adapters added by one compiled program (`add_lora`),
and what a run reports about them (`lora_json`). Its text form is `_text.parse_lora`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._errors import ConfigError

# The adapters' modules are imported by the functions that add or list them (no jax at import).

LORA_KEY_SALT = 0x10A  # the adapters' key: fold_in(key(seed), this), apart from the model's


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
