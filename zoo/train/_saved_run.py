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
import math
import os
import re
import shutil
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._checkpoint import Checkpointer, CheckpointError
from .._export_dir import check_export_dir
from .._files import atomic_write
from ..data import ChatTemplate, DataFormatError, read_records
from ..data import load as load_data
from ..data._dataset import _labels as file_label_names
from ..data._records import folder_refused
from ..hf import save_bert_classifier, save_pretrained
from ..lora import adapter as lora_adapter
from ..lora import adapter_names, load_adapter, load_adapters, merge, set_adapter
from ..lora._io import CONFIG_NAME
from ..models import classification_loss, next_token_loss
from ..models._preference import OBJECTIVES
from ._adapters import add_lora, quantize_base, read_adapter_records, stacked
from ._build import build_task, training_step
from ._config import RunConfig, saved_config
from ._errors import ConfigError
from ._export import TOKENIZER_FILES, export_dtype, merged_readme
from ._head import HEAD_NAME, load_head, read_labels, save_head
from ._plan import checkpoint_dir
from ._preference import evaluate_pairs
from ._registry import PRETRAINED_KEYS, ModelSpec, merged_path, model_spec
from ._scores import classification_scores
from ._task import lm_metrics, regression_loss, tokenizer_of
from ._text import adapter_files
from ._user_data import LM_KINDS, byte_tokenizer, read_kind

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
        name; a dpo / orpo run's on preference pairs: TRL's eval metrics as its own
        evaluation computes them (`{"kind": "preference", "pairs", "loss", "accuracy",
        "rewards/chosen", ..., "logps/rejected"}`, ORPO's three more; `evaluate_pairs`).
        **Raises:** `ConfigError` for a file of the other kind, labels the run lacks,
        or a regressor (it trains on its own data only)."""
        return evaluate_file(self, path, batch_size=batch_size)

    def export(self, directory: str | Path, *, adapter: str | None = None, dtype: str | None = None) -> list[Path]:
        """Write the model as a Hugging Face folder, LoRA branches merged (`zoo.lora.merge`),
        the tokenizer's files beside it: a decoder transformers opens as its family's causal
        LM (the same logits); a classifier's encoder (`BertModel`: the same hidden states)
        with its head in `head.safetensors` (zoo's `[in, out]` layout, the pooling in its
        metadata) and its label names as config.json's `id2label`. A folder holding files of
        the names written must already be a Hugging Face model folder (a user's own files
        are never replaced: `FileExistsError`). A run of several adapters exports one:
        `adapter` names it (`zoo.lora.adapter`).

        **Returns:** the paths written. **Raises:** `ConfigError` for a regressor (no
        Hugging Face form), a decoder no Hugging Face family expresses, or a run of several
        adapters without `adapter` (or one it does not hold). `dtype`: the floating weights'
        dtype (`"float32"`, `"bfloat16"`, `"float16"`; default the base model's, as its
        config.json names it: a bfloat16 base gives a bfloat16 merge, as transformers + peft
        write it)."""
        return export_merged(self, directory, adapter=adapter, dtype=dtype)


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
    if values is not None and "model_type" in values and "model" not in values:  # a model, not a run
        raise ConfigError(
            f"{folder}: a Hugging Face model folder ({values['model_type']}), not a zoo run; give the output folder "
            f"of zoo train / zoo finetune (zoo finetune {folder} --data FILE makes one)"
        )
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
        model = quantize_base(model, c)  # the base the adapter trained on (--quantize), as the run built it
        held = f" (adapters {', '.join(adapter_names(model))})" if several else ""
        weights = f"{adapter}{held} on {c.init or 'the ' + c.model}"
    elif (hf / "config.json").is_file() and (not spec.classifier or (hf / HEAD_NAME).is_file()):
        keep = {k: v for k, v in c.model_config.items() if k in PRETRAINED_KEYS}
        model, tok_dir, names = _base(
            dataclasses.replace(c, init=str(hf), model_config=keep), spec, folder, names, notes, what="its model/"
        )
        if spec.classifier:
            try:
                model = load_head(model, hf / HEAD_NAME)
            except ValueError as e:
                raise ConfigError(str(e).splitlines()[0]) from e
        weights = str(hf)
    else:
        model, tok_dir, names, weights = _from_checkpoint(c, spec, folder, names, notes)
    tokenizer = tokenizer_of(tok_dir) if spec.kind != "regression" else None
    run = SavedRun(
        folder,
        c,
        spec.kind,
        model,
        names,
        tokenizer,
        tok_dir if tokenizer is not None else None,
        weights=weights,
        notes=notes,
    )
    if spec.kind == "lm":
        run.chat_template = _chat_template(c, folder, run.tokenizer_dir, notes)
    return run


def _several(adapter: Path) -> bool:
    """Whether a run's adapter/ holds named adapters in subfolders (peft's layout of several)."""
    return adapter.is_dir() and any(s.is_dir() and (s / CONFIG_NAME).is_file() for s in adapter.iterdir())


def _base(c: RunConfig, spec: ModelSpec, folder: Path, names, notes: list[str], *, what: str):
    """`(model with the weights `c.init` names, its tokenizer's folder, label names)`: the
    model as the run built it (a classifier with as many labels as it had)."""
    merge_run(c.init)  # a `zoo finetune` run as its init: merged into zoo's cache if missing there
    try:
        if spec.file_model is None or (spec.classifier and names is None and c.data.source in spec.datasets):
            task = build_task(c, rules=None, mesh=None)  # the built-in data's task knows its labels
            return task.model, task.tokenizer_dir, task.label_names
        if spec.classifier and names is None:
            names = _older_labels(c, folder, notes)
        model, _, tok_dir = spec.file_model(c, len(names) if spec.classifier else None, rules=None, mesh=None)
    except ConfigError as e:
        check_base_there(folder, c.init, what)
        raise ConfigError(f"{folder}: {what}: {str(e).splitlines()[0]}") from None
    return model, tok_dir, names


def check_base_there(folder: Path, init: str | None, what: str = "the base model of its adapter") -> None:
    """Refuse the run in `folder` when `init`, the base model its config.json names by its
    full path (as a run stores a folder), is no longer there: a `ConfigError` naming it
    and how to point the run at where it went. A Hub id, or a folder there: nothing."""
    path = Path(init).expanduser() if init else None
    if path is not None and path.is_absolute() and not path.exists():
        raise ConfigError(
            f'{folder}: {what}, {path}, is gone; put it back there, or set "init" in '
            f"{folder / 'config.json'} to where it is now"
        )


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
            model = quantize_base(add_lora(model, c.lora, c.seed), c)
        adapters = _adapter_names(c, spec)
        if adapters is not None:  # several adapters trained at once, named by its data
            model = stacked(model, adapters)
        step = training_step(c, _LOSSES[spec.kind], model, per_adapter=adapters is not None)
        params, frozen = step.partition(model)
        like = {"params": params, "opt_state": step.init(model), "key": jax.random.key(c.seed)}
        try:
            (number, state, _), skipped = checkpointer.restore_intact(like)
        except CheckpointError as e:
            raise ConfigError(f"{directory}: {str(e).splitlines()[0]}") from e
    for n, why in skipped:  # read-only: left in place (the run that wrote them owns them), never silent
        notes.append(f"{directory} step {n} is damaged ({why}): the weights are the newest intact step, {number}")
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
            try:
                return ChatTemplate.from_pretrained(
                    tok_dir, template=path.read_text(encoding="utf-8-sig"), name=str(path)
                )
            except DataFormatError as e:
                raise ConfigError(str(e)) from None
        notes.append(f"the run's chat template {given} is gone: chat data is read with the tokenizer's own, if any")
    try:
        return None if tok_dir is None else ChatTemplate.from_pretrained(tok_dir)
    except DataFormatError as e:
        raise ConfigError(str(e)) from None


# --------------------------------------------------------------------------- predictions
# A saved run's predictions: a classifier's logits of texts, a regressor's outputs of numbers
# (`SavedRun.predict`, `zoo predict`).


@eqx.filter_jit
def _classify(model, batch):
    return model(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types"))


@eqx.filter_jit
def _regress(model, batch):
    return model(batch["x"])


def encode(run: SavedRun, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Texts as a classifier run's examples: its tokenizer (or UTF-8 bytes), cut and padded
    to its `seq_len`, as its training rows were."""
    tokenizer = run.tokenizer if run.tokenizer is not None else byte_tokenizer()
    return tokenizer(list(texts), max_len=run.seq_len, pad_to=run.seq_len)


def forward(run: SavedRun, arrays: dict[str, np.ndarray], *, batch_size: int = 64) -> np.ndarray:
    """The model's outputs on every row of `arrays` (`tokens`/`mask`/`token_types`, or `x`),
    float32 numpy, in chunks of `batch_size` rows (the last padded: one compiled shape)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 (rows per forward pass), got {batch_size!r}")
    fn = _regress if run.kind == "regression" else _classify
    n = len(next(iter(arrays.values())))
    rows = max(1, min(n, batch_size))
    outs = []
    for start in range(0, n, rows):
        chunk = {k: v[start : start + rows] for k, v in arrays.items()}
        m = len(next(iter(chunk.values())))
        if m < rows:  # copies of the first row, dropped below
            chunk = {k: np.concatenate([v, np.repeat(v[:1], rows - m, axis=0)]) for k, v in chunk.items()}
        outs.append(np.asarray(fn(run.model, chunk), np.float32)[:m])
    return np.concatenate(outs) if outs else np.zeros((0, 0), np.float32)


def predict(run: SavedRun, inputs: Sequence[str] | Any, *, batch_size: int = 64) -> np.ndarray:
    """A classifier's logits `[n, labels]` of texts, or a regressor's outputs `[n, out]` of
    numbers `[n, in]`; a `ConfigError` for a language model (it generates) or inputs of the
    wrong kind."""
    if run.kind == "lm":
        raise ConfigError(
            f"{run.folder} is a language model run: it predicts no labels; continue text with zoo generate"
        )
    if run.kind == "classification":
        texts = list(inputs)
        if not all(isinstance(t, str) for t in texts):
            raise ConfigError(f"{run.folder} is a classifier run: its inputs are texts")
        return forward(run, encode(run, texts), batch_size=batch_size)
    x = np.asarray(inputs, np.float32)
    width = getattr(run.model, "in_size", None)
    if x.ndim != 2 or (width is not None and x.shape[1] != width):
        raise ConfigError(
            f"{run.folder} is a regressor of {width} inputs: give rows of {width} numbers, got shape {x.shape}"
        )
    return forward(run, {"x": x}, batch_size=batch_size)


# --------------------------------------------------------------------------- evaluation on a data file
# A saved run evaluated on a data file in the formats `zoo train` reads (`SavedRun.evaluate`,
# `zoo eval`): a language model's loss, perplexity and next-token accuracy; a classifier's
# loss, accuracy, macro-F1 and per-class scores, its labels matched by name.


_lm_metrics = eqx.filter_jit(lm_metrics)


def _read(run: SavedRun, path: Path):
    """The file as the run read its data (its tokenizer, `seq_len`, packing and chat
    template), every row kept; a one-line `ConfigError` for a file it cannot read."""
    if path.is_dir():
        raise ConfigError(f"--data {folder_refused(path)}")
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file; check the path")
    raw, kind = read_kind(path)
    wanted = "text, prompt/completion or chat records" if run.kind == "lm" else "text/label records"
    if (kind in LM_KINDS) if run.kind == "lm" else (kind == "classification"):
        return _rows(run, path, raw)
    if kind == "preference" and run.config.objective in OBJECTIVES:  # TRL's eval metrics (`evaluate_pairs`)
        return _rows(run, path, raw)
    if kind == "preference" and run.kind == "lm":
        wanted += ", or evaluate the pairs with a run of --objective dpo / orpo"
    # GRPO's prompts and DPO's pairs are neither a language model's records nor a classifier's.
    what = {
        "classification": "text/label records",
        "prompt": "prompts alone, without completions (what --objective grpo completes)",
        "preference": "preference pairs (what --objective dpo / orpo train on)",
    }.get(kind, f"{kind.replace('_', '/')} records (language modelling)")
    objective = f" (--objective {run.config.objective})" if run.kind == "lm" else ""
    raise ConfigError(f"--data {path} holds {what} but {run.folder} is a {run.kind} run{objective}; give it {wanted}")


def _rows(run: SavedRun, path: Path, raw: bytes, located=None):
    """The file's (or `located`'s: some of its records) rows, as the run read its data."""
    source = run.tokenizer_dir if run.tokenizer is not None else byte_tokenizer()
    packed = run.config.data.packed is not False
    try:
        data, _ = load_data(
            path,
            source,
            seq_len=run.seq_len,
            packed=packed,
            chat_template=run.chat_template,
            data=raw,
            located=located,
            system=run.config.data.system_prompt,
            max_prompt_len=run.config.data.max_prompt_len,
            truncation=run.config.data.prompt_truncation,
        )
    except DataFormatError as e:
        raise ConfigError(f"--data: {str(e).splitlines()[0]}".replace("seq_len=", "--seq-len of the run ")) from None
    except ValueError as e:  # a template that cannot find the assistant turns
        raise ConfigError(f"--data {path}: {str(e).splitlines()[0]}") from None
    if len(data) == 0:
        raise ConfigError(f"--data {path}: no examples in it")
    return data


def _lm(run: SavedRun, arrays: dict[str, np.ndarray], batch_size: int) -> dict[str, Any]:
    n = len(arrays["tokens"])
    rows = max(1, min(n, batch_size))
    sums = {"loss": 0.0, "weight": 0.0, "correct": 0.0}
    for start in range(0, n, rows):
        chunk = {k: v[start : start + rows] for k, v in arrays.items()}
        m = len(chunk["tokens"])
        if m < rows:  # copies of the first row, weighted 0
            chunk = {k: np.concatenate([v, np.repeat(v[:1], rows - m, axis=0)]) for k, v in chunk.items()}
        chunk["weight"] = (np.arange(rows) < m).astype(np.float32)
        out = _lm_metrics(run.model, chunk)
        for k in sums:
            sums[k] += float(np.sum(np.asarray(out[k], np.float64)))
    loss = sums["loss"] / max(sums["weight"], 1e-12)
    return {
        "kind": "lm",
        "rows": n,
        "tokens": int(round(sums["weight"])),
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "accuracy": sums["correct"] / max(sums["weight"], 1e-12),
    }


def _adapters(run: SavedRun, path: Path, batch_size: int) -> dict[str, Any]:
    """A run of several adapters on a file whose records name their adapter: each
    adapter's records through it, and all of them together (means over every target token)."""
    import dataclasses

    names = adapter_names(run.model)
    records = read_adapter_records(str(path))
    if records is None:
        raise ConfigError(
            f"--data {path}: {run.folder} trained the adapters {list(names)}; give each record its adapter's name "
            '("adapter": NAME) to evaluate it through that adapter'
        )
    unknown = [n for n in records.names if n not in names]
    if unknown:
        raise ConfigError(
            f"--data {path}: adapters {unknown} are not among the run's {list(names)}; name one of those on each record"
        )
    per = {}
    for name, located in records.located.items():
        data = _rows(run, path, b"", located)
        per[name] = _lm(dataclasses.replace(run, model=set_adapter(run.model, name)), dict(data.arrays), batch_size)
    tokens = sum(r["tokens"] for r in per.values())
    loss = sum(r["loss"] * r["tokens"] for r in per.values()) / max(tokens, 1)
    return {
        "kind": "lm",
        "rows": sum(r["rows"] for r in per.values()),
        "tokens": tokens,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "accuracy": sum(r["accuracy"] * r["tokens"] for r in per.values()) / max(tokens, 1),
        "adapters": per,
    }


def _classifier(run: SavedRun, data, path: Path, batch_size: int) -> dict[str, Any]:
    names = list(run.label_names or ())
    unknown = [name for name in data.label_names if name not in names]
    if unknown:
        raise ConfigError(
            f"--data {path}: labels {unknown} are not among the run's {names}; evaluate on examples of its classes"
        )
    index = np.asarray([names.index(name) for name in data.label_names], np.int32)
    labels = index[data.arrays["labels"]]
    logits = forward(run, {k: v for k, v in data.arrays.items() if k != "labels"}, batch_size=batch_size)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(labels)), labels].mean())
    return {"kind": "classification", "loss": loss, **classification_scores(labels, logits.argmax(axis=1), names)}


def evaluate_file(run: SavedRun, path: str | Path, *, batch_size: int = 64) -> dict[str, Any]:
    """`run`'s model on every example of the data file `path` (`.txt`, `.jsonl`, `.csv`, as
    `zoo train --data` reads them, with the run's tokenizer, `seq_len`, packing and chat
    template).

    **Returns:** for a language model `{"kind": "lm", "rows", "tokens" (target tokens),
    "loss" (mean next-token cross-entropy, nats), "perplexity", "accuracy"}` (the tokens
    counted as the run's loss counts them: completions, assistant turns); for a classifier
    `{"kind": "classification", "examples", "loss", "accuracy", "macro_f1", "per_class"}`
    (`zoo.train.classification_scores`; the file's labels matched to the run's by name).
    A run of several adapters reads a `.jsonl` whose records name their adapter
    (`"adapter": NAME`): each through its own, `"adapters": {NAME: scores}` beside the
    scores of all of them.
    A dpo / orpo run on preference pairs: TRL's eval metrics, means over the pairs, as
    the run's own evaluation computes them (`_preference.evaluate_pairs`).
    **Raises:** `ConfigError` (a file of the other kind, labels the run does not have, a
    regressor, which trains on its own data only).
    """
    if run.kind == "regression":
        raise ConfigError(
            f"{run.folder} is a regressor trained on its own synthetic data, which reads no data file; "
            "its held-out loss is summary.json's eval_after"
        )
    path = Path(path).expanduser()
    data = _read(run, path)
    if data.kind == "preference":  # a dpo / orpo run on pairs: the run's own evaluation of them
        c = run.config

        def initial():  # the model the run started from: DPO's reference where no adapters are to disable
            return _base(c, model_spec(c.model), run.folder, None, [], what="the model it started from")[0]

        return evaluate_pairs(run, data, batch_size=batch_size, initial_model=initial)
    if run.kind == "lm" and adapter_names(run.model):
        return _adapters(run, path, batch_size)
    if run.kind == "lm":
        return _lm(run, dict(data.arrays), batch_size)
    return _classifier(run, data, path, batch_size)


# --------------------------------------------------------------------------- a merged Hugging Face export
# A saved run as one Hugging Face folder, LoRA merged into the base (`SavedRun.export`,
# `zoo export --merge`): a decoder transformers opens as its family's causal LM; a
# classifier's encoder (`BertModel`) with its head beside it (`head.safetensors`) and its
# label names in config.json (`id2label`). The tokenizer's files travel with it.


def export_merged(
    run: SavedRun, directory: str | Path, *, adapter: str | None = None, dtype: str | None = None
) -> list[Path]:
    """Write `run`'s model, LoRA branches merged (`zoo.lora.merge`), as a Hugging Face
    folder at `directory` (created; a folder holding files of the names written must be a
    Hugging Face model folder already: a user's own files are never replaced).

    A decoder is written by `zoo.hf.save_pretrained` (transformers'
    `AutoModelForCausalLM` opens it and computes the same logits); a classifier's encoder
    likewise (`BertModel`: the same hidden states), its head in `head.safetensors` (zoo's
    `[in, out]` layout: logits = pooled hidden states @ `head.weight` + `head.bias`, the
    pooling named in the file's metadata) and its label names as config.json's
    `id2label` / `label2id`. The tokenizer's files are copied in (none for byte-level
    models: their ids are the text's UTF-8 bytes).

    A run of several adapters merges the one `adapter` names. The floating weights are
    written in `dtype` (`export_dtype`: default the base model's, float32 without one).

    **Returns:** the paths written. **Raises:** `ConfigError` for a regressor (no Hugging
    Face form), a decoder no family expresses, or a run of several adapters without
    `adapter`; `FileExistsError` as `save_pretrained`.
    """
    if run.kind == "regression":
        raise ConfigError(
            f"{run.folder}: the {run.config.model} has no Hugging Face form; its weights are its "
            "checkpoints (zoo.Checkpointer)"
        )
    directory = Path(directory).expanduser()
    model = merge(_one_adapter(run, adapter))
    source = getattr((model if run.kind == "lm" else model.encoder).config, "source_dir", None)
    cast = jax.numpy.dtype(export_dtype(source, dtype))
    model = jax.tree.map(lambda x: x.astype(cast) if eqx.is_inexact_array(x) else x, model)
    part = model if run.kind == "lm" else model.encoder
    tok_dir = run.tokenizer_dir
    tokenizer = [n for n in TOKENIZER_FILES if tok_dir is not None and (tok_dir / n).is_file()]
    tokenizer = [n for n in tokenizer if source is None or not (Path(source) / n).is_file()]  # else save_pretrained's
    cls = run.kind == "classification" and model.pooling == "cls"  # transformers' BertForSequenceClassification
    mean = run.kind == "classification" and not cls
    extra = tokenizer + ([HEAD_NAME, "README.md"] if mean else [])
    check_export_dir(
        directory,
        extra,
        writer="zoo export",
        config="config.json",
        key="model_type",
        weights="model.safetensors",
        kind="a Hugging Face model folder",
    )
    try:
        if cls:
            written = save_bert_classifier(model, directory, label_names=list(run.label_names or ()) or None)
        else:
            written = save_pretrained(part, directory)
    except ValueError as e:  # a config no Hugging Face family expresses
        raise ConfigError(f"{run.folder}: {str(e).splitlines()[0]}") from e
    for name in tokenizer:
        atomic_write(directory / name, lambda tmp, name=name: shutil.copyfile(tok_dir / name, tmp))
        written.append(directory / name)
    if mean:
        written += save_head(model, directory)
        tokenized = (directory / "tokenizer.json").is_file()
        text = merged_readme(
            directory,
            title=f"zoo export {run.folder} --merge",
            seq_len=run.config.data.seq_len,
            label_names=run.label_names or (),
            tokenized=tokenized,
            pad_id=getattr(part.config, "pad_token_id", None) or 0,
        )
        atomic_write(directory / "README.md", lambda tmp: Path(tmp).write_text(text))
        written.append(directory / "README.md")
        config = json.loads((directory / "config.json").read_text())
        names = list(run.label_names or ())
        config |= {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        atomic_write(directory / "config.json", lambda tmp: Path(tmp).write_text(text))
    return written


def _one_adapter(run: SavedRun, name: str | None) -> Any:
    """`run`'s model with one adapter: the run's own, or of a run of several the one `name`
    picks (`zoo.lora.adapter`)."""
    names = adapter_names(run.model)
    if not names:
        if name is not None:
            raise ConfigError(f"{run.folder}: a run of one adapter; export it without an adapter name")
        return run.model
    if name not in names:
        given = "no adapter named" if name is None else f"adapter {name!r} is not one of them; name"
        raise ConfigError(
            f"{run.folder}: a run of {len(names)} adapters ({', '.join(names)}); {given} one to merge: "
            f"--adapter NAME (each adapter, in peft's layout, is {run.folder / 'adapter'}/NAME)"
        )
    return lora_adapter(run.model, name)


# --------------------------------------------------------------------------- a finetune run as init, merged
# Writing the merged model of a `zoo finetune` run given as another run's `init`
# (`_registry.merged_path`): done by `zoo.train.run` once it has planned the run, on one device, outside
# the run's mesh.


def merge_run(init: str | None) -> None:
    """When `init` names a `zoo finetune` run, write its model, adapter merged into its
    base, at `merged_path` (once: a folder already there is kept). Anything else: nothing.
    Raises `ConfigError` for a classifier run (export it first: `zoo export RUN --merge`).

    `zoo.train.run` calls it as it starts; `load_run` of a run whose init is such a run, and
    `zoo generate` / `zoo serve` of it, call it too, so a run moved to another machine (or
    whose cache was emptied) merges its init again instead of failing. Call it outside any
    mesh (`jax.set_mesh`): the merge runs on jax's default device."""
    run = Path(init).expanduser() if init else None
    if run is None or not (run / "adapter").is_dir() or not (run / "config.json").is_file():
        return
    folder = merged_path(run)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return
    saved = load_run(run)
    if saved.kind != "lm":
        raise ConfigError(
            f"RunConfig.init {run}: a {saved.config.model} classifier run; export it first (zoo export {run} --merge "
            "--output DIR), then pass DIR"
        )
    temporary = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        saved.export(temporary, dtype="float32")  # the model the run ended with, exactly
        temporary.replace(folder)  # whole or not at all
    except OSError:
        if not (folder / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
