"""The task of several LoRA adapters fine-tuned in one run (`_adapters`): each adapter's
records read, held out and packed apart, batched by `AdapterRows`, trained by the routed
loss and evaluated per adapter."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..data import DataFormatError, Dataset, describe
from ..data import load as load_data
from ..lora import routed
from ..models import next_token_loss
from ._adapters import AdapterRecords, AdapterRows, adapter_metrics, stack_rows
from ._errors import ConfigError
from ._registry import model_spec
from ._task import Task, init_folder, tokenizer_of
from ._user_data import _chat_template, _check_tokenizer, byte_tokenizer


def _load(c, adapters: AdapterRecords, source) -> tuple[dict[str, Dataset], dict[str, Dataset]]:
    """Each adapter's `(train, validation)` datasets, read, split and packed apart."""
    template, _ = _chat_template(c.data.chat_template, source if isinstance(source, Path) else None)
    trains, vals = {}, {}
    for name, located in adapters.located.items():
        path = adapters.files[name]
        try:
            trains[name], vals[name] = load_data(path, source, seq_len=c.data.seq_len, packed=c.data.packed,
                                                 validation=c.data.validation, chat_template=template, data=b"",
                                                 located=located)  # fmt: skip
        except DataFormatError as e:
            hint = "; or pass --chat-template FILE" if "chat template" in str(e) else ""
            raise ConfigError(
                f"--data: {str(e).splitlines()[0].replace('seq_len=', 'DataConfig.seq_len ')}{hint}"
            ) from None
        except ValueError as e:
            raise ConfigError(f"--data {path}: {str(e).splitlines()[0]}") from None
    return trains, vals


def _check_rows(c, adapters: AdapterRecords, trains: Mapping[str, Dataset]) -> None:
    """Every adapter takes `batch_size / K` rows of its own training rows each step."""
    k = len(trains)
    if c.batch_size % k:
        raise ConfigError(
            f"--batch-size {c.batch_size}: each step takes the same number of rows of each of the {k} adapters "
            f"{list(trains)}; use a multiple of {k} (and of data-parallel size x microbatches)"
        )
    for name, train in trains.items():
        if len(train) < c.batch_size // k:
            raise ConfigError(
                f"--data: adapter {name!r} ({adapters.files[name].name}) has {len(train)} training rows after "
                f"holding out --validation {c.data.validation}, fewer than the {c.batch_size // k} each step takes "
                f"of it (--batch-size {c.batch_size} / {k} adapters); give it more rows, or lower --batch-size"
            )


def adapters_task(c, adapters: AdapterRecords, *, rules, mesh):
    """The task of several LoRA adapters on decoder `c.model`, each on its own records
    (`read_adapter_records`): their rows batched by `AdapterRows`, the loss
    `zoo.lora.routed(next_token_loss)`, the held-out rows of every adapter evaluated
    through their own (per adapter: `loss/NAME`).

    **Raises:** `ConfigError` for a run that is no LoRA fine-tune on next-token loss, or
    an adapter with too few rows."""
    names = adapters.names
    if c.lora is None or c.objective != "sft":
        raise ConfigError(
            f"--data names {len(names)} adapters {list(names)}: several LoRA adapters train with zoo finetune "
            "(--objective sft); zoo train trains one model's every weight: drop the adapter names"
        )
    folder = init_folder(c)
    tokenizer = tokenizer_of(folder)
    source = folder if tokenizer is not None and folder is not None else (tokenizer or byte_tokenizer())
    trains, vals = _load(c, adapters, source)
    _check_rows(c, adapters, trains)
    model, config, folder = model_spec(c.model).file_model(c, None, rules=rules, mesh=mesh)
    _check_tokenizer(config, tokenizer, folder)
    held = {n: vals[n].arrays if len(vals[n]) else trains[n].arrays for n in names}
    what = "; ".join(f"{n}: {describe(trains[n])}, {len(vals[n])} validation rows" for n in names)
    return Task(
        model=model, kind="lm", loss_fn=routed(next_token_loss), metrics_fn=adapter_metrics(names),
        train_source=AdapterRows(names, tuple(trains[n] for n in names)), seed=c.seed,
        eval_data=stack_rows(held, c.data.eval_size), train_data=None,
        data=f"{len(names)} adapters ({what}); {'tokenizer' if tokenizer else 'byte'} tokens, rows of {c.data.seq_len}",
        unit="tokens", tokens_per_example=c.data.seq_len, hf_part=lambda m: m,
        tokenizer_dir=folder if tokenizer is not None else None, config=config.to_dict(),
        init=None if folder is None else str(folder), fingerprint={"data_sha256": adapters.sha256}, adapter_names=names,
    )  # fmt: skip
