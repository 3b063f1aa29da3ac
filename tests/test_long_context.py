"""Long-context RoPE (`zoo.nn.RopeScaling`: yarn, longrope) in generation and serving:
`zoo.generate`'s greedy tokens are transformers' past the original context, and a
generation or request that would pass a longrope model's original context from within it
(transformers' Phi-3 `generate` then recomputes every cached key with the long factors) is
refused with the most new tokens that fit. Loading and the frequencies:
tests/test_families.py."""

import jax
import numpy as np
import pytest
import transformers
from test_family_generate import _saved
from test_generate import MASK, NEW, TOKENS, _hf_greedy

import zoo
from zoo.serve import Engine, Request


def test_greedy_equals_transformers_with_long_context_rope(tmp_path_factory):
    """RoPE stretched past an original context of 4 tokens, the prompts and new tokens
    past it: YaRN (Qwen2), and Phi-4-mini's longrope on a partial rotary, whose long factors
    hold from the prompt on when every prompt is longer than the original context, and
    whose short ones hold while every sequence stays within it. A generation that would
    pass the original context from within it is refused, naming the most new tokens that
    fit (transformers then recomputes every earlier key with the long factors)."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4}
    hf, model = _saved(tmp_path_factory, transformers.Qwen2ForCausalLM, transformers.Qwen2Config, rope_parameters=yarn)
    assert model.config.rope_scaling == "yarn"
    np.testing.assert_array_equal(
        zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW), _hf_greedy(hf, TOKENS, MASK, NEW)
    )
    longrope = {
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.2], "long_factor": [2.0, 5.0],
    }  # fmt: skip
    hf, model = _saved(
        tmp_path_factory, transformers.Phi3ForCausalLM, transformers.Phi3Config, rope_parameters=longrope,
        original_max_position_embeddings=4,
    )  # fmt: skip
    assert (model.config.rope_scaling, model.config.rope_original_max_len) == ("longrope", 4)
    long_prompts, long_mask = TOKENS[[0, 3]], MASK[[0, 3]]  # 6 and 5 tokens: past 4 from the start
    np.testing.assert_array_equal(
        zoo.generate(model, long_prompts, mask=long_mask, max_new_tokens=NEW),
        _hf_greedy(hf, long_prompts, long_mask, NEW),
    )
    short_prompts, short_mask = TOKENS[[2, 3], 3:], MASK[[2, 3], 3:]  # 2 and 3 tokens, + 2 new: 4 at most
    np.testing.assert_array_equal(
        zoo.generate(model, short_prompts, mask=short_mask, max_new_tokens=2),
        _hf_greedy(hf, short_prompts, short_mask, 2),
    )
    with pytest.raises(ValueError, match=r"a prompt of 3 tokens \+ max_new_tokens 3 passes .* at most 2,"):
        zoo.generate(model, short_prompts, mask=short_mask, max_new_tokens=3)


def test_a_longrope_request_passing_the_original_context_is_refused():
    """A request the cache cannot decode as transformers does (longrope's switch to its long
    factors inside the request: zoo.generate refuses the same) is refused at submission
    with the most new tokens that fit; one whose prompt is already past it is taken."""
    config = zoo.models.TransformerConfig(
        vocab_size=64, d_model=16, num_heads=2, num_layers=1, max_len=32, positions="rope", activation="swiglu",
        norm="rmsnorm", rope_scaling="longrope", rope_factor=8.0, rope_original_max_len=4,
        rope_short_factor=(1.0,) * 4, rope_long_factor=(3.0,) * 4,
    )  # fmt: skip
    engine = Engine(zoo.models.Transformer(config, key=jax.random.key(0)), slots=1, max_len=32)
    with pytest.raises(ValueError, match=r"the prompt has 3 tokens and max_tokens 5 passes .* at most 2,"):
        engine.check(Request([6, 7, 8], max_tokens=5))
    engine.check(Request([6, 7, 8], max_tokens=2))
    engine.check(Request([6] * 5, max_tokens=20))
