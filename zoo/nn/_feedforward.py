"""Position-wise feed-forward layers: GELU/ReLU two-layer, or gated SwiGLU."""

from __future__ import annotations

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from ._dropout import ExampleKeys, fold_in
from ._linear import Linear, flatten_rows
from ._remat import saved

Activation = Literal["gelu", "gelu_tanh", "relu", "swiglu", "geglu"]


@jax.custom_jvp
def gelu_exact(x):
    """`jax.nn.gelu(x, approximate=False)`, with a derivative that keeps one residual.

    The same values; the derivative `Φ(x) + x φ(x)` is computed in the forward pass, so
    the backward pass stores that one array per layer instead of the three that
    differentiating `x · erfc(-x/√2) / 2` keeps (docs/performance.md).
    """
    return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    cdf = 0.5 * lax.erfc(-x * (1 / math.sqrt(2)))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return gelu_exact(x), (cdf + x * pdf).astype(t.dtype) * t


@jax.custom_jvp
def silu(x):
    """`jax.nn.silu(x)` (`x σ(x)`), with a derivative that keeps one residual.

    The same values; the derivative `σ(x) (1 + x (1 - σ(x)))` is computed in the forward
    pass, so the backward pass stores that one array instead of `x` and `σ(x)`.
    """
    return jax.nn.silu(x)


@silu.defjvp
def _silu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    s = jax.nn.sigmoid(x)
    return x * s, (s * (1 + x * (1 - s))).astype(t.dtype) * t


_ACTIVATIONS = {
    "gelu": gelu_exact,  # BERT
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's "gelu_new"
    "relu": jax.nn.relu,
    "swiglu": silu,  # applied to the gate
    "geglu": lambda x: jax.nn.gelu(x, approximate=True),  # applied to the gate (Gemma)
}

ACTIVATIONS = tuple(_ACTIVATIONS)


class FeedForward(eqx.Module):
    """`down(act(up(x)))`, or with `"swiglu"` `down(silu(gate(x)) * up(x))` (`"geglu"`:
    tanh-GELU on the gate).

    Logical axes: `up`/`gate` `("embed", "mlp")` (column-parallel under tensor
    parallelism), `down` `("mlp", "embed")` (row-parallel).
    """

    up: Linear
    gate: Linear | None
    down: Linear
    activation: str = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        activation: Activation = "gelu",
        use_bias: bool = True,
        init_std: float | None = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:** model width `dim`, `hidden_dim`, `activation` (one of
        `zoo.nn.ACTIVATIONS`), `use_bias`, normal `init_std` (`None`: uniform), PRNG `key`."""
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {list(_ACTIVATIONS)}")
        ku, kg, kd = jr.split(key, 3)
        common = dict(use_bias=use_bias, init_std=init_std)
        self.up = Linear(dim, hidden_dim, in_axis="embed", out_axis="mlp", key=ku, **common)
        self.gate = (
            Linear(dim, hidden_dim, in_axis="embed", out_axis="mlp", key=kg, **common)
            if activation in ("swiglu", "geglu")
            else None
        )
        self.down = Linear(hidden_dim, dim, in_axis="mlp", out_axis="embed", key=kd, **common)
        self.activation = activation

    def __call__(
        self, x: Float[Array, "*batch embed"], *, key: ExampleKeys | None = None
    ) -> Float[Array, "*batch embed"]:
        """Apply the feed-forward layer to the last axis of `x`. `key`: per-example keys
        for dropout inside the projections (LoRA branches), or `None`."""
        act = _ACTIVATIONS[self.activation]
        keys = [None] * 3 if key is None else [fold_in(key, i) for i in range(3)]
        if self.gate is not None:
            # One flattened copy of x for both projections' backward pass; with per-example
            # dropout keys (LoRA branches) x keeps its batch dim first.
            rows, restore = flatten_rows(x) if key is None else (x, lambda y: y)
            h = restore(act(saved(self.gate(rows, key=keys[0]))) * saved(self.up(rows, key=keys[1])))
        else:
            h = act(saved(self.up(x, key=keys[1])))
        return self.down(h, key=keys[2])
