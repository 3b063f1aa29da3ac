"""`zoo inspect MODEL`: compile the training step `zoo train` (with `--lora`, `zoo
finetune`) would run with the same flags (`zoo.train.inspect`), and list its collectives."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from .. import RULE_PRESETS, internal
from ..train import RunConfig, model_and_init, model_names, model_spec
from ._common import CLIError, init_devices


def model_help() -> str:
    """The help of `inspect`/`info`'s model argument: the registered models, or a folder."""
    names = ", ".join(f"{n} ({model_spec(n).help})" for n in model_names())
    return (
        f"model name: {names}; or a Hugging Face folder / cached model id of any registered family "
        "(zoo.hf.families()), built as the model whose --init takes it"
    )


@dataclasses.dataclass
class Built:
    """The model `zoo train` (or, with `--lora`, `zoo finetune`) would build from the
    same flags: its task (`zoo.train.build_task`, no data: random batches of the real
    shapes), the LoRA config, and the run config it was built from."""

    task: Any
    lora: Any
    command: str
    spec: Any
    config: Any  # the resolved `zoo.train.RunConfig`, data.source None
    parameters: int  # the model's before LoRA: what zoo train's summary.json reports


def resolve_model(args) -> tuple[Any, str | None, str]:
    """`(spec, init, command)` of `args.model`: a registered name, a family with `--init`,
    or a checkpoint (the spec whose --init takes it, with `init` the checkpoint:
    `zoo.train.model_and_init`). `command` is `finetune` with `--lora` (when the model
    has finetune defaults), else `train`: its defaults (`seq_len`, `batch_size`,
    `microbatches`) fill the flags not given."""
    name, init = model_and_init(args.model, args.init, args.revision)
    spec = model_spec(name)
    command = "finetune" if args.lora is not None and "finetune" in spec.defaults else "train"
    return spec, init, command


def config_of(args, spec, init: str | None, command: str) -> RunConfig:
    """The `zoo.train.RunConfig` of the flags given, as `zoo train` makes it (a flag left
    out: a field left unset) and without data unless `--data` is given; the library
    resolves it (`zoo.train.inspect`, `RunConfig.resolved`)."""
    if args.seq_len is not None and spec.defaults_for(command)["seq_len"] is None:
        raise CLIError(f"--seq-len: the {spec.name} has no sequences; drop --seq-len")
    fields = {str(f.name) for f in RunConfig.flags()}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    given |= {"model": spec.name, "init": init, "model_config": args.model_config}  # its text: the library's to read
    return RunConfig.from_dict({k: v for k, v in given.items() if v is not None})


def build_model(args, config: RunConfig, command: str, mesh, *, abstract: bool = False) -> Built:
    """Build the model `zoo train` / `zoo finetune` would from `config` (`config_of`,
    resolved for `command`, no data; through `zoo.train.build_task`, on `mesh`: pretrained
    weights are read onto it), with its LoRA adapters.

    `abstract`: a model built from scratch comes out as shapes alone (`jax.ShapeDtypeStruct`
    leaves, nothing initialised: `zoo.train.abstract_models`), its branches and quantised
    layers too; pretrained weights are still read."""
    import contextlib

    import jax

    import zoo

    config = config.resolved(command)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, source=None))
    spec = model_spec(config.model)
    lora = config.lora
    if lora is not None and lora.lora_dropout and spec.kind == "regression":
        raise CLIError(
            f"--lora dropout needs per-example keys, which the {spec.name}'s loss does not take; drop dropout="
        )
    with jax.set_mesh(mesh), zoo.train.abstract_models() if abstract else contextlib.nullcontext():
        task = zoo.train.build_task(config, rules=zoo.rules(args.rules), mesh=mesh)
    parameters = internal.tree_size(task.model)
    # An abstract base is adapted and quantised abstractly: the same shapes, nothing computed.
    with jax.set_mesh(mesh):
        if lora is not None:
            try:  # the branches' values do not matter here: only their shapes and axes are shown
                task.model = internal.on_shapes_too(
                    lambda m: zoo.lora.add_lora(m, lora, key=jax.random.key(config.seed)), task.model
                )
            except ValueError as e:
                raise CLIError(f"--lora: {e}") from e
        if config.quantize is not None:  # the base as zoo finetune --quantize stores it
            from ._generate import quantized_as_the_run

            try:
                task.model = internal.on_shapes_too(
                    lambda m: quantized_as_the_run(m, lora, config.quantize, zoo.rules(args.rules), mesh), task.model
                )
            except ValueError as e:
                raise CLIError(f"--quantize {config.quantize}: {str(e).splitlines()[0]}") from e
    return Built(task, lora, command, spec, config, parameters)


def model_of(args, mesh, *, abstract: bool = False) -> Built:
    """`build_model` of the flags (`resolve_model`, `config_of`) on `mesh`."""
    spec, init, command = resolve_model(args)
    return build_model(args, config_of(args, spec, init, command), command, mesh, abstract=abstract)


def cmd_inspect(args) -> int:
    """Compile the training step `zoo train` (`zoo finetune` with `--lora`) would run with
    these flags (`zoo.train.inspect`) and print its collectives (table or JSON)."""
    devices = init_devices(args.devices)
    import zoo

    spec, init, command = resolve_model(args)
    config = dataclasses.replace(config_of(args, spec, init, command), devices=devices)
    before = _collectives_of(args.against) if args.against else None  # a bad file refused before compiling
    ins = zoo.train.inspect(config, command=command)
    c, colls, lora = ins.config, ins.collectives, ins.config.lora
    budget, sizes = ins.budget()
    breaches = budget.breaches(colls, sizes)
    diff = zoo.compare_collectives(before, colls) if before is not None else None
    result = {
        "model": args.model,
        "command": ins.command,
        "devices": devices,
        "microbatches": c.microbatches,
        "mode": c.mode,
        "rules": c.rules,
        "mesh": c.mesh,
        "batch_size": c.batch_size,
        "seq_len": c.data.seq_len,
        "config": ins.task.config,
        "init": ins.task.init,
        **ins.sizes(),
        "collectives": [x.to_json() for x in colls],
        "summary": ins.summary(),
        "budget": {"name": budget.name, "within": not breaches, "breaches": [b.problem for b in breaches]},
    }
    if diff is not None:
        result["against"] = {
            "path": args.against,
            "added": [x.to_json() for x in diff.added],
            "removed": [x.to_json() for x in diff.removed],
        }
    code = 4 if args.budget and breaches else 1 if diff else 0
    if args.json:
        print(json.dumps(result))
        return code
    seq = "" if c.data.seq_len is None else f", seq-len {c.data.seq_len}"
    print(
        f"{args.model} (as zoo {ins.command} builds it): {internal.counted(devices, 'device')}, mesh {c.mesh}, "
        f"{internal.counted(c.microbatches, 'microbatch', 'microbatches')}, mode {c.mode}, rules {c.rules}, batch {c.batch_size}{seq}"
    )
    print(f"params {result['param_bytes']:,} bytes, trainable {result['trainable_bytes']:,} bytes")
    if lora is not None:
        adapted = result["lora"]["adapted_modules"]
        saved = result["trainable_bytes"] - result["adapter_bytes"]
        print(
            f"LoRA r={lora.r} alpha={lora.lora_alpha:g} on {result['lora_layers']} Linear layers "
            f"({', '.join(sorted({n.split('.')[-1] for n in adapted}))}): adapters {result['adapter_bytes']:,} bytes"
            + (f" + modules_to_save {saved:,} bytes" if lora.modules_to_save else "")
            + f" = {result['trainable_bytes']:,} trainable of the model's {result['model_bytes']:,} "
            f"({100 * result['trainable_bytes'] / result['model_bytes']:.2f}%, as the run says)"
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
    if args.budget:
        print(f"collectives: {budget.report(colls, sizes, what='the compiled training step')}")
    if diff is not None:
        print(f"against {args.against}:\n{diff}")
    return code


def _collectives_of(path: str) -> list:
    """The collectives a file holds: `zoo inspect --json`'s output or a run's summary.json."""
    import zoo

    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CLIError(
            f"--against {path}: cannot read it as JSON ({e}); give the output of zoo inspect --json "
            "or a run's summary.json"
        ) from e
    rows = data.get("collectives") if isinstance(data, dict) else None
    if isinstance(rows, dict):  # a run's summary.json
        rows = rows.get("list")
    if not isinstance(rows, list):
        raise CLIError(
            f"--against {path}: it holds no collectives; give the output of zoo inspect --json or a run's summary.json"
        )
    try:
        return [zoo.Collective.from_json(row) for row in rows]
    except (TypeError, ValueError) as e:
        raise CLIError(f"--against {path}: {e}") from e


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--init, --revision, --model-config, --dtype, --seq-len, --seed, --lora, --quantize: the flags of
    `zoo train` / `zoo finetune` that choose the model, with the same meaning and defaults."""
    lora = RunConfig.help_texts("finetune")  # `--lora`'s keys in words, as zoo finetune's help
    parser.add_argument(
        "--init",
        metavar="PATH",
        help="pretrained weights, as zoo train/finetune --init: a Hugging Face folder, a cached model id or a "
        "`zoo train` output folder (default: the model's own, e.g. built from scratch)",
    )
    parser.add_argument(
        "--revision",
        metavar="REV",
        help="the branch, tag or commit of the Hub model id MODEL or --init names, as zoo train --revision "
        "(default main)",
    )
    parser.add_argument(
        "--model-config",
        metavar="KEY=VALUE,...",
        help="model config fields to change, as zoo train --model-config, e.g. d_model=32,num_layers=2",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="compute dtype, as zoo train --dtype (default float32)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="L",
        help="tokens per example (default: the model's zoo train default, zoo finetune's with --lora); a "
        "model built from scratch takes it as its max_len, as zoo train does",
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for the model (default 0)")
    parser.add_argument(
        "--lora",
        metavar="KEY=VALUE,...",
        help="the model zoo finetune trains: LoRA adapters (zoo.lora.add_lora), only they (and modules_to_save) "
        "trainable; finetune's defaults (r=8, alpha=16, targets all-linear, save=head for classifiers) and "
        f"its per-model defaults of --seq-len, --batch-size, --microbatches. {lora['lora_keys']}. E.g. --lora "
        f"{lora['lora_example']}",
    )
    quantize = next(f for f in RunConfig.flags("finetune") if f.name == "quantize")
    parser.add_argument(
        quantize.option, metavar=quantize.metavar, help=f"with --lora, as zoo finetune: {quantize.help}"
    )


def add_mesh_flags(parser: argparse.ArgumentParser, *, step: bool) -> None:
    """--devices, --mesh, --rules (and, for a step, the preset's step options)."""
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
        help=f"sharding rules preset: {', '.join(RULE_PRESETS)} (default dp); tp, fsdp+tp, ep and ep+fsdp "
        "need a 'model' mesh axis, e.g. --mesh data=4,model=2"
        + ("; fsdp-once also sets the step's gather='once'" if step else ""),
    )


def add_step_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `zoo train` / `zoo finetune` that shape the training step and that
    `zoo inspect` has not declared itself (optimizer, clipping, objective, data, ...),
    with their meaning and help: `zoo inspect` with a run's flags compiles that run's step.
    A run's outputs, evaluations and checkpoints change no step and are left out."""
    for f in RunConfig.flags("train"):
        if f.positional or f.group == "evaluation and outputs" or f.option in parser._option_string_actions:
            continue
        text = f.help
        if f.kind is bool:
            parser.add_argument(f.option, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = None if f.kind is str else f.kind
            parser.add_argument(f.option, type=kind, metavar=f.metavar, choices=f.choices, help=text)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `zoo inspect` and its flags."""
    ins = sub.add_parser(
        "inspect",
        help="list the collectives of a model's compiled training step",
        description="Compile the training step zoo train runs with the same flags (with --lora: zoo "
        "finetune's; zoo.train.inspect: the same model, optimizer, placement and batch shapes), on random "
        "batches of its shapes unless --data is given, on simulated CPU devices, and list its collectives "
        "(all-reduces, all-gathers, ...), inside or outside loops, with the mesh axes they span.",
        epilog="examples: zoo inspect mlp; zoo inspect transformer --rules fsdp-once --json; "
        "zoo inspect encoder --mesh data=4,model=2 --rules tp; "
        "zoo inspect transformer --model-config d_model=32,num_layers=2 --seq-len 16 --batch-size 16; "
        f"zoo inspect transformer --lora {RunConfig.help_texts('train')['lora_example']}",
    )
    ins.add_argument("model", help=model_help())
    add_mesh_flags(ins, step=True)
    ins.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="microbatches per step (default: the model's zoo train/finetune default)",
    )
    ins.add_argument("--mode", choices=("explicit", "shard_map"), default="explicit", help="step mode")
    ins.add_argument(
        "--batch-size", type=int, metavar="B", help="global batch (default: the model's zoo train/finetune default)"
    )
    add_model_flags(ins)
    add_step_flags(ins)
    ins.add_argument(
        "--budget",
        action="store_true",
        help="check the step against its preset's collective budget (zoo.preset(RULES).budget) and print the "
        "verdict, or each collective over budget with its source line (exit 4)",
    )
    ins.add_argument(
        "--against",
        metavar="JSON",
        help="compare with the collectives in JSON (an earlier zoo inspect --json, or a run's summary.json): "
        "print what was added and removed (exit 1 when they differ)",
    )
    ins.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ins.set_defaults(func=cmd_inspect)
    return ins
