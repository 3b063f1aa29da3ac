"""A transformer layer: attention and feed-forward, each with a residual and its norms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from ._attention import Attention
from ._cache import KVCache
from ._dropout import ExampleKeys, dropout, fold_in
from ._experts import Experts, RouterChoice
from ._feedforward import FeedForward
from ._norm import LayerNorm, RMSNorm
from ._pattern import LayerPattern
from ._remat import saved


class TransformerBlock(eqx.Module):
    """One transformer layer, pre-LN (GPT-2, Llama), post-LN (BERT), or with norms on the
    sub-layers' outputs (OLMo 2; both, "sandwich": Gemma 2/3).

    Pre-LN: `h = x + attn(norm(x)); out = h + mlp(norm(h))`.
    Post-LN: `h = norm(x + attn(x)); out = norm(h + mlp(h))`.
    Each pre-LN norm is optional (`attention_norm`, `mlp_norm`: on the sub-layer's input),
    and so is a norm on each sub-layer's output before its residual add
    (`attention_out_norm`, `mlp_out_norm`): OLMo 2 has the output norms only,
    `h = x + norm(attn(x)); out = h + norm(mlp(h))`; Gemma 2/3 all four. Absent norms
    are `None` (no leaves: a pre-LN block's pytree is the same with or without the option).
    Dropout (`dropout_rate`) is applied to each sub-layer's output before the residual add.
    """

    attention: Attention
    attention_norm: LayerNorm | RMSNorm | None
    mlp: FeedForward | Experts
    mlp_norm: LayerNorm | RMSNorm | None
    pre_norm: bool = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)
    attention_out_norm: LayerNorm | RMSNorm | None = None
    mlp_out_norm: LayerNorm | RMSNorm | None = None

    def __init__(
        self,
        attention: Attention,
        mlp: FeedForward | Experts,
        attention_norm: LayerNorm | RMSNorm | None,
        mlp_norm: LayerNorm | RMSNorm | None,
        *,
        pre_norm: bool = True,
        dropout_rate: float = 0.0,
        attention_out_norm: LayerNorm | RMSNorm | None = None,
        mlp_out_norm: LayerNorm | RMSNorm | None = None,
    ):
        """**Arguments:** the `attention` and `mlp` sub-layers (`mlp` a `FeedForward` or a
        mixture of `Experts`), the norms of their inputs
        (`None`: none; both required post-LN), `pre_norm` (else post-LN), residual
        `dropout_rate`, the norms of the sub-layers' outputs (`attention_out_norm`,
        `mlp_out_norm`, pre-LN only; `None`: none)."""
        has_out = attention_out_norm is not None or mlp_out_norm is not None
        if not pre_norm and (attention_norm is None or mlp_norm is None or has_out):
            raise ValueError(
                "a post-LN TransformerBlock (pre_norm=False) normalises each residual sum: it takes "
                "attention_norm and mlp_norm and no output norms"
            )
        self.attention = attention
        self.attention_norm = attention_norm
        self.mlp = mlp
        self.mlp_norm = mlp_norm
        self.pre_norm = pre_norm
        self.dropout_rate = dropout_rate
        self.attention_out_norm = attention_out_norm
        self.mlp_out_norm = mlp_out_norm

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        mask: Bool[Array, "batch seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        key: ExampleKeys | None = None,
        cache: KVCache | None = None,
        pattern: LayerPattern | None = None,
        router: bool = False,
    ) -> (
        Float[Array, "batch seq embed"]
        | tuple[Float[Array, "batch seq embed"], KVCache]
        | tuple[Float[Array, "batch seq embed"], RouterChoice]
    ):
        """Apply the layer. `mask`: `True` at real tokens; `segment_ids`, `positions`: packed
        documents (see `Attention`); `key`: per-example keys or `None`; `cache`: this
        layer's `KVCache` (inference, see `Attention`): then returns `(output, cache)`;
        `pattern`: this layer's attention settings in a patterned stack (`LayerPattern`);
        `router` (an `Experts` layer, no cache): returns `(output, its RouterChoice)`."""
        more = {} if segment_ids is None and positions is None else dict(segment_ids=segment_ids, positions=positions)
        if pattern is not None:
            more["pattern"] = pattern
        keys = [None] * 4 if key is None else [fold_in(key, i) for i in range(4)]
        if router and (not isinstance(self.mlp, Experts) or cache is not None):
            raise ValueError("TransformerBlock(router=True) needs an Experts feed-forward and no cache")
        # Written out, not as nested functions: the tests' runtime type checks decorate a
        # nested function each time its `def` runs (every layer, every trace).
        new_cache = choice = None
        attention_in = _norm(self.attention_norm, x) if self.pre_norm else x
        if cache is None:
            attended = self.attention(attention_in, mask=mask, key=keys[0], **more)
        else:
            attended, new_cache = self.attention(attention_in, mask=mask, key=keys[0], cache=cache, **more)
        if self.pre_norm:
            h = saved(x + dropout(_norm(self.attention_out_norm, attended), self.dropout_rate, keys[1]))
            mlp_in = _norm(self.mlp_norm, h)
        else:
            h = saved(self.attention_norm(x + dropout(attended, self.dropout_rate, keys[1])))
            mlp_in = h
        if router:
            fed, choice = self.mlp(mlp_in, key=keys[3], choice=True)
        else:
            fed = self.mlp(mlp_in, key=keys[3])
        if self.pre_norm:
            out = h + dropout(_norm(self.mlp_out_norm, fed), self.dropout_rate, keys[2])
        else:
            out = self.mlp_norm(h + dropout(fed, self.dropout_rate, keys[2]))
        if choice is not None:
            return out, choice
        return out if cache is None else (out, new_cache)


def _norm(norm: Callable | None, h: Any) -> Any:
    """`norm(h)`, or `h` where the layer has no such norm."""
    return h if norm is None else norm(h)
