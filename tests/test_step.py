"""TrainStep: gradients and updates equal single-device ones for any N, M and mode."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import (
    UNIT_ROUNDOFF,
    TokenRegressor,
    assert_rounding_close,
    assert_tree_rounding_close,
    assert_within,
    data_mesh,
    largest,
    mse_per_example,
    on_host,
    pairwise,
    rounding_bound,
    token_batch,
)
from jax.sharding import AxisType

import zoo

BATCH = 64
# Sharded/microbatched vs one device: the same sums in another order (helpers.rounding_bound).
# The longest sum is the batch's 64 examples; TokenRegressor's forward is a mean over 5
# tokens and 3 layers of a matmul (<= 16 terms) and a norm's 2 sums (~10 chained sums), its
# gradients twice that, plus the sum over the batch.
SUMS = {"terms": BATCH, "depth": 2 * 10 + 1}


@pytest.fixture(scope="module")
def setup():
    key = jax.random.key(1)
    model = TokenRegressor(key=key)
    batch = token_batch(jax.random.key(2), BATCH)
    # The judge: plain jax on one device, full batch, no zoo machinery.
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: mse_per_example(m, batch).mean()))(model)
    return model, batch, loss, grads


# N x M x mode (shard_map: the same accumulation written per device) by pairwise cover
# (`helpers.pairwise`): every N meets every M, and each N and each M runs in both modes
# (12 compiled steps, not the 17 of explicit mode's full N x M plus 5 shard_map ones).
GRID = pairwise(n=(1, 2, 4, 8), m=(1, 2, 4), mode=("explicit", "shard_map"))


@pytest.mark.parametrize("n, m, mode", GRID)
def test_grads_and_update_equal_single_device(setup, n, m, mode):
    model, batch, ref_loss, ref_grads = setup
    lr = 0.1
    with jax.set_mesh(data_mesh(n)):
        sharded = zoo.shard(model, zoo.rules("dp"), data_mesh(n))
        step = zoo.TrainStep(mse_per_example, optax.sgd(lr), microbatches=m, mode=mode)
        new_model, _, loss = step(sharded, step.init(sharded), batch)
    assert_rounding_close(loss, ref_loss, **SUMS)
    # SGD: new = old - lr * grads, so the update pins down the gradients: lr x a gradient's
    # rounding, within that at the updated leaf's own scale (|lr * g| <= max|new| here).
    # In numpy: op by op, jax would compile each operation for each leaf shape.
    ref_new = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(lr) * np.asarray(g), model, ref_grads)
    assert_tree_rounding_close(new_model, ref_new, **SUMS)


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_loss_and_grads_equal_single_device(setup, mode):
    model, batch, ref_loss, ref_grads = setup
    with jax.set_mesh(data_mesh(8)):
        sharded = zoo.shard(model, zoo.rules("dp"), data_mesh(8))
        loss, grads = zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=4, mode=mode).loss_and_grads(
            sharded, batch
        )
    assert_rounding_close(loss, ref_loss, **SUMS)
    assert_tree_rounding_close(grads, eqx.filter(ref_grads, eqx.is_inexact_array), **SUMS)
    assert jax.typeof(grads.mlp.output_layer.weight).sharding.spec.unreduced == frozenset()


def test_no_mesh_runs_on_one_device_with_microbatches(setup):
    model, batch, ref_loss, ref_grads = setup
    loss, grads = zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=4).loss_and_grads(model, batch)
    assert_rounding_close(loss, ref_loss, **SUMS)
    assert_tree_rounding_close(grads, ref_grads, **SUMS)


LR, MOMENTUM, DECAY, CLIP = 1e-2, 0.9, 0.1, 0.05
OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.05, momentum=MOMENTUM),
    "adamw": lambda: optax.adamw(LR, weight_decay=DECAY),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR)),
}


def _gradient_errors(grads):
    """Per leaf, how far a gradient may move with its sums in another order (SUMS, at the
    leaf's largest |gradient|)."""
    return [rounding_bound(largest(g), **SUMS) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))]


def _adamw_step_bounds(params, grads, lr, clip):
    """Per element, how far one (clipped) AdamW step from `params` may land from another run
    whose gradients differ only by float32 rounding.

    The first step's update is lr * g / (|g| + eps) (m-hat = g, v-hat = g^2): a gradient
    error d moves it by at most lr * d / |g|, and by at most 2 lr where |g| is of order d
    (the update's sign flips: the amplification of near-zero gradients, tests/test_zero.py's
    linear_optimizer). Clipping scales every gradient by clip / ||g||, off by the relative
    error of the norm, rho. Plus the update's own roundings (m, v, bias corrections, sqrt,
    divide, decay: ~8, of |update| <= 1) and the parameter's rounding on each side.
    """
    g_leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    errors = _gradient_errors(grads)
    rho = 0.0
    if clip is not None:
        norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in g_leaves))
        if norm > clip:
            rho = np.sqrt(sum(np.size(g) * e**2 for g, e in zip(g_leaves, errors))) / norm + 4 * UNIT_ROUNDOFF
    bounds = []
    for p, g, e in zip(jax.tree.leaves(eqx.filter(params, eqx.is_array)), g_leaves, errors, strict=True):
        g = np.abs(np.asarray(g, np.float64))
        relative = np.minimum(2.0, np.divide(e, g, out=np.full_like(g, np.inf), where=g > 0) + rho)
        bounds.append(lr * (relative + 16 * UNIT_ROUNDOFF) + 2 * UNIT_ROUNDOFF * np.abs(np.asarray(p)))
    return bounds


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_any_optax_optimizer_matches_single_device(setup, name):
    """Optax's update on the sharded gradients and state equals optax on one device.

    SGD with momentum runs 3 steps (the state carries over), its update linear in the
    gradients: momentum after step t sums t gradients (weights <= 1), so the parameters
    after 3 steps are off by at most (1 + 1.9 + 2.71 < 6) x lr x a gradient's rounding,
    plus a rounding of the parameter a step (a parameter's difference feeds back into the
    next gradients only at second order). AdamW's m / (sqrt(v) + eps) turns a rounding
    difference in a near-zero gradient into one of order lr, and every later gradient then
    feels it: no float32 bound holds past its first step, so AdamW (with and without global
    clipping) is compared after one step, element by element (`_adamw_step_bounds`).
    """
    model, batch, _, _ = setup
    optimizer = OPTIMIZERS[name]()
    steps = 3 if name == "sgd-momentum" else 1

    # Reference: optax on one device, full batch.
    @eqx.filter_jit
    def ref_step(model, state):
        grads = jax.grad(lambda m: mse_per_example(m, batch).mean())(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, grads

    ref_model, ref_state = model, eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_inexact_array))
    ref_grads = []
    for _ in range(steps):
        ref_model, ref_state, grads = ref_step(ref_model, ref_state)
        ref_grads.append(grads)
    mesh = data_mesh(4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optimizer, microbatches=2)
        state = step.init(sharded)
        for _ in range(steps):
            sharded, state, _ = step(sharded, state, batch)
    got_leaves = jax.tree.leaves(eqx.filter(sharded, eqx.is_array))
    want_leaves = jax.tree.leaves(eqx.filter(ref_model, eqx.is_array))
    if name == "sgd-momentum":
        gradient_errors = np.max([_gradient_errors(g) for g in ref_grads], axis=0)
        for got, want, error in zip(got_leaves, want_leaves, gradient_errors, strict=True):
            assert_within(got, want, 6 * 0.05 * error + 2 * steps * UNIT_ROUNDOFF * largest(want), name)
    else:
        bounds = _adamw_step_bounds(model, ref_grads[0], LR, CLIP if name == "clip+adamw" else None)
        for got, want, bound in zip(got_leaves, want_leaves, bounds, strict=True):
            diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
            assert np.all(diff <= bound), f"{name}: {diff.max():.3g}, {np.max(diff / bound):.3g} x its bound"
    # Optimizer state stays plain (not reduced/unreduced) at rest.
    for leaf in jax.tree.leaves(state):
        spec = jax.typeof(leaf).sharding.spec
        assert not spec.reduced and not spec.unreduced


def only_output_layer(model):
    """A trainable filter (bool pytree) selecting the MLP's output layer only."""
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: m.mlp.output_layer, spec, replace_fn=lambda layer: jax.tree.map(lambda _: True, layer))


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_frozen_leaves_get_no_gradient_and_never_change(setup, mode):
    model, batch, _, ref_grads = setup
    mesh = data_mesh(4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(
            mse_per_example, optax.adam(1e-2), microbatches=2, trainable=only_output_layer(model), mode=mode
        )
        loss, grads = step.loss_and_grads(sharded, batch)
        state = step.init(sharded)
        new = sharded
        for _ in range(2):
            new, state, _ = step(new, state, batch)
    # Gradients exist for the output layer only, and match the full-model ones there.
    assert jax.tree.leaves((grads.embed, grads.mlp.input_block, grads.mlp.hidden)) == []
    assert_tree_rounding_close(grads.mlp.output_layer, ref_grads.mlp.output_layer, **SUMS)
    frozen_before = eqx.tree_at(lambda m: m.mlp.output_layer, model, None)
    frozen_after = eqx.tree_at(lambda m: m.mlp.output_layer, new, None)
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
        np.testing.assert_array_equal(a, b)  # bit for bit
    assert not np.allclose(new.mlp.output_layer.weight, model.mlp.output_layer.weight)


def test_frozen_leaves_come_back_as_the_same_arrays_without_a_copy(setup):
    """A frozen leaf is no output of the compiled step (XLA would copy it every step): the
    step hands back the caller's own array, through `__call__` and through `compile`."""
    model, batch, _, _ = setup
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.adam(1e-2), trainable=only_output_layer(model))
        state = step.init(sharded)
        compiled = step.compile(sharded, state, batch)
        outputs = [step(sharded, state, batch), compiled(sharded, state, batch)]
    frozen = jax.tree.leaves(eqx.tree_at(lambda m: m.mlp.output_layer, sharded, None))
    for new, _, _ in outputs:
        assert all(
            a is b
            for a, b in zip(jax.tree.leaves(eqx.tree_at(lambda m: m.mlp.output_layer, new, None)), frozen, strict=True)
        )
    # The program's outputs are the trainable leaves, the optimizer state and the loss only
    # (plus XLA's table of 8-byte pointers to them), none of the frozen bytes.
    trained = jax.tree.leaves((eqx.filter(sharded.mlp.output_layer, eqx.is_array), state)) + [outputs[0][2]]
    extra = compiled.memory_analysis().output_size_in_bytes - sum(x.nbytes for x in trained)
    assert extra == 8 * len(trained)


def masked_loss(model, batch):
    """(loss sums, weights) per example: a token-weighted mean, as an LM loss would be."""
    ids, y, weight = batch
    per = jnp.mean(jnp.square(model(ids) - y), axis=-1)
    return per * weight, weight


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_weighted_loss_is_the_global_weighted_mean(setup, mode):
    model, (ids, y), _, _ = setup
    weight = ((np.arange(BATCH) % 3 != 0) * (1 + np.arange(BATCH) % 2)).astype(np.float32)
    batch = (ids, y, weight)
    # One compiled program: op by op, the gradient compiled each operation anew.
    ref_loss, ref_grads = eqx.filter_jit(
        jax.value_and_grad(lambda m: jnp.sum(masked_loss(m, batch)[0]) / jnp.sum(weight))
    )(model)
    mesh = data_mesh(8)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        loss, grads = zoo.TrainStep(masked_loss, optax.sgd(0.1), microbatches=2, mode=mode).loss_and_grads(
            sharded, batch
        )
    assert_rounding_close(loss, ref_loss, **SUMS)
    assert_tree_rounding_close(grads, ref_grads, **SUMS)


@pytest.mark.parametrize("mode", ["explicit", "shard_map"])
def test_weights_made_without_the_batch_layout_are_moved_to_it(setup, mode):
    """A loss whose weights are `jnp.ones(b)` (replicated, not split like the batch's rows)
    gives the plain mean (a sharding error from inside the step's sums before), and moving
    them onto the rows adds no communication: one all-reduce, outside the loop, over `data`."""
    model, batch, ref_loss, ref_grads = setup
    mesh = data_mesh(8)

    def ones_weighted(m, b):
        losses = mse_per_example(m, b)
        return losses, jnp.ones(losses.shape[0])

    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(ones_weighted, optax.sgd(0.1), microbatches=2, mode=mode)
        loss, grads = step.loss_and_grads(sharded, batch)
        colls = zoo.collectives(step.lower(sharded, step.init(sharded), batch))
    assert_rounding_close(loss, ref_loss, **SUMS)
    assert_tree_rounding_close(grads, ref_grads, **SUMS)
    assert zoo.count(colls, "all-reduce", in_loop=True) == 0, zoo.report(colls)
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1, zoo.report(colls)
    assert all(c.mesh_axes == ("data",) for c in colls), zoo.report(colls)


def test_batch_not_divisible_is_a_clear_error_before_tracing(setup):
    model, batch, _, _ = setup
    ids, y = on_host(batch)  # sliced without compiling
    mesh = data_mesh(8)
    step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=4)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(on_host(model), zoo.rules("dp"), mesh)
        with pytest.raises(
            ValueError,
            match=r"global batch size 40 is not divisible by data-parallel size 8 x microbatches 4 = 32.*\(e\.g\. 32 or 64\)",
        ):
            step(sharded, step.init(sharded), (ids[:40], y[:40]))
    with pytest.raises(ValueError, match="disagree on the batch size"):
        step.check((ids[:32], y[:16]))


def test_bad_loss_fn_output_is_explained(setup):
    model, batch, _, _ = setup
    step = zoo.TrainStep(lambda m, b: mse_per_example(m, b).mean(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"must return per-example losses `\[batch\]`"):
        step.loss_and_grads(model, batch)


def test_bad_step_arguments():
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match="pmap"):
        zoo.TrainStep(mse_per_example, optax.sgd(0.1), mode="pmap")
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        zoo.TrainStep(mse_per_example, optax.sgd(0.1), microbatches=0)


def test_auto_mesh_and_missing_data_axis_are_explained(setup):
    model, batch, _, _ = setup
    step = zoo.TrainStep(mse_per_example, optax.sgd(0.1))
    auto = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    with jax.set_mesh(auto), pytest.raises(ValueError, match="needs every axis Explicit"):
        step.loss_and_grads(zoo.shard(model, zoo.rules("dp"), auto), batch)
    other = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"data axes \['data'\] are not in the mesh"):
        step.check(batch)


def test_shard_map_mode_refuses_params_sharded_over_data(setup):
    model, batch, _, _ = setup
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(on_host(model), zoo.rules("dp", mlp="data"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), mode="shard_map")
        with pytest.raises(ValueError, match="shard_map mode needs parameters replicated over the data axes"):
            step.loss_and_grads(sharded, batch)


class Scaled(eqx.Module):
    """A model with a plain Python float leaf (not an array, not a static field)."""

    inner: TokenRegressor
    scale: float

    def __call__(self, ids):
        return self.scale * self.inner(ids)


def test_donation_and_non_array_leaves(setup):
    model, batch, _, _ = setup
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        # A private copy: placement may alias the fixture's buffers, and donation deletes them.
        own = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
        sharded = zoo.shard(Scaled(own, 0.5), zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), donate=True)
        state = step.init(sharded)
        new, new_state, loss = step(sharded, state, batch)
    assert new.scale == 0.5 and isinstance(new.scale, float)
    # Donated: the old parameter buffers are gone, the batch is untouched.
    assert sharded.inner.embed.weight.is_deleted()
    assert not new.inner.embed.weight.is_deleted() and not batch[0].is_deleted()
    assert np.isfinite(float(loss))


def test_at_most_two_steps_in_flight(setup, monkeypatch):
    """A loop that never reads the loss still waits for step k-1 when it queues step k+1."""
    model, batch, _, _ = setup
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    mesh = data_mesh(2)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), donate=True)
        state = step.init(jax.tree.map(lambda x: x, sharded))
        current = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, sharded)
        losses = []
        for _ in range(3):
            current, state, loss = step(current, state, batch)
            losses.append(loss)
    assert [w is l for w, l in zip(waited, losses[:2])] == [True, True] and len(waited) == 2


def test_shard_map_mode_refuses_params_sharded_over_other_axes(setup):
    model, batch, _, _ = setup
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        sharded = zoo.shard(on_host(model), zoo.rules("dp", mlp="model"), mesh)
        step = zoo.TrainStep(mse_per_example, optax.sgd(0.1), mode="shard_map")
        with pytest.raises(
            ValueError, match=r"sharded over mesh axes \['model'\]; shard_map mode runs manual over every"
        ):
            step.loss_and_grads(sharded, batch)


def test_presets_are_objects_with_layout_and_step_options():
    once = zoo.preset("fsdp-once")
    assert once is zoo.presets.FSDP_ONCE and zoo.preset(once) is once
    assert once.step_options == {"gather": "once"} and zoo.presets.ZERO1.step_options == {"shard_optimizer": True}
    assert zoo.presets.DP.step_options == {} and zoo.presets.TP.step_options == {}
    # fsdp-once and zero1 share their layouts with fsdp and dp; only the step differs.
    assert zoo.rules(once) == zoo.rules("fsdp") and zoo.rules("zero1") == zoo.rules("dp")
    assert zoo.rules("tp", vocab=None)["vocab"] is None and zoo.rules("tp")["vocab"] == "model"
    assert tuple(zoo.presets.PRESETS) == zoo.RULE_PRESETS
    with pytest.raises(TypeError):
        once.layout["embed"] = None  # a preset cannot be edited by accident; rules() copies
    with pytest.raises(dataclasses.FrozenInstanceError):
        once.gather = "per_use"
    with pytest.raises(ValueError, match=r"unknown rules preset 'zero3'.*'fsdp-once'"):
        zoo.preset("zero3")
    with pytest.raises(ValueError, match=r"maps no mesh axes for logical axes \['seq', 'layers'.*to None to replicate"):
        zoo.Preset("mine", {"batch": "data"})


def test_train_step_takes_a_preset():
    loss = mse_per_example
    assert zoo.TrainStep(loss, optax.sgd(0.1), preset="fsdp-once").gather == "once"
    assert zoo.TrainStep(loss, optax.sgd(0.1), preset=zoo.presets.ZERO1).shard_optimizer is True
    plain = zoo.TrainStep(loss, optax.sgd(0.1), preset="fsdp")
    assert (plain.gather, plain.shard_optimizer) == ("per_use", False)
    # An explicit option wins over the preset's.
    assert zoo.TrainStep(loss, optax.sgd(0.1), preset="fsdp-once", gather="per_use").gather == "per_use"
    with pytest.raises(ValueError, match="unknown rules preset"):
        zoo.TrainStep(loss, optax.sgd(0.1), preset="fsdp_once")


def test_a_step_built_again_runs_the_program_already_compiled(setup):
    """A TrainStep built anew for the same computation (a run built again in one process)
    compiles nothing: `Jit`s share programs by their lowered text. Another mesh's devices,
    another learning rate (a constant of the program) or other compiler options each get a
    program of their own, and each step's update is its own."""
    from helpers import backend_compiles

    from zoo._jit import Jit, clear_programs

    model, batch, *_ = setup
    # On the host: placing them compiles nothing after the caches are cleared (helpers.on_host).
    model, batch = on_host((model, batch))
    clear_programs()
    jax.clear_caches()

    def update(lr, devices):
        mesh = jax.make_mesh((2,), ("data",), devices=devices, axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            placed = zoo.shard(model, zoo.rules("dp"), mesh)
            step = zoo.TrainStep(mse_per_example, optax.sgd(lr), microbatches=2)
            state = step.init(placed)
            with backend_compiles() as names:
                new, _, _ = step(placed, state, batch)
        return jax.device_get(new), [n for n in names if "train_step" in n]

    first, compiled = update(0.1, jax.devices()[:2])
    assert len(compiled) == 1
    again, compiled = update(0.1, jax.devices()[:2])
    assert compiled == [] and eqx.tree_equal(again, first)
    other_devices, compiled = update(0.1, jax.devices()[2:4])
    assert len(compiled) == 1 and eqx.tree_equal(other_devices, first)
    other_lr, compiled = update(0.2, jax.devices()[:2])
    assert len(compiled) == 1 and not eqx.tree_equal(other_lr, first)

    def double(x):
        return 2 * x

    x = jnp.arange(4.0)
    seen = []
    for options in (None, None, {"xla_cpu_enable_fast_math": True}):
        with backend_compiles() as names:
            Jit(double, on_compile=lambda *_: None, compiler_options=options)(x)
        seen.append(len(names))
    assert seen == [1, 0, 1]


def test_a_program_run_once_is_compiled_fast_unless_its_outputs_are_large():
    """`once_compiler_options`: a small initialiser is compiled without LLVM's optimisation
    (its compile is most of its time), one making `ONCE_OPTIMISED_FROM_BYTES` or more with
    XLA's defaults (its unoptimised run would take several times longer:
    benchmarks/initialiser_options.py). Lowering alone: nothing is allocated."""
    from zoo._jit import ONCE_COMPILER_OPTIONS, ONCE_OPTIMISED_FROM_BYTES, once_compiler_options

    def zeros(n):
        return jax.jit(lambda: jnp.zeros((n,), jnp.float32)).lower()

    floats = ONCE_OPTIMISED_FROM_BYTES // 4
    assert once_compiler_options(zeros(floats - 1)) == ONCE_COMPILER_OPTIONS
    assert once_compiler_options(zeros(floats)) == {}
