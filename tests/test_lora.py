"""LoRA as modules and their math, and adapters on disk: branches (insertion,
trainability, the one-all-reduce step carrying adapter bytes only, single-device equality,
merging, errors), and adapters in peft's layout (round trips, key names, shape checks,
atomic saves, sharded loads, exports that replace only an export's files)."""

import functools
import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from helpers import (
    TokenRegressor,
    assert_rounding_close,
    assert_tree_rounding_close,
    classification_batch,
    largest,
    lm_batch,
    preset_mesh,
    tiny_decoder,
    tiny_encoder_classifier,
    tree_allclose,
    tree_bytes,
)

import zoo
from zoo.lora import (
    LoraConfig,
    LoraLinear,
    add_lora,
    hf_module_name,
    load_adapter,
    merge,
    save_adapter,
    trainable,
    unload,
    unmerge,
)

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
    # Committed to the one device, as the update's outputs are: else a leaf made without a
    # device (trainable tokens' delta) compiles the update a second time at step 2.
    params = jax.device_put(params, jax.devices()[0])

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


# The adapter kinds beyond plain LoRA (docs/lora.md), dropout on where peft has it. DoRA
# (on Linear layers) and trainable tokens (the token embedding's rows) adapt different
# layers and meet only in the step, which treats every trainable leaf alike: one run holds
# both (each leaf of each kind is compared, and the one all-reduce carries both), not two.
# Embedding LoRA goes with neither (zoo refuses DoRA on an Embedding, and trainable tokens
# with a branch on the same embedding): a run of its own.
KINDS = {
    "dora+trainable-tokens": LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"),
                                        lora_dropout=0.1, use_dora=True, trainable_token_indices=(1, 5, 9)),
    "embedding+tied-head": LoraConfig(r=4, lora_alpha=8, target_modules=("token_embedding", "lm_head", "q_proj"),
                                      ensure_weight_tying=True, init_lora_weights=False),
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
    if kind == "dora+trainable-tokens":  # both kinds' leaves trained in the one run
        start = lora_decoder(KINDS[kind])
        for moved in (lambda m: m.token_embedding.trainable_tokens_delta,
                      lambda m: m.layers.layers.attention.q_proj.lora_magnitude_vector):  # fmt: skip
            assert not np.array_equal(moved(new), moved(start))
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


def test_bad_input_is_refused_with_the_fix(llama_dir):
    base = tiny_decoder(jax.random.key(0))
    with pytest.raises(ValueError, match=r"match no Linear layer.*layers\.layers\.attention\.q_proj"):
        add_lora(base, LoraConfig(target_modules=("query",)), key=jax.random.key(0))
    # Also the names the Hugging Face modules go by, which the targets take (gate_proj, not gate); a
    # model whose names are zoo's alone lists those.
    llama = zoo.hf.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match=r"mlp\.gate'.*as Hugging Face names them: \[[^]]*'gate_proj'"):
        zoo.lora.target_names(llama, LoraConfig(target_modules=("gate_projection",)))
    with pytest.raises(ValueError, match="match no Linear layer") as e:
        zoo.lora.target_names(TokenRegressor(key=jax.random.key(0)), LoraConfig(target_modules=("gate_proj",)))
    assert "as Hugging Face names them" not in str(e.value)
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


# --------------------------------------------------------------------------- adapters on disk (peft's layout)

DECODER = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"), init_lora_weights=False)
CLASSIFIER = LoraConfig(
    r=4, lora_alpha=16, target_modules=("q_proj", "v_proj"), init_lora_weights=False, modules_to_save=("head",)
)
PREFIX = "base_model.model."


@eqx.filter_jit
def forward_each(models, tokens):
    """Each model's output, in one compiled program."""
    return [model(tokens) for model in models]


def assert_same_outputs(a, b):
    out_a, out_b = forward_each([a, b], lm_batch(jax.random.key(3), 4)["tokens"])
    np.testing.assert_array_equal(out_a, out_b)


@functools.cache
def decoder_base():
    return tiny_decoder(jax.random.key(0))


@functools.cache
def classifier_base():
    return tiny_encoder_classifier(jax.random.key(0))


@functools.cache
def trained_classifier():
    """The classifier with random (non-zero) branches and a head changed as training would."""
    model = add_lora(classifier_base(), CLASSIFIER, key=jax.random.key(1))
    head = model.head.weight
    return eqx.tree_at(lambda m: m.head.weight, model, head + jax.random.normal(jax.random.key(2), head.shape))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter") / "classifier"
    save_adapter(trained_classifier(), CLASSIFIER, directory)
    return directory


def test_decoder_adapter_round_trip_reproduces_outputs(tmp_path):
    trained = add_lora(decoder_base(), DECODER, key=jax.random.key(1))
    assert np.abs(np.asarray(trained.layers.layers.attention.q_proj.lora_B)).min() > 0
    save_adapter(trained, DECODER, tmp_path / "dec")
    assert sorted(os.listdir(tmp_path / "dec")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "zoo_adapter.json",
    ]
    loaded, config = load_adapter(decoder_base(), tmp_path / "dec", key=jax.random.key(7))
    assert config == DECODER
    assert tree_allclose(loaded, trained, rtol=0, atol=0)
    assert_same_outputs(loaded, trained)


def test_encoder_classifier_round_trip_with_saved_head(classifier_dir):
    loaded, config = load_adapter(classifier_base(), classifier_dir)
    assert config == CLASSIFIER
    assert tree_allclose(loaded, trained_classifier(), rtol=0, atol=0)
    assert_same_outputs(loaded, trained_classifier())
    # Loading into a model that already carries branches (other values) sets them too.
    other = add_lora(classifier_base(), CLASSIFIER, key=jax.random.key(9))
    reloaded, _ = load_adapter(other, classifier_dir)
    assert tree_allclose(reloaded, trained_classifier(), rtol=0, atol=0)


def test_file_follows_peft_layout(classifier_dir):
    """A mean-pooling classifier's adapter is its encoder's (BertModel's names, a
    FEATURE_EXTRACTION adapter) and its head apart, torch's nn.Linear state dict."""
    tensors = safetensors.numpy.load_file(classifier_dir / "adapter_model.safetensors")
    layer = [
        f"{PREFIX}encoder.layer.{i}.attention.self.{p}.lora_{ab}.weight"
        for i in range(2)
        for p in ("query", "value")
        for ab in "AB"
    ]
    assert sorted(tensors) == sorted(layer)
    model = trained_classifier()
    q = model.encoder.layers.layers.attention.q_proj
    a, b = (
        tensors[f"{PREFIX}encoder.layer.1.attention.self.query.lora_A.weight"],
        tensors[f"{PREFIX}encoder.layer.1.attention.self.query.lora_B.weight"],
    )
    assert a.shape == (4, 16) and b.shape == (16, 4)  # [r, d_model], [d_model, r]
    np.testing.assert_array_equal(a, np.asarray(q.lora_A[1]).T)
    np.testing.assert_array_equal(b, np.asarray(q.lora_B[1]).T)
    head = safetensors.numpy.load_file(classifier_dir / "head.safetensors")
    assert sorted(head) == ["bias", "weight"] and head["weight"].shape == (3, 16)  # [num_labels, d_model]
    np.testing.assert_array_equal(head["weight"], np.asarray(model.head.weight).T)
    np.testing.assert_array_equal(head["bias"], np.asarray(model.head.bias))
    config = json.loads((classifier_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert config["task_type"] == "FEATURE_EXTRACTION" and config["modules_to_save"] is None
    assert sorted(config["target_modules"]) == sorted({k[len(PREFIX) :].rsplit(".", 2)[0] for k in layer})
    assert json.loads((classifier_dir / "zoo_adapter.json").read_text())["modules_to_save"] == ["head"]


def test_names_follow_bert_for_the_encoder_and_zoo_paths_elsewhere():
    classifier, encoder = classifier_base(), classifier_base().encoder
    assert hf_module_name(encoder, "layers.layers.attention.o_proj", (1,)) == "encoder.layer.1.attention.output.dense"
    assert hf_module_name(encoder, "layers.layers.mlp.up", (0,)) == "encoder.layer.0.intermediate.dense"
    assert hf_module_name(encoder, "layers.layers.mlp.down", (0,)) == "encoder.layer.0.output.dense"
    assert hf_module_name(encoder, "layers.layers.attention.k_proj", (1,)) == "encoder.layer.1.attention.self.key"
    # A mean-pooling classifier's encoder is BertModel; a CLS-pooling one is BertForSequenceClassification.
    assert hf_module_name(classifier, "encoder.embeddings.norm") == "embeddings.LayerNorm"
    assert hf_module_name(classifier, "head") == "classifier"
    cls = zoo.models.EncoderClassifier(encoder, 3, pooling="cls", key=jax.random.key(0))
    assert hf_module_name(cls, "encoder.embeddings.norm") == "bert.embeddings.LayerNorm"
    assert hf_module_name(cls, "pooler") == "bert.pooler.dense" and hf_module_name(cls, "head") == "classifier"
    # The tiny decoder (RoPE, RMSNorm, SwiGLU, untied head) is Llama-shaped: Llama's names.
    assert hf_module_name(decoder_base(), "layers.layers.attention.q_proj", (3,)) == "model.layers.3.self_attn.q_proj"
    assert hf_module_name(decoder_base(), "layers.layers.mlp.gate", (0,)) == "model.layers.0.mlp.gate_proj"
    assert hf_module_name(decoder_base(), "lm_head") == "lm_head"
    mlp = zoo.nn.MLP(2, 2, 4, 3, scan=True, key=jax.random.key(0))  # hidden: Stacked of 2
    assert hf_module_name(mlp, "hidden.layers.linear", (1,)) == "hidden.1.linear"
    assert hf_module_name(mlp, "output_layer") == "output_layer"
    with pytest.raises(ValueError, match="Stacked levels"):
        hf_module_name(decoder_base(), "layers.layers.attention.q_proj")


def test_adapter_without_zoo_entry_loads_as_peft_wrote_it(classifier_dir, tmp_path):
    """peft writes no zoo_adapter.json: targets come from the peft names."""
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    config = json.loads((classifier_dir / "adapter_config.json").read_text())
    config["target_modules"] = ["query", "value"]
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    for name in ("adapter_model.safetensors", "head.safetensors"):  # the head file: its head, saved whole
        (peft_dir / name).write_bytes((classifier_dir / name).read_bytes())
    loaded, loaded_config = load_adapter(classifier_base(), peft_dir)
    assert tree_allclose(loaded, trained_classifier(), rtol=0, atol=0)
    assert loaded_config.scaling == CLASSIFIER.scaling and loaded_config.modules_to_save == ("head",)
    assert set(loaded_config.target_modules) == {
        "encoder.layers.layers.attention.q_proj",
        "encoder.layers.layers.attention.v_proj",
    }


def test_loading_into_other_shapes_names_the_mismatched_tensors(classifier_dir):
    wider = tiny_encoder_classifier(jax.random.key(0), d_model=32)
    with pytest.raises(ValueError, match="mis-shaped") as err:
        load_adapter(wider, classifier_dir)
    message = str(err.value)
    assert f"{PREFIX}encoder.layer.0.attention.self.query.lora_A.weight: expected [4, 32], found [4, 16]" in message
    assert "d_model: saved 16, this model 32" in message
    # The first line (all a command prints) names the first of them and the other base.
    first = message.splitlines()[0]
    assert "does not fit this EncoderClassifier: " in first and not first.endswith(":"), first
    assert "mis-shaped (" in first and ": expected [4, 32], found [4, 16]" in first, first
    assert "the model configs differ (d_model: saved 16, this model 32" in first and "another base model?" in first
    # The head apart (head.safetensors) for another number of labels.
    five = zoo.models.EncoderClassifier(classifier_base().encoder, 5, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"head.safetensors: weight is \[16, 3\] in zoo's layout, this model's head "
        r"holds \[16, 5\]; the model configs differ \(num_labels: saved 3, this model 5",
    ):
        load_adapter(five, classifier_dir)
    # A model already carrying rank-8 branches.
    rank8 = add_lora(classifier_base(), LoraConfig(r=8, target_modules=("q_proj", "v_proj")), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"lora_A.weight: expected \[8, 16\], found \[4, 16\]"):
        load_adapter(rank8, classifier_dir)
    # Branches on other modules: missing and unexpected keys, by name.
    other = add_lora(classifier_base(), LoraConfig(r=4, target_modules=("k_proj", "v_proj")), key=jax.random.key(1))
    with pytest.raises(ValueError, match="missing keys") as err:
        load_adapter(other, classifier_dir)
    assert "unexpected keys" in str(err.value) and "attention.self.key.lora_A.weight" in str(err.value)
    assert "missing keys (" in str(err.value).splitlines()[0] and "unexpected keys (" in str(err.value).splitlines()[0]
    # The wrong model class.
    with pytest.raises(ValueError, match="saved from a zoo EncoderClassifier"):
        load_adapter(decoder_base(), classifier_dir)


def test_adapter_of_another_width_blames_the_base_not_zoos_own_rank_pattern(tmp_path):
    """A GPT-2-shaped adapter (zoo writes its fused c_attn's rank 2·r in rank_pattern) loaded on
    a wider base: the message named the other base and then told to "train it without
    rank_pattern", which zoo wrote itself and which is not the cause."""
    config = LoraConfig(r=2, target_modules=("q_proj", "v_proj"))
    gpt2 = {"vocab_size": 32, "d_model": 16, "num_heads": 2, "num_layers": 1, "mlp_dim": 32, "max_len": 8}
    small = zoo.models.Transformer(zoo.models.TransformerConfig(**gpt2), key=jax.random.key(0))
    save_adapter(add_lora(small, config, key=jax.random.key(1)), config, tmp_path / "a")
    assert json.loads((tmp_path / "a/adapter_config.json").read_text())["rank_pattern"]
    wide = zoo.models.Transformer(zoo.models.TransformerConfig(**(gpt2 | {"d_model": 32})), key=jax.random.key(0))
    with pytest.raises(ValueError, match="d_model: saved 16, this model 32") as err:
        load_adapter(wide, tmp_path / "a")
    assert "rank_pattern" not in str(err.value), str(err.value)


def test_missing_or_foreign_adapters_fail_clearly(tmp_path, classifier_dir):
    with pytest.raises(FileNotFoundError, match="no adapter directory"):
        load_adapter(classifier_base(), tmp_path / "nowhere")
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text((classifier_dir / "adapter_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="missing adapter_model.safetensors"):
        load_adapter(classifier_base(), half)
    (half / "adapter_model.safetensors").write_bytes(b"")
    (half / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="only LoRA"):
        load_adapter(classifier_base(), half)
    with pytest.raises(ValueError, match="not the ones config targets"):
        save_adapter(trained_classifier(), LoraConfig(r=4, target_modules=("q_proj",)), tmp_path / "bad")
    with pytest.raises(ValueError, match="no LoRA branches"):
        save_adapter(classifier_base(), CLASSIFIER, tmp_path / "bad")


def test_interrupted_save_leaves_the_previous_adapter(tmp_path, monkeypatch):
    directory = tmp_path / "adapter"
    first = add_lora(decoder_base(), DECODER, key=jax.random.key(1))
    second = add_lora(decoder_base(), DECODER, key=jax.random.key(2))
    save_adapter(first, DECODER, directory)
    files = sorted(os.listdir(directory))

    def crash_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00half a header")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.numpy, "save_file", crash_midway)
        with pytest.raises(OSError, match="disk full"):
            save_adapter(second, DECODER, directory)
    assert sorted(os.listdir(directory)) == files  # no temporary file left
    loaded, _ = load_adapter(decoder_base(), directory)
    assert tree_allclose(loaded, first, rtol=0, atol=0)

    # A crash between the two renames (new weights, old config) does not load.
    replace, calls = os.replace, []

    def crash_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("power cut")
        replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", crash_second)
        with pytest.raises(OSError, match="power cut"):
            save_adapter(second, DECODER, directory)
    assert sorted(os.listdir(directory)) == files
    with pytest.raises(ValueError, match="save was interrupted"):
        load_adapter(decoder_base(), directory)


def test_loaded_leaves_keep_the_sharding_of_the_leaves_they_replace(tmp_path):
    mesh, rules = preset_mesh("fsdp+tp", 8), zoo.rules("fsdp+tp")
    placed = zoo.shard(add_lora(decoder_base(), DECODER, key=jax.random.key(1)), rules, mesh)
    save_adapter(placed, DECODER, tmp_path / "sharded")
    fresh = zoo.shard(add_lora(decoder_base(), DECODER, key=jax.random.key(5)), rules, mesh)
    loaded, _ = load_adapter(fresh, tmp_path / "sharded")
    # Into the sharded base: the new branches take the layout their annotations give.
    into_base, _ = load_adapter(zoo.shard(decoder_base(), rules, mesh), tmp_path / "sharded")
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for new, old, base_loaded in zip(leaves(loaded), leaves(placed), leaves(into_base), strict=True):
        assert new.sharding == old.sharding and base_loaded.sharding == old.sharding
        np.testing.assert_array_equal(new, old)
        np.testing.assert_array_equal(base_loaded, old)
    q = loaded.layers.layers.attention.q_proj
    assert not q.lora_A.sharding.is_fully_replicated and not q.lora_B.sharding.is_fully_replicated


# --- writing into a folder that exists -------------------------------------------------------

# Each writer: (its config file and the key that marks its kind, its weights file).
WRITERS = {
    "save_pretrained": ("config.json", "model_type", "model.safetensors"),
    "save_adapter": ("adapter_config.json", "peft_type", "adapter_model.safetensors"),
}
# (case, files in the folder before the save by role, the names the refusal gives or None)
EXPORT_FOLDERS = [
    ("a new folder", {}, None),
    ("other names only", {"notes.txt": "mine"}, None),
    ("a user's config of the name", {"config": '{"app": 1}', "notes.txt": "mine"}, "config"),
    ("an export of its kind", {"config": "export", "notes.txt": "mine"}, None),
    ("weights alone (an interrupted save)", {"weights": "safetensors"}, None),
    ("a user's file named as the weights", {"weights": "not safetensors"}, "weights"),
]


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("files,refused", [c[1:] for c in EXPORT_FOLDERS], ids=[c[0] for c in EXPORT_FOLDERS])
def test_exports_replace_only_an_exports_files(tmp_path, writer, files, refused):
    """save_pretrained / save_adapter write their own file names, replacing those of an
    export of their kind (a config naming it, or readable weights) and leaving every other
    file; a folder holding one of their names that is no such export is refused, naming the
    file, with nothing written."""
    config, key, weights = WRITERS[writer]
    names = {"config": config, "weights": weights}
    contents = {"export": json.dumps({key: "x"}), "safetensors": safetensors.numpy.save({"x": np.zeros(2)})}
    directory = tmp_path / "out"
    directory.mkdir()
    for role, text in files.items():
        value = contents.get(text, text)
        path = directory / names.get(role, role)
        path.write_bytes(value) if isinstance(value, bytes) else path.write_text(value)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def save():
        if writer == "save_pretrained":
            return zoo.hf.save_pretrained(decoder_base(), directory)
        return save_adapter(add_lora(decoder_base(), DECODER, key=jax.random.key(1)), DECODER, directory)

    if refused is not None:
        with pytest.raises(FileExistsError, match=f"holds {names[refused]}, which it would replace") as info:
            save()
        assert "write into another folder, or move those files away first" in str(info.value)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
        return
    written = save()
    assert sorted(p.name for p in written) == sorted(set(os.listdir(directory)) - {"notes.txt"})
    assert all(p.parent == directory and p.stat().st_size > 0 for p in written)
    if "notes.txt" in files:
        assert (directory / "notes.txt").read_text() == "mine"
