"""`zoo` / `python -m zoo`: the demo, the collective inspector of a compiled step, and a model's leaf table.

The library never imports this module; it only uses the public API.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class CLIError(Exception):
    """A user mistake: printed as one line with the fix, no traceback."""


# --- device set-up (must run before jax touches its backend) ------------------------


def _init_devices(devices: int) -> None:
    import jax

    if devices < 1:
        raise CLIError(f"--devices must be >= 1, got {devices}")
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # backend already up (e.g. called in-process): use what is there
        pass
    have = len(jax.devices())
    if have < devices:
        raise CLIError(
            f"asked for {devices} devices but jax has {have} ({jax.default_backend()}); "
            f"pass --devices {have} or fewer"
        )


def parse_mesh(text: str | None, devices: int) -> dict[str, int]:
    """`"data=4,model=2"` → `{"data": 4, "model": 2}`; default: all devices on `data`."""
    if not text:
        return {"data": devices}
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise CLIError(f"bad --mesh {text!r}: write it as name=size[,name=size], e.g. data=4,model=2")
        if name.strip() in mesh:
            raise CLIError(f"bad --mesh {text!r}: axis {name.strip()!r} appears twice")
        mesh[name.strip()] = int(size)
    total = math.prod(mesh.values())
    if total > devices:
        raise CLIError(f"--mesh {text} needs {total} devices but only {devices} were asked for; raise --devices")
    return mesh


# --- models the CLI knows -----------------------------------------------------------

# XLA options for programs compiled once (inspected steps, initialisers): no LLVM
# optimisation of the machine code. XLA's HLO passes, which place the collectives, still run.
_INSPECT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclass
class Task:
    """A model with its loss and a batch maker: what the CLI needs to build a step."""

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    make_batch: Callable[[int, Any], Any]  # (batch_size, key) -> batch


def _mlp_task(key, *, scan: bool = True, norm: str | None = "layernorm") -> Task:
    import jax.numpy as jnp
    import jax.random as jr

    import zoo

    in_size, out_size = 16, 1
    model = zoo.nn.MLP(in_size, out_size, 64, 4, activation=jnp.tanh, norm=norm, scan=scan, key=key)
    teacher = jr.normal(jr.fold_in(key, 1), (2, in_size)) / math.sqrt(in_size)

    def make_batch(batch_size, batch_key):
        x = jr.normal(batch_key, (batch_size, in_size))
        proj = x @ teacher.T
        y = jnp.sin(2.0 * proj[:, :1]) * jnp.cos(proj[:, 1:])
        return x, y

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean(jnp.square(model(x) - y), axis=-1)

    return Task(model, loss_fn, make_batch)


# Tiny but real transformer configs: every head count and width divides by 2 (tp on
# `model=2`) and by 8 (fsdp on `data=8`, which splits the embed axis), and one step
# compiles in seconds on CPU.
_SEQ = 16
_TRANSFORMER = {"vocab_size": 64, "d_model": 32, "num_heads": 4, "num_layers": 2, "mlp_dim": 64, "max_len": _SEQ}
_NUM_LABELS = 4


_INITIALISERS: dict[str, tuple[Any, dict[str, Any]]] = {}


def _init_compiled(name: str, build: Callable[[Any], Any], key) -> Any:
    """`build(key)` as one jitted program compiled without LLVM's costly optimisations:
    about half the CPU time of running the initialisers op by op, each compiled alone.
    Same values as running it eagerly, up to float rounding. Compiled once per `name`."""
    import equinox as eqx
    import jax

    if name not in _INITIALISERS:
        static: dict[str, Any] = {}

        def arrays_of(k):
            arrays, static["tree"] = eqx.partition(build(k), eqx.is_array)
            return arrays

        compiled = jax.jit(arrays_of).lower(key).compile(compiler_options=_INSPECT_COMPILER_OPTIONS)
        _INITIALISERS[name] = (compiled, static)
    compiled, static = _INITIALISERS[name]
    return eqx.combine(compiled(key), static["tree"])


def _numpy_rng(key):
    """A numpy generator seeded by a jax PRNG key: token batches without compiling jax ops."""
    import jax
    import numpy as np

    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def _padded_tokens(rng, batch_size: int, vocab: int, seq: int = _SEQ):
    """`(tokens int32 [B, S], mask bool [B, S])`: ids in [1, vocab), then padding id 0 at
    the end of each row (every row keeps at least half its positions)."""
    import numpy as np

    tokens = rng.integers(1, vocab, (batch_size, seq), dtype=np.int32)
    lengths = rng.integers(seq // 2, seq + 1, (batch_size, 1))
    mask = np.arange(seq)[None, :] < lengths
    return np.where(mask, tokens, 0).astype(np.int32), mask


def _transformer_task(key) -> Task:
    """Decoder-only LM (`zoo.models.Transformer`) with next-token loss on padded rows."""
    import zoo

    config = zoo.models.TransformerConfig(**_TRANSFORMER)
    model = _init_compiled("transformer", lambda k: zoo.models.Transformer(config, key=k), key)

    def make_batch(batch_size, batch_key):
        import jax.numpy as jnp

        tokens, mask = _padded_tokens(_numpy_rng(batch_key), batch_size, config.vocab_size)
        return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}

    return Task(model, zoo.models.next_token_loss, make_batch)


def _encoder_task(key) -> Task:
    """BERT-style `zoo.models.EncoderClassifier` with classification loss; the padding
    mask comes from the tokens (`tokens != pad_token_id`)."""
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np

    import zoo

    config = zoo.models.EncoderConfig(**_TRANSFORMER)

    def build(k):
        k_enc, k_head = jr.split(k)
        return zoo.models.EncoderClassifier(zoo.models.Encoder(config, key=k_enc), _NUM_LABELS, key=k_head)

    model = _init_compiled("encoder", build, key)

    def make_batch(batch_size, batch_key):
        rng = _numpy_rng(batch_key)
        tokens, _ = _padded_tokens(rng, batch_size, config.vocab_size)
        labels = rng.integers(0, _NUM_LABELS, (batch_size,), dtype=np.int32)
        return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}

    return Task(model, zoo.models.classification_loss, make_batch)


MODELS: dict[str, Callable[..., Task]] = {
    "mlp": _mlp_task,
    "transformer": _transformer_task,
    "encoder": _encoder_task,
}


def _build(args) -> Task:
    import jax.random as jr

    if args.model not in MODELS:
        raise CLIError(f"unknown model {args.model!r}; choose one of {sorted(MODELS)}")
    return MODELS[args.model](jr.key(args.seed))


# --- LoRA (`inspect --lora`) ----------------------------------------------------------

# `--lora` key → (LoraConfig field, how the value reads). Keys the user leaves out take
# LoraConfig's defaults (peft's: r=8, lora_alpha=8, lora_dropout=0), except the per-model
# defaults below.
_LORA_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "targets": "target_modules",
    "exclude": "exclude_modules",
    "rslora": "use_rslora",
    "save": "modules_to_save",
}
_LORA_EXAMPLE = "r=8,alpha=16,targets=q_proj+v_proj"
# Targets when `targets=` is not given: the attention's query and value projections (peft's
# default for LLaMA/BERT-style models); the MLP has no attention, so every hidden Linear.
_LORA_DEFAULT_TARGETS: dict[str, Any] = {"mlp": "all-linear", "transformer": ("q_proj", "v_proj"), "encoder": ("q_proj", "v_proj")}
# Modules trained in full besides the adapters when `save=` is not given: the encoder's
# classification head is new for the task (peft's modules_to_save=["classifier"] for
# sequence classification); `save=none` freezes it too.
_LORA_DEFAULT_SAVE: dict[str, Any] = {"encoder": ("head",)}
_LORA_KEY_SALT = 0x10A  # the adapters' key: fold_in(key(seed), this), apart from the model's


def _lora_value(key: str, value: str) -> Any:
    """One `--lora` value, read as its LoraConfig field wants it; ValueError if it cannot."""
    if key == "r":
        if not value.isdigit():
            raise ValueError(f"r must be a positive integer, got {value!r}")
        return int(value)
    if key in ("alpha", "dropout"):
        number = float(value)  # ValueError names the value
        return int(number) if key == "alpha" and number.is_integer() and "." not in value else number
    if key == "rslora":
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"rslora must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    names = tuple(n.strip() for n in value.split("+"))
    if key == "targets" and value == "all-linear":
        return value
    if key == "save" and value.lower() == "none":
        return None
    if not all(names):
        raise ValueError(f"{key} must be module names joined by '+', e.g. q_proj+v_proj, got {value!r}")
    return names


def parse_lora(text: str, model: str):
    """`"r=8,alpha=16,targets=q_proj+v_proj"` → a `zoo.lora.LoraConfig`, with the model's
    default targets (and, for the encoder, `modules_to_save`) where the text names none."""
    import zoo

    def bad(why: str) -> CLIError:
        return CLIError(
            f"bad --lora {text!r}: {why}; write key=value pairs joined by commas, e.g. {_LORA_EXAMPLE}; "
            f"keys: {', '.join(_LORA_KEYS)}"
        )

    fields: dict[str, Any] = {"target_modules": _LORA_DEFAULT_TARGETS.get(model, "all-linear")}
    if model in _LORA_DEFAULT_SAVE:
        fields["modules_to_save"] = _LORA_DEFAULT_SAVE[model]
    seen: set[str] = set()
    for part in text.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise bad(f"{part.strip()!r} is not key=value")
        if key not in _LORA_KEYS:
            raise bad(f"unknown key {key!r}")
        if key in seen:
            raise bad(f"key {key!r} appears twice")
        seen.add(key)
        try:
            fields[_LORA_KEYS[key]] = _lora_value(key, value)
        except ValueError as e:
            raise bad(str(e)) from e
    try:
        return zoo.lora.LoraConfig(**fields)
    except ValueError as e:
        raise bad(str(e)) from e


_LORA_WRAPPERS: dict[Any, tuple[Any, dict[str, Any]]] = {}


def _add_lora(name: str, model: Any, config: Any, seed: int) -> Any:
    """`zoo.lora.add_lora(model, config, key=...)` as one jitted program compiled without
    LLVM's costly optimisations (like `_init_compiled`), once per (model, config).
    A target matching nothing, a rank too large, ... → CLIError with zoo's message."""
    import equinox as eqx
    import jax
    import jax.random as jr

    import zoo

    key = jr.fold_in(jr.key(seed), _LORA_KEY_SALT)
    arrays, static = eqx.partition(model, eqx.is_array)
    if (name, config) not in _LORA_WRAPPERS:
        out: dict[str, Any] = {}

        def wrap(arrays, k):
            lora_arrays, out["tree"] = eqx.partition(
                zoo.lora.add_lora(eqx.combine(arrays, static), config, key=k), eqx.is_array
            )
            return lora_arrays

        try:
            compiled = jax.jit(wrap).lower(arrays, key).compile(compiler_options=_INSPECT_COMPILER_OPTIONS)
        except ValueError as e:
            raise CLIError(f"--lora: {e}") from e
        _LORA_WRAPPERS[(name, config)] = (compiled, out)
    compiled, out = _LORA_WRAPPERS[(name, config)]
    return eqx.combine(compiled(arrays, key), out["tree"])


def _lora_json(model: Any, config: Any) -> dict[str, Any]:
    """The config (peft's field names), its scaling, and the modules that got a branch."""
    import dataclasses

    import zoo

    def plain(value):
        return list(value) if isinstance(value, tuple) else value

    fields = {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return fields | {
        "scaling": config.scaling,
        "adapted_modules": sorted(zoo.lora.modules(model, zoo.lora.LoraLinear)),
    }


def _mesh(shape: dict[str, int]):
    import jax

    n = math.prod(shape.values())
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=jax.devices()[:n])


def _tree_bytes(tree) -> int:
    import equinox as eqx
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


# --- commands -----------------------------------------------------------------------


def _rules_and_lora(args, mesh_shape: dict[str, int]):
    """Check `--rules` against the mesh and parse `--lora` (None without it)."""
    import zoo

    if args.rules not in zoo.RULE_PRESETS:
        raise CLIError(f"unknown --rules {args.rules!r}; choose one of {list(zoo.RULE_PRESETS)}")
    _check_rules_fit_mesh(args.rules, mesh_shape, args.devices)
    return None if args.lora is None else parse_lora(args.lora, args.model)


def cmd_inspect(args) -> int:
    _init_devices(args.devices)
    mesh_shape = parse_mesh(args.mesh, args.devices)
    import equinox as eqx
    import jax
    import optax

    import zoo

    lora = _rules_and_lora(args, mesh_shape)
    if lora is not None and lora.lora_dropout and args.model == "mlp":
        raise CLIError("--lora dropout needs per-example keys, which the mlp's loss does not take; drop dropout=")
    data = mesh_shape.get("data", 1)
    batch_size = args.batch_size or data * args.microbatches * 2
    try:  # before building anything: the step would say the same after compiling the model
        zoo.check_batch(jax.ShapeDtypeStruct((batch_size,), "int32"), data, args.microbatches)
    except ValueError as e:
        raise CLIError(str(e)) from e
    task = _build(args)
    if lora is not None:
        task.model = _add_lora(args.model, task.model, lora, args.seed)
    mesh = _mesh(mesh_shape)
    with jax.set_mesh(mesh):
        try:
            model = zoo.shard(task.model, zoo.rules(args.rules), mesh)
        except ValueError as e:
            raise CLIError(str(e)) from e
        options = zoo.step_options(args.rules)
        if lora is not None:  # only the adapters (and modules_to_save) get gradients and all-reduces
            options["trainable"] = zoo.lora.trainable(model, lora)
        step = zoo.TrainStep(
            task.loss_fn,
            optax.adamw(1e-3),
            microbatches=args.microbatches,
            mode=args.mode,
            **options,
        )
        batch = task.make_batch(batch_size, jax.random.key(0))
        if lora is not None and lora.lora_dropout:  # per-example keys turn the branches' dropout on
            batch = dict(batch, dropout_key=zoo.nn.example_keys(jax.random.key(1), batch_size))
        try:
            lowered = step.lower(model, step.init(model), batch)
        except ValueError as e:
            raise CLIError(str(e)) from e
        # The step is only inspected, never run: skip LLVM's costly optimisations (about
        # half the compile time on CPU); the collectives come out the same.
        colls = zoo.collectives(lowered.compile(compiler_options=_INSPECT_COMPILER_OPTIONS), mesh=mesh)
        trainable = step.partition(model)[0]
    result = {
        "model": args.model,
        "devices": args.devices,
        "microbatches": args.microbatches,
        "mode": args.mode,
        "rules": args.rules,
        "mesh": mesh_shape,
        "batch_size": batch_size,
        "param_bytes": _tree_bytes(model),
        "trainable_bytes": _tree_bytes(trainable),
        "lora": None if lora is None else _lora_json(model, lora),
        "adapter_bytes": _tree_bytes(eqx.filter(model, zoo.lora.trainable(model))),
        "collectives": [c.to_json() for c in colls],
        "summary": _summary(colls),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}: {args.devices} devices, mesh {mesh_shape}, {args.microbatches} microbatches, "
            f"mode {args.mode}, rules {args.rules}, batch {batch_size}"
        )
        print(f"params {result['param_bytes']:,} bytes, trainable {result['trainable_bytes']:,} bytes")
        if lora is not None:
            adapted = result["lora"]["adapted_modules"]
            saved = result["trainable_bytes"] - result["adapter_bytes"]
            print(
                f"LoRA r={lora.r} alpha={lora.lora_alpha} on {len(adapted)} Linear layers "
                f"({', '.join(sorted({n.split('.')[-1] for n in adapted}))}): adapters {result['adapter_bytes']:,} bytes"
                + (f" + modules_to_save {saved:,} bytes" if lora.modules_to_save else "")
                + f" = {result['trainable_bytes']:,} trainable of the model's {result['param_bytes']:,} "
                f"({100 * result['trainable_bytes'] / result['param_bytes']:.1f}%)"
            )
        print(zoo.report(colls))
        summary = result["summary"]
        print(
            f"all-gathers: {summary['all_gather_in_loop']} inside loops, {summary['all_gather_outside']} outside; "
            f"reduce-scatters: {summary['reduce_scatter_in_loop']} inside loops, "
            f"{summary['reduce_scatter_outside']} outside"
        )
        inside = ",".join(summary["in_loop_mesh_axes"]) or "-"
        outside = ",".join(summary["outside_mesh_axes"]) or "-"
        print(f"mesh axes of collectives: inside loops {inside}, outside {outside}")
    return 0


def _check_rules_fit_mesh(preset: str, mesh_shape: dict[str, int], devices: int) -> None:
    """Fail fast (before building a model) when a rules preset uses mesh axes the mesh lacks."""
    import zoo

    used: list[str] = []
    for target in zoo.rules(preset).values():
        for ax in (target,) if isinstance(target, str) else (target or ()):
            if ax not in used:
                used.append(ax)
    missing = [ax for ax in used if ax not in mesh_shape]
    if missing:
        have = ",".join(f"{k}={v}" for k, v in mesh_shape.items())
        model = 2 if "model" in used and devices % 2 == 0 else 1
        example = {"data": devices // model, "model": model}
        example_text = ",".join(f"{k}={v}" for k, v in example.items() if k in used)
        raise CLIError(
            f"--rules {preset} shards over mesh axes {used}, but the mesh {have} lacks "
            f"{', '.join(map(repr, missing))}; pass a mesh with them, e.g. --mesh {example_text}"
        )


def _summary(colls) -> dict[str, Any]:
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


def _leaf_rows(model: Any, axes: Any, specs: Any, trainable: Any, mesh_shape: dict[str, int]) -> list[dict[str, Any]]:
    """One row per array leaf of `model`: path, shape, dtype, logical axes, spec, trainable,
    bytes and bytes per device (each dimension over the product of the mesh axis sizes its
    spec entry names; nothing is placed on devices)."""
    import equinox as eqx
    import jax

    from ._axes import path_str

    rows: list[dict[str, Any]] = []

    def one(path, x, names, spec, train):
        if not eqx.is_array(x):
            return
        entries = tuple(spec) + (None,) * (x.ndim - len(spec))
        per_device = [
            dim if entry is None else math.ceil(dim / math.prod(mesh_shape[ax] for ax in _mesh_axes(entry)))
            for dim, entry in zip(x.shape, entries, strict=True)
        ]
        rows.append(
            {
                "path": path_str(path),
                "shape": list(x.shape),
                "dtype": str(x.dtype),
                "logical_axes": list(names.names),
                "spec": [None if e is None else (e if isinstance(e, str) else list(e)) for e in entries],
                "trainable": bool(train),
                "parameters": int(x.size),
                "bytes": int(x.size * x.dtype.itemsize),
                "bytes_per_device": int(math.prod(per_device) * x.dtype.itemsize),
            }
        )

    jax.tree_util.tree_map_with_path(one, model, axes, specs, trainable)
    return rows


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def cmd_info(args) -> int:
    _init_devices(args.devices)
    mesh_shape = parse_mesh(args.mesh, args.devices)
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zoo

    lora = _rules_and_lora(args, mesh_shape)
    model = _build(args).model
    if lora is not None:
        model = _add_lora(args.model, model, lora, args.seed)
    # An abstract mesh: the specs are checked against its axes and sizes, nothing is placed.
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    try:
        axes = zoo.logical_axes(model)
        specs = zoo.partition_specs(model, zoo.rules(args.rules), mesh)
    except ValueError as e:
        raise CLIError(str(e)) from e
    if lora is not None:
        trainable = zoo.lora.trainable(model, lora)
    else:
        trainable = jax.tree.map(lambda x: eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact), model)
    rows = _leaf_rows(model, axes, specs, trainable, mesh_shape)
    totals = {
        "leaves": len(rows),
        "parameters": sum(r["parameters"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
        "bytes_per_device": sum(r["bytes_per_device"] for r in rows),
        "trainable_leaves": sum(r["trainable"] for r in rows),
        "trainable_parameters": sum(r["parameters"] for r in rows if r["trainable"]),
        "trainable_bytes": sum(r["bytes"] for r in rows if r["trainable"]),
    }
    if args.json:
        result = {
            "model": args.model,
            "devices": args.devices,
            "rules": args.rules,
            "mesh": mesh_shape,
            "lora": None if lora is None else _lora_json(model, lora),
            "leaves": rows,
            "totals": totals,
        }
        print(json.dumps(result))
        return 0

    def fmt(values) -> str:
        return "(" + ", ".join("-" if v is None else (v if isinstance(v, str) else "+".join(v)) for v in values) + ")"

    header = ("leaf", "shape", "dtype", "logical axes", "spec", "trainable", "bytes/device")
    table = [
        (
            r["path"],
            str(tuple(r["shape"])),
            r["dtype"],
            fmt(r["logical_axes"]),
            fmt(r["spec"]),
            "yes" if r["trainable"] else "no",
            f"{r['bytes_per_device']:,}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *table)) for i in range(len(header))]
    print(f"{args.model}: mesh {mesh_shape}, rules {args.rules}" + ("" if lora is None else f", LoRA r={lora.r}"))
    for row in (header, *table):
        print("  ".join(c.rjust(w) if i == len(row) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    print(
        f"total: {totals['leaves']} leaves, {totals['parameters']:,} parameters, {totals['bytes']:,} bytes, "
        f"{totals['bytes_per_device']:,} bytes per device; trainable: {totals['trainable_parameters']:,} "
        f"parameters, {totals['trainable_bytes']:,} bytes"
    )
    return 0


def cmd_demo(args) -> int:
    _init_devices(args.devices)
    import jax
    import optax

    import zoo

    task = _build(args)
    mesh = _mesh({"data": args.devices})
    batch_size = args.devices * args.microbatches * args.per_device_batch
    print(
        f"zoo demo: MLP regression on {args.devices} simulated devices, {args.microbatches} microbatches, "
        f"global batch {batch_size}, {args.steps} steps"
    )
    with jax.set_mesh(mesh):
        model = zoo.shard(task.model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(task.loss_fn, optax.adamw(args.lr), microbatches=args.microbatches)
        opt_state = step.init(model)
        key = jax.random.key(args.seed + 1)
        eval_batch = task.make_batch(1024, jax.random.fold_in(key, 10**6))
        eval_fn = jax.jit(lambda m, b: task.loss_fn(m, b).mean())
        first_eval = float(eval_fn(model, eval_batch))
        print(f"held-out loss before training: {first_eval:.4f}")
        losses = []
        start = time.perf_counter()
        for i in range(args.steps):
            batch = task.make_batch(batch_size, jax.random.fold_in(key, i))
            model, opt_state, loss = step(model, opt_state, batch)
            losses.append(float(loss))
            if i == 0:
                compile_s = time.perf_counter() - start
                start = time.perf_counter()
            if (i + 1) % max(args.steps // 10, 1) == 0 or i == 0:
                print(f"step {i + 1:4d}  loss {losses[-1]:.4f}")
        run_s = time.perf_counter() - start
        last_eval = float(eval_fn(model, eval_batch))
        colls = zoo.collectives(step.lower(model, opt_state, batch), mesh=mesh)
    print(f"held-out loss after training:  {last_eval:.4f} ({first_eval / max(last_eval, 1e-12):.1f}x lower)")
    print(f"compile {compile_s:.1f} s, then {1000 * run_s / max(args.steps - 1, 1):.1f} ms/step")
    print("\ncollectives in the compiled training step:")
    print(zoo.report(colls))
    fell = last_eval < first_eval
    print(f"\nloss fell: {'yes' if fell else 'NO'}")
    return 0 if fell else 1


# --- parser -------------------------------------------------------------------------


_MODEL_HELP = (
    "model name: mlp (a 4-layer MLP regressor), transformer (a tiny decoder-only LM, "
    "next-token loss), encoder (a tiny BERT-style classifier, padded tokens)"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zoo` (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="zoo", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    from ._rules import RULE_PRESETS  # zoo's import leaves jax's backend alone

    ins = sub.add_parser(
        "inspect",
        help="list the collectives of a model's compiled training step",
        description="Compile one training step of a model on simulated CPU devices and list its "
        "collectives (all-reduces, all-gathers, ...), inside or outside loops, with the mesh axes "
        "they span.",
        epilog="examples: zoo inspect mlp; zoo inspect transformer --rules fsdp-once --json; "
        "zoo inspect encoder --mesh data=4,model=2 --rules tp; "
        f"zoo inspect transformer --lora {_LORA_EXAMPLE}",
    )
    ins.add_argument("model", help=_MODEL_HELP)
    ins.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    ins.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    ins.add_argument("--mesh", help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES)")
    ins.add_argument(
        "--rules",
        default="dp",
        help=f"sharding rules preset: {', '.join(RULE_PRESETS)} (default dp); tp and fsdp+tp "
        "need a 'model' mesh axis, e.g. --mesh data=4,model=2; fsdp-once also sets the step's "
        "gather='once'",
    )
    ins.add_argument("--mode", choices=("explicit", "shard_map"), default="explicit", help="step mode")
    ins.add_argument("--batch-size", type=int, help="global batch (default data x microbatches x 2)")
    ins.add_argument("--seed", type=int, default=0, help="PRNG seed for the model")
    ins.add_argument(
        "--lora",
        metavar="KEY=VALUE,...",
        help="add LoRA adapters (zoo.lora.add_lora) and train only them: the gradient all-reduce "
        "then carries the adapter bytes alone. Keys: r (rank, default 8), alpha (lora_alpha, "
        "default 8), dropout (the branches' input dropout, with per-example keys in the batch; "
        "transformer and encoder only), targets (Linear names joined by '+', e.g. q_proj+v_proj, or "
        "all-linear; default q_proj+v_proj, all-linear for mlp), exclude (names joined by '+'), "
        "rslora (true/false), save (modules_to_save, names joined by '+'; the encoder's default is "
        "head, its new classification head trained in full; save=none freezes it). "
        f"E.g. --lora {_LORA_EXAMPLE}",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ins.set_defaults(func=cmd_inspect)

    info = sub.add_parser(
        "info",
        help="list a model's array leaves with their logical axes, sharding and bytes per device",
        description="Build a model (no training step is compiled) and list every array leaf: path, "
        "shape, dtype, logical axes (zoo.logical_axes), PartitionSpec under the rules "
        "(zoo.partition_specs), whether it is trained, and its bytes per device (its bytes over the "
        "product of the mesh axis sizes its spec splits it over); then the totals.",
        epilog="examples: zoo info transformer; zoo info transformer --rules tp --mesh data=4,model=2; "
        f"zoo info encoder --lora {_LORA_EXAMPLE} --json",
    )
    info.add_argument("model", help=_MODEL_HELP)
    info.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    info.add_argument("--mesh", help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES)")
    info.add_argument(
        "--rules",
        default="dp",
        help=f"sharding rules preset: {', '.join(RULE_PRESETS)} (default dp); tp and fsdp+tp "
        "need a 'model' mesh axis, e.g. --mesh data=4,model=2",
    )
    info.add_argument("--seed", type=int, default=0, help="PRNG seed for the model")
    info.add_argument(
        "--lora",
        metavar="KEY=VALUE,...",
        help="add LoRA adapters (zoo.lora.add_lora): only they (and modules_to_save) are trainable; "
        "without it every float leaf is. Same keys as inspect --lora, e.g. " + _LORA_EXAMPLE,
    )
    info.add_argument("--json", action="store_true", help="print one JSON object (leaves, totals) instead of a table")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="train the zoo MLP on 8 simulated devices and show the collectives")
    demo.add_argument("model", nargs="?", default="mlp", help="model name (default mlp)")
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    demo.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    demo.add_argument("--per-device-batch", type=int, default=8, help="rows per device per microbatch")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--lr", type=float, default=3e-3, help="adamw learning rate")
    demo.add_argument("--seed", type=int, default=0, help="PRNG seed")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zoo` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"zoo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
