"""LoRA adapters on disk in peft's layout: round trips, key names, shape checks, atomic saves."""

import functools
import json
import os

import equinox as eqx
import jax
import numpy as np
import pytest
import safetensors.numpy
from helpers import (
    lm_batch,
    preset_mesh,
    tiny_decoder,
    tiny_encoder_classifier,
    tree_allclose,
)

import zoo
from zoo.lora import (
    LoraConfig,
    add_lora,
    hf_module_name,
    load_adapter,
    save_adapter,
)

DECODER = LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down"), init_lora_weights=False)
CLASSIFIER = LoraConfig(
    r=4, lora_alpha=16, target_modules=("q_proj", "v_proj"), init_lora_weights=False, modules_to_save=("head",)
)
PREFIX = "base_model.model."


@eqx.filter_jit
def forward(models, tokens):
    """Each model's output, in one compiled program."""
    return [model(tokens) for model in models]


def assert_same_outputs(a, b):
    out_a, out_b = forward([a, b], lm_batch(jax.random.key(3), 4)["tokens"])
    np.testing.assert_array_equal(out_a, out_b)


@functools.cache
def decoder_base():
    return tiny_decoder(jax.random.key(0))


@functools.cache
def classifier_base():
    return tiny_encoder_classifier(jax.random.key(0))


@functools.cache
def trained_classifier():
    """The classifier with random (non-zero) branches and a head changed as training would."""
    model = add_lora(classifier_base(), CLASSIFIER, key=jax.random.key(1))
    head = model.head.weight
    return eqx.tree_at(lambda m: m.head.weight, model, head + jax.random.normal(jax.random.key(2), head.shape))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adapter") / "classifier"
    save_adapter(trained_classifier(), CLASSIFIER, directory)
    return directory


def test_decoder_adapter_round_trip_reproduces_outputs(tmp_path):
    trained = add_lora(decoder_base(), DECODER, key=jax.random.key(1))
    assert np.abs(np.asarray(trained.layers.layers.attention.q_proj.lora_B)).min() > 0
    save_adapter(trained, DECODER, tmp_path / "dec")
    assert sorted(os.listdir(tmp_path / "dec")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "zoo_adapter.json",
    ]
    loaded, config = load_adapter(decoder_base(), tmp_path / "dec", key=jax.random.key(7))
    assert config == DECODER
    assert tree_allclose(loaded, trained, rtol=0, atol=0)
    assert_same_outputs(loaded, trained)


def test_encoder_classifier_round_trip_with_saved_head(classifier_dir):
    loaded, config = load_adapter(classifier_base(), classifier_dir)
    assert config == CLASSIFIER
    assert tree_allclose(loaded, trained_classifier(), rtol=0, atol=0)
    assert_same_outputs(loaded, trained_classifier())
    # Loading into a model that already carries branches (other values) sets them too.
    other = add_lora(classifier_base(), CLASSIFIER, key=jax.random.key(9))
    reloaded, _ = load_adapter(other, classifier_dir)
    assert tree_allclose(reloaded, trained_classifier(), rtol=0, atol=0)


def test_file_follows_peft_layout(classifier_dir):
    """A mean-pooling classifier's adapter is its encoder's (BertModel's names, a
    FEATURE_EXTRACTION adapter) and its head apart, torch's nn.Linear state dict."""
    tensors = safetensors.numpy.load_file(classifier_dir / "adapter_model.safetensors")
    layer = [
        f"{PREFIX}encoder.layer.{i}.attention.self.{p}.lora_{ab}.weight"
        for i in range(2)
        for p in ("query", "value")
        for ab in "AB"
    ]
    assert sorted(tensors) == sorted(layer)
    model = trained_classifier()
    q = model.encoder.layers.layers.attention.q_proj
    a, b = (
        tensors[f"{PREFIX}encoder.layer.1.attention.self.query.lora_A.weight"],
        tensors[f"{PREFIX}encoder.layer.1.attention.self.query.lora_B.weight"],
    )
    assert a.shape == (4, 16) and b.shape == (16, 4)  # [r, d_model], [d_model, r]
    np.testing.assert_array_equal(a, np.asarray(q.lora_A[1]).T)
    np.testing.assert_array_equal(b, np.asarray(q.lora_B[1]).T)
    head = safetensors.numpy.load_file(classifier_dir / "head.safetensors")
    assert sorted(head) == ["bias", "weight"] and head["weight"].shape == (3, 16)  # [num_labels, d_model]
    np.testing.assert_array_equal(head["weight"], np.asarray(model.head.weight).T)
    np.testing.assert_array_equal(head["bias"], np.asarray(model.head.bias))
    config = json.loads((classifier_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert config["task_type"] == "FEATURE_EXTRACTION" and config["modules_to_save"] is None
    assert sorted(config["target_modules"]) == sorted({k[len(PREFIX) :].rsplit(".", 2)[0] for k in layer})
    assert json.loads((classifier_dir / "zoo_adapter.json").read_text())["modules_to_save"] == ["head"]


def test_names_follow_bert_for_the_encoder_and_zoo_paths_elsewhere():
    classifier, encoder = classifier_base(), classifier_base().encoder
    assert hf_module_name(encoder, "layers.layers.attention.o_proj", (1,)) == "encoder.layer.1.attention.output.dense"
    assert hf_module_name(encoder, "layers.layers.mlp.up", (0,)) == "encoder.layer.0.intermediate.dense"
    assert hf_module_name(encoder, "layers.layers.mlp.down", (0,)) == "encoder.layer.0.output.dense"
    assert hf_module_name(encoder, "layers.layers.attention.k_proj", (1,)) == "encoder.layer.1.attention.self.key"
    # A mean-pooling classifier's encoder is BertModel; a CLS-pooling one is BertForSequenceClassification.
    assert hf_module_name(classifier, "encoder.embeddings.norm") == "embeddings.LayerNorm"
    assert hf_module_name(classifier, "head") == "classifier"
    cls = zoo.models.EncoderClassifier(encoder, 3, pooling="cls", key=jax.random.key(0))
    assert hf_module_name(cls, "encoder.embeddings.norm") == "bert.embeddings.LayerNorm"
    assert hf_module_name(cls, "pooler") == "bert.pooler.dense" and hf_module_name(cls, "head") == "classifier"
    # The tiny decoder (RoPE, RMSNorm, SwiGLU, untied head) is Llama-shaped: Llama's names.
    assert hf_module_name(decoder_base(), "layers.layers.attention.q_proj", (3,)) == "model.layers.3.self_attn.q_proj"
    assert hf_module_name(decoder_base(), "layers.layers.mlp.gate", (0,)) == "model.layers.0.mlp.gate_proj"
    assert hf_module_name(decoder_base(), "lm_head") == "lm_head"
    mlp = zoo.nn.MLP(2, 2, 4, 3, scan=True, key=jax.random.key(0))  # hidden: Stacked of 2
    assert hf_module_name(mlp, "hidden.layers.linear", (1,)) == "hidden.1.linear"
    assert hf_module_name(mlp, "output_layer") == "output_layer"
    with pytest.raises(ValueError, match="Stacked levels"):
        hf_module_name(decoder_base(), "layers.layers.attention.q_proj")


def test_adapter_without_zoo_entry_loads_as_peft_wrote_it(classifier_dir, tmp_path):
    """peft writes no zoo_adapter.json: targets come from the peft names."""
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    config = json.loads((classifier_dir / "adapter_config.json").read_text())
    config["target_modules"] = ["query", "value"]
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))
    for name in ("adapter_model.safetensors", "head.safetensors"):  # the head file: its head, saved whole
        (peft_dir / name).write_bytes((classifier_dir / name).read_bytes())
    loaded, loaded_config = load_adapter(classifier_base(), peft_dir)
    assert tree_allclose(loaded, trained_classifier(), rtol=0, atol=0)
    assert loaded_config.scaling == CLASSIFIER.scaling and loaded_config.modules_to_save == ("head",)
    assert set(loaded_config.target_modules) == {
        "encoder.layers.layers.attention.q_proj",
        "encoder.layers.layers.attention.v_proj",
    }


def test_loading_into_other_shapes_names_the_mismatched_tensors(classifier_dir):
    wider = tiny_encoder_classifier(jax.random.key(0), d_model=32)
    with pytest.raises(ValueError, match="mis-shaped") as err:
        load_adapter(wider, classifier_dir)
    message = str(err.value)
    assert f"{PREFIX}encoder.layer.0.attention.self.query.lora_A.weight: expected [4, 32], found [4, 16]" in message
    assert "d_model: saved 16, this model 32" in message
    # The first line (all a command prints) names the first of them and the other base.
    first = message.splitlines()[0]
    assert "does not fit this EncoderClassifier: " in first and not first.endswith(":"), first
    assert "mis-shaped (" in first and ": expected [4, 32], found [4, 16]" in first, first
    assert "the model configs differ (d_model: saved 16, this model 32" in first and "another base model?" in first
    # The head apart (head.safetensors) for another number of labels.
    five = zoo.models.EncoderClassifier(classifier_base().encoder, 5, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"head.safetensors: weight is \[16, 3\] in zoo's layout, this model's head "
        r"holds \[16, 5\]; the model configs differ \(num_labels: saved 3, this model 5",
    ):
        load_adapter(five, classifier_dir)
    # A model already carrying rank-8 branches.
    rank8 = add_lora(classifier_base(), LoraConfig(r=8, target_modules=("q_proj", "v_proj")), key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"lora_A.weight: expected \[8, 16\], found \[4, 16\]"):
        load_adapter(rank8, classifier_dir)
    # Branches on other modules: missing and unexpected keys, by name.
    other = add_lora(classifier_base(), LoraConfig(r=4, target_modules=("k_proj", "v_proj")), key=jax.random.key(1))
    with pytest.raises(ValueError, match="missing keys") as err:
        load_adapter(other, classifier_dir)
    assert "unexpected keys" in str(err.value) and "attention.self.key.lora_A.weight" in str(err.value)
    assert "missing keys (" in str(err.value).splitlines()[0] and "unexpected keys (" in str(err.value).splitlines()[0]
    # The wrong model class.
    with pytest.raises(ValueError, match="saved from a zoo EncoderClassifier"):
        load_adapter(decoder_base(), classifier_dir)


def test_missing_or_foreign_adapters_fail_clearly(tmp_path, classifier_dir):
    with pytest.raises(FileNotFoundError, match="no adapter directory"):
        load_adapter(classifier_base(), tmp_path / "nowhere")
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text((classifier_dir / "adapter_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="missing adapter_model.safetensors"):
        load_adapter(classifier_base(), half)
    (half / "adapter_model.safetensors").write_bytes(b"")
    (half / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(ValueError, match="only LoRA"):
        load_adapter(classifier_base(), half)
    with pytest.raises(ValueError, match="not the ones config targets"):
        save_adapter(trained_classifier(), LoraConfig(r=4, target_modules=("q_proj",)), tmp_path / "bad")
    with pytest.raises(ValueError, match="no LoRA branches"):
        save_adapter(classifier_base(), CLASSIFIER, tmp_path / "bad")


def test_interrupted_save_leaves_the_previous_adapter(tmp_path, monkeypatch):
    directory = tmp_path / "adapter"
    first = add_lora(decoder_base(), DECODER, key=jax.random.key(1))
    second = add_lora(decoder_base(), DECODER, key=jax.random.key(2))
    save_adapter(first, DECODER, directory)
    files = sorted(os.listdir(directory))

    def crash_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00half a header")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.numpy, "save_file", crash_midway)
        with pytest.raises(OSError, match="disk full"):
            save_adapter(second, DECODER, directory)
    assert sorted(os.listdir(directory)) == files  # no temporary file left
    loaded, _ = load_adapter(decoder_base(), directory)
    assert tree_allclose(loaded, first, rtol=0, atol=0)

    # A crash between the two renames (new weights, old config) does not load.
    replace, calls = os.replace, []

    def crash_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("power cut")
        replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", crash_second)
        with pytest.raises(OSError, match="power cut"):
            save_adapter(second, DECODER, directory)
    assert sorted(os.listdir(directory)) == files
    with pytest.raises(ValueError, match="save was interrupted"):
        load_adapter(decoder_base(), directory)


def test_loaded_leaves_keep_the_sharding_of_the_leaves_they_replace(tmp_path):
    mesh, rules = preset_mesh("fsdp+tp", 8), zoo.rules("fsdp+tp")
    placed = zoo.shard(add_lora(decoder_base(), DECODER, key=jax.random.key(1)), rules, mesh)
    save_adapter(placed, DECODER, tmp_path / "sharded")
    fresh = zoo.shard(add_lora(decoder_base(), DECODER, key=jax.random.key(5)), rules, mesh)
    loaded, _ = load_adapter(fresh, tmp_path / "sharded")
    # Into the sharded base: the new branches take the layout their annotations give.
    into_base, _ = load_adapter(zoo.shard(decoder_base(), rules, mesh), tmp_path / "sharded")
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for new, old, base_loaded in zip(leaves(loaded), leaves(placed), leaves(into_base), strict=True):
        assert new.sharding == old.sharding and base_loaded.sharding == old.sharding
        np.testing.assert_array_equal(new, old)
        np.testing.assert_array_equal(base_loaded, old)
    q = loaded.layers.layers.attention.q_proj
    assert not q.lora_A.sharding.is_fully_replicated and not q.lora_B.sharding.is_fully_replicated


# --- writing into a folder that exists -------------------------------------------------------

# Each writer: (its config file and the key that marks its kind, its weights file).
WRITERS = {
    "save_pretrained": ("config.json", "model_type", "model.safetensors"),
    "save_adapter": ("adapter_config.json", "peft_type", "adapter_model.safetensors"),
}
# (case, files in the folder before the save by role, the names the refusal gives or None)
EXPORT_FOLDERS = [
    ("a new folder", {}, None),
    ("other names only", {"notes.txt": "mine"}, None),
    ("a user's config of the name", {"config": '{"app": 1}', "notes.txt": "mine"}, "config"),
    ("an export of its kind", {"config": "export", "notes.txt": "mine"}, None),
    ("weights alone (an interrupted save)", {"weights": "safetensors"}, None),
    ("a user's file named as the weights", {"weights": "not safetensors"}, "weights"),
]


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("files,refused", [c[1:] for c in EXPORT_FOLDERS], ids=[c[0] for c in EXPORT_FOLDERS])
def test_exports_replace_only_an_exports_files(tmp_path, writer, files, refused):
    """save_pretrained / save_adapter write their own file names, replacing those of an
    export of their kind (a config naming it, or readable weights) and leaving every other
    file; a folder holding one of their names that is no such export is refused, naming the
    file, with nothing written."""
    config, key, weights = WRITERS[writer]
    names = {"config": config, "weights": weights}
    contents = {"export": json.dumps({key: "x"}), "safetensors": safetensors.numpy.save({"x": np.zeros(2)})}
    directory = tmp_path / "out"
    directory.mkdir()
    for role, text in files.items():
        value = contents.get(text, text)
        path = directory / names.get(role, role)
        path.write_bytes(value) if isinstance(value, bytes) else path.write_text(value)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def save():
        if writer == "save_pretrained":
            return zoo.hf.save_pretrained(decoder_base(), directory)
        return save_adapter(add_lora(decoder_base(), DECODER, key=jax.random.key(1)), DECODER, directory)

    if refused is not None:
        with pytest.raises(FileExistsError, match=f"holds {names[refused]}, which it would replace") as info:
            save()
        assert "write into another folder, or move those files away first" in str(info.value)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
        return
    written = save()
    assert sorted(p.name for p in written) == sorted(set(os.listdir(directory)) - {"notes.txt"})
    assert all(p.parent == directory and p.stat().st_size > 0 for p in written)
    if "notes.txt" in files:
        assert (directory / "notes.txt").read_text() == "mine"
