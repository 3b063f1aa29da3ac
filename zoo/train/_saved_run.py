"""A finished run read back from its folder: `load_run` → `SavedRun`, the trained model with
what it needs to be used (its tokenizer, label names, chat template), for prediction,
evaluation on a data file and a merged Hugging Face export (`zoo predict`, `zoo eval`,
`zoo export`).

The model is rebuilt from the run's config.json as the run built it (the registry's
builders), then given the trained weights from what the run left, in this order: its
`adapter/` (a LoRA run: onto the base model its `init` names), its `model/` (a Hugging
Face folder, a classifier's head beside it in `head.safetensors`), or its newest intact
checkpoint (the mlp, a decoder no Hugging Face family expresses).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._checkpoint import Checkpointer, CheckpointError
from ..data import ChatTemplate, read_records
from ..data._dataset import _labels as file_label_names
from ..lora import adapter_names, load_adapter, load_adapters
from ..lora._io import CONFIG_NAME
from ..models import classification_loss, next_token_loss
from ._adapters import adapter_files, read_adapter_records, stacked
from ._build import training_step
from ._build_task import build_task
from ._config import RunConfig
from ._continue import saved_config
from ._errors import ConfigError
from ._head import HEAD_NAME, load_head, read_labels
from ._lora import add_lora
from ._model_config import PRETRAINED_KEYS
from ._plan import checkpoint_dir
from ._registry import ModelSpec, model_spec
from ._task import regression_loss, tokenizer_of

_LOSSES = {"regression": regression_loss, "lm": next_token_loss, "classification": classification_loss}


@dataclasses.dataclass
class SavedRun:
    """A run's trained model and what using it needs (`zoo.train.load_run`).

    **Fields:**

    - `folder`: the run's folder; `config`: its `RunConfig` (config.json).
    - `kind`: `"regression"`, `"lm"` or `"classification"`.
    - `model`: the trained model (a LoRA run's with its branches, unmerged).
    - `label_names`: a classifier's classes, label `i` being the `i`-th (None otherwise).
    - `tokenizer`: the `zoo.hf.Tokenizer` it reads text with, None for UTF-8 byte tokens
      (and the mlp); `tokenizer_dir`: the folder of its files.
    - `chat_template`: the `zoo.data.ChatTemplate` a decoder's chat data was rendered
      with (the run's `--chat-template`, else its tokenizer's), or None.
    - `weights`: where the trained weights were read, in words; `notes`: what the caller
      should know (e.g. labels named by their ids: an older run that stored no names).
    """

    folder: Path
    config: RunConfig
    kind: str
    model: Any
    label_names: tuple[str, ...] | None = None
    tokenizer: Any = None
    tokenizer_dir: Path | None = None
    chat_template: ChatTemplate | None = None
    weights: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def seq_len(self) -> int | None:
        """Tokens per example the run trained with (None: the mlp)."""
        return self.config.data.seq_len

    def predict(self, inputs: Sequence[str] | Any, *, batch_size: int = 64) -> np.ndarray:
        """A classifier's logits `[n, labels]` of texts, read as the run read its own (its
        tokenizer or UTF-8 bytes, cut and padded to its `seq_len`); a regressor's outputs
        `[n, out]` of numbers `[n, in]`. float32 numpy, computed `batch_size` rows at a
        time. A `ConfigError` for a language model (it generates) or inputs of the wrong kind."""
        from ._predict import predict

        return predict(self, inputs, batch_size=batch_size)

    def evaluate(self, path: str | Path, *, batch_size: int = 64) -> dict[str, Any]:
        """The model on every example of the data file `path` (`.txt`, `.jsonl`, `.csv`, read
        as `zoo train --data` reads them, with the run's tokenizer, `seq_len`, packing and
        chat template).

        **Returns:** a language model's `{"kind": "lm", "rows", "tokens" (the target tokens
        its loss counts: completions, assistant turns), "loss" (their mean cross-entropy,
        nats), "perplexity", "accuracy"}`; a classifier's `{"kind": "classification",
        "examples", "loss", "accuracy", "macro_f1", "per_class"}`
        (`zoo.train.classification_scores`), the file's labels matched to the run's by
        name. **Raises:** `ConfigError` for a file of the other kind, labels the run lacks,
        or a regressor (it trains on its own data only)."""
        from ._evaluate_file import evaluate_file

        return evaluate_file(self, path, batch_size=batch_size)

    def export(self, directory: str | Path) -> list[Path]:
        """Write the model as a Hugging Face folder, LoRA branches merged (`zoo.lora.merge`),
        the tokenizer's files beside it: a decoder transformers opens as its family's causal
        LM (the same logits); a classifier's encoder (`BertModel`: the same hidden states)
        with its head in `head.safetensors` (zoo's `[in, out]` layout, the pooling in its
        metadata) and its label names as config.json's `id2label`. A folder holding files of
        the names written must already be a Hugging Face model folder (a user's own files
        are never replaced: `FileExistsError`).

        **Returns:** the paths written. **Raises:** `ConfigError` for a regressor (no
        Hugging Face form) or a decoder no Hugging Face family expresses."""
        from ._merged import export_merged

        return export_merged(self, directory)


def load_run(folder: str | Path) -> SavedRun:
    """Read the trained model of a `zoo train` / `zoo finetune` / `zoo demo` run folder.

    **Arguments:** `folder`: the run's output folder (config.json, and adapter/, model/ or
    checkpoints/).

    **Returns:** a `SavedRun`, on jax's default device. **Raises:** `ConfigError` naming
    what is missing (no run there, a base model moved away, no weights saved).
    """
    folder = Path(folder).expanduser()
    try:
        values = saved_config(str(folder))
    except ConfigError as e:
        raise ConfigError(str(e).replace("RunConfig.resume: ", "")) from None
    if values is None or "model" not in values:
        raise ConfigError(
            f"{folder}: no config.json of a zoo run there; give the output folder of zoo train / zoo finetune "
            "(config.json with model/ or adapter/ beside it)"
        )
    c = RunConfig.from_dict(values)
    spec = model_spec(c.model)
    names, notes = read_labels(folder), []
    adapter, hf = folder / "adapter", folder / "model"
    several = c.lora is not None and _several(adapter)  # several adapters trained at once: adapter/NAME/
    if several or (c.lora is not None and (adapter / "adapter_config.json").is_file()):
        model, tok_dir, names = _base(c, spec, folder, names, notes, what="the base model of its adapter")
        try:
            model, _ = (load_adapters if several else load_adapter)(model, adapter)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"{adapter}: {str(e).splitlines()[0]}") from e
        held = f" (adapters {', '.join(adapter_names(model))})" if several else ""
        weights = f"{adapter}{held} on {c.init or 'the ' + c.model}"
    elif (hf / "config.json").is_file() and (not spec.classifier or (hf / HEAD_NAME).is_file()):
        keep = {k: v for k, v in c.model_config.items() if k in PRETRAINED_KEYS}
        model, tok_dir, names = _base(dataclasses.replace(c, init=str(hf), model_config=keep), spec, folder, names,
                                      notes, what="its model/")  # fmt: skip
        if spec.classifier:
            try:
                model = load_head(model, hf / HEAD_NAME)
            except ValueError as e:
                raise ConfigError(str(e).splitlines()[0]) from e
        weights = str(hf)
    else:
        model, tok_dir, names, weights = _from_checkpoint(c, spec, folder, names, notes)
    tokenizer = tokenizer_of(tok_dir) if spec.kind != "regression" else None
    run = SavedRun(folder, c, spec.kind, model, names, tokenizer, tok_dir if tokenizer is not None else None,
                   weights=weights, notes=notes)  # fmt: skip
    if spec.kind == "lm":
        run.chat_template = _chat_template(c, folder, run.tokenizer_dir, notes)
    return run


def _several(adapter: Path) -> bool:
    """Whether a run's adapter/ holds named adapters in subfolders (peft's layout of several)."""
    return adapter.is_dir() and any(s.is_dir() and (s / CONFIG_NAME).is_file() for s in adapter.iterdir())


def _base(c: RunConfig, spec: ModelSpec, folder: Path, names, notes: list[str], *, what: str):
    """`(model with the weights `c.init` names, its tokenizer's folder, label names)`: the
    model as the run built it (a classifier with as many labels as it had)."""
    try:
        if spec.file_model is None or (spec.classifier and names is None and c.data.source in spec.datasets):
            task = build_task(c, rules=None, mesh=None)  # the built-in data's task knows its labels
            return task.model, task.tokenizer_dir, task.label_names
        if spec.classifier and names is None:
            names = _older_labels(c, folder, notes)
        model, _, tok_dir = spec.file_model(c, len(names) if spec.classifier else None, rules=None, mesh=None)
    except ConfigError as e:
        raise ConfigError(f"{folder}: {what}: {str(e).splitlines()[0]}") from None
    return model, tok_dir, names


def _older_labels(c: RunConfig, folder: Path, notes: list[str]) -> tuple[str, ...]:
    """The label names of a classifier trained on a data file by a zoo that stored none:
    the file's own (the same rule, if it is still there), else ids from summary.json's count."""
    path = Path(c.data.source).expanduser()
    if path.is_file():
        try:
            _, records = read_records(path)
            return file_label_names(records, [str(path)] * len(records))[1]
        except ValueError:
            pass
    try:
        count = int(re.search(r", (\d+) classes", json.loads((folder / "summary.json").read_text())["data"])[1])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{folder} stores no label names (labels.json: written by newer zoo runs), its data file {path} is gone "
            "and summary.json does not give the number of classes; train it again"
        ) from None
    notes.append(f"{folder} stores no label names (a run of an older zoo) and its data file is gone: labels are ids")
    return tuple(str(i) for i in range(count))


def _from_checkpoint(c: RunConfig, spec: ModelSpec, folder: Path, names, notes: list[str]):
    """The model of the run's newest intact checkpoint, its tokenizer's folder, label names
    and where it came from."""
    directory = checkpoint_dir(c, folder)
    # Read-only: a run may still be training into it (its saves in flight stay untouched).
    with Checkpointer(directory, read_only=True) if directory.is_dir() else nullcontext() as checkpointer:
        if checkpointer is None or not checkpointer.steps():
            saved = "a classifier's head (model/head.safetensors), " if spec.classifier else ""
            raise ConfigError(
                f"{folder} holds no trained weights: no adapter/, model/ ({saved}written at a run's end) or checkpoint "
                f"in {directory}; was the run stopped before its end without --checkpoint-every?"
            )
        model, tok_dir, names = _base(c, spec, folder, names, notes, what="its model")
        if c.lora is not None:
            model = add_lora(model, c.lora, c.seed)
        adapters = _adapter_names(c, spec)
        if adapters is not None:  # several adapters trained at once, named by its data
            model = stacked(model, adapters)
        step = training_step(c, _LOSSES[spec.kind], model, per_adapter=adapters is not None)
        params, frozen = step.partition(model)
        like = {"params": params, "opt_state": step.init(model), "key": jax.random.key(c.seed)}
        try:
            (number, state, _), _ = checkpointer.restore_intact(like)
        except CheckpointError as e:
            raise ConfigError(f"{directory}: {str(e).splitlines()[0]}") from e
    return eqx.combine(state["params"], frozen), tok_dir, names, f"{directory} step {number}"


def _adapter_names(c: RunConfig, spec: ModelSpec) -> tuple[str, ...] | None:
    """The adapters a LoRA run of several trained, named by its data (None: one model)."""
    source = c.data.source
    if c.lora is None or spec.kind != "lm" or source is None or source in spec.datasets:
        return None
    if adapter_files(source) is None and not Path(source).expanduser().is_file():
        return None  # a one-adapter run's data file gone: the checkpoint says which
    try:
        records = read_adapter_records(source)
    except (ConfigError, OSError) as e:
        raise ConfigError(f"the run's data {source} names its adapters but cannot be read: {e}") from None
    return None if records is None else records.names


def _chat_template(c: RunConfig, folder: Path, tok_dir: Path | None, notes: list[str]) -> ChatTemplate | None:
    """The chat template the run rendered chat data with: its `--chat-template` file (as
    given, else beside the run), else its tokenizer folder's own."""
    given = c.data.chat_template
    if given is not None:
        path = next((p for p in (Path(given).expanduser(), folder / given) if p.is_file()), None)
        if path is not None:
            return ChatTemplate.from_pretrained(tok_dir, template=path.read_text(encoding="utf-8"))
        notes.append(f"the run's chat template {given} is gone: chat data is read with the tokenizer's own, if any")
    return None if tok_dir is None else ChatTemplate.from_pretrained(tok_dir)
