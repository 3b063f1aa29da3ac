"""The values of `RunConfig.model_config` (`--model-config`): each of the right kind and
range, checked when the config is made, so a bad one is one line before anything is built
(a width of 0 was a ZeroDivisionError in the build)."""

from __future__ import annotations

import math
from typing import Any

from ._errors import ConfigError

# Keys by the values they take (TransformerConfig / EncoderConfig fields, the mlp's).
SIZES = ("width", "depth", "vocab_size", "d_model", "num_heads", "num_layers", "mlp_dim", "max_len", "num_kv_heads",
         "head_dim", "type_vocab_size")  # fmt: skip
IDS = ("pad_token_id",)
PROBABILITIES = ("dropout", "attention_dropout")
POSITIVE = ("norm_eps", "init_std", "rope_theta")
_NULLABLE = ("mlp_dim", "num_kv_heads", "head_dim")
_MAX_SIZE = 2**31 - 1


def check_model_config(values: dict[str, Any]) -> None:
    """Raise `ConfigError` naming the first value of `values` (config key → value) of the
    wrong kind or out of range: `RunConfig.model_config width=0: width must be an
    integer >= 1, e.g. width=64`."""
    if not isinstance(values, dict):
        raise ConfigError(f"RunConfig.model_config must be a dict of config key -> value, got {values!r}")
    for key, value in values.items():
        where = f"RunConfig.model_config {key}={value}"
        if key in SIZES + IDS and not (key in _NULLABLE and value is None):
            low = 1 if key in SIZES else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{where}: {key} must be an integer >= {low}, e.g. {key}=64"
                                  if key in SIZES else f"{where}: {key} must be an integer >= 0")  # fmt: skip
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
