"""The 4-bit frozen base (QLoRA): `zoo.nn.FourBitLinear` (NF4 as bitsandbytes stores it, int4
per group) and `zoo.lora.cast_frozen(model, "nf4" | "int4")`. The pure NF4 functions are
held to bitsandbytes in tests/test_four_bit.py."""

import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_rounding_close, assert_tree_rounding_close, lm_batch, preset_mesh, tiny_decoder, tree_bytes
from jax.sharding import PartitionSpec as P

import zoo
from zoo._tree import node_at
from zoo.lora import LoraConfig, add_lora, cast_frozen, trainable
from zoo.nn import FourBitLinear, Linear

# torch on one thread (conftest.torch_one_thread): its references are tiny models.
pytestmark = pytest.mark.usefixtures("torch_one_thread")

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
BATCH = 4
BLOCK = 4  # the tiny decoder is 16 wide: blocks of 4 inputs, so FSDP can split the scales too
FORWARD = {"terms": 32, "depth": 2 * 6 + 1}
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * FORWARD["depth"]}


@functools.cache  # built once per file: every test reads it, none changes it
def _lora_model(config=CONFIG, tied=False):
    overrides = {"tie_embeddings": True} if tied else {}
    return add_lora(tiny_decoder(jax.random.key(0), **overrides), config, key=jax.random.key(1))


def _q_proj(model):
    return model.layers.layers.attention.q_proj


@eqx.filter_jit
def _logits(model, tokens):
    """`model(tokens)` as one program per model structure (not one per op), shared by the
    tests: the float models holding dequantised weights of every kind share theirs."""
    return model(tokens)


@eqx.filter_jit
def _lora_grads(model, batch, config):
    """One device's `(loss, gradients of the trainable leaves)` of a LoRA model (one
    program per model structure, shared like `_logits`'s)."""
    step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(1e-2), trainable=trainable(model, config))
    return step.loss_and_grads(model, batch)


def test_nf4_layer_is_bitsandbytes_quantize_4bit_transposed():
    """A Llama-shaped projection (and a stacked one): the layer's codes, scales and float
    weight are bitsandbytes' `quantize_4bit` / `dequantize_4bit` of the torch weight
    `[out, in]`, transposed, bit for bit; the forward pass is that weight's matmul."""
    import bitsandbytes.functional as F
    import torch

    key = jax.random.key(0)
    linear = Linear(256, 96, key=key)
    linear = eqx.tree_at(lambda lin: lin.weight, linear, jax.random.normal(key, (256, 96)) * 0.02)
    layer = FourBitLinear.quantize(linear, "nf4")
    assert layer.codes.shape == (128, 96) and layer.codes.dtype == jnp.uint8 and layer.scale.shape == (4, 96)
    torch_weight = torch.from_numpy(np.asarray(linear.weight).T.copy())
    packed, state = F.quantize_4bit(torch_weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    np.testing.assert_array_equal(np.asarray(layer.codes).T, packed.numpy().reshape(96, 128))
    np.testing.assert_array_equal(np.asarray(layer.scale).T, state.absmax.numpy().reshape(96, 4))
    weight = F.dequantize_4bit(packed, state).numpy()
    np.testing.assert_array_equal(np.asarray(layer.dequantized_weight()), weight.T)
    x = jax.random.normal(jax.random.key(1), (2, 3, 256))
    assert_rounding_close(layer(x), x @ weight.T + linear.bias, terms=256, depth=1)
    # Stacked layers (zoo.nn.Stacked): each layer quantised as on its own.
    stacked = jax.vmap(lambda k: Linear(128, 32, key=k))(jax.random.split(key, 3))
    layers = FourBitLinear.quantize(stacked, "nf4")
    assert layers.codes.shape == (3, 64, 32) and layers.scale.shape == (3, 2, 32)
    one = FourBitLinear.quantize(jax.tree.map(lambda a: a[1], stacked), "nf4")
    np.testing.assert_array_equal(layers.dequantized_weight()[1], one.dequantized_weight())


def test_int4_is_within_half_a_step_per_group_and_the_errors_name_the_fix():
    linear = Linear(64, 10, key=jax.random.key(2))
    layer = FourBitLinear.quantize(linear, "int4", block_size=16)
    assert layer.scale.shape == (4, 10) and layer.block_size == 16 and layer.kind == "int4"
    error = np.abs(np.asarray(layer.dequantized_weight()) - np.asarray(linear.weight))
    step = np.repeat(np.asarray(layer.scale), 16, axis=0)
    assert np.all(error <= step / 2 * (1 + 1e-6)) and error.max() > 0
    # The levels are integers in [-7, 7]: 7 x scale is each group's absmax.
    groups = np.abs(np.asarray(linear.weight)).reshape(4, 16, 10).max(axis=1)
    np.testing.assert_allclose(np.asarray(layer.scale) * 7, groups, rtol=1e-6)
    with pytest.raises(
        ValueError, match="block of 48 input features does not divide this layer's 64 inputs.*16, 32, 64"
    ):
        FourBitLinear.quantize(linear, "nf4", block_size=48)
    with pytest.raises(ValueError, match="kind must be 'nf4' or 'int4', got 'fp4'"):
        FourBitLinear.quantize(linear, "fp4")
    with pytest.raises(TypeError, match="uint8 codes"):
        FourBitLinear(jnp.zeros((32, 10), jnp.int8), jnp.ones((4, 10)))


@pytest.mark.parametrize("kind", ["nf4", "int4", "nf4:dq"])
def test_cast_frozen_four_bit_changes_storage_not_the_lora_gradients(kind):
    """QLoRA: every adapted projection's base is 4-bit, the branches stay float32, and the
    outputs and LoRA gradients are those of the float32 model holding the dequantised
    weights; the parameter bytes of the 4-bit layers are under 0.3x their float32 ones
    (with 32 bits per block of scales; `nf4:dq`, double quantisation: 8 bits per block)."""
    model = _lora_model()
    cast = cast_frozen(model, kind, config=CONFIG, block_size=BLOCK)
    adapted = zoo.lora.modules(cast, zoo.lora.LoraLinear)
    assert len(adapted) == 7 and all(isinstance(node_at(cast, p).base, FourBitLinear) for p, _ in adapted.values())
    double_quant = kind.endswith(":dq")
    assert _q_proj(cast).base.kind == kind.split(":")[0] and _q_proj(cast).base.block_size == BLOCK
    assert _q_proj(cast).base.double_quant == double_quant
    np.testing.assert_array_equal(_q_proj(cast).lora_A, _q_proj(model).lora_A)
    four_bit = sum(tree_bytes(node_at(cast, p).base) for p, _ in adapted.values())
    float32 = sum(tree_bytes(node_at(model, p).base) for p, _ in adapted.values())
    assert four_bit < 0.3 * float32 + 0.5 * float32 * 4 / BLOCK, (four_bit, float32)  # scales: 32 bits per block
    # 4 bits per weight; per block of 4 a float32 scale, or its 8-bit code (+ a nested absmax and offset per layer)
    values = sum(node_at(model, p).base.weight.size for p, _ in adapted.values())
    stored = sum(node_at(cast, p).base.codes.nbytes + node_at(cast, p).base.scale.nbytes for p, _ in adapted.values())
    assert stored == values // 2 + values // BLOCK * (1 if double_quant else 4), (stored, values)
    dequantised = cast_frozen(cast, jnp.float32, config=CONFIG)
    assert isinstance(_q_proj(dequantised).base, Linear)
    batch = lm_batch(jax.random.key(3), BATCH)
    # The float32 model's programs (forward, gradients) are the same for every kind: compiled once.
    assert_rounding_close(_logits(cast, batch["tokens"]), _logits(dequantised, batch["tokens"]), **FORWARD)
    grads = {name: _lora_grads(m, batch, CONFIG)[1] for name, m in ((kind, cast), ("float32", dequantised))}
    flat = [jax.tree.leaves(g) for g in grads.values()]
    assert len(flat[0]) == len(flat[1]) == 2 * 7  # A and B of every branch: the 4-bit base has none
    for g, want in zip(*flat, strict=True):
        assert float(jnp.max(jnp.abs(want))) > 0
        assert_rounding_close(g, want, **GRADIENTS)
    # Quantising the dequantised base again gives the same codes and scales (double
    # quantisation: the same block scales within one 8-bit step, its offset a new mean).
    again = cast_frozen(dequantised, kind, config=CONFIG, block_size=BLOCK)
    np.testing.assert_array_equal(_q_proj(again).base.codes, _q_proj(cast).base.codes)
    if not double_quant:
        assert_tree_rounding_close(_q_proj(again).base, _q_proj(cast).base, terms=1, depth=1)


def test_cast_frozen_takes_the_text_form_and_loading_quantises_alike(tmp_path):
    """`cast_frozen(model, "nf4:4")` (the form `--quantize` and `RunConfig.quantize` take)
    is `cast_frozen(model, "nf4", block_size=4)`, leaf for leaf; the projections
    `from_pretrained(quantize=)` stores are `cast_frozen`'s of the same float weights (one
    quantiser for both, `zoo.nn._quantized.quantizer`), adapted or not; a block given twice
    or a bad text form is one line."""
    model = _lora_model()
    for text, dtype, block in (("nf4:4", "nf4", 4), ("int4:8", "int4", 8), ("int8", jnp.int8, None)):
        got = cast_frozen(model, text, config=CONFIG)
        want = cast_frozen(model, dtype, config=CONFIG, block_size=block)
        assert jax.tree.structure(got) == jax.tree.structure(want), text
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == w.dtype, text
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match=r"^cast_frozen: 'nf4:4' gives the block already; drop block_size=8$"):
        cast_frozen(model, "nf4:4", config=CONFIG, block_size=8)
    with pytest.raises(ValueError, match=r"^cast_frozen: quantize 'nf4:3': give nf4, int4 or int8"):
        cast_frozen(model, "nf4:3", config=CONFIG)
    with pytest.raises(ValueError, match=r"^cast_frozen: quantize 'int4:8:dq': .*nf4:dq or nf4:64:dq stores NF4's"):
        cast_frozen(model, "int4:8:dq", config=CONFIG)  # double quantisation is NF4's
    base = zoo.lora.unload(model)
    zoo.hf.save_pretrained(base, tmp_path / "base")
    loaded = zoo.hf.from_pretrained(tmp_path / "base", quantize="int4:8")
    cast = cast_frozen(add_lora(zoo.hf.from_pretrained(tmp_path / "base"), CONFIG, key=jax.random.key(1)), "int4:8")
    got, want = _q_proj(loaded), _q_proj(cast).base
    assert isinstance(got, FourBitLinear) and (got.kind, got.block_size) == ("int4", 8)
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.scale, want.scale)
    # Adapted or not, every projection of the stack is stored as loading stores it (as
    # bitsandbytes' QLoRA base): LoRA on q_proj alone leaves no float projection.
    narrow = LoraConfig(r=4, target_modules=("q_proj",))
    cast = cast_frozen(add_lora(zoo.hf.from_pretrained(tmp_path / "base"), narrow, key=jax.random.key(1)), "int4:8")
    is_layer = lambda x: isinstance(x, FourBitLinear | Linear)  # noqa: E731
    layers = {
        name: [x for x in jax.tree.leaves(tree, is_leaf=is_layer) if is_layer(x)]
        for name, tree in (("loaded", loaded), ("cast", zoo.lora.unload(cast)))
    }
    assert [type(x) for x in layers["cast"]] == [type(x) for x in layers["loaded"]]
    assert sum(isinstance(x, FourBitLinear) for x in layers["cast"]) == 7  # q, k, v, o, up, gate, down
    for got, want in zip(layers["loaded"], layers["cast"], strict=True):
        if isinstance(got, FourBitLinear):
            np.testing.assert_array_equal(got.codes, want.codes)
            np.testing.assert_array_equal(got.scale, want.scale)


def test_qdora_gradients_are_the_dequantised_models():
    """QDoRA on an NF4 base whose scales are double-quantised (DoRA's column norms read the
    dequantised weight, `float_weight`, scales from their 8-bit codes; the plain NF4 scales
    take the path every other test here takes): gradients of the dequantised float model."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "down"), use_dora=True, init_lora_weights=False)
    cast = cast_frozen(_lora_model(config), "nf4:dq", config=config, block_size=BLOCK)
    assert _q_proj(cast).base.double_quant
    dequantised = cast_frozen(cast, jnp.float32, config=config)
    batch = lm_batch(jax.random.key(3), BATCH)
    flat = [jax.tree.leaves(_lora_grads(m, batch, config)[1]) for m in (cast, dequantised)]
    assert len(flat[0]) == len(flat[1]) == 3 * 2  # A, B and the magnitude of both branches
    for g, want in zip(*flat, strict=True):
        assert float(jnp.max(jnp.abs(want))) > 0
        assert_rounding_close(g, want, **GRADIENTS)


def test_under_fsdp_quantised_bytes_are_gathered_and_the_promise_and_budget_hold():
    """The int8 and 4-bit bases are placed like the float one (codes and scales on the
    weight's axes), gathered as int8 / 4-bit bytes under FSDP, never reduced; the step's
    all-reduces are the float model's (the branches' gradients), the gradients the
    single-device ones, and each compiled step is within the fsdp preset's budget (as `zoo
    inspect --quantize ... --rules fsdp --budget` checks it: XLA's CPU backend gathers the
    bfloat16 leaves around a quantised base in float32, which the budget counts,
    `wire_itemsize`; the tied embedding is gathered once, the head reusing the lookup's
    gather). Under tensor parallelism the codes split like the weight. Double-quantised NF4
    gathers its scales' 8-bit codes (a byte per block, not 4); its nested absmax and offset
    are replicated, never gathered.

    The gradients are the compiled step's own: its optimizer `optax.trace(decay=0)` leaves
    them as its state after one step, exactly (g + 0·0), so one program per base gives the
    collectives, the budget and the gradients (an optimizer's update is elementwise on
    each shard: no collective of its own). Each base's are one device's gradients of the
    float32 model holding the weights it stores (dequantised): one reference program for
    the four bases (one device's quantised gradients are those of the dequantised model:
    test_cast_frozen_four_bit_changes_storage_not_the_lora_gradients here, and
    tests/test_quantized.py::test_int8_changes_storage_not_the_lora_gradients)."""
    model = _lora_model(tied=True)
    cast = cast_frozen(model, "nf4", config=CONFIG, block_size=BLOCK)
    double = cast_frozen(model, "nf4:dq", config=CONFIG, block_size=BLOCK)
    batch = lm_batch(jax.random.key(3), 2 * BATCH)  # 4 devices x 2 microbatches
    mesh = preset_mesh("fsdp", 4)
    colls = {}
    for name, m in (("float32", model), ("int8", cast_frozen(model, jnp.int8, config=CONFIG)), ("nf4", cast),
                    ("nf4:dq", double)):  # fmt: skip
        dequantised = cast_frozen(m, jnp.float32, config=CONFIG)  # the float model: the same structure as `model`
        assert jax.tree.structure(dequantised) == jax.tree.structure(model), name
        step = zoo.TrainStep(
            zoo.models.next_token_loss, optax.trace(decay=0.0), trainable=trainable(m, CONFIG), microbatches=2,
            preset="fsdp",
        )  # fmt: skip
        with jax.set_mesh(mesh):
            placed = zoo.shard(m, zoo.rules("fsdp"), mesh)
            opt_state = step.init(placed)
            compiled = step.compile(placed, opt_state, batch)
            colls[name] = zoo.collectives(compiled, mesh=mesh)
            # The preset's budget, checked as the step compiled (a breach raises zoo.BudgetError).
            assert step.budget_verdict.startswith("within the fsdp budget"), step.budget_verdict
            grads = compiled(placed, opt_state, batch)[1].trace
        bound = dict(GRADIENTS, terms=2 * GRADIENTS["terms"])
        got = jax.tree.leaves(grads)
        want = jax.tree_util.tree_leaves_with_path(_lora_grads(dequantised, batch, CONFIG)[1])
        assert len(got) == len(want) == 2 * 7, name  # A and B of every branch: the bases have none
        for g, (path, w) in zip(got, want, strict=True):
            where = f"{name}{jax.tree_util.keystr(path)}"
            assert g.shape == w.shape, where
            assert_rounding_close(g, w, **bound, what=where)
    assert "data" in str(_q_proj(placed).base.codes.sharding.spec)
    # In the layers' scan each base weight is gathered for its use: V float32 values in the
    # float model, V/2 bytes of codes plus a float32 scale per block in the 4-bit one (the
    # embeddings and branches gathered alike in both); int8 moves fewer bytes in all.
    gathered = {k: sum(c.bytes for c in v if c.kind == "all-gather" and c.in_loop) for k, v in colls.items()}
    layers = model.layers.layers
    values = sum(
        node_at(layers, p).base.weight[0].size for p, _ in zoo.lora.modules(layers, zoo.lora.LoraLinear).values()
    )
    assert gathered["nf4"] == gathered["float32"] - 4 * values + values // 2 + 4 * values // BLOCK, gathered
    assert gathered["nf4:dq"] == gathered["float32"] - 4 * values + values // 2 + values // BLOCK, gathered
    assert _q_proj(placed).base.scale_absmax.sharding.is_fully_replicated and _q_proj(placed).base.double_quant
    every = {k: sum(c.bytes for c in v if c.kind == "all-gather") for k, v in colls.items()}
    assert 0 < every["int8"] < 0.6 * every["float32"], every
    reduced = {k: [(c.in_loop, c.bytes) for c in v if c.kind == "all-reduce"] for k, v in colls.items()}
    assert (
        reduced["nf4:dq"] == reduced["nf4"] == reduced["int8"] == reduced["float32"]
    )  # the float model's, pinned per preset by test_presets.py
    tp = preset_mesh("tp", 4)
    with jax.set_mesh(tp):
        rules = zoo.rules("tp")
        # The float model's placement read from its abstract form (nothing placed).
        placed, ref = zoo.shard(double, rules, tp), zoo.shard(eqx.filter_eval_shape(lambda: model), rules, tp)
        for proj in ("q_proj", "o_proj"):
            got, want = getattr(placed.layers.layers.attention, proj), getattr(ref.layers.layers.attention, proj)
            assert got.base.codes.sharding.spec == got.base.scale.sharding.spec == want.base.weight.sharding.spec
        out = _logits(placed, jax.device_put(batch["tokens"], P("data", None)))
    assert_rounding_close(out, _logits(double, batch["tokens"]), **FORWARD)


def test_four_bit_bases_refuse_what_cannot_hold_and_merge_by_dequantising(tmp_path):
    model = _lora_model()
    with pytest.raises(ValueError, match=r"cast_frozen\(model, 'nf4'\) at layers.*block of 64 .*pass block_size="):
        cast_frozen(model, "nf4", config=CONFIG)  # 64 does not divide the 16 inputs
    with pytest.raises(ValueError, match="block_size is for dtype 'nf4' or 'int4'"):
        cast_frozen(model, jnp.int8, config=CONFIG, block_size=4)
    cast = cast_frozen(model, "nf4", config=CONFIG, block_size=BLOCK)
    with pytest.raises(ValueError, match="into an nf4 base.*unload=True"):
        zoo.lora.merge(cast, unload=False)
    pissa = LoraConfig(r=2, target_modules=("q_proj",), init_lora_weights="pissa")
    plain = zoo.lora.unload(cast)
    assert isinstance(_q_proj(plain), FourBitLinear)
    with pytest.raises(ValueError, match=r"which is nf4: .*cast_frozen\(model, 'nf4'"):
        add_lora(plain, pissa, key=jax.random.key(2))
    merged = zoo.lora.merge(cast)  # unload=True: the float32 weight plus the branch
    assert isinstance(_q_proj(merged), Linear) and _q_proj(merged).weight.dtype == jnp.float32
    base, delta = _q_proj(cast).base.dequantized_weight(), _q_proj(cast).delta()
    np.testing.assert_allclose(_q_proj(merged).weight, base + delta, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"are int8 or 4-bit .*FourBitLinear.*zoo.nn.dequantize"):
        zoo.hf.save_pretrained(plain, tmp_path / "out")
    zoo.hf.save_pretrained(merged, tmp_path / "merged")  # merging dequantises
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_finetune_quantize_trains_on_the_four_bit_base_and_readers_load_it(llama_dir, data_files, tmp_path):
    """`zoo finetune --quantize nf4:16:dq`: the run trains LoRA on an NF4 base (its scales
    double-quantised; plain `nf4:16` runs in the several-adapters test), writes the
    setting in config.json, and `load_run` (predict, eval, generate) rebuilds that base
    under the adapter; a block that does not fit, a full-weight run and an unknown kind are
    one line each, naming the fix."""
    from helpers import one_line_error, zoo_main
    from tiny_runs import TINY

    run = tmp_path / "qlora"
    common = ["finetune", "transformer", "--init", llama_dir, "--data", data_files["chat"], "--lora", "r=4,alpha=8",
              *TINY, "--steps", "2", "--lr", "1e-2"]  # fmt: skip
    rc, _, err = zoo_main(*common, "--quantize", "nf4:16:dq", "--output", run)
    assert rc == 0, err
    assert json.loads((run / "config.json").read_text())["quantize"] == "nf4:16:dq"
    loaded = zoo.train.load_run(run)
    q_proj = _q_proj(loaded.model)
    assert isinstance(q_proj.base, FourBitLinear) and q_proj.base.kind == "nf4" and q_proj.base.block_size == 16
    assert q_proj.base.double_quant and q_proj.base.scale.dtype == jnp.uint8
    assert q_proj.lora_A.dtype == jnp.float32
    rc, _, err = zoo_main(*common, "--quantize", "nf4", "--output", tmp_path / "bad")
    one_line_error(rc, err, "--quantize nf4: cast_frozen(model, 'nf4') at layers.layers.attention.q_proj")
    assert "pass --quantize nf4:BLOCK, BLOCK one of [16, 32]" in err and not (tmp_path / "bad").exists()
    rc, _, err = zoo_main(*common, "--quantize", "fp4", "--output", tmp_path / "bad")
    one_line_error(rc, err, "--quantize 'fp4': give nf4, int4 or int8")
    with pytest.raises(zoo.train.ConfigError, match="stores the frozen base of LoRA adapters"):
        zoo.train.RunConfig(model="transformer", quantize="int8").resolved("train")
    # zoo generate RUN: the adapter on the NF4 base it trained on, as load_run builds it (one
    # call: its streamed text and its stderr line; each call compiles a decoding program).
    rc, out, err = zoo_main("generate", run, "--prompt", "the cat", "--max-new-tokens", 3)
    assert rc == 0 and "on its nf4 base" in err, err
    tokenizer = zoo.hf.Tokenizer.from_pretrained(llama_dir)
    tokens = tokenizer(["the cat"])["tokens"]
    ids = np.asarray(zoo.generate(loaded.model, tokens, max_new_tokens=3))[0, tokens.shape[1] :].tolist()
    ids = ids[: ids.index(2)] if 2 in ids else ids  # config.json's eos ends the text
    assert out == "the cat" + tokenizer.decode(ids) + "\n"


def test_several_adapters_train_on_one_nf4_base_and_each_is_the_dequantised_models(llama_dir, data_files, tmp_path):
    """`zoo finetune --quantize nf4:16 --data alpha=...,beta=...`: both named adapters train
    on one NF4 base, a step, then one more after `--resume` (its checkpoint restored onto
    that base); `load_run` rebuilds it (codes of the float base's weights, the same
    bytes), and each adapter routed through the stacked model gives the logits of the float
    model holding the dequantised weights with that adapter alone (rounding bound);
    `zoo generate --adapter RUN/adapter/NAME` decodes on that base, `zoo export --merge
    --adapter NAME` writes the merged dequantised model transformers opens."""
    import shutil

    import torch
    import transformers
    from helpers import one_line_error, zoo_main
    from tiny_runs import FORWARD, TINY

    run = tmp_path / "two"
    data = f"alpha={data_files['text']},beta={data_files['chat']}"
    # LoRA as the single-adapter run above sets it (rank 4, alpha 8): one program adds the branches to both.
    rc, _, err = zoo_main("finetune", "transformer", "--init", llama_dir, "--data", data, *TINY, "--steps", "1",
                          "--lora", "r=4,alpha=8", "--lr", "1e-1", "--quantize", "nf4:16", "--checkpoint-every", "1", "--output", run)  # fmt: skip
    assert rc == 0, err
    # Continued (--resume): the step-1 checkpoint restored onto the same quantised, stacked base.
    rc, _, err = zoo_main("finetune", "--output", run, "--resume", "--steps", "2", "--devices", "2")
    assert rc == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == [1, 2]
    assert json.loads((run / "config.json").read_text())["quantize"] == "nf4:16"
    loaded = zoo.train.load_run(run)
    q_proj = _q_proj(loaded.model)
    assert isinstance(q_proj, zoo.lora.MultiLoraLinear) and q_proj.names == ("alpha", "beta")
    assert isinstance(q_proj.base, FourBitLinear) and (q_proj.base.kind, q_proj.base.block_size) == ("nf4", 16)
    float_base = zoo.hf.from_pretrained(llama_dir)
    want_codes = FourBitLinear.quantize(_q_proj(float_base), "nf4", block_size=16)
    np.testing.assert_array_equal(np.asarray(q_proj.base.codes), np.asarray(want_codes.codes))
    tokens = np.array([[1, 6, 8, 10, 12, 6, 14], [1, 7, 9, 11, 13, 7, 15]], np.int32)
    forward = eqx.filter_jit(lambda m: m(tokens))  # one program per model, not one per op
    logits, want = {}, {}
    for k, name in enumerate(("alpha", "beta")):
        alone, lora = zoo.lora.load_adapter(float_base, run / "adapter" / name)
        # The float model: the base's weights as NF4 holds them, the other frozen leaves as stored.
        want_model = zoo.nn.dequantize(cast_frozen(alone, "nf4", config=lora, block_size=16))
        assert not any(isinstance(x, FourBitLinear) for x in jax.tree.leaves(want_model, is_leaf=eqx.is_array))
        want[name] = np.asarray(forward(want_model))
        logits[name] = np.asarray(forward(zoo.lora.route(loaded.model, [k, k])))
        assert_rounding_close(logits[name], want[name], **FORWARD, what=f"adapter {name} on NF4 vs dequantised")
    assert np.abs(logits["alpha"] - logits["beta"]).max() > 1e-4  # two adapters, two models
    # zoo generate RUN --adapter RUN/adapter/alpha: that adapter on the NF4 base, as load_run
    # builds it (one call: its streamed text and its stderr line).
    rc, out, err = zoo_main("generate", run, "--adapter", run / "adapter" / "alpha", "--prompt", "the cat",
                            "--max-new-tokens", 3)  # fmt: skip
    assert rc == 0 and "on its nf4 base" in err, err
    tokenizer = zoo.hf.Tokenizer.from_pretrained(llama_dir)
    prompt = tokenizer(["the cat"])["tokens"]
    ids = np.asarray(zoo.generate(zoo.lora.adapter(loaded.model, "alpha"), prompt, max_new_tokens=3))
    ids = ids[0, prompt.shape[1] :].tolist()
    assert out == "the cat" + tokenizer.decode(ids[: ids.index(2)] if 2 in ids else ids) + "\n"
    rc, _, err = zoo_main("serve", run, "--port", "0")  # how to serve them all: on the base they trained on
    one_line_error(rc, err, f"--adapter alpha={run / 'adapter' / 'alpha'} for each, BASE its config.json's init with ")
    assert "with --quantize nf4:16, as they trained" in err, err
    # zoo export RUN --merge --adapter beta: the dequantised base with beta merged, in transformers.
    rc, _, err = zoo_main("export", run, "--merge", "--adapter", "beta", "--output", tmp_path / "beta")
    assert rc == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "beta", torch_dtype=torch.float32)
    with torch.no_grad():
        exported = hf(torch.from_numpy(tokens).long()).logits.numpy()
    assert_rounding_close(exported, want["beta"], **FORWARD, what="merged adapter beta in transformers")
    # A run stopped before its end (no adapter/): its checkpoint's adapters on the same NF4 base.
    shutil.rmtree(run / "adapter")
    stopped = zoo.train.load_run(run)
    assert "checkpoints" in stopped.weights and isinstance(_q_proj(stopped.model).base, FourBitLinear)
    for k, name in enumerate(("alpha", "beta")):
        np.testing.assert_array_equal(np.asarray(forward(zoo.lora.route(stopped.model, [k, k]))), logits[name])


@pytest.fixture(scope="module")
def llama_64(tmp_path_factory):
    """A random Llama saved by transformers whose widths (64, 128) hold bitsandbytes'
    blocks of 64 inputs within each row, as real models' do (the tests only read it)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("llama-64")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return folder


def _float32_bnb(model):
    """`model` with bitsandbytes' 4-bit layers on their float32 path (dequantise, then
    matmul in `bnb_4bit_compute_dtype`): on a CPU with AVX512-BF16, bitsandbytes' inference
    forward otherwise repacks the weights for a fused kernel that computes in bfloat16
    (`Linear4bit.support_avx512bf16_for_cpu`), ~2e-3 away on these logits, whatever the
    compute dtype asked. Machines without it take the float32 path already."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


@pytest.mark.numerics
def test_peft_opens_a_zoo_adapter_on_bitsandbytes_nf4_base_and_zoo_a_peft_one(llama_64, tmp_path):
    """QLoRA across libraries: transformers loads a Llama with bitsandbytes' NF4
    (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, blocks of 64, as
    zoo's default) and peft puts zoo's adapter (trained on zoo's NF4 base) on it: the same
    logits. The reverse: peft's adapter on that base, loaded by zoo onto its NF4 base."""
    import peft
    import torch
    import transformers

    bnb = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )

    def bnb_base():
        return _float32_bnb(
            transformers.AutoModelForCausalLM.from_pretrained(
                llama_64, quantization_config=bnb, device_map="cpu"
            ).eval()
        )

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = add_lora(zoo.hf.from_pretrained(llama_64), config, key=jax.random.key(1))
    # The bases in NF4, every other leaf float32 as transformers keeps them (cast_frozen
    # would store those in bfloat16).
    paths = [p for p, _ in zoo.lora.modules(model, zoo.lora.LoraLinear).values()]
    nf4 = eqx.tree_at(
        lambda m: [node_at(m, p).base for p in paths],
        model,
        replace=[FourBitLinear.quantize(node_at(model, p).base, "nf4") for p in paths],
    )
    tokens = np.array([[1, 5, 9, 2, 33, 7, 60, 4], [3, 3, 8, 41, 12, 0, 17, 9]])

    logits = eqx.filter_jit(lambda m: m(tokens))  # one program per model, not one per op

    def close(ours, theirs, what):
        ours, theirs = np.asarray(ours), theirs.detach().numpy()
        assert np.abs(ours - theirs).max() <= 1e-4 * max(1.0, np.abs(theirs).max()), what

    zoo.lora.save_adapter(nf4, config, tmp_path / "zoo-adapter")
    opened = peft.PeftModel.from_pretrained(bnb_base(), tmp_path / "zoo-adapter").eval()
    assert "Linear4bit" in type(opened.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__
    with torch.no_grad():
        close(logits(nf4), opened(torch.tensor(tokens)).logits, "zoo's QLoRA adapter in peft on bitsandbytes' NF4")
    # The NF4 base alone matters: on the float base the same adapter gives other logits.
    with torch.no_grad():
        theirs = opened(torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(logits(model)) - theirs).max() > 1e-3
    # The reverse: a peft adapter (random B) made on bitsandbytes' base, loaded by zoo onto its NF4 base.
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(bnb_base(), lora).eval()
    theirs.save_pretrained(tmp_path / "peft-adapter")
    plain = zoo.lora.unload(nf4)
    assert isinstance(_q_proj(plain), FourBitLinear)
    loaded, _ = zoo.lora.load_adapter(plain, tmp_path / "peft-adapter")
    assert isinstance(_q_proj(loaded).base, FourBitLinear)
    with torch.no_grad():
        close(logits(loaded), theirs(torch.tensor(tokens)).logits, "peft's QLoRA adapter in zoo on zoo's NF4")


def test_generate_and_serve_quantize_the_base_as_they_load(llama_dir, tmp_path):
    """`zoo generate SOURCE --quantize nf4:16:dq` (NF4, its scales double-quantised)
    continues a prompt as zoo.generate does with `from_pretrained(SOURCE,
    quantize="nf4:16:dq")` (and says so on stderr), whose projections are
    `FourBitLinear.quantize(..., double_quant=True)`'s of the float ones; `zoo serve`'s
    engine on that base gives zoo.generate's tokens for the base and for a LoRA adapter on
    it; a kind that is none is one line naming --quantize."""
    from helpers import one_line_error, zoo_main

    from zoo.serve import Engine, Request

    prompt = "the cat sat on"
    rc, out, err = zoo_main("generate", llama_dir, "--prompt", prompt, "--max-new-tokens", 5, "--quantize", "nf4:16:dq")
    assert rc == 0, err
    assert "its projections nf4" in err
    model = zoo.hf.from_pretrained(llama_dir, quantize="nf4:16:dq")
    assert isinstance(model.layers.layers.attention.q_proj, FourBitLinear)
    want = FourBitLinear.quantize(_q_proj(zoo.hf.from_pretrained(llama_dir)), "nf4", block_size=16, double_quant=True)
    assert jax.tree.structure(_q_proj(model)) == jax.tree.structure(want) and _q_proj(model).double_quant
    for got, leaf in zip(jax.tree.leaves(_q_proj(model)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, leaf)
    tokenizer = zoo.hf.Tokenizer.from_pretrained(llama_dir)
    tokens = tokenizer([prompt])["tokens"]
    ids = np.asarray(zoo.generate(model, tokens, max_new_tokens=5))[0, tokens.shape[1] :].tolist()
    ids = ids[: ids.index(2)] if 2 in ids else ids  # config.json's eos ends the text
    assert out == prompt + tokenizer.decode(ids) + "\n"

    # The engine serves the 4-bit base and a LoRA adapter on it (float branches) side by side.
    config = zoo.lora.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    adapted = zoo.lora.add_lora(model, config, key=jax.random.key(1))
    adapted = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "lora_B" in jax.tree_util.keystr(p) else x, adapted
    )  # B = 0 would be the base
    zoo.lora.save_adapter(adapted, config, tmp_path / "adapter")
    engine = Engine(model, slots=2, max_len=32, adapters={"tuned": tmp_path / "adapter"})
    handles = [engine.submit(Request(tokens[0].tolist(), max_tokens=5, adapter=a)) for a in (None, "tuned")]
    engine.run_until_done()
    for handle, served in zip(handles, (model, adapted), strict=True):
        assert handle.ids == np.asarray(zoo.generate(served, tokens, max_new_tokens=5))[0, tokens.shape[1] :].tolist()

    rc, _, err = zoo_main("generate", llama_dir, "--prompt", prompt, "--quantize", "fp4")
    one_line_error(rc, err, "--quantize: quantize 'fp4': give nf4, int4 or int8")


@pytest.mark.numerics
@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "float-absmax"])
def test_a_checkpoint_transformers_saved_in_nf4_loads_with_its_codes(llama_64, tmp_path, double_quant):
    """A model transformers saved with a bitsandbytes 4-bit NF4 `quantization_config` (a
    QLoRA base, as `*-bnb-4bit` checkpoints are): `from_pretrained` reads it into NF4
    `FourBitLinear`s whose dequantised weights are bitsandbytes' `dequantize_4bit`, bit for
    bit, and gives transformers' logits. Double-quantised scales stay so: the file's 8-bit
    codes, nested absmax and offset, the layer's state; `quantize="nf4:64"` expands them to
    float32 (the same weights)."""
    import bitsandbytes.functional as bnb_functional
    import torch
    import transformers

    bnb = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    theirs = _float32_bnb(
        transformers.AutoModelForCausalLM.from_pretrained(llama_64, quantization_config=bnb, device_map="cpu").eval()
    )
    theirs.save_pretrained(tmp_path / "nf4")
    ours = zoo.hf.from_pretrained(tmp_path / "nf4")
    for i, layer in enumerate(theirs.model.layers):
        attention = [
            (ours.layers.layers.attention, layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        mlp = [(ours.layers.layers.mlp, layer.mlp, n) for n in ("gate", "up", "down")]
        for zoo_part, torch_part, name in attention + mlp:
            mine = getattr(zoo_part, name)
            assert isinstance(mine, FourBitLinear) and mine.kind == "nf4" and mine.block_size == 64
            assert mine.double_quant == double_quant and mine.scale.dtype == (
                jnp.uint8 if double_quant else jnp.float32
            )
            w = getattr(torch_part, name if name.endswith("_proj") else f"{name}_proj").weight
            want = bnb_functional.dequantize_4bit(w.data, w.quant_state).numpy()
            assert np.array_equal(np.asarray(mine.dequantized_weight())[i].T, want), f"layer {i} {name}"
            if double_quant:  # bitsandbytes' nested state, as it holds it
                state = w.quant_state
                np.testing.assert_array_equal(np.asarray(mine.scale[i]).T.reshape(-1), state.absmax.numpy())
                np.testing.assert_array_equal(mine.scale_absmax[i], state.state2.absmax.numpy())
                assert float(mine.scale_offset[i]) == state.offset.item()
                assert mine.scale_code0 == float(state.state2.code[0])
    if double_quant:
        expanded = zoo.hf.from_pretrained(tmp_path / "nf4", quantize="nf4:64")
        q_proj = expanded.layers.layers.attention.q_proj
        assert not q_proj.double_quant and q_proj.scale.dtype == jnp.float32
        np.testing.assert_array_equal(
            q_proj.dequantized_weight(), ours.layers.layers.attention.q_proj.dequantized_weight()
        )
    tokens = np.array([[1, 5, 9, 2, 33, 7, 60, 4]])
    with torch.no_grad():
        want = theirs(torch.tensor(tokens)).logits.numpy()
    assert_rounding_close(ours(tokens), want, **FORWARD, what="logits of the NF4 checkpoint")
    # 8-bit checkpoints and other methods are named, with the way to load the model.
    values = json.loads((tmp_path / "nf4" / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (tmp_path / "nf4" / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"8-bit \(LLM.int8\) checkpoint, .* quantize='int8'"):
        zoo.hf.from_pretrained(tmp_path / "nf4")
