"""A run's settings, each field a flag of `zoo train` (`flag(...)`): `DataConfig` (what a
run trains on) and `RunSettings` (the fields of `RunConfig`), each checked when made. What
they resolve to and their flat JSON form are `RunConfig`'s (`zoo.train._config`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..lora import LoraConfig
from ._errors import ConfigError
from ._flags import flag
from ._optimizer import OptimizerConfig
from ._registry import check_model_config
from ._scores import WATCHED, watched_metric
from ._text import quantize_kind

# What a decoder minimises: next-token loss, or a preference objective (zoo.models.PreferenceLoss).
OBJECTIVES = ("sft", "dpo", "orpo", "grpo")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# What `beta` and `loss_type` are where the run does not say, per objective (TRL's DPOConfig /
# ORPOConfig / GRPOConfig defaults).
OBJECTIVE_DEFAULTS = {
    "dpo": {"beta": 0.1, "loss_type": "sigmoid"},
    "orpo": {"beta": 0.1, "loss_type": "sigmoid"},
    "grpo": {"beta": 0.0, "loss_type": "dapo"},
}
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
    eval_size: int = flag(
        0,
        metavar="N",
        group="evaluation and outputs",
        resume="safe",
        help="held-out examples evaluated (default: all test texts; 256 LM windows; 1024 mlp examples)",
    )
    packed: bool | None = flag(
        None,
        group="model and data",
        help="--data FILE (language modelling): pack short documents into each row (default yes)",
    )
    validation: float | int | None = flag(
        None,
        metavar="FRACTION",
        group="model and data",
        help="--data FILE: the fraction of its documents held out for evaluation (default 0.1)",
    )
    chat_template: str | None = flag(
        None,
        metavar="FILE",
        group="model and data",
        help="--data FILE of chat messages: a jinja2 chat template (default: the tokenizer's)",
    )
    system_prompt: str | None = flag(
        None,
        metavar="TEXT",
        group="training",
        help="preference pairs: a system prompt put before every prompt (a system turn of conversations that have "
        "none) (default: none)",
    )
    max_prompt_len: int | None = flag(
        None,
        metavar="N",
        group="training",
        help="preference pairs too long for --seq-len: the prompt is cut to N tokens, then the completions to what is "
        "left (default: half of --seq-len)",
    )
    prompt_truncation: str = flag(
        "keep_end",
        choices=("keep_end", "keep_start", "error"),
        group="training",
        help="which end of a too-long prompt is kept (TRL's truncation_mode), or error to refuse such pairs (default "
        "keep_end)",
    )

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
            raise ConfigError(
                f"DataConfig.max_prompt_len must be an integer from 1 to seq_len - 1 (room for a "
                f"completion), got {self.max_prompt_len!r}"
            )
        if self.prompt_truncation not in ("keep_end", "keep_start", "error"):
            raise ConfigError(
                f"DataConfig.prompt_truncation must be keep_end, keep_start or error, got {self.prompt_truncation!r}"
            )
        if self.validation is not None and not (isinstance(self.validation, int | float) and 0 <= self.validation < 1):
            raise ConfigError(f"DataConfig.validation must be a fraction in [0, 1), got {self.validation!r}")


# Reward functions given to a `GRPOConfig` as functions, by the name it keeps of them.
REWARD_FUNCTIONS: dict[str, Callable] = {}


def reward_name(function: Callable) -> str:
    """`MODULE:QUALNAME` of a reward function given as a function: what config.json keeps
    (a resumed run in another process imports it from there); the function itself is
    found by that name in this process (`REWARD_FUNCTIONS`). A lambda or a nested function
    gets its id too (it cannot be imported: such a run resumes only in this process)."""
    name = f"{getattr(function, '__module__', None)}:{getattr(function, '__qualname__', type(function).__name__)}"
    if "<" in name:  # <lambda>, <locals>
        name = f"{name}#{id(function):x}"
    REWARD_FUNCTIONS[name] = function
    return name


def _grpo_flag(default: Any, **kwargs) -> Any:
    """A `GRPOConfig` field: a training flag of `zoo finetune` (GRPO trains LoRA adapters)."""
    return flag(default, group="training", commands=("finetune",), **kwargs)


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """How `--objective grpo` samples and rewards its completions (TRL 1.16's `GRPOConfig`
    names and defaults where TRL has them).

    **Fields:**

    - `reward`: the reward functions, `FILE.py:NAME` or `MODULE:NAME` each, comma-separated
      (`--reward`), or in Python the functions themselves (one or a list, kept as
      `MODULE:NAME`: `reward_name`); each is called as TRL calls them,
      `NAME(prompts=..., completions=..., **columns)`.
    - `reward_weights`: one weight per function, comma-separated or a list (default 1 each).
    - `num_generations`: completions sampled per prompt (G >= 2: the group whose mean is
      each completion's baseline); the batch holds `batch_size / G` prompts.
    - `max_completion_length`: the most new tokens of a completion (and `dr_grpo`'s divisor).
    - `temperature`, `top_p`, `top_k`: the sampling of the rollouts (the log-probabilities
      of the loss are those of the logits divided by `temperature`).
    - `epsilon`, `epsilon_high`: the ratio's clip range `[1 - epsilon, 1 + epsilon_high]`.
    - `scale_rewards`: `group`, `batch` or `none` (Dr. GRPO): the advantages' divisor.
    - `importance_sampling_level`: `token`, or `sequence` (GSPO).
    - `num_iterations`: optimizer steps per rollout (μ); the later ones reuse it, their
      ratios against the sampling policy's log-probabilities (the engine's).
    - `mask_truncated_completions`: completions cut by `max_completion_length` (no end of
      sequence) count for nothing in the loss (DAPO).
    """

    reward: str | Callable | Sequence[str | Callable] | None = _grpo_flag(
        None,
        metavar="FILE.py:NAME,...",
        repeat=True,
        help="grpo: the reward functions, FILE.py:NAME each (comma-separated or repeated), called as TRL calls them: "
        "NAME(prompts=..., completions=..., **columns) -> one float (or None) per completion",
    )
    reward_weights: str | Sequence[float | int] | None = _grpo_flag(
        None,
        metavar="W,...",
        repeat=True,
        help="grpo: one weight per --reward function, comma-separated or repeated (default 1 each)",
    )
    num_generations: int = _grpo_flag(
        8,
        metavar="G",
        help="grpo: completions sampled per prompt; --batch-size counts completions, a multiple of G (default 8)",
    )
    max_completion_length: int = _grpo_flag(
        256,
        metavar="N",
        help="grpo: the most new tokens of a completion (default 256; at most --seq-len minus the prompt)",
    )
    temperature: float | int = _grpo_flag(1.0, metavar="T", help="grpo: sampling temperature (default 1)")
    top_p: float | int = _grpo_flag(1.0, metavar="P", help="grpo: nucleus sampling's p (default 1: off)")
    top_k: int = _grpo_flag(0, metavar="K", help="grpo: sample among the K likeliest (default 0: off)")
    epsilon: float | int = _grpo_flag(0.2, metavar="EPS", help="grpo: the ratio's clip, 1 +- EPS (default 0.2)")
    epsilon_high: float | int | None = _grpo_flag(
        None, metavar="EPS", help="grpo: the ratio's upper clip 1 + EPS (DAPO's clip-higher; default --epsilon)"
    )
    scale_rewards: str = _grpo_flag(
        "group",
        choices=("group", "batch", "none"),
        help="grpo: divide the advantages by the reward std of the group, of the batch, or none (Dr. GRPO) "
        "(default group)",
    )
    importance_sampling_level: str = _grpo_flag(
        "token",
        choices=("token", "sequence"),
        help="grpo: an importance ratio per token, or per sequence (GSPO) (default token)",
    )
    num_iterations: int = _grpo_flag(
        1,
        metavar="MU",
        help="grpo: optimizer steps per rollout (TRL's num_iterations): the later ones reuse it, clipped against "
        "the sampling policy's log-probabilities (default 1)",
    )
    mask_truncated_completions: bool = _grpo_flag(
        False,
        help="grpo: completions cut at --max-completion-length count for nothing in the loss (default no)",
    )

    def __post_init__(self):
        def bad(field: str, want: str) -> ConfigError:
            return ConfigError(f"GRPOConfig.{field} must be {want}, got {getattr(self, field)!r}")

        if self.reward is not None and not isinstance(self.reward, str):  # functions: kept by name
            items = [self.reward] if callable(self.reward) else list(self.reward)
            object.__setattr__(self, "reward", ",".join(reward_name(f) if callable(f) else str(f) for f in items))
        if self.reward_weights is not None and not isinstance(self.reward_weights, str):
            object.__setattr__(self, "reward_weights", ",".join(str(w) for w in self.reward_weights))

        def number(value) -> bool:
            return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

        if (
            isinstance(self.num_generations, bool)
            or not isinstance(self.num_generations, int)
            or self.num_generations < 2
        ):
            raise bad("num_generations", "an integer >= 2 (a group's mean is each completion's baseline)")
        if (
            isinstance(self.max_completion_length, bool)
            or not isinstance(self.max_completion_length, int)
            or not 1 <= self.max_completion_length <= MAX_COUNT
        ):
            raise bad("max_completion_length", "an integer >= 1")
        if not number(self.temperature) or self.temperature <= 0:
            raise bad("temperature", "a number > 0 (rollouts sample; the loss divides the logits by it)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if isinstance(self.num_iterations, bool) or not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise bad("num_iterations", "an integer >= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0: off)")
        if not number(self.epsilon) or self.epsilon < 0:
            raise bad("epsilon", "a number >= 0")
        if self.epsilon_high is not None and (not number(self.epsilon_high) or self.epsilon_high < 0):
            raise bad("epsilon_high", "a number >= 0 (or None)")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise bad("scale_rewards", "group, batch or none")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise bad("importance_sampling_level", "token or sequence")
        self.weights()  # the weights parse

    def rewards(self) -> list[str]:
        """Each reward function's `FILE.py:NAME` or `MODULE:NAME` (`reward_name`)."""
        return [r.strip() for r in (self.reward or "").split(",") if r.strip()]

    def weights(self) -> list[float] | None:
        """The reward weights, one per function (None: 1 each)."""
        if self.reward_weights is None:
            return None
        try:
            weights = [float(w) for w in str(self.reward_weights).split(",")]
        except ValueError:
            weights = []
        if not weights or not all(math.isfinite(w) for w in weights):
            raise ConfigError(
                f"GRPOConfig.reward_weights must be numbers, comma-separated (one per GRPOConfig.reward function), got "
                f"{self.reward_weights!r}"
            )
        if self.reward is not None and len(weights) != len(self.rewards()):
            raise ConfigError(
                f"GRPOConfig.reward_weights gives {len(weights)} weights for {len(self.rewards())} reward functions; "
                "give one per GRPOConfig.reward function"
            )
        return weights


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The fields of `RunConfig` (each documented there), each its flag of `zoo train`
    (`batch_size` is `--batch-size`), checked when made (`check`). `RunConfig` adds what
    they resolve to for a model and a command, and their flat form."""

    model: str | None = flag(None, positional=True, help="{models}")
    steps: int | None = flag(None, metavar="N", resume="safe", help="optimizer steps ({per_model})")
    epochs: float | int | None = flag(
        None,
        metavar="E",
        resume="safe",
        help="passes over a data file's training rows instead of --steps: the steps are E x rows / batch, rounded up",
    )
    batch_size: int | None = flag(
        None, metavar="B", help="global batch, a multiple of data axis x microbatches ({per_model})"
    )
    microbatches: int | None = flag(None, metavar="M", resume="safe", help="microbatches per step ({per_model})")
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    lora: LoraConfig | None = flag(
        None,
        metavar="KEY=VALUE,...",
        group="model and data",
        commands=("finetune", "demo"),
        help="LoRA adapters; only they (and modules_to_save) train. Default r=8,alpha=16,targets=all-linear (+ "
        "save=head for classifiers). {lora_keys}",
    )
    quantize: str | None = flag(
        None,
        metavar="KIND",
        group="model and data",
        commands=("finetune", "demo"),
        help="store the frozen base of the LoRA adapters in nf4 (QLoRA: bitsandbytes' 4-bit NormalFloat, a scale per "
        "64 inputs), int4 (symmetric, a scale per 128 inputs) or int8 (a scale per output); KIND:BLOCK sets a "
        "4-bit block, e.g. nf4:32; nf4:dq or nf4:32:dq stores NF4's scales in 8 bits (bitsandbytes' double "
        "quantisation) (default: the float base)",
    )
    objective: str = flag(
        "sft",
        choices=OBJECTIVES,
        group="training",
        resume="fixed",
        help="what a decoder minimises: sft (next-token loss), dpo (a reference: the base with the LoRA adapters off, "
        "or log-probabilities computed once before training without LoRA) or orpo (no reference); dpo/orpo train "
        "on {{prompt, chosen, rejected}} pairs; grpo (finetune: online RL) samples --num-generations completions "
        "of each prompt (a .jsonl of prompt lines) and rewards them with --reward (default sft)",
    )
    beta: float | int | None = flag(
        None,
        metavar="BETA",
        group="training",
        help="dpo's beta (how far from the reference; default 0.1), orpo's weight of the odds-ratio term (default "
        "0.1), or grpo's weight of the KL to the reference, the base with the adapters off (default 0: none)",
    )
    loss_type: str | None = flag(
        None,
        choices=LOSS_TYPES + GRPO_LOSS_TYPES,
        group="training",
        help="dpo's loss as TRL's: sigmoid, ipo, hinge or robust (default sigmoid); grpo's: grpo, bnpo, dr_grpo or "
        "dapo (default dapo)",
    )
    label_smoothing: float | int = flag(
        0.0,
        metavar="EPS",
        group="training",
        help="robust dpo: the probability in [0, 0.5) that a pair's label is flipped (default 0)",
    )
    seed: int = flag(0, help="seed of the model, head, adapters and batches (default 0)")
    dtype: str = flag(
        "float32",
        choices=("float32", "bfloat16"),
        help="compute dtype; parameters, gradients and their all-reduce stay float32 (default float32)",
    )
    devices: int | None = flag(
        None,
        metavar="N",
        group="devices and sharding",
        resume="launch",
        help="devices: simulated CPU devices on CPU (default 8), real ones on GPU/TPU (default all)",
    )
    mesh: dict[str, int] | None = flag(
        None,
        metavar="AXIS=SIZE,...",
        group="devices and sharding",
        resume="launch",
        help="mesh shape, e.g. data=8 or data=4,model=2 (default data=DEVICES); needs a data axis",
    )
    rules: str = flag(
        "dp",
        metavar="PRESET",
        group="devices and sharding",
        resume="safe",
        help="sharding rules preset: {rule_presets} (default dp); tp, fsdp+tp, ep and ep+fsdp (experts over 'model', a mixture of experts only) need a 'model' mesh axis; fsdp-once "
        "also sets the step's gather='once' (zoo.preset(name).step_options)",
    )
    mode: str = flag(
        "explicit",
        choices=("explicit", "shard_map"),
        group="devices and sharding",
        resume="safe",
        help="step mode (default explicit)",
    )
    init: str | None = flag(
        None,
        metavar="PATH",
        group="model and data",
        help="start from pretrained weights: a Hugging Face folder or a model id in the local Hugging Face cache "
        "({init_families}; its tokenizer.json is used when present, else byte tokens) or a `zoo train` output "
        "folder; minilm's default is the packaged all-MiniLM-L6-v2",
    )
    revision: str | None = flag(
        None,
        metavar="REV",
        group="model and data",
        help="the branch, tag or commit of the Hub model id the run starts from (default main); the run records "
        "the commit it resolved in its config.json, which --resume, zoo generate RUN and zoo export read",
    )
    model_config: dict[str, Any] = flag(
        factory=dict,
        metavar="KEY=VALUE,...",
        group="model and data",
        help="model config fields to change, e.g. d_model=128,num_layers=4 (TransformerConfig / EncoderConfig fields; "
        "mlp: width, depth; pretrained models: dropout, attention_dropout, remat)",
    )
    eval_every: int | None = flag(
        None,
        metavar="N",
        group="evaluation and outputs",
        resume="safe",
        help="evaluate every N steps (default: a tenth of --steps; 0: only before and after)",
    )
    eval_before: bool = flag(
        True,
        group="evaluation and outputs",
        resume="safe",
        help="evaluate the held-out set before the first step: the starting point of summary.json's loss_fell "
        "(and of the demo's exit code 1 when the loss did not fall); --no-eval-before starts training at once, as "
        "transformers' Trainer does by default (its eval_on_start), loss_fell then null (default yes)",
    )
    probe: int | None = flag(
        None,
        metavar="STEPS",
        group="model and data",
        resume="safe",
        help="classifiers: also fit the new head alone on frozen-encoder features (a linear probe: full-batch Adam, "
        "this many steps) and report it as a baseline; training starts from the new head either way (default 0: "
        "off{probe_demo})",
    )
    pooling: str | None = flag(
        None,
        choices=POOLINGS,
        group="model and data",
        help="classifiers: what the head reads: cls, the [CLS] state through the checkpoint's pooler as "
        "BertForSequenceClassification (the adapter is a peft SEQ_CLS one), or mean, the mean of the hidden "
        "states (sentence-transformers' features; the adapter is a peft FEATURE_EXTRACTION one, the head in "
        "adapter/head.safetensors) (default {pooling_default})",
    )
    output: str | None = flag(
        None,
        metavar="DIR",
        group="evaluation and outputs",
        resume="safe",
        help="output folder (default runs/{command}-MODEL-UTCTIME): config.json, metrics.jsonl, loss.png, "
        "summary.json, {outputs}, checkpoints/",
    )
    checkpoint_dir: str | None = flag(
        None,
        metavar="DIR",
        group="evaluation and outputs",
        resume="safe",
        help="checkpoints folder (default OUTPUT/checkpoints)",
    )
    checkpoint_every: int = flag(
        0,
        metavar="N",
        group="evaluation and outputs",
        resume="safe",
        help="save the trained leaves, optimizer state and key every N steps and at the end (default 0: none; a train "
        "run without a Hugging Face model/ folder, e.g. the mlp's, saves its end anyway)",
    )
    keep: int = flag(
        3, metavar="K", group="evaluation and outputs", resume="safe", help="checkpoints kept, newest first (default 3)"
    )
    resume: bool = flag(
        False,
        group="evaluation and outputs",
        resume="launch",
        help="continue from the newest checkpoint of --checkpoint-dir (or OUTPUT/checkpoints) up to --steps (default "
        "no)",
    )
    resume_step: int | None = flag(
        None,
        metavar="N",
        group="evaluation and outputs",
        resume="launch",
        help="resume from checkpoint step N instead of the newest (implies --resume; later steps are refused unless "
        "--overwrite deletes them)",
    )
    overwrite: bool = flag(
        False,
        group="evaluation and outputs",
        resume="launch",
        help="replace the outputs and checkpoints of an earlier run in --output (default no: such a folder is "
        "refused; --resume continues it instead)",
    )
    keep_best: str | None = flag(
        None,
        metavar="METRIC",
        group="evaluation and outputs",
        resume="safe",
        help="keep the checkpoint of the best evaluation by METRIC: eval_loss or eval_perplexity (lower is better), "
        "eval_accuracy or eval_macro_f1 (higher); saved in the checkpoints folder when an evaluation after a "
        "step improves on every earlier one, kept beyond --keep, named in summary.json's best (default: none)",
    )
    early_stop: int = flag(
        0,
        metavar="PATIENCE",
        group="evaluation and outputs",
        resume="safe",
        help="stop when the --keep-best metric (else eval_loss) has not improved for PATIENCE evaluations in a row; "
        "the run ends as at its last step (final evaluation, saves, export; summary.json's stopped_early) "
        "(default 0: never)",
    )
    skip_nonfinite: bool = flag(
        False,
        help="skip a step whose loss or gradients are NaN/inf (weights and optimizer state unchanged; counted as "
        "`skipped` in metrics.jsonl) instead of stopping the run with exit code 3 (default no)",
    )
    quiet: bool = flag(
        False,
        group="evaluation and outputs",
        resume="safe",
        help="no progress bar and header, only the summary (default no)",
    )
    sample_tokens: int = flag(
        32,
        metavar="N",
        group="evaluation and outputs",
        resume="safe",
        help="a decoder's run ends with a greedy sample of N tokens after the start of a validation window "
        "(summary.json's sample; default 32, at most the context left; 0: none, nothing compiled for it)",
    )
    tensorboard: str | None = flag(
        None,
        metavar="DIR",
        group="evaluation and outputs",
        resume="safe",
        help="also write TensorBoard event files (loss, lr, eval_loss, eval_accuracy, eval_perplexity, eval_macro_f1, "
        "per-class precision/recall/f1) into DIR; needs tensorboardX (pip install 'eqx-zoo[tensorboard]')",
    )
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
        for field in ("seed", "checkpoint_every", "early_stop", "sample_tokens"):
            if not integer(getattr(self, field)) or getattr(self, field) < 0:
                raise bad(field, "an integer >= 0")
        if self.seed > MAX_SEED:
            raise bad("seed", f"below 2**32 (at most {MAX_SEED}: the seeds jax and numpy take)")
        if self.epochs is not None and (
            isinstance(self.epochs, bool) or not isinstance(self.epochs, int | float) or not 0 < self.epochs < MAX_COUNT
        ):
            raise bad("epochs", "a finite number > 0 (or None)")
        optional = ("steps", "batch_size", "microbatches", "eval_every", "probe", "resume_step", "devices")
        for field in optional:
            value = getattr(self, field)
            low = 0 if field in ("eval_every", "probe") else 1
            if value is not None and (not integer(value) or value < low):
                raise bad(field, f"an integer >= {low} (or None)")
        for field in ("keep", "checkpoint_every", "early_stop", "sample_tokens", *optional):
            value = getattr(self, field)
            if value is not None and value > MAX_COUNT:
                raise bad(field, f"at most {MAX_COUNT} (2**31 - 1: compiled programs count in int32)")
        if self.keep_best is not None:
            try:
                watched_metric(self.keep_best)
            except ValueError as e:
                raise bad("keep_best", f"an evaluation metric ({', '.join(WATCHED)})") from e
        for field in dataclasses.fields(self):  # a string "no" would read as true
            if field.type in ("bool", bool) and not isinstance(getattr(self, field.name), bool):
                raise bad(field.name, "True or False")
        if self.probe and not self.eval_before:
            raise ConfigError(
                "RunConfig.probe fits the new head on the frozen encoder's features in the evaluation before "
                "training, which RunConfig.eval_before=False leaves out: drop RunConfig.probe, or evaluate before "
                "training (RunConfig.eval_before)"
            )
        if self.early_stop and self.eval_every == 0:
            raise ConfigError(
                "RunConfig.early_stop counts evaluations during the run, but RunConfig.eval_every is 0 "
                "(only before and after): set RunConfig.eval_every"
            )
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise bad("pooling", f"one of {list(POOLINGS)} (or None)")
        if self.objective not in OBJECTIVES:
            raise bad("objective", f"one of {list(OBJECTIVES)}")
        if not isinstance(self.grpo, GRPOConfig):
            raise bad("grpo", "a zoo.train.GRPOConfig")
        if self.objective == "grpo":
            try:
                self.grpo_loss()
            except ValueError as e:
                raise ConfigError(f"RunConfig: {e}") from None
        elif self.objective != "sft":
            try:
                self.preference_loss()
            except ValueError as e:
                raise ConfigError(f"RunConfig: {e}") from None
        if self.dtype not in ("float32", "bfloat16"):
            raise bad("dtype", "'float32' or 'bfloat16'")
        if self.quantize is not None:
            quantize_kind(self.quantize)
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

        defaults = OBJECTIVE_DEFAULTS[self.objective]
        return PreferenceLoss(
            self.objective,
            beta=defaults["beta"] if self.beta is None else self.beta,
            loss_type=defaults["loss_type"] if self.loss_type is None else self.loss_type,
            label_smoothing=self.label_smoothing,
            reference=disabled_adapters,
        )

    def grpo_loss(self):
        """The `zoo.models.GRPOLoss` of `objective` grpo (`beta`, `loss_type`, and `grpo`'s
        clip, importance level, completion length and temperature), its reference the model
        with its adapters disabled."""
        from ..lora import disabled_adapters
        from ..models._grpo import GRPOLoss

        defaults = OBJECTIVE_DEFAULTS["grpo"]
        g = self.grpo
        return GRPOLoss(
            loss_type=defaults["loss_type"] if self.loss_type is None else self.loss_type,
            beta=defaults["beta"] if self.beta is None else self.beta,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_high,
            importance_sampling_level=g.importance_sampling_level,
            max_completion_length=g.max_completion_length,
            temperature=g.temperature,
            reference=disabled_adapters,
        )
