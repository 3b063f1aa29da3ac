"""`RunConfig`: a run's settings (`RunSettings`), what they resolve to for a model and a
command (`resolved`: the model's defaults, and a resumed run's config.json inherited), and
their flat JSON form (`to_dict`, `from_dict`: a run's config.json)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

from ..lora import LoraConfig
from ._errors import ConfigError
from ._flags import Flag, fields_flags, help_texts
from ._optimizer import OptimizerConfig
from ._registry import (
    DATA_FILE_DEFAULTS,
    PREFERENCE_DEFAULTS,
    ModelSpec,
    check_pretrained_shape,
    check_revision,
    model_and_init,
    model_names,
    model_spec,
    pinned_revision,
)
from ._scores import WATCHED, watched_metric
from ._settings import OBJECTIVE_DEFAULTS, DataConfig, GRPOConfig, RunSettings
from ._text import absolute_files, lora_text, mesh_text, parse_lora, parse_mesh, parse_pairs, parse_scalar

# The flat keys of the nested configs' fields (`DataConfig.source` is `data`), from their flags.
_DATA_KEYS = {f.name: field for field, f in fields_flags(DataConfig)}
_OPTIMIZER_KEYS = {f.name: field for field, f in fields_flags(OptimizerConfig)}
_GRPO_KEYS = {f.name: field for field, f in fields_flags(GRPOConfig)}


@dataclasses.dataclass(frozen=True)
class RunConfig(RunSettings):
    """Everything a run (`zoo.train.run`) needs; the field names are `zoo train`'s flags
    (`batch_size` is `--batch-size`). A field left None takes its default for the model
    and the command when the run starts (`resolved`): `zoo train MODEL` with no flags and
    `RunConfig(model=MODEL)` are the same run.

    **Fields:**

    - `model`: a model's name (`"mlp"`, `"transformer"`, `"encoder"`, `"minilm"`); None
      only to resume a run, which names its own (`resolved`).
    - `data`: a `DataConfig`; `optimizer`: an `OptimizerConfig`.
    - `lora`: a `zoo.lora.LoraConfig` to fine-tune adapters only, used as given (None:
      train every weight; with the command `"finetune"` or `"demo"`, the model's LoRA,
      `ModelSpec.lora_defaults`).
    - `steps`, `batch_size` (global, a multiple of the data axis × `microbatches`),
      `microbatches` (None: the model's defaults), `seed`, `dtype` (`"float32"` or
      `"bfloat16"` compute).
    - `devices`: how many of jax's devices the mesh uses (None: all); `mesh`: its shape
      (`{"data": 4, "model": 2}`; None: every device on `data`); `rules`: a sharding rules
      preset (`zoo.RULE_PRESETS`); `mode`: `"explicit"` or `"shard_map"`.
    - `init`: pretrained weights (a Hugging Face folder, a run's output folder, or a Hub
      id); `revision`: a Hub id's branch, tag or commit (None: main), which a run resolves
      to the commit and records in config.json (`zoo.train.plan_run`);
      `model_config`: config fields to change (`{"d_model": 128}`).
    - `eval_every`: evaluate every N steps (None: the model's default, else a tenth of the
      run; 0: before and after only); `eval_before`: evaluate before the first step (the
      "before" of summary.json's `loss_fell`; False: train at once, `loss_fell` None);
      `probe`: fit a classifier's head alone on frozen features for this many steps
      first, as a baseline (None: the model's default, 0 but for the demo); `pooling`:
      what a classifier's head reads, `"cls"` (the `[CLS]` state through the
      checkpoint's pooler, as `BertForSequenceClassification`) or `"mean"` (None: the
      model's default; only classifiers take it).
    - `output`: the run's folder (None: `runs/COMMAND-MODEL-UTCTIME`); `checkpoint_dir`
      (None: OUTPUT/checkpoints), `checkpoint_every` (0: none), `keep`, `resume`,
      `resume_step`, `overwrite` (replace an earlier run's outputs).
    - `keep_best`: keep the checkpoint of the best evaluation by this metric
      (`"eval_loss"`, `"eval_perplexity"`, `"eval_accuracy"`, `"eval_macro_f1"`, or
      without `eval_`; None: none); `early_stop`: stop once that metric (else
      `eval_loss`) has not improved for this many evaluations (0: never).
    - `skip_nonfinite`: skip a step whose gradients are NaN/inf instead of stopping.
    - `quiet`: print only the summary; `tensorboard`: a folder for TensorBoard event files.
    - `sample_tokens`: the tokens of a decoder's greedy sample at the end of the run (0: none).
    - `derived`: the fields `resolved` computed rather than took (set by it; config.json
      lists them and a replay derives them again).
    """

    @property
    def resuming(self) -> bool:
        """Whether the run continues a saved one (`resume`, or a `resume_step`)."""
        return self.resume or self.resume_step is not None

    @property
    def eval_interval(self) -> int:
        """Steps between evaluations: `eval_every`, or a tenth of the run, at least 1, so
        loss.png shows measured points (0: none between)."""
        if self.eval_every is not None:
            return self.eval_every
        if self.steps is None:
            raise ConfigError("RunConfig.eval_interval needs the steps; call it on config.resolved()")
        return max(1, self.steps // 10)

    def resolved(self, command: str | None = None) -> RunConfig:
        """This config with every unset field (None) at its default for `command`: what a
        run trains with, and writes as its config.json.

        `command` is `"train"`, `"finetune"` or `"demo"` (default: `"finetune"` with
        `lora`, else `"train"`). The defaults are the model's (`ModelSpec.defaults_for`,
        every model's shared ones under them: `steps`, `batch_size`, `microbatches`, `lr`,
        `weight_decay`, `seq_len`, `probe`, `eval_every`), its data set for the command
        (`ModelSpec.data_for`; a data file given becomes an absolute path), a warmup of a
        twentieth of the steps and an evaluation every tenth (`OptimizerConfig.warmup_steps`,
        `eval_interval`), a data file read packed with 0.1 held out, and to fine-tune the
        model's LoRA (`ModelSpec.lora_defaults`). Set fields are kept; a resolved config
        resolves to itself.

        A resumed run (`resume` or `resume_step`, with an `output` holding a run's
        config.json) continues that run: first every field left unset (None, or at its
        default) that is not this launch's own (`Flag.resume != "launch"`: devices, mesh,
        resume, resume_step, overwrite) takes the saved value (the model too), and once
        resolved, a field that changes what it trains (`Flag.resume == "fixed"`) and
        differs from the saved value is refused. So a field set to its default on resume
        (`seed=0`) counts as unset.

        Also checked against the model (`model_spec`): `init` for a model without
        pretrained weights, the `dtype`s it computes in, a pretrained model's shape fixed
        (`model_config`); and `resume` needs the earlier run's `output` or
        `checkpoint_dir`. (A fine-tune's `init`, where the model needs one, is the run's
        check: `zoo inspect` resolves a fine-tune's settings without weights.) Raises `ConfigError` naming the
        fields, e.g. if the command does not take the model.
        """
        command = command or ("finetune" if self.lora is not None else "train")
        saved = saved_config(self.output) if self.resuming else None
        base = self if saved is None else self._inherit(saved)
        if base.model is not None and base.model not in model_names():  # a family or a checkpoint: its model
            model, init = model_and_init(base.model, base.init, base.revision)
            base = dataclasses.replace(base, model=model, init=init)
        done = base._with_defaults(command)
        if saved is not None:
            if done.revision and done.revision != saved.get("revision"):  # a branch given again: its commit compares
                done = dataclasses.replace(done, revision=pinned_revision(done.init, done.revision))
            check_unchanged(done.to_dict(), saved, _flags_by_key(), _normal)
        return done

    def _inherit(self, saved: dict[str, Any]) -> RunConfig:
        """This config, its unset fields (None or the default) the saved run's."""
        mine, blank = self.to_dict(), RunConfig().to_dict()
        given = {k: v for k, v in mine.items() if k not in blank or v != blank[k]}
        merged = RunConfig.from_dict(inherit(given, saved, _flags_by_key()))
        # Still the saved run's values, and derived (a config resolved already keeps its own).
        derived = tuple(sorted(set(self.derived) | {k for k in saved.get("derived") or () if k not in given}))
        return dataclasses.replace(
            merged, resume=True, resume_step=self.resume_step, overwrite=self.overwrite, derived=derived
        )

    def _with_defaults(self, command: str) -> RunConfig:
        """`resolved` of a config already merged with the run it resumes."""
        if self.model is None and self.resuming and self.output:  # `resolved` found no config.json there
            folder = Path(self.output).expanduser()
            why = "no config.json in it" if folder.is_dir() else "no such folder"
            raise ConfigError(
                f"RunConfig.resume: RunConfig.output {folder} holds no run to resume ({why}); give the folder of an "
                f"earlier run, or start one there: name one of {model_names(command)} as RunConfig.model, "
                "without RunConfig.resume"
            )
        if self.model is None:
            raise ConfigError(
                f"no model given; name one of {model_names(command)} as RunConfig.model (or resume a run: "
                "RunConfig.resume and its RunConfig.output)"
            )
        spec = model_spec(self.model)
        table = spec.defaults_for(command)
        self._check_fits(spec)

        def pick(value: Any, key: str) -> Any:
            return table[key] if value is None else value

        if self.epochs is not None and self.steps is not None and "steps" not in self.derived:
            raise ConfigError(
                f"RunConfig.steps {self.steps} and RunConfig.epochs {self.epochs} are both set; give one (epochs sets "
                "the steps from the data file's rows)"
            )
        # With epochs, the model's steps stand in until the data's rows are known (`_plan.fit_epochs`).
        steps = pick(None if self.epochs is not None else self.steps, "steps")
        optimizer = dataclasses.replace(
            self.optimizer,
            lr=pick(self.optimizer.lr, "lr")
            if self.objective == "sft"
            else self.optimizer.lr or PREFERENCE_DEFAULTS["lr"],
            weight_decay=pick(self.optimizer.weight_decay, "weight_decay"),
        )
        warmup = pick(optimizer.warmup, "warmup")
        optimizer = dataclasses.replace(optimizer, warmup=optimizer.warmup_steps(steps) if warmup is None else warmup)
        source = self.data.source or spec.data_for(command)
        if source not in spec.datasets and Path(source).expanduser().exists():
            source = str(Path(source).expanduser().resolve())  # a file: the same wherever the run is resumed
        elif source not in spec.datasets:
            source = absolute_files(source)  # NAME=FILE,...: each file's path absolute
        data = dataclasses.replace(
            self.data,
            source=source,
            seq_len=pick(self.data.seq_len, "seq_len"),
            validation=DATA_FILE_DEFAULTS["validation"] if self.data.validation is None else self.data.validation,
            packed=DATA_FILE_DEFAULTS["packed"] if self.data.packed is None else self.data.packed,
        )
        lora = self.lora
        if lora is None and command != "train":
            lora = LoraConfig(**spec.lora_defaults)
        derived = set(self.derived)
        derived |= {"steps"} if self.epochs is not None else set()
        derived |= {"batch_size"} if self.batch_size is None else set()
        derived |= {"microbatches"} if self.microbatches is None else set()
        derived |= {"warmup"} if warmup is None else set()
        derived |= {"eval_every"} if pick(self.eval_every, "eval_every") is None else set()
        done = dataclasses.replace(
            self,
            init=absolute_init(self.init),
            steps=steps,
            batch_size=pick(self.batch_size, "batch_size"),
            microbatches=pick(self.microbatches, "microbatches"),
            probe=pick(self.probe, "probe"),
            eval_every=pick(self.eval_every, "eval_every"),
            optimizer=optimizer,
            data=data,
            lora=lora,
            resume=self.resuming,
            pooling=self.pooling or (table["pooling"] if spec.classifier else None),
            beta=self.beta
            if self.beta is not None or self.objective == "sft"
            else OBJECTIVE_DEFAULTS[self.objective]["beta"],
            loss_type=self.loss_type
            if self.loss_type is not None or self.objective == "sft"
            else OBJECTIVE_DEFAULTS[self.objective]["loss_type"],
            derived=tuple(sorted(derived)),
        )
        check_revision(done.init, done.revision)
        if done.quantize is not None and done.lora is None:
            raise ConfigError(
                f"RunConfig.quantize {done.quantize!r} stores the frozen base of LoRA adapters, and this run trains "
                "every weight: fine-tune with LoRA (zoo finetune, RunConfig.lora) or drop RunConfig.quantize"
            )
        return dataclasses.replace(done, eval_every=done.eval_interval)

    def _check_fits(self, spec: ModelSpec) -> None:
        """The settings `spec`'s model takes (`resolved`'s checks)."""
        check_fits_model(self, spec)
        if self.resuming and not (self.output or self.checkpoint_dir):
            raise ConfigError(
                "RunConfig.resume needs the earlier run's folder: pass RunConfig.output RUN (or "
                "RunConfig.checkpoint_dir RUN/checkpoints)"
            )

    def to_dict(self) -> dict[str, Any]:
        """The flat form: `zoo train`'s long flags as keys (`"batch_size"`, `"lr"`,
        `"lora"` as `--lora` text, `"mesh"` as `"data=4,model=2"`), what a run writes as
        its config.json and `zoo train --config` reads back. `resume_step` and
        `overwrite` are left out: replaying a config.json must not delete a run."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("data", "optimizer"):
                keys = _DATA_KEYS if f.name == "data" else _OPTIMIZER_KEYS
                for key, field in keys.items():
                    inner = getattr(value, field)
                    if (
                        key in ("packed", "validation", "chat_template", "system_prompt", "max_prompt_len")
                        and inner is None
                    ):
                        continue  # not set: the loader's default (and no flag to replay)
                    if key == "prompt_truncation" and inner == "keep_end":
                        continue
                    if key == "end_lr_fraction" and inner == 0.1:
                        continue
                    flat[key] = inner
            elif f.name == "lora":
                if value is not None:
                    flat["lora"] = lora_text(value)
            elif f.name == "mesh":
                flat["mesh"] = None if value is None else mesh_text(value)
            elif f.name == "model_config":
                flat["model_config"] = ",".join(f"{k}={v}" for k, v in value.items()) or None
            elif f.name in ("resume_step", "overwrite"):
                continue
            elif f.name == "derived":
                if value:
                    flat["derived"] = sorted(value)
            elif f.name == "grpo":
                if self.objective == "grpo":  # only a GRPO run has rollouts to replay
                    flat |= {key: getattr(value, field) for key, field in _GRPO_KEYS.items()}
            elif f.name in ("objective", "beta", "loss_type", "label_smoothing") and self.objective == "sft":
                continue  # next-token training: no preference settings to replay
            elif f.name == "label_smoothing" and self.objective == "grpo":
                continue
            elif (f.name in ("tensorboard", "pooling", "keep_best", "quantize", "revision") and value is None) or (
                f.name == "early_stop" and not value
            ):
                continue
            else:
                flat[f.name] = value
        return flat

    @classmethod
    def flags(cls, command: str | None = None) -> tuple[Flag, ...]:
        """Every field as its flag (`zoo train`'s run flags), in field order, the fields of
        `data` and `optimizer` in their place: each `Flag` names its flat key
        (`Flag.name`), the field it sets (`Flag.field`), its help and how `--resume`
        treats it. The CLI's parser is generated from these.

        With a `command` (`train`, `finetune`, `demo`): the flags it takes, each help
        filled in for it from the registry (`help_texts`); without: every flag, its help
        a template."""
        nested = {"data": DataConfig, "optimizer": OptimizerConfig, "grpo": GRPOConfig}
        own = dict(fields_flags(cls))
        out: list[Flag] = []
        for f in dataclasses.fields(cls):
            if f.name in nested:
                out += [inner for _, inner in fields_flags(nested[f.name])]
            elif f.name in own:
                out.append(own[f.name])
        if command is None:
            return tuple(out)
        texts = help_texts(command)
        return tuple(dataclasses.replace(f, help=f.help.format_map(texts)) for f in out if command in f.commands)

    @staticmethod
    def help_texts(command: str) -> dict[str, str]:
        """What the flags' help leaves to `command`, filled in from the registry (its
        models, data sets, defaults; `defaults`: each model's defaults for it, as a table)."""
        return help_texts(command)

    def output_path(self, command: str) -> Path:
        """The folder the run writes: `output`, else a new `runs/COMMAND-MODEL-UTCTIME`."""
        return output_dir(self.output, str(self.model), command)

    @classmethod
    def flat_keys(cls) -> tuple[str, ...]:
        """The keys of the flat form (`to_dict`, `from_dict`, a config.json): `zoo train`'s
        run flags without the dashes."""
        return tuple(str(f.name) for f in cls.flags())

    @classmethod
    def from_dict(cls, flat: dict[str, Any]) -> RunConfig:
        """A `RunConfig` from its flat form (`to_dict`, a config.json, the CLI's resolved
        flags). An unknown key raises `ConfigError` naming it."""
        values = dict(flat)
        if values.get("model") is not None and values["model"] not in model_names():  # a family or a checkpoint
            values["model"], values["init"] = model_and_init(
                values["model"], values.get("init"), values.get("revision")
            )
        data = {field: values.pop(key) for key, field in _DATA_KEYS.items() if key in values}
        opt = {field: values.pop(key) for key, field in _OPTIMIZER_KEYS.items() if key in values}
        grpo = {field: values.pop(key) for key, field in _GRPO_KEYS.items() if key in values}
        if isinstance(values.get("lora"), str):
            # As `--lora`: keys the text leaves out take the model's LoRA defaults.
            defaults = model_spec(values["model"]).lora_defaults if values.get("model") is not None else {}
            values["lora"] = parse_lora(values["lora"], defaults)
        if isinstance(values.get("mesh"), str):
            values["mesh"] = parse_mesh(values["mesh"])
        if isinstance(values.get("derived"), list | tuple):
            values["derived"] = tuple(str(k) for k in values["derived"])
        if isinstance(values.get("model_config"), str) or values.get("model_config") is None:
            text = values.get("model_config") or ""
            values["model_config"] = parse_pairs(text, "model_config", parse_scalar) if text else {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"RunConfig: unknown keys {unknown}; known keys: {sorted(cls.flat_keys())}")
        return cls(data=DataConfig(**data), optimizer=OptimizerConfig(**opt), grpo=GRPOConfig(**grpo), **values)


def output_dir(output: str | None, model: str, command: str) -> Path:
    """A run's folder: `output`, else a new `runs/COMMAND-MODEL-UTCTIME`."""
    if output:
        return Path(output).expanduser()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{command}-{model}-{stamp}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = Path(f"{base}-{n}")
    return folder


def check_fits_model(config: RunConfig, spec: ModelSpec) -> None:
    """Refuse what `spec`'s model cannot take: `init` without pretrained weights, a
    `dtype` it does not compute in, a `model_config` changing a pretrained model's shape.
    `RunConfig.resolved` and `build_task` check with it."""
    if config.init and spec.init_class is None:
        raise ConfigError(f"RunConfig.init: the {spec.name} has no pretrained weights; drop RunConfig.init")
    if config.keep_best is not None or config.early_stop:
        metric = watched_metric(config.keep_best)
        if spec.kind not in WATCHED[metric][1]:
            field = "keep_best" if config.keep_best is not None else "early_stop"
            kinds = [m for m, (_, takes) in WATCHED.items() if spec.kind in takes]
            raise ConfigError(f"RunConfig.{field}: the {spec.name} measures no {metric}; watch one of {kinds}")
    if config.pooling is not None and not spec.classifier:
        raise ConfigError(f"RunConfig.pooling: the {spec.name} is no classifier; drop RunConfig.pooling")
    if config.dtype not in spec.dtypes:
        raise ConfigError(
            f"RunConfig.dtype: the {spec.name} computes in {' or '.join(spec.dtypes)} only; drop RunConfig.dtype"
        )
    fixed = spec.pretrained is not None and not config.init
    check_pretrained_shape(spec.name, config.model_config, fixed)


def absolute_init(init: str | None) -> str | None:
    """`init` as a run saves it: a local folder's absolute path (the run's base found from
    any working folder: `zoo generate RUN`, `--resume`), a Hub id as given. Links are kept
    (a Hugging Face cache snapshot stays that path)."""
    if init and Path(init).expanduser().exists():
        return os.path.abspath(Path(init).expanduser())
    return init


def _flags_by_key() -> dict[str, Flag]:
    """`RunConfig.flags()` by flat key."""
    return {str(f.name): f for f in RunConfig.flags()}


def _normal(key: str, value: Any) -> Any:
    """A flat value in the form two configs compare in (a model config's keys in any order)."""
    if key == "init":  # a run saved before its init was made absolute compares as one now
        return absolute_init(value)
    if key == "model_config":
        if isinstance(value, dict):
            return value
        return parse_pairs(value, "model_config", parse_scalar) if value else {}
    return json.loads(json.dumps(value, default=str))


# --------------------------------------------------------------------------- continuing a saved run: its config.json inherited, what it trains unchanged
# A resumed run continues the run saved in its folder: the settings it leaves unset come
# from that run's config.json, and a setting that would change what it trains is refused.
# `RunConfig.resolved` does both, so `zoo train --resume` and `zoo.train.run(RunConfig(...,
# resume=True))` continue a run alike. Works on the flat form (`RunConfig.to_dict`).


def saved_config(output: str | None) -> dict[str, Any] | None:
    """The flat config (config.json) of the run saved in the folder `output`; None
    without a folder or the file. A `ConfigError` if the file cannot be read."""
    if not output:
        return None
    path = Path(output).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"RunConfig.resume: cannot read {path}: {e}; fix or remove it") from e
    if not isinstance(saved, dict):
        raise ConfigError(f"RunConfig.resume: {path} is not a run's config.json (not a JSON object); fix or remove it")
    return saved


def inherit(given: dict[str, Any], saved: dict[str, Any], flags: dict[str, Flag]) -> dict[str, Any]:
    """`given` (the flat keys a config sets) over the saved run's values of every key
    that is not this launch's own (`Flag.resume != "launch"`)."""
    inherited = {k for k, f in flags.items() if f.resume != "launch"}
    return {k: v for k, v in saved.items() if k in inherited and v is not None} | given


def check_unchanged(now: dict[str, Any], saved: dict[str, Any], flags: dict[str, Flag], normal) -> None:
    """Refuse a resumed run whose flat config `now` changes a setting of the saved run
    that changes what it trains (`Flag.resume == "fixed"`), naming each field.
    `normal(key, value)` is the value's comparable form."""
    changed = [
        f"{flags[k].field} {now[k]} (was {saved[k]})"
        for k in sorted(now)
        if k in saved and k in flags and flags[k].resume == "fixed" and normal(k, now[k]) != normal(k, saved[k])
    ]
    if changed:
        raise ConfigError(
            f"RunConfig.resume: {', '.join(changed)} would change the run saved in {now['output']}; drop "
            f"{'them' if len(changed) > 1 else 'it'} to continue that run, or start a new one (another "
            "RunConfig.output, or RunConfig.overwrite without RunConfig.resume)"
        )
