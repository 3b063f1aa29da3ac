"""eqx-zoo: Equinox models whose multi-device training step holds one gradient all-reduce.

The path a model takes: annotate (`zoo.field`) → rules (`zoo.rules`) → place
(`zoo.shard`) → `zoo.TrainStep` (reduced cast → scan over microbatches → one all-reduce
→ optax update) → check the compiled step (`zoo.collectives`).
"""

from . import data, hf, lora, models, nn
from ._axes import LAYERS, LogicalAxes, field, logical_axes, stacked_field
from ._batch import check_batch, split_microbatches
from ._checkpoint import CheckpointError, Checkpointer
from ._compile_cache import default_cache_dir, enable_compilation_cache
from ._distributed import distributed_init, global_batch, is_main_process, local_rows
from ._inspect import COLLECTIVE_KINDS, Collective, collectives, count, report
from ._reduced import (
    gather_over,
    manual_specs,
    pcast_unreduced,
    pcast_varying,
    reduce_unreduced,
    reduced_cast,
    split_spec,
    unreduced_zeros,
)
from ._rules import LOGICAL_AXES, RULE_PRESETS, partition_specs, rules, shard, spec_for, step_options
from ._step import TrainStep, partition_trainable

__version__ = "0.1.0"

__all__ = [
    "COLLECTIVE_KINDS",
    "LAYERS",
    "LOGICAL_AXES",
    "RULE_PRESETS",
    "CheckpointError",
    "Checkpointer",
    "Collective",
    "LogicalAxes",
    "TrainStep",
    "check_batch",
    "collectives",
    "count",
    "field",
    "gather_over",
    "global_batch",
    "is_main_process",
    "data",
    "default_cache_dir",
    "distributed_init",
    "enable_compilation_cache",
    "hf",
    "logical_axes",
    "local_rows",
    "lora",
    "manual_specs",
    "models",
    "nn",
    "partition_specs",
    "partition_trainable",
    "pcast_unreduced",
    "pcast_varying",
    "reduce_unreduced",
    "reduced_cast",
    "report",
    "rules",
    "shard",
    "spec_for",
    "split_microbatches",
    "split_spec",
    "stacked_field",
    "step_options",
    "unreduced_zeros",
]
