"""The performance changes keep exact semantics: `zoo.nn.project`'s flattened matmul, the
bfloat16 frozen base (`zoo.lora.cast_frozen`), and the persistent compilation cache."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_rounding_close,
    assert_tree_rounding_close,
    largest,
    lm_batch,
    preset_mesh,
    rounding_bound,
    storage_bound,
    storage_errors,
    tiny_decoder,
    tree_bytes,
)
from jax.sharding import PartitionSpec as P

import zoo
from zoo.lora import LoraConfig, add_lora, cast_frozen, trainable

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
BATCH = 8
# The tiny decoder's float32 sums (helpers.rounding_bound): a loss's and gradients' longest
# is over the batch's 8 x 8 tokens; 2 layers of ~6 chained sums plus the head forward,
# gradients twice that.
FORWARD = {"terms": 32, "depth": 2 * 6 + 1}
GRADIENTS = {"terms": BATCH * 8, "depth": 2 * FORWARD["depth"]}


def _einsum_project(x, w):
    return jnp.einsum("...i,io->...o", x, w)


def test_project_is_the_einsum_with_its_gradients():
    """The flattened 2-D matmul gives the einsum's values and gradients, for 2-D, 3-D and
    4-D inputs, including the rank-r factor chain of a LoRA branch."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(k1, (16, 4))
    b = jax.random.normal(k2, (4, 24))
    for shape in [(6, 16), (3, 5, 16), (2, 3, 5, 16)]:
        x = jax.random.normal(k3, shape)

        def branch(f):
            return lambda x_, a, b: jnp.sum(jnp.sin(f(f(x_, a), b)))

        # Compiled: one program per shape each (eagerly, every operation of the gradients compiles).
        got = jax.jit(jax.grad(branch(zoo.nn.project), argnums=(0, 1, 2)))(x, a, b)
        want = jax.jit(jax.grad(branch(_einsum_project), argnums=(0, 1, 2)))(x, a, b)
        assert zoo.nn.project(x, a).shape == shape[:-1] + (4,)
        # sin(x a b) and its gradients: two matmuls (<= 24 wide, or a sum over <= 30 rows)
        # forward, two back.
        for g, w in zip(got, want):
            assert_rounding_close(g, w, terms=30, depth=4)


@pytest.mark.parametrize("preset", ["dp", "tp"])
def test_project_keeps_the_sharding_under_a_mesh(preset):
    """Under a mesh the flattened matmul returns the einsum's sharding (batch on `data`,
    a column-parallel output on `model`) and its values."""
    mesh = preset_mesh(preset, 4)
    x = jax.random.normal(jax.random.key(0), (4, 3, 8))
    w = jax.random.normal(jax.random.key(1), (8, 6))
    out_axis = "model" if preset == "tp" else None
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", None, None))
        ws = jax.device_put(w, P(None, out_axis))
        y = jax.jit(zoo.nn.project)(xs, ws)
        assert jax.typeof(y).sharding.spec == P("data", None, out_axis)
    # One 8-term dot per output, in another order: at its sum of |terms|.
    assert_rounding_close(y, _einsum_project(x, w), terms=8, scale=largest(jnp.abs(x) @ jnp.abs(w)))


def test_exact_gelu_values_and_derivatives_are_jax_nn_gelu():
    """The exact GELU with its one-residual derivative: same values as
    `jax.nn.gelu(approximate=False)`, same first and second derivatives up to rounding."""
    from zoo.nn._feedforward import gelu_exact

    x = jnp.linspace(-6.0, 6.0, 101)
    ref = lambda x: jax.nn.gelu(x, approximate=False)
    np.testing.assert_array_equal(gelu_exact(x), ref(x))
    for order in (1, 2):
        got, want = gelu_exact, ref
        for _ in range(order):
            got, want = jax.grad(lambda x, f=got: jnp.sum(f(x))), jax.grad(lambda x, f=want: jnp.sum(f(x)))
        # Elementwise formulas of the derivatives (erf, exp, ~8 products and sums), of
        # values no larger than the derivative's largest.
        assert_rounding_close(got(x), want(x), terms=1, depth=8)


def _lora_model():
    return add_lora(tiny_decoder(jax.random.key(0)), CONFIG, key=jax.random.key(1))


def _dp_step(model):
    batch = lm_batch(jax.random.key(3), BATCH)
    mesh = preset_mesh("dp", 4)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules("dp"), mesh)
        step = zoo.TrainStep(zoo.models.next_token_loss, optax.adamw(1e-2), trainable=trainable(model, CONFIG))
        opt_state = step.init(placed)
        compiled = step.compile(placed, opt_state, batch)
        new, _, loss = compiled(placed, opt_state, batch)
        _, grads = step.loss_and_grads(placed, batch)
    _, single = step.loss_and_grads(model, batch)  # no mesh: one device
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(single))
    assert_tree_rounding_close(grads, single, **GRADIENTS)  # 4 devices = 1 device
    return new, float(loss), zoo.collectives(compiled, mesh=mesh), step.partition(placed)[0]


def test_cast_frozen_stores_the_base_in_bfloat16_and_keeps_the_branches():
    model = _lora_model()
    cast = cast_frozen(model, config=CONFIG)
    train = jax.tree.leaves(trainable(model, CONFIG))
    leaves = jax.tree.leaves(model)
    cast_leaves = jax.tree.leaves(cast)
    assert any(train) and not all(train)
    for t, old, new in zip(train, leaves, cast_leaves):
        assert new.dtype == (jnp.float32 if t else jnp.bfloat16)
        if t:
            np.testing.assert_array_equal(new, old)
    frozen = eqx.filter(model, jax.tree.map(lambda t: not t, trainable(model, CONFIG)))
    assert tree_bytes(cast) == tree_bytes(model) - tree_bytes(frozen) // 2
    # Same output up to bfloat16 rounding of the weights (compute stays float32).
    tokens = lm_batch(jax.random.key(3), BATCH)["tokens"]
    ref, got = eqx.filter_jit(lambda m: m(tokens))(model), eqx.filter_jit(lambda m: m(tokens))(cast)
    assert got.dtype == jnp.float32
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(ref))
    bound = storage_bound(lambda m: m(tokens), model, storage_errors(model, CONFIG, jnp.bfloat16))
    bound += rounding_bound(largest(ref), **FORWARD)
    assert 0 < diff.max() and np.all(diff <= bound), (diff.max(), np.max(diff / bound))


@pytest.fixture(scope="module")
def float32_step():
    """The float32 model with random branches and its dp step's (loss, collectives): the
    reference both cast dtypes compare against, compiled and run once."""
    random_branches = dataclasses.replace(CONFIG, init_lora_weights=False)
    model = add_lora(tiny_decoder(jax.random.key(0)), random_branches, key=jax.random.key(1))
    _, ref_loss, ref_colls, _ = _dp_step(model)
    return model, ref_loss, ref_colls


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_cast_frozen_step_has_the_same_single_all_reduce_and_leaves_the_base_alone(dtype, float32_step):
    """A bfloat16 or int8 base: the same collectives as the float32 model's, in kind, place
    and bytes (the frozen base is never communicated), the frozen leaves bit-identical, and
    the 4-device gradients those of one device (random branches: no zero gradient)."""
    model, ref_loss, ref_colls = float32_step
    cast = cast_frozen(model, dtype, config=CONFIG)
    new, loss, colls, params = _dp_step(cast)
    assert [(c.kind, c.in_loop, c.bytes) for c in colls] == [(c.kind, c.in_loop, c.bytes) for c in ref_colls]
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1 and zoo.count(colls, in_loop=True, kind=None) == 0
    assert colls[0].bytes == tree_bytes(params) + 8  # the float32 adapters (+ loss, count)
    batch = lm_batch(jax.random.key(3), BATCH)

    def mean_loss(m):
        sums, counts = zoo.models.next_token_loss(m, batch)
        return sums.sum() / counts.sum()

    bound = storage_bound(mean_loss, model, storage_errors(model, CONFIG, dtype))
    assert abs(loss - ref_loss) <= bound + rounding_bound(abs(ref_loss), **GRADIENTS), (loss, ref_loss, bound)
    train = jax.tree.leaves(trainable(cast, CONFIG))
    assert any(x.dtype == dtype for t, x in zip(train, jax.tree.leaves(cast)) if not t)
    for t, old, upd in zip(train, jax.tree.leaves(cast), jax.tree.leaves(new), strict=True):
        assert upd.dtype == old.dtype
        if not t:
            np.testing.assert_array_equal(np.asarray(upd), np.asarray(old))


def test_cast_frozen_refuses_bad_input():
    model = _lora_model()
    with pytest.raises(ValueError, match="'int3' is not a dtype; use .*jnp.int8, 'nf4' or 'int4'"):
        cast_frozen(model, "int3", config=CONFIG)
    with pytest.raises(ValueError, match="no LoRA branches.*add_lora"):
        cast_frozen(tiny_decoder(jax.random.key(0)))


_CACHE_SCRIPT = textwrap.dedent(
    """
    import sys, time, jax, jax.numpy as jnp
    import zoo
    hits = []
    jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
    assert zoo.enable_compilation_cache(sys.argv[1], min_compile_time_secs=0) is not None
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() + 1.0)
    t = time.perf_counter()
    compiled = f.lower(jnp.ones((32, 16))).compile()
    print("hits", len(hits), "seconds", time.perf_counter() - t)
    """
)


def test_compilation_cache_second_run_hits(tmp_path):
    """Two identical processes: the first writes the compiled program to the folder, the
    second loads it (jax's cache-hit event); ZOO_NO_COMPILE_CACHE=1 turns it off."""
    folder = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "ZOO_NO_COMPILE_CACHE"}

    def run(extra_env=None):
        out = subprocess.run(
            [sys.executable, "-c", _CACHE_SCRIPT, str(folder)],
            env=env | (extra_env or {}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        return out

    first = run()
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[:2] == ["hits", "0"]
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files, "the first run wrote no cache entry"
    second = run()
    assert second.returncode == 0, second.stderr
    # The jitted function and the small programs behind `jnp.ones` all load from the cache.
    assert second.stdout.split()[0] == "hits" and int(second.stdout.split()[1]) >= 1, second.stdout
    off = run({"ZOO_NO_COMPILE_CACHE": "1"})
    assert off.returncode != 0 and "AssertionError" in off.stderr  # enable_... returned None


def test_compilation_cache_folder_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert zoo.default_cache_dir() == tmp_path / "zoo" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert zoo.default_cache_dir() == tmp_path / "home" / ".cache" / "zoo" / "jax"
    # Turned off by ZOO_NO_COMPILE_CACHE=1, whatever the arguments: nothing is configured.
    monkeypatch.setenv("ZOO_NO_COMPILE_CACHE", "1")
    assert zoo.enable_compilation_cache(tmp_path / "unused") is None
    assert not (tmp_path / "unused").exists()


# -- fewer residuals for the backward pass (docs/performance.md) ------------------------------


def _plain_softmax(x):
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _plain_standardize(x, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + eps)


def _plain_rms_scale(x, eps):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _derivatives_agree(got, want, x, order=2):
    """Values equal; gradients of a weighted sum (orders 1..order) equal up to rounding:
    a 12-wide function (two sums over the last axis and ~4 elementwise roundings), its
    derivatives each chaining as many again."""
    sums = {"terms": 12, "depth": 4}
    # Each side compiled whole (eagerly, every operation of each derivative compiles).
    assert_rounding_close(jax.jit(got)(x), jax.jit(want)(x), **sums)
    w = jax.random.normal(jax.random.key(9), want(x).shape)
    g, f = got, want
    for k in range(1, order + 1):
        g, f = (jax.grad(lambda x, h=h: jnp.sum(jnp.sin(h(x)) * w)) for h in (g, f))
        assert_rounding_close(jax.jit(g)(x), jax.jit(f)(x), terms=sums["terms"], depth=(k + 1) * sums["depth"])


@pytest.mark.parametrize("name", ["softmax", "standardize", "rms_scale", "silu"])
def test_one_residual_functions_are_the_formulas(name):
    """Softmax, the two norms' cores and SiLU with their own derivatives: the formulas'
    values, first and second derivatives (the masked softmax rows, at the float32 minimum,
    included)."""
    from zoo.nn._attention import softmax
    from zoo.nn._feedforward import silu
    from zoo.nn._norm import rms_scale, standardize

    x = 3 * jax.random.normal(jax.random.key(0), (4, 5, 12))
    pairs = {
        "softmax": (softmax, _plain_softmax),
        "standardize": (lambda x: standardize(x, 1e-5), lambda x: _plain_standardize(x, 1e-5)),
        "rms_scale": (lambda x: rms_scale(x, 1e-6), lambda x: _plain_rms_scale(x, 1e-6)),
        "silu": (silu, jax.nn.silu),
    }
    got, want = pairs[name]
    _derivatives_agree(got, want, x)
    if name == "softmax":
        masked = x.at[..., 7:].add(jnp.finfo(jnp.float32).min)
        np.testing.assert_array_equal(got(masked), jax.nn.softmax(masked, axis=-1))
        assert float(jnp.max(got(masked)[..., 7:])) == 0.0


def _plain_versions(monkeypatch):
    """Patch zoo's layers back to the formulas differentiated as written."""
    import zoo.nn._attention as attention
    import zoo.nn._feedforward as feedforward
    import zoo.nn._linear as linear
    import zoo.nn._norm as norm

    monkeypatch.setattr(attention, "softmax", _plain_softmax)
    monkeypatch.setattr(norm, "standardize", _plain_standardize)
    monkeypatch.setattr(norm, "rms_scale", _plain_rms_scale)
    monkeypatch.setattr(norm, "like_rows", zoo.nn.broadcast_like)
    monkeypatch.setitem(feedforward._ACTIVATIONS, "swiglu", jax.nn.silu)
    monkeypatch.setattr(attention, "flatten_rows", lambda x: (x, lambda y: y))
    monkeypatch.setattr(feedforward, "flatten_rows", lambda x: (x, lambda y: y))
    del linear


def _lora_grads(model, batch, loss_fn):
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = add_lora(model, config, key=jax.random.key(5))
    step = zoo.TrainStep(loss_fn, optax.sgd(0.1), trainable=trainable(model, config))
    loss, grads = step.loss_and_grads(model, batch)
    full = zoo.TrainStep(loss_fn, optax.sgd(0.1), trainable=eqx.is_inexact_array)
    full_loss, full_grads = full.loss_and_grads(model, batch)
    return float(loss), grads, float(full_loss), full_grads


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_fewer_residuals_keep_the_gradients(family, monkeypatch):
    """A decoder (RoPE, GQA, SwiGLU, RMSNorm, padding mask) and an encoder (LayerNorm, exact
    GELU, padding mask): losses and gradients (LoRA-only and full) equal those of the same
    layers written as plain formulas (no custom derivatives, one flattening per projection,
    a full-size broadcast of the norm scales)."""
    from helpers import classification_batch, tiny_encoder_classifier

    if family == "decoder":
        model, batch, loss_fn = (
            tiny_decoder(jax.random.key(0)),
            lm_batch(jax.random.key(3), 4),
            zoo.models.next_token_loss,
        )
    else:
        model = tiny_encoder_classifier(jax.random.key(0), dropout=0.0)
        batch = {k: v for k, v in classification_batch(jax.random.key(3), 4).items() if k != "dropout_key"}
        loss_fn = zoo.models.classification_loss
    got = _lora_grads(model, batch, loss_fn)
    _plain_versions(monkeypatch)
    want = _lora_grads(model, batch, loss_fn)
    # The same math with other derivative formulas and flattenings: rounding in another
    # order, over 4 x 8 tokens (the longest sum, with the 32-wide MLP's).
    sums = {"terms": 4 * 8, "depth": GRADIENTS["depth"]}
    for g, w in zip(got, want):
        if isinstance(g, float):
            assert_rounding_close(g, w, terms=sums["terms"], depth=FORWARD["depth"] + 2)  # + the loss's 2 sums
            continue
        gl, wl = jax.tree.leaves(g), jax.tree.leaves(w)
        assert len(gl) == len(wl) and gl
        # At the scale of the whole gradient: a leaf whose terms cancel (a bias in front of a
        # LayerNorm: exactly 0) sums terms of its neighbours' sizes, not of its own.
        scale = max(largest(b) for b in wl)
        for a, b in zip(gl, wl):
            assert_rounding_close(a, b, **sums, scale=scale)


def _saved_bytes(f, *args):
    """Bytes of the activations `f`'s backward pass keeps (jax's own list of its residuals,
    less the arguments and constants, which are kept anyway)."""
    from jax._src.ad_checkpoint import saved_residuals

    return sum(
        int(np.prod(aval.shape)) * aval.dtype.itemsize
        for aval, why in saved_residuals(f, *args)
        if not any(word in why for word in ("argument", "constant", "literal"))
    )


def test_a_lora_layer_saves_fewer_residuals(monkeypatch):
    """One LoRA'd decoder layer (frozen base): its backward pass keeps at most 65 % of the
    activation bytes the plain formulas keep (the attention's mask and softmax intermediates, the
    norms' centred inputs and broadcast scales, three copies of the q/k/v input are gone)."""

    def first_layer():  # built in one compiled program (eagerly, each initialiser compiles)
        model = add_lora(tiny_decoder(jax.random.key(0), d_model=64, mlp_dim=128), CONFIG, key=jax.random.key(1))
        params, static = eqx.partition(model.layers.layers, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda x: x[0], params), static)

    layer = eqx.filter_jit(first_layer)()
    lora, frozen = eqx.partition(layer, jax.tree.map(lambda x: x, trainable(layer, CONFIG)))
    batch = lm_batch(jax.random.key(3), 4)
    x = jax.random.normal(jax.random.key(4), (4, 8, 64))

    def loss(lora, x):
        return jnp.sum(eqx.combine(lora, frozen)(x, mask=batch["mask"]))

    new = _saved_bytes(loss, lora, x)
    _plain_versions(monkeypatch)
    old = _saved_bytes(loss, lora, x)
    assert new <= 0.65 * old, (new, old)
