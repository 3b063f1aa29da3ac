"""`zoo.generate` and `zoo.serve.Engine` refuse a model holding NaN or inf in Python, as
the CLI refuses its files: NaN logits' argmax is token 0, which reads as an answer. The
check runs once per model object, not once per call."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_decoder

import zoo
import zoo._finite
import zoo.serve


def _poisoned(model, value=jnp.nan):
    return eqx.tree_at(lambda m: m.token_embedding.weight, model, model.token_embedding.weight.at[3, 1].set(value))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_generate_refuses_a_model_holding_nan_or_inf(value):
    model = _poisoned(tiny_decoder(jax.random.key(0)), value)
    with pytest.raises(
        zoo.internal.NonFiniteWeightsError, match=r"token_embedding.weight holds NaN or inf \(1 of its 512"
    ):
        zoo.generate(model, np.array([[1, 2]]), max_new_tokens=2)


def test_engine_refuses_a_model_holding_nan():
    model = _poisoned(tiny_decoder(jax.random.key(0)))
    with pytest.raises(
        zoo.internal.NonFiniteWeightsError, match="the Engine's model: the weight .*token_embedding.weight"
    ):
        zoo.serve.Engine(model, slots=1)


def test_a_healthy_model_is_checked_once(monkeypatch):
    model = tiny_decoder(jax.random.key(0))
    checked = []
    real = zoo._finite.check_finite
    monkeypatch.setattr(
        zoo._finite, "check_finite", lambda tree, where: checked.append(where) or real(tree, where=where)
    )
    first = zoo.generate(model, np.array([[1, 2]]), max_new_tokens=2)
    again = zoo.generate(model, np.array([[1, 2]]), max_new_tokens=2)
    assert checked == ["zoo.generate's model"]
    np.testing.assert_array_equal(first, again)
    # Another model object (the same weights with one changed) is checked anew.
    with pytest.raises(zoo.internal.NonFiniteWeightsError):
        zoo.generate(_poisoned(model), np.array([[1, 2]]), max_new_tokens=2)
    assert len(checked) == 2
