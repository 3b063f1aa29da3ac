"""`--data FILE`: `zoo train` / `zoo finetune` on a user's own `.txt`, `.jsonl` or `.csv`
(zoo.data.load with the model's tokenizer): the batches the task builds (completion and
assistant weights exactly), the peft contract of the adapter, resuming mid-epoch with the
same batches, classification with labels from the file, and one-line errors for bad files."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_as_accurate, assert_rounding_close, one_line_error, torch_reference, zoo_main
from helpers import zoo_ok as ok
from tiny_runs import (  # noqa: F401  (names other test files import from here)
    CHAT_TEMPLATE,
    ENCODER,
    FORWARD,
    LOSS_DEPTH,
    NO_SAMPLE,
    SEQ,
    TINY,
    VOCAB,
    _sentence,
    read_jsonl,
    write_jsonl,
)


def _task(name: str, data: Path, init: Path | None, seq_len: int = SEQ, *, shapes: bool = False, **options):
    """The task `zoo train/finetune NAME --data DATA` builds, on a data=2 mesh; `shapes`:
    a model from scratch as its shapes alone (`zoo.train.abstract_models`), for the tests
    that read the data, not the weights (no initialiser compiled)."""
    import contextlib

    import jax

    import zoo
    from zoo.train import DataConfig, RunConfig, abstract_models, build_task

    config = RunConfig(model=name, init=None if init is None else str(init), batch_size=4,
                       data=DataConfig(source=str(data), seq_len=seq_len, **options)).resolved()  # fmt: skip
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh), abstract_models() if shapes else contextlib.nullcontext():
        return build_task(config, rules=zoo.rules("dp"), mesh=mesh)


def _segments(batch: dict, row: int):
    """The (token words, weights) of each packed document of a row."""
    words = {i: t for t, i in VOCAB.items()}
    seg = batch["segment_ids"][row]
    for s in range(1, int(seg.max()) + 1):
        at = seg == s
        yield [words[int(t)] for t in batch["tokens"][row][at]], batch["weights"][row][at]


def test_prompt_completion_weights_are_exactly_the_completion_tokens(llama_dir, data_files):
    """Packed prompt/completion rows: weight 1 on the completion's words and the EOS, 0 on
    `<s>` + the prompt; documents in file order (no validation split here)."""
    task = _task("transformer", data_files["pc"], llama_dir, validation=0.0)
    records = read_jsonl(data_files["pc"])
    arrays = task.eval_data  # no split: the evaluation rows are the training rows, in file order
    docs = [d for row in range(len(arrays["tokens"])) for d in _segments(arrays, row)]
    assert len(docs) == len(records)
    for (words, weights), r in zip(docs, records):
        prompt = ["<s>", *r["prompt"].split()]
        assert words == prompt + r["completion"].split() + ["</s>"]
        assert weights.tolist() == [0.0] * len(prompt) + [1.0] * (len(words) - len(prompt))
    batch = task.batch_at(1, 4)  # the rows a step trains on: the same documents, weighted alike
    assert set(batch) == {"tokens", "mask", "segment_ids", "positions", "weights"}
    known = {(tuple(w), tuple(x.tolist())) for w, x in docs}
    assert all((tuple(w), tuple(x.tolist())) in known for row in range(4) for w, x in _segments(batch, row))
    assert task.loss_fn.__name__ == "next_token_loss" and task.kind == "lm"


def test_chat_weights_are_exactly_the_assistant_tokens(llama_dir, data_files):
    """Chat rows rendered with the folder's template: weight 1 on each assistant reply's
    words and the `</s>` closing it, 0 on user turns and role headers."""
    task = _task("transformer", data_files["chat"], llama_dir, validation=0.0)
    arrays = task.eval_data
    records = read_jsonl(data_files["chat"])
    docs = [d for row in range(len(arrays["tokens"])) for d in _segments(arrays, row)]
    assert len(docs) == len(records)
    for (words, weights), r in zip(docs, records):
        expected, role = [], None
        for w in words:  # independent of zoo: weighted from after <assistant> through its </s>
            expected.append(1.0 if role == "assistant" and w not in ("<assistant>", "<user>") else 0.0)
            if w in ("<user>", "<assistant>"):
                role = w[1:-1]
            elif w == "</s>":
                role = None
        assert weights.tolist() == expected
        assert sum(expected) == sum(len(m["content"].split()) + 1 for m in r["messages"] if m["role"] == "assistant")


def test_chat_template_flag_gives_byte_tokens_their_turns(tmp_path, data_files):
    """`--chat-template FILE` for a model without a tokenizer (byte tokens): the weighted
    bytes are exactly each assistant reply and the ` </s> ` closing it."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    task = _task("transformer", data_files["chat"], None, seq_len=128, shapes=True, validation=0.0,
                 chat_template=str(template))  # fmt: skip
    assert task.data.endswith(
        "0 truncated; no validation split (evaluated on the training rows); byte tokens, rows of 128"
    )
    arrays = task.eval_data
    weighted = bytes(arrays["tokens"][arrays["weights"] > 0].astype(np.uint8)).decode()
    replies = [m["content"] + " </s> " for r in read_jsonl(data_files["chat"]) for m in r["messages"]
               if m["role"] == "assistant"]  # fmt: skip
    assert weighted == "".join(replies)


def test_train_batches_are_the_datasets_epochs_and_a_function_of_the_step(llama_dir, data_files):
    """Step k's batch is batch k of `Dataset.batches` run one epoch after another (the
    partial batch dropped), the same however often it is asked for; the metrics weigh the
    loss exactly as `zoo.models.next_token_loss`."""
    import equinox as eqx
    import jax.numpy as jnp

    import zoo
    from zoo.train import lm_metrics

    train, _ = zoo.data.load(data_files["text"], llama_dir, seq_len=SEQ, validation=0.1)
    task = _task("transformer", data_files["text"], llama_dir)
    per_epoch = len(train) // 4
    expected = [b for epoch in range(3) for b in train.batches(4, seed=0, epoch=epoch)]
    for step in (1, 2, per_epoch, per_epoch + 1, 2 * per_epoch + 1):
        got = task.batch_at(step, 4)
        assert all(np.array_equal(got[k], expected[step - 1][k]) for k in got)
    assert np.array_equal(task.batch_at(3, 4)["tokens"], task.batch_at(3, 4)["tokens"])
    # Metrics: next_token_loss's sums and weights, scaled by the evaluator's row weight.
    batch = {k: jnp.asarray(v) for k, v in task.batch_at(1, 4).items()}
    sums, weights = eqx.filter_jit(zoo.models.next_token_loss)(task.model, batch)
    row = jnp.asarray([1.0, 1.0, 0.0, 1.0])
    out = eqx.filter_jit(lm_metrics)(task.model, batch | {"weight": row})
    # The same per-row sums (a row's SEQ tokens) in another program: rounding in another order.
    assert_rounding_close(out["loss"], sums * row, terms=max(SEQ, FORWARD["terms"]), depth=LOSS_DEPTH)
    np.testing.assert_array_equal(out["weight"], weights * row)
    assert float(out["correct"].sum()) <= float(out["weight"].sum())


def test_the_runs_evaluator_weighs_packed_held_out_rows_as_the_training_loss(llama_dir, data_files):
    """The run's Evaluator (chunks padded with weight-0 rows, columns cut past the longest
    row's mask) on the packed prompt/completion rows: the loss is next_token_loss's
    weighted mean over every row, at once."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zoo
    from zoo.train import Evaluator

    task = _task("transformer", data_files["pc"], llama_dir, validation=0.0)
    data = task.eval_data
    assert len(data["tokens"]) % 4 != 0  # the last chunk is padded
    sums, weights = eqx.filter_jit(zoo.models.next_token_loss)(task.model, {k: jnp.asarray(v) for k, v in data.items()})
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        loss = Evaluator(task, mesh, 4)(task.model, data)["loss"]
    # Chunks of 4 rows vs all at once: the same sums in another order, the longest the loss's
    # over every token; its terms (nll >= 0) sum to the loss itself.
    terms = max(np.size(data["tokens"]), FORWARD["terms"])
    assert_rounding_close(loss, float(sums.sum() / weights.sum()), terms=terms, depth=LOSS_DEPTH, scale=loss)


def test_a_held_out_set_smaller_than_a_chunk_is_evaluated_at_its_own_size():
    """7 held-out rows run as one call of 8 (the data axis's multiple), not padded to the
    run's 64-row chunk: 8x the work, which made a 55M decoder's first evaluation of 8
    windows 44 s instead of 7. A decoder's chunk holds at most EVAL_LOGITS_BYTES of logits,
    but never fewer rows than one training microbatch (whose step holds their logits)."""
    import types

    import jax
    import jax.numpy as jnp

    from zoo.train._evaluate import EVAL_LOGITS_BYTES, Evaluator, evaluation_rows

    seen = []

    def metrics(model, batch):
        seen.append(batch["tokens"].shape[0])  # at trace time: the call's rows
        weight = batch["weight"]
        return {"loss": weight * jnp.sum(batch["tokens"], axis=1), "weight": weight, "correct": weight}

    task = types.SimpleNamespace(kind="lm", metrics_fn=metrics, adapter_names=None)
    tokens = np.arange(7 * 3, dtype=np.int32).reshape(7, 3) % 2
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        out = Evaluator(task, mesh, 64)(None, {"tokens": tokens})
    assert seen == [8] and out["examples"] == 7
    assert out["loss"] == tokens.sum() / 7  # integer sums, exact in float32; the padding row weighs 0

    qwen = types.SimpleNamespace(config=types.SimpleNamespace(padded_vocab=151_936))
    lm, classifier = types.SimpleNamespace(kind="lm"), types.SimpleNamespace(kind="classification")
    row_bytes = 128 * 151_936 * 4
    assert evaluation_rows(lm, qwen, batch_size=8, microbatches=1, seq_len=128, data_size=2) == 14
    assert 13 * row_bytes <= EVAL_LOGITS_BYTES < 14 * row_bytes  # 13 rows fit, rounded up to the data axis
    # 2,048 positions: not one row fits; one training microbatch's 4 rows
    assert evaluation_rows(lm, qwen, batch_size=32, microbatches=8, seq_len=2048, data_size=2) == 4
    small = types.SimpleNamespace(config=types.SimpleNamespace(padded_vocab=256))
    assert evaluation_rows(lm, small, batch_size=8, microbatches=1, seq_len=64, data_size=2) == 64
    assert evaluation_rows(classifier, qwen, batch_size=8, microbatches=1, seq_len=2048, data_size=8) == 64


def test_byte_tokenizer_ids_are_the_utf8_bytes():
    from zoo.train._user_data import byte_tokenizer

    text = "def f(x):\n\treturn 'héllo' \x01"
    tok = byte_tokenizer()
    encoding = tok.tokenizer.encode(text)
    assert encoding.ids == list(text.encode("utf-8")) and tok.vocab_size == 256
    assert tok.decode(encoding.ids) == text


@pytest.fixture(scope="module")
def txt_run(tmp_path_factory, data_files):
    """One `zoo train transformer --data notes.txt` run from scratch (byte tokens, the tiny
    decoder on TINY's flags) for `--epochs 1.5`, then its `--resume --epochs 2`: refused
    once while the file is edited since the checkpoint, taken once the file is restored.
    What each command left and how often it opened the file are recorded; the tests of a
    .txt file, of --epochs, of the edited file and of the one read each read their part
    (one run and its resume instead of four runs of the same shapes)."""
    import builtins
    import io
    import os
    import types

    folder = tmp_path_factory.mktemp("txt")
    data = folder / "notes.txt"
    data.write_text("".join(data_files["txt"].read_text().splitlines(keepends=True)[:24]))  # 12 of its 40 functions
    rows = len(_task("transformer", data, None, shapes=True).train_source)
    out = folder / "run"
    # A constant learning rate after the warmup: the resume, 2 epochs instead of 1.5, runs the
    # step the run compiled (a cosine schedule ends at the run's last step: another program).
    args = ["train", "transformer", "--data", data, *TINY, "--model-config", "d_model=32,num_layers=1", "--schedule",
            "constant"]  # fmt: skip
    opens, real_open = [], io.open

    def counting_open(file, *a, **kw):
        if isinstance(file, str | os.PathLike) and Path(file).resolve() == data.resolve():
            opens.append(a[0] if a else kw.get("mode", "r"))
        return real_open(file, *a, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(io, "open", counting_open)  # pathlib's open
        patch.setattr(builtins, "open", counting_open)
        text = ok(*args, "--epochs", "1.5", "--checkpoint-every", "1000", "--output", out)
        opened = {"run": list(opens)}
        first = {name: (out / name).read_text() for name in ("metrics.jsonl", "config.json", "summary.json")}
        original = data.read_text()
        data.write_text(original.replace("x + 1", "x + 2"))
        del opens[:]
        refused = zoo_main(*args, "--epochs", "2", "--checkpoint-every", "1000", "--output", out, "--resume")
        opened["refused"] = list(opens)
        data.write_text(original)
        del opens[:]
        ok("train", "--output", out, "--resume", "--epochs", "2", "--devices", "2", "--quiet")
        opened["resume"] = list(opens)
    return types.SimpleNamespace(data=data, rows=rows, out=out, args=args, text=text, first=first, refused=refused,
                                 opened=opened)  # fmt: skip


def test_train_transformer_on_a_txt_file_from_scratch_with_byte_tokens(txt_run):
    """(a) `zoo train transformer --data notes.txt`: byte tokens, one `"kind": "train"`
    record per step, a GPT-2 folder written."""
    rows = [json.loads(line) for line in txt_run.first["metrics.jsonl"].splitlines()]
    steps = json.loads(txt_run.first["config.json"])["steps"]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, steps + 1))
    summary = json.loads(txt_run.first["summary.json"])
    assert summary["data"].startswith("notes.txt, text:") and "byte tokens" in summary["data"], summary["data"]
    assert (txt_run.out / "model" / "config.json").is_file(), txt_run.text
    config = json.loads(txt_run.first["config.json"])
    assert config["data"] == str(txt_run.data.resolve()) and config["packed"] is True


def test_epochs_set_the_steps_from_the_data_files_rows(txt_run, tmp_path):
    """`--epochs E`: E passes over the file's training rows, E x rows / batch steps rounded
    up, recorded in config.json as derived (with the warmup that follows them); given with
    --steps, or on data without an end, one line."""
    import math

    steps = math.ceil(1.5 * txt_run.rows / 4)
    rows = [json.loads(line) for line in txt_run.first["metrics.jsonl"].splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, steps + 1))
    config = json.loads(txt_run.first["config.json"])
    assert config["epochs"] == 1.5 and config["steps"] == steps and {"steps", "warmup"} <= set(config["derived"])
    assert config["warmup"] == max(1, steps // 20)
    # A resumed run takes more epochs: its steps derived again, it continues where it stopped.
    train = [r["step"] for r in read_jsonl(txt_run.out / "metrics.jsonl") if r["kind"] == "train"]
    assert train == list(range(1, math.ceil(2 * txt_run.rows / 4) + 1))
    args = txt_run.args
    rc, _, err = zoo_main(*args, "--epochs", "2", "--steps", "3", "--output", tmp_path / "both")
    one_line_error(rc, err, "--steps 3 and --epochs 2.0 are both set; give one")
    rc, _, err = zoo_main("train", "mlp", "--epochs", "2", "--output", tmp_path / "stream", "--quiet")
    one_line_error(rc, err, "--epochs counts passes over a data file's training rows")
    rc, _, err = zoo_main(*args, "--epochs", "0", "--output", tmp_path / "zero")
    one_line_error(rc, err, "--epochs must be a finite number > 0")


def test_resume_refuses_a_data_file_edited_since_the_checkpoint(txt_run):
    """Each checkpoint holds the data file's sha256: `--resume` after the file changed is
    one line (the resumed steps would see other rows); with the file restored it resumes."""
    steps = json.loads(txt_run.first["config.json"])["steps"]
    rc, _, err = txt_run.refused
    one_line_error(rc, err, f"notes.txt changed since checkpoint step {steps}")
    summary = json.loads((txt_run.out / "summary.json").read_text())
    assert summary["resumed_from"] == steps and summary["last_step"] > steps
    train = [r["step"] for r in read_jsonl(txt_run.out / "metrics.jsonl") if r["kind"] == "train"]
    assert train == list(range(1, summary["last_step"] + 1))


def test_a_runs_data_file_is_read_once(txt_run):
    """`zoo train --data FILE` and its `--resume` each open the file once (the command line
    reads no data; the run's records, rows and fingerprint come from the same bytes), and
    the checkpoint's `data_sha256` is the digest of those bytes."""
    import hashlib

    import zoo

    # The refused resume, too, read the file once (to find it changed).
    assert txt_run.opened == {"run": ["rb"], "refused": ["rb"], "resume": ["rb"]}, txt_run.opened
    checkpoints = zoo.Checkpointer(txt_run.out / "checkpoints", read_only=True)
    saved = checkpoints.metadata(checkpoints.steps()[-1])
    assert saved["data_sha256"] == hashlib.sha256(txt_run.data.read_bytes()).hexdigest()


def test_every_task_gives_the_same_batch_of_a_step_every_time(data_files):
    """Built-in data (the mlp's teacher, a corpus's windows, the docstrings' epochs, a
    model's random rows) and a user's files (their `zoo.data.Dataset`, held as is) are
    `zoo.data.BatchSource`s: the batch of step k is the same however often it is asked
    for and from a task built again, and a function of the seed."""
    import dataclasses

    import zoo
    from zoo.train import DataConfig, RunConfig, abstract_models, build_task

    small = {"d_model": 32, "num_layers": 1}
    txt, csv = (DataConfig(str(data_files[k]), seq_len=16) for k in ("txt", "csv"))
    configs = {
        "teacher": RunConfig(model="mlp"),
        "prose": RunConfig(model="transformer", model_config=small, data=DataConfig(source="prose", seq_len=16)),
        "docstrings": RunConfig(model="encoder", model_config=small, data=DataConfig(seq_len=16)),
        "txt": RunConfig(model="transformer", model_config=small, data=txt),
        "csv": RunConfig(model="encoder", model_config=small, batch_size=4, data=csv),
    }
    configs = {k: c.resolved() for k, c in configs.items()}
    docstrings = configs["docstrings"]
    configs["random rows"] = dataclasses.replace(docstrings, data=dataclasses.replace(docstrings.data, source=None))
    for name, config in configs.items():
        with abstract_models():  # the batches are the subject: the models as shapes, nothing initialised
            task, again = (build_task(config, rules=None, mesh=None) for _ in range(2))
            reseeded = build_task(dataclasses.replace(config, seed=1), rules=None, mesh=None)
        assert isinstance(task.train_source, zoo.data.BatchSource), name
        if name in ("txt", "csv"):
            assert isinstance(task.train_source, zoo.data.Dataset), name
        for step in (1, 2, 9, 40):
            first = task.batch_at(step, 4)
            assert first.keys() == again.batch_at(step, 4).keys(), name
            for got in (task.batch_at(step, 4), again.batch_at(step, 4)):
                assert all(np.array_equal(first[k], got[k]) for k in first), (name, step)
            other = reseeded.batch_at(step, 4)
            assert not all(np.array_equal(first[k], other[k]) for k in first), (name, step)


def test_train_transformer_on_jsonl_text_with_the_init_tokenizer(tmp_path, llama_dir, data_files):
    """(b) `zoo train transformer --init HF_DIR --data text.jsonl --no-packed`: the
    folder's tokenizer, one document per row, the tokenizer copied next to the model."""
    out = tmp_path / "text"
    ok("train", "transformer", "--init", llama_dir, "--data", data_files["text"], "--no-packed", *TINY,
       "--steps", "2", "--output", out)  # fmt: skip
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert "text: 36 rows" in summary["data"] and "tokenizer tokens" in summary["data"], summary["data"]
    assert (out / "model" / "tokenizer.json").is_file()


def _finetune(llama_dir, data, out, *extra):
    return ok("finetune", "transformer", "--init", llama_dir, "--data", data, "--lora", "r=4,alpha=8", *TINY,
              "--lr", "1e-2", "--output", out, *extra)  # fmt: skip


@pytest.mark.slow
def test_finetune_contract_peft_opens_the_adapter_with_zoos_logits(tmp_path, llama_dir, data_files):
    """(f) `zoo finetune transformer --init HF_DIR --data pc.jsonl --lora r=4,alpha=8
    --output OUT`: OUT/adapter opened by peft on the transformers model gives zoo's
    logits; metrics.jsonl holds one train record per step."""
    import peft
    import torch
    import transformers

    import zoo

    out = tmp_path / "sft"
    _finetune(llama_dir, data_files["pc"], out, "--steps", "6")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == list(range(1, 7))
    tokens = np.array([[1, 6, 8, 10, 12, 6, 14]], np.int32)  # <s> the cat sat on the mat
    model, _ = zoo.lora.load_adapter(zoo.hf.from_pretrained(llama_dir), out / "adapter")
    ours = np.asarray(model(tokens))[..., : len(VOCAB)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        base = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(hf, out / "adapter").eval()
    theirs = torch_reference(lambda m: m(torch.from_numpy(tokens.astype(np.int64))).logits, peft_model)
    assert_as_accurate(ours, theirs, what="finetuned adapter vs peft")
    assert np.abs(theirs.f32 - base).max() > 1e-3  # the adapter changed the model


# Each kind of run the resume matrix covers: (command, model, its flags; the data file's key in
# `data_files` or None for built-in data, the LoRA base (llama_dir) or not, its steps, the export folder).
RESUMED = {
    "own data decoder": (["train", "transformer", "--model-config", "d_model=32,num_layers=1"], "text", False, 4,
                         "model"),
    "built-in data": (["train", "mlp", "--model-config", "width=16,depth=2", "--eval-size", "16"], None, False, 4,
                      None),
    # The chat file packs into 15 training rows, epochs of 3 batches of 4: resumed after step 2,
    # the run is mid-epoch and then crosses an epoch's end.
    "LoRA fine-tune": (["finetune", "transformer", "--lora", "r=4,alpha=8", "--lr", "1e-2"], "chat", True, 4,
                       "adapter"),
    "classifier": (["train", "encoder", "--model-config", "d_model=32,num_layers=1"], "csv", False, 4, "model"),
}  # fmt: skip


def _killed_after_step_2(whole: Path, to: Path) -> Path:
    """A copy of the finished run `whole` as if it had been killed after step 3, whose
    checkpoint it never saved: checkpoint 2, the metrics rows up to step 2 and a row of step
    3 (which the resumed run must drop), no summary, plot or export."""
    import shutil

    import zoo

    shutil.copytree(whole, to)
    with zoo.Checkpointer(to / "checkpoints", keep=None) as ckpt:
        for step in ckpt.steps():
            if step > 2:
                ckpt.delete(step)
    for name in ("summary.json", "loss.png", "model", "adapter"):
        path = to / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    rows = [r for r in read_jsonl(to / "metrics.jsonl") if r["step"] <= 2]
    write_jsonl(to / "metrics.jsonl", [*rows, {"kind": "train", "step": 3, "loss": 1e9}])
    return to


def _zoo_process(*args) -> None:
    """`zoo ARGS` as a process of its own, as a user runs it (nothing kept in memory between
    a run and its resume), compiling as the tests do (`helpers.short_run_env`'s XLA flags:
    a short run's time is its compiling)."""
    import subprocess
    import sys

    from helpers import short_run_env

    proc = subprocess.run([sys.executable, "-m", "zoo", *map(str, args)], env=short_run_env(), capture_output=True,
                          text=True, timeout=500, check=False)  # fmt: skip
    assert proc.returncode == 0, f"zoo {' '.join(map(str, args))} exited {proc.returncode}\n{proc.stderr}"


def _final_state(folder: Path, step: int) -> dict:
    """The bit checksums of every leaf of checkpoint `step` (weights, optimizer state, key)."""
    import zoo

    leaves = zoo.Checkpointer(folder / "checkpoints", read_only=True).manifest(step)["leaves"]
    return {path: leaf["fingerprint"] for path, leaf in leaves.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kind, devices, across",
    # Every kind once, one device and several (2 and 8) each more than once: the restore
    # (the key's one-device sharding, the leaves' placements) is the same code for every
    # kind; what differs by kind (the data source, the LoRA split, the head) is device-blind.
    # The process boundary is the subject once (the LoRA fine-tune, the kind with the most
    # state: its base from a folder, the adapter split, a chat file mid-epoch, runs and
    # resumes in processes of its own); the other kinds resume in this process, from the
    # files alone.
    [("own data decoder", 1, False), ("own data decoder", 8, False), ("built-in data", 2, False),
     ("LoRA fine-tune", 2, True), ("classifier", 1, False)],
)  # fmt: skip
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, llama_dir, data_files, kind, devices, across):
    """Every kind of run, on 1 device and on several (2 and 8): a run killed after its
    step-2 checkpoint and resumed by the same command with --resume ends as the run never
    interrupted, bit for bit: each step's training loss in metrics.jsonl (the killed run's
    later row dropped), the final checkpoint's every leaf, the exported weights. The
    LoRA fine-tune runs and resumes in processes of their own (nothing kept in memory but
    the files); the other kinds run and resume in this process. Before it resumes, an own-data
    run whose file was edited since the checkpoint is refused (and resumes once it is
    restored). On 1 device the resume used to fail restoring the PRNG key (a rank-2
    sharding for its rank-1 data)."""
    import safetensors.numpy

    command, data, lora, steps, export = RESUMED[kind]
    source = data_files[data] if data else None
    if data == "text":  # a copy of its own, to edit
        source = write_jsonl(tmp_path / "text.jsonl", read_jsonl(data_files["text"]))
    args = [*command, "--devices", str(devices), "--batch-size", str(max(4, devices)), "--microbatches", "1", "--seq-len", str(SEQ),
            "--steps", str(steps), "--checkpoint-every", "2", "--eval-every", "0", "--quiet", *NO_SAMPLE,
            *(["--data", source] if source else []), *(["--init", llama_dir] if lora else [])]  # fmt: skip
    whole = tmp_path / "whole"
    run = _zoo_process if across else ok
    run(*args, "--output", whole)
    resumed = _killed_after_step_2(whole, tmp_path / "resumed")
    if data == "text":
        original = source.read_text()
        source.write_text(original + '{"text": "red red"}\n')
        rc, _, err = zoo_main(*args, "--output", resumed, "--resume")
        one_line_error(rc, err, "text.jsonl changed since checkpoint step 2")
        source.write_text(original)
    run(*args, "--output", resumed, "--resume")
    losses = [[(r["step"], r["loss"]) for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "train"]
              for d in (whole, resumed)]  # fmt: skip
    assert [s for s, _ in losses[1]] == list(range(1, steps + 1))
    # The same program on the same batches from the checkpointed (exact) state: the same
    # sums in the same order, so the same bits (no rounding allowance).
    assert losses[0] == losses[1], losses
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"] == 2
    assert _final_state(whole, steps) == _final_state(resumed, steps)
    if export:
        name = "adapter_model.safetensors" if export == "adapter" else "model.safetensors"
        a, b = (safetensors.numpy.load_file(d / export / name) for d in (whole, resumed))
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_finetune_minilm_on_string_labels(tmp_path, data_files):
    """(e) `zoo finetune minilm --data labels.jsonl`: 3 classes from the file's string
    labels, named in sorted order and printed."""
    out = tmp_path / "minilm"
    text = ok("finetune", "minilm", "--data", data_files["labels"], *TINY[:-3], "--seq-len", "16", "--steps", "2",
              "--output", out)  # fmt: skip
    assert "classes: cats, colours, dogs" in text, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"].startswith("labels.jsonl, 3 classes"), summary["data"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_train_encoder_on_a_csv_with_int_labels(tmp_path, data_files):
    """(e) `zoo train encoder --data labels.csv`: integer labels, byte tokens. The texts of
    labels.jsonl with their labels' indices: 3 classes, the shapes of the shared classifier
    run (tests/conftest.py's `classifier_run`, the same flags), whose programs either reuses."""
    records = read_jsonl(data_files["labels"])
    names = sorted({r["label"] for r in records})
    csv = tmp_path / "labels.csv"
    csv.write_text("text,label\n" + "".join(f'"{r["text"]}",{names.index(r["label"])}\n' for r in records))
    task = _task("encoder", csv, None, shapes=True)
    assert task.label_names == ("0", "1", "2") and task.kind == "classification"
    assert task.model.head.weight.shape[-1] == 3  # the head has as many outputs as the file has labels
    batch = task.batch_at(1, 4)
    assert set(batch) == {"tokens", "mask", "token_types", "labels"} and batch["tokens"].max() < 256
    out = tmp_path / "encoder"
    text = ok("train", "encoder", "--data", csv, *TINY[:-3], *ENCODER, "--steps", "2", "--output", out)
    assert "classes: 0, 1, 2" in text, text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["data"].startswith("labels.csv, 3 classes")


@pytest.mark.parametrize(
    ("args", "make", "message"),
    [
        (["train", "transformer"], None, "no such file"),
        (["train", "transformer"], ("d.parquet", "x"), "unknown extension '.parquet'"),
        (["train", "transformer"], ("d.jsonl", '{"text": "a"}\n{"text": \n'), "d.jsonl line 2 is not valid JSON"),
        (["train", "transformer"], ("d.jsonl", '{"text": "a"}\n{"prompt": "a", "completion": "b"}\n'),
         "mixes formats"),
        (["train", "transformer"], ("d.jsonl", '{"body": "a"}\n'), "none of the known keys"),
        (["train", "transformer"], ("d.csv", "text,label\na,x\nb,y\n"),
         "(classification), but transformer is a language model; train a classifier on it: zoo finetune minilm"),
        (["train", "encoder"], ("d.jsonl", '{"text": "a"}\n'),
         "(language modelling), but encoder is a classifier; train a decoder on it: zoo finetune transformer"),
        # A .json array is read (refused before as "unknown extension '.json'"): here, as the wrong model's data.
        (["train", "encoder"], ("d.json", '[{"text": "a"}]'),
         "(language modelling), but encoder is a classifier; train a decoder on it: zoo finetune transformer"),
        # A folder of files (datasets' data_dir): "unknown extension '(none)'" before.
        (["train", "transformer"], ("shards", None), "is a folder; zoo reads one data file: join its files into one"),
        (["train", "mlp"], ("d.txt", "abc"), "the mlp trains on its own data sets only (teacher)"),
        (["train", "encoder"], ("d.csv", "words,label\na,1\n"), "needs a header with 'text' and 'label'"),
        (["train", "transformer", "--validation", "1.5"], ("d.txt", "abc"), "--validation must be a fraction"),
        (["train", "transformer", "--steps", "1", "--devices", "2", "--model-config", "d_model=32"],
         ("d.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n'),
         "or a jinja2 template file: --chat-template FILE (in Python: chat_template=zoo.data.ChatTemplate(text))"),
        (["train", "transformer", "--steps", "1", "--devices", "2", "--batch-size", "8", "--model-config",
          "d_model=32", "--validation", "0"], ("d.jsonl", '{"text": "a b c"}\n' * 3),
         "--batch-size 8 is more than the training rows of d.jsonl (1)"),
        (["train", "transformer"], ("d.jsonl", '{"text": 12345}\n'), "d.jsonl line 1 field 'text' is int 12345"),
        (["train", "encoder"], ("d.csv", "text,label\na,0\nb,\n"), "d.csv line 3 field 'label' is empty"),
        (["train", "encoder"], ("d.csv", "text,label\na,0\nb,1\nc,-1\n"), "d.csv line 4 field 'label' is '-1'"),
        (["train", "transformer", "--seq-len", "4", "--devices", "2", "--model-config", "d_model=32"],
         ("d.jsonl", '{"prompt": "aaaaaaaaaa", "completion": "b"}\n'),
         "--data: d.jsonl line 1: no target token is left after truncation to seq_len 4 (the completion starts at "
         "token 10); --seq-len 11 or more fits it"),
    ],
)  # fmt: skip
def test_bad_data_files_are_one_line(tmp_path, args, make, message):
    path = tmp_path / "missing.jsonl"
    if make is not None:
        path = tmp_path / make[0]
        path.mkdir() if make[1] is None else path.write_text(make[1])
    rc, _, err = zoo_main(*args, "--data", path, "--output", tmp_path / "out")
    one_line_error(rc, err, message)


def test_chat_template_errors_are_one_line(tmp_path, llama_dir, data_files):
    """A template that does not parse (a --chat-template file, the model folder's own)
    names the file and its line; a template's raise_exception names the data's line."""
    args = ["finetune", llama_dir, *TINY, "--steps", "1", "--output", tmp_path / "out"]
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages[0].content \n")
    rc, _, err = zoo_main(*args, "--data", data_files["chat"], "--chat-template", broken)
    one_line_error(rc, err, f"--chat-template {broken} line 1: the chat template does not parse (unexpected end of")
    assert err.strip().endswith("; fix the template"), err
    rc, _, err = zoo_main("generate", llama_dir, "--chat-template", broken, "--prompt", "hi")
    one_line_error(rc, err, f"--chat-template {broken} line 1: the chat template does not parse (unexpected end of")
    folder = tmp_path / "llama"
    folder.mkdir()
    for f in llama_dir.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }}\n{% endif %}")
    rc, _, err = zoo_main(*args[:1], folder, *args[2:], "--data", data_files["chat"])
    one_line_error(rc, err, f"{folder / 'chat_template.jinja'} line 3: the chat template does not parse")
    refusing = tmp_path / "strict.jinja"
    refusing.write_text("{% if messages[0].role == 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}"
                        + CHAT_TEMPLATE)  # fmt: skip
    chats = read_jsonl(data_files["chat"])[:4]
    chats[2]["messages"].insert(0, {"role": "system", "content": "be brief"})
    data = write_jsonl(tmp_path / "sys.jsonl", chats)
    rc, _, err = zoo_main(*args, "--data", data, "--chat-template", refusing)
    one_line_error(
        rc, err, "sys.jsonl line 3: the chat template refused this conversation: roles must alternate; fix the row or"
    )


def test_a_name_neither_built_in_nor_a_file_is_one_line():
    rc, _, err = zoo_main("train", "encoder", "--data", "prose")
    one_line_error(
        rc,
        err,
        "--data 'prose': encoder trains on docstrings or swapped-halves, or on your own .txt, .jsonl, .json or .csv file",
    )


def test_the_report_counts_a_data_files_rows_as_rows(tmp_path, llama_dir, data_files):
    """A fine-tune on prompt / completion records said "validation set, 4 windows" (and
    sampled "after the start of a validation window") though its data line counts rows:
    a data file's evaluation rows are rows; a built-in corpus's stay windows."""
    text = _finetune(llama_dir, data_files["pc"], tmp_path / "pc", "--steps", "1")
    assert "prompt_completion: " in json.loads((tmp_path / "pc" / "summary.json").read_text())["data"]
    assert re.search(r"^validation set, 2 rows ", text, re.M) and "window" not in text, text
