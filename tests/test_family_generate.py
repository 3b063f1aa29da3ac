"""Every family zoo.hf loads, decoding greedily as transformers' `generate` does: on one
device, sharded, and served with a peft adapter.

Each family is a tiny random model made by transformers (windows of 3 columns, shorter
than the prompts and new tokens; mixed RoPE bases, NoPE layers, soft-caps, q/k norms,
partial rotary, norms after or around the sub-layers), saved and loaded through zoo.hf
once per file (`loaded`) and shared by the tests below: one device for every family;
Gemma 3 (the richest pattern) under dp, fsdp and tp; an adapter peft made, served by
zoo.serve.Engine beside a bare-base request, for the families that together hold every
architecture feature.
"""

import copy

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import preset_mesh
from test_generate import MASK, NEW, TOKENS, _hf_greedy

import zoo


def _saved(tmp_path_factory, cls, config_cls, **fields):
    torch.manual_seed(2)
    common = dict(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, bos_token_id=39,
        eos_token_id=39, pad_token_id=0,
    )  # fmt: skip
    hf = cls(config_cls(**(common | fields))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp(cls.__name__)
    hf.save_pretrained(directory)
    return hf, zoo.hf.from_pretrained(directory)


def _build(tmp_path_factory, family):
    """`(transformers model, the zoo model loaded from its folder)` for one family, each
    pattern checked as zoo read it."""
    if family == "llama":
        hf, model = _saved(tmp_path_factory, transformers.LlamaForCausalLM, transformers.LlamaConfig)
    elif family == "qwen3":  # q/k norms before RoPE, in the prompt's pass and every cached step
        hf, model = _saved(tmp_path_factory, transformers.Qwen3ForCausalLM, transformers.Qwen3Config, head_dim=8)
        assert model.config.qk_norm
    elif family == "olmo2":  # q/k norms over the whole projections, norms after the sub-layers
        hf, model = _saved(tmp_path_factory, transformers.Olmo2ForCausalLM, transformers.Olmo2Config, head_dim=8)
        assert (model.config.qk_norm_scope, model.config.norm_placement) == ("projection", "output")
    elif family == "qwen2":  # a window of 3 columns on layer 1 only (max_window_layers 1)
        hf, model = _saved(
            tmp_path_factory, transformers.Qwen2ForCausalLM, transformers.Qwen2Config, use_sliding_window=True,
            sliding_window=3, max_window_layers=1,
        )  # fmt: skip
        assert model.config.sliding_layers == (False, True)
    elif family == "smollm3":  # NoPE layers 1 and 3; a window of 3 columns on layers 0 and 3
        layers = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
        hf, model = _saved(
            tmp_path_factory, transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config, num_hidden_layers=4,
            no_rope_layer_interval=2, use_sliding_window=True, sliding_window=3, layer_types=layers,
        )  # fmt: skip
        assert model.config.rope_layers == (True, False, True, False)
        assert model.config.sliding_layers == (True, False, False, True)
    elif family == "gemma2":  # a window of 3 columns on layer 0, norms around each sub-layer, soft-caps
        hf, model = _saved(
            tmp_path_factory, transformers.Gemma2ForCausalLM, transformers.Gemma2Config, head_dim=8,
            sliding_window=3, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=12,
        )  # fmt: skip
        assert model.config.sliding_layers == (True, False) and model.config.norm_placement == "sandwich"
    elif family == "gemma3_text":  # q/k norms; windows of 3 on layers 0 and 2 with RoPE base 10k, layer 1 at 1M
        layers = ["sliding_attention", "full_attention", "sliding_attention"]  # and stretched 8 times (linear)
        ropes = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
        hf, model = _saved(
            tmp_path_factory, transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, num_hidden_layers=3,
            head_dim=8, sliding_window=3, layer_types=layers, final_logit_softcapping=3.0, query_pre_attn_scalar=12,
            rope_parameters=ropes,
        )  # fmt: skip
        assert model.config.rope_thetas == (1e4, 1e6, 1e4) and model.config.rope_factors == (1.0, 8.0, 1.0)
    elif family == "phi3":  # q | k | v and gate | up fused in the file; RoPE on half of each head
        hf, model = _saved(
            tmp_path_factory, transformers.Phi3ForCausalLM, transformers.Phi3Config, partial_rotary_factor=0.5
        )
        assert (model.config.family, model.config.partial_rotary_factor) == ("phi3", 0.5)
    else:  # a window of 3 columns bites within the prompts and the new tokens
        hf, model = _saved(
            tmp_path_factory, transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=3
        )
        assert model.config.sliding_window == 3
    return hf, model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family → `(transformers model, zoo model, transformers' greedy tokens on TOKENS)`,
    each made once for the file."""
    made = {}

    def get(family):
        if family not in made:
            hf, model = _build(tmp_path_factory, family)
            made[family] = (hf, model, _hf_greedy(hf, TOKENS, MASK, NEW))
        return made[family]

    return get


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "phi3", "qwen2", "qwen3", "olmo2", "smollm3", "gemma2", "gemma3_text"]
)
def test_greedy_equals_transformers_loaded_through_zoo_hf(loaded, family):
    _, model, expected = loaded(family)
    np.testing.assert_array_equal(zoo.generate(model, TOKENS, mask=MASK, max_new_tokens=NEW), expected)


@pytest.fixture(scope="module")
def gemma3_batch8(loaded):
    """`(tokens, mask, transformers' greedy tokens)` of 8 rows (TOKENS, then reversed) on
    Gemma 3, for the three presets (transformers' generate once, not once each)."""
    hf, _, _ = loaded("gemma3_text")
    tokens, mask = np.concatenate([TOKENS, TOKENS[::-1]]), np.concatenate([MASK, MASK[::-1]])
    return tokens, mask, _hf_greedy(hf, tokens, mask, NEW)


@pytest.mark.parametrize("preset", ["dp", "fsdp", "tp"])
def test_sharded_windowed_family_equals_transformers(loaded, gemma3_batch8, preset):
    """Gemma 3 (windows of 3 on layers 0 and 2 at RoPE base 10k, layer 1 global at 1M
    stretched 8 times, q/k norms, soft-capped logits) placed by a preset on 8 devices:
    transformers' greedy tokens past the window, the batch split over `data`."""
    _, model, _ = loaded("gemma3_text")
    tokens, mask, expected = gemma3_batch8
    mesh = preset_mesh(preset, 8)
    with jax.set_mesh(mesh):
        placed = zoo.shard(model, zoo.rules(preset), mesh)
        out = zoo.generate(placed, tokens, mask=mask, max_new_tokens=NEW)
    # Not left whole on every device: fsdp splits the weights over data, tp over model.
    axes = {"dp": set(), "fsdp": {"data"}, "tp": {"model"}}[preset]
    spec = placed.layers.layers.attention.q_proj.weight.sharding.spec
    assert {a for a in jax.tree.leaves(tuple(spec)) if a} == axes
    assert out.sharding.spec[0] == "data"
    np.testing.assert_array_equal(out, expected)


# The engine builds cost compiles: the families that together hold every feature the
# others add to Llama's (served with adapters in test_serve_adapters.py): Gemma 2
# (soft-caps, norms around each sub-layer, alternating windows), Gemma 3 (mixed windows
# and RoPE bases, per-head q/k norms as Qwen3's), OLMo 2 (norms after the sub-layers,
# q/k norms over the projections), SmolLM3 (NoPE layers, windows) and Phi-3 (partial
# rotary, q | k | v and gate | up fused: peft's adapter on the fused layers).
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2", "smollm3", "phi3"])
def test_served_with_a_peft_adapter_beside_the_bare_base(loaded, tmp_path, family):
    """An adapter peft made on the transformers model (every linear layer, random B), its
    folder served by zoo.serve.Engine beside a bare-base request on the same prompt: each
    request gets transformers' greedy tokens (with peft's adapter, without), past the window."""
    hf, model, expected = loaded(family)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    adapted = peft.get_peft_model(copy.deepcopy(hf), config).eval()
    adapted.save_pretrained(tmp_path)
    want = _hf_greedy(adapted, TOKENS[:1], MASK[:1], NEW)[0, TOKENS.shape[1] :]
    assert want.tolist() != expected[0, TOKENS.shape[1] :].tolist()  # the adapter changes the tokens
    engine = zoo.serve.Engine(model, slots=2, max_len=16, adapters={"a": tmp_path})
    prompt = TOKENS[0].tolist()  # no padding
    mine = engine.submit(zoo.serve.Request(prompt, max_tokens=NEW, adapter="a"))
    base = engine.submit(zoo.serve.Request(prompt, max_tokens=NEW))
    engine.run_until_done()
    assert mine.ids == want.tolist()
    assert base.ids == expected[0, TOKENS.shape[1] :].tolist()
