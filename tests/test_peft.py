"""LoRA adapters both ways with peft: zoo adapters open in peft (PeftModel, AutoPeftModel)
with zoo's outputs, peft adapters load into zoo with peft's outputs, for every Hugging Face
family; GPT-2's fused c_attn, rsLoRA, modules_to_save, SEQ_CLS, all-linear, integrity."""

import dataclasses
import functools
import json
import operator
import types
import warnings
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import peft
import pytest
import safetensors.torch
import torch
import transformers
from helpers import Reference, assert_as_accurate, assert_rounding_close, torch_reference, tree_allclose

import zoo
from zoo.lora import LoraConfig, add_lora, load_adapter, save_adapter

# Also run under other CPU kernels and thread counts (`make test-numerics`); torch on one
# thread: its references here are tiny models (tests/conftest.py).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("torch_one_thread")]

VOCAB, SEQ, BATCH = 32, 8, 2
TOKENS = np.random.default_rng(0).integers(1, VOCAB, (BATCH, SEQ))  # no padding id 0

BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 32,
    "max_position_embeddings": SEQ,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
GPT2 = {
    "vocab_size": VOCAB,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": SEQ,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 1,
}
# Llama-style decoders: grouped-query attention, an untied head.
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Phi-3 fuses gate | up into gate_up_proj (and q | k | v into qkv_proj): that HF name picks both.
GATE = {"phi3": "gate_up_proj"}
# Gemma: its own head size, the head tied to the embedding (no lm_head to save).
GEMMA = {"head_dim": 4, "tie_word_embeddings": True}
# Qwen3: q/k norms over a head_dim ≠ hidden/heads. OLMo 2: q/k norms over the whole
# projections (32 and 16 wide), norms after the sub-layers, attention biases.
# SmolLM3: layers 1 and 3 without RoPE, a window of 3 (< SEQ) on layers 0 and 3.
SMOLLM3 = {
    "num_hidden_layers": 4,
    "no_rope_layer_interval": 2,
    "use_sliding_window": True,
    "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
}
# Gemma 2: norms around each sub-layer, a window of 3 (< SEQ) on layer 0, scores and
# logits soft-capped low enough to bite. Gemma 3: its q/k norms, a window of 3 on layer 0
# at RoPE base 10k and layer 1 at 1M, the logits soft-capped.
GEMMA2 = GEMMA | {
    "sliding_window": 3,
    "attn_logit_softcapping": 2.0,
    "final_logit_softcapping": 3.0,
    "query_pre_attn_scalar": 6,
}
GEMMA3 = GEMMA | {
    "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"],
    "final_logit_softcapping": 3.0,
    "query_pre_attn_scalar": 6,
}
EXTRA = {
    "gemma": GEMMA,
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "qwen3": {"head_dim": 8},
    "olmo2": {"head_dim": 8, "attention_bias": True},
    "smollm3": SMOLLM3,
    "phi3": {"partial_rotary_factor": 0.5},  # Phi-4-mini's partial rotary: RoPE on half of each head
}


def perturb(module, seed, which=lambda name: True, scale=0.1):
    """Add noise to the parameters `which` selects (LayerNorms, biases, B = 0 branches: all
    non-trivial), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if which(name):
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return module


def is_adapter(name):
    return "lora_" in name or "modules_to_save" in name


@functools.cache
def hf_folder(kind, root):
    """A tiny random (perturbed) Hugging Face model saved under `root`, by kind."""
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**BERT))
    elif kind == "bert-cls":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, num_labels=3))
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    else:
        extra = EXTRA.get(kind, {})
        model = getattr(transformers, CAUSAL_LM[kind])(transformers.AutoConfig.for_model(kind, **DECODER | extra))
    folder = f"{root}/{kind}"
    perturb(model, 1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def hf_outputs(model) -> Reference:
    """What the HF (or peft) model computes on TOKENS, hidden states or logits, in float32
    and on a float64 copy (helpers.torch_reference)."""
    model.eval()

    def run(m):
        out = m(input_ids=torch.tensor(TOKENS), attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long))
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return torch_reference(run, model)


@eqx.filter_jit
def _zoo_forward(model, tokens):
    return model(tokens)


def zoo_outputs(model):
    return np.asarray(_zoo_forward(model, jax.numpy.asarray(TOKENS)))


def assert_close(zoo_value, hf_value: Reference, what):
    """zoo's output as accurate as the HF/peft model's own (helpers.assert_as_accurate)."""
    zoo_value = zoo_value[..., : hf_value.f32.shape[-1]]  # a vocabulary padded for tensor parallelism
    return assert_as_accurate(zoo_value, hf_value, what=what)


def no_peft_warnings(record):
    peft_warnings = [str(w.message) for w in record if "peft" in w.filename]
    assert not peft_warnings, peft_warnings


def peft_adapter(hf_model, config, folder, seed=2):
    """A peft adapter made with get_peft_model, its branches (and saved modules) non-zero."""
    torch.manual_seed(seed)  # peft draws A from torch's global generator
    model = peft.get_peft_model(hf_model, config)
    perturb(model, seed, is_adapter)
    model.save_pretrained(folder)
    return model


# --------------------------------------------------------------------------- BERT


def test_bert_zoo_adapter_opens_in_peft_with_hf_target_names(root, tmp_path):
    folder = hf_folder("bert", root)
    encoder = zoo.hf.from_pretrained(folder)
    # HF names in target_modules: "query"/"value" and every "dense" (attention output, MLP).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], init_lora_weights=False)
    model = add_lora(encoder, config, key=jax.random.key(1))
    assert set(zoo.lora.target_names(encoder, config)) == {
        f"layers.layers.{m}" for m in ("attention.q_proj", "attention.v_proj", "attention.o_proj", "mlp.up", "mlp.down")
    }
    save_adapter(model, config, tmp_path / "a")
    values = json.loads((tmp_path / "a/adapter_config.json").read_text())
    assert values["task_type"] == "FEATURE_EXTRACTION" and "zoo" not in values
    assert values["base_model_name_or_path"] == str(Path(folder).resolve())
    ours = zoo_outputs(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opened = peft.PeftModel.from_pretrained(transformers.BertModel.from_pretrained(folder), tmp_path / "a")
        auto = peft.AutoPeftModelForFeatureExtraction.from_pretrained(tmp_path / "a")
    no_peft_warnings(record)
    assert_close(ours, hf_outputs(opened), "BertModel, PeftModel")
    assert_close(ours, hf_outputs(auto), "BertModel, AutoPeftModel")
    assert not np.allclose(ours, zoo_outputs(encoder), atol=1e-3)  # the adapter does something


def test_bert_all_linear_peft_adapter_loads_skipping_the_pooler(root, tmp_path):
    folder = hf_folder("bert", root)
    hf = transformers.BertModel.from_pretrained(folder)
    opened = peft_adapter(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), tmp_path / "p")
    assert "pooler.dense" in json.loads((tmp_path / "p/adapter_config.json").read_text())["target_modules"]
    with pytest.warns(UserWarning, match=r"skipping the adapter's tensors for \['pooler.dense'\].*pooler_output"):
        model, _ = load_adapter(zoo.hf.from_pretrained(folder), tmp_path / "p")
    assert len(zoo.lora.modules(model, zoo.lora.LoraLinear)) == 6
    assert_close(zoo_outputs(model), hf_outputs(opened), "BertModel all-linear, peft → zoo")


# --------------------------------------------------------------------------- SEQ_CLS


def test_bert_classifier_loads_with_cls_pooling(root):
    folder = hf_folder("bert-cls", root)
    classifier = zoo.hf.load_bert_classifier(folder)
    assert classifier.pooling == "cls" and classifier.num_labels == 3
    hf = transformers.BertForSequenceClassification.from_pretrained(folder)
    assert_close(zoo_outputs(classifier), hf_outputs(hf), "BertForSequenceClassification, no adapter")
    # A BertModel folder: its pooler, a new head (as BertForSequenceClassification.from_pretrained does).
    bert = hf_folder("bert", folder.rsplit("/", 1)[0])
    with pytest.raises(ValueError, match="no classifier.* head .*pass num_labels="):
        zoo.hf.load_bert_classifier(bert)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    fresh = zoo.hf.load_bert_classifier(bert, num_labels=5, rules=zoo.rules("fsdp"), mesh=mesh)
    pooler = transformers.BertModel.from_pretrained(bert).pooler.dense
    np.testing.assert_array_equal(np.asarray(fresh.pooler.weight), pooler.weight.detach().numpy().T)
    assert fresh.head.weight.shape == (16, 5) and fresh.head.weight.sharding.mesh == mesh


def test_seq_cls_both_ways(root, tmp_path):
    folder = hf_folder("bert-cls", root)
    # peft → zoo: all-linear on BertForSequenceClassification adapts bert.pooler.dense, not the classifier.
    hf = transformers.BertForSequenceClassification.from_pretrained(folder)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS")
    opened = peft_adapter(hf, config, tmp_path / "p")
    model, loaded = load_adapter(zoo.hf.load_bert_classifier(folder), tmp_path / "p")
    assert "pooler" in loaded.target_modules and loaded.modules_to_save == ("head",)
    assert_close(zoo_outputs(model), hf_outputs(opened), "SEQ_CLS peft → zoo")
    # A mean-pooling classifier would compute other logits: refused, with the reason.
    mean = zoo.models.EncoderClassifier(zoo.hf.from_pretrained(folder), 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"SEQ_CLS.*\[CLS\].*mean-pools"):
        load_adapter(mean, tmp_path / "p")

    # zoo → peft: AutoPeftModelForSequenceClassification opens it from the adapter folder alone.
    base = zoo.hf.load_bert_classifier(folder)
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules="all-linear", modules_to_save=["classifier"], init_lora_weights=False
    )  # HF's name for the head
    model = add_lora(base, config, key=jax.random.key(3))
    assert zoo.lora.trainable(model, config).head.weight is True
    model = eqx.tree_at(lambda m: m.head.bias, model, model.head.bias + 0.5)
    save_adapter(model, config, tmp_path / "z")
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert values["task_type"] == "SEQ_CLS" and values["modules_to_save"] == ["classifier"]
    assert "bert.pooler.dense" in values["target_modules"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        auto = peft.AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "z")
    no_peft_warnings(record)
    assert_close(zoo_outputs(model), hf_outputs(auto), "SEQ_CLS zoo → peft")


class MeanPooled(torch.nn.Module):
    """What a mean-pooling zoo classifier computes, in torch: the (peft) BertModel's hidden
    states, their mean over the attention mask, then the head."""

    def __init__(self, encoder, head):
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return types.SimpleNamespace(logits=self.head((hidden * mask).sum(1) / mask.sum(1)))


def test_mean_pooling_classifier_adapter_is_features_plus_a_head(root, tmp_path):
    """No Hugging Face class mean-pools: such a classifier's adapter is its encoder's
    (FEATURE_EXTRACTION, BertModel's names), its head apart in head.safetensors; peft
    opens the one as features, torch's nn.Linear loads the other: zoo's logits. Opening it
    as a SEQ_CLS classifier is refused by peft; zoo reads it back exactly."""
    folder = hf_folder("bert", root)
    mean = zoo.models.EncoderClassifier(zoo.hf.from_pretrained(folder), 3, key=jax.random.key(0))
    config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", modules_to_save=["head"],
                        init_lora_weights=False)  # fmt: skip
    model = add_lora(mean, config, key=jax.random.key(3))
    model = eqx.tree_at(lambda m: m.head.bias, model, model.head.bias + 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        files = save_adapter(model, config, tmp_path / "m")
    assert sorted(f.name for f in files) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "head.safetensors", "zoo_adapter.json"]
    )
    values = json.loads((tmp_path / "m/adapter_config.json").read_text())
    assert values["task_type"] == "FEATURE_EXTRACTION" and values["modules_to_save"] is None
    assert all(t.startswith("encoder.layer.") for t in values["target_modules"]), values["target_modules"]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        encoder = peft.AutoPeftModelForFeatureExtraction.from_pretrained(tmp_path / "m")
    no_peft_warnings(record)
    head = torch.nn.Linear(16, 3)
    head.load_state_dict(safetensors.torch.load_file(tmp_path / "m/head.safetensors"))
    assert_close(zoo_outputs(model), hf_outputs(MeanPooled(encoder, head)), "mean-pooling classifier zoo → peft")
    with pytest.raises(ValueError, match="PeftModelForFeatureExtraction"):
        peft.AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "m", num_labels=3)
    loaded, loaded_config = load_adapter(mean, tmp_path / "m")
    assert loaded_config == config
    assert tree_allclose(loaded, model, rtol=0, atol=0)
    # A cls-pooling classifier is another model: refused, naming the pooling.
    with pytest.raises(ValueError, match="pooling='mean'.*pooling='cls'"):
        load_adapter(zoo.hf.load_bert_classifier(folder, num_labels=3), tmp_path / "m")


def test_mean_pooling_adapter_of_an_earlier_zoo_loads(root, tmp_path):
    """zoo once wrote a mean-pooling classifier's adapter as a SEQ_CLS one
    (`bert.`-prefixed names, the head as `classifier`): it still loads, exactly."""
    folder = hf_folder("bert", root)
    mean = zoo.models.EncoderClassifier(zoo.hf.from_pretrained(folder), 3, key=jax.random.key(0))
    config = LoraConfig(r=2, target_modules=["query"], modules_to_save=["head"], init_lora_weights=False)
    model = add_lora(mean, config, key=jax.random.key(3))
    save_adapter(model, config, tmp_path / "new")
    tensors = safetensors.torch.load_file(tmp_path / "new/adapter_model.safetensors")
    old = {k.replace("base_model.model.", "base_model.model.bert."): v for k, v in tensors.items()}
    head = safetensors.torch.load_file(tmp_path / "new/head.safetensors")
    old |= {f"base_model.model.classifier.{k}": v for k, v in head.items()}
    (tmp_path / "old").mkdir()
    safetensors.torch.save_file(old, tmp_path / "old/adapter_model.safetensors", metadata={"format": "pt"})
    values = json.loads((tmp_path / "new/adapter_config.json").read_text())
    values |= {"task_type": "SEQ_CLS", "modules_to_save": ["classifier"],
               "target_modules": ["bert." + t for t in values["target_modules"]]}  # fmt: skip
    (tmp_path / "old/adapter_config.json").write_text(json.dumps(values))
    meta = json.loads((tmp_path / "new/zoo_adapter.json").read_text())
    meta.pop("head_sha256")
    meta["tensors_sha256"] = zoo.lora.tensors_sha256({k: v.numpy() for k, v in old.items()})
    (tmp_path / "old/zoo_adapter.json").write_text(json.dumps(meta))
    loaded, _ = load_adapter(mean, tmp_path / "old")
    assert tree_allclose(loaded, model, rtol=0, atol=0)


# --------------------------------------------------------------------------- GPT-2


def test_gpt2_zoo_qkv_branches_open_in_peft_as_one_c_attn_branch(root, tmp_path):
    folder = hf_folder("gpt2", root)
    base = zoo.hf.from_pretrained(folder)
    assert zoo.lora.target_names(base, LoraConfig(target_modules=["c_attn"])) == [
        f"layers.layers.attention.{p}_proj" for p in "qkv"
    ]
    config = LoraConfig(
        r=2,
        lora_alpha=5,
        use_rslora=True,
        target_modules=("q_proj", "k_proj", "v_proj", "up"),
        modules_to_save=("final_norm",),
        init_lora_weights=False,
    )
    model = add_lora(base, config, key=jax.random.key(1))
    model = eqx.tree_at(lambda m: m.final_norm.weight, model, model.final_norm.weight * 1.5)
    save_adapter(model, config, tmp_path / "z")
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    c_attn = [f"transformer.h.{i}.attn.c_attn" for i in range(2)]
    assert sorted(values["target_modules"]) == sorted(c_attn + [f"transformer.h.{i}.mlp.c_fc" for i in range(2)])
    assert values["rank_pattern"] == {m: 6 for m in c_attn} and values["fan_in_fan_out"] is True
    assert values["modules_to_save"] == ["transformer.ln_f"] and values["task_type"] == "CAUSAL_LM"
    tensors = safetensors.torch.load_file(tmp_path / "z/adapter_model.safetensors")
    a, b = (
        tensors[f"base_model.model.{c_attn[1]}.lora_A.weight"],
        tensors[f"base_model.model.{c_attn[1]}.lora_B.weight"],
    )
    assert a.shape == (6, 16) and b.shape == (48, 6)
    k = model.layers.layers.attention.k_proj
    np.testing.assert_array_equal(a[2:4].numpy(), np.asarray(k.lora_A[1]).T)
    np.testing.assert_array_equal(b[16:32, 2:4].numpy(), np.asarray(k.lora_B[1]).T)
    assert not b[16:32, :2].any() and not b[:16, 2:].any()  # block-diagonal
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "z")
    no_peft_warnings(record)
    assert_close(zoo_outputs(model), hf_outputs(auto), "GPT-2 q/k/v + rsLoRA + modules_to_save, zoo → peft")
    # And back into zoo: the blocks split out exactly.
    loaded, loaded_config = load_adapter(base, tmp_path / "z")
    assert loaded_config == config and tree_allclose(loaded, model, rtol=0, atol=0)


def test_adapters_zoo_cannot_hold_name_why_on_the_first_line(root, tmp_path):
    """A rank_pattern rank: the first line (all a command prints)
    names the keys, their shapes and the cause; it ended at "does not fit ...:" before."""
    folder = hf_folder("gpt2", root)
    cases = [
        (peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], rank_pattern={"c_fc": 2}),
         ["4 mis-shaped (base_model.model.transformer.h.0.mlp.c_fc.lora_A.weight: expected [4, 16], found [2, 16]",
          "rank_pattern gives c_fc: 2 another rank than r 4"]),
    ]  # fmt: skip
    for i, (config, fragments) in enumerate(cases):
        peft_adapter(transformers.GPT2LMHeadModel.from_pretrained(folder), config, tmp_path / str(i))
        with pytest.raises(ValueError) as info:
            load_adapter(zoo.hf.from_pretrained(folder), tmp_path / str(i))
        first = str(info.value).splitlines()[0]
        assert all(f in first for f in fragments), first


def test_gpt2_peft_c_attn_branch_loads_as_three_zoo_branches_sharing_a(root, tmp_path):
    folder = hf_folder("gpt2", root)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder)
    # all-linear: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (peft leaves out lm_head).
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["ln_f"], task_type="CAUSAL_LM"
    )
    opened = peft_adapter(hf, config, tmp_path / "p")
    model, loaded = load_adapter(zoo.hf.from_pretrained(folder), tmp_path / "p")
    attention = model.layers.layers.attention
    assert loaded.r == 4 and loaded.modules_to_save == ("final_norm",)
    assert len(zoo.lora.modules(model, zoo.lora.LoraLinear)) == 6  # q, k, v, o, up, down
    np.testing.assert_array_equal(attention.q_proj.lora_A, attention.v_proj.lora_A)  # shared A
    assert_close(zoo_outputs(model), hf_outputs(opened), "GPT-2 all-linear + ln_f, peft → zoo")
    # A c_attn branch of another rank than zoo's one rank is refused, not mangled.
    values = json.loads((tmp_path / "p/adapter_config.json").read_text())
    values["r"] = 2
    (tmp_path / "p/adapter_config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="mis-shaped"):
        load_adapter(zoo.hf.from_pretrained(folder), tmp_path / "p")


# --------------------------------------------------------------------------- Llama, Mistral, Qwen2, Qwen3, OLMo 2, Gemma 1/2/3, Phi-3, SmolLM3


@pytest.mark.parametrize("family", sorted(CAUSAL_LM))
def test_decoder_families_both_ways(family, root, tmp_path):
    folder = hf_folder(family, root)
    # Llama with its vocabulary padded (as for tensor parallelism): a saved lm_head holds the real rows.
    padded = {"vocab_multiple": 48} if family == "llama" else {}
    base = zoo.hf.from_pretrained(folder, config_overrides=padded)
    # zoo → peft, targets named the HF way and the zoo way at once.
    head = [] if family.startswith("gemma") else ["lm_head"]  # Gemma's head is the tied embedding
    gate = GATE.get(family, "gate_proj")
    config = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "v_proj", gate, "down"],
        modules_to_save=["final_norm", *head],
        init_lora_weights=False,
    )
    model = add_lora(base, config, key=jax.random.key(1))
    model = eqx.tree_at(lambda m: m.final_norm.weight, model, model.final_norm.weight * 1.5)
    if head:
        model = eqx.tree_at(lambda m: m.lm_head.weight, model, model.lm_head.weight * 1.5)
    save_adapter(model, config, tmp_path / "z")
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert f"model.layers.1.mlp.{gate}" in values["target_modules"]
    assert values["modules_to_save"] == [*head, "model.norm"]
    if family == "phi3":  # one branch per fused module: q | v (k's rows zero; 16, 8, 8 wide), gate | up
        fused = {f"model.layers.{i}.{m}": 4 for i in range(2) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
        assert values["rank_pattern"] == fused
        tensors = safetensors.torch.load_file(tmp_path / "z/adapter_model.safetensors")
        b = tensors["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
        v = model.layers.layers.attention.v_proj
        assert b.shape == (32, 4) and not b[16:24].any()
        np.testing.assert_array_equal(b[24:, 2:].numpy(), np.asarray(v.lora_B[1]).T)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "z")
    no_peft_warnings(record)
    assert_close(zoo_outputs(model), hf_outputs(auto), f"{family} zoo → peft")
    # peft → zoo: all-linear (every projection, not lm_head).
    hf = getattr(transformers, CAUSAL_LM[family]).from_pretrained(folder)
    opened = peft_adapter(
        hf,
        peft.LoraConfig(
            r=2,
            lora_alpha=8,
            target_modules="all-linear",
            use_rslora=True,
            modules_to_save=head or None,
            task_type="CAUSAL_LM",
        ),
        tmp_path / "p",
    )
    loaded, loaded_config = load_adapter(base, tmp_path / "p")
    assert len(zoo.lora.modules(loaded, zoo.lora.LoraLinear)) == 7 and loaded_config.use_rslora
    if head:
        assert loaded.lm_head.weight.shape[1] == (48 if padded else VOCAB)
        assert not np.any(loaded.lm_head.weight[:, VOCAB:])
    assert_close(zoo_outputs(loaded), hf_outputs(opened), f"{family} all-linear rsLoRA, peft → zoo")


# --------------------------------------------------------------------------- integrity


def test_resaved_identical_tensors_load_and_changed_ones_are_refused(root, tmp_path):
    folder = hf_folder("gpt2", root)
    base = zoo.hf.from_pretrained(folder)
    # q and v only: a rank-2r c_attn branch whose k rows are zero.
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = add_lora(base, config, key=jax.random.key(1))
    save_adapter(model, config, tmp_path)
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path)
    assert_close(zoo_outputs(model), hf_outputs(auto), "GPT-2 q/v only, zoo → peft")
    weights = tmp_path / "adapter_model.safetensors"
    before = weights.read_bytes()
    tensors = safetensors.torch.load_file(weights)
    safetensors.torch.save_file(tensors, tmp_path.parent / "kept.safetensors")
    # peft's way of writing: other key order, other metadata: other bytes, same tensors.
    safetensors.torch.save_file(dict(reversed(list(tensors.items()))), weights, metadata={"format": "pt", "by": "peft"})
    assert weights.read_bytes() != before
    loaded, _ = load_adapter(base, tmp_path)
    assert tree_allclose(loaded, model, rtol=0, atol=0)
    # Changed tensors (as after training on in peft) are refused while zoo_adapter.json vouches for others.
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][:16, 2:] = 0.5  # q's rows now read v's rank columns: no longer block-diagonal
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not the ones .*zoo_adapter.json records.*delete zoo_adapter.json"):
        load_adapter(base, tmp_path)
    # Without it, it is a peft adapter: one rank-4 c_attn branch that no rank-2 zoo branches hold exactly.
    (tmp_path / "zoo_adapter.json").unlink()
    with pytest.raises(ValueError, match=r"neither block-structured rank-2 branches \(.*\) nor one rank-2 branch"):
        load_adapter(base, tmp_path)
    # The unchanged tensors without zoo_adapter.json (peft re-saved it elsewhere): q, k, v
    # branches (k's B zero), the same outputs.
    tensors[key] = safetensors.torch.load_file(tmp_path.parent / "kept.safetensors")[key]
    safetensors.torch.save_file(tensors, weights)
    resaved, resaved_config = load_adapter(base, tmp_path)
    assert len(resaved_config.target_modules) == 3 and not np.any(resaved.layers.layers.attention.k_proj.lora_B)
    np.testing.assert_array_equal(
        resaved.layers.layers.attention.v_proj.lora_B, model.layers.layers.attention.v_proj.lora_B
    )
    # The same weights plus a zero branch: the same sums (2 layers of ~6, 16-wide at most).
    assert_rounding_close(zoo_outputs(resaved), zoo_outputs(model), terms=16 * 4, depth=2 * 6 + 1)


# --------------------------------------------------------------------------- modules_to_save by suffix

# peft saves every module whose name ends with a modules_to_save entry (a plain string
# suffix): "norm" is each layer's input_layernorm and post_attention_layernorm, and
# model.norm; in OLMo 2 each layer's post_attention_layernorm, post_feedforward_layernorm
# and its attention's q_norm and k_norm (as wide as the projections), and model.norm; in
# Gemma 2 each layer's four (input, post-attention, pre- and post-feedforward).
NORMS = {
    "llama": ["input_layernorm", "post_attention_layernorm"],
    "olmo2": ["post_attention_layernorm", "post_feedforward_layernorm", "self_attn.k_norm", "self_attn.q_norm"],
    "gemma2": [
        "input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm",
    ],
}  # fmt: skip
# The zoo modules they are, in the order zoo lists them.
ZOO_NORMS = {
    "llama": ("layers.layers.attention_norm", "layers.layers.mlp_norm", "final_norm"),
    "olmo2": (
        "layers.layers.attention.q_norm", "layers.layers.attention.k_norm", "layers.layers.attention_out_norm",
        "layers.layers.mlp_out_norm", "final_norm",
    ),
    "gemma2": (
        "layers.layers.attention_norm", "layers.layers.mlp_norm", "layers.layers.attention_out_norm",
        "layers.layers.mlp_out_norm", "final_norm",
    ),
}  # fmt: skip


def norm_names(family, layers=2):
    norms = NORMS.get(family, NORMS["llama"])
    return sorted([f"model.layers.{i}.{n}" for i in range(layers) for n in norms] + ["model.norm"])


def zoo_norms(family, model):
    """The weights of `model`'s norms (each layer's and the final one), in ZOO_NORMS' order."""
    return [operator.attrgetter(name)(model).weight for name in ZOO_NORMS.get(family, ZOO_NORMS["llama"])]


# Gemma: its norms are stored as weight - 1; OLMo 2: other norms, q/k ones among them;
# Gemma 2: four a layer, each stored as weight - 1.
@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2", "gemma2"])
def test_peft_modules_to_save_norm_loads_the_norms_peft_saved(family, root, tmp_path):
    """peft (0.22 on) matches modules_to_save=["norm"] as a dotted part: it saves
    `model.norm` alone, and zoo reads that. peft up to 0.21 matched a plain suffix and saved
    every layer's norms too under the same entry: that file (peft's adapter of every norm by
    name, its entry written back as "norm", as those versions wrote it) loads with them all."""
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    every = ZOO_NORMS.get(family, ZOO_NORMS["llama"])
    for entries, want in ((["norm"], ("final_norm",)), (norm_names(family), every)):
        hf = getattr(transformers, CAUSAL_LM[family]).from_pretrained(folder)
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=entries,
                                 task_type="CAUSAL_LM")  # fmt: skip
        where = tmp_path / f"p{len(entries)}"
        opened = peft_adapter(hf, config, where)  # perturbs the saved norms' copies too
        tensors = safetensors.torch.load_file(where / "adapter_model.safetensors")
        saved = sorted(k.removeprefix("base_model.model.").removesuffix(".weight") for k in tensors if "lora_" not in k)
        assert saved == (["model.norm"] if entries == ["norm"] else norm_names(family))
        values = json.loads((where / "adapter_config.json").read_text())
        (where / "adapter_config.json").write_text(json.dumps(values | {"modules_to_save": ["norm"]}))
        model, loaded = load_adapter(base, where)
        assert loaded.modules_to_save == want
        for name, got, was in zip(every, zoo_norms(family, model), zoo_norms(family, base), strict=True):
            assert np.allclose(got, was) == (name not in want), name  # the saved norms arrived, no other
        assert_close(zoo_outputs(model), hf_outputs(opened), f"{family} modules_to_save {entries}, peft → zoo")
        # trainable marks the same modules; saved again, the file holds the same keys.
        trainable = zoo.lora.trainable(model, loaded)
        assert [w is True for w in zoo_norms(family, trainable)] == [n in want for n in every]
        save_adapter(model, loaded, tmp_path / f"z{len(entries)}")
        assert set(safetensors.torch.load_file(tmp_path / f"z{len(entries)}/adapter_model.safetensors")) == set(tensors)
    assert not np.allclose(zoo_outputs(model), zoo_outputs(add_lora(base, loaded, key=jax.random.key(0))), atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2", "gemma2"])
def test_zoo_modules_to_save_norm_suffix_opens_in_peft(family, root, tmp_path):
    folder = hf_folder(family, root)
    base = zoo.hf.from_pretrained(folder)
    # "norm" is the final norm alone (peft 0.22's rule); the layers' norms by their own names.
    entries = ["norm", *NORMS.get(family, NORMS["llama"])]
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=entries, init_lora_weights=False)
    model = add_lora(base, config, key=jax.random.key(1))
    trainable = zoo.lora.trainable(model, config)  # every layer's norms and the final one, nothing else
    assert all(w is True for w in zoo_norms(family, trainable)) and trainable.token_embedding.weight is False
    final_only = zoo.lora.trainable(model, dataclasses.replace(config, modules_to_save=["norm"]))
    assert [w is True for w in zoo_norms(family, final_only)] == [
        n == "final_norm" for n in ZOO_NORMS.get(family, ZOO_NORMS["llama"])
    ]
    rng = np.random.default_rng(5)
    norms = functools.partial(zoo_norms, family)
    model = eqx.tree_at(norms, model, [w + 0.1 * rng.standard_normal(w.shape, np.float32) for w in norms(model)])
    save_adapter(model, config, tmp_path / "z")
    values = json.loads((tmp_path / "z/adapter_config.json").read_text())
    assert values["modules_to_save"] == norm_names(family)  # every layer's, by full name: peft picks exactly these
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "z")
    no_peft_warnings(record)
    wrapped = sorted(n for n, m in auto.named_modules() if isinstance(m, peft.utils.ModulesToSaveWrapper))
    assert [n.removeprefix("base_model.model.") for n in wrapped] == norm_names(family)
    assert_close(zoo_outputs(model), hf_outputs(auto), f"{family} modules_to_save={entries}, zoo → peft")
    loaded, loaded_config = load_adapter(base, tmp_path / "z")
    assert loaded_config == config and tree_allclose(loaded, model, rtol=0, atol=0)


def test_modules_to_save_matching_nothing_or_some_layers_is_refused(root, tmp_path):
    folder = hf_folder("llama", root)
    base = zoo.hf.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"entry 'layer_norm' matches no module.*ends with \.it.*input_layernorm"):
        add_lora(base, LoraConfig(target_modules=["q_proj"], modules_to_save=["layer_norm"]), key=jax.random.key(0))
    # A string (peft would match each of its characters): refused by LoraConfig, or first
    # by the runtime type checks the suite runs with.
    with pytest.raises(TypeError, match="modules_to_save"):
        LoraConfig(modules_to_save="norm")
    # A peft adapter whose entries match nothing here (peft saved no module).
    hf = transformers.LlamaForCausalLM.from_pretrained(folder)
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["layer_norm"], task_type="CAUSAL_LM")
    peft_adapter(hf, config, tmp_path / "none")
    with pytest.raises(ValueError, match=r"modules_to_save \['layer_norm'\] match no module.*input_layernorm"):
        load_adapter(base, tmp_path / "none")
    # peft saved one layer's norm: zoo stacks the layers, so it saves a norm at all of them or none.
    hf = transformers.LlamaForCausalLM.from_pretrained(folder)
    config = peft.LoraConfig(
        r=2, target_modules=["q_proj"], modules_to_save=["layers.1.input_layernorm"], task_type="CAUSAL_LM"
    )
    peft_adapter(hf, config, tmp_path / "one")
    with pytest.raises(ValueError, match=r"only some layers of the stacked module 'layers.layers.attention_norm'"):
        load_adapter(base, tmp_path / "one")
