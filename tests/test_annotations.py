"""Logical axes declared at the field, rules → PartitionSpecs, placement, and their errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import data_mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

import zoo


class TwoAxes(eqx.Module):
    w: Float[Array, "a b"] = zoo.field(axes=("embed", "mlp"))
    plain: Float[Array, " a"]  # no annotation: replicated


def test_field_axes_and_stacked_layers_axis(key):
    mlp = zoo.nn.MLP(4, 2, 8, 3, scan=True, norm="rmsnorm", key=key)
    axes = zoo.logical_axes(mlp)
    assert axes.input_block.linear.weight.names == ("embed", "mlp")
    assert axes.input_block.norm.weight.names == ("mlp",)
    assert axes.output_layer.weight.names == ("mlp", "embed")
    assert axes.output_layer.bias.names == ("embed",)
    # Stacked hidden layers gain a leading "layers" axis.
    assert axes.hidden.layers.linear.weight.names == ("layers", "mlp_in", "mlp")
    assert mlp.hidden.layers.linear.weight.shape == (2, 8, 8)
    assert axes.hidden.layers.norm.weight.names == ("layers", "mlp")


def test_unannotated_arrays_are_replicated():
    axes = zoo.logical_axes(TwoAxes(jnp.ones((2, 3)), jnp.ones(2)))
    assert axes.w.names == ("embed", "mlp")
    assert axes.plain.names == (None,)


def test_annotation_rank_mismatch_names_the_leaf():
    with pytest.raises(ValueError, match=r"model\.w has shape \(2, 3, 4\)"):
        zoo.logical_axes(TwoAxes(jnp.ones((2, 3, 4)), jnp.ones(2)))


def test_partition_specs_dp_and_custom_rules(key):
    mlp = zoo.nn.MLP(4, 2, 8, 2, key=key)
    specs = zoo.partition_specs(mlp, zoo.rules("dp"))
    assert all(s == P(*([None] * len(s))) for s in jax.tree.leaves(specs))
    specs = zoo.partition_specs(mlp, zoo.rules("dp", mlp="data"))
    assert specs.input_block.linear.weight == P(None, "data")
    assert specs.output_layer.weight == P("data", None)


def test_rules_preset_is_a_plain_editable_copy():
    r = zoo.rules("dp")
    assert isinstance(r, dict) and r["batch"] == "data"
    r["embed"] = "data"
    assert zoo.rules("dp")["embed"] is None
    with pytest.raises(ValueError, match="unknown rules preset 'nope'"):
        zoo.rules("nope")


def test_unknown_logical_axis_error_names_leaf_and_fix():
    model = TwoAxes(jnp.ones((2, 3)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"model\.w: logical axis 'mlp' has no sharding rule.*rules\['mlp'\] = None"):
        zoo.partition_specs(model, {"embed": None})


def test_missing_mesh_axis_error():
    model = TwoAxes(jnp.ones((2, 8)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"model\.w: rules map logical axis 'mlp' to mesh axes \['model'\]"):
        zoo.partition_specs(model, {"embed": None, "mlp": "model"}, data_mesh(2))


def test_not_divisible_error():
    model = TwoAxes(jnp.ones((2, 6)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"model\.w: dimension 1 \('mlp'\) has size 6.*size 4"):
        zoo.partition_specs(model, {"embed": None, "mlp": "data"}, data_mesh(4))


def test_mesh_axis_used_twice_error():
    model = TwoAxes(jnp.ones((4, 4)), jnp.ones(2))
    with pytest.raises(ValueError, match="mesh axis 'data' is used by logical axes 'embed' and 'mlp'"):
        zoo.partition_specs(model, {"embed": "data", "mlp": "data"})


def test_shard_places_every_leaf(key):
    mesh = data_mesh(4)
    mlp = zoo.nn.MLP(4, 2, 8, 2, key=key)
    placed = zoo.shard(mlp, zoo.rules("dp", mlp="data"), mesh)
    w = placed.input_block.linear.weight
    assert w.sharding.spec == P(None, "data")
    assert w.sharding.mesh.shape == mesh.shape
    assert len(w.addressable_shards) == 4 and w.addressable_shards[0].data.shape == (4, 2)
    assert placed.output_layer.bias.sharding.spec == P(None)
    assert jnp.array_equal(w, mlp.input_block.linear.weight)


def test_shard_without_mesh_is_a_clear_error(key):
    with pytest.raises(ValueError, match="no mesh to place the model on"):
        zoo.shard(zoo.nn.MLP(2, 2, 2, 1, key=key), zoo.rules("dp"))
