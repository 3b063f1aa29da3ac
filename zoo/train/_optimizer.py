"""The optimizer of a run: optax's own transformations and learning-rate schedules."""

from __future__ import annotations

import dataclasses
import math

from ._errors import ConfigError
from ._flags import flag

OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor")
SCHEDULES = ("cosine", "constant", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """An optimizer and its learning-rate schedule.

    **Fields:**

    - `name`: `"adamw"`, `"adam"`, `"sgd"` (Nesterov momentum 0.9), `"lion"` or `"adafactor"`.
    - `lr`: the peak learning rate (finite, > 0). None: the model's default in a run
      (`RunConfig.resolved`); `build` needs it set.
    - `schedule`: after the warmup, `"cosine"` (decay to `end_lr_fraction · lr` at the last
      step), `"linear"` (the same end, in a straight line) or `"constant"`.
    - `warmup`: steps of linear warmup; step `k <= warmup` runs at `lr · k / warmup`, so
      step 1 already moves the weights and step `warmup` runs at the peak. `None`: a
      twentieth of the run (at least 1, fewer than the steps).
    - `weight_decay`: decoupled weight decay of adamw, lion and sgd (>= 0). None: the
      run's default (0.01 to train every weight, 0 to fine-tune; `RunConfig.resolved`),
      none when built outside a run.
    - `clip`: clip the gradients at this global norm first (0: no clipping).
    - `end_lr_fraction`: where the cosine and linear schedules end, as a fraction of `lr`.
    """

    # Plain `str`s, checked in __post_init__: a bad name is a ConfigError listing the choices.
    name: str = flag("adamw", name="optimizer", choices=OPTIMIZERS, help="optimizer (default adamw)")
    lr: float | int | None = flag(None, metavar="LR", help="peak learning rate ({per_model})")
    schedule: str = flag(
        "cosine",
        choices=SCHEDULES,
        help="after the warmup: cosine decay to lr/10 at the last "
        "step, linear decay to lr/10, or constant (default cosine); the warmup rises linearly from "
        "lr/warmup at step 1 to lr at step --warmup",
    )
    warmup: int | None = flag(
        None, metavar="STEPS", help="linear warmup steps (default: a twentieth of --steps, at least 1)"
    )
    weight_decay: float | int | None = flag(
        None,
        metavar="WD",
        help="weight decay of adamw/lion/sgd (default {weight_decays}, unless the model says otherwise)",
    )
    clip: float | int = flag(1.0, metavar="NORM", help="clip gradients at this global norm, 0 for none (default 1)")
    end_lr_fraction: float | int = flag(
        0.1, metavar="F", help="where the cosine and linear schedules end, as a fraction of --lr (default 0.1)"
    )

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"OptimizerConfig.name {self.name!r} is not one of {list(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"OptimizerConfig.schedule {self.schedule!r} is not one of {list(SCHEDULES)}")
        for field, strict in (("lr", True), ("weight_decay", False), ("clip", False), ("end_lr_fraction", False)):
            value = getattr(self, field)
            if value is None and field in ("lr", "weight_decay"):
                continue  # the run's default
            ok = isinstance(value, int | float) and math.isfinite(value) and (value > 0 if strict else value >= 0)
            if not ok:
                raise ConfigError(
                    f"OptimizerConfig.{field} must be a finite number {'> 0' if strict else '>= 0'}, got {value!r}"
                )
        if self.warmup is not None and (
            isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0
        ):
            raise ConfigError(f"OptimizerConfig.warmup must be an integer >= 0 (or None), got {self.warmup!r}")

    def warmup_steps(self, steps: int) -> int:
        """The warmup of a run of `steps` steps (`warmup`, or its default)."""
        if self.warmup is None:
            return min(max(1, steps // 20), steps - 1) if steps > 1 else 0
        if self.warmup >= steps and self.warmup > 0:
            raise ConfigError(f"OptimizerConfig.warmup {self.warmup} must be below the run's {steps} steps")
        return self.warmup

    def schedule_fn(self, steps: int):
        """The optax schedule of a run of `steps` steps: a function of optax's update
        count (0 at the first step), so step `k` (1-based) runs at `schedule_fn(steps)(k - 1)`.

        Built from `optax.linear_schedule`, `optax.cosine_decay_schedule`,
        `optax.constant_schedule` and `optax.join_schedules`."""
        import optax

        warmup = self.warmup_steps(steps)
        if self.lr is None:
            raise ConfigError(
                "OptimizerConfig.lr is not set; pass lr=..., or run it through zoo.train.run, which "
                "takes the model's default (RunConfig.resolved)"
            )
        end = self.lr * self.end_lr_fraction
        # Counts warmup, warmup + 1, ..., steps - 1 (steps warmup + 1 ... steps) decay, so the
        # last step runs at `end` exactly.
        decay = max(steps - 1 - warmup, 1)
        if self.schedule == "cosine":
            after = optax.cosine_decay_schedule(self.lr, decay, alpha=self.end_lr_fraction)
        elif self.schedule == "linear":
            after = optax.linear_schedule(self.lr, end, decay)
        else:
            after = optax.constant_schedule(self.lr)
        if warmup == 0:
            return after
        # Count c (step c + 1) of the warmup runs at lr · (c + 1) / warmup: never 0.
        rise = optax.linear_schedule(self.lr / warmup, self.lr, warmup - 1)
        return optax.join_schedules([rise, after], [warmup])

    def rates(self, steps: int):
        """The learning rate of every step, as numpy (index `k - 1` for step `k`): the
        values of `schedule_fn(steps)`, computed once, for logging without a device op
        per step."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        # One program, not the schedule's ops run (and each compiled) one by one: ~0.2 s.
        return np.asarray(jax.jit(jax.vmap(self.schedule_fn(steps)))(jnp.arange(steps)))

    def build(self, steps: int, *, per_adapter: bool = False):
        """The `optax.GradientTransformation` of a run of `steps` steps: global-norm clipping
        at `clip` (if > 0), then the optimizer on `schedule_fn(steps)`. `per_adapter`:
        the trained leaves are the adapters of a `zoo.lora.stack_adapters` model, each
        clipped at its own norm (`zoo.lora.clip_per_adapter`), as if trained alone."""
        import optax

        from ..lora import clip_per_adapter

        rate = self.schedule_fn(steps)
        decay = self.weight_decay or 0.0  # unset outside a run: none
        if self.name == "adamw":
            opt = optax.adamw(rate, weight_decay=decay)
        elif self.name == "adam":
            opt = optax.adam(rate)
        elif self.name == "sgd":
            opt = optax.chain(optax.add_decayed_weights(decay), optax.sgd(rate, momentum=0.9, nesterov=True))
        elif self.name == "lion":
            opt = optax.lion(rate, weight_decay=decay)
        else:
            opt = optax.adafactor(rate)
        if self.clip <= 0:
            return opt
        clip = clip_per_adapter(self.clip) if per_adapter else optax.clip_by_global_norm(self.clip)
        return optax.chain(clip, opt)
