"""The checks of `RunConfig.model_config` (`zoo train --model-config`): each value of the
right kind and range, and a pretrained model's shape left as it is. Errors name the field
(`RunConfig.model_config`), which the CLI shows as its flag."""

from __future__ import annotations

import math
from typing import Any

from ._errors import ConfigError

# Keys by kind: sizes (ints >= 1), ids (ints >= 0), probabilities in [0, 1), positive
# floats; other keys are left to the model's config class.
SIZES = ("width", "depth", "vocab_size", "d_model", "num_heads", "num_layers", "mlp_dim", "max_len", "num_kv_heads",
         "head_dim", "type_vocab_size")  # fmt: skip
IDS = ("pad_token_id",)
PROBABILITIES = ("dropout", "attention_dropout")
POSITIVE = ("norm_eps", "init_std", "rope_theta")
_NULLABLE = ("mlp_dim", "num_kv_heads", "head_dim")
_MAX_SIZE = 2**31 - 1
# What `model_config` may change of a pretrained model whose shape is fixed.
PRETRAINED_KEYS = ("dropout", "attention_dropout", "remat", "dtype")


def check_model_config(values: dict[str, Any]) -> None:
    """Raise `ConfigError` naming the first value of `values` (a `RunConfig.model_config`)
    of the wrong kind or range: sizes are integers >= 1 (at most 2**31 - 1), ids integers
    >= 0, dropouts probabilities in [0, 1), `norm_eps` / `init_std` / `rope_theta` numbers
    > 0, and every float finite."""
    if not isinstance(values, dict):
        raise ConfigError(f"RunConfig.model_config must be a dict of config key -> value, got {values!r}")
    for key, value in values.items():
        where = f"RunConfig.model_config {key}={value}"
        if key in SIZES + IDS and not (key in _NULLABLE and value is None):
            low = 1 if key in SIZES else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                example = f", e.g. {key}=64" if key in SIZES else ""
                raise ConfigError(f"{where}: {key} must be an integer >= {low}{example}")
            if value > _MAX_SIZE:
                raise ConfigError(f"{where}: {key} must be at most {_MAX_SIZE} (array dimensions are int32)")
        elif key in PROBABILITIES + POSITIVE:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{where}: {key} must be a finite number")
            if key in PROBABILITIES and not 0 <= value < 1:
                raise ConfigError(f"{where}: {key} is a probability in [0, 1)")
            if key in POSITIVE and not value > 0:
                raise ConfigError(f"{where}: {key} must be > 0")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite")


def check_pretrained_shape(model: str, values: dict[str, Any], fixed: bool) -> None:
    """A pretrained model's shape is its checkpoint's: when `fixed` (the model loads its
    own weights, no `init`), `values` may only hold `PRETRAINED_KEYS`."""
    if fixed and values.keys() - set(PRETRAINED_KEYS):
        raise ConfigError(
            f"RunConfig.model_config: the pretrained {model}'s shape is fixed; only dropout, attention_dropout and "
            "remat can change"
        )
