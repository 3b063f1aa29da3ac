"""The promise, read off the compiled program: one gradient all-reduce, outside every loop.

Each test compiles a real training step and counts collectives with zoo's inspector; the
negative controls prove the inspector sees what it must catch.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    TokenRegressor,
    assert_tree_rounding_close,
    data_mesh,
    mse_per_example,
    on_host,
    pairwise,
    token_batch,
    tree_bytes,
)
from jax.sharding import PartitionSpec as P

import zoo

N, M = 8, 4


@functools.cache
def compiled_step_collectives(norm, scan, mode, trainable="all"):
    """Collectives of the compiled zoo step (cached: several tests read the same program)."""
    # On the host: placing them compiles nothing (helpers.on_host).
    model = on_host(TokenRegressor(norm=norm, scan=scan, key=jax.random.key(0)))
    filter_spec = eqx.is_inexact_array
    if trainable == "output_layer":
        filter_spec = jax.tree.map(lambda _: False, model)
        filter_spec = eqx.tree_at(
            lambda m: m.mlp.output_layer, filter_spec, replace_fn=lambda l: jax.tree.map(lambda _: True, l)
        )
    mesh = data_mesh(N)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.adamw(1e-3), microbatches=M, mode=mode, trainable=filter_spec)
        batch = on_host(token_batch(jax.random.key(1), 64))
        colls = zoo.collectives(step.lower(sharded, step.init(sharded), batch))
        trainable_bytes = tree_bytes(step.partition(sharded)[0])
    return colls, trainable_bytes


# Every pair of two settings once (4 programs, not the product's 8): each norm scanned and
# unrolled, each in either mode. tests/test_presets.py pins every preset's step whole.
CASES = pairwise(norm=("layernorm", "rmsnorm"), scan=(True, False), mode=("explicit", "shard_map"))


@pytest.mark.parametrize("norm, scan, mode", CASES, ids=[f"{n}-{'scan' if s else 'unrolled'}-{m}" for n, s, m in CASES])
def test_exactly_one_all_reduce_outside_loops_and_nothing_else(norm, scan, mode):
    colls, trainable_bytes = compiled_step_collectives(norm, scan, mode)
    print(zoo.report(colls))
    assert zoo.count(colls, "all-reduce", in_loop=True) == 0
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1
    # Nothing else moves: no all-to-all / permute from the microbatch split, no gathers.
    assert len(colls) == 1, zoo.report(colls)
    (reduce,) = colls
    assert reduce.mesh_axes == ("data",) and reduce.group_size == N
    # It carries the gradients and the loss scalar, nothing more.
    assert reduce.bytes == trainable_bytes + 4


def test_frozen_leaves_add_no_communication():
    colls, trainable_bytes = compiled_step_collectives("layernorm", True, "explicit", trainable="output_layer")
    all_colls, all_bytes = compiled_step_collectives("layernorm", True, "explicit")
    assert [c.kind for c in colls] == ["all-reduce"] and not colls[0].in_loop
    assert colls[0].bytes == trainable_bytes + 4
    assert trainable_bytes < all_bytes / 10


def grads_step(model, batch, *, reduced: bool, naive_split: bool = False):
    """A hand-written accumulation step for the controls (loss summed per microbatch)."""
    params = zoo.internal.reduced_cast(model) if reduced else model
    if naive_split:  # the trap: microbatch m's rows end up on few devices
        micro = jax.tree.map(
            lambda x: x.reshape(
                M, x.shape[0] // M, *x.shape[1:], out_sharding=P(None, "data", *([None] * (x.ndim - 1)))
            ),
            batch,
        )
    else:
        micro = zoo.internal.split_microbatches(batch, M, N, ("data",))

    def body(acc, mb):
        grads = jax.grad(lambda m: jnp.sum(mse_per_example(m, mb)))(params)
        return jax.tree.map(jnp.add, acc, grads), None

    acc = (
        zoo.internal.unreduced_zeros(model)
        if reduced
        else jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
    )
    acc, _ = jax.lax.scan(body, acc, micro)
    return zoo.internal.reduce_unreduced(acc) if reduced else acc


def control_collectives(**kwargs):
    mesh = data_mesh(N)
    with jax.set_mesh(mesh):
        model = zoo.shard(on_host(TokenRegressor(key=jax.random.key(0))), zoo.rules("dp"), mesh)
        batch = jax.device_put(on_host(token_batch(jax.random.key(1), 64)), P("data"))
        fn = eqx.filter_jit(functools.partial(grads_step, **kwargs))
        return zoo.collectives(fn, model, batch)


def test_negative_control_replicated_params_reduce_inside_the_loop():
    colls = control_collectives(reduced=False)
    assert zoo.count(colls, "all-reduce", in_loop=True) >= 1, zoo.report(colls)
    assert all(c.mesh_axes == ("data",) for c in colls if c.kind == "all-reduce")
    # The same hand-written step with the reduced cast: back to one, outside.
    fixed = control_collectives(reduced=True)
    assert zoo.count(fixed, "all-reduce", in_loop=True) == 0
    assert zoo.count(fixed, "all-reduce", in_loop=False) == 1


def test_negative_control_naive_microbatch_split_moves_data():
    colls = control_collectives(reduced=True, naive_split=True)
    moves = [c for c in colls if c.kind != "all-reduce"]
    assert moves, "a naive reshape split should compile to data movement the inspector sees"
    assert {c.kind for c in moves} & {"all-to-all", "collective-permute", "all-gather"}


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_two_dimensional_mesh_reduces_over_data_only(mode):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    # On the host: placing them compiles nothing (helpers.on_host).
    batch = on_host(token_batch(jax.random.key(1), 32))
    host_model = on_host(TokenRegressor(key=jax.random.key(0)))
    with jax.set_mesh(mesh):
        model = zoo.shard(host_model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=2, mode=mode)
        colls = zoo.collectives(step.lower(model, step.init(model), batch))
        _, grads = step.loss_and_grads(model, batch)
    ref = eqx.filter_jit(jax.grad(lambda m, b: mse_per_example(m, b).mean()))(host_model, batch)
    # The same sums in another order: the longest the batch's 32 examples; TokenRegressor's
    # forward ~10 chained sums (a token mean, 3 layers of a matmul and a norm's 2), gradients
    # twice that plus the batch sum (helpers.rounding_bound).
    assert_tree_rounding_close(grads, ref, terms=32, depth=2 * 10 + 1)
    reduces = [c for c in colls if c.kind == "all-reduce"]
    assert len(reduces) == 1 and not reduces[0].in_loop
    assert reduces[0].mesh_axes == ("data",) and reduces[0].group_size == 4


# --- the parser on hand-written HLO (formats the CPU backend does not always emit) ---

MODULE_WITH_ADD = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

NESTED_HLO = (
    MODULE_WITH_ADD
    + """
%inner_body (p: (s32[], f32[4,2])) -> (s32[], f32[4,2]) {
  %p = (s32[], f32[4,2]) parameter(0)
  %g = f32[4,2] get-tuple-element(%p), index=1
  %ar = f32[4,2] all-reduce(%g), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add, metadata={op_name="inner/dot_general"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,2]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,2])) -> pred[] {
  %p = (s32[], f32[4,2]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%helper (x: (s32[], f32[4,2])) -> (s32[], f32[4,2]) {
  %x = (s32[], f32[4,2]) parameter(0)
  ROOT %w = (s32[], f32[4,2]) while(%x), condition=%cond, body=%inner_body
}

ENTRY %main (x: (s32[], f32[4,2]), y: bf16[8]) -> bf16[16] {
  %x = (s32[], f32[4,2]) parameter(0)
  %y = bf16[8] parameter(1)
  %c = (s32[], f32[4,2]) call(%x), to_apply=%helper
  %z = f32[2] constant({1, 2})
  %ar2 = f32[2] all-reduce(%z), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="named"}
  %ag = bf16[16] all-gather(%y), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="gather"}
  ROOT %cp = bf16[16] collective-permute(%ag), channel_id=3, source_target_pairs={{0,1},{1,0}}, metadata={op_name="permute"}
}
"""
)


def test_parser_nesting_iota_groups_bytes_and_axes():
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
    colls = zoo.collectives(NESTED_HLO, mesh=mesh)
    assert [(c.kind, c.in_loop) for c in colls] == [
        ("all-reduce", True),  # in a while body reached through a call
        ("all-reduce", False),
        ("all-gather", False),
        ("collective-permute", False),
    ]
    ar, named, ag, cp = colls
    assert named.mesh_axes == ("data",) and named.group_size == 4 and named.bytes == 8
    assert ar.bytes == 32 and ar.mesh_axes == ("data",) and ar.group_size == 4 and ar.op_name == "inner/dot_general"
    assert ag.bytes == 32 and ag.mesh_axes == ("model",) and ag.group_size == 2
    assert cp.mesh_axes == ("model",)
    assert "IN LOOP" in zoo.report(colls) and "1 inside loops, 1 outside" in zoo.report(colls)


BRANCHES_HLO = (
    MODULE_WITH_ADD
    + """
%reduce_it (r: f32[4]) -> f32[4] {
  %r = f32[4] parameter(0)
  ROOT %ar = f32[4] all-reduce(%r), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%keep_it (k: f32[4]) -> f32[4] {
  ROOT %k = f32[4] parameter(0)
}

%body (p: (pred[], f32[4])) -> (pred[], f32[4]) {
  %p = (pred[], f32[4]) parameter(0)
  %b = pred[] get-tuple-element(%p), index=0
  %v = f32[4] get-tuple-element(%p), index=1
  %c = f32[4] conditional(%b, %v, %v), true_computation=%reduce_it, false_computation=%keep_it
  ROOT %t = (pred[], f32[4]) tuple(%b, %c)
}

%cond (p: (pred[], f32[4])) -> pred[] {
  %p = (pred[], f32[4]) parameter(0)
  ROOT %b = pred[] get-tuple-element(%p), index=0
}

%pick (i: s32[], v: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %v = f32[4] parameter(1)
  ROOT %c = f32[4] conditional(%i, %v, %v), branch_computations={%reduce_it, %keep_it}
}

ENTRY %main (x: (pred[], f32[4]), i: s32[], v: f32[4]) -> f32[4] {
  %x = (pred[], f32[4]) parameter(0)
  %w = (pred[], f32[4]) while(%x), condition=%cond, body=%body
  %i = s32[] parameter(1)
  %v = f32[4] parameter(2)
  ROOT %once = f32[4] call(%i, %v), to_apply=%pick
}
"""
)


def test_parser_follows_conditionals_branches_into_and_out_of_loops():
    """A collective in a computation several ops name (a conditional's branch in a loop
    body, and an index conditional's branch outside it) is in a loop: one of its callers is."""
    (ar,) = zoo.collectives(BRANCHES_HLO)
    assert ar.kind == "all-reduce" and ar.in_loop and ar.group_size == 2
    outside = (
        BRANCHES_HLO.replace("body=%body", "body=%cond_body")
        .replace("%body (p", "%cond_body (p")
        .replace("true_computation=%reduce_it", "true_computation=%keep_it")
    )
    (ar,) = zoo.collectives(outside)
    assert not ar.in_loop  # reached only through `to_apply=%pick`'s `branch_computations`


def test_inspector_rejects_what_it_cannot_read():
    with pytest.raises(TypeError, match="jitted function with its arguments"):
        zoo.collectives(object())
    with pytest.raises(ValueError, match="outside the 4 devices"):
        zoo.collectives(NESTED_HLO, mesh=jax.sharding.AbstractMesh((2, 2), ("data", "model")))


# --- ground truth: programs that reduce over a known mesh axis, on every 2-D mesh ---

MESHES_2D = [((2, 2), ("data", "model")), ((2, 4), ("data", "model")), ((4, 2), ("data", "model")),
             ((2, 4), ("model", "data")), ((4, 2), ("model", "data"))]  # fmt: skip


def known_axis_programs(mesh, axis):
    """Compiled programs whose one collective is over `axis`: (kind, compiled) pairs."""
    n = mesh.devices.size
    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((2 * n, 3), np.float32), P(axis))  # from the host: no slicing program
        psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis), in_specs=P(axis), out_specs=P()))
        unreduced = jax.jit(lambda x: jax.reshard(jax.lax.reduce_sum(x, (0,), out_sharding=P(unreduced={axis})), P()))
        gather = jax.jit(lambda x: jax.reshard(x, P()))
        return [(kind, fn.lower(x).compile()) for kind, fn in
                [("all-reduce", psum), ("all-reduce", unreduced), ("all-gather", gather)]]  # fmt: skip


@pytest.mark.parametrize("shape, names", MESHES_2D, ids=[f"{n[0]}={s[0]},{n[1]}={s[1]}" for s, n in MESHES_2D])
@pytest.mark.parametrize("device_order", ["iota", "shuffled"])
def test_collectives_name_the_axis_they_reduce_over(shape, names, device_order):
    devices = np.array(jax.devices()[: math.prod(shape)])
    if device_order == "shuffled":
        devices = devices[np.random.default_rng(0).permutation(devices.size)]
    mesh = jax.sharding.Mesh(devices.reshape(shape), names, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    for axis in names:
        for kind, compiled in known_axis_programs(mesh, axis):
            expected = [(kind, (axis,), mesh.shape[axis])]
            inside = zoo.collectives(compiled)
            with jax.set_mesh(mesh):  # the mesh comes from the program, not the context
                outside = zoo.collectives(compiled)
            got = [(c.kind, c.mesh_axes, c.group_size) for c in inside]
            assert got == expected, (axis, compiled.as_text())
            assert [(c.kind, c.mesh_axes, c.group_size) for c in outside] == expected
            # HLO text (logical ids = positions in the mesh): named by the mesh passed, or not at all.
            text = zoo.collectives(compiled.as_text(), mesh=mesh)
            assert [(c.kind, c.mesh_axes, c.group_size) for c in text] == expected
            assert [(c.mesh_axes, c.group_size) for c in zoo.collectives(compiled.as_text())] == [
                ((), mesh.shape[axis])
            ]


def test_shard_map_collectives_over_several_axes_and_permutes():
    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def body(x):
        ring = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])
        both = jax.lax.psum(ring, ("model", "data"))
        gathered = jax.lax.all_gather(x, "model")
        moved = jax.lax.all_to_all(x.reshape(4, -1), "data", 0, 0, tiled=True)
        return both + gathered.sum() + moved.sum()

    x = jax.device_put(jnp.ones((64,)), jax.NamedSharding(mesh, P(("data", "model"))))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "model")), out_specs=P(("data", "model"))))
    got = sorted((c.kind, c.mesh_axes, c.group_size) for c in zoo.collectives(fn, x))
    assert got == [
        ("all-gather", ("model",), 2),
        ("all-reduce", ("data", "model"), 8),
        ("all-to-all", ("data",), 4),
        ("collective-permute", ("data",), 4),  # a ring over `data`: its devices form the groups
    ]


@functools.cache
def host_decoder():
    """The tiny decoder, built once on the host: placing it compiles nothing (helpers.on_host)."""
    from helpers import tiny_decoder

    return on_host(tiny_decoder(jax.random.key(0)))


def test_tensor_parallel_step_names_its_in_loop_reductions_outside_set_mesh():
    """The TP decoder step's in-loop embedding all-reduces print their groups as a named
    mesh (`replica_groups=mesh[...] {...}`); read with no mesh set, every op still names its
    axis."""
    from helpers import lm_batch

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        model = zoo.shard(host_decoder(), zoo.rules("tp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1), microbatches=2)
        compiled = step.compile(model, step.init(model), lm_batch(jax.random.key(1), 8))
        inside = zoo.collectives(compiled)
    assert "replica_groups=mesh[" in compiled.as_text()  # the format this test is about
    outside = zoo.collectives(compiled)
    assert outside == inside
    assert all(c.mesh_axes == ("model",) and c.group_size == 2 for c in outside if c.in_loop), zoo.report(outside)
    data = [c for c in outside if "data" in c.mesh_axes]
    assert [(c.kind, c.in_loop, c.mesh_axes, c.group_size) for c in data] == [("all-reduce", False, ("data",), 4)]
    assert all(c.mesh_axes for c in outside), zoo.report(outside)


@pytest.mark.parametrize("text", ["hello", "", "ENTRY %main () -> f32[] {\n}", "jit_step"])
def test_text_that_is_not_an_hlo_module_raises(text):
    with pytest.raises(ValueError, match="not an HLO module"):
        zoo.collectives(text)


# --- the parser on literal HLO lines of each replica-group form XLA prints ---

LINE = "  %x = f32[8]{0} all-reduce(%p), channel_id=1, GROUPS, use_global_device_ids=true, to_apply=%add"
MESH_42 = jax.sharding.AbstractMesh((4, 2), ("data", "model"))


@pytest.mark.parametrize(
    "groups, axes, size",
    [
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("data",), 4),
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("model",), 2),
        ("replica_groups={}", ("data", "model"), 8),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ("data",), 4),
        ("replica_groups=[4,2]<=[8]", ("model",), 2),
        ("replica_groups=[1,8]<=[8]", ("data", "model"), 8),
        # jax 0.10.2's named mesh: its own axis names, a size-1 filler axis, grouped axes.
        ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}", ("data",), 4),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}", ("model",), 2),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_1'}", ("data",), 2),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", ("data", "model"), 8),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {}", (), 1),
        # an explicit device list, and the unquoted names of newer XLA
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'a'}", ("model",), 2),
        ("replica_groups=mesh[a=8] {a}", ("data", "model"), 8),
        # sub-axes `name:(pre_size)size`: the major 2 of an 8-axis is `data`'s upper half
        ("replica_groups=mesh['a'=8] {'a':(1)2}", ("data",), 2),
        ("replica_groups=mesh['a'=8] {'a':(4)2}", ("model",), 2),
        ("replica_groups=mesh['a'=8] {'a':(2)4}", ("data", "model"), 4),
        ("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", ("data", "model"), 4),
    ],
)
def test_parser_reads_every_replica_group_form(groups, axes, size):
    text = f"HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n  %p = f32[8]{{0}} parameter(0)\n{LINE.replace('GROUPS', groups)}\n}}\n"
    (c,) = zoo.collectives(text, mesh=MESH_42)
    assert (c.kind, c.mesh_axes, c.group_size, c.bytes) == ("all-reduce", axes, size, 32)


def test_parser_groups_match_xla_semantics():
    from zoo._inspect import _parse_groups

    assert _parse_groups("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _parse_groups("replica_groups=mesh['a'=8] {'a':(1)2}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _parse_groups("replica_groups=mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'x'}", 4) == [[0, 1], [2, 3]]
    assert _parse_groups("replica_groups=mesh['x'=2,'y'=2] {'y','x'}", 4) == [[0, 2, 1, 3]]
    assert _parse_groups("source_target_pairs={{0,1},{1,0},{2,3},{3,2}}", 4) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_runtime_checks_add_no_communication_to_a_sharded_step(monkeypatch, mode):
    """ZOO_RUNTIME_CHECKS=1 checks token ids inside compiled code only where that needs no
    reduction across devices: a decoder's step split over `data` keeps its one all-reduce,
    outside the loop (checking its split ids there was an all-reduce per microbatch)."""
    monkeypatch.setenv("ZOO_RUNTIME_CHECKS", "1")  # read when the step is traced
    mesh = data_mesh(N)
    tokens = np.random.default_rng(0).integers(1, 32, (2 * N, 8)).astype(np.int32)
    with jax.set_mesh(mesh):
        model = zoo.shard(host_decoder(), zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1), microbatches=2, mode=mode)
        colls = zoo.collectives(step.lower(model, step.init(model), {"tokens": tokens}))
    assert zoo.count(colls, "all-reduce", in_loop=True) == 0, zoo.report(colls)
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1, zoo.report(colls)
    assert len(colls) == 1, zoo.report(colls)
