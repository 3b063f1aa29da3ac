"""Multi-layer perceptron with optional normalisation and scanned hidden layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_array
from ._inputs import place_inputs
from ._linear import Linear
from ._norm import LayerNorm, RMSNorm
from ._stacked import Stacked

NormKind = Literal["layernorm", "rmsnorm"] | None


def _make_norm(kind: NormKind, dim: int, axis: str) -> LayerNorm | RMSNorm | None:
    if kind is None:
        return None
    if kind == "layernorm":
        return LayerNorm(dim, axis=axis)
    if kind == "rmsnorm":
        return RMSNorm(dim, axis=axis)
    raise ValueError(f"norm must be 'layernorm', 'rmsnorm' or None, got {kind!r}")


class MLPBlock(eqx.Module):
    """One hidden layer of an `MLP`: linear, optional norm, activation."""

    linear: Linear
    norm: LayerNorm | RMSNorm | None
    activation: Callable[[Array], Array] = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        """Apply linear → norm → activation."""
        h = self.linear(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.activation(h)


class MLP(eqx.Module):
    """An MLP on batched arrays: `in_size → width (× depth) → out_size`.

    Like `eqx.nn.MLP`, `depth` counts hidden layers, so there are `depth + 1` linear
    layers. With `scan=True` the `depth - 1` width→width layers are a `Stacked` run by
    `lax.scan` (one compiled layer whatever the depth); otherwise a tuple run in Python.
    """

    input_block: MLPBlock
    hidden: Stacked[MLPBlock] | tuple[MLPBlock, ...]
    output_layer: Linear
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    depth: int = eqx.field(static=True)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        width: int,
        depth: int,
        *,
        activation: Callable[[Array], Array] = jax.nn.relu,
        use_bias: bool = True,
        norm: NormKind = None,
        scan: bool = False,
        remat: str | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_size`, `out_size`, `width`: feature sizes.
        - `depth`: number of hidden layers (≥ 1).
        - `activation`: applied after each hidden layer (and its norm).
        - `use_bias`: biases on every linear layer.
        - `norm`: `"layernorm"`, `"rmsnorm"` or `None`, applied before each activation.
        - `scan`: stack the width→width layers and run them with `lax.scan`.
        - `remat`: with `scan`, a `jax.checkpoint` policy name for the stacked layers.
        - `key`: PRNG key.
        """
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (number of hidden layers), got {depth}")
        in_key, hidden_key, out_key = jr.split(key, 3)

        def block(fan_in: int, in_axis: str, k: PRNGKeyArray) -> MLPBlock:
            linear = Linear(fan_in, width, use_bias=use_bias, in_axis=in_axis, out_axis="mlp", key=k)
            return MLPBlock(linear, _make_norm(norm, width, "mlp"), activation)

        self.input_block = block(in_size, "embed", in_key)
        n_hidden = depth - 1
        if scan and n_hidden > 0:
            self.hidden = Stacked(lambda k: block(width, "mlp_in", k), n_hidden, remat=remat, key=hidden_key)
        else:
            keys = jr.split(hidden_key, max(n_hidden, 1))[:n_hidden]
            self.hidden = tuple(block(width, "mlp_in", k) for k in keys)
        self.output_layer = Linear(width, out_size, use_bias=use_bias, in_axis="mlp", out_axis="embed", key=out_key)
        self.in_size = in_size
        self.out_size = out_size
        self.width = width
        self.depth = depth

    def __call__(self, x: Float[ArrayLike, "*batch {self.in_size}"]) -> Float[Array, "*batch {self.out_size}"]:
        """Apply the MLP to `x` with any leading batch dims (none: one example)."""
        check_array(x, where="MLP", name="x", kind="float", min_ndim=1, last=self.in_size)
        if x.ndim == 1:  # one example is a batch of one, so a placed MLP can take it too
            return self._batched(x[None])[0]
        return self._batched(x)

    @place_inputs
    def _batched(self, x: Float[Array, "batch *rest {self.in_size}"]) -> Float[Array, "batch *rest {self.out_size}"]:
        h = self.input_block(x)
        if isinstance(self.hidden, Stacked):
            h = self.hidden(h)
        else:
            for layer in self.hidden:
                h = layer(h)
        return self.output_layer(h)
