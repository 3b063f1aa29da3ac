"""How a run's settings are `zoo train`'s flags: each field of `RunConfig`, `DataConfig`
and `OptimizerConfig` carries its flag (`flag(...)`, dataclass field metadata), so a new
flag is one field with its metadata; the CLI generates its parser from them
(`RunConfig.flags()`), and maps the library's errors, which name fields
(`RunConfig.batch_size`), to flags (`--batch-size`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

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

    - `help`: what the flag does and its default, in words. `{name}` fields are filled by
      the command from the registry (`zoo._cli`'s `help_context`): `{per_model}`,
      `{command}`, `{data_sets}`, `{init_families}`, `{rule_presets}`,
      `{weight_decays}`, `{outputs}`, `{lora_keys}`, `{probe_demo}`.
    - `name`: the flag and flat key (`to_dict`) when not the field's name (`DataConfig.source`
      is `--data`); set by `RunConfig.flags()` otherwise.
    - `metavar`, `choices`: as argparse's.
    - `group`: the `--help` section, one of `Flag.groups`.
    - `resume`: how `--resume` treats it (`RESUME_KINDS`).
    - `commands`: the commands that take it.
    - `positional`: the command's positional argument (the model) instead of `--name`.
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
            done = dataclasses.replace(meta, name=meta.name or f.name, field=f"{cls.__name__}.{f.name}",
                                       kind=_kind(f.type))  # fmt: skip
            out.append((f.name, done))
    return out
