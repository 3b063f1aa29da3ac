"""`zoo inspect MODEL`: compile one training step and list its collectives."""

from __future__ import annotations

import argparse
import json

from ._common import (
    INSPECT_COMPILER_OPTIONS,
    CLIError,
    check_rules_fit_mesh,
    collective_summary,
    init_devices,
    make_mesh,
    parse_mesh,
    tree_bytes,
)
from ._lora_flag import LORA_EXAMPLE, LORA_HELP, add_lora, inspect_defaults, lora_json, parse_lora
from ._tasks import build_inspect_task, inspect_model_kind, vocab_multiple

INSPECT_MODEL_HELP = (
    "model name: mlp (a 4-layer MLP regressor), transformer (a tiny decoder-only LM, next-token "
    "loss), encoder (a tiny BERT-style classifier, padded tokens), minilm (the pretrained "
    "all-MiniLM-L6-v2 encoder with a 4-way head), or a Hugging Face folder / cached model id of any "
    "registered family (zoo.hf.families(): bert, gpt2, llama, mistral, qwen2, gemma)"
)


def rules_and_lora(args, mesh_shape: dict[str, int], devices: int):
    """Check `--rules` against the mesh and parse `--lora` (None without it)."""
    kind = inspect_model_kind(args.model)
    check_rules_fit_mesh(args.rules, mesh_shape, devices)
    return None if args.lora is None else parse_lora(args.lora, inspect_defaults(kind))


def cmd_inspect(args) -> int:
    """Compile one step of `args.model` and print its collectives (table or JSON)."""
    devices = init_devices(args.devices)
    mesh_shape = parse_mesh(args.mesh, devices)
    import equinox as eqx
    import jax
    import optax

    import zoo

    lora = rules_and_lora(args, mesh_shape, devices)
    if lora is not None and lora.lora_dropout and args.model == "mlp":
        raise CLIError("--lora dropout needs per-example keys, which the mlp's loss does not take; drop dropout=")
    data = mesh_shape.get("data", 1)
    batch_size = args.batch_size or data * args.microbatches * 2
    try:  # before building anything: the step would say the same after compiling the model
        zoo.internal.check_batch(jax.ShapeDtypeStruct((batch_size,), "int32"), data, args.microbatches)
    except ValueError as e:
        raise CLIError(str(e)) from e
    task = build_inspect_task(args.model, args.seed, vocab_multiple=vocab_multiple(args.rules, mesh_shape))
    if lora is not None:
        task.model = add_lora(task.model, lora, args.seed)
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        try:
            model = zoo.shard(task.model, zoo.rules(args.rules), mesh)
        except ValueError as e:
            raise CLIError(str(e)) from e
        options = {}
        if lora is not None:  # only the adapters (and modules_to_save) get gradients and all-reduces
            options["trainable"] = zoo.lora.trainable(model, lora)
        step = zoo.TrainStep(
            task.loss_fn,
            optax.adamw(1e-3),
            microbatches=args.microbatches,
            mode=args.mode,
            preset=args.rules,
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
        colls = zoo.collectives(lowered.compile(compiler_options=INSPECT_COMPILER_OPTIONS), mesh=mesh)
        trainable = step.partition(model)[0]
    result = {
        "model": args.model,
        "devices": devices,
        "microbatches": args.microbatches,
        "mode": args.mode,
        "rules": args.rules,
        "mesh": mesh_shape,
        "batch_size": batch_size,
        "param_bytes": tree_bytes(model),
        "trainable_bytes": tree_bytes(trainable),
        "lora": None if lora is None else lora_json(model, lora),
        "adapter_bytes": tree_bytes(eqx.filter(model, zoo.lora.trainable(model))),
        "collectives": [c.to_json() for c in colls],
        "summary": collective_summary(colls),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.model}: {devices} devices, mesh {mesh_shape}, {args.microbatches} microbatches, "
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


def add_mesh_flags(parser: argparse.ArgumentParser, *, step: bool) -> None:
    """--devices, --mesh, --rules (and, for a step, the preset's step options)."""
    from .._presets import RULE_PRESETS  # zoo's import leaves jax's backend alone

    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="devices: simulated CPU devices on CPU (default 8), real ones on GPU/TPU (default all)",
    )
    parser.add_argument("--mesh", help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES)")
    parser.add_argument(
        "--rules",
        default="dp",
        help=f"sharding rules preset: {', '.join(RULE_PRESETS)} (default dp); tp and fsdp+tp "
        "need a 'model' mesh axis, e.g. --mesh data=4,model=2"
        + ("; fsdp-once also sets the step's gather='once'" if step else ""),
    )


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `zoo inspect` and its flags."""
    ins = sub.add_parser(
        "inspect",
        help="list the collectives of a model's compiled training step",
        description="Compile one training step of a model on simulated CPU devices and list its "
        "collectives (all-reduces, all-gathers, ...), inside or outside loops, with the mesh axes "
        "they span.",
        epilog="examples: zoo inspect mlp; zoo inspect transformer --rules fsdp-once --json; "
        "zoo inspect encoder --mesh data=4,model=2 --rules tp; "
        f"zoo inspect transformer --lora {LORA_EXAMPLE}",
    )
    ins.add_argument("model", help=INSPECT_MODEL_HELP)
    add_mesh_flags(ins, step=True)
    ins.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    ins.add_argument("--mode", choices=("explicit", "shard_map"), default="explicit", help="step mode")
    ins.add_argument("--batch-size", type=int, help="global batch (default data x microbatches x 2)")
    ins.add_argument("--seed", type=int, default=0, help="PRNG seed for the model")
    ins.add_argument(
        "--lora",
        metavar="KEY=VALUE,...",
        help="add LoRA adapters (zoo.lora.add_lora) and train only them: the gradient all-reduce "
        "then carries the adapter bytes alone. Defaults: r=8, alpha=8, targets q_proj+v_proj (mlp: "
        f"all-linear), save=head for classifiers. {LORA_HELP}. Dropout needs per-example keys: "
        f"transformer, encoder and minilm only. E.g. --lora {LORA_EXAMPLE}",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ins.set_defaults(func=cmd_inspect)
    return ins
