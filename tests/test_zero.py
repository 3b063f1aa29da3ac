"""ZeRO-1 (`TrainStep(shard_optimizer=True)`, the "zero1" preset): the optimizer state lives
split over `data`; the step reduce-scatters the gradients into it, updates the shards and
all-gathers the parameters once. Same numbers as the unsharded step, 1/N of the state per
device, no collective inside the microbatch loop.

Each case compiles the unsharded and the sharded step once (module cache) and runs three
adamw steps with global-norm clipping; every test reads those programs and results.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import (
    UNIT_ROUNDOFF,
    data_mesh,
    largest,
    lm_batch,
    max_abs_diff,
    on_host,
    rounding_bound,
    tiny_decoder,
    tree_bytes,
)
from jax.sharding import PartitionSpec as P

import zoo
from zoo.lora import LoraConfig, add_lora, trainable

BATCH = 24
STEPS = 3
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"))

# case → (devices N, microbatches M, LoRA?, mode of the sharded step)
CASES = {
    "N4-M2": (4, 2, False, "explicit"),
    "N8-M3": (8, 3, False, "explicit"),
    "lora-N4-M3": (4, 3, True, "explicit"),
    "shard_map-N8-M3": (8, 3, False, "shard_map"),
}


CLIP, LR, DECAY, MOMENTUM = 0.05, 1e-2, 0.1, 0.9


def optimizer():
    """Clipping (the update depends on the global norm over all the sharded gradients),
    weight decay, momentum (a state split like adam's moments) and a schedule (a count).

    Linear in the gradients on purpose: a rounding difference in a gradient moves the
    parameters by lr times as much. adamw's m/(sqrt(v)+eps) turns a difference in a
    near-zero gradient (|g| ~ eps) into one of order lr, which no float32 bound covers
    (docs/claims.md, "Numeric tolerances"); adamw's two moments are split in
    test_without_global_norm_the_gradients_reduce_in_one_collective.
    """
    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.add_decayed_weights(DECAY),
        optax.sgd(optax.constant_schedule(LR), momentum=MOMENTUM),
    )


@functools.cache
def model_and_filter(lora: bool):
    model = tiny_decoder(jax.random.key(0))
    if not lora:
        return model, eqx.is_inexact_array
    model = add_lora(model, LORA, key=jax.random.key(1))
    return model, trainable(model, LORA)


@functools.cache
def host_batch():
    return on_host(lm_batch(jax.random.key(2), BATCH))


@functools.cache
def run(n, m, lora, mode, shard_optimizer, opt=optimizer):
    """Three compiled steps: (model, opt state, losses, collectives, memory, trainable params)."""
    model, filter_spec = model_and_filter(lora)
    batch = host_batch()
    mesh = data_mesh(n)
    with jax.set_mesh(mesh):
        # From the host: placing it compiles no slicing program per layout (helpers.on_host).
        sharded = zoo.shard(on_host(model), zoo.rules("zero1" if shard_optimizer else "dp"), mesh)
        step = zoo.TrainStep(
            zoo.models.next_token_loss,
            opt(),
            microbatches=m,
            trainable=filter_spec,
            mode=mode,
            shard_optimizer=shard_optimizer,
        )
        state = step.init(sharded)
        compiled = step.compile(sharded, state, batch)
        memory = compiled.memory_analysis()
        new, losses = sharded, []
        for _ in range(STEPS):
            new, state, loss = compiled(new, state, batch)
            losses.append(float(loss))
        colls = zoo.collectives(compiled, mesh=mesh)
    return new, state, losses, colls, memory, step.partition(sharded)[0]


def pair(case):
    n, m, lora, mode = CASES[case]
    return run(n, m, lora, "explicit", False), run(n, m, lora, mode, True)


def expected_split(shape, n):
    """The documented rule: the first dimension N divides (nothing else is sharded here)."""
    for dim, size in enumerate(shape):
        if size % n == 0:
            return P(*([None] * dim), "data", *([None] * (len(shape) - dim - 1)))
    return P(*([None] * len(shape)))


def momentum(state):
    """The momentum of the sgd part of the chain, and its schedule's count."""
    trace, schedule = state[2]
    return trace.trace, schedule.count


def per_device_bytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# A gradient differs from the unsharded one by float32 rounding in another order: a mean
# over the batch's tokens (at most 24 x 8 terms) of sums through 2 layers forward and back
# (~12 chained sums each, plus embedding and head), each clipped gradient at most CLIP.
GRADIENT_ERROR = rounding_bound(CLIP, terms=BATCH * 8, depth=2 * 2 * 12 + 4)


@pytest.mark.numerics
@pytest.mark.parametrize("case", CASES)
def test_results_equal_the_unsharded_step(case):
    (ref_model, ref_state, ref_losses, *_), (model, state, losses, *_) = pair(case)
    # The loss: a sum over the batch's tokens of terms of order its value.
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= rounding_bound(abs(b), terms=BATCH * 8, depth=2 * 12 + 2), (losses, ref_losses)
    # Momentum after step t is a sum of t gradients (weights <= 1): off by <= t x the
    # gradient error; the parameters take lr x the momentum each step (1 + 2 + 3 = 6 x lr
    # x the gradient error in all), plus 2 roundings of the parameter a step.
    for (path, want), got in zip(
        jax.tree.leaves_with_path(eqx.filter(ref_model, eqx.is_array)), jax.tree.leaves(eqx.filter(model, eqx.is_array))
    ):
        bound = 6 * LR * GRADIENT_ERROR + 2 * STEPS * UNIT_ROUNDOFF * largest(want)
        assert largest(np.asarray(got) - np.asarray(want)) <= bound, (jax.tree_util.keystr(path), bound)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        assert largest(np.asarray(got, np.float64) - np.asarray(want)) <= STEPS * GRADIENT_ERROR
    assert losses[-1] < losses[0]
    # The parameters moved (so equality is not vacuous) and came back in their own layout.
    start = model_and_filter(CASES[case][2])[0]
    assert max_abs_diff(model, start) > 1e-4
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        assert leaf.sharding.spec == P(*([None] * leaf.ndim))


@pytest.mark.parametrize("case", CASES)
def test_optimizer_state_is_split_over_data(case):
    n = CASES[case][0]
    (_, ref_state, *_), (_, state, _, _, _, params) = pair(case)
    trace, count = momentum(state)
    dims_used = set()
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(trace), strict=True):
        want = expected_split(p.shape, n)
        assert a.sharding.spec == want, (p.shape, a.sharding.spec, want)
        assert a.addressable_shards[0].data.size == a.size // n
        dims_used.add(list(want).index("data"))
    if not CASES[case][2]:  # the embedding splits its dim 0, stacked [layers=2, ...] leaves dim 1
        assert dims_used == {0, 1}
    assert count.sharding.spec == P() and momentum(ref_state)[1].sharding.spec == P()
    for leaf in jax.tree.leaves(ref_state):  # the unsharded step keeps everything replicated
        assert leaf.sharding.spec == P(*([None] * leaf.ndim))


def test_split_spec_rule():
    with jax.set_mesh(data_mesh(4)):
        assert zoo.internal.split_spec(jnp.zeros((2, 8, 4))) == P(None, "data", None)
        assert zoo.internal.split_spec(jnp.zeros((3, 5))) == P(None, None)  # nothing divides: replicated
        assert zoo.internal.split_spec(jnp.zeros(())) == P()  # scalars (counts) stay replicated
        fsdp = jax.device_put(jnp.zeros((8, 8)), P(None, "data"))
        assert zoo.internal.split_spec(fsdp) == P(None, "data")  # already 1/N: kept
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        tp = jax.device_put(jnp.zeros((4, 6)), P("model", None))
        assert zoo.internal.split_spec(tp) == P("model", "data")  # a dimension split over `model` is skipped


@pytest.mark.parametrize("case", CASES)
def test_collectives_all_outside_loops(case):
    """In the loop: nothing. After it: the gradient reduction(s) into the shards, a scalar
    all-reduce for the global norm, and one all-gather per split parameter."""
    n = CASES[case][0]
    (*_, ref_colls, _, _), (*_, colls, _, params) = pair(case)
    print(zoo.report(colls))
    assert not [c for c in colls if c.in_loop], zoo.report(colls)
    assert all(c.mesh_axes == ("data",) and c.group_size == n for c in colls), zoo.report(colls)
    assert {c.kind for c in colls} <= {"all-reduce", "reduce-scatter", "all-gather"}
    # One all-gather per trainable leaf (each split, see the state test), carrying exactly
    # the full updated parameters: gathered once, not per microbatch.
    gathers = [c for c in colls if c.kind == "all-gather"]
    assert len(gathers) == len(jax.tree.leaves(params))
    assert sum(c.bytes for c in gathers) == tree_bytes(params)
    # The reductions carry every gradient once (the CPU backend's reduce-scatter is an
    # all-reduce of the full leaf + a local dynamic-slice), plus 4-byte scalars: loss sum,
    # token count, and one sum-of-squares partial per leaf for clip_by_global_norm.
    reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    scalars = sum(c.bytes for c in reductions) - tree_bytes(params)
    assert scalars == 4 * (2 + len(jax.tree.leaves(params))), zoo.report(colls)
    # XLA's CPU all-reduce combiner pairs each leaf's gradient reduction with another
    # leaf's norm partial, so there are at most one reduction per leaf plus one.
    assert 1 <= len(reductions) <= len(jax.tree.leaves(params)) + 1
    # The unsharded step: one all-reduce, no gathers.
    assert [c.kind for c in ref_colls] == ["all-reduce"]


def test_without_global_norm_the_gradients_reduce_in_one_collective():
    """adamw alone: the whole accumulator (gradients + loss + token count) is reduced into
    the split layout by ONE collective, and the parameters come back by all-gathers; both
    of adam's moments are split like the parameters, its count replicated."""
    _, state, _, colls, _, params = run(4, 2, False, "explicit", True, opt=lambda: optax.adamw(1e-2))
    adam = state[0]
    for p, mu, nu in zip(jax.tree.leaves(params), jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), strict=True):
        assert mu.sharding.spec == nu.sharding.spec == expected_split(p.shape, 4), (p.shape, mu.sharding.spec)
    assert adam.count.sharding.spec == P()
    print(zoo.report(colls))
    assert not [c for c in colls if c.in_loop]
    (reduction,) = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    assert reduction.bytes in (tree_bytes(params) + 8, tree_bytes(params) // 4 + 8)
    assert zoo.count(colls, "all-gather") == len(jax.tree.leaves(params))


@pytest.mark.parametrize("case", CASES)
def test_optimizer_state_memory_falls_n_fold(case):
    n = CASES[case][0]
    (_, ref_state, _, _, ref_memory, _), (_, state, _, _, memory, _) = pair(case)
    count = momentum(state)[1]
    full = tree_bytes(ref_state)
    replicated = tree_bytes(count) + tree_bytes(momentum(ref_state)[1])  # the counts
    per_device = per_device_bytes(state)
    print(f"{case}: optimizer state {full} B unsharded, {per_device} B per device sharded")
    assert per_device_bytes(ref_state) == full
    assert per_device <= 1.2 * full / n + replicated
    # The compiled program agrees: its per-device argument bytes shrink by the state's
    # (N-1)/N (the parameters and the batch are the same in both programs).
    saved = ref_memory.argument_size_in_bytes - memory.argument_size_in_bytes
    print(f"{case}: arguments {ref_memory.argument_size_in_bytes} -> {memory.argument_size_in_bytes} B")
    assert saved == full - per_device
    assert ref_memory.output_size_in_bytes - memory.output_size_in_bytes == full - per_device


def test_preset_and_no_op_settings():
    assert zoo.preset("zero1").step_options == {"shard_optimizer": True}
    assert zoo.rules("zero1") == zoo.rules("dp")
    model, _ = model_and_filter(False)
    step = zoo.TrainStep(zoo.models.next_token_loss, optimizer(), shard_optimizer=True)
    # Without a mesh (or with one data shard) there is nothing to split: plain optax state.
    for leaf, ref in zip(
        jax.tree.leaves(step.init(model)), jax.tree.leaves(eqx.filter_jit(optimizer().init)(step.partition(model)[0]))
    ):
        np.testing.assert_array_equal(leaf, ref)
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match="shard_optimizer"):
        zoo.TrainStep(zoo.models.next_token_loss, optimizer(), shard_optimizer="data")
