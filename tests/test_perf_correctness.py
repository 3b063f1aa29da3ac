"""The performance changes keep exact semantics: `zoo.nn.project`'s flattened matmul, the
bfloat16 frozen base (`zoo.lora.cast_frozen`), and the persistent compilation cache."""

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
from helpers import lm_batch, preset_mesh, tiny_decoder, tree_bytes
from jax.sharding import PartitionSpec as P

import zoo
from zoo.lora import LoraConfig, add_lora, cast_frozen, trainable

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
BATCH = 8


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

        got = jax.grad(branch(zoo.nn.project), argnums=(0, 1, 2))(x, a, b)
        want = jax.grad(branch(_einsum_project), argnums=(0, 1, 2))(x, a, b)
        assert zoo.nn.project(x, a).shape == shape[:-1] + (4,)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


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
    np.testing.assert_allclose(y, _einsum_project(x, w), rtol=1e-5, atol=1e-5)


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
        np.testing.assert_allclose(got(x), want(x), rtol=1e-5, atol=1e-6)


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
    err = float(jnp.max(jnp.abs(got - ref)))
    assert 0 < err < 2e-2 * float(jnp.max(jnp.abs(ref))), err


def test_cast_frozen_step_has_the_same_single_all_reduce_and_leaves_the_base_alone():
    model = _lora_model()
    cast = cast_frozen(model, config=CONFIG)
    new, loss, colls, params = _dp_step(cast)
    _, ref_loss, ref_colls, _ = _dp_step(model)
    assert [(c.kind, c.in_loop, c.bytes) for c in colls] == [(c.kind, c.in_loop, c.bytes) for c in ref_colls]
    assert zoo.count(colls, "all-reduce", in_loop=False) == 1 and zoo.count(colls, in_loop=True, kind=None) == 0
    assert colls[0].bytes == tree_bytes(params) + 8  # the float32 adapters (+ loss, count)
    assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss)
    for t, old, upd in zip(jax.tree.leaves(trainable(model, CONFIG)), jax.tree.leaves(cast), jax.tree.leaves(new)):
        assert upd.dtype == old.dtype
        if not t:
            np.testing.assert_array_equal(np.asarray(upd), np.asarray(old))


def test_cast_frozen_refuses_bad_input():
    model = _lora_model()
    with pytest.raises(ValueError, match="floating-point dtype, got int8"):
        cast_frozen(model, jnp.int8, config=CONFIG)
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
    # Off in this process (conftest sets ZOO_NO_COMPILE_CACHE=1): nothing is configured.
    assert zoo.enable_compilation_cache(tmp_path / "unused") is None
    assert not (tmp_path / "unused").exists()
