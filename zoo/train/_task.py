"""A model on its data: `Task` (built from a `RunConfig` by `zoo.train.build_task`). Also
the pieces a model's builder shares: loading an `--init` checkpoint (`load_pretrained`,
of the folder `_registry.resolve_init` names), configs from dicts, and the traced metric functions of each task kind.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._distributed import is_main_process
from .._jit import once_compiler_options
from .._rules import PlacementError
from ..data import BatchSource
from ..models import cross_entropy
from ..models._loss import token_loss
from ._errors import ConfigError
from ._registry import check_init_family, init_families, model_spec, resolve_init, shapes_folder

if TYPE_CHECKING:  # _config imports _lora, which imports this module
    from ._config import RunConfig

_INITIALISERS: dict[Any, Any] = {}
_ABSTRACT = contextvars.ContextVar("abstract_models", default=False)


@contextlib.contextmanager
def abstract_models() -> Iterator[None]:
    """Inside, a model built from scratch (`init_compiled`) comes out abstract: its array
    leaves `jax.ShapeDtypeStruct`s, nothing initialised, compiled or allocated. What `zoo
    info` shows needs only shapes, dtypes and axes: a billion-parameter config's table
    without its gigabytes (initialising them held several times the model's bytes)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


@dataclasses.dataclass
class Task:
    """A model on its data: everything the training loop needs.

    - `model`: the model (not yet LoRA-wrapped; placed or not).
    - `kind`: `"regression"`, `"lm"`, `"classification"`, `"preference"` (dpo, orpo) or
      `"grpo"`.
    - `loss_fn`: the `zoo.TrainStep` loss.
    - `metrics_fn(model, batch)`: per-example `loss` sums, `weight`s and (not for
      regression) `correct` counts; a classifier's also its `predicted` classes and pooled
      `features`. Batches carry a `weight` per row (0 for padding rows).
    - `train_source`: what it trains on, a `zoo.data.BatchSource` (a user's file: its
      `zoo.data.Dataset`); `seed`: the batches' seed (`RunConfig.seed`). `batch_at` asks
      the source for a step's batch.
    - `eval_data` / `train_data`: held-out and training examples (numpy, rows first) for
      evaluation and the probe.
    - `data`: what the data is, in words; `unit`: `"examples"` or `"tokens"`, per example
      `tokens_per_example`.
    - `hf_part(model)`: the part `zoo.hf.save_pretrained` writes (None: none);
      `tokenizer_dir`: where the tokenizer's files are (copied next to a saved model).
    - `config`: the model's config as a dict; `init`: where pretrained weights came from.
    - `fingerprint`: the sha256 of a user's data file (`"data_sha256"`) and chat template
      file (`"chat_template_sha256"`) as they were read: saved with each checkpoint, so
      that a resume refuses files edited in between (`{}` for built-in data).
    - `adapter_names`: several LoRA adapters trained at once (`_adapters.adapters_task`):
      their names, in index order (each batch row's `"adapter"`); None: one model.
    - `evaluate(model, eval_data)`: the task's own held-out evaluation, in place of the
      `Evaluator`'s batched `metrics_fn` (GRPO's: rollouts of held-out prompts); None: that.
    """

    model: Any
    kind: str
    loss_fn: Callable
    metrics_fn: Callable
    train_source: BatchSource
    seed: int
    eval_data: dict
    train_data: dict | None
    data: str
    unit: str
    tokens_per_example: int
    label_names: tuple[str, ...] | None = None
    hf_part: Callable[[Any], Any] | None = None
    tokenizer_dir: Path | None = None
    config: dict | None = None
    init: str | None = None
    fingerprint: dict[str, str] = dataclasses.field(default_factory=dict)
    adapter_names: tuple[str, ...] | None = None
    evaluate: Callable[..., dict] | None = None

    @property
    def classifier(self) -> bool:
        """Whether the task classifies (a new head, fitted by the probe, saved under LoRA)."""
        return self.kind == "classification"

    def batch_at(self, step: int, batch_size: int, *, mesh: Any = None) -> dict:
        """The numpy batch of training step `step` (from 1), this process's rows of it
        (`train_source.batch_at` with the task's `seed`; `mesh`: the run's, which says
        the rows when there are several processes). A function of the step alone, so a
        resumed run sees the batches it would have seen."""
        return self.train_source.batch_at(step, batch_size, seed=self.seed, mesh=mesh)


# -- metrics (traced) --


def regression_metrics(model, batch):
    """Per-example squared error (`loss`, weighted) and `weight` of a regressor on
    `{"x", "y", "weight"}`."""
    import jax.numpy as jnp

    err = jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)
    return {"loss": err * batch["weight"], "weight": batch["weight"]}


def regression_loss(model, batch):
    """Per-example mean squared error of a regressor on `{"x", "y"}`: a `zoo.TrainStep` loss."""
    import jax.numpy as jnp

    return jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)


def lm_metrics(model, batch):
    """Per-row next-token `loss` sums, target `weight`s and `correct` counts of a decoder on
    `{"tokens", "weight"}` (and `"weights"` / `"mask"` / packing keys when the batch has
    them), each row scaled by its `weight` (0 on the evaluator's padding rows). The loss is
    `zoo.models.next_token_loss` itself, so held-out tokens weigh as in training (only
    completions / assistant turns, packed documents apart), and like it never holds the
    full logits where they are large (`TransformerConfig.loss_chunk`): the accuracy is
    read a chunk of positions at a time with the loss."""
    row = batch["weight"]
    sums, weights, _, hits = token_loss(model, {k: v for k, v in batch.items() if k != "weight"}, correct=True)
    return {"loss": sums * row, "weight": weights * row, "correct": hits * row}


def classifier_metrics(model, batch):
    """Per-example cross-entropy (`loss`, weighted), `weight`, `correct`, the `predicted`
    class and the pooled `features` (what its head reads, mean or CLS) of a
    `zoo.models.EncoderClassifier` on `{"tokens", "mask", "labels",
    "weight"}` (`token_types` optional)."""
    import jax.numpy as jnp

    features = model.features(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types"))
    logits = model.head(features)
    w = batch["weight"]
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
    ce = cross_entropy(logits, batch["labels"])
    predicted = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return {"loss": ce * w, "weight": w, "correct": correct * w, "features": features, "predicted": predicted}


# -- pieces the builders share --


def init_compiled(name: Any, build: Callable[[Any], Any], key) -> Any:
    """`build(key)` as one jitted program compiled without LLVM's costly optimisations
    (a large model's with them: `once_compiler_options`): about half the CPU time of
    running the initialisers op by op, each compiled alone.
    Same values as running it eagerly, up to float rounding. Compiled once per `name`
    (which must name the model's configuration too) and mesh set by `jax.set_mesh`."""
    import equinox as eqx
    import jax

    if _ABSTRACT.get():
        return eqx.filter_eval_shape(build, key)
    # The arrays come out on the mesh set when it was compiled: another mesh (a second
    # run in this process on other devices) is another program.
    name = (name, jax.sharding.get_mesh())
    if name not in _INITIALISERS:
        static: dict[str, Any] = {}

        def arrays_of(k):
            arrays, static["tree"] = eqx.partition(build(k), eqx.is_array)
            return arrays

        lowered = jax.jit(arrays_of).lower(key)
        compiled = lowered.compile(compiler_options=once_compiler_options(lowered))
        _INITIALISERS[name] = (compiled, static)
    compiled, static = _INITIALISERS[name]
    return eqx.combine(compiled(key), static["tree"])


def load_pretrained(folder: Path, kind: type, overrides: dict[str, Any], *, rules, mesh):
    """The `kind` model (`zoo.models.Transformer` / `Encoder`) in `folder`, read onto
    `mesh` under `rules` with config `overrides`; a `ConfigError` for a checkpoint of
    another architecture or one the zoo cannot load."""
    from .. import hf

    try:
        model = hf.from_pretrained(folder, rules=rules, mesh=mesh, config_overrides=overrides)
    except PlacementError as e:  # the library's fix (a rules mapping, zoo.rules(...)) is no setting of a run
        problem = e.problem.removeprefix(f"{folder}: ")
        fix = "choose other RunConfig.rules (dp replicates every weight)"
        if e.where is None and e.size is not None:  # a head count that the mesh axes splitting heads do not divide
            fix += f", or a RunConfig.mesh whose axis that splits heads divides {e.size}"
        raise ConfigError(f"RunConfig.rules cannot place {folder} on this mesh: {problem}; {fix}") from e
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ConfigError(f"RunConfig.init {folder}: {str(e).splitlines()[0]}") from e
    if not isinstance(model, kind):
        raise ConfigError(
            f"RunConfig.init {folder} holds a {type(model).__name__}, but this model needs a "
            f"{' / '.join(init_families(kind))} checkpoint"
        )
    return model


def load_cls_classifier(folder: Path, num_labels: int, overrides: dict[str, Any], *, key, rules, mesh):
    """The `BertForSequenceClassification` of the BERT checkpoint in `folder` as a
    `zoo.models.EncoderClassifier(pooling="cls")` with a new `num_labels`-way head
    (`zoo.hf.load_bert_classifier`); a `ConfigError` saying what to do when the checkpoint
    has no pooler."""
    from .. import hf

    try:
        return hf.load_bert_classifier(
            folder, num_labels=num_labels, key=key, rules=rules, mesh=mesh, config_overrides=overrides
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        if "no BERT pooler" in str(e):
            raise ConfigError(
                f"RunConfig.pooling cls: {folder} holds no BERT pooler (pooler.dense.*), which BertForSequenceClassification "
                "classifies through (zoo's own BERT export has none); use RunConfig.pooling mean"
            ) from e
        raise ConfigError(f"RunConfig.init {folder}: {str(e).splitlines()[0]}") from e


def config_from(cls, values: dict[str, Any], flag: str = "RunConfig.model_config"):
    """`cls.from_dict(values)` (a zoo config class), its errors as a `ConfigError`."""
    try:
        return cls.from_dict(values)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{flag}: {e}") from e


def tokenizer_of(folder: Path | None):
    """The init folder's tokenizer (`zoo.hf.Tokenizer`) when it has a tokenizer.json,
    else None (byte-level tokens)."""
    if folder is not None and (folder / "tokenizer.json").is_file():
        from .. import hf

        return hf.Tokenizer.from_pretrained(folder)
    return None


def decoder_of(tokenizer) -> Callable[[Any], str]:
    """ids → text: `tokenizer.decode` (special tokens dropped), or UTF-8 bytes without one."""

    def decode(ids) -> str:
        ids = [int(i) for i in ids]
        if tokenizer is None:  # byte tokens
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return tokenizer.decode(ids)

    return decode


# A vocabulary above this many ids is a tokenizer's, not byte tokens' (256, a few specials).
BYTE_VOCAB_AT_MOST = 512


def check_vocab(vocab: int, tokenizer, where: str) -> None:
    """Byte tokens (no tokenizer) need a vocabulary of at least 256 ids; a larger
    vocabulary than byte tokens use (a pretrained model's folder without its tokenizer
    files) is warned about: its data would be bytes, not the tokens the model learned."""
    if tokenizer is None and vocab < 256:
        raise ConfigError(f"{where} has a vocabulary of {vocab} ids but no tokenizer.json: byte tokens need 256")
    if tokenizer is None and vocab > BYTE_VOCAB_AT_MOST and is_main_process():
        print(
            f"zoo: warning: {where} has no tokenizer.json: the data is read as UTF-8 bytes (ids 0-255), not as the "
            f"{vocab:,}-token vocabulary the model learned; copy the model's tokenizer files (tokenizer.json, "
            "tokenizer_config.json) into the folder to train on its own tokens",
            file=sys.stderr,
            flush=True,
        )


def init_folder(c: RunConfig) -> Path | None:
    """The checkpoint folder of `c.init` (checked against the spec's `init_class` by
    its `config.json` `model_type`, before any weight is read), else the spec's
    `pretrained` folder, else None. Without data (`c.data.source` None: `zoo info`,
    `zoo inspect`), a `zoo finetune` run's base, unmerged (`shapes_folder`)."""
    spec = model_spec(c.model)
    if c.init:
        # No data (`zoo info` / `zoo inspect`): the shapes alone, a run's base unmerged.
        folder = (
            resolve_init(c.init, what="RunConfig.init", revision=c.revision)
            if c.data.source is not None
            else shapes_folder(c.init, what="RunConfig.init", revision=c.revision)
        )
        check_init_family(spec, folder)
        return folder
    if spec.pretrained is not None:
        return spec.pretrained()
    return None


def check_pretrained_seq_len(c: RunConfig, folder: Path | None) -> None:
    """Refuse a `DataConfig.seq_len` longer than the pretrained model in `folder` embeds
    (its config.json's positions, or `model_config`'s `max_len` over them), from that file
    alone: before a data file's rows are cut at that length and counted (a length it cannot
    take was reported as too few rows) and before any weight is read."""
    from .. import hf
    from ..hf._files import read_config

    if folder is None or not c.data.seq_len:
        return
    try:
        values = read_config(folder)
        family = hf.get_family(values.get("model_type"), str(folder / "config.json"))
        overrides = {"family": family.name, "source_dir": str(folder.resolve())} | dict(c.model_config)
        config = family.config_from_hf(values, **overrides)
        max_len = getattr(config, "max_seq", config.max_len)  # RoBERTa's positions start after the pad id
    except (OSError, ValueError, TypeError, KeyError):
        return  # what this file cannot tell, the model's load reports in its own words
    if c.data.seq_len > max_len:
        raise ConfigError(
            f"DataConfig.seq_len {c.data.seq_len} exceeds the model's max_len {max_len} (the positions {folder} embeds); "
            "lower DataConfig.seq_len"
        )


def init_name(c: RunConfig, folder: Path | None) -> str | None:
    """Where a model's pretrained weights came from, in words (None: from scratch)."""
    if c.init is None and c.model == "minilm":
        return "the pretrained all-MiniLM-L6-v2"
    return None if folder is None else str(folder)
