"""Rotary position embeddings (RoPE), in the half-split layout of GPT-NeoX and Llama."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

ROPE_SCALINGS = ("linear", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE stretched past the context a model was pretrained on, as transformers computes
    it (`modeling_rope_utils`): other inverse frequencies, and `cos`/`sin` multiplied by an
    attention factor.

    - `kind`: `"linear"` (every frequency divided by `factor`: Gemma 3's global layers),
      `"yarn"` (frequencies blended between interpolated and original by a ramp over
      `beta_fast`..`beta_slow` rotations, Qwen's long-context configs) or `"longrope"`
      (each frequency divided by its own factor: `short_factor` while the sequence fits
      `original_max_len`, `long_factor` once its largest position + 1 exceeds it, for the
      whole forward pass: Phi-3.5 / Phi-4-mini).
    - `factor`: the context's stretch (yarn, linear), or for longrope
      `max_position_embeddings / original_max_len`, which sets its attention factor.
    - `original_max_len`: the pretraining context (yarn, longrope).
    - `attention_factor`: `cos`/`sin`'s multiplier; None: transformers' default for the kind
      (linear 1; yarn `0.1·ln(factor) + 1`; longrope `sqrt(1 + ln(factor) / ln(original_max_len))`).
    - `beta_fast`, `beta_slow`, `truncate`: yarn's ramp (transformers' defaults 32, 1, True).
    - `short_factor`, `long_factor`: longrope's per-frequency factors, `rotary dim / 2` each.
    """

    kind: str
    factor: float = 1.0
    original_max_len: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling.kind must be one of {ROPE_SCALINGS}, got {self.kind!r}")
        if not (isinstance(self.factor, int | float) and math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RopeScaling.factor must be a finite number > 0, got {self.factor!r}")
        if self.kind != "linear" and not (isinstance(self.original_max_len, int) and self.original_max_len >= 1):
            raise ValueError(
                f"RopeScaling {self.kind!r} needs original_max_len, the pretraining context (an int >= 1), "
                f"got {self.original_max_len!r}"
            )
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if values is None:
                    raise ValueError(f"RopeScaling 'longrope' needs {name}: one factor per rotary frequency")
                object.__setattr__(self, name, tuple(float(v) for v in values))  # hashable: a static field
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(
                    f"RopeScaling 'longrope': short_factor has {len(self.short_factor)} values and long_factor "
                    f"{len(self.long_factor)}; give one per rotary frequency in each"
                )

    def decode_limit(self, prompt: int) -> int | None:
        """The most new tokens a key/value cache decodes after a `prompt`-token prompt as
        transformers generates them, or None: no limit. Only longrope has one: once a
        sequence first passes `original_max_len` tokens, transformers' Phi-3 `generate`
        drops its cache and runs the whole sequence again with the long factors (every
        earlier key changes), which a decode loop over a cache does not do."""
        if self.kind != "longrope" or prompt > self.original_max_len:
            return None
        return self.original_max_len - prompt + 1

    @property
    def cos_sin_factor(self) -> float:
        """What `cos` and `sin` are multiplied by (`attention_factor`, or the kind's default)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "yarn":
            return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        if self.kind == "longrope" and self.factor > 1:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))
        return 1.0

    def frequencies(
        self, dim: int, theta: float | Float[ArrayLike, ""], longest: Int[ArrayLike, "*rows"] | int
    ) -> Float[Array, "*rows half"]:
        """The inverse frequencies of a `dim`-wide rotation with base `theta`, as
        transformers' `_compute_{linear_scaling,yarn,longrope}_parameters` compute them;
        longrope's for sequences whose largest position + 1 is `longest` (a number, or one
        per row: `[batch, half]` then)."""
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        powers = jnp.asarray(theta, jnp.float32) ** exponents
        if self.kind == "linear":
            return 1.0 / powers / self.factor
        if self.kind == "longrope":
            if len(self.short_factor) != dim // 2:
                raise ValueError(
                    f"RopeScaling 'longrope' holds {len(self.short_factor)} factors for a rotation of {dim // 2} "
                    "frequencies: give one per frequency (rotary dim / 2)"
                )
            short, long = jnp.asarray(self.short_factor, jnp.float32), jnp.asarray(self.long_factor, jnp.float32)
            factors = jnp.where(jnp.asarray(longest)[..., None] > self.original_max_len, long, short)
            return 1.0 / (factors * powers)
        # yarn: the correction range in dimensions, from rotations per pretraining context
        log_theta = jnp.log(jnp.asarray(theta, jnp.float32))

        def dimension(rotations: float) -> Array:
            return dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * log_theta)

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = jnp.floor(low), jnp.ceil(high)
        low, high = jnp.maximum(low, 0), jnp.minimum(high, dim - 1)
        high = jnp.where(low == high, high + 0.001, high)  # transformers' guard against a zero-width ramp
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation


def rope_frequencies(
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
) -> Float[Array, " half"]:
    """The inverse frequencies `theta^(-2i/head_dim)`, `[head_dim/2]` (`theta`: a number,
    or a layer's traced base in a patterned stack).

    `llama3`: `(factor, low_freq_factor, high_freq_factor, original_max_len)` rescales them
    as Llama 3.1 does (`rope_type: "llama3"`, transformers' `_compute_llama3_parameters`):
    wavelengths longer than `original_max_len / low_freq_factor` are divided by `factor`,
    those shorter than `original_max_len / high_freq_factor` kept, those between blended.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(
    seq_len: int,
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
    scaling: RopeScaling | None = None,
    linear: Float[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "seq half"], Float[Array, "seq half"]]:
    """`(cos, sin)` of the rotation angles `p · theta^(-2i/head_dim)`, `[seq, head_dim/2]`
    (`llama3`: the frequencies rescaled, see `rope_frequencies`; `scaling`: a
    `RopeScaling`'s frequencies, `cos`/`sin` times its attention factor; `linear`: the
    frequencies divided by it, a layer's traced linear factor in a patterned stack)."""
    positions = jnp.arange(seq_len, dtype=jnp.float32)
    return _cos_sin(positions[:, None], seq_len, head_dim, theta, llama3, scaling, linear)


def rope_angles(
    positions: Int[Array, "batch seq"],
    head_dim: int,
    *,
    theta: float | Float[ArrayLike, ""] = 10000.0,
    llama3: tuple[float, float, float, int] | None = None,
    scaling: RopeScaling | None = None,
    linear: Float[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]:
    """`(cos, sin)` as `rope_tables`, at given per-row `positions` `[batch, seq]` (packed
    documents whose positions restart at 0)."""
    # longrope's factors per row, by the row's largest position: what transformers picks
    # running that sequence alone (it takes the batch's largest).
    longest = jnp.max(positions, axis=-1) + 1 if scaling is not None and scaling.kind == "longrope" else 0
    return _cos_sin(positions.astype(jnp.float32)[..., None], longest, head_dim, theta, llama3, scaling, linear)


def _cos_sin(positions, longest, head_dim, theta, llama3, scaling, linear=None):
    """`cos`/`sin` of `positions [..., 1]` times the frequencies (`longest`: the forward
    pass's largest position + 1, which picks longrope's factors)."""
    if scaling is None:
        inv_freq = rope_frequencies(head_dim, theta=theta, llama3=llama3)
        angles = positions * (inv_freq if linear is None else inv_freq / linear)
        return jnp.cos(angles), jnp.sin(angles)
    if llama3 is not None or linear is not None:
        raise ValueError("rope: give one of llama3, scaling and a per-layer linear factor")
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = scaling.frequencies(head_dim, theta, longest)
    angles = positions * (inv_freq[:, None, :] if inv_freq.ndim == 2 else inv_freq)  # per row: [batch, 1, half]
    factor = scaling.cos_sin_factor
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(
    x: Float[Array, "batch seq *heads head_dim"],
    cos: Float[Array, "*rows seq half"],
    sin: Float[Array, "*rows seq half"],
) -> Float[Array, "batch seq *heads head_dim"]:
    """Rotate each pair `(x[i], x[i + half])` of every head by its position's angle, `half`
    being `cos`'s last size.

    `cos`/`sin`: `[seq, half]` (every row at positions `0..seq-1`) or `[batch, seq, half]`
    (per-row positions, `rope_angles`). With `2·half < head_dim` (partial rotary, Phi-4-mini's
    `partial_rotary_factor`) only the first `2·half` dimensions of each head are rotated, in
    the same split layout, and the rest pass through unchanged, as transformers' Phi-3 does.

    Computed in float32, returned in `x`'s dtype.
    """
    half = cos.shape[-1]
    rotary = 2 * half
    if rotary > x.shape[-1]:
        raise ValueError(f"apply_rope: cos/sin rotate {rotary} dimensions of heads {x.shape[-1]} wide")
    extra = x.ndim - 3  # head dims between seq and head_dim
    shape = (x.shape[0] if cos.ndim == 3 else 1, x.shape[1]) + (1,) * extra + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:rotary]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rotary < x.shape[-1]:  # partial rotary: the tail is not rotated
        parts.append(x32[..., rotary:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)
