"""zoo.nn modules: reference math, unsharded use, jaxtyping checks, construction errors."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import assert_rounding_close, largest, rounding_bound

import zoo


def test_linear_matches_reference(key):
    layer = zoo.nn.Linear(3, 5, key=key)
    x = jax.random.normal(key, (2, 4, 3))
    x_, w, b = np.asarray(x), np.asarray(layer.weight), np.asarray(layer.bias)
    # A sum of 3 products and the bias, scaled by its sum of |terms| (Higham's dot product bound).
    assert_rounding_close(layer(x), x_ @ w + b, terms=4, scale=largest(np.abs(x_) @ np.abs(w) + np.abs(b)))
    no_bias = zoo.nn.Linear(3, 5, use_bias=False, key=key)
    assert no_bias.bias is None
    w = np.asarray(no_bias.weight)
    assert_rounding_close(no_bias(x), x_ @ w, terms=3, scale=largest(np.abs(x_) @ np.abs(w)))


def test_layernorm_matches_equinox_per_example(key):
    norm = zoo.nn.LayerNorm(6)
    norm = eqx.tree_at(lambda n: (n.weight, n.bias), norm, (jnp.linspace(0.5, 2, 6), jnp.linspace(-1, 1, 6)))
    ref = eqx.nn.LayerNorm(6, eps=1e-5)
    ref = eqx.tree_at(lambda n: (n.weight, n.bias), ref, (norm.weight, norm.bias))
    x = 3 * jax.random.normal(key, (4, 6)) + 1
    # Mean and variance over 6 values, then rsqrt, scale and shift: ~5 chained roundings.
    assert_rounding_close(norm(x), jax.vmap(ref)(x), terms=6, depth=5)


def test_rmsnorm_matches_formula(key):
    norm = eqx.tree_at(lambda n: n.weight, zoo.nn.RMSNorm(6), jnp.linspace(0.5, 2, 6))
    x = np.asarray(jax.random.normal(key, (2, 3, 6)))
    expect = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(norm.weight)
    # A mean of 6 squares, then + eps, sqrt, divide and scale: ~5 chained roundings.
    assert_rounding_close(norm(jnp.asarray(x)), expect, terms=6, depth=5)


def test_norm_keeps_low_precision_dtype(key):
    x = jax.random.normal(key, (2, 6)).astype(jnp.bfloat16)
    assert zoo.nn.LayerNorm(6)(x).dtype == jnp.bfloat16
    assert zoo.nn.RMSNorm(6)(x).dtype == jnp.bfloat16


def test_embedding_lookup(key):
    emb = zoo.nn.Embedding(10, 4, key=key)
    ids = jnp.array([[1, 2, 9], [0, 0, 3]])
    np.testing.assert_array_equal(emb(ids), np.asarray(emb.weight)[np.asarray(ids)])


def test_mlp_scan_equals_unrolled(key):
    kwargs = dict(activation=jnp.tanh, norm="layernorm", key=key)
    scanned = zoo.nn.MLP(4, 2, 8, 4, scan=True, **kwargs)
    unrolled = zoo.nn.MLP(4, 2, 8, 4, scan=False, **kwargs)
    # Same parameters: copy the unrolled hidden layers into the stacked ones.
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *unrolled.hidden)
    scanned = eqx.tree_at(lambda m: m.hidden.layers, scanned, stacked)
    scanned = eqx.tree_at(
        lambda m: (m.input_block, m.output_layer), scanned, (unrolled.input_block, unrolled.output_layer)
    )
    x = jax.random.normal(key, (5, 4))
    # 4 layers of an (<= 8-wide) matmul and a LayerNorm's 2 sums; gradients twice that, and
    # a sum over the 5 examples.
    sums = {"terms": 8, "depth": 4 * 3}
    # Compiled (eager calls compile every op alone): one program per model.
    forward = eqx.filter_jit(lambda m, x: m(x))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: m(x).sum()))
    assert_rounding_close(forward(scanned, x), forward(unrolled, x), **sums)
    remat = eqx.tree_at(
        lambda m: m.hidden, scanned, zoo.nn.Stacked(lambda k: unrolled.hidden[0], 3, remat="dots_saveable", key=key)
    )
    remat = eqx.tree_at(lambda m: m.hidden.layers, remat, stacked)
    assert_rounding_close(
        grads(remat, x).input_block.linear.weight,
        grads(scanned, x).input_block.linear.weight,
        terms=sums["terms"],
        depth=2 * sums["depth"] + 1,
    )


def _np_erf(x):
    return np.vectorize(math.erf)(x)


# Each activation a model can name, written independently of jax (float64 NumPy / math);
# "swiglu" is silu(gate) * up, here with gate = up = identity.
REFERENCE_ACTIVATIONS = {
    "gelu": lambda x: 0.5 * x * (1 + _np_erf(x / math.sqrt(2))),  # BERT's exact (erf) GELU
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),  # GPT-2's
    "relu": lambda x: np.maximum(x, 0.0),
    "swiglu": lambda x: x / (1 + np.exp(-x)) * x,
    "geglu": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))) * x,  # Gemma's
}


@pytest.mark.parametrize("name", zoo.nn.ACTIVATIONS)
def test_activation_matches_its_formula(name):
    """FeedForward(1, 1) with identity projections is its activation, on [-6, 6]: the
    tolerance (float32 rounding, ~1e-5 at |x| = 2) is far below the 1e-4-level gaps between
    formulas (erf vs tanh GELU differ by 2.3e-4 at |x| = 2)."""
    assert set(zoo.nn.ACTIVATIONS) <= set(REFERENCE_ACTIVATIONS)  # a new one needs its formula here
    ff = zoo.nn.FeedForward(1, 1, activation=name, key=jax.random.key(0))
    one, zero = jnp.ones((1, 1)), jnp.zeros((1,))
    for layer in ("up", "gate", "down"):
        if getattr(ff, layer) is not None:
            ff = eqx.tree_at(lambda f, name=layer: (getattr(f, name).weight, getattr(f, name).bias), ff, (one, zero))
    x = np.linspace(-6, 6, 481)
    got = np.asarray(ff(jnp.asarray(x, jnp.float32)[:, None]))[:, 0]
    # float32 evaluation of the formula, elementwise: the input's rounding, <= 8 operations
    # (powers, products, sums, 1 + tanh(...) near -1) and tanh/erf/exp's few ulps (~4), each
    # of a value no larger than 1 + |x| + |f(x)| (geglu's x * gelu_tanh(x) included).
    want = REFERENCE_ACTIVATIONS[name](x)
    bound = rounding_bound(1 + np.abs(x) + np.abs(want), terms=1, depth=13)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_wrong_shape_is_a_readable_jaxtyping_error(key):
    layer = zoo.nn.Linear(3, 5, key=key)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter .x."):
        layer(jnp.ones((2, 4)))


def test_bad_construction_arguments(key):
    with pytest.raises(ValueError, match="depth must be >= 1"):
        zoo.nn.MLP(2, 2, 4, 0, key=key)
    # Caught by the Literal annotation when type checks are on, by a ValueError otherwise.
    with pytest.raises((ValueError, jaxtyping.TypeCheckError), match="batchnorm"):
        zoo.nn.MLP(2, 2, 4, 1, norm="batchnorm", key=key)
    with pytest.raises(ValueError, match="unknown remat policy"):
        zoo.nn.Stacked(lambda k: zoo.nn.Linear(2, 2, key=k), 2, remat="sometimes", key=key)
