"""Helpers the tests share: tolerant tree comparison, meshes, tiny models and batches.

Imported by test modules (`from helpers import ...`); fixtures live in `conftest.py`.
`zoo` is imported inside the functions, not here: jaxtyping's import hook (installed by
pytest's `--jaxtyping-packages`) must see zoo's first import.
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    import zoo


def tree_allclose(a, b, *, rtol=1e-5, atol=1e-6) -> bool:
    """Same structure and every array leaf close (None leaves must match)."""
    a_arrays, a_static = eqx.partition(a, eqx.is_array)
    b_arrays, b_static = eqx.partition(b, eqx.is_array)
    if jax.tree.structure(a_arrays) != jax.tree.structure(b_arrays):
        return False
    return all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(jax.tree.leaves(a_arrays), jax.tree.leaves(b_arrays))
    )


def max_abs_diff(a, b) -> float:
    """Largest elementwise difference between two trees of arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)))
    )


@functools.cache
def data_mesh(n: int):
    """A 1-D explicit mesh `data=n` over the first n devices."""
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def regression_batch(key, size: int, in_size: int, out_size: int = 1):
    """A deterministic regression batch `(x [size, in], y [size, out])`."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (size, in_size))
    w = jax.random.normal(kw, (in_size, out_size)) / np.sqrt(in_size)
    return x, jnp.sin(x @ w)


def mse_per_example(model, batch):
    """Per-example mean squared error: the loss_fn contract of zoo.TrainStep."""
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y), axis=-1)


class TokenRegressor(eqx.Module):
    """Test model touching every zoo module: Embedding → mean over tokens → MLP."""

    embed: zoo.nn.Embedding
    mlp: zoo.nn.MLP

    def __init__(self, *, norm="layernorm", scan=True, vocab=11, dim=8, key):
        import zoo

        k1, k2 = jax.random.split(key)
        self.embed = zoo.nn.Embedding(vocab, dim, init_std=0.5, key=k1)
        self.mlp = zoo.nn.MLP(dim, 2, 16, 3, activation=jnp.tanh, norm=norm, scan=scan, key=k2)

    def __call__(self, ids):
        return self.mlp(self.embed(ids).mean(axis=1))


def token_batch(key, size: int, seq: int = 5, vocab: int = 11):
    """`(ids [size, seq], y [size, 2])`: a target that depends on the tokens."""
    ids = jax.random.randint(key, (size, seq), 0, vocab)
    y = jnp.stack([jnp.sin(ids.sum(1) / 7.0), jnp.cos(ids[:, 0] / 3.0)], axis=1)
    return ids, y


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


@functools.cache
def preset_mesh(preset: str, n: int):
    """`data=n` for data-parallel presets; `data=n/2, model=2` for tensor-parallel ones."""
    if "tp" in preset:
        return jax.make_mesh((n // 2, 2), ("data", "model"), devices=jax.devices()[:n])
    return data_mesh(n)


def tiny_decoder(key, **overrides):
    """A small decoder LM exercising GQA, RoPE, SwiGLU, RMSNorm and an untied head."""
    import zoo

    config = dict(
        vocab_size=32,
        d_model=16,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        mlp_dim=32,
        max_len=8,
        positions="rope",
        activation="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
    )
    return zoo.models.Transformer(zoo.models.TransformerConfig(**(config | overrides)), key=key)


def tiny_encoder_classifier(key, **overrides):
    """A small BERT-style encoder (with dropout) plus a 3-way classification head."""
    import zoo

    config = dict(vocab_size=32, d_model=16, num_heads=4, num_layers=2, mlp_dim=32, max_len=8, dropout=0.1)
    k1, k2 = jax.random.split(key)
    encoder = zoo.models.Encoder(zoo.models.EncoderConfig(**(config | overrides)), key=k1)
    return zoo.models.EncoderClassifier(encoder, 3, key=k2)


def lm_batch(key, size: int, seq: int = 8, vocab: int = 32):
    """`{"tokens", "mask"}` with some right-padding, for `zoo.models.next_token_loss`."""
    tokens = jax.random.randint(key, (size, seq), 1, vocab)
    lengths = seq - (jnp.arange(size) % 3)
    mask = jnp.arange(seq)[None, :] < lengths[:, None]
    return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}


def classification_batch(key, size: int, seq: int = 8, vocab: int = 32):
    """`{"tokens", "labels", "dropout_key"}` with padding (id 0), for the encoder classifier."""
    import zoo

    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (size, seq), 1, vocab)
    lengths = seq - (jnp.arange(size) % 4)
    tokens = jnp.where(jnp.arange(seq)[None, :] < lengths[:, None], tokens, 0)
    labels = jax.random.randint(k2, (size,), 0, 3)
    return {"tokens": tokens, "labels": labels, "dropout_key": zoo.nn.example_keys(k3, size)}


def zoo_main(*args) -> tuple[int, str, str]:
    """`zoo ARGS` in-process: (exit code, stdout, stderr); argparse's exits become codes."""
    from zoo._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def zoo_ok(*args) -> str:
    """`zoo ARGS` in-process, which must succeed: its stdout."""
    rc, out, err = zoo_main(*args)
    assert rc == 0, f"zoo {' '.join(map(str, args))} exited {rc}\n{out}\n{err}"
    return out


def one_line_error(rc: int, err: str, message: str, code: int = 2) -> None:
    """A command's failure as the CLI promises it: exit `code`, one line on stderr holding
    `message`, no traceback."""
    assert rc == code, (rc, err)
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
