"""What every command shares: the one-line error, devices, the mesh flag, small helpers.

Nothing here imports jax when the module loads: the number of simulated CPU devices must
be set (`init_devices`) before jax starts its backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from ..train._errors import ConfigError


class CLIError(ConfigError):
    """A user mistake: printed as one line with the fix, no traceback; exit code 2. A
    `zoo.train.ConfigError`, so library callers catch the CLI's checks with it too."""

    exit_code = 2
    prefix = "error"


# XLA options for programs compiled once and run once (inspected steps, initialisers): no
# LLVM optimisation of the machine code. XLA's HLO passes, which place the collectives,
# still run.
INSPECT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Devices simulated on CPU when --devices is not given.
DEFAULT_CPU_DEVICES = 8


# --- devices and meshes --------------------------------------------------------------------


def init_devices_env() -> None:
    """XLA flags every command sets before jax's backend starts."""
    # Simulated devices share a few cores: on a busy machine one device's thread can reach
    # a collective long after the others, and XLA's CPU runtime aborts after 40 s of
    # waiting by default. Let it wait (read when the backend starts; harmless elsewhere).
    flags = os.environ.get("XLA_FLAGS", "")
    if "collective_call_terminate_timeout" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_call_terminate_timeout_seconds=3600".strip()


def init_devices(devices: int | None) -> int:
    """Set up jax's devices and return how many the command uses.

    On CPU, `devices` simulated devices (default 8); on an accelerator, the real ones
    (`devices` of them, default all). Must run before anything touches jax's backend;
    when the backend is already up (a caller in the same process), what it has is used.
    """
    import jax

    if devices is not None and devices < 1:
        raise CLIError(f"--devices must be >= 1, got {devices}")
    init_devices_env()
    wanted = DEFAULT_CPU_DEVICES if devices is None else devices
    try:
        jax.config.update("jax_num_cpu_devices", wanted)
    except RuntimeError:  # backend already up (e.g. called in-process): use what is there
        pass
    have = len(jax.devices())
    if devices is None:
        return have if jax.default_backend() != "cpu" else min(have, wanted)
    if have < devices:
        raise CLIError(
            f"asked for {devices} devices but jax has {have} ({jax.default_backend()}); pass --devices {have} or fewer"
        )
    return devices


def parse_mesh(text: str | None, devices: int) -> dict[str, int]:
    """`"data=4,model=2"` → `{"data": 4, "model": 2}`; default: all devices on `data`."""
    if not text:
        return {"data": devices}
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise CLIError(f"bad --mesh {text!r}: write it as name=size[,name=size], e.g. data=4,model=2")
        if name in mesh:
            raise CLIError(f"bad --mesh {text!r}: axis {name!r} appears twice")
        mesh[name] = int(size)
    total = math.prod(mesh.values())
    if total > devices:
        raise CLIError(f"--mesh {text} needs {total} devices but only {devices} were asked for; raise --devices")
    return mesh


def mesh_text(shape: dict[str, int]) -> str:
    """`{"data": 4, "model": 2}` → `"data=4,model=2"` (what --mesh reads)."""
    return ",".join(f"{k}={v}" for k, v in shape.items())


def make_mesh(shape: dict[str, int]):
    """A jax mesh of `shape` over the first devices."""
    import jax

    n = math.prod(shape.values())
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=jax.devices()[:n])


def check_rules_fit_mesh(preset: str, mesh_shape: dict[str, int], devices: int) -> None:
    """Fail fast (before building a model) on an unknown rules preset, or one that uses
    mesh axes the mesh lacks."""
    import zoo

    if preset not in zoo.RULE_PRESETS:
        raise CLIError(f"unknown --rules {preset!r}; choose one of {list(zoo.RULE_PRESETS)}")
    used: list[str] = []
    for target in zoo.rules(preset).values():
        for ax in (target,) if isinstance(target, str) else (target or ()):
            if ax not in used:
                used.append(ax)
    idle = [ax for ax, size in mesh_shape.items() if ax not in used and size > 1]
    if idle:
        raise CLIError(
            f"--mesh {mesh_text(mesh_shape)}: no rule of --rules {preset} uses mesh axes {idle}, so their devices "
            f"would repeat the same work; drop them or give them size 1 (e.g. --mesh "
            f"{mesh_text({k: v for k, v in mesh_shape.items() if k not in idle})}), or pick rules that use them"
        )
    missing = [ax for ax in used if ax not in mesh_shape]
    if missing:
        model = 2 if "model" in used and devices % 2 == 0 else 1
        example = {"data": devices // model, "model": model}
        example_text = ",".join(f"{k}={v}" for k, v in example.items() if k in used)
        raise CLIError(
            f"--rules {preset} shards over mesh axes {used}, but the mesh {mesh_text(mesh_shape)} lacks "
            f"{', '.join(map(repr, missing))}; pass a mesh with them, e.g. --mesh {example_text}"
        )


# --- key=value lists (--lora, --model-config) ------------------------------------------------


def parse_pairs(text: str, flag: str, example: str) -> dict[str, str]:
    """`"a=1,b=x"` → `{"a": "1", "b": "x"}`, each key once; CLIError naming `flag` else."""
    pairs: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise CLIError(f"bad {flag} {text!r}: {part.strip()!r} is not key=value; write e.g. {example}")
        if key in pairs:
            raise CLIError(f"bad {flag} {text!r}: key {key!r} appears twice")
        pairs[key] = value
    return pairs


def parse_scalar(value: str) -> Any:
    """A flag's value as the Python scalar it spells: int, float, true/false, none, or str."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# --- pytrees, compiled helpers -----------------------------------------------------------------


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree."""
    import equinox as eqx
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def tree_size(tree) -> int:
    """Number of elements in the array leaves of a pytree."""
    import equinox as eqx
    import jax

    return sum(x.size for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


_INITIALISERS: dict[Any, tuple[Any, dict[str, Any]]] = {}


def init_compiled(name: Any, build: Callable[[Any], Any], key) -> Any:
    """`build(key)` as one jitted program compiled without LLVM's costly optimisations:
    about half the CPU time of running the initialisers op by op, each compiled alone.
    Same values as running it eagerly, up to float rounding. Compiled once per `name`
    (which must name the model's configuration too)."""
    import equinox as eqx
    import jax

    if name not in _INITIALISERS:
        static: dict[str, Any] = {}

        def arrays_of(k):
            arrays, static["tree"] = eqx.partition(build(k), eqx.is_array)
            return arrays

        compiled = jax.jit(arrays_of).lower(key).compile(compiler_options=INSPECT_COMPILER_OPTIONS)
        _INITIALISERS[name] = (compiled, static)
    compiled, static = _INITIALISERS[name]
    return eqx.combine(compiled(key), static["tree"])


def numpy_rng(*seed: Any):
    """A numpy generator from ints or jax PRNG keys: batches without compiling jax ops."""
    import numpy as np

    words: list[int] = []
    for s in seed:
        if isinstance(s, int):
            words.append(s)
        else:
            import jax

            words.extend(np.asarray(jax.random.key_data(s)).ravel().tolist())
    return np.random.default_rng(words)


def collective_summary(colls) -> dict[str, Any]:
    """Counts of the collectives by kind and place, and the mesh axes they span."""
    import zoo

    def axes(in_loop: bool) -> list[str]:
        return sorted({a for c in colls if c.in_loop == in_loop for a in c.mesh_axes})

    return {
        "all_reduce_in_loop": zoo.count(colls, "all-reduce", in_loop=True),
        "all_reduce_outside": zoo.count(colls, "all-reduce", in_loop=False),
        "all_gather_in_loop": zoo.count(colls, "all-gather", in_loop=True),
        "all_gather_outside": zoo.count(colls, "all-gather", in_loop=False),
        "reduce_scatter_in_loop": zoo.count(colls, "reduce-scatter", in_loop=True),
        "reduce_scatter_outside": zoo.count(colls, "reduce-scatter", in_loop=False),
        "collectives_in_loop": sum(c.in_loop for c in colls),
        "collectives_total": len(colls),
        "in_loop_mesh_axes": axes(True),
        "outside_mesh_axes": axes(False),
    }
