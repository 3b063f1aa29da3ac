"""Low-level pieces of the training step, for building your own (like `equinox.internal`).

The everyday path needs none of these: `zoo.TrainStep` applies them. They are the
filtered transforms between plain, reduced and unreduced leaves (explicit mode:
`reduced_cast` → `unreduced_zeros` → `reduce_unreduced`; `jax.shard_map` mode:
`manual_specs`, `pcast_varying`, `pcast_unreduced`), the FSDP gather (`gather_over`), the
ZeRO layout (`split_spec`), the batch split (`check_batch`, `split_microbatches`), one
array's `PartitionSpec` under rules (`spec_for`) and the trainable/frozen split
(`partition_trainable`). See docs/design.md for how the step uses them.

The second half is the command line's plumbing (`zoo/_cli` imports only public names):
the pieces of `zoo.train.run` the commands also use on their own, the text forms of
`--lora` (`parse_lora`, `lora_text`, `lora_json`) and `--model-config` (`parse_scalar`),
the mesh (`parse_mesh`, `mesh_text`, `make_mesh`, `check_rules_fit_mesh`), the registry's
shared tables (`SHARED_DEFAULTS`, `OPTIONAL_DEFAULT_KEYS`, `CLASSIFIER_SAVE`,
`spec_for_init`), a run's outputs and sizes, and the fixed pieces of the built-in models
(`DATA_FILE_HELP`: `--data`'s help on files). No stability promise beyond the CLI's.
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._batch": ("check_batch", "split_microbatches"),
        "._checkpoint._disk": ("without_closed_loop_tracebacks",),
        "._finite": ("NonFiniteWeightsError", "check_finite"),
        "._inspect": ("COLLECTIVE_KINDS",),
        "._reduced": (
            "gather_over",
            "manual_specs",
            "pcast_unreduced",
            "pcast_varying",
            "plain_spec",
            "reduce_unreduced",
            "reduced_cast",
            "reshard_tree",
            "split_spec",
            "unreduced_zeros",
        ),
        "._rules": ("spec_for",),
        "._sampling": ("check_sampling",),
        "._step": ("partition_trainable",),
        "._tree": ("path_str",),
        ".hf._files": ("hub_cache",),
        ".hf._load": ("fit_to_mesh",),
        ".nn._rope": ("rope_angles", "rope_frequencies"),
        ".nn._sharding": ("contract_spec", "for_use", "sharding_spec"),
        ".train._builtin": ("DEMO_PRETRAIN", "minilm_available"),
        ".train._adapters": ("add_lora", "lora_json"),
        ".train._output": (
            "Metrics",
            "collective_summary",
            "human_bytes",
            "plot_losses",
            "read_metrics",
            "tree_bytes",
            "tree_size",
            "write_json",
        ),
        ".train._plan": ("check_rules_fit_mesh", "make_mesh", "output_dir"),
        ".train._registry": (
            "PRETRAINED_KEYS",
            "CLASSIFIER_SAVE",
            "DATA_FILE_HELP",
            "OPTIONAL_DEFAULT_KEYS",
            "SHARED_DEFAULTS",
            "check_model_name",
            "model_and_init",
            "resolve_init",
            "spec_for_init",
        ),
        ".train._sources": ("numpy_rng",),
        ".train._task": ("ONCE_COMPILER_OPTIONS", "init_compiled"),
        ".train._text": ("LORA_EXAMPLE", "lora_text", "mesh_text", "parse_lora", "parse_mesh", "parse_scalar"),
    },
)

if TYPE_CHECKING:
    from ._batch import check_batch as check_batch
    from ._batch import split_microbatches as split_microbatches
    from ._checkpoint._disk import without_closed_loop_tracebacks as without_closed_loop_tracebacks
    from ._finite import NonFiniteWeightsError as NonFiniteWeightsError
    from ._finite import check_finite as check_finite
    from ._inspect import COLLECTIVE_KINDS as COLLECTIVE_KINDS
    from ._reduced import gather_over as gather_over
    from ._reduced import manual_specs as manual_specs
    from ._reduced import pcast_unreduced as pcast_unreduced
    from ._reduced import pcast_varying as pcast_varying
    from ._reduced import plain_spec as plain_spec
    from ._reduced import reduce_unreduced as reduce_unreduced
    from ._reduced import reduced_cast as reduced_cast
    from ._reduced import reshard_tree as reshard_tree
    from ._reduced import split_spec as split_spec
    from ._reduced import unreduced_zeros as unreduced_zeros
    from ._rules import spec_for as spec_for
    from ._sampling import check_sampling as check_sampling
    from ._step import partition_trainable as partition_trainable
    from ._tree import path_str as path_str
    from .hf._files import hub_cache as hub_cache
    from .hf._load import fit_to_mesh as fit_to_mesh
    from .nn._rope import rope_angles as rope_angles
    from .nn._rope import rope_frequencies as rope_frequencies
    from .nn._sharding import contract_spec as contract_spec
    from .nn._sharding import for_use as for_use
    from .nn._sharding import sharding_spec as sharding_spec
    from .train._adapters import add_lora as add_lora
    from .train._adapters import lora_json as lora_json
    from .train._builtin import DEMO_PRETRAIN as DEMO_PRETRAIN
    from .train._builtin import minilm_available as minilm_available
    from .train._output import Metrics as Metrics
    from .train._output import collective_summary as collective_summary
    from .train._output import human_bytes as human_bytes
    from .train._output import plot_losses as plot_losses
    from .train._output import read_metrics as read_metrics
    from .train._output import tree_bytes as tree_bytes
    from .train._output import tree_size as tree_size
    from .train._output import write_json as write_json
    from .train._plan import check_rules_fit_mesh as check_rules_fit_mesh
    from .train._plan import make_mesh as make_mesh
    from .train._plan import output_dir as output_dir
    from .train._registry import CLASSIFIER_SAVE as CLASSIFIER_SAVE
    from .train._registry import DATA_FILE_HELP as DATA_FILE_HELP
    from .train._registry import OPTIONAL_DEFAULT_KEYS as OPTIONAL_DEFAULT_KEYS
    from .train._registry import PRETRAINED_KEYS as PRETRAINED_KEYS
    from .train._registry import SHARED_DEFAULTS as SHARED_DEFAULTS
    from .train._registry import check_model_name as check_model_name
    from .train._registry import model_and_init as model_and_init
    from .train._registry import resolve_init as resolve_init
    from .train._registry import spec_for_init as spec_for_init
    from .train._sources import numpy_rng as numpy_rng
    from .train._task import ONCE_COMPILER_OPTIONS as ONCE_COMPILER_OPTIONS
    from .train._task import init_compiled as init_compiled
    from .train._text import LORA_EXAMPLE as LORA_EXAMPLE
    from .train._text import lora_text as lora_text
    from .train._text import mesh_text as mesh_text
    from .train._text import parse_lora as parse_lora
    from .train._text import parse_mesh as parse_mesh
    from .train._text import parse_scalar as parse_scalar

__all__ = [
    "CLASSIFIER_SAVE",
    "COLLECTIVE_KINDS",
    "DATA_FILE_HELP",
    "DEMO_PRETRAIN",
    "LORA_EXAMPLE",
    "ONCE_COMPILER_OPTIONS",
    "OPTIONAL_DEFAULT_KEYS",
    "PRETRAINED_KEYS",
    "SHARED_DEFAULTS",
    "Metrics",
    "NonFiniteWeightsError",
    "add_lora",
    "check_batch",
    "check_finite",
    "check_model_name",
    "check_rules_fit_mesh",
    "check_sampling",
    "collective_summary",
    "contract_spec",
    "fit_to_mesh",
    "for_use",
    "gather_over",
    "hub_cache",
    "human_bytes",
    "init_compiled",
    "lora_json",
    "lora_text",
    "make_mesh",
    "manual_specs",
    "mesh_text",
    "minilm_available",
    "model_and_init",
    "numpy_rng",
    "output_dir",
    "parse_lora",
    "parse_mesh",
    "parse_scalar",
    "partition_trainable",
    "path_str",
    "pcast_unreduced",
    "pcast_varying",
    "plain_spec",
    "plot_losses",
    "read_metrics",
    "reduce_unreduced",
    "reduced_cast",
    "reshard_tree",
    "resolve_init",
    "rope_angles",
    "rope_frequencies",
    "sharding_spec",
    "spec_for",
    "spec_for_init",
    "split_microbatches",
    "split_spec",
    "tree_bytes",
    "tree_size",
    "unreduced_zeros",
    "without_closed_loop_tracebacks",
    "write_json",
]
