"""The zoo.hf architecture registry: Llama, Mistral, Qwen2, Qwen3, OLMo 2, SmolLM3, Gemma 1/2/3, Phi-3 (and GPT-2, BERT)
both ways against transformers, sharded loads, vocabulary padding, cache ids, the CLI on a family folder.
What each family reads from config.json and writes back, and what it refuses by name:
tests/test_family_configs.py (it imports CASES and SMALL from here)."""

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import (
    UNIT_ROUNDOFF,
    Reference,
    assert_as_accurate,
    assert_rounding_close,
    assert_tree_rounding_close,
    drawn_on_host,
    largest,
    preset_mesh,
    torch_reference,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo.models import Transformer, TransformerConfig

# torch on one thread: its references here are tiny models (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_one_thread")

# The tests that compare computed floats are marked `numerics`: `make test-numerics` runs
# them again under other CPU kernels and thread counts (refusals, tokenizers and exact
# copies of weights compute nothing a kernel could round differently).

# Against transformers: helpers.assert_as_accurate (zoo as close to a float64 run of the
# transformers model as transformers' own float32 run, within its margin). Measured maxima
# are printed with -s (`MAX DIFF`); docs/models.md quotes them. Zoo against zoo (sharded,
# padded): helpers.rounding_bound over the sums of these models, the longest one the MLP's
# 48 terms (or a batch of 8 rows of 8 tokens: 64), 2 layers of 6 chained sums plus the head.
SUMS = {"terms": 64, "depth": 2 * 6 + 1}
SEQ = 8
VOCAB = 61  # odd: does not split over a model axis of 2
RIGHT = np.array([8, 6, 3])  # real tokens per row (right padding)
LEFT = np.array([0, 2, 5])  # pad tokens per row (left padding)

SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
CASES = {
    # Llama 3-style: GQA, untied head, rope_theta.
    "llama": (transformers.LlamaConfig, SMALL | {"rope_theta": 500000.0}),
    # Llama with attention/mlp biases, a tied head and an explicit head_dim ≠ hidden/heads.
    "llama_bias_tied": (
        transformers.LlamaConfig,
        SMALL | {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "head_dim": 16},
    ),
    # Llama 3.1 frequency rescaling (a short original context so every band is hit).
    "llama3_scaled": (
        transformers.LlamaConfig,
        SMALL | {"rope_scaling": LLAMA3},
    ),
    # Qwen's long-context YaRN: frequencies blended by a ramp, cos/sin times 0.1·ln(4) + 1;
    # an original context of 4 (the sequences are 8); a tied head.
    "qwen2_yarn": (
        transformers.Qwen2Config,
        SMALL
        | {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 4,
            },
        },
    ),
    # Mistral with a window shorter than the sequence.
    "mistral": (transformers.MistralConfig, SMALL | {"sliding_window": 3}),
    "qwen2": (transformers.Qwen2Config, SMALL | {"tie_word_embeddings": True}),
    # Qwen2 with a window (shorter than the sequence) on the layers from max_window_layers on,
    # a tied head.
    "qwen2_windowed": (
        transformers.Qwen2Config,
        SMALL
        | {
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": 3,
            "max_window_layers": 1,
            "tie_word_embeddings": True,
        },
    ),
    # Qwen3: q/k heads RMS-normalised before RoPE, a head_dim ≠ hidden/heads, a tied head.
    "qwen3": (transformers.Qwen3Config, SMALL | {"tie_word_embeddings": True, "head_dim": 16}),
    # OLMo 2: norms on the sub-layers' outputs only, q/k RMS-normalised over the whole
    # projections (64 and 32 wide), a head_dim ≠ hidden/heads, attention biases, its eps.
    "olmo2": (
        transformers.Olmo2Config,
        SMALL | {"head_dim": 16, "attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 50000.0},
    ),
    # SmolLM3: every 2nd layer without RoPE (no_rope_layer_interval), a window shorter than
    # the sequence on layers 0 and 3 (a RoPE and a NoPE one), an untied head.
    "smollm3": (
        transformers.SmolLM3Config,
        SMALL
        | {
            "num_hidden_layers": 4,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
            "tie_word_embeddings": False,
            "pad_token_id": 0,
        },
    ),
    # Gemma: embeddings × sqrt(hidden), RMSNorm by (1 + weight), GeGLU, tied head.
    "gemma": (transformers.GemmaConfig, SMALL | {"head_dim": 8}),
    # Gemma 2: norms before and after each sub-layer, a window shorter than the sequence on
    # layer 0 (the default alternation), scores and logits soft-capped low enough to bite,
    # scores scaled by query_pre_attn_scalar (12, not head_dim 8).
    "gemma2": (
        transformers.Gemma2Config,
        SMALL
        | {
            "head_dim": 8,
            "sliding_window": 3,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 12,
        },
    ),
    # Gemma 3's text decoder: Gemma 2's layers with q/k norms, two sliding layers around a
    # global one, their RoPE bases 10k local, 1M global, the global one's positions
    # stretched 8 times (linear scaling, as Gemma 3 4B and larger), logits soft-capped,
    # scores scaled by query_pre_attn_scalar (attn_logit_softcapping set: its transformers
    # attention ignores it, and so does zoo).
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        SMALL
        | {
            "num_hidden_layers": 3,
            "head_dim": 8,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 12,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
    # Phi-3: q | k | v fused in qkv_proj (blocks 32, 16, 16 wide under GQA), gate | up in gate_up_proj.
    "phi3": (transformers.Phi3Config, SMALL | {"pad_token_id": 0}),
    # Phi-4-mini's partial rotary: RoPE on the first half of each head (4 of 8 dimensions,
    # frequencies those of a 4-wide head), the other 4 passed through.
    "phi3_partial": (transformers.Phi3Config, SMALL | {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
    # Phi-4-mini's longrope on a partial rotary: per-frequency long factors past an original
    # context of 4 (Phi-3's top-level key), cos/sin times sqrt(1 + ln(64/4) / ln 4).
    "phi3_longrope": (
        transformers.Phi3Config,
        SMALL
        | {
            "pad_token_id": 0,
            "original_max_position_embeddings": 4,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.2],
                "long_factor": [2.0, 5.0],
            },
        },
    ),
}


def _torch(x):
    return torch.from_numpy(np.asarray(x).astype(np.int64))


@eqx.filter_jit
def forward(model, tokens, mask):
    return model(tokens, mask=mask)


def _masks():
    pos = np.arange(SEQ)[None, :]
    return {"right": pos < RIGHT[:, None], "left": pos >= LEFT[:, None]}


def _hf_logits(hf, tokens, mask) -> Reference:
    return torch_reference(lambda m: m(_torch(tokens), attention_mask=_torch(mask)).logits, hf)


def _check(zoo_logits, reference: Reference, mask, what) -> float:
    """zoo's logits as accurate as transformers' over real (unpadded) positions and the real
    vocabulary (helpers.assert_as_accurate); returns the largest difference."""
    z = np.asarray(zoo_logits)[..., : reference.f32.shape[-1]]
    return assert_as_accurate(z[mask], reference[mask], what=what)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(3, VOCAB, (3, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Each case as a tiny random transformers model on disk (weights perturbed: biases ≠ 0,
    norms ≠ 1), with tokenizer files next to it."""
    out = {}
    for i, (name, (cls, values)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        config = cls(**values, attn_implementation="eager")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        (directory / "tokenizer.json").write_text('{"fake": "tokenizer ' + name + '"}')
        (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}')
        out[name] = directory
    return out


def _placed(mesh, *arrays):
    """Arrays with rows split over `data` (sharded models take placed inputs)."""
    sharding = NamedSharding(mesh, P("data"))
    return [jax.device_put(np.asarray(a), sharding) for a in arrays]


def _rows8(x):
    return np.concatenate([x, x, x[:2]])


def _open_hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def loaded(hf_dirs):
    return {name: zoo.hf.from_pretrained(d) for name, d in hf_dirs.items()}


# --------------------------------------------------------------------------- both directions


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_load_and_export_match_transformers(name, hf_dirs, loaded, tokens, tmp_path):
    model = loaded[name]
    assert model.config.family == CASES[name][1].get("model_type", CASES[name][0].model_type)
    hf = _open_hf(hf_dirs[name])
    zoo.hf.save_pretrained(model, tmp_path)
    exported = _open_hf(tmp_path)
    assert type(exported) is type(hf)
    for kind, mask in _masks().items():
        t = np.where(mask, tokens, 0).astype(np.int32)
        got = forward(model, jnp.asarray(t), jnp.asarray(mask))
        load_diff = _check(got, _hf_logits(hf, t, mask), mask, f"{name} {kind} load")
        export_diff = _check(got, _hf_logits(exported, t, mask), mask, f"{name} {kind} export")
        print(f"MAX DIFF {name} {kind}: load {load_diff:.2e} export {export_diff:.2e}")
    # The export is the source's tensors again, bit for bit.
    source = safetensors.numpy.load_file(str(hf_dirs[name] / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(k for k in source if not k.endswith("inv_freq"))
    for k in written:  # Gemma's norms go through fl(1 + w) − 1 (exact): off by one rounding of 1 + w
        bound = UNIT_ROUNDOFF * largest(1 + source[k]) if name.startswith("gemma") and "norm" in k else 0
        np.testing.assert_allclose(written[k], source[k], rtol=0, atol=bound, err_msg=k)


@pytest.mark.numerics
def test_mistral_window_is_applied(hf_dirs, loaded, tokens):
    """Past its window Mistral's logits differ from full attention's: the band matters."""
    model = loaded["mistral"]
    full = zoo.hf.from_pretrained(hf_dirs["mistral"], config_overrides={"sliding_window": None})
    mask = np.ones((3, SEQ), bool)
    a, b = forward(model, tokens, mask), forward(full, tokens, mask)
    assert_rounding_close(a[:, :3], b[:, :3], **SUMS)  # within the window: the same
    assert np.abs(np.asarray(a[:, 3:]) - np.asarray(b[:, 3:])).max() > 1e-3


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("name", "patterns", "uniform"),
    [
        ("smollm3", {"rope_layers": (True, False, True, False)}, {"rope_layers": None}),
        ("smollm3", {"sliding_layers": (True, False, False, True)}, {"sliding_layers": None, "sliding_window": None}),
        ("qwen2_windowed", {"sliding_layers": (False, True, True)}, {"sliding_layers": None}),
        ("qwen2_windowed", {"sliding_window": 3}, {"sliding_layers": None, "sliding_window": None}),
        ("gemma2", {"sliding_layers": (True, False)}, {"sliding_layers": None, "sliding_window": None}),
        ("gemma2", {"attn_logit_softcapping": 2.0}, {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": 3.0}, {"final_logit_softcapping": None}),
        ("gemma2", {"query_pre_attn_scalar": 12.0}, {"query_pre_attn_scalar": None}),
        ("gemma3_text", {"rope_thetas": (1e4, 1e6, 1e4)}, {"rope_thetas": None}),
    ],
)
def test_layer_patterns_are_read_and_applied(name, patterns, uniform, hf_dirs, loaded, tokens):
    """The per-layer patterns come from the config (SmolLM3's NoPE layers from
    no_rope_layer_interval, its windows from layer_types; Qwen2's from max_window_layers;
    Gemma 2's alternation and soft-caps, Gemma 3's two RoPE bases), and each changes the
    logits: the same weights with the pattern made uniform (the cap off) differ."""
    model = loaded[name]
    for field, value in patterns.items():
        assert getattr(model.config, field) == value
    other = zoo.hf.from_pretrained(hf_dirs[name], config_overrides=uniform)
    mask = np.ones((3, SEQ), bool)
    assert np.abs(np.asarray(forward(model, tokens, mask)) - np.asarray(forward(other, tokens, mask))).max() > 1e-3


@pytest.mark.numerics
def test_llama3_scaling_changes_the_frequencies():
    # Each in one program, as inside a model (eagerly every op compiles on its own).
    base, scaled = jax.jit(
        lambda: [zoo.internal.rope_frequencies(16, theta=10000.0, llama3=s) for s in (None, (8.0, 1.0, 4.0, 16))]
    )()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**CASES["llama3_scaled"][1] | {"rope_theta": 10000.0, "head_dim": 16})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    # Elementwise: a wavelength, two comparisons and a blend, ~8 roundings a value each side.
    assert_rounding_close(scaled, expected.numpy(), terms=1, depth=8)
    assert not np.allclose(base, scaled)


@pytest.mark.parametrize("kind", ["linear", "yarn", "longrope"])
def test_rope_scalings_are_transformers_frequencies_and_factors(kind):
    """`zoo.nn.RopeScaling`'s inverse frequencies and cos/sin factor equal transformers'
    `ROPE_INIT_FUNCTIONS` of the same config: linear, yarn (ramp over the correction range),
    longrope with its short factors within the original context and its long ones past it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 16}
    if kind == "longrope":
        params |= {"short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}
    config = transformers.LlamaConfig(**SMALL | {"head_dim": 16, "rope_parameters": params})
    zoo_config = zoo.hf.get_family("llama").config_from_hf(config.to_dict())
    scaling = zoo.models._config.rope_scaling_of(zoo_config)
    lengths = (16, 17)  # the original context, and one past it (longrope's switch)
    # In one program, as inside a model (eagerly every op compiles on its own).
    short, long = map(np.asarray, jax.jit(lambda: [scaling.frequencies(16, 5e5, n) for n in lengths])())
    for longest, frequencies in zip(lengths, (short, long), strict=True):
        expected, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=longest)
        # A power, a division or two, and yarn's blend: a few roundings a value each side.
        assert_rounding_close(frequencies, expected.numpy(), terms=1, depth=6)
        assert scaling.cos_sin_factor == pytest.approx(factor, rel=1e-12)
    assert (kind == "longrope") != np.array_equal(short, long)


@pytest.mark.numerics
def test_multimodal_gemma3_loads_its_text_decoder_and_peft_opens_its_adapters(tmp_path, tokens):
    """A Gemma 3 multimodal checkpoint (`Gemma3ForConditionalGeneration`, a tiny vision
    tower beside the gemma3_text case's decoder): zoo loads the text decoder (its tensors
    under `language_model.model.`; the vision tower and projector skipped, no warning)
    with the multimodal model's text logits; writes it as `Gemma3ForCausalLM`, the
    decoder's tensors bit for bit; peft opens a zoo adapter on the multimodal model with
    zoo's logits (modules named `model.language_model.layers.{i}...`), and zoo a peft one;
    the serving engine serves that adapter folder as zoo.generate decodes it."""
    import warnings

    import peft

    text = CASES["gemma3_text"][1] | {"max_position_embeddings": 64}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    torch.manual_seed(7)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "mm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped is a task head's
        model = zoo.hf.from_pretrained(tmp_path / "mm")
    assert (model.config.family, model.config.rope_factors) == ("gemma3", (1.0, 8.0, 1.0))
    mask = _masks()["right"]
    t = np.where(mask, tokens, 0).astype(np.int32)
    got = forward(model, jnp.asarray(t), jnp.asarray(mask))
    print(f"MAX DIFF gemma3 multimodal: {_check(got, _hf_logits(hf, t, mask), mask, 'gemma3 multimodal'):.2e}")
    zoo.hf.save_pretrained(model, tmp_path / "text")
    exported = _open_hf(tmp_path / "text")
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    _check(got, _hf_logits(exported, t, mask), mask, "gemma3 multimodal, written as gemma3_text")
    source = safetensors.numpy.load_file(str(tmp_path / "mm" / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "text" / "model.safetensors"))
    decoder = {k.replace("language_model.model.", "model.", 1): v for k, v in source.items() if "language_model" in k}
    assert sorted(written) == sorted(decoder)
    for k in written:  # Gemma's norms go through fl(1 + w) − 1 (exact): off by one rounding of 1 + w
        bound = UNIT_ROUNDOFF * largest(1 + decoder[k]) if "norm" in k else 0
        np.testing.assert_allclose(written[k], decoder[k], rtol=0, atol=bound, err_msg=k)
    # Adapters both ways on the multimodal model.
    lora = zoo.lora.LoraConfig(r=2, lora_alpha=4, target_modules=("q_proj", "v_proj", "down"), init_lora_weights=False)
    adapted = zoo.lora.add_lora(model, lora, key=jax.random.key(1))
    zoo.lora.save_adapter(adapted, lora, tmp_path / "zoo-adapter")
    names = json.loads((tmp_path / "zoo-adapter" / "adapter_config.json").read_text())["target_modules"]
    assert "model.language_model.layers.0.self_attn.q_proj" in names
    opened = peft.PeftModel.from_pretrained(hf, tmp_path / "zoo-adapter").eval()
    _check(forward(adapted, jnp.asarray(t), jnp.asarray(mask)), _hf_logits(opened, t, mask), mask, "zoo adapter, peft")
    # Served with that adapter folder (read by the family's names): zoo.generate's tokens.
    engine = zoo.serve.Engine(model, slots=1, max_len=16, adapters={"mine": tmp_path / "zoo-adapter"})
    handle = engine.submit(zoo.serve.Request(tokens[0, :5].tolist(), max_tokens=4, adapter="mine"))
    engine.run_until_done()
    want = np.asarray(zoo.generate(adapted, tokens[:1, :5], max_new_tokens=4))[0, 5:]
    assert handle.ids == want.tolist()
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm").eval()
    # The tied head too (peft ties its branch to the embedding's; built without autograd so
    # the tied tensors stay leaves the float64 reference can copy).
    theirs = peft.LoraConfig(r=2, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|o_proj)|lm_head",
                             ensure_weight_tying=True, init_lora_weights=False)  # fmt: skip
    with torch.no_grad():
        peft.get_peft_model(hf, theirs).save_pretrained(tmp_path / "peft-adapter")
    mine, _ = zoo.lora.load_adapter(model, tmp_path / "peft-adapter")
    _check(forward(mine, jnp.asarray(t), jnp.asarray(mask)), _hf_logits(hf, t, mask), mask, "peft adapter, zoo")
    # The same adapter as peft wrote it on transformers 4.x, whose model held the decoder at
    # `language_model.model.` and the head at `language_model.lm_head`: peft reads it on
    # today's model (by its conversion mapping), zoo too.
    shutil.copytree(tmp_path / "peft-adapter", tmp_path / "older-adapter")
    file = tmp_path / "older-adapter" / "adapter_model.safetensors"
    written = safetensors.numpy.load_file(str(file))
    older = "base_model.model.language_model.model."
    assert any(k.startswith("base_model.model.lm_head.") for k in written)
    safetensors.numpy.save_file({k.replace("base_model.model.model.language_model.", older)
                                 .replace("base_model.model.lm_head.", "base_model.model.language_model.lm_head."): v
                                 for k, v in written.items()}, str(file))  # fmt: skip
    assert all(k.startswith("base_model.model.language_model.") for k in safetensors.numpy.load_file(str(file)))
    fresh = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm").eval()
    hf_older = _hf_logits(peft.PeftModel.from_pretrained(fresh, tmp_path / "older-adapter").eval(), t, mask)
    np.testing.assert_array_equal(hf_older.f32, _hf_logits(hf, t, mask).f32)  # peft reads the older names as today's
    older_mine, _ = zoo.lora.load_adapter(model, tmp_path / "older-adapter")
    _check(forward(older_mine, jnp.asarray(t), jnp.asarray(mask)), hf_older, mask, "peft adapter of transformers 4.x")


def test_export_keeps_source_config_and_copies_tokenizer(hf_dirs, loaded, tmp_path):
    zoo.hf.save_pretrained(loaded["llama"], tmp_path)
    source = json.loads((hf_dirs["llama"] / "config.json").read_text())
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["max_position_embeddings"] == source["max_position_embeddings"] == 64
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (hf_dirs["llama"] / name).read_bytes()
    generation = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert generation.eos_token_id == 2


@pytest.mark.numerics
def test_scratch_llama_is_exported_by_shape(tmp_path, tokens):
    """A Llama-shaped zoo model built from scratch (no family) is written as Llama, with a
    generation_config.json transformers reads."""
    config = TransformerConfig(
        vocab_size=VOCAB, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=48, max_len=32,
        positions="rope", activation="swiglu", norm="rmsnorm", use_bias=False, tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    # Its shapes from the constructor, its weights drawn on the host (the initialiser is not
    # what this tests, and drawing compiles nothing): norms near 1, the rest small.
    model = drawn_on_host(eqx.filter_eval_shape(Transformer, config, key=jax.random.key(3)), 3, 0.15, norm=1.0)
    assert zoo.hf.family_of(model).name == "llama"
    zoo.hf.save_pretrained(model, tmp_path)
    hf = _open_hf(tmp_path)
    assert type(hf).__name__ == "LlamaForCausalLM"
    mask = _masks()["right"]
    d = _check(forward(model, tokens, mask), _hf_logits(hf, tokens, mask), mask, "scratch llama export")
    print(f"MAX DIFF scratch llama export: {d:.2e}")
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"_from_model_config": True}


def test_activation_spelling_round_trips(tmp_path):
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=31, n_positions=16,
                                     activation_function="gelu_pytorch_tanh")  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "src")
    zoo.hf.save_pretrained(zoo.hf.from_pretrained(tmp_path / "src"), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["activation_function"] == "gelu_pytorch_tanh"


# --------------------------------------------------------------------------- meshes


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("name", "preset", "devices"),
    [
        ("qwen2", "fsdp", 8), ("qwen3", "fsdp", 8), ("qwen3", "tp", 8), ("qwen2", "fsdp+tp", 4),
        ("olmo2", "fsdp", 8), ("olmo2", "tp", 8), ("smollm3", "fsdp", 8), ("smollm3", "tp", 8),
        ("gemma2", "fsdp", 8), ("gemma2", "tp", 8), ("gemma3_text", "fsdp", 8), ("gemma3_text", "tp", 8),
        ("phi3_partial", "fsdp", 8), ("phi3_partial", "tp", 8),
    ],
)  # fmt: skip
def test_sharded_loads_equal_unsharded(name, preset, devices, hf_dirs, loaded, tokens):
    """data=8/4/2 × model=2; the tp presets also pad the odd vocabulary (61 → 62). Qwen3's
    q/k norms act on heads split over `model` under tp; OLMo 2's sum squares across them;
    SmolLM3's per-layer pattern (NoPE and sliding layers) is scanned beside sharded
    parameters; Gemma 2/3's soft-capped logits are capped before the padded entries are set."""
    mesh = preset_mesh(preset, devices)
    model = zoo.hf.from_pretrained(hf_dirs[name], rules=zoo.rules(preset), mesh=mesh)
    padded = "tp" in preset
    assert model.config.padded_vocab == (62 if padded else VOCAB)
    assert isinstance(model.token_embedding.weight.sharding, NamedSharding)
    tokens, mask = _rows8(tokens), _rows8(_masks()["left"])
    with jax.set_mesh(mesh):
        got = np.asarray(forward(model, *_placed(mesh, tokens, mask)))
    want = np.asarray(forward(loaded[name], tokens, mask))
    assert_rounding_close(got[..., :VOCAB], want, **SUMS)
    if padded:
        assert (got[..., VOCAB:] == np.finfo(np.float32).min).all()
        assert (np.argmax(got, -1) == np.argmax(want, -1)).all()
        targets = jnp.asarray(tokens)
        loss = lambda logits: zoo.models.cross_entropy(jnp.asarray(logits), targets)
        # A mean over 64 tokens of log-sum-exps over 62 logits: two more sums of 64 terms.
        assert_rounding_close(loss(got), loss(want), terms=64, depth=2)


def test_padded_vocab_exports_the_real_rows(hf_dirs, tmp_path):
    mesh = preset_mesh("tp", 8)
    model = zoo.hf.from_pretrained(hf_dirs["llama"], rules=zoo.rules("tp"), mesh=mesh)
    assert model.token_embedding.weight.shape[0] == 62 and model.lm_head.weight.shape[1] == 62
    assert not np.asarray(model.token_embedding.weight)[VOCAB:].any()  # padding rows are zero
    tensors = zoo.hf.hf_tensors(model)
    source = safetensors.numpy.load_file(str(hf_dirs["llama"] / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_array_equal(tensors[name], source[name])
    zoo.hf.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == VOCAB


@pytest.mark.numerics
def test_gpt2_and_bert_odd_vocabularies_load_under_tp(tmp_path):
    """The README's `from_pretrained(gpt2_dir, rules=zoo.rules("tp"))` with an odd
    vocabulary; BERT's over a model axis of 4."""
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=16, n_layer=1, n_head=4, vocab_size=51, n_positions=16)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                                          intermediate_size=32, vocab_size=50, max_position_embeddings=16))  # fmt: skip
    bert.save_pretrained(tmp_path / "bert")
    tokens = np.random.default_rng(1).integers(0, 50, (4, 6)).astype(np.int32)
    mesh = preset_mesh("tp", 8)
    model = zoo.hf.from_pretrained(tmp_path / "gpt2", rules=zoo.rules("tp"), mesh=mesh)
    expected = torch_reference(lambda m: m(_torch(tokens)).logits, gpt2.eval())
    with jax.set_mesh(mesh):
        got = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, *_placed(mesh, tokens)))
    assert got.shape[-1] == 52
    assert_as_accurate(got[..., :51], expected, what="GPT-2 under tp")
    mesh4 = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    encoder = zoo.hf.from_pretrained(tmp_path / "bert", rules=zoo.rules("tp"), mesh=mesh4)
    assert encoder.embeddings.word_embeddings.weight.shape[0] == 52
    expected = torch_reference(lambda m: m(_torch(tokens)).last_hidden_state, bert.eval())
    with jax.set_mesh(mesh4):
        got = np.asarray(eqx.filter_jit(lambda m, t: m(t))(encoder, *_placed(mesh4, tokens)))
    assert_as_accurate(got, expected, what="BERT under tp")


# --------------------------------------------------------------------------- cache ids


def test_model_ids_load_from_the_local_cache_first(hf_dirs, loaded, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abc"
    shutil.copytree(hf_dirs["llama"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = zoo.hf.from_pretrained("tiny-org/tiny-llama")
    assert model.config.source_dir == str(snapshot.resolve())
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded["llama"]), strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert zoo.hf.resolve_model_dir("tiny-org/tiny-llama") == snapshot
    # Missing from the cache: fetched from the Hub (tests/test_hub.py), unless offline, as
    # the test suite is (tests/conftest.py).
    with pytest.raises(FileNotFoundError, match=rf"cache \({tmp_path / 'hub'}\), and HF_HUB_OFFLINE is set"):
        zoo.hf.from_pretrained("tiny-org/absent")
    (snapshot.parent / "4567def").mkdir()
    (snapshot.parent.parent / "refs" / "main").unlink()
    with pytest.raises(FileNotFoundError, match="2 snapshots"):
        zoo.hf.from_pretrained("tiny-org/tiny-llama")
    with pytest.raises(FileNotFoundError, match="no model directory"):
        zoo.hf.from_pretrained(tmp_path / "no" / "such" / "dir")


def test_cli_finetunes_a_llama_from_the_cache(tmp_path, monkeypatch, llama_dir, data_files, chat_run):
    """`zoo finetune transformer --init ORG/NAME` with a Llama in the local cache: the
    session's chat SFT run (tests/tiny_runs.py, `--init` the tiny Llama's folder) again with
    the model's id for `--init`, its snapshot a link to that folder. The same model, data
    and flags: the run's adapter is the chat run's, bit for bit, and its programs are the
    chat run's (a config names its folder resolved, so the link's target)."""
    from tiny_runs import TINY

    snapshot = tmp_path / "hub" / "models--org--cli-llama" / "snapshots" / "abc"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(llama_dir, target_is_directory=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = _zoo("finetune", "transformer", "--init", "org/cli-llama", "--data", data_files["chat"], "--lora",
               "r=4,alpha=8", *TINY, "--steps", "2", "--lr", "1e-2", "--output", tmp_path / "out")  # fmt: skip
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["init"] == str(snapshot)
    assert "1 gradient all-reduce" in out
    ours = safetensors.numpy.load_file(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"))
    theirs = safetensors.numpy.load_file(str(chat_run / "adapter" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def _zoo(*args):
    import contextlib
    import io

    from zoo._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    assert rc == 0, err.getvalue()
    return out.getvalue()


def test_cli_info_and_inspect_take_a_family_folder(hf_dirs):
    """`zoo info DIR` / `zoo inspect DIR` under tp: the odd vocabulary padded, one
    gradient all-reduce (without clipping, whose global norm over gradients sharded on
    `model` reduces scalars of its own outside loops)."""
    mesh = ["--devices", "8", "--mesh", "data=4,model=2", "--rules", "tp"]
    info = json.loads(_zoo("info", hf_dirs["qwen2"], *mesh, "--json"))
    embedding = next(r for r in info["leaves"] if "token_embedding" in r["path"])
    assert embedding["shape"] == [62, 32] and embedding["spec"][0] == "model"
    report = json.loads(_zoo("inspect", hf_dirs["llama"], *mesh, "--microbatches", "2", "--clip", "0", "--json"))
    summary = report["summary"]  # the gradient all-reduce over data once; in loops only model-axis ones
    assert summary["all_reduce_outside"] == 1 and summary["outside_mesh_axes"] == ["data"]
    assert summary["in_loop_mesh_axes"] == ["model"]


@pytest.mark.numerics
def test_padded_vocab_gradients_equal_unpadded(hf_dirs, loaded, tokens):
    """Under tp the padded model's next-token gradients are the unpadded ones on the real
    rows and zero on the padding rows."""
    mesh = preset_mesh("tp", 8)
    padded = zoo.hf.from_pretrained(hf_dirs["llama"], rules=zoo.rules("tp"), mesh=mesh)

    @eqx.filter_jit
    def grads(model, tokens, mask):
        def loss(m):
            sums, counts = zoo.models.next_token_loss(m, {"tokens": tokens, "mask": mask})
            return jnp.sum(sums) / jnp.sum(counts)

        return eqx.filter_grad(loss)(model)

    t, mask = _rows8(tokens), _rows8(_masks()["right"])
    with jax.set_mesh(mesh):
        got = grads(padded, *_placed(mesh, t, mask))
    want = grads(loaded["llama"], t, mask)
    emb, head = np.asarray(got.token_embedding.weight), np.asarray(got.lm_head.weight)
    assert_rounding_close(emb[:VOCAB], want.token_embedding.weight, **SUMS)
    assert_rounding_close(head[:, :VOCAB], want.lm_head.weight, **SUMS)
    assert not emb[VOCAB:].any() and not head[:, VOCAB:].any() and np.abs(head).max() > 1e-3
    assert_tree_rounding_close(got.layers, want.layers, **SUMS, what="layers")
