"""The device mesh of a run: made over the first devices, written as `--mesh` text, and
checked against the sharding rules before anything is built."""

from __future__ import annotations

import math

from .._presets import RULE_PRESETS
from .._presets import rules as preset_rules
from ._errors import ConfigError
from ._text import mesh_text


def make_mesh(shape: dict[str, int]):
    """A jax mesh of `shape` (axis name → size) over the first devices."""
    import jax

    n = math.prod(shape.values())
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=jax.devices()[:n])


def check_rules_fit_mesh(preset: str, mesh_shape: dict[str, int], devices: int) -> None:
    """Fail fast (before building a model) on an unknown rules preset, or one that uses
    mesh axes the mesh lacks."""
    if preset not in RULE_PRESETS:
        raise ConfigError(f"unknown --rules {preset!r}; choose one of {list(RULE_PRESETS)}")
    used: list[str] = []
    for target in preset_rules(preset).values():
        for ax in (target,) if isinstance(target, str) else (target or ()):
            if ax not in used:
                used.append(ax)
    idle = [ax for ax, size in mesh_shape.items() if ax not in used and size > 1]
    if idle:
        raise ConfigError(
            f"--mesh {mesh_text(mesh_shape)}: no rule of --rules {preset} uses mesh axes {idle}, so their devices "
            f"would repeat the same work; drop them or give them size 1 (e.g. --mesh "
            f"{mesh_text({k: v for k, v in mesh_shape.items() if k not in idle})}), or pick rules that use them"
        )
    missing = [ax for ax in used if ax not in mesh_shape]
    if missing:
        model = 2 if "model" in used and devices % 2 == 0 else 1
        example = {"data": devices // model, "model": model}
        example_text = ",".join(f"{k}={v}" for k, v in example.items() if k in used)
        raise ConfigError(
            f"--rules {preset} shards over mesh axes {used}, but the mesh {mesh_text(mesh_shape)} lacks "
            f"{', '.join(map(repr, missing))}; pass a mesh with them, e.g. --mesh {example_text}"
        )
