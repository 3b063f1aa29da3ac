"""How a run's settings are `zoo train`'s flags: each field of `RunConfig`, `DataConfig`
and `OptimizerConfig` carries its flag (`flag(...)`, dataclass field metadata), so a new
flag is one field with its metadata; the CLI generates its parser from them
(`RunConfig.flags(command)`, each help filled in from the registry: `help_texts`), and maps
the library's errors, which name fields (`RunConfig.batch_size`), to flags (`--batch-size`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .._presets import RULE_PRESETS
from ._registry import DATA_FILE_HELP, OPTIONAL_DEFAULT_KEYS, SHARED_DEFAULTS, model_names, model_spec
from ._text import LORA_EXAMPLE, LORA_HELP

# How --resume treats a flag. "fixed": it changes what is trained, so a resumed run
# refuses a new value and takes the saved run's (config.json) when not given; "safe": how
# long, where and how the run is laid out, evaluated, saved and shown, which may change
# (the saved value when not given); "launch": this launch's own (devices, mesh, whether to
# resume), never taken from config.json.
RESUME_KINDS = ("fixed", "safe", "launch")
GROUPS = ("devices and sharding", "training", "model and data", "evaluation and outputs")
COMMANDS = ("train", "finetune", "demo")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One config field as a flag of `zoo train` / `finetune` / `demo`.

    **Fields:**

    - `help`: what the flag does and its default, in words. `{name}` fields are filled
      per command from the registry (`RunConfig.flags(command)`, `help_texts`):
      `{per_model}`, `{command}`, `{data_sets}`, `{init_families}`, `{rule_presets}`,
      `{weight_decays}`, `{outputs}`, `{lora_keys}`, `{probe_demo}`.
    - `name`: the flag and flat key (`to_dict`) when not the field's name (`DataConfig.source`
      is `--data`); set by `RunConfig.flags()` otherwise.
    - `metavar`, `choices`: as argparse's.
    - `group`: the `--help` section, one of `Flag.groups`.
    - `resume`: how `--resume` treats it (`RESUME_KINDS`).
    - `commands`: the commands that take it.
    - `positional`: the command's positional argument (the model) instead of `--name`.
    - `repeat`: the flag may be given several times, each adding to its comma-separated list.
    - `field`: the owning field, `"RunConfig.steps"`; `kind`: `int`, `float`, `bool` or
      `str` (text forms: `--mesh`, `--lora`, `--model-config`), from the field's type.
      Both set by `RunConfig.flags()`.
    """

    help: str
    name: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    group: str = "training"
    resume: str = "fixed"
    commands: tuple[str, ...] = COMMANDS
    positional: bool = False
    repeat: bool = False
    field: str = ""
    kind: type = str

    groups: ClassVar[tuple[str, ...]] = GROUPS

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"Flag.group {self.group!r} is not one of {GROUPS}")
        if self.resume not in RESUME_KINDS:
            raise ValueError(f"Flag.resume {self.resume!r} is not one of {RESUME_KINDS}")

    @property
    def option(self) -> str:
        """The command-line spelling: `--batch-size`."""
        return "--" + str(self.name).replace("_", "-")


def flag(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A dataclass field whose metadata is its `Flag(**kwargs)`: `steps: int | None =
    flag(None, help="optimizer steps", metavar="N")`."""
    meta = {"flag": Flag(**kwargs)}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _kind(annotation: Any) -> type:
    """A field's flag type from its annotation (a string under `from __future__ import
    annotations`): bool, int, float (`float | int`), else str (a text form)."""
    parts = {p.strip() for p in str(annotation).split("|")} - {"None"}
    if parts == {"bool"}:
        return bool
    if parts == {"int"}:
        return int
    if parts == {"float", "int"}:
        return float
    return str


def fields_flags(cls: type) -> list[tuple[str, Flag]]:
    """`(field name, Flag)` of each flag field of the dataclass `cls`, `name`, `field` and
    `kind` filled in."""
    out = []
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata:
            meta = f.metadata["flag"]
            done = dataclasses.replace(
                meta, name=meta.name or f.name, field=f"{cls.__name__}.{f.name}", kind=_kind(f.type)
            )
            out.append((f.name, done))
    return out


# --------------------------------------------------------------------------- the help, filled in per command


def _model_help(command: str) -> str:
    """The model argument's help: every registered model `command` takes, with its help."""
    specs = [model_spec(n) for n in model_names(command)]
    text = "model: " + ", ".join(f"{s.name} ({s.help})" for s in specs)
    return text + (" (default: minilm if installed, else transformer)" if command == "demo" else "")


def _data_help(command: str) -> str:
    """`--data`'s help: the data sets of every model `command` takes, in words, then data files."""
    by_data: dict[str, list[str]] = {}
    words: dict[str, str] = {}
    for name in model_names(command):
        for data, text in model_spec(name).datasets.items():
            by_data.setdefault(data, []).append(name)
            words.setdefault(data, text)
    entries = [f"{d} ({'/'.join(models)}: {words[d]})" for d, models in by_data.items()]
    return (
        "what to train on: " + ", ".join(entries) + ". Default: per model, the first for train, the last for finetune"
    ) + DATA_FILE_HELP


def _defaults_table(command: str) -> str:
    """Each model's defaults for `command`, from the registry (`ModelSpec.defaults_for`)."""
    rows = []
    shared = SHARED_DEFAULTS[command]
    for model in model_names(command):
        d = model_spec(model).defaults_for(command)
        extra = "".join(
            f", {k.replace('_', '-')} {d[k]:g}" if not isinstance(d[k], str) else f", {k} {d[k]}"
            for k in OPTIONAL_DEFAULT_KEYS
            if d[k] is not None and d[k] != shared[k]
        )
        seq = f", seq-len {d['seq_len']}" if d.get("seq_len") else ""
        rows.append(
            f"{model}: steps {d['steps']}, batch-size {d['batch_size']}, microbatches {d['microbatches']}, "
            f"lr {d['lr']:g}{seq}{extra}"
        )
    return "; ".join(rows)


def _pooling_default(command: str) -> str:
    """The classifiers' default pooling for `command`, and the models that differ."""
    shared = SHARED_DEFAULTS[command]["pooling"]
    others = [
        f"{m}: {d['pooling']}"
        for m in model_names(command)
        if model_spec(m).classifier and (d := model_spec(m).defaults_for(command))["pooling"] != shared
    ]
    return shared + (f"; {', '.join(others)}" if others else "")


def help_texts(command: str) -> dict[str, str]:
    """What the flags' help (`Flag.help`) leaves to `command` (`train`, `finetune`,
    `demo`): its name, and from the registry its models, data sets, checkpoints, rules
    presets and shared defaults; `defaults` is the table of each model's defaults for the
    command (`zoo train --help`'s epilog), `lora_example` a `--lora` text. Reads the registries only (no jax)."""
    specs = [model_spec(n) for n in model_names()]
    return {
        "per_model": "default: per model, see below",
        "command": command,
        "models": _model_help(command),
        "data_sets": _data_help(command),
        "init_families": "; ".join(f"{s.name}: {'/'.join(s.init_families)}" for s in specs if s.init_families),
        "rule_presets": ", ".join(RULE_PRESETS),
        "weight_decays": ", ".join(f"{d['weight_decay']:g} for {c}" for c, d in SHARED_DEFAULTS.items()),
        "outputs": "adapter/" if command != "train" else "model/ (Hugging Face layout)",
        "lora_keys": LORA_HELP,
        "lora_example": LORA_EXAMPLE,
        "probe_demo": ", demo 300" if command == "demo" else "",
        "pooling_default": _pooling_default(command),
        "defaults": _defaults_table(command),
    }
