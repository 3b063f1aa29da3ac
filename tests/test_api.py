"""The public surface: the path's nouns at `zoo.*`, the low-level transforms in `zoo.internal`."""

import importlib.metadata

import zoo

LOW_LEVEL = (
    "check_batch",
    "gather_over",
    "manual_specs",
    "partition_trainable",
    "pcast_unreduced",
    "pcast_varying",
    "reduce_unreduced",
    "reduced_cast",
    "spec_for",
    "split_microbatches",
    "split_spec",
    "unreduced_zeros",
)


def test_every_public_name_exists_and_low_level_ones_live_in_internal():
    assert all(hasattr(zoo, name) for name in zoo.__all__)
    assert {"TrainStep", "shard", "rules", "preset", "field", "collectives", "Checkpointer"} <= set(zoo.__all__)
    for name in LOW_LEVEL:
        assert callable(getattr(zoo.internal, name)), name
        assert not hasattr(zoo, name) and name not in zoo.__all__, name


def test_version_comes_from_the_package_metadata():
    assert zoo.__version__ == importlib.metadata.version("eqx-zoo")
