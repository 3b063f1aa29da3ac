"""The zoo.hf architecture registry's configs: what each family reads from config.json and
writes back (both ways the identity, derived as transformers derives them, chosen by
shape), and every option zoo cannot build or a family cannot express refused by name; head
counts a mesh cannot split refused. No weights are compared here (tests/test_families.py
loads and exports the families against transformers)."""

import dataclasses
import json

import equinox as eqx
import jax
import pytest
import transformers
from helpers import preset_mesh
from test_families import CASES, SMALL

import zoo
from zoo.models import Transformer, TransformerConfig


def _config_only(tmp_path, name, **values):
    directory = tmp_path / name
    directory.mkdir()
    kinds = {
        "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
        "olmo2": transformers.Olmo2Config,
        "smollm3": transformers.SmolLM3Config,
    }  # fmt: skip
    cls = kinds[values.pop("kind", "llama")]
    cls(**(SMALL | values)).save_pretrained(directory)
    return directory


def test_heads_the_model_axis_cannot_split_are_refused(tmp_path):
    mesh = preset_mesh("tp", 8)
    three = _config_only(tmp_path, "three", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"3 attention heads.*\['model'\].*zoo.rules\('fsdp'\)"):
        zoo.hf.from_pretrained(three, rules=zoo.rules("tp"), mesh=mesh)
    one_kv = _config_only(tmp_path, "one_kv", num_key_value_heads=1)
    with pytest.raises(ValueError, match="1 key/value heads"):
        zoo.hf.from_pretrained(one_kv, rules=zoo.rules("fsdp+tp"), mesh=mesh)


# --------------------------------------------------------------------------- refusals and registry


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling of type 'dynamic'"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707}},
            "yarn' with mscale / mscale_all_dim",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'.*SwiGLU"),
        (
            {"kind": "qwen2", "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
            "layer_types marks sliding layers without use_sliding_window",
        ),
        (
            {"kind": "qwen3", "layer_types": ["full_attention", "chunked_attention"]},
            r"layer_types \['chunked_attention'\]",
        ),
        (
            {"kind": "smollm3", "no_rope_layers": [1], "layer_types": ["full_attention"] * 2},
            r"no_rope_layers=\[1\] \(one 0 or 1 for each of the 2 layers",
        ),
        ({"kind": "olmo2", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "olmo2 config.*of type 'dynamic'"),
        ({"kind": "olmo2", "hidden_act": "gelu"}, "olmo2 config.*hidden_act='gelu'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 \(llama rotates every head dimension"),
        (
            {
                "kind": "qwen2",
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            },
            r"partial_rotary_factor=0.5 \(qwen2",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(values, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        zoo.hf.from_pretrained(_config_only(tmp_path, "refused", **values))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "of type 'longrope' without"),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}}, "holds 3 factors"),
        ({"partial_rotary_factor": 0.375}, r"partial_rotary_factor=0.375 must be .* it rotates 3"),
    ],
)
def test_phi3_long_context_rope_and_odd_partial_rotary_are_refused_by_name(values, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"} | SMALL | values))
    with pytest.raises(ValueError, match=message):
        zoo.hf.from_pretrained(tmp_path)


def test_a_multimodal_gemma3_config_without_its_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="gemma3 config has no text_config"):
        zoo.hf.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
            r"rope_parameters\['full_attention'\] of type 'dynamic'",
        ),
        ({"hidden_activation": "gelu"}, "hidden_act='gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, r"layer_types \['chunked_attention'\]"),
    ],
)
def test_gemma3_options_zoo_cannot_build_are_refused_by_name(values, message, tmp_path):
    transformers.Gemma3TextConfig(**SMALL | {"head_dim": 8} | values).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"gemma3_text config.*{message}"):
        zoo.hf.from_pretrained(tmp_path)


def test_gemma_2_and_3_configs_round_trip_and_are_chosen_by_shape():
    """Old config.json files (no layer_types, Gemma 3's `rope_theta` / `rope_local_base_freq`)
    read as transformers reads them; written back, they read the same; a scratch config of
    their shape is written as theirs; what they cannot say is refused by name."""
    values = SMALL | {"num_hidden_layers": 6, "head_dim": 8, "sliding_window": 3}
    old = {"rope_theta": 5e5, "rope_local_base_freq": 2e4} | values | {"model_type": "gemma3_text"}
    hf = transformers.Gemma3TextConfig(**values, rope_theta=5e5, rope_local_base_freq=2e4)
    gemma3 = zoo.hf.get_family("gemma3_text")
    config = gemma3.config_from_hf(old)
    sliding = tuple(t == "sliding_attention" for t in hf.layer_types)
    assert config.sliding_layers == sliding == (True,) * 5 + (False,)
    assert config.rope_thetas == tuple(2e4 if s else 5e5 for s in sliding)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.query_pre_attn_scalar) == (
        None, None, 256.0,
    )  # fmt: skip
    written = gemma3.config_to_hf(config)
    assert written["rope_parameters"] == hf.rope_parameters and written["layer_types"] == hf.layer_types
    assert gemma3.config_to_hf(gemma3.config_from_hf(written)) == written
    assert zoo.hf.family_of(dataclasses.replace(config, family=None)).name == "gemma3_text"
    every3 = transformers.Gemma3TextConfig(**values, sliding_window_pattern=3)
    assert (
        gemma3.config_from_hf(old | {"sliding_window_pattern": 3}).sliding_layers
        == tuple(t == "sliding_attention" for t in every3.layer_types)
        == (True, True, False) * 2
    )
    gemma2 = zoo.hf.get_family("gemma2")
    config2 = gemma2.config_from_hf(values | {"model_type": "gemma2"})
    assert config2.sliding_layers == (True, False) * 3
    assert (config2.attn_logit_softcapping, config2.final_logit_softcapping) == (50.0, 30.0)  # Gemma2Config's
    written = gemma2.config_to_hf(config2)
    assert written["layer_types"] == transformers.Gemma2Config(**values).layer_types
    assert gemma2.config_to_hf(gemma2.config_from_hf(written)) == written
    assert zoo.hf.family_of(dataclasses.replace(config2, family=None)).name == "gemma2"
    with pytest.raises(ValueError, match="attn_logit_softcapping=2.0.*Gemma 3 does not apply it"):
        gemma3.config_to_hf(dataclasses.replace(config, attn_logit_softcapping=2.0))
    with pytest.raises(ValueError, match="rope_thetas with .* on the sliding_attention layers"):
        gemma3.config_to_hf(dataclasses.replace(config, rope_thetas=(1.0, 2.0) + config.rope_thetas[2:]))
    with pytest.raises(ValueError, match="rope_thetas=.*one RoPE base"):
        gemma2.config_to_hf(dataclasses.replace(config2, rope_thetas=(1.0,) * 6))
    with pytest.raises(ValueError, match="final_logit_softcapping=3.0 .*llama has none; Gemma 2 and 3 have"):
        zoo.hf.get_family("llama").config_to_hf(
            TransformerConfig(**_LLAMA_SHAPE, use_bias=False, final_logit_softcapping=3.0)
        )


_LLAMA_SHAPE = dict(
    vocab_size=11, d_model=16, num_heads=2, num_layers=1, positions="rope", norm="rmsnorm", activation="swiglu"
)


def test_qwen2_sliding_window_on_every_layer_loads(tmp_path):
    values = {"kind": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    config = zoo.hf.get_family("qwen2").config_from_hf(
        json.loads((_config_only(tmp_path, "q", **values) / "config.json").read_text())
    )
    assert config.sliding_window == 4 and config.qkv_bias and not config.o_bias
    off = zoo.hf.get_family("qwen2").config_from_hf(transformers.Qwen2Config(**SMALL, sliding_window=4).to_dict())
    assert off.sliding_window is None  # use_sliding_window defaults to false


def test_export_refuses_what_the_family_cannot_express():
    base = dict(
        vocab_size=11, d_model=16, num_heads=2, num_layers=1, positions="rope", norm="rmsnorm", activation="swiglu"
    )
    llama = zoo.hf.get_family("llama")
    with pytest.raises(ValueError, match="sliding_window=4.*Mistral"):
        llama.config_to_hf(TransformerConfig(**base, sliding_window=4, use_bias=False))
    with pytest.raises(ValueError, match="qkv_bias=True with o_bias=False"):
        llama.config_to_hf(TransformerConfig(**base, use_bias=False, qkv_bias=True))
    with pytest.raises(ValueError, match="norm='layernorm'.*activation='gelu'"):
        llama.config_to_hf(TransformerConfig(**base | {"norm": "layernorm", "activation": "gelu"}))
    with pytest.raises(ValueError, match="Qwen2 has biases on q, k and v only"):
        zoo.hf.get_family("qwen2").config_to_hf(TransformerConfig(**base, use_bias=False))
    with pytest.raises(ValueError, match="qk_norm=True.*Qwen3 does"):
        llama.config_to_hf(TransformerConfig(**base, use_bias=False, qk_norm=True))
    with pytest.raises(ValueError, match="qk_norm=False"):
        zoo.hf.get_family("qwen3").config_to_hf(TransformerConfig(**base, use_bias=False))
    # Partial rotary: Phi-3 writes it, Llama refuses it and does not claim such a model.
    partial = TransformerConfig(**base, use_bias=False, partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 \(llama rotates every head dimension"):
        llama.config_to_hf(partial)
    assert not llama.claims(partial)
    phi3 = zoo.hf.get_family("phi3")
    written = phi3.config_to_hf(partial)
    assert written["rope_parameters"]["partial_rotary_factor"] == written["partial_rotary_factor"] == 0.5
    assert phi3.config_from_hf(written).partial_rotary_factor == 0.5
    # Chosen by shape: a window → Mistral, q/k/v-only biases → Qwen2, q/k norms → Qwen3.
    assert zoo.hf.family_of(TransformerConfig(**base, sliding_window=4, use_bias=False)).name == "mistral"
    assert zoo.hf.family_of(TransformerConfig(**base, use_bias=False, qkv_bias=True)).name == "qwen2"
    qwen3 = zoo.hf.get_family("qwen3")
    for extra in ({}, {"sliding_window": 4}, {"qkv_bias": True, "o_bias": True}):
        config = TransformerConfig(**base, use_bias=False, qk_norm=True, **extra)
        assert zoo.hf.family_of(config).name == "qwen3"
        written = qwen3.config_to_hf(config)
        assert qwen3.config_to_hf(qwen3.config_from_hf(written)) == written
    # OLMo 2: output norms and whole-projection q/k norms, each refused where not built.
    olmo2 = zoo.hf.get_family("olmo2")
    shape = dict(use_bias=False, qk_norm=True, qk_norm_scope="projection", norm_placement="output")
    with pytest.raises(ValueError, match="norm_placement='output'.*llama normalises each sub-layer's input"):
        llama.config_to_hf(TransformerConfig(**base, use_bias=False, norm_placement="output"))
    with pytest.raises(ValueError, match="qk_norm_scope='projection'.*qwen3 has each query and key head"):
        qwen3.config_to_hf(TransformerConfig(**base | shape | {"norm_placement": "input"}))
    with pytest.raises(ValueError, match="qk_norm_scope='head'.*olmo2 has the whole query and key projections"):
        olmo2.config_to_hf(TransformerConfig(**base | shape | {"qk_norm_scope": "head"}))
    with pytest.raises(ValueError, match="norm_placement='sandwich'.*olmo2 normalises each sub-layer's output"):
        olmo2.config_to_hf(TransformerConfig(**base | shape | {"norm_placement": "sandwich"}))
    with pytest.raises(ValueError, match="mlp_bias=True.*no biases"):
        olmo2.config_to_hf(TransformerConfig(**base | shape | {"mlp_bias": True}))
    with pytest.raises(ValueError, match="post-LN.*takes norm_placement='input'"):
        TransformerConfig(**base, norm_placement="output", pre_norm=False)
    for extra in ({}, {"qkv_bias": True, "o_bias": True}):
        config = TransformerConfig(**base | shape | extra)
        assert zoo.hf.family_of(config).name == "olmo2"
        written = olmo2.config_to_hf(config)
        assert olmo2.config_to_hf(olmo2.config_from_hf(written)) == written


@pytest.mark.parametrize("interval", [4, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_smollm3_patterns_are_derived_as_transformers_derives_them(interval, window):
    """A config.json without `no_rope_layers` / `layer_types` / a RoPE base (older files):
    zoo derives them from `no_rope_layer_interval` and `use_sliding_window`, and the base
    SmolLM3's, as SmolLM3Config does."""
    values = SMALL | {"num_hidden_layers": 8, "no_rope_layer_interval": interval, "pad_token_id": 0}
    values |= {"use_sliding_window": window is not None, "sliding_window": window}
    hf = transformers.SmolLM3Config(**values)
    derived = ("no_rope_layers", "layer_types", "rope_parameters", "rope_theta", "rope_scaling")
    written = {k: v for k, v in hf.to_dict().items() if k not in derived}
    config = zoo.hf.get_family("smollm3").config_from_hf(written)
    assert (config.rope_layers or (True,) * 8) == tuple(bool(f) for f in hf.no_rope_layers)
    sliding = tuple(t == "sliding_attention" for t in hf.layer_types)
    assert config.sliding_window == (window if any(sliding) else None)
    assert (config.sliding_layers or (config.sliding_window is not None,) * 8) == sliding
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 2e6
    back = zoo.hf.get_family("smollm3").config_to_hf(config)
    assert back["no_rope_layers"] == hf.no_rope_layers and back["layer_types"] == hf.layer_types


@pytest.mark.parametrize("name", list(zoo.hf.families()))
def test_registry_tables_name_every_projection(name):
    family = zoo.hf.get_family(name)
    assert family.name == name and zoo.hf.families()[name] is family
    for zoo_name in ("q_proj", "k_proj", "v_proj", "o_proj", "up", "down"):
        short = family.lora_names[zoo_name]
        module = ("layers.layers.mlp." if zoo_name in ("up", "down") else "layers.layers.attention.") + zoo_name
        hf_name = family.hf_module_name(module, (3,))
        assert hf_name.endswith("." + short) and ".3." in hf_name
    if name in CASES:  # config both ways is the identity
        config = family.config_from_hf(CASES[name][0](**SMALL).to_dict())
        assert family.config_from_hf(family.config_to_hf(config)) == config


def test_shard_refuses_heads_the_model_axis_cannot_split():
    config = TransformerConfig(vocab_size=16, d_model=24, num_heads=3, num_layers=1)
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"3 attention heads.*rules\['heads'\] = None"):
        zoo.shard(abstract, zoo.rules("tp"), preset_mesh("tp", 8))
    zoo.shard(abstract, zoo.rules("fsdp"), preset_mesh("fsdp", 8))  # no head split: fine
