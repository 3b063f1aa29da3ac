"""Transformer models × sharding presets × step modes: single-device results, and where
every collective of the compiled step sits.

Each (model, preset, mode) compiles one step, at a (devices N, microbatches M) setting
chosen so that every model meets N ∈ {2, 4, 8} and M ∈ {1, 3}; the same compiled program
is run (results) and read (collectives).
"""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import (
    classification_batch,
    lm_batch,
    max_abs_diff,
    preset_mesh,
    tiny_decoder,
    tiny_encoder_classifier,
    tree_allclose,
    tree_bytes,
)

import zoo

BATCH = 24  # divisible by every N × M below
LR = 0.5

MODELS = {
    "decoder": (tiny_decoder, lm_batch, zoo.models.next_token_loss),
    "encoder": (tiny_encoder_classifier, classification_batch, zoo.models.classification_loss),
}

# (preset, mode) pairs that apply: shard_map mode needs parameters replicated off `data`
# inside the loop, which dp and fsdp-once (gathered once, before the loop) provide.
PRESET_MODES = [
    ("dp", "explicit"),
    ("dp", "shard_map"),
    ("fsdp", "explicit"),
    ("fsdp-once", "explicit"),
    ("fsdp-once", "shard_map"),
    ("tp", "explicit"),
    ("fsdp+tp", "explicit"),
    ("zero1", "explicit"),
]
# (devices N, microbatches M): each case takes the next one, so every model meets every
# N ∈ {2, 4, 8} and M ∈ {1, 3}, and every preset runs at M = 3 for one of the models.
SETTINGS = [(8, 3), (2, 1), (4, 3), (8, 1), (2, 3), (4, 1)]


def cases():
    for m_index, model in enumerate(MODELS):
        for p_index, (preset, mode) in enumerate(PRESET_MODES):
            n, m = SETTINGS[(p_index + 2 * m_index) % len(SETTINGS)]
            yield pytest.param(model, preset, mode, n, m, id=f"{model}-{preset}-{mode}-N{n}-M{m}")


@functools.cache
def reference(model_name):
    """The judge: plain jax on one device, whole batch, then one SGD update."""
    make_model, make_batch, loss_fn = MODELS[model_name]
    model = make_model(jax.random.key(0))
    batch = make_batch(jax.random.key(1), BATCH)

    def mean_loss(m):
        out = loss_fn(m, batch)
        return out[0].sum() / out[1].sum() if isinstance(out, tuple) else out.mean()

    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(model)
    updated = jax.tree.map(lambda p, g: p - LR * g, model, grads)
    return model, batch, loss, updated


@functools.cache
def run(model_name, preset, mode, n, m):
    """One compiled step: (updated model, loss, its collectives, trainable params, mesh)."""
    model, batch, _, _ = reference(model_name)
    loss_fn = MODELS[model_name][2]
    mesh = preset_mesh(preset, n)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(loss_fn, optax.sgd(LR), microbatches=m, mode=mode, **zoo.step_options(preset))
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)
        new_model, _, loss = compiled(sharded, opt_state, batch)
        colls = zoo.collectives(compiled, mesh=mesh)
    return new_model, loss, colls, step.partition(sharded)[0], mesh


@pytest.mark.parametrize("model_name, preset, mode, n, m", list(cases()))
def test_update_equals_single_device(model_name, preset, mode, n, m):
    _, _, ref_loss, ref_updated = reference(model_name)
    new_model, loss, *_ = run(model_name, preset, mode, n, m)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # SGD: new = old - lr * grads, so equal updates mean equal gradients.
    assert tree_allclose(new_model, ref_updated, rtol=1e-5, atol=1e-6), max_abs_diff(new_model, ref_updated)


@pytest.mark.parametrize("model_name, preset, mode, n, m", list(cases()))
def test_collectives_sit_where_the_preset_says(model_name, preset, mode, n, m):
    _, _, colls, trainable, mesh = run(model_name, preset, mode, n, m)
    print(zoo.report(colls))
    in_loop = [c for c in colls if c.in_loop]
    outside = [c for c in colls if not c.in_loop]
    grad_reductions = [c for c in outside if c.kind in ("all-reduce", "reduce-scatter") and "data" in c.mesh_axes]
    if preset == "dp":
        # The promise: one all-reduce, outside loops, carrying the gradients and loss sums.
        assert len(colls) == 1 and colls[0].kind == "all-reduce" and not colls[0].in_loop, zoo.report(colls)
        scalars = colls[0].bytes - tree_bytes(trainable)
        assert scalars in (4, 8), zoo.report(colls)  # loss sum (+ token count)
    elif preset == "fsdp-once":
        # Gathered once before the loop, gradients reduced (scattered) once after it.
        assert not in_loop, zoo.report(colls)
        assert {c.kind for c in outside} <= {"all-gather", "all-reduce", "reduce-scatter"}
        assert zoo.count(colls, "all-gather") >= 1
        assert len(grad_reductions) == 1, zoo.report(colls)
    elif preset == "fsdp":
        # The standard trade-off: gathers per use and gradient reduce-scatters in the loop,
        # all over `data`; nothing else.
        assert in_loop and all(c.mesh_axes == ("data",) for c in colls), zoo.report(colls)
        assert zoo.count(colls, "all-gather", in_loop=True) >= 1
        # Outside the loop, one reduction for the leaves not split over `data` (and the loss).
        assert len(grad_reductions) == 1, zoo.report(colls)
    elif preset == "tp":
        # In the loop only tensor parallelism's own collectives over `model`; the gradient
        # reduction over `data` happens once, outside.
        assert all(c.mesh_axes == ("model",) for c in in_loop), zoo.report(colls)
        data_colls = [c for c in colls if "data" in c.mesh_axes]
        if mesh.shape["data"] == 1:
            assert not data_colls  # one data shard: nothing to reduce
        else:
            assert len(data_colls) == 1 and data_colls[0].kind == "all-reduce" and not data_colls[0].in_loop
    elif preset == "zero1":
        # ZeRO-1: one reduction of the accumulator into the split layout after the loop
        # (reduce-scatter; all-reduce + dynamic-slice on CPU), one all-gather per split
        # parameter after the update; nothing in the loop.
        assert not in_loop and {c.kind for c in outside} <= {"all-gather", "all-reduce", "reduce-scatter"}
        assert len(grad_reductions) == 1, zoo.report(colls)
        split = [x for x in jax.tree.leaves(trainable) if "data" in zoo.internal.split_spec(x, "data", mesh.shape["data"])]
        assert zoo.count(colls, "all-gather") == len(split) >= 1, zoo.report(colls)
    elif preset == "fsdp+tp":
        # Per-use FSDP over `data` plus tensor parallelism over `model`: no collective mixes
        # them, in-loop data traffic is FSDP's own (gathers and reductions), one reduction
        # outside for the unsplit leaves.
        assert all(c.mesh_axes in (("data",), ("model",)) for c in colls), zoo.report(colls)
        if mesh.shape["data"] > 1:
            assert zoo.count([c for c in in_loop if c.mesh_axes == ("data",)], "all-gather") >= 1
            assert len(grad_reductions) == 1, zoo.report(colls)


def test_fsdp_once_holds_full_copy_only_for_the_step():
    """fsdp-once keeps parameters and optimizer state split at rest: after a step every
    leaf is still sharded over `data` along its embed axis."""
    model, batch, _, _ = reference("decoder")
    mesh = preset_mesh("fsdp-once", 4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("fsdp-once"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.adam(1e-3), microbatches=3, gather="once")
        new_model, opt_state, _ = step(sharded, step.init(sharded), batch)
    specs = zoo.partition_specs(model, zoo.rules("fsdp-once"))
    for leaf, spec in zip(jax.tree.leaves(eqx.filter(new_model, eqx.is_array)), jax.tree.leaves(specs)):
        assert leaf.sharding.spec == spec
    mu = opt_state[0].mu
    assert mu.token_embedding.weight.sharding.spec == specs.token_embedding.weight


def test_bf16_compute_keeps_the_gradient_all_reduce_in_float32():
    """Mixed precision: activations in bfloat16, but the one all-reduce carries float32
    gradients (its bytes are the float32 parameter bytes plus the two loss scalars)."""
    model = tiny_decoder(jax.random.key(0), dtype="bfloat16")
    batch = lm_batch(jax.random.key(1), 8)
    mesh = preset_mesh("dp", 4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1), microbatches=2)
        compiled = step.compile(sharded, step.init(sharded), batch)
        new_model, _, loss = compiled(sharded, step.init(sharded), batch)
    colls = zoo.collectives(compiled, mesh=mesh)
    assert len(colls) == 1 and not colls[0].in_loop
    assert colls[0].bytes == tree_bytes(model) + 8
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(eqx.filter(new_model, eqx.is_array)))
    assert np.isfinite(loss)
