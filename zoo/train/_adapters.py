"""Several LoRA adapters fine-tuned in one run over one frozen base (`zoo finetune --data`
with an `adapter` name on each record, or `--data NAME=FILE,NAME=FILE`): each adapter's
documents are read, split and packed apart (no row mixes two adapters), every step takes
`batch_size / K` rows of each adapter's own data (the rows that adapter trained alone with
`batch_size / K` would see), and the step trains all `K` at once (`zoo.lora.routed`,
`zoo.lora.clip_per_adapter`); the run evaluates each adapter on its own held-out rows and
saves each as its own peft folder (`zoo.lora.save_adapters`)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._tree import counted, is_abstract, on_shapes_too
from ..data import DataFormatError, Dataset, describe, local_batch
from ..data import load as load_data
from ..data._chat import TemplateParseError
from ..data._records import read_located
from ..lora import routed
from ..models import next_token_loss
from ._errors import ConfigError
from ._registry import model_spec
from ._task import Task, init_folder, tokenizer_of
from ._text import adapter_files, check_name
from ._user_data import _chat_template, byte_tokenizer, check_tokenizer

FIELD = "adapter"  # the record field naming a row's adapter
LM_KINDS = ("text", "prompt_completion", "chat")


@dataclasses.dataclass(frozen=True)
class AdapterRecords:
    """Each adapter's records as `zoo.data.read_located` gives them (`kind, records,
    wheres`), by name (the run's adapter order), and the digest of every byte read."""

    located: dict[str, tuple[str, list[dict[str, Any]], list[str]]]
    files: dict[str, Path]
    sha256: str

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters' names, in index order."""
        return tuple(self.located)


def _located(path: Path, raw: bytes) -> tuple[str, list[dict[str, Any]], list[str]]:
    try:
        kind, records, wheres = read_located(path, data=raw)
    except DataFormatError as e:
        raise ConfigError(f"DataConfig.source: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"DataConfig.source {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    _check_kind(kind, path)
    return kind, records, wheres


def _check_kind(kind: str, path: Path) -> None:
    if kind not in LM_KINDS:
        raise ConfigError(
            f"DataConfig.source {path} holds {kind.replace('_', '/')} records; several adapters train a decoder on text, "
            "prompt/completion or chat records (docs/training.md, Training several adapters at once)"
        )


def read_adapter_records(source: str) -> AdapterRecords | None:
    """The records of a several-adapter `--data`: one file whose records each name their
    adapter (`"adapter": NAME`; the adapters sorted by name), or `NAME=FILE` pairs (each
    file's records that adapter's; a record naming another adapter is refused). None for
    a single file whose records name no adapter (a one-adapter run). The records are
    returned without the `adapter` field: an adapter's documents are held out and packed
    as its own file of them would be.

    **Raises:** `ConfigError` naming the file and line of a record without the `adapter`
    field in a file where others have one, of a name that cannot be a folder's, or of a
    record of a pair's file naming another adapter; or a file that is no decoder's data."""
    pairs = adapter_files(source)
    if pairs is None:
        path = Path(source).expanduser()
        if path.suffix.lower() not in (".jsonl", ".json"):
            return None  # a .txt / .csv has no fields to name adapters by
        raw = path.read_bytes()
        if FIELD.encode() not in raw:
            return None  # no record names an adapter: spare every one-adapter run a second parse
        try:
            kind, records, wheres = read_located(path, data=raw)
        except (DataFormatError, UnicodeDecodeError):
            return None  # the one-adapter reader names what is wrong
        named = [i for i, r in enumerate(records) if FIELD in r]
        if not named:
            return None
        _check_kind(kind, path)
        groups: dict[str, tuple[list, list]] = {}
        for record, where in zip(records, wheres):
            if FIELD not in record:
                raise ConfigError(
                    f"DataConfig.source: {where} has no {FIELD!r} field, but {wheres[named[0]]} names its adapter "
                    f"({records[named[0]][FIELD]!r}); give every record its adapter's name (or none of them, to "
                    "train one adapter)"
                )
            check_name(record[FIELD], f"--data: {where} field {FIELD!r}")
            rows = groups.setdefault(record[FIELD], ([], []))
            rows[0].append(_without_name(record))  # held out by its content: as in its adapter's own file
            rows[1].append(where)
        located = {n: (kind, *groups[n]) for n in sorted(groups)}
        return AdapterRecords(located, {n: path for n in located}, hashlib.sha256(raw).hexdigest())
    located, files, digests = {}, {}, []
    for name, file in pairs.items():
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"DataConfig.source {name}={file}: no such file; check the path")
        raw = path.read_bytes()
        kind, records, wheres = _located(path, raw)
        located[name] = kind, [_without_name(r) for r in records], wheres
        files[name] = path
        digests.append(hashlib.sha256(raw).hexdigest())
        for record, where in zip(records, wheres):
            if FIELD in record and record[FIELD] != name:
                raise ConfigError(
                    f"DataConfig.source: {where} names adapter {record[FIELD]!r}, but {path.name} holds adapter {name!r}'s "
                    f"rows (DataConfig.source {name}={file}); remove the field, or move the line to {record[FIELD]!r}'s file"
                )
    return AdapterRecords(located, files, hashlib.sha256("".join(digests).encode()).hexdigest())


def _without_name(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its adapter's name: its content, which the held-out split hashes."""
    return {k: v for k, v in record.items() if k != FIELD}


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterRows:
    """A `zoo.data.BatchSource` of `K` adapters' rows: step `i`'s batch holds
    `batch_size / K` rows of each adapter's own `Dataset` (its `rows_at(i, batch_size /
    K)`, so the rows that adapter trained alone would see), adapter 0's first, with
    `"adapter"` (the row's adapter index) and `"adapter_norm"` (`zoo.lora.adapter_norms`
    of the rows' target counts over the global batch: each adapter's gradient its own
    rows' mean)."""

    names: tuple[str, ...]
    datasets: tuple[Dataset, ...]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def batch_at(self, step: int, batch_size: int, *, seed: int = 0, mesh=None, data_axes="data") -> dict:
        """The step's rows of every adapter, this process's of them."""
        from ..lora import adapter_norms

        share = batch_size // len(self.names)
        parts = [{k: v[d.rows_at(step, share, seed=seed)] for k, v in d.arrays.items()} for d in self.datasets]
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        batch["adapter"] = np.repeat(np.arange(len(self.names), dtype=np.int32), share)
        counts = batch["weights"][:, 1:].sum(axis=1, dtype=np.float64)  # next_token_loss's targets per row
        batch["adapter_norm"] = adapter_norms(batch["adapter"], counts, len(self.names))
        return local_batch(batch, mesh=mesh, data_axes=data_axes)


def adapter_metrics(names: tuple[str, ...]):
    """The evaluator's metrics of a several-adapter decoder: `lm_metrics` with each row
    through its own adapter (`batch["adapter"]`), and per adapter its rows' `loss/NAME`
    and `weight/NAME` (the evaluator's per-adapter mean)."""
    from ..lora import route
    from ._task import lm_metrics

    def metrics(model, batch):
        index = batch["adapter"]
        out = lm_metrics(route(model, index), {k: v for k, v in batch.items() if k != "adapter"})
        for k, name in enumerate(names):
            on = (index == k).astype(out["loss"].dtype)
            out[f"loss/{name}"] = out["loss"] * on
            out[f"weight/{name}"] = out["weight"] * on
        return out

    return metrics


def stacked(model: Any, names: tuple[str, ...]) -> Any:
    """The one-adapter LoRA `model` as `len(names)` adapters, each starting where a
    one-adapter run of the same seed starts (`zoo.lora.stack_adapters`).

    **Raises:** `ConfigError` for an adapter kind that cannot be stacked (DoRA, embedding
    LoRA, trainable tokens, `modules_to_save`)."""
    from ..lora import stack_adapters

    try:
        return on_shapes_too(lambda m: stack_adapters(dict.fromkeys(names, m)), model)
    except ValueError as e:
        raise ConfigError(
            f"RunConfig.lora: several adapters (DataConfig.source with adapter names): {str(e).splitlines()[0]}"
        ) from e


def stack_rows(parts: Mapping[str, Mapping[str, np.ndarray]], limit: int = 0) -> dict[str, np.ndarray]:
    """Each adapter's rows (the first `limit` of each, 0: all) one after another, with
    `"adapter"`, each row's adapter index."""
    arrays = [{k: v[:limit] if limit else v for k, v in p.items()} for p in parts.values()]
    out = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
    sizes = [len(next(iter(a.values()))) for a in arrays]
    out["adapter"] = np.repeat(np.arange(len(arrays), dtype=np.int32), sizes)
    return out


# --------------------------------------------------------------------------- the task of several adapters
# The task of several LoRA adapters fine-tuned in one run (`_adapters`): each adapter's
# records read, held out and packed apart, batched by `AdapterRows`, trained by the routed
# loss and evaluated per adapter.


def _load(c, adapters: AdapterRecords, source) -> tuple[dict[str, Dataset], dict[str, Dataset]]:
    """Each adapter's `(train, validation)` datasets, read, split and packed apart."""
    template, _ = _chat_template(c.data.chat_template, source if isinstance(source, Path) else None)
    trains, vals = {}, {}
    for name, located in adapters.located.items():
        path = adapters.files[name]
        try:
            trains[name], vals[name] = load_data(
                path,
                source,
                seq_len=c.data.seq_len,
                packed=c.data.packed,
                validation=c.data.validation,
                chat_template=template,
                data=b"",
                located=located,
            )
        except TemplateParseError as e:  # the model folder's template
            raise ConfigError(f"{e}; or pass DataConfig.chat_template FILE") from None
        except DataFormatError as e:
            raise ConfigError(
                f"DataConfig.source: {str(e).splitlines()[0].replace('seq_len=', 'DataConfig.seq_len ')}"
            ) from None
        except ValueError as e:
            raise ConfigError(f"DataConfig.source {path}: {str(e).splitlines()[0]}") from None
    return trains, vals


def _check_rows(c, adapters: AdapterRecords, trains: Mapping[str, Dataset]) -> None:
    """Every adapter takes `batch_size / K` rows of its own training rows each step."""
    k = len(trains)
    if c.batch_size % k:
        raise ConfigError(
            f"RunConfig.batch_size {c.batch_size}: each step takes the same number of rows of each of the {k} adapters "
            f"{list(trains)}; use a multiple of {k} (and of data-parallel size x microbatches)"
        )
    for name, train in trains.items():
        if len(train) < c.batch_size // k:
            raise ConfigError(
                f"DataConfig.source: adapter {name!r} ({adapters.files[name].name}) has {counted(len(train), 'training row')} after "
                f"holding out DataConfig.validation {c.data.validation}, fewer than the {c.batch_size // k} each step takes "
                f"of it (RunConfig.batch_size {c.batch_size} / {k} adapters); give it more rows, or lower RunConfig.batch_size"
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
            f"DataConfig.source names {len(names)} adapters {list(names)}: several LoRA adapters train with zoo finetune "
            "(RunConfig.objective sft); zoo train trains one model's every weight: drop the adapter names"
        )
    folder = init_folder(c)
    tokenizer = tokenizer_of(folder)
    source = folder if tokenizer is not None and folder is not None else (tokenizer or byte_tokenizer())
    trains, vals = _load(c, adapters, source)
    _check_rows(c, adapters, trains)
    model, config, folder = model_spec(c.model).file_model(c, None, rules=rules, mesh=mesh)
    check_tokenizer(config, tokenizer, folder)
    held = {n: vals[n].arrays if len(vals[n]) else trains[n].arrays for n in names}
    what = "; ".join(f"{n}: {describe(trains[n])}, {counted(len(vals[n]), 'validation row')}" for n in names)
    return Task(
        model=model,
        kind="lm",
        loss_fn=routed(next_token_loss),
        metrics_fn=adapter_metrics(names),
        train_source=AdapterRows(names, tuple(trains[n] for n in names)),
        seed=c.seed,
        eval_data=stack_rows(held, c.data.eval_size),
        train_data=None,
        data=f"{len(names)} adapters ({what}); {'tokenizer' if tokenizer else 'byte'} tokens, rows of {c.data.seq_len}",
        unit="tokens",
        tokens_per_example=c.data.seq_len,
        hf_part=lambda m: m,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict(),
        init=None if folder is None else str(folder),
        fingerprint={"data_sha256": adapters.sha256},
        adapter_names=names,
    )


# --------------------------------------------------------------------------- a run's LoRA config on its model
# A run's LoRA config on its model: adapters added by one compiled program (`add_lora`),
# and what a run reports about them (`zoo.lora._named.lora_json`). Its text form is `_text.parse_lora`.


LORA_KEY_SALT = 0x10A  # the adapters' key: fold_in(key(seed), this), apart from the model's


_LORA_WRAPPERS: dict[Any, tuple[Any, dict[str, Any]]] = {}


def add_lora(model: Any, config: Any, seed: int) -> Any:
    """`zoo.lora.add_lora(model, config, key=...)` as one jitted program compiled as
    `init_compiled`'s (`once_compiler_options`), once per (model structure and placement,
    config).
    A target matching nothing, a rank too large, ... → ConfigError with zoo's message."""
    import equinox as eqx
    import jax
    import jax.random as jr

    from .._jit import once_compiler_options
    from ..lora import add_lora as add_branches

    if is_abstract(model):  # shapes alone: the branches' too, nothing computed
        try:
            return eqx.filter_eval_shape(
                lambda m: add_branches(m, config, key=jr.fold_in(jr.key(seed), LORA_KEY_SALT)), model
            )
        except ValueError as e:
            raise ConfigError(f"RunConfig.lora: {e}") from e
    seed_key = jr.key_data(jr.key(seed))
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    # A compiled program takes only the placements it was compiled for: another mesh (a
    # second run in this process on other devices) is another program.
    placements = tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)
    cache_key = (treedef, placements, config, jax.sharding.get_mesh())
    if cache_key not in _LORA_WRAPPERS:
        out: dict[str, Any] = {}

        def wrap(arrays, seed_key):
            # fold_in in the program: no program of its own to compile (jr.key's is the model's).
            key = jr.fold_in(jr.wrap_key_data(seed_key), LORA_KEY_SALT)
            lora_arrays, out["tree"] = eqx.partition(
                add_branches(eqx.combine(arrays, static), config, key=key), eqx.is_array
            )
            # The base's arrays pass through untouched: the program returns only the new
            # ones, and the caller's own are put back (an output that is an input is still a
            # copy made by the program: at 1B, a second 4 GB base beside the run's task.model).
            position = {id(x): i for i, x in enumerate(jax.tree.leaves(arrays))}
            new, out["treedef"] = jax.tree.flatten(lora_arrays)
            out["forwarded"] = [position.get(id(x)) for x in new]
            return [x for x, i in zip(new, out["forwarded"]) if i is None]

        try:
            lowered = jax.jit(wrap).lower(arrays, seed_key)
            compiled = lowered.compile(compiler_options=once_compiler_options(lowered))
        except ValueError as e:
            raise ConfigError(f"RunConfig.lora: {e}") from e
        _LORA_WRAPPERS[cache_key] = (compiled, out)
    compiled, out = _LORA_WRAPPERS[cache_key]
    made = iter(compiled(arrays, seed_key))
    lora_leaves = [next(made) if i is None else leaves[i] for i in out["forwarded"]]
    return eqx.combine(jax.tree.unflatten(out["treedef"], lora_leaves), out["tree"])


def quantize_base(model: Any, config: Any) -> Any:
    """`model` (its LoRA branches added) with the frozen base stored as `config.quantize`
    asks (`zoo.lora.cast_frozen`: every frozen projection of the layer stack and every
    branch's base as nf4 / int4 `FourBitLinear` or int8 `QuantizedLinear`, the other
    frozen leaves in bfloat16); unchanged without it.

    **Raises:** `ConfigError` when a 4-bit block does not divide a layer's inputs, naming
    the `--quantize KIND:BLOCK` that fits."""
    from ..lora import cast_frozen

    if config.quantize is None:
        return model
    try:
        # its text form, "nf4:32" too
        return on_shapes_too(lambda m: cast_frozen(m, config.quantize, config=config.lora), model)
    except ValueError as e:
        kind = config.quantize.partition(":")[0]
        first = (
            str(e)
            .splitlines()[0]
            .replace("pass block_size= one of", f"pass RunConfig.quantize {kind}:BLOCK, BLOCK one of")
        )
        raise ConfigError(f"RunConfig.quantize {config.quantize}: {first}") from None
