"""eqx-zoo: Equinox models whose multi-device training step holds one gradient all-reduce.

The path a model takes: annotate (`zoo.field`) → rules (`zoo.rules`, `zoo.presets`) →
place (`zoo.shard`) → `zoo.TrainStep` (reduced cast → scan over microbatches → one
all-reduce → optax update) → check the compiled step (`zoo.collectives`). The low-level
transforms the step is built from live in `zoo.internal`.
"""

from typing import TYPE_CHECKING

from ._env import VERSION as _VERSION
from ._env import runtime_checks as _runtime_checks
from ._lazy import lazy_names

# ZOO_RUNTIME_CHECKS=1: every jaxtyping-annotated function and module of the package checks
# its arguments' shapes and dtypes with beartype when called (as the test suite runs). The
# import hook must be in place before the modules below are imported (when first read).
if _runtime_checks():
    try:
        import beartype as _beartype  # noqa: F401
    except ImportError as _e:
        raise ImportError("ZOO_RUNTIME_CHECKS=1 needs beartype: pip install beartype (or unset it)") from _e
    import jaxtyping as _jaxtyping

    _jaxtyping.install_import_hook("zoo", "beartype.beartype")

# The public names, imported when first read (`zoo._lazy`): `import zoo` loads no jax, so
# `zoo --help` answers at once. The block below is the same list for type checkers.
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        ".data": ("data",),
        ".hf": ("hf",),
        ".internal": ("internal",),
        ".lora": ("lora",),
        ".models": ("models",),
        ".nn": ("nn",),
        ".presets": ("presets",),
        ".serve": ("serve",),
        ".train": ("train",),
        "._axes": ("LAYERS", "LogicalAxes", "field", "logical_axes", "stacked_field"),
        "._budget": ("Allowance", "Budget", "BudgetError", "BudgetWarning"),
        "._checkpoint": ("CheckpointError", "Checkpointer", "DamagedCheckpointError"),
        "._compile_cache": ("default_cache_dir", "enable_compilation_cache"),
        "._distributed": ("distributed_init", "global_batch", "is_main_process", "local_rows"),
        "._generate": ("generate",),
        "._host_memory": ("keep_freed_memory",),
        "._inspect": ("Collective", "collectives", "compare_collectives", "count", "report"),
        "._presets": ("RULE_PRESETS", "Preset", "preset", "rules"),
        "._axis_names": ("LOGICAL_AXES",),
        "._rules": ("partition_specs", "shard"),
        "._step": ("TrainStep",),
    },
)

if TYPE_CHECKING:
    from . import data, hf, internal, lora, models, nn, presets, serve, train
    from ._axes import LAYERS as LAYERS
    from ._axes import LogicalAxes as LogicalAxes
    from ._axes import field as field
    from ._axes import logical_axes as logical_axes
    from ._axes import stacked_field as stacked_field
    from ._axis_names import LOGICAL_AXES as LOGICAL_AXES
    from ._budget import Allowance as Allowance
    from ._budget import Budget as Budget
    from ._budget import BudgetError as BudgetError
    from ._budget import BudgetWarning as BudgetWarning
    from ._checkpoint import Checkpointer as Checkpointer
    from ._checkpoint import CheckpointError as CheckpointError
    from ._checkpoint import DamagedCheckpointError as DamagedCheckpointError
    from ._compile_cache import default_cache_dir as default_cache_dir
    from ._compile_cache import enable_compilation_cache as enable_compilation_cache
    from ._distributed import distributed_init as distributed_init
    from ._distributed import global_batch as global_batch
    from ._distributed import is_main_process as is_main_process
    from ._distributed import local_rows as local_rows
    from ._generate import generate as generate
    from ._host_memory import keep_freed_memory as keep_freed_memory
    from ._inspect import Collective as Collective
    from ._inspect import collectives as collectives
    from ._inspect import compare_collectives as compare_collectives
    from ._inspect import count as count
    from ._inspect import report as report
    from ._presets import RULE_PRESETS as RULE_PRESETS
    from ._presets import Preset as Preset
    from ._presets import preset as preset
    from ._presets import rules as rules
    from ._rules import partition_specs as partition_specs
    from ._rules import shard as shard
    from ._step import TrainStep as TrainStep


__version__ = _VERSION

__all__ = [
    "LAYERS",
    "LOGICAL_AXES",
    "RULE_PRESETS",
    "Allowance",
    "Budget",
    "BudgetError",
    "BudgetWarning",
    "CheckpointError",
    "Checkpointer",
    "Collective",
    "DamagedCheckpointError",
    "LogicalAxes",
    "Preset",
    "TrainStep",
    "collectives",
    "compare_collectives",
    "count",
    "data",
    "default_cache_dir",
    "distributed_init",
    "enable_compilation_cache",
    "field",
    "generate",
    "global_batch",
    "hf",
    "internal",
    "is_main_process",
    "keep_freed_memory",
    "local_rows",
    "logical_axes",
    "lora",
    "models",
    "nn",
    "partition_specs",
    "preset",
    "presets",
    "report",
    "rules",
    "serve",
    "shard",
    "stacked_field",
    "train",
]
