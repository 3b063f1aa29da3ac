"""A run's settings as typed dataclasses, and their flat JSON form (a run's config.json)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from ..lora import LoraConfig
from . import _text
from ._errors import ConfigError
from ._flags import Flag, fields_flags, flag, help_texts
from ._optimizer import OptimizerConfig
from ._registry import (
    DATA_FILE_DEFAULTS,
    PREFERENCE_DEFAULTS,
    ModelSpec,
    check_model_config,
    check_pretrained_shape,
    model_and_init,
    model_names,
    model_spec,
)
from ._scores import WATCHED, watched_metric
from ._text import absolute_files, lora_text, mesh_text, parse_lora, parse_mesh, parse_pairs, parse_scalar

# What a decoder minimises: next-token loss, or a preference objective (zoo.models.PreferenceLoss).
OBJECTIVES = ("sft", "dpo", "orpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
# What a classifier's head reads (`zoo.models.EncoderClassifier`'s pooling).
POOLINGS = ("cls", "mean")
# The largest count a run takes (steps, rows, intervals): compiled programs count steps and
# rows in int32. Seeds are 32-bit, as numpy's and jax's PRNG seeds are portably.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What a run trains on.

    **Fields:**

    - `source`: a built-in data set's name (`"teacher"`, `"code"`, `"prose"`, `"docstrings"`;
      which ones a model takes: `zoo train --help`), or a file (None: the model's default
      for the command), or one file per LoRA adapter to train at once, `{NAME: FILE}` (kept
      as the text `"NAME=FILE,NAME=FILE"`, `--data`'s form).
    - `seq_len`: tokens per example, padded or cut (None: the model's default; the mlp has
      no sequences).
    - `eval_size`: held-out examples evaluated (0: the data set's default).
    - `packed`, `validation`, `chat_template`: how a user's file is read (None: packed,
      0.1): texts packed into full windows, the held-out fraction, the chat template of
      conversations.
    """

    source: str | dict[str, str] | None = flag(
        None, name="data", metavar="NAME|FILE", group="model and data", help="{data_sets}"
    )
    seq_len: int | None = flag(None, metavar="L", help="tokens per example, padded or cut ({per_model})")
    eval_size: int = flag(0, metavar="N", group="evaluation and outputs", resume="safe",
                          help="held-out examples evaluated (default: all test texts; 256 LM windows; 1024 mlp "
                          "examples)")  # fmt: skip
    packed: bool | None = flag(None, group="model and data", help="--data FILE (language modelling): pack short "
                               "documents into each row (default yes)")  # fmt: skip
    validation: float | int | None = flag(None, metavar="FRACTION", group="model and data", help="--data FILE: "
                                          "the fraction of its documents held out for evaluation (default 0.1)")  # fmt: skip
    chat_template: str | None = flag(None, metavar="FILE", group="model and data", help="--data FILE of chat "
                                     "messages: a jinja2 chat template (default: the tokenizer's)")  # fmt: skip
    system_prompt: str | None = flag(None, metavar="TEXT", group="training", help="preference pairs: a "
                                     "system prompt put before every prompt (a system turn of conversations that "
                                     "have none) (default: none)")  # fmt: skip
    max_prompt_len: int | None = flag(None, metavar="N", group="training", help="preference pairs too long "
                                      "for --seq-len: the prompt is cut to N tokens, then the completions to what is "
                                      "left (default: half of --seq-len)")  # fmt: skip
    prompt_truncation: str = flag("keep_end", choices=("keep_end", "keep_start", "error"), group="training",
                                  help="which end of a too-long prompt is kept (TRL's truncation_mode), or error to "
                                  "refuse such pairs (default keep_end)")  # fmt: skip

    def __post_init__(self):
        if isinstance(self.source, dict):  # one file per adapter: stored as --data's text
            object.__setattr__(self, "source", ",".join(f"{name}={file}" for name, file in self.source.items()))
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ConfigError(f"DataConfig.seq_len must be an integer >= 2 (or None), got {self.seq_len!r}")
        if not isinstance(self.eval_size, int) or self.eval_size < 0:
            raise ConfigError(f"DataConfig.eval_size must be an integer >= 0, got {self.eval_size!r}")
        for field in ("seq_len", "eval_size"):
            if (getattr(self, field) or 0) > MAX_COUNT:
                raise ConfigError(
                    f"DataConfig.{field} must be at most {MAX_COUNT} (2**31 - 1: compiled programs count in int32), "
                    f"got {getattr(self, field)}"
                )
        if self.max_prompt_len is not None and (
            not isinstance(self.max_prompt_len, int)
            or self.max_prompt_len < 1
            or self.seq_len is not None
            and self.max_prompt_len >= self.seq_len
        ):
            raise ConfigError(f"DataConfig.max_prompt_len must be an integer from 1 to seq_len - 1 (room for a "
                              f"completion), got {self.max_prompt_len!r}")  # fmt: skip
        if self.prompt_truncation not in ("keep_end", "keep_start", "error"):
            raise ConfigError(f"DataConfig.prompt_truncation must be keep_end, keep_start or error, got "
                              f"{self.prompt_truncation!r}")  # fmt: skip
        if self.validation is not None and not (isinstance(self.validation, int | float) and 0 <= self.validation < 1):
            raise ConfigError(f"DataConfig.validation must be a fraction in [0, 1), got {self.validation!r}")


# The flat keys of the nested configs' fields (`DataConfig.source` is `data`), from their flags.
_DATA_KEYS = {f.name: field for field, f in fields_flags(DataConfig)}
_OPTIMIZER_KEYS = {f.name: field for field, f in fields_flags(OptimizerConfig)}


@dataclasses.dataclass(frozen=True)
class RunConfig:
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
    - `init`: pretrained weights (a Hugging Face folder, or a run's output folder);
      `model_config`: config fields to change (`{"d_model": 128}`).
    - `eval_every`: evaluate every N steps (None: the model's default, else a tenth of the
      run; 0: before and after only); `probe`: fit a classifier's head alone on frozen
      features for this many steps first, as a baseline (None: the model's default, 0
      but for the demo); `pooling`: what a classifier's head reads, `"cls"` (the `[CLS]`
      state through the checkpoint's pooler, as `BertForSequenceClassification`) or
      `"mean"` (None: the model's default; only classifiers take it).
    - `output`: the run's folder (None: `runs/COMMAND-MODEL-UTCTIME`); `checkpoint_dir`
      (None: OUTPUT/checkpoints), `checkpoint_every` (0: none), `keep`, `resume`,
      `resume_step`, `overwrite` (replace an earlier run's outputs).
    - `keep_best`: keep the checkpoint of the best evaluation by this metric
      (`"eval_loss"`, `"eval_perplexity"`, `"eval_accuracy"`, `"eval_macro_f1"`, or
      without `eval_`; None: none); `early_stop`: stop once that metric (else
      `eval_loss`) has not improved for this many evaluations (0: never).
    - `skip_nonfinite`: skip a step whose gradients are NaN/inf instead of stopping.
    - `quiet`: print only the summary; `tensorboard`: a folder for TensorBoard event files.
    - `derived`: the fields `resolved` computed rather than took (set by it; config.json
      lists them and a replay derives them again).
    """

    model: str | None = flag(None, positional=True, help="{models}")
    steps: int | None = flag(None, metavar="N", resume="safe", help="optimizer steps ({per_model})")
    epochs: float | int | None = flag(None, metavar="E", resume="safe", help="passes over a data file's training rows "
                                      "instead of --steps: the steps are E x rows / batch, rounded up")  # fmt: skip
    batch_size: int | None = flag(None, metavar="B", help="global batch, a multiple of data axis x microbatches "
                                  "({per_model})")  # fmt: skip
    microbatches: int | None = flag(None, metavar="M", resume="safe", help="microbatches per step ({per_model})")
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: LoraConfig | None = flag(None, metavar="KEY=VALUE,...", group="model and data", commands=("finetune", "demo"),
                                   help="LoRA adapters; only they (and modules_to_save) train. Default r=8,alpha=16,"
                                   "targets=all-linear (+ save=head for classifiers). {lora_keys}")  # fmt: skip
    quantize: str | None = flag(None, metavar="KIND", group="model and data", commands=("finetune", "demo"),
                                help="store the frozen base of the LoRA adapters in nf4 (QLoRA: bitsandbytes' 4-bit "
                                "NormalFloat, a scale per 64 inputs), int4 (symmetric, a scale per 128 inputs) or int8 "
                                "(a scale per output); KIND:BLOCK sets a 4-bit block, e.g. nf4:32 (default: the "
                                "float base)")  # fmt: skip
    objective: str = flag("sft", choices=OBJECTIVES, group="training", resume="fixed",
                          help="what a decoder minimises: sft (next-token loss), dpo (a reference: the base with the "
                          "LoRA adapters off, or log-probabilities computed once before training without LoRA) or orpo "
                          "(no reference); dpo/orpo train on {{prompt, chosen, rejected}} pairs (default sft)")  # fmt: skip
    beta: float | int = flag(0.1, metavar="BETA", group="training",
                             help="dpo's beta (how far from the reference), or orpo's weight of the odds-ratio term "
                             "(default 0.1)")  # fmt: skip
    loss_type: str = flag("sigmoid", choices=LOSS_TYPES, group="training",
                          help="dpo's loss as TRL's: sigmoid, ipo, hinge or robust (default sigmoid)")  # fmt: skip
    label_smoothing: float | int = flag(0.0, metavar="EPS", group="training",
                                        help="robust dpo: the probability in [0, 0.5) that a pair's label is flipped "
                                        "(default 0)")  # fmt: skip
    seed: int = flag(0, help="seed of the model, head, adapters and batches (default 0)")
    dtype: str = flag("float32", choices=("float32", "bfloat16"), help="compute dtype; parameters, gradients and "
                      "their all-reduce stay float32 (default float32)")  # fmt: skip
    devices: int | None = flag(None, metavar="N", group="devices and sharding", resume="launch", help="devices: "
                               "simulated CPU devices on CPU (default 8), real ones on GPU/TPU (default all)")  # fmt: skip
    mesh: dict[str, int] | None = flag(None, metavar="AXIS=SIZE,...", group="devices and sharding", resume="launch",
                                       help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES); "
                                       "needs a data axis")  # fmt: skip
    rules: str = flag("dp", metavar="PRESET", group="devices and sharding", resume="safe",
                      help="sharding rules preset: {rule_presets} (default dp); tp and fsdp+tp need a 'model' mesh "
                      "axis; fsdp-once also sets the step's gather='once' (zoo.preset(name).step_options)")  # fmt: skip
    mode: str = flag("explicit", choices=("explicit", "shard_map"), group="devices and sharding", resume="safe",
                     help="step mode (default explicit)")  # fmt: skip
    init: str | None = flag(None, metavar="PATH", group="model and data", help="start from pretrained weights: a "
                            "Hugging Face folder or a model id in the local Hugging Face cache ({init_families}; its "
                            "tokenizer.json is used when present, else byte tokens) or a `zoo train` output folder; "
                            "minilm's default is the packaged all-MiniLM-L6-v2")  # fmt: skip
    model_config: dict[str, Any] = flag(factory=dict, metavar="KEY=VALUE,...", group="model and data",
                                        help="model config fields to change, e.g. d_model=128,num_layers=4 "
                                        "(TransformerConfig / EncoderConfig fields; mlp: width, depth; pretrained "
                                        "models: dropout, attention_dropout, remat)")  # fmt: skip
    eval_every: int | None = flag(None, metavar="N", group="evaluation and outputs", resume="safe",
                                  help="evaluate every N steps (default: a tenth of --steps; 0: only before and "
                                  "after)")  # fmt: skip
    probe: int | None = flag(None, metavar="STEPS", group="model and data", resume="safe",
                             help="classifiers: also fit the new head alone on frozen-encoder features (a linear "
                             "probe: full-batch Adam, this many steps) and report it as a baseline; training starts "
                             "from the new head either way (default 0: off{probe_demo})")  # fmt: skip
    pooling: str | None = flag(None, choices=POOLINGS, group="model and data",
                               help="classifiers: what the head reads: cls, the [CLS] state through the "
                               "checkpoint's pooler as BertForSequenceClassification (the adapter is a peft SEQ_CLS "
                               "one), or mean, the mean of the hidden states (sentence-transformers' features; the "
                               "adapter is a peft FEATURE_EXTRACTION one, the head in adapter/head.safetensors) "
                               "(default {pooling_default})")  # fmt: skip
    output: str | None = flag(None, metavar="DIR", group="evaluation and outputs", resume="safe",
                              help="output folder (default runs/{command}-MODEL-UTCTIME): config.json, metrics.jsonl, "
                              "loss.png, summary.json, {outputs}, checkpoints/")  # fmt: skip
    checkpoint_dir: str | None = flag(None, metavar="DIR", group="evaluation and outputs", resume="safe",
                                      help="checkpoints folder (default OUTPUT/checkpoints)")  # fmt: skip
    checkpoint_every: int = flag(0, metavar="N", group="evaluation and outputs", resume="safe",
                                 help="save the trained leaves, optimizer state and key every N steps and at the end "
                                 "(default 0: none; a train run without a Hugging Face model/ folder, e.g. the mlp's, "
                                 "saves its end anyway)")  # fmt: skip
    keep: int = flag(3, metavar="K", group="evaluation and outputs", resume="safe",
                     help="checkpoints kept, newest first (default 3)")  # fmt: skip
    resume: bool = flag(False, group="evaluation and outputs", resume="launch",
                        help="continue from the newest checkpoint of --checkpoint-dir (or OUTPUT/checkpoints) up to "
                        "--steps (default no)")  # fmt: skip
    resume_step: int | None = flag(None, metavar="N", group="evaluation and outputs", resume="launch",
                                   help="resume from checkpoint step N instead of the newest (implies --resume; "
                                   "later steps are refused unless --overwrite deletes them)")  # fmt: skip
    overwrite: bool = flag(False, group="evaluation and outputs", resume="launch",
                           help="replace the outputs and checkpoints of an earlier run in --output (default no: "
                           "such a folder is refused; --resume continues it instead)")  # fmt: skip
    keep_best: str | None = flag(None, metavar="METRIC", group="evaluation and outputs", resume="safe",
                                 help="keep the checkpoint of the best evaluation by METRIC: eval_loss or "
                                 "eval_perplexity (lower is better), eval_accuracy or eval_macro_f1 (higher); saved "
                                 "in the checkpoints folder when an evaluation after a step improves on every "
                                 "earlier one, kept beyond --keep, named in summary.json's best (default: none)")  # fmt: skip
    early_stop: int = flag(0, metavar="PATIENCE", group="evaluation and outputs", resume="safe",
                           help="stop when the --keep-best metric (else eval_loss) has not improved for PATIENCE "
                           "evaluations in a row; the run ends as at its last step (final evaluation, saves, "
                           "export; summary.json's stopped_early) (default 0: never)")  # fmt: skip
    skip_nonfinite: bool = flag(False, help="skip a step whose loss or gradients are NaN/inf (weights and optimizer "
                                "state unchanged; counted as `skipped` in metrics.jsonl) instead of stopping the run "
                                "with exit code 3 (default no)")  # fmt: skip
    quiet: bool = flag(False, group="evaluation and outputs", resume="safe",
                       help="no progress bar and header, only the summary (default no)")  # fmt: skip
    tensorboard: str | None = flag(None, metavar="DIR", group="evaluation and outputs", resume="safe",
                                   help="also write TensorBoard event files (loss, lr, eval_loss, eval_accuracy, "
                                   "eval_perplexity, eval_macro_f1, per-class precision/recall/f1) into "
                                   "DIR; needs tensorboardX (pip install 'eqx-zoo[tensorboard]')")  # fmt: skip
    # Not a flag: the fields `resolved` computed from the others rather than took (`warmup`
    # and `eval_every` from `steps`, `batch_size` / `microbatches` from the model's defaults
    # fitted to the mesh and the data). config.json lists them, so a replay with other
    # values (`zoo train --config config.json --steps 5`) derives them again.
    derived: tuple[str, ...] = ()

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise `ConfigError` naming the first field out of range."""

        def bad(field: str, want: str) -> ConfigError:
            return ConfigError(f"RunConfig.{field} must be {want}, got {getattr(self, field)!r}")

        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.model is not None and not isinstance(self.model, str):
            raise bad("model", "a registered model's name (zoo.train.model_names())")
        for field in ("keep",):
            if not integer(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "an integer >= 1")
        for field in ("seed", "checkpoint_every", "early_stop"):
            if not integer(getattr(self, field)) or getattr(self, field) < 0:
                raise bad(field, "an integer >= 0")
        if self.seed > MAX_SEED:
            raise bad("seed", f"below 2**32 (at most {MAX_SEED}: the seeds jax and numpy take)")
        if self.epochs is not None and (isinstance(self.epochs, bool) or not isinstance(self.epochs, int | float)
                                        or not 0 < self.epochs < MAX_COUNT):  # fmt: skip
            raise bad("epochs", "a finite number > 0 (or None)")
        for field in ("steps", "batch_size", "microbatches", "eval_every", "probe", "resume_step", "devices"):
            value = getattr(self, field)
            low = 0 if field in ("eval_every", "probe") else 1
            if value is not None and (not integer(value) or value < low):
                raise bad(field, f"an integer >= {low} (or None)")
        for field in ("keep", "checkpoint_every", "early_stop", "steps", "batch_size", "microbatches", "eval_every", "probe",
                      "resume_step", "devices"):  # fmt: skip
            value = getattr(self, field)
            if value is not None and value > MAX_COUNT:
                raise bad(field, f"at most {MAX_COUNT} (2**31 - 1: compiled programs count in int32)")
        if self.keep_best is not None:
            try:
                watched_metric(self.keep_best)
            except ValueError as e:
                raise bad("keep_best", f"an evaluation metric ({', '.join(WATCHED)})") from e
        if self.early_stop and self.eval_every == 0:
            raise ConfigError("RunConfig.early_stop counts evaluations during the run, but RunConfig.eval_every is 0 "
                              "(only before and after): set RunConfig.eval_every")  # fmt: skip
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise bad("pooling", f"one of {list(POOLINGS)} (or None)")
        if self.objective not in OBJECTIVES:
            raise bad("objective", f"one of {list(OBJECTIVES)}")
        if self.objective != "sft":
            try:
                self.preference_loss()
            except ValueError as e:
                raise ConfigError(f"RunConfig: {e}") from None
        if self.dtype not in ("float32", "bfloat16"):
            raise bad("dtype", "'float32' or 'bfloat16'")
        if self.quantize is not None:
            _text.quantize_kind(self.quantize)
        if self.mode not in ("explicit", "shard_map"):
            raise bad("mode", "'explicit' or 'shard_map'")
        if not isinstance(self.data, DataConfig):
            raise bad("data", "a zoo.train.DataConfig")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise bad("optimizer", "a zoo.train.OptimizerConfig")
        if self.steps is not None:
            self.optimizer.warmup_steps(self.steps)
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise bad("lora", "a zoo.lora.LoraConfig or None")
        if self.mesh is not None and (
            not isinstance(self.mesh, dict)
            or not all(isinstance(k, str) and integer(v) and v >= 1 for k, v in self.mesh.items())
        ):
            raise bad("mesh", "a dict of axis name -> size >= 1, e.g. {'data': 4, 'model': 2}")
        if not isinstance(self.model_config, dict):
            raise bad("model_config", "a dict of model config fields, e.g. {'d_model': 128}")
        check_model_config(self.model_config)

    def preference_loss(self):
        """The `zoo.models.PreferenceLoss` of `objective` dpo / orpo (`beta`, `loss_type`,
        `label_smoothing`), its reference the model with its adapters disabled."""
        from ..lora import disabled_adapters
        from ..models._preference import PreferenceLoss

        return PreferenceLoss(
            self.objective,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            reference=disabled_adapters,
        )

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
            model, init = model_and_init(base.model, base.init)
            base = dataclasses.replace(base, model=model, init=init)
        done = base._with_defaults(command)
        if saved is not None:
            check_unchanged(done.to_dict(), saved, _flags_by_key(), _normal)
        return done

    def _inherit(self, saved: dict[str, Any]) -> RunConfig:
        """This config, its unset fields (None or the default) the saved run's."""
        mine, blank = self.to_dict(), RunConfig().to_dict()
        given = {k: v for k, v in mine.items() if k not in blank or v != blank[k]}
        merged = RunConfig.from_dict(inherit(given, saved, _flags_by_key()))
        # Still the saved run's values, and derived (a config resolved already keeps its own).
        derived = tuple(sorted(set(self.derived) | {k for k in saved.get("derived") or () if k not in given}))
        return dataclasses.replace(merged, resume=True, resume_step=self.resume_step, overwrite=self.overwrite,
                                   derived=derived)  # fmt: skip

    def _with_defaults(self, command: str) -> RunConfig:
        """`resolved` of a config already merged with the run it resumes."""
        if self.model is None:
            raise ConfigError(f"no model given; name one of {model_names()} as RunConfig.model (or resume a run: "
                              "RunConfig.resume and its RunConfig.output)")  # fmt: skip
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
            self, steps=steps, batch_size=pick(self.batch_size, "batch_size"),
            microbatches=pick(self.microbatches, "microbatches"), probe=pick(self.probe, "probe"),
            eval_every=pick(self.eval_every, "eval_every"), optimizer=optimizer, data=data, lora=lora,
            resume=self.resuming, pooling=self.pooling or (table["pooling"] if spec.classifier else None),
            derived=tuple(sorted(derived)),
        )  # fmt: skip
        if done.quantize is not None and done.lora is None:
            raise ConfigError(
                f"RunConfig.quantize {done.quantize!r} stores the frozen base of LoRA adapters, and this run trains "
                "every weight: fine-tune with LoRA (zoo finetune, RunConfig.lora) or drop --quantize"
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
            elif f.name in ("objective", "beta", "loss_type", "label_smoothing") and self.objective == "sft":
                continue  # next-token training: no preference settings to replay
            elif (f.name in ("tensorboard", "pooling", "keep_best", "quantize") and value is None) or (
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
        nested = {"data": DataConfig, "optimizer": OptimizerConfig}
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
            values["model"], values["init"] = model_and_init(values["model"], values.get("init"))
        data = {field: values.pop(key) for key, field in _DATA_KEYS.items() if key in values}
        opt = {field: values.pop(key) for key, field in _OPTIMIZER_KEYS.items() if key in values}
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
        return cls(data=DataConfig(**data), optimizer=OptimizerConfig(**opt), **values)


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


def _flags_by_key() -> dict[str, Flag]:
    """`RunConfig.flags()` by flat key."""
    return {str(f.name): f for f in RunConfig.flags()}


def _normal(key: str, value: Any) -> Any:
    """A flat value in the form two configs compare in (a model config's keys in any order)."""
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
