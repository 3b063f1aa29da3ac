"""How the layers of one scanned stack differ: per-layer attention settings as data."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import numpy as np
from jaxtyping import Array, ArrayLike

# The window of a layer that attends to every earlier position: larger than any distance
# between two columns, so `query - key < window` always holds.
GLOBAL_WINDOW = np.iinfo(np.int32).max


class LayerPattern(eqx.Module):
    """The attention settings that differ between the layers of a stack (SmolLM3's layers
    without RoPE, sliding-window and global layers, a RoPE base per layer), as arrays.

    Outside a stack each field is one value per layer (`[layers]`); `Stacked` scans them
    beside the layers' parameters, so layer `i` is called with `pattern=` its own scalars
    (traced: every layer runs the one compiled body), and `Unstacked` hands layer `i` its
    values likewise. A field that is `None` is not patterned: the layer's own (static)
    setting holds. The pattern holds no parameters: it comes from the model's static
    config at each call, so checkpoints, optimizer state, sharding and adapters never see it.

    - `rope`: whether the layer rotates its queries and keys (`False`: a NoPE layer).
    - `window`: the layer's sliding window (a query sees the last `window` positions);
      `GLOBAL_WINDOW` on a global layer.
    - `rope_theta`: the layer's RoPE base.
    - `rope_factor`: the layer's linear RoPE scaling (its inverse frequencies divided by it;
      1: none): Gemma 3 scales its global layers only.
    """

    rope: Array | ArrayLike | None = None
    window: Array | ArrayLike | None = None
    rope_theta: Array | ArrayLike | None = None
    rope_factor: Array | ArrayLike | None = None

    @classmethod
    def of_layers(
        cls,
        *,
        rope: Sequence[bool] | None = None,
        window: Sequence[int | None] | None = None,
        rope_theta: Sequence[float] | None = None,
        rope_factor: Sequence[float] | None = None,
    ) -> LayerPattern | None:
        """The pattern of per-layer settings (one value per layer each, `None` for a window:
        global), keeping only the fields whose layers differ; `None` when none differ (a
        uniform stack: nothing to scan, the same program as without a pattern)."""

        pattern = cls(
            rope=_varying(rope, np.bool_),
            window=_varying(window, np.int32, GLOBAL_WINDOW),
            rope_theta=_varying(rope_theta, np.float32),
            rope_factor=_varying(rope_factor, np.float32),
        )
        fields = (pattern.rope, pattern.window, pattern.rope_theta, pattern.rope_factor)
        return None if all(v is None for v in fields) else pattern


def _varying(values: Sequence | None, dtype: type, none: int | None = None) -> np.ndarray | None:
    """`values` as an array of `dtype` (`none` for a `None`), or `None` where every layer's
    value is the same (`LayerPattern.of_layers`)."""
    if values is None or len(set(values)) <= 1:
        return None
    return np.asarray([none if v is None else v for v in values], dtype)
