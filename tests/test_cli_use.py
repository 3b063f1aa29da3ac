"""Using a finished run from the command line, end to end on tiny runs: `zoo predict` (a
classifier's labels by name, a regressor's outputs), `zoo eval` (against the run's own
held-out evaluation and scikit-learn's scores), `zoo export --merge` (opened by transformers
with the same outputs), `zoo generate --chat / --stop / --repetition-penalty` on a chat SFT
run; runs of older zoos (no label names stored); one-line errors."""

import functools
import json
import shutil

import equinox as eqx
import numpy as np
import pytest
import safetensors.numpy
from helpers import assert_rounding_close, one_line_error, zoo_main
from helpers import zoo_ok as ok
from tiny_runs import CHAT_TEMPLATE, FORWARD, LOSS_DEPTH, read_jsonl, write_jsonl

# The finished runs (chat_run, classifier_run, lora_classifier_run) and their data are
# tests/conftest.py's session fixtures (tests/tiny_runs.py), shared with other files.

TEXTS = ["the cat sat on the mat", "red blue big log", "a dog ran under a log"]
# A tiny BERT from scratch on byte tokens (test_cli_data's classifier runs), and its float32
# sums (helpers.rounding_bound): <= 128 wide (its MLP), 1 layer of ~6 chained sums, the
# pooling and the head; a loss adds its log-sum-exp and mean.
ENCODER_SUMS = {"terms": 128, "depth": 6 + 2}
# Measured: export vs zoo, and predict vs the reference, differ by < 1e-6 on these tiny models.
EXPORT_TOLERANCE = 1e-4


def _held_out(path, tmp_path):
    """A file of the records the run held out (its validation split, by content hash)."""
    from zoo.data._dataset import _held_out

    records = read_jsonl(path)
    held = _held_out([json.dumps(r, sort_keys=True).encode() for r in records], 0.1)
    return write_jsonl(tmp_path / f"held-{path.name}", [r for r, h in zip(records, held) if h])


def _reference_logits(model_dir, texts):
    """A byte-token classifier's logits computed apart from zoo.train: the encoder by
    zoo.hf (its forward one compiled program), mean pooling and the head from
    head.safetensors in numpy."""
    import zoo

    encoder = zoo.hf.from_pretrained(model_dir)
    head = safetensors.numpy.load_file(model_dir / "head.safetensors")
    tokens, mask = zoo.data.byte_tokens(texts, 32)
    hidden = np.asarray(_forward(encoder, tokens, mask=mask), np.float64)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled @ head["head.weight"] + head["head.bias"]


@eqx.filter_jit
def _forward(model, inputs, **kwargs):
    """A model's forward pass as one compiled program (not op by op)."""
    return model(inputs, **kwargs)


# --- zoo predict ------------------------------------------------------------------------------


def test_predict_names_a_classifiers_labels_from_texts_and_files(classifier_run, tmp_path):
    assert json.loads((classifier_run / "labels.json").read_text()) == {"labels": ["cats", "colours", "dogs"]}
    rc, _, err = zoo_main("predict", classifier_run, "--text", TEXTS[0])  # it said "1 inputs"
    assert rc == 0 and err.endswith(", 1 input\n"), err
    out = ok("predict", classifier_run, *sum((["--text", t] for t in TEXTS), []), "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in records] == TEXTS
    logits = np.asarray([r["logits"] for r in records])
    assert_rounding_close(logits, _reference_logits(classifier_run / "model", TEXTS), **ENCODER_SUMS)
    names = ["cats", "colours", "dogs"]
    assert [r["label"] for r in records] == [names[i] for i in logits.argmax(axis=1)]
    # The same texts from each kind of --input file; plain output: label, probability, text.
    files = {"t.txt": "\n".join(TEXTS) + "\n\n", "t.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in TEXTS),
             "t.csv": "text,label\n" + "".join(f'"{t}",x\n' for t in TEXTS)}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        (tmp_path / f"bom{name}").write_text(text, encoding="utf-8-sig")  # a BOM (Windows editors) is no text
        lines = ok("predict", classifier_run, "--input", tmp_path / name).splitlines()
        assert ok("predict", classifier_run, "--input", tmp_path / f"bom{name}").splitlines() == lines, name
        assert [line.split("\t")[0] for line in lines] == [r["label"] for r in records], name
        assert [line.split("\t")[2] for line in lines] == TEXTS, name
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        assert [float(line.split("\t")[1]) for line in lines] == pytest.approx(p.max(1) / p.sum(1), abs=1e-3)


def test_predict_a_regressors_outputs(finished_mlp_run, tmp_path):
    """The shared finished mlp run (tests/conftest.py: 4 steps, checkpoints at 2 and 4),
    read, not changed."""
    import zoo

    out = finished_mlp_run
    x = np.random.default_rng(0).normal(size=(3, 16)).round(3)
    (tmp_path / "x.csv").write_text("".join(",".join(map(str, row)) + "\n" for row in x))
    records = [json.loads(line) for line in ok("predict", out, "--input", tmp_path / "x.csv", "--json").splitlines()]
    assert [r["input"] for r in records] == x.tolist()
    # The mlp's weights are its last checkpoint (it has no Hugging Face form).
    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [2, 4]
    run = zoo.train.load_run(out)
    assert run.weights.endswith("step 4") and run.kind == "regression"
    want = np.asarray(_forward(run.model, x.astype(np.float32)))
    np.testing.assert_allclose([r["prediction"] for r in records], want, rtol=1e-6)
    one = ok("predict", out, "--text", ",".join(map(str, x[0])))
    assert float(one) == pytest.approx(want[0, 0], rel=1e-5)
    rc, _, err = zoo_main("predict", out, "--text", "1,2,3")
    one_line_error(rc, err, "is a regressor of 16 inputs: give rows of 16 numbers, got shape (1, 3)")
    rc, _, err = zoo_main("export", out, "--output", tmp_path / "x")
    one_line_error(rc, err, "the mlp has no Hugging Face form")


def test_a_run_without_stored_label_names_reads_them_from_its_file_or_falls_back_to_ids(classifier_run, tmp_path):
    """Runs of an older zoo stored no labels.json: the names come from the data file the
    run names when it is still there (the same rule), else ids, with a note."""
    old = tmp_path / "old"
    shutil.copytree(classifier_run, old)
    (old / "labels.json").unlink()
    text = ok("predict", old, "--text", TEXTS[0], "--json")
    assert json.loads(text)["label"] in ("cats", "colours", "dogs")
    config = json.loads((old / "config.json").read_text())
    config["data"] = str(tmp_path / "gone.jsonl")
    (old / "config.json").write_text(json.dumps(config))
    rc, out, err = zoo_main("predict", old, "--text", TEXTS[0], "--json")
    assert rc == 0, err
    assert json.loads(out)["label"] in ("0", "1", "2")
    assert "stores no label names (a run of an older zoo) and its data file is gone: labels are ids" in err


# --- zoo eval ---------------------------------------------------------------------------------


def test_eval_of_a_classifier_is_its_runs_evaluation_and_sklearns_scores(classifier_run, data_files, tmp_path):
    from sklearn.metrics import f1_score, precision_recall_fscore_support

    held = _held_out(data_files["labels"], tmp_path)
    scores = json.loads(ok("eval", classifier_run, "--data", held, "--json"))
    after = json.loads((classifier_run / "summary.json").read_text())["eval_after"]
    assert scores["examples"] == after["examples"] and scores["accuracy"] == after["accuracy"]
    assert_rounding_close(scores["loss"], after["loss"], terms=ENCODER_SUMS["terms"], depth=ENCODER_SUMS["depth"] + 2)
    # A file of two classes, listed in another order than the run's: matched by name.
    records = [r for r in read_jsonl(data_files["labels"]) if r["label"] != "colours"]
    file = write_jsonl(tmp_path / "two.jsonl", records[::-1])
    scores = json.loads(ok("eval", classifier_run, "--data", file, "--json"))
    names = ["cats", "colours", "dogs"]
    truth = [names.index(r["label"]) for r in records[::-1]]
    predicted = _reference_logits(classifier_run / "model", [r["text"] for r in records[::-1]]).argmax(axis=1)
    assert scores["accuracy"] == pytest.approx(np.mean(np.asarray(truth) == predicted))
    assert scores["macro_f1"] == pytest.approx(f1_score(truth, predicted, average="macro"))
    p, r, f, s = precision_recall_fscore_support(truth, predicted, labels=[0, 1, 2], zero_division=0)
    for i, name in enumerate(names):
        assert scores["per_class"][name] == pytest.approx(
            {"precision": p[i], "recall": r[i], "f1": f[i], "support": s[i]}
        )
    text = ok("eval", classifier_run, "--data", file)
    assert "macro-F1" in text and "colours" in text and "precision" in text
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a", "label": "birds"}, {"text": "b", "label": "cats"}])
    rc, _, err = zoo_main("eval", classifier_run, "--data", bad)
    one_line_error(rc, err, "labels ['birds'] are not among the run's ['cats', 'colours', 'dogs']")
    rc, _, err = zoo_main("eval", classifier_run, "--data", data_files["chat"])
    one_line_error(rc, err, "holds chat records (language modelling) but")


def test_eval_of_a_chat_run_is_its_runs_evaluation_with_perplexity(chat_run, data_files, tmp_path):
    """On the records the run held out, `zoo eval` gives the run's own final evaluation: the
    same rows (the chat template, packing, assistant tokens only)."""
    held = _held_out(data_files["chat"], tmp_path)
    scores = json.loads(ok("eval", chat_run, "--data", held, "--json"))
    after = json.loads((chat_run / "summary.json").read_text())["eval_after"]
    assert_rounding_close(scores["loss"], after["loss"], terms=FORWARD["terms"], depth=LOSS_DEPTH)
    assert scores["accuracy"] == pytest.approx(after["accuracy"], abs=1e-9)
    assert scores["perplexity"] == pytest.approx(np.exp(scores["loss"])) and scores["tokens"] > 0
    assert "perplexity" in ok("eval", chat_run, "--data", held)


def test_eval_names_grpo_prompts_and_preference_pairs_as_what_they_are(chat_run, classifier_run, tmp_path):
    """A GRPO run's prompts file (or DPO's pairs) given to `zoo eval`: it said the file "holds
    text/label records", and a classifier took a prompts file past the check."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the cat", "answer": "4"}] * 2)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2)
    # An SFT run: its objective named, and what evaluates pairs (a dpo / orpo run: TRL's metrics).
    sft_on_pairs = "(--objective sft); give it text, prompt/completion or chat records, or evaluate the pairs with "
    sft_on_pairs += "a run of --objective dpo / orpo"
    for run, file, what in [
        (chat_run, prompts, "holds prompts alone, without completions (what --objective grpo completes) but"),
        (chat_run, pairs, "holds preference pairs (what --objective dpo / orpo train on) but"),
        (chat_run, pairs, sft_on_pairs),
        (classifier_run, prompts, "holds prompts alone, without completions"),
        (chat_run, tmp_path, "is a folder; zoo reads one data file: join its files into one"),  # "no such file" before
    ]:
        rc, _, err = zoo_main("eval", run, "--data", file)
        one_line_error(rc, err, what)


# --- zoo export -------------------------------------------------------------------------------


def test_export_merges_a_chat_run_that_transformers_opens_with_zoos_logits(chat_run, tmp_path):
    import safetensors.torch
    import torch
    import transformers

    import zoo

    rc, _, err = zoo_main("export", chat_run, "--output", tmp_path / "no")
    one_line_error(rc, err, "is a LoRA run: pass --merge to fold its adapter into the base model")
    out = tmp_path / "merged"
    ok("export", chat_run, "--merge", "--output", out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    tokens = np.array([[1, 6, 8, 10, 12, 6, 14]], np.int32)
    ours = np.asarray(_forward(zoo.train.load_run(chat_run).model, tokens))[..., :20]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(ours - theirs).max() <= EXPORT_TOLERANCE
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    # --dtype bfloat16: the float32 export's weights rounded to bfloat16, opened as bfloat16.
    ok("export", chat_run, "--merge", "--dtype", "bfloat16", "--output", tmp_path / "bf16")
    f32, bf16 = (safetensors.torch.load_file(f / "model.safetensors") for f in (out, tmp_path / "bf16"))
    assert {t.dtype for t in f32.values()} == {torch.float32} and {t.dtype for t in bf16.values()} == {torch.bfloat16}
    assert f32.keys() == bf16.keys() and all(torch.equal(f32[k].to(torch.bfloat16), bf16[k]) for k in f32)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    # A folder holding a user's file of a name the export writes, and no model: refused.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("my own")
    rc, _, err = zoo_main("export", chat_run, "--merge", "--output", mine)
    one_line_error(rc, err, "holds tokenizer.json, which it would replace")
    assert (mine / "tokenizer.json").read_text() == "my own"
    # A model folder given where a run is expected: named as what it is (its config.json is HF's).
    rc, _, err = zoo_main("export", out, "--merge", "--output", tmp_path / "again")
    one_line_error(rc, err, "a Hugging Face model folder (llama), not a zoo run")
    # --output a file, or a folder that cannot be created (under a file): one line naming it.
    notes = mine / "notes.md"
    notes.write_text("mine")
    rc, _, err = zoo_main("export", chat_run, "--merge", "--output", notes)
    one_line_error(rc, err, f"--output {notes} is a file, not a folder; choose a folder")
    rc, _, err = zoo_main("export", chat_run, "--merge", "--output", notes / "merged")
    one_line_error(rc, err, f"--output {notes / 'merged'}: cannot create the folder (Not a directory)")


def test_an_export_is_written_in_its_base_models_dtype_by_default(tmp_path):
    """transformers + peft write a merged model in its base's dtype: zoo export's default is
    the dtype the base folder's config.json names (transformers 5's `dtype`, older
    `torch_dtype`), float32 without one; another `--dtype` is refused."""
    from zoo.train import ConfigError
    from zoo.train._export import export_dtype

    for values, want in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                         ({"dtype": "float32"}, "float32"), ({"dtype": "int8"}, "float32"), ({}, "float32")):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(values))
        assert export_dtype(str(tmp_path), None) == want, values
        assert export_dtype(str(tmp_path), "float16") == "float16"
    assert export_dtype(None, None) == "float32"
    with pytest.raises(ConfigError, match="--dtype 'int4': choose one of float32, bfloat16, float16"):
        export_dtype(None, "int4")


def test_a_run_whose_base_model_moved_says_where_it_was_and_how_to_point_at_it(chat_run, tmp_path):
    """A LoRA run whose base model folder (config.json's init) is gone: export and generate
    name the folder and how to point the run at where it went, not "pass a folder"."""
    run = tmp_path / "run"
    shutil.copytree(chat_run / "adapter", run / "adapter")
    config = json.loads((chat_run / "config.json").read_text()) | {"init": str(tmp_path / "moved")}
    (run / "config.json").write_text(json.dumps(config))
    for command in (["export", run, "--merge", "--output", tmp_path / "out"], ["generate", run, "--prompt", "a"]):
        rc, _, err = zoo_main(*command)
        one_line_error(rc, err, f"the base model of its adapter, {tmp_path / 'moved'}, is gone; put it back there")


def test_generate_of_a_lora_run_on_a_classifier_run_names_the_flag(lora_classifier_run, tmp_path):
    """A LoRA run whose base (config.json's init) is a classifier run: the library's refusal
    (naming `RunConfig.init`) reaches zoo generate's one line as the flag."""
    run = tmp_path / "lora"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": "transformer", "init": str(lora_classifier_run)}))
    rc, _, err = zoo_main("generate", run, "--prompt", "x")
    one_line_error(
        rc, err, f"the base model of its adapter: --init {lora_classifier_run}: a encoder classifier run; export it"
    )


def test_export_of_a_lora_classifier_is_bert_plus_its_head(lora_classifier_run, tmp_path):
    """transformers' BertModel on the merged folder, mean-pooled, through head.safetensors:
    `zoo predict`'s logits; the label names are config.json's id2label; no
    generation_config.json (it wrote one, which transformers never writes for BERT)."""
    import torch
    import transformers

    import zoo

    out = tmp_path / "cls"
    ok("export", lora_classifier_run, "--merge", "--output", out)
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "cats", "1": "colours", "2": "dogs"}
    predicted = [json.loads(line) for line in ok("predict", lora_classifier_run, *sum((["--text", t] for t in TEXTS),
                                                 []), "--json").splitlines()]  # fmt: skip
    tokens, mask = zoo.data.byte_tokens(TEXTS, 32)
    bert = transformers.BertModel.from_pretrained(out, add_pooling_layer=False).eval()
    with torch.no_grad():
        hidden = bert(
            torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask)
        ).last_hidden_state
    hidden = hidden.numpy().astype(np.float64)
    # An encoder generates nothing: transformers writes no generation_config.json for it, nor does the export.
    bert.save_pretrained(tmp_path / "theirs")
    assert not (tmp_path / "theirs" / "generation_config.json").exists()
    assert not (out / "generation_config.json").exists()
    head = safetensors.numpy.load_file(out / "head.safetensors")
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    logits = pooled @ head["head.weight"] + head["head.bias"]
    assert np.abs(logits - np.asarray([r["logits"] for r in predicted])).max() <= EXPORT_TOLERANCE
    assert [r["label"] for r in predicted] == [config["id2label"][str(i)] for i in logits.argmax(axis=1)]


# --- zoo generate --chat / --stop / --repetition-penalty ----------------------------------------


@functools.cache
def _load_run(folder):
    import zoo

    return zoo.train.load_run(folder)


def _library_reply(run_folder, prompt, **kwargs):
    """The reply zoo.generate gives to `prompt` as a user turn of the run's chat template."""
    import zoo

    run = _load_run(run_folder)
    text = run.chat_template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    assert text.endswith("<assistant> ")
    ids = run.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    out = np.asarray(zoo.generate(run.model, np.asarray([ids], np.int32), max_new_tokens=8, eos_token_id=2, **kwargs))
    new = [int(i) for i in out[0, len(ids) :]]
    return run.tokenizer.decode(new[: new.index(2)] if 2 in new else new)


def test_generate_chat_prompts_a_chat_run_in_its_training_format(chat_run):
    """Two SFT steps teach the tiny model to end its turn (`</s>`) at once; a strong
    repetition penalty (the prompt holds `</s>`) makes it say something first: the same
    words as the library's, cut where `--stop` says, streamed or not."""
    chat = ["generate", chat_run, "--chat", "--prompt", "cat dog red", "--max-new-tokens", 8]
    reply = _library_reply(chat_run, "cat dog red")
    assert json.loads(ok(*chat, "--json")) == [{"prompt": "cat dog red", "completion": reply}]
    assert ok(*chat) == reply + "\n"  # the reply alone, streamed
    penalised = _library_reply(chat_run, "cat dog red", repetition_penalty=10.0)
    words = penalised.split()
    assert len(words) >= 2 and penalised != reply, penalised
    # A batch of two prompts (its first row the reply alone: the padding changes nothing),
    # without and with --stop: one compiled program.
    batch = [*chat, "--prompt", "a", "--repetition-penalty", 10, "--json"]
    assert json.loads(ok(*batch))[0]["completion"] == penalised
    stop = f" {words[1]}"
    want = penalised[: penalised.index(stop)]
    assert ok(*chat, "--repetition-penalty", 10, "--stop", stop, "--stop", "zzz") == want + "\n"
    assert json.loads(ok(*batch, "--stop", stop))[0]["completion"] == want
    rc, _, err = zoo_main("generate", chat_run, "--chat-template", "/nonexistent.jinja", "--prompt", "a")
    one_line_error(rc, err, "--chat-template /nonexistent.jinja: no such file")


def test_stop_strings_cut_the_streamed_text_where_the_whole_text_is_cut():
    """The printer holds back what may begin a stop string: a stop split over tokens."""
    import io

    from zoo._cli._generate import Printer, Text, cut_at_stop

    class Chars(Text):
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    text = Chars()
    text.tokenizer = object()  # decoded through `decode`, not bytes
    for whole, stops in [("abc<END>def", ["<END>"]), ("ab<E<END", ["<END>"]), ("abc", ["c", "bc"]), ("x<", ["<E"])]:
        stream = io.StringIO()
        printer = Printer(text, eos=None, stops=stops, stream=stream)
        for ch in whole:
            printer(np.asarray([ord(ch)]))
        printer.finish()
        assert stream.getvalue() == cut_at_stop(whole, stops)[0], (whole, stops)


def test_generate_says_when_the_model_ends_the_text_at_once(llama_dir, monkeypatch):
    """A completion that is empty because the first new token was end-of-sequence gets a
    line on stderr saying so (the output alone looked like nothing happened); a completion
    with text gets none."""
    import jax.numpy as jnp

    import zoo

    def first_new(token):
        def fake(model, tokens, *, eos_token_id=None, stream=None, **kwargs):
            new = jnp.full((tokens.shape[0], 2), eos_token_id if token == "eos" else 7, tokens.dtype)
            return jnp.concatenate([tokens, new], axis=1)

        return fake

    for token, said in (("eos", True), ("text", False)):
        monkeypatch.setattr(zoo, "generate", first_new(token))
        rc, out, err = zoo_main("generate", llama_dir, "--prompt", "the cat", "--max-new-tokens", "2", "--devices", "1")
        assert rc == 0, err
        assert out.startswith("the cat")
        assert ("the model ended the text at once: its first new token was end-of-sequence" in err) is said, err


def test_a_finetune_run_names_the_family_of_its_hugging_face_base(chat_run, llama_dir, tmp_path):
    """A `zoo finetune` run on a Hugging Face folder names the family its config.json
    names (`model_type`: here "llama"), not only zoo's "transformer": in its title (the
    header's first line, summary.json) and in the header's model line, for a run chained
    on another (its init a run) too, found through the runs' config.json files."""
    import dataclasses
    import types

    from zoo.train import RunConfig
    from zoo.train._console import _print_header

    title = json.loads((chat_run / "summary.json").read_text())["title"]
    assert title.startswith("finetune transformer (LoRA fine-tuning of llama on "), title
    for init in (llama_dir, chat_run):
        c = dataclasses.replace(RunConfig(model="transformer", init=str(init)).resolved("finetune"), devices=1)
        task = types.SimpleNamespace(init=str(init), data="chat", label_names=None)
        lines: list[str] = []
        _print_header(lines.append, c, task, title, 1, {"data": 1}, None, None, 1, 4, 4, 0, 1.0, 0, 0)
        assert lines[1].startswith("model: transformer (llama), 1 parameters"), lines
