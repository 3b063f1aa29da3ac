"""Multi-head attention with grouped key/value heads, causal and padding masks, RoPE; through
`jax.nn.dot_product_attention` (cuDNN's fused kernel) on a GPU in half precision."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._cache import KEYS_LAYOUT, VALUES_LAYOUT, KVCache
from ._dropout import ExampleKeys, dropout, fold_in
from ._linear import Linear, flatten_rows
from ._norm import RMSNorm
from ._pattern import LayerPattern
from ._remat import saved
from ._rope import RopeScaling, apply_rope, rope_angles, rope_tables


@jax.custom_jvp
def softmax(x: Float[Array, "... n"]) -> Float[Array, "... n"]:
    """Softmax over the last axis, `exp(x - max) / sum`, whose derivative keeps one residual.

    The values of `jax.nn.softmax(x, axis=-1)`; differentiated as written it keeps
    `exp`, the quotient and the squared sum for the backward pass, whereas
    `p (t - Σ p t)` needs only the output `p` (docs/performance.md).
    """
    e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / jnp.sum(e, axis=-1, keepdims=True)


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    p = softmax(x)
    return p, p * (t - jnp.sum(p * t, axis=-1, keepdims=True))


class Attention(eqx.Module):
    """Multi-head self-attention on `[batch, seq, embed]` arrays.

    Projections are plain `Linear` layers (`q_proj`, `k_proj`, `v_proj`, `o_proj`) whose
    head dimension is flattened (`heads × head_dim`), so each maps one-to-one onto a
    Hugging Face `nn.Linear`/`Conv1D` and LoRA can wrap any of them. Query head `h` reads
    key/value head `h // (num_heads // num_kv_heads)` (grouped-query attention, as HF's
    `repeat_kv`). Logical axes: `("embed", "heads")`, `("embed", "kv_heads")`,
    `("heads", "embed")` — tensor parallelism splits heads over `model`. With `qk_norm`,
    each query and key head is RMS-normalised over its `head_dim` before RoPE (`q_norm`,
    `k_norm`, one scale of `head_dim` shared by the heads: Qwen3, Gemma 3); with
    `qk_norm="projection"`, the whole query and key projections are, before they are split
    into heads (scales of `heads × head_dim` and `kv_heads × head_dim`, split over `model`
    as the heads are, the mean of squares a sum across them: OLMo 2).
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    dropout_rate: float = eqx.field(static=True)
    rope_llama3: tuple[float, float, float, int] | None = eqx.field(static=True, default=None)
    sliding_window: int | None = eqx.field(static=True, default=None)
    logit_softcap: float | None = eqx.field(static=True, default=None)
    query_scale: float | None = eqx.field(static=True, default=None)
    rope_dim: int | None = eqx.field(static=True, default=None)
    rope_scaling: RopeScaling | None = eqx.field(static=True, default=None)
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = False,
        rope_theta: float | None = None,
        dropout_rate: float = 0.0,
        use_bias: bool = True,
        init_std: float | None = 0.02,
        rope_llama3: tuple[float, float, float, int] | None = None,
        sliding_window: int | None = None,
        qk_norm: bool | str = False,
        norm_eps: float = 1e-6,
        logit_softcap: float | None = None,
        query_scale: float | None = None,
        rope_dim: int | None = None,
        rope_scaling: RopeScaling | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: model width (input and output size).
        - `num_heads`: query heads.
        - `num_kv_heads`: key/value heads (default `num_heads`; fewer for grouped-query
          attention; must divide `num_heads`).
        - `head_dim`: size of each head (default `dim // num_heads`).
        - `causal`: position `s` attends only to positions `≤ s`.
        - `rope_theta`: apply rotary position embeddings with this base (`None`: none).
        - `dropout_rate`: dropout on the attention probabilities.
        - `use_bias`: biases on the four projections.
        - `init_std`: normal init std of the projections (`None`: uniform ±1/√in).
        - `rope_llama3`: Llama 3.1's rescaling of the RoPE frequencies, `(factor,
          low_freq_factor, high_freq_factor, original_max_len)` (see `zoo.internal.rope_frequencies`).
        - `sliding_window`: with `causal`, position `s` attends only to positions `t` with
          `s - window < t ≤ s` (Mistral's banded mask); `None`: every earlier position.
        - `qk_norm`: RMS-normalise each query and key head before RoPE, with a learned
          scale of `head_dim` (init 1) and epsilon `norm_eps`; `"projection"`: the whole
          query and key projections instead (scales of their widths).
        - `logit_softcap`: soft-cap the scores, `cap * tanh(scores / cap)`, before the
          mask and softmax (Gemma 2's `attn_logit_softcapping`); `None`: none.
        - `query_scale`: the scores are divided by `sqrt(query_scale)` instead of
          `sqrt(head_dim)` (Gemma 2/3's `query_pre_attn_scalar`); `None`: `head_dim`.
        - `rope_dim`: RoPE rotates only the first `rope_dim` (even) dimensions of each head
          (partial rotary, its frequencies those of a `rope_dim`-wide head) and passes the
          rest through; `None`: all `head_dim`.
        - `rope_scaling`: a `RopeScaling` (linear, yarn, longrope) of the RoPE frequencies
          and of `cos`/`sin`; `None`: none (or `rope_llama3`'s).
        - `key`: PRNG key.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): each group of "
                "num_heads // num_kv_heads query heads shares one key/value head"
            )
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim ({dim}) is not divisible by num_heads ({num_heads}); pass head_dim explicitly")
            head_dim = dim // num_heads
        kq, kk, kv, ko = jr.split(key, 4)
        common = dict(use_bias=use_bias, init_std=init_std)
        self.q_proj = Linear(dim, num_heads * head_dim, in_axis="embed", out_axis="heads", key=kq, **common)
        self.k_proj = Linear(dim, num_kv_heads * head_dim, in_axis="embed", out_axis="kv_heads", key=kk, **common)
        self.v_proj = Linear(dim, num_kv_heads * head_dim, in_axis="embed", out_axis="kv_heads", key=kv, **common)
        self.o_proj = Linear(num_heads * head_dim, dim, in_axis="heads", out_axis="embed", key=ko, **common)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.rope_theta = rope_theta
        self.dropout_rate = dropout_rate
        self.rope_llama3 = rope_llama3
        if rope_scaling is not None and rope_llama3 is not None:
            raise ValueError("Attention: give rope_llama3 or rope_scaling, not both")
        self.rope_scaling = rope_scaling
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.query_scale = query_scale
        if rope_dim is not None and not (0 < rope_dim <= head_dim and rope_dim % 2 == 0):
            raise ValueError(f"rope_dim must be even and in (0, head_dim={head_dim}], got {rope_dim}")
        self.rope_dim = None if rope_dim == head_dim else rope_dim
        if qk_norm not in (False, True, "head", "projection"):
            raise ValueError(f"qk_norm must be a bool, 'head' or 'projection', got {qk_norm!r}")
        if qk_norm == "projection":  # scales as wide as the projections, split as they are
            self.q_norm = RMSNorm(num_heads * head_dim, eps=norm_eps, axis="heads")
            self.k_norm = RMSNorm(num_kv_heads * head_dim, eps=norm_eps, axis="kv_heads")
        else:  # per head dimension, shared by every head: nothing of it to split
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, axis=None) if qk_norm else None
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, axis=None) if qk_norm else None

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
        """Attend over `x` (and, with a `cache`, over the columns it holds).

        **Arguments:**

        - `x`: `[batch, seq, embed]` activations.
        - `mask`: `[batch, seq]`, `True` at real tokens; keys at `False` (padding) are
          never attended to.
        - `segment_ids`: `[batch, seq]` document ids of packed rows: a query attends only
          to keys of its own segment (`None`: one segment per row).
        - `positions`: `[batch, seq]` RoPE positions (restarting at each packed document);
          `None`: `0..seq-1`.
        - `key`: one PRNG key per example (`[batch]`) for attention dropout, or `None`.
        - `cache`: this layer's `KVCache` (inference): `x` is the tokens of its columns
          `index … index+seq`, whose keys and values are written there; each query attends
          to the columns the cache's mask marks up to its own (causal: the cache's columns
          are the token positions; with a `sliding_window`, the last `window` of them).
          `mask` and `segment_ids` are not used with it: the cache's mask says which
          columns hold real tokens.
        - `pattern`: this layer's `LayerPattern` values in a stack whose layers differ
          (scalars, traced inside `Stacked`'s scan): whether it applies RoPE (this module's
          `rope_theta` must be set for any to), its window and its RoPE base, each in place
          of this module's own setting where given.

        **Returns:** `[batch, seq, embed]`, in `x`'s dtype; with a `cache`, `(that, the
        cache with this call's keys and values written)`.
        """
        b, s, _ = x.shape
        kvh, g, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # Streams 1-4 for the projections (dropout in LoRA branches), 0 for the probabilities.
        keys = [None] * 5 if key is None else [fold_in(key, i) for i in range(5)]
        # One flattened copy of x for the three projections' backward pass; with per-example
        # dropout keys (LoRA branches) x keeps its batch dim first.
        rows, restore = flatten_rows(x) if key is None else (x, lambda y: y)
        q, k = saved(restore(self.q_proj(rows, key=keys[1]))), saved(restore(self.k_proj(rows, key=keys[2])))
        # A q norm wider than a head spans the projection (OLMo 2): before the split into
        # heads. (With one query head the two scopes are the same sums.)
        whole = self.q_norm is not None and self.q_norm.dim != hd
        if whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(b, s, kvh, g, hd), k.reshape(b, s, kvh, hd)
        v = saved(restore(self.v_proj(rows, key=keys[3]))).reshape(b, s, kvh, hd)
        if self.q_norm is not None and not whole:
            q, k = self.q_norm(q), self.k_norm(k)
        pattern = LayerPattern() if pattern is None else pattern
        window = self.sliding_window if pattern.window is None else pattern.window
        if self.rope_theta is not None:
            theta = self.rope_theta if pattern.rope_theta is None else pattern.rope_theta
            rd = hd if self.rope_dim is None else self.rope_dim
            scaling = dict(llama3=self.rope_llama3, scaling=self.rope_scaling, linear=pattern.rope_factor)
            if positions is None:
                cos, sin = rope_tables(s, rd, theta=theta, **scaling)
            else:
                cos, sin = rope_angles(positions, rd, theta=theta, **scaling)
            rotated_q, rotated_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if pattern.rope is None:
                q, k = rotated_q, rotated_k
            else:  # a layer without RoPE (NoPE) keeps them as projected
                q, k = jnp.where(pattern.rope, rotated_q, q), jnp.where(pattern.rope, rotated_k, k)
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("attention over a cache takes no segment_ids: one document per row")
            cache = cache.write(k, v)
            parts_k, parts_v = cache.read()
            parts_k, parts_v = [p.astype(x.dtype) for p in parts_k], [p.astype(x.dtype) for p in parts_v]
            t = sum(p.shape[2] for p in parts_k)
            held, real = cache.key_columns(s, t)  # which column each one read holds (a ring's: its slots)
            allowed = real[:, None]  # [batch, 1, columns read]
            if self.causal:  # a query's column is its position in the cache
                query_columns = jnp.reshape(cache.index, (-1, 1)) + jnp.arange(s)  # [1 or batch, seq]
                allowed = allowed & _causal(query_columns, held[:, None], window)
            out = self._weigh(q, parts_k, parts_v, allowed[:, None, None], layout=(KEYS_LAYOUT, VALUES_LAYOUT))
            return self.o_proj(out.reshape(b, s, self.num_heads * hd)), cache
        allowed = None
        if self.causal:
            allowed = _causal(jnp.arange(s), jnp.arange(s), window)
        if segment_ids is not None:
            same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
            allowed = same if allowed is None else allowed & same
        if mask is not None:
            keys_ok = mask.astype(bool)[:, None, None, None, :]
            allowed = keys_ok if allowed is None else allowed & keys_ok
        implementation = self._fused(x.dtype, key)
        if implementation is None:
            out = self._weigh(q, [k], [v], allowed, key=keys[0])
        else:
            out = fused_attention(q, k, v, allowed, scale=self._scale(), implementation=implementation)
        return self.o_proj(saved(out.reshape(b, s, self.num_heads * hd)), key=keys[4])

    def _fused(self, dtype, key) -> str | None:
        """`jax.nn.dot_product_attention`'s implementation for a call (`fused_implementation`:
        cuDNN's on a GPU in half precision), or `None`: the einsum attention (`_weigh`),
        always where the scores are soft-capped or attention dropout is on."""
        if self.logit_softcap is not None or (key is not None and self.dropout_rate > 0):
            return None
        return fused_implementation(dtype, self.head_dim)

    def _scale(self) -> float:
        """The scores' multiplier: 1 / sqrt(head_dim), or of `query_scale` where set."""
        return 1 / math.sqrt(self.head_dim if self.query_scale is None else self.query_scale)

    def _weigh(self, q, keys: list, values: list, allowed, *, key=None, layout=("btkd", "btkd")):
        """The attention of the queries `q` `[batch, seq, kv_heads, group, head_dim]` over
        keys and values given in parts whose columns follow each other (`layout`: how each
        part's dimensions lie, einsum letters, `t` the columns), at the columns `allowed`
        marks: `[batch, seq, kv_heads, group, head_dim]` in `q`'s dtype. Scores in float32;
        `key`: dropout on the probabilities."""
        key_layout, value_layout = layout
        scores = [jnp.einsum(f"bskgd,{key_layout}->bkgst", q, k, preferred_element_type=jnp.float32) for k in keys]
        scores = scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1)
        # Divided, not multiplied by `_scale()`: the einsum path's rounding as it always was.
        scores = scores / math.sqrt(self.head_dim if self.query_scale is None else self.query_scale)
        if self.logit_softcap is not None:  # Gemma 2: scores bounded to (-cap, cap) before the mask
            scores = self.logit_softcap * jnp.tanh(scores / self.logit_softcap)
        if allowed is not None:
            # An additive bias (0 or the float32 minimum) in the mask's own, smaller shape,
            # rather than `where` on the scores: the same probabilities (exp of the minimum
            # minus the row's maximum is 0), but the backward pass keeps no broadcast
            # [batch, heads, seq, seq] mask (docs/performance.md).
            scores = scores + jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        probs = softmax(scores)
        probs = dropout(probs, self.dropout_rate, key).astype(q.dtype)
        out, start = None, 0
        for v in values:  # each part's columns of the probabilities times its values
            n = v.shape[value_layout.index("t")]
            part = probs if len(values) == 1 else probs[..., start : start + n]
            part = jnp.einsum(f"bkgst,{value_layout}->bskgd", part, v)
            out, start = part if out is None else out + part, start + n
        return out


def _causal(query_columns: Int[Array, "*rows seq"], key_columns: Int[Array, "*key_rows columns"], window):
    """`[*rows, seq, columns]`: a query sees the keys at its own column and before (and,
    with a `window` (an int, or a layer's traced one), only the last `window` of them:
    Mistral's band)."""
    allowed = query_columns[..., :, None] >= key_columns
    if window is not None:
        allowed = allowed & (query_columns[..., :, None] - key_columns < window)
    return allowed


# The dtypes cuDNN's fused attention takes (jax 0.10.2): half precision only.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def fused_implementation(dtype, head_dim: int = 64) -> str | None:
    """`jax.nn.dot_product_attention`'s `implementation` for activations of `dtype` and
    heads `head_dim` wide on this process's default backend: `"cudnn"` on a GPU in
    bfloat16 or float16 with heads of a multiple of 8 up to 128 (what its fused kernel
    takes), else `None`
    (zoo's own einsum attention: on CPU jax's `"xla"` implementation is the same
    computation with a `where` over the whole `[batch, heads, seq, seq]` scores, which
    zoo's additive mask avoids, and float32 has no fused kernel)."""
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in [jnp.dtype(d) for d in _CUDNN_DTYPES]:
        return None
    if head_dim % 8 or head_dim > 128:
        return None
    return "cudnn"


def fused_attention(
    q: Float[Array, "batch seq kv_heads group head_dim"],
    k: Float[Array, "batch columns kv_heads head_dim"],
    v: Float[Array, "batch columns kv_heads head_dim"],
    allowed: Bool[Array, "*mask"] | None,
    *,
    scale: float,
    implementation: str,
) -> Float[Array, "batch seq kv_heads group head_dim"]:
    """`Attention`'s weighting of `v` by the softmax of `q · k · scale` at the columns
    `allowed` marks, through `jax.nn.dot_product_attention` (grouped-query heads as it
    takes them, float32 softmax).

    **Arguments:** `q`, `k`, `v` as `Attention` lays them out; `allowed`, the mask
    `Attention` builds (`[seq, columns]` or `[batch|1, 1, 1, seq|1, columns]`), `None`:
    every column; `scale`, the scores' multiplier; `implementation`, jax's (`"cudnn"`,
    `"xla"`).

    **Returns:** `[batch, seq, kv_heads, group, head_dim]` in `q`'s dtype.
    """
    b, s, kvh, g, hd = q.shape
    t = k.shape[1]
    mask = None
    if allowed is not None:
        allowed = allowed.reshape((1,) * (5 - allowed.ndim) + allowed.shape)[:, 0]  # [b|1, 1, s|1, t]
        mask = jnp.broadcast_to(allowed, allowed.shape[:2] + (s, t))
    # Query head n = kv_head * group + j reads key head n // group: jax's grouped-query layout.
    out = jax.nn.dot_product_attention(
        q.reshape(b, s, kvh * g, hd), k, v, mask=mask, scale=scale, implementation=implementation
    )
    return out.reshape(b, s, kvh, g, hd)
