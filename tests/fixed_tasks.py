"""The fixed tiny models (random batches) whose compiled steps `tests/data/make_step_collectives.py`
records and `benchmarks/suite.py` measures, kept fixed so their numbers stay comparable
across versions, and their LoRA (`inspect_defaults`). Test and benchmark fixtures, not
part of the package (they lived in `zoo/_cli/_tasks.py`): the commands build their models
through the registry (`zoo.train.model_spec`, `zoo.train.build_task`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from zoo.train import Task, build_task
from zoo.train._builtin import minilm_available
from zoo.train._registry import CLASSIFIER_SAVE
from zoo.train._sources import numpy_rng
from zoo.train._task import init_compiled

# --- the fixed tiny models ---------------------------------------------------------------------


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

    encoder = zoo.hf.from_pretrained(zoo.hf.minilm_path())
    model = zoo.models.EncoderClassifier(encoder, _NUM_LABELS, key=key)
    return InspectTask(model, zoo.models.classification_loss, _classifier_batches(encoder.config.vocab_size))


INSPECT_MODELS: dict[str, Callable[[Any], InspectTask]] = {
    "mlp": _inspect_mlp,
    "transformer": _inspect_transformer,
    "encoder": _inspect_encoder,
    "minilm": _inspect_minilm,
}


def build_inspect_task(name: str, seed: int) -> InspectTask:
    """The fixed tiny model `name` (`mlp`, `transformer`, `encoder`, `minilm`) with its
    loss and a random batch maker."""
    import jax.random as jr

    return INSPECT_MODELS[name](jr.key(seed))


__all__ = [
    "INSPECT_MODELS",
    "TINY_TRANSFORMER",
    "InspectTask",
    "Task",
    "build_inspect_task",
    "build_task",
    "minilm_available",
]


def inspect_defaults(model: str) -> dict[str, Any]:
    """The LoRA of the pinned collectives (tests/data/step_collectives.json) and the
    benchmarks: the attention's query and value projections
    (peft's default for LLaMA/BERT-style models; every hidden Linear for the MLP, which has
    no attention), the classifier's head trained in full."""
    fields: dict[str, Any] = {"target_modules": "all-linear" if model == "mlp" else ("q_proj", "v_proj")}
    if model in ("encoder", "minilm"):
        fields["modules_to_save"] = CLASSIFIER_SAVE
    return fields
