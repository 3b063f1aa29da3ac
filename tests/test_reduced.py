"""The filtered transforms on their own: types in, types out."""

import jax
import jax.numpy as jnp
from helpers import data_mesh
from jax.sharding import PartitionSpec as P

import zoo


def test_reduced_cast_unreduced_zeros_and_reduce_follow_the_filter():
    mesh = data_mesh(4)
    with jax.set_mesh(mesh):
        tree = {
            "replicated": jax.device_put(jnp.ones((4, 2)), P()),
            "data_sharded": jax.device_put(jnp.ones((8, 2)), P("data", None)),  # FSDP-style layout
            "ints": jax.device_put(jnp.ones(3, jnp.int32), P()),
        }
        cast = zoo.internal.reduced_cast(tree)
        assert jax.typeof(cast["replicated"]).sharding.spec.reduced == {"data"}
        # A leaf split over the data axis cannot be reduced over it: left as it is.
        assert jax.typeof(cast["data_sharded"]).sharding.spec == P("data", None)
        assert not jax.typeof(cast["ints"]).sharding.spec.reduced  # not selected by the default filter
        zeros = zoo.internal.unreduced_zeros(tree)
        assert zeros["ints"] is None
        assert jax.typeof(zeros["replicated"]).sharding.spec.unreduced == {"data"}
        assert not jax.typeof(zeros["data_sharded"]).sharding.spec.unreduced
        reduced = zoo.internal.reduce_unreduced({k: v for k, v in zeros.items() if v is not None})
        assert jax.typeof(reduced["replicated"]).sharding.spec == P(None, None)
        assert jax.typeof(reduced["data_sharded"]).sharding.spec == P("data", None)
        specs = zoo.internal.manual_specs({"w": tree["replicated"]}, state="unreduced")
        assert specs["w"] == P(None, None, unreduced={"data"})
