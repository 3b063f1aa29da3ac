"""A transformer layer: attention and feed-forward, each with a residual and a norm."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from ._attention import Attention
from ._cache import KVCache
from ._dropout import ExampleKeys, dropout, fold_in
from ._feedforward import FeedForward
from ._norm import LayerNorm, RMSNorm
from ._pattern import LayerPattern


class TransformerBlock(eqx.Module):
    """One transformer layer, pre-LN (GPT-2, Llama) or post-LN (BERT).

    Pre-LN: `h = x + attn(norm(x)); out = h + mlp(norm(h))`.
    Post-LN: `h = norm(x + attn(x)); out = norm(h + mlp(h))`.
    Dropout (`dropout_rate`) is applied to each sub-layer's output before the residual add.
    """

    attention: Attention
    attention_norm: LayerNorm | RMSNorm
    mlp: FeedForward
    mlp_norm: LayerNorm | RMSNorm
    pre_norm: bool = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)

    def __init__(
        self,
        attention: Attention,
        mlp: FeedForward,
        attention_norm: LayerNorm | RMSNorm,
        mlp_norm: LayerNorm | RMSNorm,
        *,
        pre_norm: bool = True,
        dropout_rate: float = 0.0,
    ):
        """**Arguments:** the `attention` and `mlp` sub-layers, their norms, `pre_norm`
        (else post-LN), residual `dropout_rate`."""
        self.attention = attention
        self.attention_norm = attention_norm
        self.mlp = mlp
        self.mlp_norm = mlp_norm
        self.pre_norm = pre_norm
        self.dropout_rate = dropout_rate

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
    ) -> Float[Array, "batch seq embed"] | tuple[Float[Array, "batch seq embed"], KVCache]:
        """Apply the layer. `mask`: `True` at real tokens; `segment_ids`, `positions`: packed
        documents (see `Attention`); `key`: per-example keys or `None`; `cache`: this
        layer's `KVCache` (inference, see `Attention`): then returns `(output, cache)`;
        `pattern`: this layer's attention settings in a patterned stack (`LayerPattern`)."""
        more = {} if segment_ids is None and positions is None else dict(segment_ids=segment_ids, positions=positions)
        if pattern is not None:
            more["pattern"] = pattern
        keys = [None] * 4 if key is None else [fold_in(key, i) for i in range(4)]
        new_cache = None

        def drop(h, k):
            return dropout(h, self.dropout_rate, k)

        def attend(h):
            nonlocal new_cache
            if cache is None:
                return self.attention(h, mask=mask, key=keys[0], **more)
            out, new_cache = self.attention(h, mask=mask, key=keys[0], cache=cache, **more)
            return out

        if self.pre_norm:
            h = x + drop(attend(self.attention_norm(x)), keys[1])
            out = h + drop(self.mlp(self.mlp_norm(h), key=keys[3]), keys[2])
        else:
            h = self.attention_norm(x + drop(attend(x), keys[1]))
            out = self.mlp_norm(h + drop(self.mlp(h, key=keys[3]), keys[2]))
        return out if cache is None else (out, new_cache)
