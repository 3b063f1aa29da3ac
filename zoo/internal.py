"""Low-level pieces, for building your own (like `equinox.internal`); no stability promise.

The everyday path needs none of these: `zoo.TrainStep` applies them. They are the
filtered transforms between plain, reduced and unreduced leaves (explicit mode:
`reduced_cast` → `unreduced_zeros` → `reduce_unreduced`; `jax.shard_map` mode:
`manual_specs`, `pcast_varying`, `pcast_unreduced`), the FSDP gather (`gather_over`), the
ZeRO layout (`split_spec`), the batch split (`check_batch`, `split_microbatches`), one
array's `PartitionSpec` under rules (`spec_for`; `PlacementError` when they cannot place it) and the trainable/frozen split
(`partition_trainable`). See docs/design.md for how the step uses them.

Then what the layers, loaders and tools share: how a layer's weight is laid out for use
(`sharding_spec`, `contract_spec`, `for_use`), RoPE's frequencies, the sampling settings'
check, refusing non-finite weights (`check_finite`, `NonFiniteWeightsError`), a pytree's
sizes and paths (`tree_bytes`, `tree_size`, `human_bytes`, `path_str`), a count and its noun
(`counted`: "1 step", "2 steps"), a model of shapes
alone (`is_array_like`, `on_shapes_too`: `zoo.train.abstract_models`), what a LoRA config
adapted (`lora_json`) and tracebacks without the checkpoint writer's closed-loop frames.

It imports nothing from `zoo.train` (tests/test_structure.py holds it): the command line
uses `zoo.train`'s public names for what it shares with a run.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._batch": ("check_batch", "split_microbatches"),
        "._checkpoint._disk": ("without_closed_loop_tracebacks",),
        "._finite": ("NonFiniteWeightsError", "check_finite"),
        "._reduced": (
            "gather_over",
            "manual_specs",
            "pcast_unreduced",
            "pcast_varying",
            "reduce_unreduced",
            "reduced_cast",
            "split_spec",
            "unreduced_zeros",
        ),
        "._rules": ("PlacementError", "spec_for"),
        "._sampling": ("check_sampling",),
        "._step": ("partition_trainable",),
        "._tree": ("counted", "human_bytes", "is_array_like", "on_shapes_too", "path_str", "tree_bytes", "tree_size"),
        ".lora._named": ("lora_json",),
        ".nn._rope": ("rope_frequencies",),
        ".nn._sharding": ("contract_spec", "for_use", "sharding_spec"),
    },
)

if TYPE_CHECKING:
    from ._batch import check_batch as check_batch
    from ._batch import split_microbatches as split_microbatches
    from ._checkpoint._disk import without_closed_loop_tracebacks as without_closed_loop_tracebacks
    from ._finite import NonFiniteWeightsError as NonFiniteWeightsError
    from ._finite import check_finite as check_finite
    from ._reduced import gather_over as gather_over
    from ._reduced import manual_specs as manual_specs
    from ._reduced import pcast_unreduced as pcast_unreduced
    from ._reduced import pcast_varying as pcast_varying
    from ._reduced import reduce_unreduced as reduce_unreduced
    from ._reduced import reduced_cast as reduced_cast
    from ._reduced import split_spec as split_spec
    from ._reduced import unreduced_zeros as unreduced_zeros
    from ._rules import PlacementError as PlacementError
    from ._rules import spec_for as spec_for
    from ._sampling import check_sampling as check_sampling
    from ._step import partition_trainable as partition_trainable
    from ._tree import counted as counted
    from ._tree import human_bytes as human_bytes
    from ._tree import is_array_like as is_array_like
    from ._tree import on_shapes_too as on_shapes_too
    from ._tree import path_str as path_str
    from ._tree import tree_bytes as tree_bytes
    from ._tree import tree_size as tree_size
    from .lora._named import lora_json as lora_json
    from .nn._rope import rope_frequencies as rope_frequencies
    from .nn._sharding import contract_spec as contract_spec
    from .nn._sharding import for_use as for_use
    from .nn._sharding import sharding_spec as sharding_spec

__all__ = [
    "NonFiniteWeightsError",
    "PlacementError",
    "check_batch",
    "check_finite",
    "check_sampling",
    "contract_spec",
    "counted",
    "for_use",
    "gather_over",
    "human_bytes",
    "is_array_like",
    "lora_json",
    "manual_specs",
    "on_shapes_too",
    "partition_trainable",
    "path_str",
    "pcast_unreduced",
    "pcast_varying",
    "reduce_unreduced",
    "reduced_cast",
    "rope_frequencies",
    "sharding_spec",
    "spec_for",
    "split_microbatches",
    "split_spec",
    "tree_bytes",
    "tree_size",
    "unreduced_zeros",
    "without_closed_loop_tracebacks",
]
