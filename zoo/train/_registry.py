"""The model registry: a name → how its training task is built, its defaults per command,
its data and which pretrained checkpoints its `--init` takes.

`zoo train NAME`, `zoo finetune NAME`, `zoo info NAME` and `zoo inspect NAME` look `NAME`
up here (`model_spec`), and `zoo.train.build_task` builds the spec's task: every command
builds the same model from the same settings. The built-in models (`mlp`, `transformer`,
`encoder`, `minilm`) are registered by `zoo.train` itself; `register_model` adds one.

Which Hugging Face folders a spec's `--init` takes comes from two registries that meet
at a zoo model class: a spec names the class its `--init` builds (`init_class`,
`zoo.models.Transformer` or `zoo.models.Encoder`), and the architecture registry
(`zoo.hf.families()`) says which class a folder's `config.json` `model_type` builds.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._lazy import resolve_class
from ._errors import ConfigError

KINDS = ("regression", "lm", "classification")
COMMANDS = ("train", "finetune", "demo")
# The per-command defaults every spec gives.
DEFAULT_KEYS = ("steps", "batch_size", "microbatches", "lr", "seq_len")
# The per-command defaults a spec may give; without them, every model's below.
OPTIONAL_DEFAULT_KEYS = ("weight_decay", "warmup", "eval_every", "probe", "pooling")
# Every model's defaults per command, under the spec's own: training every weight decays
# them; fine-tuning adapters does not (peft's and transformers' recipes). An unset warmup
# and eval_every follow the run's length (`RunConfig.resolved`).
# A classifier's head reads the mean of the hidden states unless the spec says otherwise
# (`pooling`; other kinds ignore it).
SHARED_DEFAULTS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
    "train": types.MappingProxyType({"weight_decay": 0.01, "warmup": None, "eval_every": None, "probe": 0,
                                     "pooling": "mean"}),
    "finetune": types.MappingProxyType({"weight_decay": 0.0, "warmup": None, "eval_every": None, "probe": 0,
                                        "pooling": "mean"}),
    "demo": types.MappingProxyType({"weight_decay": 0.0, "warmup": None, "eval_every": None, "probe": 0,
                                    "pooling": "mean"}),
})  # fmt: skip
# What the preference objectives (dpo, orpo) take where the run does not say: TRL's
# `DPOConfig` / `ORPOConfig` defaults (tests/test_preference.py compares them), over the
# model's own learning rate, which is an SFT one.
PREFERENCE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({"lr": 1e-6})
# The LoRA of `zoo finetune` (a `zoo.lora.LoraConfig`'s fields): rank 8, scaling 2, on every
# Linear layer but the output head (peft's `all-linear`); a classifier's new head, which
# LoRA cannot adapt from nothing, trained in full (peft's modules_to_save=["classifier"]).
LORA_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
CLASSIFIER_SAVE = ("head",)
# How a user's data file (`--data FILE`) is read when the run does not say.
DATA_FILE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({"validation": 0.1, "packed": True})
# What `--data`'s help says of a user's data file, after the registered data sets.
DATA_FILE_HELP = (
    "; or your own file: .txt, .jsonl or .json with text, prompt+completion or messages (chat) for transformer, "
    ".jsonl, .json or .csv with text+label for encoder/minilm (docs/data.md); finetune: several LoRA adapters at once "
    'from a .jsonl whose records name their adapter ("adapter": NAME) or from one file per adapter, '
    "NAME=FILE,NAME=FILE (docs/training.md)"
)


class _ClassField:
    """A dataclass field that takes a class or its import path and reads as the class,
    imported on first read; `declared(spec)` is what was given."""

    def __set_name__(self, owner: type, name: str):
        self.slot = f"_{name}"

    def __get__(self, spec: Any, owner: type | None = None) -> type | None:
        if spec is None:
            return None  # the field's default
        declared = self.declared(spec)
        return None if declared is None else resolve_class(declared)

    def __set__(self, spec: Any, value: type | str | None):
        object.__setattr__(spec, self.slot, value)

    def declared(self, spec: Any) -> type | str | None:
        return getattr(spec, self.slot)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model the `zoo` commands and `zoo.train.build_task` know by name.

    **Arguments:**

    - `name`: the name (`zoo train NAME`); not a path (no `/`).
    - `help`: what the model is, in a few words (the CLI's model help).
    - `kind`: `"regression"`, `"lm"` (next-token loss) or `"classification"`.
    - `build`: `build(config, *, rules, mesh) -> zoo.train.Task`, given the run's
      `zoo.train.RunConfig` (its defaults applied: `RunConfig.resolved`) whose `model` is
      this spec's. `config.data.source` is one of `datasets`, or None when only the
      model is wanted (`zoo info` / `zoo inspect`): the builder may then skip loading
      data, and the task's `train_source` only needs to give batches of the right shapes
      and dtypes. Raise `zoo.train.ConfigError` for bad settings.
    - `defaults`: per command (`"train"`, `"finetune"`, `"demo"`), the defaults of the
      settings that depend on the model: `steps`, `batch_size`, `microbatches`, `lr`,
      `seq_len` (None for models without sequences), and where the model differs from
      every model's (`SHARED_DEFAULTS`) `weight_decay`, `warmup`, `eval_every`, `probe`,
      `pooling` (classifiers: `"cls"` or `"mean"`).
      `RunConfig.resolved` fills a run's unset fields from them. A command missing here
      does not take the model (`zoo finetune mlp` is refused).
    - `datasets`: the data names it trains on (`--data`) → what each is, in words. The
      first is `train`'s default, the last `finetune`'s.
    - `scratch_config`: the model config (as a dict) of a model built without `--init`;
      `--model-config` changes it. None: none (every model is loaded).
    - `init_class`: the zoo model class its `--init` checkpoints build
      (`zoo.models.Transformer`, `zoo.models.Encoder`), or its import path
      (`"zoo.models.Transformer"`: read, the class, imported then; the built-ins give
      paths, so registering them loads no jax); None: it takes no `--init`.
    - `finetune_needs_init`: whether `zoo finetune` needs `--init` (a model built from
      scratch has nothing to adapt).
    - `pretrained`: `() -> Path`, the checkpoint folder used when `--init` is not given
      (its shape is fixed: `--model-config` changes only dropout, remat, dtype); None:
      built from `scratch_config`.
    - `dtypes`: the compute dtypes it takes (`--dtype`).
    - `file_model`: `file_model(config, num_labels, *, rules, mesh) -> (model,
      model_config, folder)` (`config` the `RunConfig`), the model it trains on a user's
      data file (`--data FILE`, read by `zoo.data.load` with the model's tokenizer): for
      kind `"lm"` a decoder taking `[batch, seq]` token ids (`num_labels` is None), for
      `"classification"` a classifier with a new `num_labels`-way head taking `tokens`
      and `mask`. `model_config` is the model's config (`vocab_size`, `to_dict()`),
      `folder` the Hugging Face folder it was loaded from (its tokenizer reads the file)
      or None (byte tokens). None: the model trains on its `datasets` only.
    """

    name: str
    help: str
    kind: str
    build: Callable[..., Any]
    defaults: Mapping[str, Mapping[str, Any]]
    datasets: Mapping[str, str]
    scratch_config: Mapping[str, Any] | None = None
    init_class: type | str | None = _ClassField()  # type: ignore[assignment]
    finetune_needs_init: bool = False
    pretrained: Callable[[], Path] | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    file_model: Callable[..., Any] | None = None

    def __post_init__(self):
        # Read-only views: a spec is shared by every command of the process.
        defaults = {c: types.MappingProxyType(dict(d)) for c, d in self.defaults.items()}
        object.__setattr__(self, "defaults", types.MappingProxyType(defaults))
        object.__setattr__(self, "datasets", types.MappingProxyType(dict(self.datasets)))
        if self.scratch_config is not None:
            object.__setattr__(self, "scratch_config", types.MappingProxyType(dict(self.scratch_config)))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))

    @property
    def init_families(self) -> list[str]:
        """The Hugging Face families (`config.json` `model_type`s) whose checkpoints its
        `--init` takes (`zoo.train.init_families(init_class)`); empty when it takes none.
        An `init_class` given as a path stays unimported."""
        declared = vars(ModelSpec)["init_class"].declared(self)
        return [] if declared is None else init_families(declared)

    @property
    def classifier(self) -> bool:
        """Whether the model is a classifier (a new head, trained in full under LoRA)."""
        return self.kind == "classification"

    @property
    def lora_defaults(self) -> dict[str, Any]:
        """The `zoo.lora.LoraConfig` fields of `zoo finetune`'s LoRA for this model: what
        a fine-tuning run takes without one, and what `--lora` keys it leaves out."""
        return dict(LORA_DEFAULTS) | ({"modules_to_save": CLASSIFIER_SAVE} if self.classifier else {})

    def defaults_for(self, command: str) -> dict[str, Any]:
        """The defaults of `command`: every model's (`SHARED_DEFAULTS`) under the spec's
        own. A `ConfigError` naming the commands that take the model when it is not one of
        them."""
        if command not in self.defaults:
            hint = f"; the {self.name} has no pretrained weights to adapt: zoo train {self.name}"
            raise ConfigError(
                f"zoo {command} does not take {self.name!r}; choose one of {model_names(command)}"
                + (hint if command != "train" and self.init_class is None else "")
            )
        return dict(SHARED_DEFAULTS[command]) | dict(self.defaults[command])

    def data_for(self, command: str) -> str:
        """The default data of `command`: the first data set for `train`, the last for the
        others (fine-tuning moves a model to another domain where there is one)."""
        names = list(self.datasets)
        return names[0] if command == "train" else names[-1]


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Add `spec` to the registry under `spec.name`, checked.

    **Arguments:**

    - `spec`: the `ModelSpec`.
    - `replace`: allow replacing a registered spec of the same name (else a
      `ConfigError`).

    **Returns:** `spec`.
    """
    if not spec.name or "/" in spec.name or spec.name.strip() != spec.name:
        raise ConfigError(f"model name {spec.name!r}: give a non-empty name without '/' or spaces around it")
    if spec.name in _REGISTRY and not replace:
        raise ConfigError(f"model {spec.name!r} is already registered; pass replace=True to replace it")
    if spec.kind not in KINDS:
        raise ConfigError(f"model {spec.name!r}: kind {spec.kind!r} is not one of {list(KINDS)}")
    if not callable(spec.build):
        raise ConfigError(f"model {spec.name!r}: build must be a function (config, *, rules, mesh) -> Task")
    if spec.file_model is not None and (not callable(spec.file_model) or spec.kind not in ("lm", "classification")):
        raise ConfigError(
            f"model {spec.name!r}: file_model must be a function (config, num_labels, *, rules, mesh) -> "
            "(model, model_config, folder), and only a model of kind 'lm' or 'classification' trains on data files"
        )
    if "train" not in spec.defaults:
        raise ConfigError(f"model {spec.name!r}: defaults needs a 'train' entry (the defaults of zoo train)")
    for command, values in spec.defaults.items():
        if command not in COMMANDS:
            raise ConfigError(f"model {spec.name!r}: defaults for {command!r}; commands are {list(COMMANDS)}")
        missing = [k for k in DEFAULT_KEYS if k not in values]
        if missing:
            raise ConfigError(f"model {spec.name!r}: the {command} defaults lack {missing}")
        unknown = sorted(set(values) - set(DEFAULT_KEYS) - set(OPTIONAL_DEFAULT_KEYS))
        if unknown:
            raise ConfigError(
                f"model {spec.name!r}: the {command} defaults hold {unknown}, which no model sets; "
                f"a spec's defaults are {list(DEFAULT_KEYS + OPTIONAL_DEFAULT_KEYS)}"
            )
    if not spec.datasets:
        raise ConfigError(f"model {spec.name!r}: datasets is empty; name at least one data set")
    _REGISTRY[spec.name] = spec
    return spec


def model_spec(name: str | None) -> ModelSpec:
    """The spec registered as `name`; a `ConfigError` listing the registered names."""
    if name is None:
        raise ConfigError(f"no model given; name one of {model_names()}")
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; choose one of {model_names()}")
    return _REGISTRY[name]


def model_names(command: str | None = None) -> list[str]:
    """The registered model names, in registration order; with `command`, only those
    that command takes (a spec with defaults for it)."""
    return [n for n, s in _REGISTRY.items() if command is None or command in s.defaults]


def init_families(model_class: type | str) -> list[str]:
    """The Hugging Face families (`config.json` `model_type`s, from `zoo.hf.families()`)
    whose checkpoints build a `model_class` (a class or its import path,
    `"zoo.models.Transformer"`: then no model is imported): what an `--init` of a spec
    with this `init_class` takes."""
    from .. import hf

    return [name for name, family in hf.families().items() if family.builds(model_class)]


def check_init_family(spec: ModelSpec, folder: Path) -> None:
    """Refuse `--init folder` unless its `model_type` builds `spec.init_class`: a
    `ConfigError` naming the families the model takes and the models that take it."""
    from .. import hf
    from ..hf._files import read_config

    if spec.init_class is None:
        raise ConfigError(f"RunConfig.init: the {spec.name} has no pretrained weights; drop RunConfig.init")
    config = folder / "config.json"
    try:
        model_type = read_config(folder).get("model_type")
        family = hf.get_family(model_type, str(config))
    except (OSError, ValueError) as e:
        raise ConfigError(f"RunConfig.init {folder}: {str(e).splitlines()[0]}") from e
    if issubclass(family.model_class, spec.init_class):
        return
    others = [
        n
        for n, s in _REGISTRY.items()
        if s.init_class is not None and issubclass(family.model_class, s.init_class) and s.pretrained is None
    ]
    raise ConfigError(
        f"RunConfig.init {folder} holds a {model_type} checkpoint (a {family.model_class.__name__}); {spec.name} takes "
        f"{' / '.join(init_families(spec.init_class))} checkpoints"
        + (f", {' / '.join(others)} takes this one" if others else "")
    )


def spec_for_init(folder: Path) -> ModelSpec:
    """The first registered spec built from scratch whose `--init` takes the checkpoint
    in `folder` (a decoder: `transformer`, a BERT: `encoder`); a `ConfigError` if none."""
    from .. import hf
    from ..hf._files import read_config

    config = folder / "config.json"
    try:
        model_type = read_config(folder).get("model_type")
        family = hf.get_family(model_type, str(config))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder}: {str(e).splitlines()[0]}") from e
    for spec in _REGISTRY.values():
        if spec.init_class is not None and spec.pretrained is None and issubclass(family.model_class, spec.init_class):
            return spec
    raise ConfigError(f"{folder}: no registered model takes a {model_type} checkpoint; registered: {model_names()}")


# --------------------------------------------------------------------------- a model config's values checked
# The checks of `RunConfig.model_config` (`zoo train --model-config`): each value of the
# right kind and range, and a pretrained model's shape left as it is. Errors name the field
# (`RunConfig.model_config`), which the CLI shows as its flag.


# Keys by kind: sizes (ints >= 1), ids (ints >= 0), probabilities in [0, 1), positive
# floats; other keys are left to the model's config class.
SIZES = (
    "width",
    "depth",
    "vocab_size",
    "d_model",
    "num_heads",
    "num_layers",
    "mlp_dim",
    "max_len",
    "num_kv_heads",
    "head_dim",
    "type_vocab_size",
)
IDS = ("pad_token_id",)
PROBABILITIES = ("dropout", "attention_dropout")
POSITIVE = ("norm_eps", "init_std", "rope_theta")
_NULLABLE = ("mlp_dim", "num_kv_heads", "head_dim")
_MAX_SIZE = 2**31 - 1
# What `model_config` may change of a pretrained model whose shape is fixed.
PRETRAINED_KEYS = ("dropout", "attention_dropout", "remat", "dtype")


def check_model_config(values: dict[str, Any]) -> None:
    """Raise `ConfigError` naming the first value of `values` (a `RunConfig.model_config`)
    of the wrong kind or range: sizes are integers >= 1 (at most 2**31 - 1), ids integers
    >= 0, dropouts probabilities in [0, 1), `norm_eps` / `init_std` / `rope_theta` numbers
    > 0, and every float finite."""
    if not isinstance(values, dict):
        raise ConfigError(f"RunConfig.model_config must be a dict of config key -> value, got {values!r}")
    for key, value in values.items():
        where = f"RunConfig.model_config {key}={value}"
        if key in SIZES + IDS and not (key in _NULLABLE and value is None):
            low = 1 if key in SIZES else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                example = f", e.g. {key}=64" if key in SIZES else ""
                raise ConfigError(f"{where}: {key} must be an integer >= {low}{example}")
            if value > _MAX_SIZE:
                raise ConfigError(f"{where}: {key} must be at most {_MAX_SIZE} (array dimensions are int32)")
        elif key in PROBABILITIES + POSITIVE:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{where}: {key} must be a finite number")
            if key in PROBABILITIES and not 0 <= value < 1:
                raise ConfigError(f"{where}: {key} is a probability in [0, 1)")
            if key in POSITIVE and not value > 0:
                raise ConfigError(f"{where}: {key} must be > 0")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite")


def check_pretrained_shape(model: str, values: dict[str, Any], fixed: bool) -> None:
    """A pretrained model's shape is its checkpoint's: when `fixed` (the model loads its
    own weights, no `init`), `values` may only hold `PRETRAINED_KEYS`."""
    if fixed and values.keys() - set(PRETRAINED_KEYS):
        raise ConfigError(
            f"RunConfig.model_config: the pretrained {model}'s shape is fixed; only dropout, attention_dropout and "
            "remat can change"
        )


# --------------------------------------------------------------------------- what a run's model and init name
# What a run's `model` names: a registered model (`transformer`), a Hugging Face family
# (`llama`, with the checkpoint as `init`), or the checkpoint itself (a folder, a `zoo
# train` run, or a Hub id `org/name`, fetched into the local cache when it is not there):
# `zoo finetune Qwen/Qwen3-0.6B` is `zoo finetune transformer --init Qwen/Qwen3-0.6B`.
# Also the folder an `init` names (`resolve_init`).
#
# Loads no jax: the CLI answers a misspelt name before anything starts (`check_model_name`).


def _families() -> list[str]:
    from .. import hf

    return list(hf.families())


def _spec_of_family(family: str):
    """The first registered model built from scratch whose `init` takes `family`."""
    for name in model_names():
        spec = model_spec(name)
        declared = vars(type(spec))["init_class"].declared(spec)
        if declared is not None and spec.pretrained is None and family in init_families(declared):
            return spec
    raise ConfigError(f"RunConfig.model {family!r}: no registered model takes {family} checkpoints")


def is_checkpoint_name(model: str) -> bool:
    """Whether `model` names a checkpoint rather than a registered model or family: an
    existing path, or anything with a `/` (a path or a Hub id `org/name`)."""
    return "/" in model or Path(model).expanduser().exists()


def check_model_name(model: str | None) -> None:
    """Refuse a `model` that is neither registered, nor a family, nor a checkpoint's name
    (`is_checkpoint_name`): a `ConfigError` listing the names, with the nearest ones
    (`did you mean`). Reads nothing but the registries."""
    if model is None or model in model_names() or model in _families() or is_checkpoint_name(model):
        return
    close = difflib.get_close_matches(model, model_names() + _families(), n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(
        f"unknown model {model!r}; choose one of {model_names()}{hint}, a Hugging Face family with its checkpoint "
        f"as RunConfig.init ({', '.join(_families())}), or a checkpoint: a folder, a `zoo train` run or a Hub id "
        "(org/name)"
    )


def model_and_init(model: str | None, init: str | None, revision: str | None = None) -> tuple[str | None, str | None]:
    """`(registered model, init)` of a run's `model` and `init`.

    - a registered name: as given;
    - a family (`llama`, `bert`; `zoo.hf.families()`): the model whose `init` takes it
      (`transformer`, `encoder`), `init` required;
    - a checkpoint (`is_checkpoint_name`: a Hugging Face folder, a `zoo train` run, a Hub
      id): the model whose `init` takes it, with `init` the checkpoint (a Hub id not in the
      cache is fetched now, at `revision`, `zoo.hf.download`); `init` must not be given too.

    **Returns:** the pair; a `ConfigError` naming what was tried otherwise.
    """
    if model is None or model in model_names():
        return model, init
    check_model_name(model)
    if model in _families():
        spec = _spec_of_family(model)
        if not init:
            here = Path(model)
            # A folder of the family's name in the working folder: the name alone reads as the family.
            hint = f" (the folder {model} here: give it as ./{model})" if (here / "config.json").is_file() else ""
            raise ConfigError(
                f"RunConfig.model {model!r} names a family: give its checkpoint as RunConfig.init (a {model} folder, "
                f"a `zoo train` run or a Hub id), or the checkpoint itself as RunConfig.model{hint}"
            )
        return spec.name, init
    if init:
        raise ConfigError(
            f"RunConfig.model {model!r} is a checkpoint and RunConfig.init {init!r} another: give the checkpoint once "
            "(as RunConfig.model, or RunConfig.init with a registered model)"
        )
    run = Path(model).expanduser()
    if (run / "adapter").is_dir() and (run / "config.json").is_file():  # a `zoo finetune` run: its own model
        name = json.loads((run / "config.json").read_text()).get("model")
        if name in model_names():
            return name, model
    folder = resolve_init(model, what="RunConfig.model", revision=revision)
    return spec_for_init(folder).name, model


def check_revision(init: str | None, revision: str | None) -> None:
    """Refuse a `revision` without a Hub id to pin (no `init`, or a local folder or run
    there: it has no revisions), in a `ConfigError` saying what to give. Reads no weight."""
    if revision and not init:
        raise ConfigError(
            f"RunConfig.revision {revision!r} pins the Hub model RunConfig.init names, and this run has no "
            "RunConfig.init: drop RunConfig.revision, or name the model's Hub id (org/name)"
        )
    if revision and init and Path(init).expanduser().exists():
        resolve_init(init, what="RunConfig.init", revision=revision)  # its refusal


def pinned_revision(init: str | None, revision: str | None) -> str | None:
    """The commit a run of `init` at `revision` (a branch, tag or commit; None: `main`)
    records, so that resuming it, generating from it or exporting it later reads the same
    weights even after the branch moved: for a Hub id, the commit of the cache snapshot
    `resolve_init` finds (fetched now if missing); None for anything else. A `ConfigError`
    as `check_revision`'s, or naming a revision the Hub does not have."""
    check_revision(init, revision)
    if not init or Path(init).expanduser().exists():
        return None
    from ..hf._hub import hub_id_of

    found = hub_id_of(resolve_init(init, what="RunConfig.init", revision=revision))
    return found[1] if found else revision


def resolve_init(path: str, *, what: str = "--init", revision: str | None = None) -> Path:
    """The Hugging Face model folder `--init PATH` names: PATH itself (`config.json` +
    `model.safetensors`), the `model/` folder of a `zoo train` output folder, a `zoo
    finetune` run's model, its adapter merged into its base (`merged_folder`:
    written once into zoo's cache by `zoo.train.run`), or a model
    id (`org/name`) in the local Hugging Face cache, fetched from the Hub when it is not
    there, at `revision` (a branch, tag or commit; `zoo.hf.resolve_model_dir`); a
    `ConfigError` naming what was tried (`what`: the setting that named it), or refusing a
    `revision` for a local folder or run (it has none: its own config.json pins its base's)."""
    folder = Path(path).expanduser()
    if revision and folder.exists():
        raise ConfigError(
            f"RunConfig.revision {revision!r} names a commit of a Hub model, and {what} {path} is a local folder, "
            "which has no revisions (a run pins its base's commit in its config.json): drop RunConfig.revision, or "
            "give the model's Hub id (org/name)"
        )
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file() and any(candidate.glob("model*.safetensors*")):
            if "model_type" in json.loads((candidate / "config.json").read_text(encoding="utf-8-sig")):
                return candidate
    if not folder.exists():
        from .. import hf
        from ..hf._hub import looks_like_id

        if "/" not in path or not looks_like_id(path):
            raise ConfigError(
                f"{what} {path}: no such folder; pass a Hugging Face model folder, a `zoo train` run or a Hub id "
                "(org/name)"
            )
        try:  # a model id: in the local Hugging Face cache, else fetched from the Hub
            return resolve_init(str(hf.resolve_model_dir(path, revision=revision)), what=what)
        except FileNotFoundError as e:
            raise ConfigError(f"{what} {path}: {e}") from None
    if (folder / "adapter").is_dir() and (folder / "config.json").is_file():  # a `zoo finetune` run
        return merged_folder(folder, what)
    raise ConfigError(
        f"{what} {path}: neither a Hugging Face model folder (config.json with model_type + model.safetensors) "
        "nor a `zoo train` output folder holding one in model/ (the mlp's runs have none)"
    )


# --------------------------------------------------------------------------- a finetune run as init
# A `zoo finetune` run as the pretrained weights of another (`--init runs/sft`, e.g. SFT
# then DPO): its adapter merged into its base (`zoo.lora.merge`), written once as a Hugging
# Face folder into zoo's cache and read from there as any `--init` folder. This module
# names the folder (`merged_path`, for `resolve_init`); `zoo.train.run` writes it first
# (`_saved_run.merge_run`), so that reading an `--init` never loads a run.
#
# Merged, not stacked under the new adapter: the new run then starts from exactly the
# model the first one ended with (its outputs equal the first run's), trains one adapter of
# its own that peft opens on that merged base, and DPO's reference (the base with the new
# adapter off) is the SFT model, as TRL's recipe has it.


def merged_cache() -> Path:
    """`$XDG_CACHE_HOME/zoo/merged`, or `~/.cache/zoo/merged`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zoo" / "merged"


def merged_path(run: Path, what: str = "--init") -> Path:
    """Where the merged model of the `zoo finetune` run `run` is: `merged_cache()/DIGEST`
    (the digest of the run's config.json and adapter weights: a run trained further gets
    a new folder). Raises `ConfigError` for a run of several adapters (export the one to
    start from: `zoo export RUN --merge --output DIR`, then `--init DIR`)."""
    weights = run / "adapter" / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(
            f"{what} {run}: a `zoo finetune` run of several adapters (adapter/NAME/); merge the one to start from: "
            f"zoo export {run} --merge --output DIR, then pass DIR"
        )
    digest = hashlib.sha256((run / "config.json").read_bytes() + weights.read_bytes()).hexdigest()[:20]
    return merged_cache() / digest


def shapes_folder(path: str, what: str = "--init", revision: str | None = None) -> Path:
    """The Hugging Face folder with the shapes of `--init PATH`'s model, for `zoo info` and
    `zoo inspect`, which need no weight of their own: `resolve_init`'s folder, except that a
    `zoo finetune` run (one whose init is another such run too) gives its base's, read from
    the runs' config.json files. Merging an adapter changes no shape, so nothing is merged
    and zoo's cache is not needed. A run with no init (a pretrained default): `resolve_init`.
    `revision`: `path`'s (a Hub id's); each run's base at the revision its config.json pins."""
    folder = Path(path).expanduser()
    for _ in range(16):  # a chain of runs, each started from the one before
        if not ((folder / "adapter").is_dir() and (folder / "config.json").is_file()):
            return resolve_init(str(folder), what=what, revision=revision)
        try:
            saved = json.loads((folder / "config.json").read_text(encoding="utf-8-sig"))
            init, revision = saved.get("init"), saved.get("revision")
        except (OSError, ValueError, AttributeError):  # unreadable: resolve_init's own words
            break
        if not init:
            break
        folder = Path(init).expanduser()
    return resolve_init(path, what=what)


def merged_folder(run: Path, what: str = "--init") -> Path:
    """`merged_path(run)` once written (by `zoo.train.run`, `_saved_run.merge_run`); a
    `ConfigError` saying how to get it otherwise."""
    folder = merged_path(run, what)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    raise ConfigError(
        f"{what} {run}: a `zoo finetune` run, which zoo train / zoo finetune merge into its base when they start; "
        f"here, export it first: zoo export {run} --merge --output DIR, then pass DIR"
    )
