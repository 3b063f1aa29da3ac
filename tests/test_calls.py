"""Calling placed models however their inputs arrive.

A model placed by `zoo.shard` under every preset (dp, fsdp, tp, fsdp+tp) is called on host
numpy, `jnp`, batch-split (`P("data")`) and replicated (`P()`) inputs, inside and outside
`jax.set_mesh`, eager and under `jax.jit`, with batch sizes the data axis does and does not
divide (every pair of those settings at least once); every answer must equal the
single-device model's. LoRA branches added to (or
loaded into) single-device and placed models, in either context, must sit on their base
weight's devices and give the single-device answer.

Each placed model is built once per module. An eager call of a model compiles its layer
stack's scan again every time (jax traces an eager scan's body anew), so each case makes
one call of each kind it needs, no more.
"""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_rounding_close, preset_mesh, tiny_decoder, tiny_encoder_classifier
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo

PRESETS = ("dp", "fsdp", "tp", "fsdp+tp")
KINDS = ("numpy", "jnp", "data", "replicated")
CONTEXTS = ("inside", "outside")
DEVICES = 8
BATCH = 8  # divides the data axis of every preset mesh (data=8, or data=4 with model=2)
ODD = 6  # divides neither
SEQ = 8
# Placed vs single-device: the same sums in another order (helpers.rounding_bound). The
# longest sum is the decoder's/encoder's 32-wide MLP (the MLP model's are 16 wide); 2 layers
# of ~6 chained sums plus the head (the MLP: 3 layers of a matmul and a LayerNorm's 2 sums).
SUMS = {"terms": 32, "depth": 2 * 6 + 1}
# MiniLM: the 1536-wide MLP of 6 layers of ~6 sums, then the mean pooling and normalisation.
MINILM_SUMS = {"terms": 1536, "depth": 6 * 6 + 2}
LORA = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)


@functools.cache
def reference(name):
    """The single-device model."""
    key = jax.random.key(0)
    if name == "decoder":
        return tiny_decoder(key)
    if name == "encoder":
        return tiny_encoder_classifier(key).encoder
    if name == "classifier":
        return tiny_encoder_classifier(key)
    if name == "mlp":
        # Sizes divisible by every mesh axis: in/out are "embed" (fsdp), width "mlp" (tp).
        return zoo.nn.MLP(8, 8, 16, 3, activation=jnp.tanh, norm="layernorm", scan=True, key=key)
    if name == "lora-decoder":
        return zoo.lora.add_lora(reference("decoder"), LORA, key=jax.random.key(1))
    raise KeyError(name)


@functools.cache
def placed(name, preset):
    return zoo.shard(reference(name), zoo.rules(preset), preset_mesh(preset, DEVICES))


def host_inputs(name, size):
    """The model's input as host numpy, the first `size` of BATCH examples: token ids (pad
    id 0 at the ends) or features."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        return rng.normal(size=(BATCH, 8)).astype(np.float32)[:size]
    tokens = rng.integers(1, 32, (BATCH, SEQ)).astype(np.int32)
    tokens[::2, -2:] = 0  # padding: the encoder masks it
    return tokens[:size]


@eqx.filter_jit
def single_device(model, x, **kwargs):
    """The single-device model's answer, compiled: one program, not one per op (the placed
    models below are called eagerly and jitted, as users call them)."""
    return model(x, **kwargs)


@functools.cache
def expected(name, size):
    """The single-device answer to `host_inputs(name, size)`: the first `size` rows of its
    answer to all BATCH examples (each example's answer is its own: one program a model)."""
    return np.asarray(single_device(reference(name), jnp.asarray(host_inputs(name, BATCH))))[:size]


def arrive(kind, x, mesh):
    """`x` as the input kind says."""
    if kind == "numpy":
        return x
    if kind == "jnp":
        return jnp.asarray(x)
    spec = P("data") if kind == "data" else P()
    return jax.device_put(x, NamedSharding(mesh, spec))


def call(model, x, context, mesh):
    if context == "inside":
        with jax.set_mesh(mesh):
            return model(x)
    return model(x)


# --------------------------------------------------------------------------- the call matrix


AXES = {
    "name": ("decoder", "encoder", "mlp", "lora-decoder"),
    "preset": PRESETS,
    "context": CONTEXTS,
    "kind": KINDS,
    "size": (BATCH, ODD),
}


def possible(case) -> bool:
    """A batch split over `data` divides it by construction: no such case holds ODD."""
    return not (case[3] == "data" and case[4] == ODD)


# Every pair of two axes' values that some possible case holds meets at least once (16
# cases, one call each, not the 224 of the full product; checked below): the call boundary's
# paths depend on the input kind with the mesh context, the preset's layout and whether
# the batch divides the data axis (the padding path), each met with each model. (An
# orthogonal array of 16 rows, its data-axis rows given BATCH; helpers.pairwise's greedy
# cover needs 20.)
MATRIX = [
    ("decoder", "dp", "inside", "numpy", BATCH),
    ("decoder", "fsdp", "inside", "data", BATCH),
    ("decoder", "tp", "inside", "replicated", BATCH),
    ("decoder", "fsdp+tp", "outside", "jnp", ODD),
    ("encoder", "dp", "inside", "jnp", BATCH),
    ("encoder", "fsdp", "inside", "replicated", ODD),
    ("encoder", "tp", "outside", "data", BATCH),
    ("encoder", "fsdp+tp", "inside", "numpy", ODD),
    ("mlp", "dp", "inside", "data", BATCH),
    ("mlp", "fsdp", "outside", "numpy", BATCH),
    ("mlp", "tp", "inside", "jnp", ODD),
    ("mlp", "fsdp+tp", "inside", "replicated", BATCH),
    ("lora-decoder", "dp", "outside", "replicated", ODD),
    ("lora-decoder", "fsdp", "inside", "jnp", BATCH),
    ("lora-decoder", "tp", "inside", "numpy", ODD),
    ("lora-decoder", "fsdp+tp", "inside", "data", BATCH),
]


def _pairs(case):
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


_ALL_PAIRS = set().union(*map(_pairs, filter(possible, itertools.product(*AXES.values()))))
assert all(map(possible, MATRIX)) and set().union(*map(_pairs, MATRIX)) == _ALL_PAIRS, "MATRIX misses a pair"


@pytest.mark.parametrize("name, preset, context, kind, size", MATRIX, ids=["-".join(map(str, case)) for case in MATRIX])
def test_placed_model_gives_the_single_device_answer(name, preset, context, kind, size):
    model, mesh = placed(name, preset), preset_mesh(preset, DEVICES)
    out = call(model, arrive(kind, host_inputs(name, size), mesh), context, mesh)
    assert out.shape == expected(name, size).shape
    assert_rounding_close(out, expected(name, size), **SUMS, what=f"batch {size}")


# Each preset once, each context twice: the keyword inputs meet every layout and both
# contexts; every (preset, context) pair meets in the call matrix above (the same boundary,
# the tokens alone).
@pytest.mark.parametrize("preset, context", [("dp", "inside"), ("fsdp", "outside"), ("tp", "outside"),
                                             ("fsdp+tp", "inside")])  # fmt: skip
def test_classifier_with_mask_token_types_and_dropout_keys(preset, context):
    """Every keyword input is placed with the tokens (and padded with them): mask,
    token types, per-example dropout keys; the dropout masks follow the examples."""
    model, mesh = placed("classifier", preset), preset_mesh(preset, DEVICES)
    tokens = host_inputs("classifier", ODD)
    kwargs = {
        "mask": tokens != 0,
        "token_types": (np.arange(SEQ)[None, :] >= SEQ // 2).astype(np.int32).repeat(ODD, 0),
        "key": zoo.nn.example_keys(jax.random.key(3), ODD),
    }
    want = single_device(reference("classifier"), jnp.asarray(tokens), **{k: jnp.asarray(v) for k, v in kwargs.items()})
    if context == "inside":
        with jax.set_mesh(mesh):
            out = model(tokens, **kwargs)
    else:
        out = model(tokens, **kwargs)
    assert_rounding_close(out, want, **SUMS)


@functools.cache
def _jitted():
    return eqx.filter_jit(lambda model, x: model(x))


# Every (preset, context), (preset, size) and (context, size) pair once: 8 programs, not
# the 16 of the full product (each preset meets both sizes, one in each context).
JITTED = [(preset, context, (BATCH, ODD)[(i + j) % 2]) for i, preset in enumerate(PRESETS)
          for j, context in enumerate(CONTEXTS)]  # fmt: skip


@pytest.mark.parametrize("preset, context, size", JITTED)
def test_jitted_call_on_host_inputs(preset, context, size):
    """Under `jax.jit` the boundary reshards traced inputs (and enters the parameters'
    abstract mesh when no mesh is set)."""
    model, mesh = placed("decoder", preset), preset_mesh(preset, DEVICES)
    out = call(lambda x: _jitted()(model, x), host_inputs("decoder", size), context, mesh)
    assert_rounding_close(out, expected("decoder", size), **SUMS)


def test_split_inputs_pass_unchanged_into_the_call():
    """Inputs already split over a mesh axis (a training step's microbatches) reach the
    model as they came: the boundary adds no reshard."""
    mesh = preset_mesh("fsdp", DEVICES)
    model = placed("decoder", "fsdp")
    tokens = jax.device_put(host_inputs("decoder", BATCH), NamedSharding(mesh, P("data")))

    def lowered_text(fn):
        with jax.set_mesh(mesh):
            return jax.jit(fn).lower(eqx.filter(model, eqx.is_array), tokens).as_text()

    def through_boundary(params, x):
        return eqx.combine(params, model)(x)

    def past_boundary(params, x):
        return type(model).__call__.__wrapped__(eqx.combine(params, model), x)

    def ops(text):  # the program without its source locations
        return [line.split(" loc(")[0] for line in text.splitlines() if "=" in line and "loc(" in line]

    assert ops(lowered_text(through_boundary)) == ops(lowered_text(past_boundary))


def test_one_example_to_a_placed_mlp():
    """An MLP input without batch dims (one example) works placed too."""
    mesh = preset_mesh("fsdp", DEVICES)
    x = host_inputs("mlp", 1)[0]
    out = placed("mlp", "fsdp")(x)
    want = expected("mlp", 1)[0]
    assert_rounding_close(out, want, **SUMS)
    with jax.set_mesh(mesh):
        out = placed("mlp", "fsdp")(jnp.asarray(x))
    assert_rounding_close(out, want, **SUMS)


@pytest.mark.parametrize("context", CONTEXTS)
def test_single_device_model_under_any_context(context):
    """A model on one device keeps working inside a mesh context, on any input kind."""
    model, mesh = reference("decoder"), preset_mesh("dp", DEVICES)
    for kind in KINDS:
        out = call(model, arrive(kind, host_inputs("decoder", BATCH), mesh), context, mesh)
        assert_rounding_close(out, expected("decoder", BATCH), **SUMS, what=kind)


# --------------------------------------------------------------------------- LoRA on placed models


def _check_branches(model, base_model):
    """Each branch on its base weight's devices: on a mesh, A split like the weight's input
    axis and B like its output axis (as `zoo.shard` would place them); base leaves untouched."""
    layers = zoo.lora.modules(model, zoo.lora.LoraLinear)
    assert layers
    for name, (path, stacked) in layers.items():
        layer = model
        for key in path:
            layer = getattr(layer, key.name)
        weight = layer.base.weight
        if isinstance(weight.sharding, NamedSharding):
            spec = tuple(weight.sharding.spec) + (None,) * (weight.ndim - len(weight.sharding.spec))
            lead, (into, out) = spec[:stacked], spec[stacked:]
            assert layer.lora_A.sharding == NamedSharding(weight.sharding.mesh, P(*lead, into, None)), name
            assert layer.lora_B.sharding == NamedSharding(weight.sharding.mesh, P(*lead, None, out)), name
        else:
            assert layer.lora_A.sharding == layer.lora_B.sharding == weight.sharding, name
    for old, new in zip(jax.tree.leaves(base_model), jax.tree.leaves(zoo.lora.unload(model)), strict=True):
        assert new.sharding == old.sharding


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter")
    zoo.lora.save_adapter(reference("lora-decoder"), LORA, directory)
    return directory


def assert_identical(model, like):
    """The same structure, leaf values, dtypes and placements: the same model to call."""
    assert jax.tree.structure(model) == jax.tree.structure(like)
    for new, old in zip(jax.tree.leaves(model), jax.tree.leaves(like), strict=True):
        assert new.sharding == old.sharding and new.dtype == old.dtype
        np.testing.assert_array_equal(new, old)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("preset", ["single-device", *PRESETS])
def test_add_lora_and_load_adapter_place_branches_like_their_base(preset, context, adapter):
    if preset == "single-device":
        base, mesh, like = reference("decoder"), preset_mesh("fsdp+tp", DEVICES), reference("lora-decoder")
    else:
        base, mesh, like = placed("decoder", preset), preset_mesh(preset, DEVICES), placed("lora-decoder", preset)

    def build():
        return zoo.lora.add_lora(base, LORA, key=jax.random.key(1)), zoo.lora.load_adapter(base, adapter)[0]

    if context == "inside":
        with jax.set_mesh(mesh):
            added, loaded = build()
    else:
        added, loaded = build()
    # Each is the LoRA decoder placed as zoo.shard places it (the adapter holds its values):
    # its answers are the call matrix's (the lora-decoder cases: every preset, both contexts).
    # Calling each again would compile the layer stack's scan again, and give those answers.
    for model in (added, loaded):
        _check_branches(model, base)
        assert_identical(model, like)
    if preset == "single-device":  # no call matrix case: called here, on the padded batch
        out = call(added, host_inputs("decoder", ODD), context, mesh)
        assert_rounding_close(out, expected("lora-decoder", ODD), **SUMS)


# --------------------------------------------------------------------------- the README's lines


def test_readme_sharded_minilm_lines():
    """README: `load_minilm(rules=zoo.rules("fsdp"), mesh=mesh)`, then
    `zoo.hf.sentence_embeddings(encoder, **tokenizer([...]))` without `jax.set_mesh`."""
    mesh = jax.make_mesh((DEVICES,), ("data",))
    encoder, tokenizer = zoo.hf.load_minilm(rules=zoo.rules("fsdp"), mesh=mesh)
    vectors = zoo.hf.sentence_embeddings(encoder, **tokenizer(["a sentence", "another"]))
    single, _ = zoo.hf.load_minilm()
    want = zoo.hf.sentence_embeddings(single, **tokenizer(["a sentence", "another"]))
    assert vectors.shape == (2, 384)
    assert_rounding_close(vectors, want, **MINILM_SUMS)
