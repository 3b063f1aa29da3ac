"""LoRA branches: insertion, trainability, the one-all-reduce step carrying adapter bytes
only, single-device equality, merging, and errors."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_rounding_close,
    assert_tree_rounding_close,
    classification_batch,
    largest,
    lm_batch,
    preset_mesh,
    tiny_decoder,
    tiny_encoder_classifier,
    tree_bytes,
)

import zoo
from zoo.lora import LoraConfig, LoraLinear, add_lora, merge, trainable, unload, unmerge

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"), lora_dropout=0.1)
BATCH = 12
STEPS = 3
# The tiny decoder's sums (helpers.rounding_bound): the longest is a loss's and gradients'
# sum over the batch's 12 x 8 tokens (the forward's are <= 32 wide); 2 layers of ~6 chained
# sums plus the head forward.
FORWARD = {"terms": 32, "depth": 2 * 6 + 1}
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * FORWARD["depth"]}


@functools.cache
def lora_decoder(config=CONFIG):
    return add_lora(tiny_decoder(jax.random.key(0)), config, key=jax.random.key(1))


def forward(model, tokens):
    return _forward(model, tokens)


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


def test_branches_wrap_the_targets_with_stacked_shapes_and_derived_axes():
    model = lora_decoder()
    q = model.layers.layers.attention.q_proj
    assert isinstance(q, LoraLinear) and isinstance(model.layers.layers.attention.k_proj, zoo.nn.Linear)
    assert q.lora_A.shape == (2, 16, 4) and q.lora_B.shape == (2, 4, 16)  # [L, in, r], [L, r, out]
    axes = zoo.logical_axes(model).layers.layers
    assert axes.attention.q_proj.lora_A.names == ("layers", "embed", None)
    assert axes.attention.q_proj.lora_B.names == ("layers", None, "heads")
    assert axes.mlp.down.lora_A.names == ("layers", "mlp", None)
    assert axes.mlp.down.lora_B.names == ("layers", None, "embed")
    # The base weight is the untouched original.
    base = tiny_decoder(jax.random.key(0))
    np.testing.assert_array_equal(q.base.weight, base.layers.layers.attention.q_proj.weight)


def test_output_identical_to_the_base_at_init():
    tokens = lm_batch(jax.random.key(2), 4)["tokens"]
    np.testing.assert_array_equal(forward(lora_decoder(), tokens), forward(tiny_decoder(jax.random.key(0)), tokens))
    gaussian = add_lora(
        tiny_decoder(jax.random.key(0)), LoraConfig(init_lora_weights="gaussian"), key=jax.random.key(1)
    )
    np.testing.assert_array_equal(forward(gaussian, tokens), forward(tiny_decoder(jax.random.key(0)), tokens))


def test_scaling_follows_alpha_over_r_or_its_square_root():
    assert LoraConfig(r=4, lora_alpha=8).scaling == 2.0
    assert LoraConfig(r=4, lora_alpha=8, use_rslora=True).scaling == 4.0
    layer = LoraLinear(zoo.nn.Linear(6, 5, key=jax.random.key(0)), 2, scaling=3.0, init=False, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (3, 6))
    expected = x @ layer.base.weight + layer.base.bias + 3.0 * (x @ layer.lora_A @ layer.lora_B)
    # A 6-term dot product, the bias and a 2-term rank-r chain, scaled: ~4 sums in a chain.
    assert_rounding_close(layer(x), expected, terms=6, depth=4)


@functools.cache
def sharded_run(preset, n, m, steps=STEPS, config=CONFIG):
    """A few LoRA steps on a mesh (dropout on) and the compiled program's collectives."""
    model = lora_decoder(config)
    batch = lm_batch(jax.random.key(3), BATCH) | {"dropout_key": zoo.nn.example_keys(jax.random.key(4), BATCH)}
    mesh = preset_mesh(preset, n)
    with jax.set_mesh(mesh):
        sharded = zoo.shard(model, zoo.rules(preset), mesh)
        step = zoo.TrainStep(
            zoo.models.next_token_loss,
            optax.sgd(0.5),
            microbatches=m,
            trainable=trainable(model, config),
            preset=preset,
        )
        opt_state = step.init(sharded)
        compiled = step.compile(sharded, opt_state, batch)
        new = sharded
        losses = []
        for _ in range(steps):
            new, opt_state, loss = compiled(new, opt_state, batch)
            losses.append(float(loss))
    return new, losses, zoo.collectives(compiled, mesh=mesh), step.partition(sharded)[0]


def single_device_run(steps=STEPS, config=CONFIG):
    model = lora_decoder(config)
    batch = lm_batch(jax.random.key(3), BATCH) | {"dropout_key": zoo.nn.example_keys(jax.random.key(4), BATCH)}
    params, frozen = zoo.internal.partition_trainable(model, trainable(model, config))

    @eqx.filter_jit
    def update(params):
        def mean_loss(p):
            sums, counts = zoo.models.next_token_loss(eqx.combine(p, frozen), batch)
            return sums.sum() / counts.sum()

        loss, grads = jax.value_and_grad(mean_loss)(params)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    losses = []
    for _ in range(steps):
        params, loss = update(params)
        losses.append(float(loss))
    return eqx.combine(params, frozen), losses


def test_lora_step_equals_single_device_with_dropout_on():
    new, losses, _, _ = sharded_run("dp", 4, 3)
    ref, ref_losses = single_device_run()
    # Each loss: the same sums in another order (at that step's parameters, off by the
    # earlier steps' rounding: one more gradient's worth a step).
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        assert_rounding_close(loss, ref_loss, terms=GRADIENTS["terms"], depth=(step + 1) * GRADIENTS["depth"])
    # Plain SGD (no AdamW amplification): STEPS updates of lr x a gradient's rounding, each
    # within that at the adapters' own scale (|lr * g| <= max|new| here); the frozen base
    # leaves are equal.
    assert_tree_rounding_close(new, ref, terms=GRADIENTS["terms"], depth=STEPS * GRADIENTS["depth"])


# The adapter kinds beyond plain LoRA (docs/lora.md), dropout on where peft has it.
KINDS = {
    "dora": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"), lora_dropout=0.1,
                       use_dora=True),
    "embedding+tied-head": LoraConfig(r=4, lora_alpha=8, target_modules=("token_embedding", "lm_head", "q_proj"),
                                      ensure_weight_tying=True, init_lora_weights=False),
    "trainable-tokens": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj",), trainable_token_indices=(1, 5, 9)),
}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_kind_step_equals_single_device_with_one_all_reduce(kind):
    """DoRA, embedding/tied-head LoRA and trainable tokens keep the promise: 4 devices, 3
    microbatches equal one device (within float32 rounding, as plain LoRA above), and the
    compiled step holds no all-reduce inside a loop and one outside."""
    new, losses, colls, _ = sharded_run("dp", 4, 3, config=KINDS[kind])
    ref, ref_losses = single_device_run(config=KINDS[kind])
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        assert_rounding_close(loss, ref_loss, terms=GRADIENTS["terms"], depth=(step + 1) * GRADIENTS["depth"])
    assert_tree_rounding_close(new, ref, terms=GRADIENTS["terms"], depth=STEPS * GRADIENTS["depth"])
    reduces = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
    assert not [c for c in reduces if c.in_loop], zoo.report(colls)
    assert len([c for c in reduces if not c.in_loop]) == 1, zoo.report(colls)


def test_only_adapter_leaves_change_bit_for_bit():
    new, losses, _, _ = sharded_run("dp", 4, 3)
    assert losses[-1] < losses[0]
    before = jax.tree_util.tree_flatten_with_path(eqx.filter(lora_decoder(), eqx.is_array))[0]
    after = jax.tree.leaves(eqx.filter(new, eqx.is_array))
    for (path, old), updated in zip(before, after):
        name = zoo._axes.path_str(path)
        if name.endswith(("lora_A", "lora_B")):
            continue
        np.testing.assert_array_equal(np.asarray(updated), np.asarray(old), err_msg=name)
    assert not np.array_equal(new.layers.layers.mlp.down.lora_B, lora_decoder().layers.layers.mlp.down.lora_B)


@pytest.mark.parametrize("preset, n", [("dp", 4), ("tp", 4), ("fsdp-once", 4)])
def test_one_all_reduce_carries_the_adapter_bytes_only(preset, n):
    _, _, colls, params = sharded_run(preset, n, 3)
    print(zoo.report(colls))
    if preset == "fsdp-once":
        # Trainable and frozen leaves alike are gathered once before the loop; the adapter
        # gradients are reduced once after it (into their split layout).
        assert not [c for c in colls if c.in_loop], zoo.report(colls)
        reductions = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter")]
        assert len(reductions) == 1 and reductions[0].bytes == tree_bytes(params) + 8
        return
    data = [c for c in colls if "data" in c.mesh_axes]
    assert len(data) == 1 and data[0].kind == "all-reduce" and not data[0].in_loop, zoo.report(colls)
    lora_leaves = [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(eqx.filter(lora_decoder(), eqx.is_array))[0]
        if zoo._axes.path_str(p).endswith(("lora_A", "lora_B"))
    ]
    assert tree_bytes(params) == sum(x.nbytes for x in lora_leaves)  # trainable = the adapter
    # Collective bytes are per device: under tp, B of q/v and A of down are split over `model`.
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    assert data[0].bytes == per_device + 8  # + the loss sum and the token count
    assert tree_bytes(params) < tree_bytes(lora_decoder()) / 4
    if preset == "tp":
        assert all(c.mesh_axes == ("model",) for c in colls if c.in_loop)


def test_modules_to_save_train_in_full():
    config = LoraConfig(r=2, target_modules="all-linear", modules_to_save=("head",))
    model = add_lora(tiny_encoder_classifier(jax.random.key(0), dropout=0.0), config, key=jax.random.key(1))
    assert isinstance(model.head, zoo.nn.Linear)  # "all-linear" leaves the output layer out
    assert isinstance(model.encoder.layers.layers.mlp.up, LoraLinear)
    flags = trainable(model, config)
    assert flags.head.weight and flags.head.bias
    assert flags.encoder.layers.layers.attention.q_proj.lora_A
    assert not flags.encoder.layers.layers.attention.q_proj.base.weight
    assert not flags.encoder.embeddings.word_embeddings.weight
    batch = classification_batch(jax.random.key(2), 8)
    step = zoo.TrainStep(zoo.models.classification_loss, optax.sgd(0.1), trainable=flags)
    loss, grads = step.loss_and_grads(model, batch)
    assert grads.encoder.embeddings.word_embeddings.weight is None  # no gradient computed
    assert float(jnp.max(jnp.abs(grads.head.weight))) > 0


def test_merge_unmerge_round_trip_and_merged_output():
    model = add_lora(
        tiny_decoder(jax.random.key(0)),
        LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False),
        key=jax.random.key(1),
    )
    tokens = lm_batch(jax.random.key(2), 4)["tokens"]
    out = forward(model, tokens)
    merged = merge(model)
    assert not zoo.lora.modules(merged, LoraLinear)
    # W + s * A @ B summed before the matmul instead of after it: one more rounding of each
    # weight (a 4-term sum) then the same forward's sums.
    assert_rounding_close(forward(merged, tokens), out, **FORWARD)
    kept = merge(model, unload=False)
    assert kept.layers.layers.attention.q_proj.merged
    assert_rounding_close(forward(kept, tokens), out, **FORWARD)
    back = unmerge(kept)
    # fl(fl(W + D) - D), D = s A B computed alike both times: 2 roundings, of the merged
    # weight's size (the branches come back as they were).
    for a, b, merged_leaf in zip(*(jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (back, model, kept))):
        assert_rounding_close(a, b, terms=1, depth=1, scale=max(largest(merged_leaf), largest(b)))
    base = unload(model)
    np.testing.assert_array_equal(forward(base, tokens), forward(tiny_decoder(jax.random.key(0)), tokens))


def test_bad_input_is_refused_with_the_fix():
    base = tiny_decoder(jax.random.key(0))
    with pytest.raises(ValueError, match=r"match no Linear layer.*layers\.layers\.attention\.q_proj"):
        add_lora(base, LoraConfig(target_modules=("query",)), key=jax.random.key(0))
    with pytest.raises(ValueError, match="r must be a positive int"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match=r"r=17 exceeds min\(in, out\) = 16"):
        add_lora(base, LoraConfig(r=17), key=jax.random.key(0))
    with pytest.raises(ValueError, match="modules_to_save entry 'classifier' matches no module"):
        add_lora(base, LoraConfig(modules_to_save=("classifier",)), key=jax.random.key(0))
    # Adding branches twice never wraps a branch's own base layer.
    adapted = add_lora(base, LoraConfig(target_modules="all-linear"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="already carry LoRA branches"):
        add_lora(adapted, LoraConfig(target_modules="all-linear"), key=jax.random.key(1))
    regex = LoraConfig(target_modules=r".*attention\.(q|v)_proj", exclude_modules=("v_proj",))
    assert zoo.lora.target_names(base, regex) == ["layers.layers.attention.q_proj"]
