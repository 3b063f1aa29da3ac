"""The int8 frozen base: `zoo.nn.QuantizedLinear` and `zoo.lora.cast_frozen(model, jnp.int8)`.

The dp step's collectives under an int8 base are checked with the bfloat16 ones in
tests/test_perf_correctness.py; the fsdp step's (gathered as int8, within the preset's budget)
with the 4-bit ones in tests/test_qlora.py."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    UNIT_ROUNDOFF,
    assert_rounding_close,
    assert_tree_rounding_close,
    largest,
    lm_batch,
    preset_mesh,
    rounding_bound,
    storage_bound,
    storage_errors,
    tiny_decoder,
    tree_allclose,
    tree_bytes,
)
from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints, as data
from jax.sharding import PartitionSpec as P

import zoo
from zoo.lora import LoraConfig, add_lora, cast_frozen, trainable
from zoo.nn import Linear, QuantizedLinear

# torch on one thread: the peft reference here is a tiny model (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_one_thread")

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
BATCH = 4
# The tiny decoder's float32 sums (helpers.rounding_bound): <= 32 wide forward, 2 layers of
# ~6 chained sums plus the head; gradients twice that, over the batch's 4 x 8 tokens.
FORWARD = {"terms": 32, "depth": 2 * 6 + 1}
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * FORWARD["depth"]}


def _linear(key, lead=(), n_in=8, n_out=6):
    """A `Linear` with weights of very different sizes per output channel (and, with `lead`,
    stacked on leading layer dims as `zoo.nn.Stacked` stores it)."""
    linear = Linear(n_in, n_out, key=key)
    kw, kb = jax.random.split(jax.random.fold_in(key, 1))
    channel = jnp.logspace(-3, 1, n_out)
    weight = jax.random.normal(kw, (*lead, n_in, n_out)) * channel
    bias = jax.random.normal(kb, (*lead, n_out))
    return eqx.tree_at(lambda lin: (lin.weight, lin.bias), linear, (weight, bias))


@functools.cache  # built once per file: every test reads it, none changes it
def _lora_model():
    return add_lora(tiny_decoder(jax.random.key(0)), CONFIG, key=jax.random.key(1))


def _q_proj(model):
    return model.layers.layers.attention.q_proj


@pytest.mark.parametrize("lead", [(), (3,)])
def test_quantize_error_is_within_half_a_step_per_channel(lead):
    linear = _linear(jax.random.key(0), lead)
    q = QuantizedLinear.quantize(linear)
    assert q.weight.dtype == jnp.int8 and q.weight.shape == linear.weight.shape
    assert q.scale.dtype == jnp.float32 and q.scale.shape == (*lead, 6)
    assert (q.in_features, q.out_features, q.in_axis, q.out_axis) == (8, 6, "embed", "mlp")
    np.testing.assert_array_equal(q.bias, linear.bias)
    # The checks' arithmetic in numpy (float32 as jnp's; eagerly jnp compiles each op).
    weight = np.asarray(linear.weight)
    absmax = np.max(np.abs(weight), axis=-2, keepdims=True)
    assert int(np.max(np.abs(np.asarray(q.weight).astype(np.int32)))) == 127  # the whole int8 range is used
    back = q.dequantize()
    assert isinstance(back, Linear) and back.weight.dtype == jnp.float32
    err = np.abs(np.asarray(back.weight) - weight)
    # Half a step (absmax / 127 / 2), plus the roundings of the scale and of q x scale.
    assert np.all(err <= absmax / np.float32(254) + np.float32(3 * UNIT_ROUNDOFF) * absmax)
    # Per channel, not per tensor: the smallest channel's error is its own scale's.
    assert float(np.max(err[..., 0])) < 1e-3 / 254 * 10
    # A zero channel stays zero (no division by a zero scale).
    zero = QuantizedLinear.quantize(eqx.tree_at(lambda lin: lin.weight, linear, linear.weight.at[..., 2].set(0)))
    assert not bool(jnp.any(zero.weight[..., 2])) and bool(jnp.all(jnp.isfinite(zero.dequantize().weight)))


def test_output_is_the_dequantised_matmul_plus_bias():
    q = QuantizedLinear.quantize(_linear(jax.random.key(0)))
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    w = q.dequantize().weight
    # An 8-term dot and the bias, the scale applied after it or before: one more rounding.
    scale = largest(jnp.abs(x) @ jnp.abs(w) + jnp.abs(q.bias))
    assert_rounding_close(eqx.filter_jit(q)(x), x @ w + q.bias, terms=9, depth=2, scale=scale)
    # bfloat16 activations compute in bfloat16.
    assert q(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    no_bias = QuantizedLinear(q.weight, q.scale, None)
    assert_rounding_close(no_bias(x), x @ w, terms=8, depth=2, scale=largest(jnp.abs(x) @ jnp.abs(w)))
    with pytest.raises(TypeError, match="(?i)int8"):  # ours, or jaxtyping's when runtime checks are on
        QuantizedLinear(q.weight.astype(jnp.int16), q.scale)


def test_cast_frozen_int8_quantises_the_projections_and_keeps_the_branches():
    model = _lora_model()
    cast = cast_frozen(model, jnp.int8, config=CONFIG)
    adapted = zoo.lora.modules(cast, zoo.lora.LoraLinear)
    assert len(adapted) == 7  # q, k, v, o, up, gate, down
    q_proj = _q_proj(cast)
    assert isinstance(q_proj.base, QuantizedLinear) and q_proj.base.weight.dtype == jnp.int8
    assert q_proj.base.scale.dtype == jnp.float32 and q_proj.base.bias.dtype == jnp.bfloat16
    np.testing.assert_array_equal(q_proj.lora_A, _q_proj(model).lora_A)
    np.testing.assert_array_equal(q_proj.lora_B, _q_proj(model).lora_B)
    for path, leaf in jax.tree_util.tree_leaves_with_path(cast):
        name = jax.tree_util.keystr(path)
        if "lora_" in name or name.endswith("base.scale"):
            assert leaf.dtype == jnp.float32, name
        elif name.endswith("base.weight"):
            assert leaf.dtype == jnp.int8, name
        else:  # embeddings, norms, the frozen head, biases
            assert leaf.dtype == jnp.bfloat16, name
    assert tree_bytes(cast) < tree_bytes(cast_frozen(model, jnp.bfloat16, config=CONFIG))
    # The error is the int8 rounding of the weights (compute stays float32).
    tokens = lm_batch(jax.random.key(3), BATCH)["tokens"]
    ref, got = eqx.filter_jit(lambda m: m(tokens))(model), eqx.filter_jit(lambda m: m(tokens))(cast)
    assert got.dtype == jnp.float32
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref))
    # The leaves' storage errors in one program (eagerly every leaf's ops compile on their own).
    errors = eqx.filter_jit(storage_errors)(model, CONFIG, jnp.int8)
    bound = storage_bound(lambda m: m(tokens), model, errors)
    bound += rounding_bound(largest(ref), **FORWARD)
    assert 0 < diff.max() and np.all(diff <= bound), (diff.max(), np.max(diff / bound))
    # modules_to_save stay float32 and trainable.
    saved = LoraConfig(r=4, target_modules=("q_proj",), modules_to_save=("final_norm",))
    # Dtypes only: traced, nothing computed.
    cast = eqx.filter_eval_shape(
        lambda: cast_frozen(
            add_lora(tiny_decoder(jax.random.key(0)), saved, key=jax.random.key(1)), jnp.int8, config=saved
        )
    )
    assert cast.final_norm.weight.dtype == jnp.float32 and cast.lm_head.weight.dtype == jnp.bfloat16


def test_int8_changes_storage_not_the_lora_gradients():
    """The LoRA gradients of the int8 model are those of the float32 model holding its
    dequantised weights: int8 is how the base is stored, not another function."""
    cast = cast_frozen(_lora_model(), jnp.int8, config=CONFIG)
    dequantised = cast_frozen(cast, jnp.float32, config=CONFIG)
    assert isinstance(_q_proj(dequantised).base, Linear)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(dequantised))
    batch = lm_batch(jax.random.key(3), BATCH)
    grads = {}
    for name, m in (("int8", cast), ("float32", dequantised)):
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(1e-2), trainable=trainable(m, CONFIG))
        loss, grads[name] = eqx.filter_jit(step.loss_and_grads)(m, batch)
    flat = [jax.tree.leaves(g) for g in grads.values()]
    assert len(flat[0]) == len(flat[1]) == 2 * 7  # A and B of every branch, nothing else
    for g, want in zip(*flat, strict=True):
        assert float(jnp.max(jnp.abs(want))) > 0
        assert_rounding_close(g, want, **GRADIENTS)
    # Re-quantising the dequantised base gives the same int8 weights and scales.
    again = cast_frozen(dequantised, jnp.int8, config=CONFIG)
    # The scales: fl(fl(127 s) / 127), 2 roundings of s (the rest exactly equal).
    assert_tree_rounding_close(_q_proj(again).base, _q_proj(cast).base, terms=1, depth=1)
    np.testing.assert_array_equal(_q_proj(again).base.weight, _q_proj(cast).base.weight)


def test_int8_base_is_placed_like_the_linear_under_tensor_parallelism():
    model = _lora_model()
    cast = cast_frozen(model, jnp.int8, config=CONFIG)
    mesh = preset_mesh("tp", 4)
    tokens = lm_batch(jax.random.key(3), BATCH)["tokens"]
    with jax.set_mesh(mesh):
        rules = zoo.rules("tp")
        placed, ref = zoo.shard(cast, rules, mesh), zoo.shard(model, rules, mesh)
        for proj in ("q_proj", "o_proj"):
            got, want = getattr(placed.layers.layers.attention, proj), getattr(ref.layers.layers.attention, proj)
            assert got.base.weight.sharding.spec == want.base.weight.sharding.spec
            assert got.base.scale.sharding.spec == got.base.bias.sharding.spec == want.base.bias.sharding.spec
        assert "model" in str(placed.layers.layers.attention.q_proj.base.weight.sharding.spec)
        out = eqx.filter_jit(lambda m, t: m(t))(placed, jax.device_put(tokens, P("data", None)))
        # Quantising a placed model gives the same placement.
        after = cast_frozen(ref, jnp.int8, config=CONFIG)
    shardings = [(x.sharding, y.sharding) for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(placed), strict=True)]
    assert all(a == b for a, b in shardings)
    assert_rounding_close(out, eqx.filter_jit(lambda m: m(tokens))(cast), **FORWARD)


def test_cast_frozen_int8_refuses_bad_input_and_merges_only_by_dequantising():
    model = _lora_model()
    for bad in (jnp.uint8, jnp.int16):
        with pytest.raises(ValueError, match="floating-point dtype, int8 or 4 bits, got .*'nf4' or 'int4'"):
            cast_frozen(model, bad, config=CONFIG)
    with pytest.raises(ValueError, match="'float33' is not a dtype"):
        cast_frozen(model, "float33", config=CONFIG)
    with pytest.raises(ValueError, match="merged LoRA branch: unmerge"):
        cast_frozen(zoo.lora.merge(model, unload=False), jnp.int8, config=CONFIG)
    cast = cast_frozen(model, jnp.int8, config=CONFIG)
    with pytest.raises(ValueError, match="int8 base.*unload=True.*cast_frozen\\(model, jnp.float32"):
        zoo.lora.merge(cast, unload=False)
    # merge(unload=True) folds each branch into the dequantised float32 weight.
    merged = zoo.lora.merge(cast)
    q_proj = _q_proj(merged)
    assert isinstance(q_proj, Linear) and q_proj.weight.dtype == jnp.float32
    base, delta = _q_proj(cast).base.dequantize().weight, _q_proj(cast).delta()
    # q x scale, a rank-4 product scaled, their sum: rounding in another order.
    assert_rounding_close(q_proj.weight, base + delta, terms=4, depth=2, scale=largest(jnp.abs(base) + jnp.abs(delta)))
    tokens = lm_batch(jax.random.key(3), BATCH)["tokens"]
    # The merged float32 weights vs int8 base + branch: one more rounding a weight, same sums.
    forward = eqx.filter_jit(lambda m: m(tokens))
    assert_rounding_close(forward(merged), forward(cast), terms=FORWARD["terms"], depth=FORWARD["depth"] + 1)
    # unload keeps the int8 layers; a plain int8 model can take new branches.
    plain = zoo.lora.unload(cast)
    assert isinstance(_q_proj(plain), QuantizedLinear)
    again = add_lora(plain, CONFIG, key=jax.random.key(5))
    assert _q_proj(again).lora_A.dtype == jnp.float32 and isinstance(_q_proj(again).base, QuantizedLinear)


def test_int8_adapter_saves_in_peft_format_and_hf_export_asks_to_dequantise(tmp_path):
    import peft
    import test_peft as tp

    folder = tp.hf_folder("gpt2", str(tmp_path / "hf"))
    config = LoraConfig(
        r=2,
        target_modules=("q_proj", "k_proj", "v_proj", "up"),
        modules_to_save=("final_norm",),
        init_lora_weights=False,
    )
    model = add_lora(zoo.hf.from_pretrained(folder), config, key=jax.random.key(1))
    cast = cast_frozen(model, jnp.int8, config=config)
    zoo.lora.save_adapter(model, config, tmp_path / "f32")
    zoo.lora.save_adapter(cast, config, tmp_path / "int8")
    # The same adapter (the branches are float32 either way), GPT-2's c_attn fused as for float.
    assert (tmp_path / "int8/adapter_config.json").read_text() == (tmp_path / "f32/adapter_config.json").read_text()
    f32, int8 = (zoo.lora.tensors_sha256(_read(tmp_path / d)) for d in ("f32", "int8"))
    assert f32 == int8
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opened = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "int8")
    tp.no_peft_warnings(record)
    tp.assert_close(tp.zoo_outputs(model), tp.hf_outputs(opened), "int8-trained adapter on the float base, peft")
    # Read back onto the int8 model (and onto its unloaded base: new branches, int8 base kept).
    loaded, _ = zoo.lora.load_adapter(cast, tmp_path / "int8")
    assert tree_allclose(loaded, cast, rtol=0, atol=0)
    onto, _ = zoo.lora.load_adapter(zoo.lora.unload(cast), tmp_path / "int8")
    assert isinstance(_q_proj(onto).base, QuantizedLinear)
    assert tree_allclose(onto, cast, rtol=0, atol=0)
    with pytest.raises(ValueError, match="int8 .*QuantizedLinear.*zoo.nn.dequantize"):
        zoo.hf.save_pretrained(zoo.lora.unload(cast), tmp_path / "out")
    zoo.hf.save_pretrained(zoo.lora.merge(cast), tmp_path / "merged")  # merging dequantises


def _read(directory):
    import safetensors.numpy

    return safetensors.numpy.load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_a_narrow_weight_is_not_kept_converted_for_the_backward_pass(dtype):
    """`project` converts a bfloat16/int8 weight again in the backward pass instead of
    keeping its float32 copy (one per layer in a scan), with the same gradient."""
    from zoo.nn import project

    x = jax.random.normal(jax.random.key(0), (6, 16))
    w = jnp.clip(jax.random.normal(jax.random.key(1), (16, 8)) * 40, -127, 127).astype(dtype)

    def loss(x):
        return jnp.sum(jnp.sin(project(x, w)))

    kept = saved_residuals(loss, x)
    assert not any(r.shape == w.shape and r.dtype == jnp.float32 for r, _ in kept), kept
    assert any(r.shape == w.shape and r.dtype == w.dtype for r, _ in kept), kept  # the narrow one instead
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(x @ w.astype(jnp.float32))))(x)
    # cos(x w) w^T: a 16-term and an 8-term sum, at most the rows' sums of |w|.
    w32 = jnp.abs(w.astype(jnp.float32))
    assert_rounding_close(jax.grad(loss)(x), expected, terms=16, depth=2, scale=largest(w32.sum(axis=1)))
