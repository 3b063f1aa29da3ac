"""`zoo info MODEL`: every array leaf of the model `zoo train` (with `--lora`, `zoo
finetune`) would build from the same flags, with its logical axes, sharding and bytes per
device, without compiling a step."""

from __future__ import annotations

import json
import math
from typing import Any

from .. import internal
from ..train import RunConfig
from ._common import CLIError, init_devices
from ._inspect import add_mesh_flags, add_model_flags, model_help, model_of


def _leaf_rows(model: Any, axes: Any, specs: Any, trainable: Any, mesh_shape: dict[str, int]) -> list[dict[str, Any]]:
    """One row per array leaf of `model`: path, shape, dtype, logical axes, spec, trainable,
    bytes and bytes per device (each dimension over the product of the mesh axis sizes its
    spec entry names; nothing is placed on devices)."""
    import jax

    rows: list[dict[str, Any]] = []

    def one(path, x, names, spec, train):
        if not internal.is_array_like(x):
            return
        entries = tuple(spec) + (None,) * (x.ndim - len(spec))
        per_device = [
            dim if entry is None else math.ceil(dim / math.prod(mesh_shape[ax] for ax in _mesh_axes(entry)))
            for dim, entry in zip(x.shape, entries, strict=True)
        ]
        rows.append(
            {
                "path": internal.path_str(path),
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
    """Build `args.model` (no step) and print its leaf table (or JSON)."""
    devices = init_devices(args.devices)
    import jax
    import jax.numpy as jnp

    import zoo

    real = zoo.train.make_mesh(args.mesh, rules=args.rules, devices=devices)
    mesh_shape = dict(real.shape)
    built = model_of(args, real, abstract=True)  # shapes alone: a large config is not initialised
    model, lora = built.task.model, built.lora
    # The specs are checked against an abstract mesh of the same axes and sizes (only a
    # pretrained model's weights were read onto devices, as zoo train reads them).
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
    try:
        axes = zoo.logical_axes(model)
        specs = zoo.partition_specs(model, zoo.rules(args.rules), mesh)
    except ValueError as e:
        raise CLIError(str(e)) from e
    if lora is not None:
        trainable = zoo.lora.trainable(model, lora)
    else:
        trainable = jax.tree.map(lambda x: internal.is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact), model)
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
            "command": built.command,
            "seq_len": built.config.data.seq_len,
            "config": built.task.config,
            "init": built.task.init,
            "parameters": built.parameters,
            "devices": devices,
            "rules": args.rules,
            "mesh": mesh_shape,
            "lora": None if lora is None else internal.lora_json(model, lora),
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
    seq = "" if built.config.data.seq_len is None else f", seq-len {built.config.data.seq_len}"
    print(
        f"{args.model} (as zoo {built.command} builds it{seq}): mesh {mesh_shape}, rules {args.rules}"
        + ("" if lora is None else f", LoRA r={lora.r}")
    )
    for row in (header, *table):
        print(
            "  ".join(
                c.rjust(w) if i == len(row) - 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
    print(
        f"total: {totals['leaves']} leaves, {totals['parameters']:,} parameters, {totals['bytes']:,} bytes, "
        f"{totals['bytes_per_device']:,} bytes per device; trainable: {totals['trainable_parameters']:,} "
        f"parameters, {totals['trainable_bytes']:,} bytes"
    )
    return 0


def add_parser(sub):
    """Register `zoo info` and its flags."""
    info = sub.add_parser(
        "info",
        help="list a model's array leaves with their logical axes, sharding and bytes per device",
        description="Build the model zoo train builds from the same flags (with --lora: zoo finetune's), "
        "without compiling a step, and list every array leaf: path, "
        "shape, dtype, logical axes (zoo.logical_axes), PartitionSpec under the rules "
        "(zoo.partition_specs), whether it is trained, and its bytes per device (its bytes over the "
        "product of the mesh axis sizes its spec splits it over); then the totals.",
        epilog="examples: zoo info transformer; zoo info transformer --rules tp --mesh data=4,model=2; "
        f"zoo info encoder --lora {RunConfig.help_texts('train')['lora_example']} --json; zoo info minilm --lora r=8,targets=all-linear",
    )
    info.add_argument("model", help=model_help())
    add_mesh_flags(info, step=False)
    add_model_flags(info)
    info.add_argument("--json", action="store_true", help="print one JSON object (leaves, totals) instead of a table")
    info.set_defaults(func=cmd_info)
    return info
