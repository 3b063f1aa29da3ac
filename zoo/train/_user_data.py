"""A training task from a user's own data file (`--data FILE`): the model built as for the
built-in data, the file read by `zoo.data.load` with the model's tokenizer.

Language modelling (`.txt`, `.jsonl` with `text`, `prompt`/`completion` or `messages`)
trains a decoder (`transformer`) with `zoo.models.next_token_loss` on the weights the file
gives (every token, the completions, the assistant turns); classification (`.jsonl` /
`.csv` with `text`/`label`) trains an encoder (`encoder`, `minilm`) with
`zoo.models.classification_loss`, as many labels as the file holds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any

from .._tree import counted
from ..data import ChatTemplate, DataFormatError, read_records
from ..data import describe as describe_data
from ..data import load as load_data
from ..data._chat import TemplateParseError
from ..data._records import FORMATS, folder_refused
from ..hf import Tokenizer
from ..models import classification_loss, next_token_loss
from ._config import RunConfig
from ._errors import ConfigError
from ._preference import preference_task
from ._registry import ModelSpec, model_names, model_spec
from ._task import (
    Task,
    check_pretrained_seq_len,
    check_vocab,
    classifier_metrics,
    decoder_of,
    init_folder,
    init_name,
    lm_metrics,
    tokenizer_of,
)
from ._text import adapter_files

SUFFIXES = (".txt", ".jsonl", ".json", ".csv")
LM_KINDS = ("text", "prompt_completion", "chat")


def check_data_file(c: RunConfig) -> None:
    """Refuse a `--data` (`c.data.source`) that is neither one of the model's data sets
    nor a data file it trains on, or a `--chat-template` file that is not there: a
    one-line `ConfigError` naming the fix. Only the paths are looked at (the plan checks
    them before anything is built); the file is read once, by `user_data_task`."""
    spec = model_spec(c.model)
    data = c.data.source
    if c.objective == "grpo" and (data is None or data in spec.datasets):
        raise ConfigError(
            'RunConfig.objective grpo completes prompts: pass DataConfig.source FILE.jsonl with a "prompt" on each line (docs/training.md, '
            f"Online RL: GRPO); {data or 'the default data'} holds none"
        )
    if c.objective != "sft" and (data is None or data in spec.datasets):
        raise ConfigError(
            f"RunConfig.objective {c.objective} trains on preference pairs: pass DataConfig.source FILE.jsonl with prompt, chosen and "
            f"rejected on each line (docs/training.md, Preference tuning); {data or 'the default data'} holds none"
        )
    if c.objective != "sft" and spec.kind != "lm":
        raise ConfigError(
            f"RunConfig.objective {c.objective} tunes a decoder (a language model); {spec.name} is none: use "
            "RunConfig.objective sft, or a decoder such as transformer"
        )
    if data is None or data in spec.datasets:
        return
    files = adapter_files(data)  # NAME=FILE,...: one file per adapter
    for name, file in (files or {None: data}).items():
        _check_file(spec, file if name is None else f"{name}={file}", file)
    if files is not None and (c.lora is None or c.objective != "sft" or spec.kind != "lm"):
        raise ConfigError(
            f"DataConfig.source {data}: one file per adapter trains several LoRA adapters of a decoder on "
            "next-token loss; run zoo finetune on a decoder (with RunConfig.objective sft)"
        )
    template = c.data.chat_template
    if template is not None and not Path(template).expanduser().is_file():
        raise ConfigError(f"DataConfig.chat_template {template}: no such file; pass a jinja2 chat template file")


def _check_file(spec: ModelSpec, data: str, file: str) -> None:
    """One data file's path (`data`: how `--data` names it)."""
    path = Path(file).expanduser()
    if path.is_dir():
        raise ConfigError(f"DataConfig.source {folder_refused(data)}")
    if path.suffix.lower() not in SUFFIXES:
        if not path.exists():
            raise ConfigError(
                f"DataConfig.source {data!r}: {spec.name} trains on {' or '.join(spec.datasets)}"
                + (", or on your own .txt, .jsonl, .json or .csv file (docs/data.md)" if spec.file_model else "")
            )
        raise ConfigError(
            f"DataConfig.source {data}: unknown extension {path.suffix or '(none)'!r}; zoo reads {FORMATS}"
        )
    if not path.is_file():
        raise ConfigError(f"DataConfig.source {data}: no such file; check the path")
    check_takes_files(spec, data)


def check_takes_files(spec: ModelSpec, data: Any) -> None:
    """Refuse a data file for a model whose spec has no `file_model`."""
    if spec.file_model is None:
        raise ConfigError(
            f"DataConfig.source {data}: the {spec.name} trains on its own data sets only "
            f"({', '.join(spec.datasets)}); a data file trains {_file_models_text()}"
        )


def check_kind(spec: ModelSpec, kind: str, data: Any) -> None:
    """Refuse a file whose records (`zoo.data.read_records`' kind) the model cannot train on:
    language-modelling records for a classifier, labelled ones for a language model."""
    if (kind in LM_KINDS or kind in ("preference", "prompt")) and spec.kind == "classification":
        decoder = (_file_models("lm") or ["transformer"])[0]
        raise ConfigError(
            f"DataConfig.source {data} holds {kind.replace('_', '/')} records (language modelling), but {spec.name} is a "
            f"classifier; train a decoder on it: zoo finetune {decoder} --init HF_DIR --data FILE (or zoo train "
            f"{decoder} --data FILE)"
        )
    if kind == "classification" and spec.kind == "lm":
        classifiers = _file_models("classification") or ["minilm"]
        raise ConfigError(
            f"DataConfig.source {data} holds text/label records (classification), but {spec.name} is a language model; "
            f"train a classifier on it: zoo finetune {classifiers[-1]} --data FILE (or zoo train {classifiers[0]} "
            "--data FILE)"
        )


def _file_models(kind: str) -> list[str]:
    """The registered models of `kind` that train on data files."""
    return [n for n in model_names() if model_spec(n).kind == kind and model_spec(n).file_model is not None]


def _file_models_text() -> str:
    parts = [
        f"{' / '.join(names)} ({what})"
        for kind, what in (("lm", "text"), ("classification", "text + label"))
        if (names := _file_models(kind))
    ]
    return " or ".join(parts) or "no registered model"


# --- tokenizers ----------------------------------------------------------------------------------


def check_fingerprint(saved: dict[str, Any], current: dict[str, str], source: str, step: int) -> None:
    """Refuse to resume from a checkpoint whose data files differ from the current ones (a
    checkpoint saved without a fingerprint, by an older zoo, is not checked)."""
    for key, digest in current.items():
        if key in saved and saved[key] != digest:
            what = source if key == "data_sha256" else "the --chat-template file"
            raise ConfigError(
                f"RunConfig.resume: {what} changed since checkpoint step {step} was saved (its sha256 differs), so the "
                "resumed steps would train on other rows than the run's first ones; restore the file, or start "
                "a new run on it (RunConfig.overwrite)"
            )


def byte_tokenizer():
    """A `zoo.hf.Tokenizer` whose ids are the text's UTF-8 bytes (0…255, as
    `zoo.data.byte_tokens`), with character offsets (chat data needs them), no special
    tokens, padding id 0."""
    import tokenizers

    chars = _byte_to_char()
    rust = tokenizers.Tokenizer(tokenizers.models.BPE({chars[b]: b for b in range(256)}, []))
    rust.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(rust, pad_id=0)


@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (what the `ByteLevel`
    pre-tokenizer produces)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):  # the other 68 bytes (controls, space, ...) go to 256, 257, ...
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


def _chat_template(file: str | None, folder: Path | None) -> tuple[ChatTemplate | None, dict[str, str]]:
    """`--chat-template FILE` with the special tokens of `folder`'s tokenizer_config.json
    (None without the flag: the folder's own template, if any), and the digest of the
    file's bytes (`{"chat_template_sha256": ...}`, or `{}`)."""
    if file is None:
        return None, {}
    data = Path(file).expanduser().read_bytes()
    try:
        template = ChatTemplate.from_pretrained(folder, template=data.decode("utf-8-sig"), name=file)
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"DataConfig.chat_template {file} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    except DataFormatError as e:
        raise ConfigError(f"DataConfig.chat_template {e}") from None
    return template, {"chat_template_sha256": hashlib.sha256(data).hexdigest()}


def check_prompts_file(c: RunConfig) -> tuple[Path, bytes]:
    """A GRPO run's prompts file (`c.data.source`) and its bytes, read once, its records
    checked to be prompts alone."""
    path = Path(c.data.source).expanduser()
    return path, _read(path, model_spec(c.model), c.objective)


def tokenizer_source(c: RunConfig) -> tuple[Path | None, Any, Any, Any]:
    """`(init folder, its zoo.hf.Tokenizer or None, the rust tokenizer that encodes,
    decode(ids) -> text)`: the folder's tokenizer.json, else byte tokens."""
    folder = init_folder(c)
    tokenizer = tokenizer_of(folder)
    return folder, tokenizer, (tokenizer or byte_tokenizer()).tokenizer, decoder_of(tokenizer)


def chat_template_of(c: RunConfig, folder: Path | None) -> tuple[ChatTemplate | None, dict[str, str]]:
    """`--chat-template FILE` (and its digest), else the folder's own template."""
    template, digest = _chat_template(c.data.chat_template, folder)
    if template is None and folder is not None:
        try:
            template = ChatTemplate.from_pretrained(folder)
        except DataFormatError as e:
            raise ConfigError(f"{e}; or pass DataConfig.chat_template FILE") from None
    return template, digest


# --- the task ------------------------------------------------------------------------------------


def user_data_task(c: RunConfig, *, rules, mesh) -> Task:
    """The task of model `c.model` (`transformer`, `encoder`, `minilm`) on the data file
    `c.data.source` (its path checked by `check_data_file`): `c.data.validation` of its
    documents held out, language-modelling documents packed into rows (`c.data.packed`),
    `c.data.chat_template` a jinja2 file for chat data when the tokenizer has none. The
    file is read once: its records, its rows and its fingerprint (`data_sha256`) come
    from the same bytes. The task trains on the file's `zoo.data.Dataset` itself."""
    spec = model_spec(c.model)
    path = Path(c.data.source).expanduser()
    raw = _read(path, spec, c.objective)  # before the tokenizer and the model: a wrong file fails fast
    folder = init_folder(c)
    check_pretrained_seq_len(c, folder)  # before rows are cut at that length and counted
    tokenizer = tokenizer_of(folder)
    validation = c.data.validation
    source = folder if tokenizer is not None and folder is not None else (tokenizer or byte_tokenizer())
    template, template_digest = _chat_template(c.data.chat_template, folder)
    try:
        train, val = load_data(
            path,
            source,
            seq_len=c.data.seq_len,
            packed=c.data.packed,
            validation=validation,
            chat_template=template,
            data=raw,
            system=c.data.system_prompt,
            max_prompt_len=c.data.max_prompt_len,
            truncation=c.data.prompt_truncation,
        )
    except TemplateParseError as e:  # the model folder's template
        raise ConfigError(f"{e}; or pass DataConfig.chat_template FILE") from None
    except DataFormatError as e:
        # load names its argument (seq_len=N); the run's field is the CLI's flag.
        text = str(e).splitlines()[0].replace("seq_len=", "DataConfig.seq_len ")
        raise ConfigError(f"DataConfig.source: {text}") from None
    except ValueError as e:  # a template that cannot find the assistant turns
        raise ConfigError(f"DataConfig.source {path}: {str(e).splitlines()[0]}") from None
    if len(train) == 0:
        raise ConfigError(
            f"DataConfig.source {path}: no training rows are left after holding out DataConfig.validation {validation}"
        )
    # A derived batch is fitted to the rows later (`_plan.fit_batch`): it needs a row per device and microbatch.
    m = 1 if "microbatches" in c.derived else c.microbatches
    unit = dict(c.mesh or {}).get("data", 1) * m if "batch_size" in c.derived else c.batch_size
    if c.batch_size is not None and (unit or 0) > len(train):
        raise ConfigError(
            f"RunConfig.batch_size {c.batch_size} is more than the training rows of {path.name} ({len(train)}); lower "
            "RunConfig.batch_size (or DataConfig.seq_len: shorter rows are more rows)"
            if unit == c.batch_size
            else f"{path.name} has {len(train)} training rows, fewer than one per device of the data axis and "
            f"microbatch ({unit}); give it more rows, or use fewer devices or microbatches (RunConfig.devices, "
            "RunConfig.microbatches)"
        )
    tokens_kind = "byte" if tokenizer is None else "tokenizer"
    fingerprint = {"data_sha256": train.sha256, **template_digest}
    if train.kind == "classification":
        if train.num_labels < 2:
            raise ConfigError(
                f"DataConfig.source {c.data.source}: every example has the label {train.label_names[0]!r}; a classifier needs 2 or more"
            )
        model, config, folder = spec.file_model(c, train.num_labels, rules=rules, mesh=mesh)
        check_tokenizer(config, tokenizer, folder)
        task = _classifier(c, model, config, folder, tokenizer, train, val, tokens_kind, init_name(c, folder))
        return dataclasses.replace(task, fingerprint=fingerprint)
    model, config, folder = spec.file_model(c, None, rules=rules, mesh=mesh)
    check_tokenizer(config, tokenizer, folder)
    if train.kind == "preference":
        task = preference_task(c, model, train, val, data=f"{path.name}, {describe_data(train)}", tokens=tokens_kind)
        return dataclasses.replace(
            task,
            hf_part=lambda m: m,
            tokenizer_dir=folder if tokenizer is not None else None,
            config=config.to_dict(),
            init=None if folder is None else str(folder),
            fingerprint=fingerprint,
        )
    eval_data = dict(val.arrays if len(val) else train.arrays)
    if c.data.eval_size:
        eval_data = {k: v[: c.data.eval_size] for k, v in eval_data.items()}
    held = counted(len(val), "validation row") if len(val) else "no validation split (evaluated on the training rows)"
    return Task(
        model=model,
        kind="lm",
        loss_fn=next_token_loss,
        metrics_fn=lm_metrics,
        train_source=train,
        seed=c.seed,
        eval_data=eval_data,
        train_data=None,
        data=f"{path.name}, {describe_data(train)}; {held}; {tokens_kind} tokens, rows of {c.data.seq_len}",
        unit="tokens",
        tokens_per_example=c.data.seq_len,
        hf_part=lambda m: m,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict(),
        init=None if folder is None else str(folder),
        fingerprint=fingerprint,
    )


def read_kind(path: Path) -> tuple[bytes, str]:
    """The data file's bytes, read once, and the kind of its records (a one-line
    `ConfigError` naming the file, the line and the fix when they cannot be read)."""
    raw = path.read_bytes()
    try:
        kind, _ = read_records(path, data=raw)
    except DataFormatError as e:
        raise ConfigError(f"DataConfig.source: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"DataConfig.source {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    return raw, kind


def _read(path: Path, spec: ModelSpec, objective: str = "sft") -> bytes:
    """The data file's bytes, its records' kind checked against the model's and the
    objective's (preference pairs for dpo / orpo, and only for them)."""
    raw, kind = read_kind(path)
    check_kind(spec, kind, path)
    if (kind == "prompt") != (objective == "grpo"):
        if kind == "prompt":
            raise ConfigError(
                f"DataConfig.source {path} holds prompts alone (no completion): train on them with RunConfig.objective grpo and a "
                'GRPOConfig.reward, or give each line its answer ({"prompt", "completion"}) for RunConfig.objective sft'
            )
        raise ConfigError(
            f"RunConfig.objective grpo completes prompts and rewards the completions, but DataConfig.source {path} holds "
            f'{kind.replace("_", "/")} records; give it a .jsonl of {{"prompt"}} lines (extra keys are passed to the '
            "reward functions)"
        )
    if objective == "grpo":
        return raw
    if (kind == "preference") != (objective != "sft"):
        if kind == "preference":
            raise ConfigError(
                f"DataConfig.source {path} holds preference pairs (prompt, chosen, rejected): tune on them with "
                "RunConfig.objective dpo or RunConfig.objective orpo"
            )
        raise ConfigError(
            f"RunConfig.objective {objective} trains on preference pairs, but DataConfig.source {path} holds {kind.replace('_', '/')} "
            'records; give it a .jsonl of {"prompt", "chosen", "rejected"} lines (or use RunConfig.objective sft)'
        )
    return raw


def check_tokenizer(config, tokenizer, folder: Path | None) -> None:
    """Refuse a tokenizer the model's vocabulary cannot hold (or byte tokens below 256 ids)."""
    check_vocab(config.vocab_size, tokenizer, f"--init {folder}")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"RunConfig.init {folder}: its tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"{config.vocab_size}; use the tokenizer the model was trained with"
        )


def _classifier(c, model, config, folder, tokenizer, train, val, tokens_kind: str, init: str | None) -> Task:
    num_labels = train.num_labels
    train_arrays = dict(train.arrays)
    eval_data = dict(val.arrays if len(val) else train.arrays)
    if c.data.eval_size:
        eval_data = {k: v[: c.data.eval_size] for k, v in eval_data.items()}
    path = Path(c.data.source)
    held = f"{len(val)} test texts" if len(val) else "no test split (evaluated on the training texts)"
    return Task(
        model=model,
        kind="classification",
        loss_fn=classification_loss,
        metrics_fn=classifier_metrics,
        train_source=train,
        seed=c.seed,
        eval_data=eval_data,
        train_data=train_arrays,
        data=(
            f"{path.name}, {num_labels} classes, {len(train)} train texts / {held}, {tokens_kind} tokens cut at "
            f"{c.data.seq_len}"
        ),
        unit="examples",
        tokens_per_example=c.data.seq_len,
        label_names=train.label_names,
        hf_part=lambda m: m.encoder,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict() | {"num_labels": num_labels},
        init=init,
    )
