"""The path a new user walks, in small pieces: what a MODEL argument may name, the
commands' refusals that point at the right command, argparse's prefix matching off and
"did you mean", usage errors answered without jax. Cheap: no model is trained here."""

from __future__ import annotations

import json

import jax
import pytest
from helpers import one_line_error, zoo_main


def _checkpoint(folder, model_type="llama"):
    """A folder that names a checkpoint (config.json with model_type, a safetensors file):
    enough for what MODEL resolves to, no weights are read."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_model_names_a_registered_model_a_family_or_a_checkpoint(tmp_path, monkeypatch):
    import zoo
    from zoo.train import model_and_init

    llama = _checkpoint(tmp_path / "llama")
    bert = _checkpoint(tmp_path / "bert", "bert")
    assert model_and_init("transformer", None) == ("transformer", None)
    assert model_and_init("llama", str(llama)) == ("transformer", str(llama))
    assert model_and_init(str(llama), None) == ("transformer", str(llama))
    assert model_and_init(str(bert), None) == ("encoder", str(bert))
    run = tmp_path / "run"
    _checkpoint(run / "model")  # a `zoo train` run: its model/
    assert model_and_init(str(run), None) == ("transformer", str(run))
    # RunConfig resolves it the same way: config.json records the model and its init.
    config = zoo.train.RunConfig(model=str(llama)).resolved("finetune")
    assert (config.model, config.init) == ("transformer", str(llama))
    with pytest.raises(zoo.train.ConfigError, match="names a family: give its checkpoint as RunConfig.init") as e:
        model_and_init("llama", None)
    assert "./llama" not in str(e.value)
    # A folder of the family's name in the working folder: the error says how to name it.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        zoo.train.ConfigError, match=r"names a family: .* \(the folder llama here: give it as ./llama\)"
    ):
        model_and_init("llama", None)
    with pytest.raises(zoo.train.ConfigError, match="give the checkpoint once"):
        model_and_init(str(llama), str(bert))
    with pytest.raises(zoo.train.ConfigError, match=r"unknown model 'transfomer'; .*\(did you mean 'transformer'\?\)"):
        model_and_init("transfomer", None)


def test_a_finetune_run_is_the_init_of_the_next_sft_then_dpo(llama_dir, chat_run, tmp_path, monkeypatch):
    """A DPO fine-tune of the SFT run (`zoo finetune --init runs/sft --objective dpo`; here
    the library's `RunConfig(model="runs/sft")`, the run named as the checkpoint, which only
    the resolved config turns into `init`): the SFT run's adapter merged into its base
    (once, into zoo's cache) is the model DPO starts from: its logits are the SFT run's
    (float32 rounding: the merge adds B·A into W). The SFT run is the shared finished chat
    SFT run (LoRA on the tiny Llama, tests/conftest.py), read, not changed."""
    import numpy as np
    from helpers import assert_rounding_close
    from tiny_runs import SEQ

    import zoo
    from zoo.train._registry import merged_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "the cat sat on the", "chosen": " mat", "rejected": " log"}) + "\n"
                             for _ in range(24)))  # fmt: skip
    sft, dpo = chat_run, tmp_path / "runs" / "dpo"
    config = zoo.train.RunConfig(
        model=str(sft), data=zoo.train.DataConfig(source=str(pairs), seq_len=SEQ), objective="dpo", steps=2,
        lora=zoo.lora.LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj")), devices=2, batch_size=4,
        microbatches=1, quiet=True, output=str(dpo), optimizer=zoo.train.OptimizerConfig(lr=1e-2),
    )  # fmt: skip
    zoo.train.run(config, command="finetune")
    assert json.loads((dpo / "config.json").read_text())["init"] == str(sft)
    (merged,) = merged_cache().iterdir()
    tokens = np.array([[1, 6, 8, 10, 12, 6, 14]], np.int32)
    ours = np.asarray(zoo.hf.from_pretrained(merged)(tokens))
    want = np.asarray(zoo.train.load_run(sft).model(tokens))
    assert_rounding_close(ours, want, terms=48, depth=14, what="the merged SFT run vs the SFT run")
    assert np.abs(want - np.asarray(zoo.hf.from_pretrained(llama_dir)(tokens))).max() > 1e-4  # SFT changed it
    # The model of the DPO run's adapter is that merged base.
    assert json.loads((dpo / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(merged)
    # Another machine, or the cache emptied: the DPO run merges its init again (it used to
    # refuse, "export it first"), to the same model and the same greedy text.
    dpo_logits = np.asarray(zoo.train.load_run(dpo).model(tokens))
    rc, text, err = zoo_main("generate", dpo, "--prompt", "the cat", "--max-new-tokens", "4")
    assert rc == 0, err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another"))
    np.testing.assert_array_equal(np.asarray(zoo.train.load_run(dpo).model(tokens)), dpo_logits)  # zoo export, eval
    assert len(list(merged_cache().iterdir())) == 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a third"))
    rc, again, err = zoo_main("generate", dpo, "--prompt", "the cat", "--max-new-tokens", "4")  # zoo serve's too
    assert rc == 0 and again == text, err


def test_cli_models_by_family_and_folder(tmp_path):
    rc, _, err = zoo_main("finetune", "llama")
    one_line_error(rc, err, "MODEL 'llama' names a family: give its checkpoint as --init")
    rc, _, err = zoo_main("finetune", "mlpz")
    one_line_error(
        rc, err, "unknown model 'mlpz'; choose one of ['mlp', 'transformer', 'encoder', 'minilm'] (did you mean 'mlp'?)"
    )
    rc, _, err = zoo_main("finetune", tmp_path / "no" / "such")
    one_line_error(rc, err, f"MODEL {tmp_path / 'no' / 'such'}: no such folder")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_send_a_classifier_run_to_predict(tmp_path, command):
    run = tmp_path / "cls"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": "minilm", "steps": 3}))
    rc, _, err = zoo_main(command, run, *(["--prompt", "a"] if command == "generate" else ["--port", "0"]))
    one_line_error(rc, err, f"SOURCE {run}: a classifier run (the minilm), which generates no text: use zoo predict")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "mlp", "--step", "3"], "unrecognized arguments: --step 3; did you mean --steps?"),
        (["finetune", "minilm", "--lora-r", "4"], "unrecognized arguments: --lora-r 4; did you mean --lora?"),
        (
            ["generate", "x", "--prompt", "a", "--max-new-token", "3"],
            "--max-new-token 3; did you mean --max-new-tokens?",
        ),
    ],
)
def test_flags_are_taken_as_written_and_typos_get_the_nearest(args, message):
    """argparse's prefix matching is off: `--step 3` is not `--steps 3`."""
    rc, _, err = zoo_main(*args)
    one_line_error(rc, err, message)


def test_usage_errors_of_the_registry_answer_without_jax():
    """A misspelt model or one the command does not take is refused before jax is imported
    (the process is the subject: a fresh one)."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\nfrom zoo._cli import main\n"
        "for args in (['train', 'mlpx'], ['finetune', 'mlp'], ['info', 'transfomer'], ['train', 'mlp', '--step', '3']):\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n            rc = main(args)\n        except SystemExit as e:\n            rc = e.code\n"
        "    assert rc == 2, (args, rc)\n"
        "print('jax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_adapter_readme_says_what_load_adapter_returns_and_that_missing_is_expected(tmp_path):
    from zoo.train._export import classifier_readme

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "bert",
                                                              "modules_to_save": ["classifier"]}))  # fmt: skip
    text = classifier_readme(tmp_path, pooling="cls", title="t", seq_len=8, label_names=["a", "b"], d_model=4,
                             tokenizer_dir=None, pad_id=0)  # fmt: skip
    assert "model, config = zoo.lora.load_adapter(classifier, ADAPTER)" in text
    assert "`classifier.weight` and `classifier.bias` as MISSING" in text and "expected" in text


def test_an_unset_batch_is_the_largest_the_mesh_and_the_rows_allow():
    import dataclasses

    import zoo
    from zoo.train._plan import fit_batch

    config = zoo.train.RunConfig(model="transformer").resolved("finetune")
    assert set(config.derived) == {"batch_size", "microbatches", "warmup", "eval_every"}
    assert config.to_dict()["derived"] == ["batch_size", "eval_every", "microbatches", "warmup"]
    on = dataclasses.replace(config, mesh={"data": 8})  # default: batch 64, 4 microbatches
    assert (fit_batch(on, None).batch_size, fit_batch(on, None).microbatches) == (64, 4)
    assert (fit_batch(on, 110).batch_size, fit_batch(on, 110).microbatches) == (64, 4)
    assert (fit_batch(on, 40).batch_size, fit_batch(on, 40).microbatches) == (32, 4)
    assert (fit_batch(on, 15).batch_size, fit_batch(on, 15).microbatches) == (8, 1)  # microbatches lowered too
    on6 = dataclasses.replace(on, mesh={"data": 6})
    assert (fit_batch(on6, None).batch_size, fit_batch(on6, None).microbatches) == (48, 4)
    # Given values are kept: the checks then say what is wrong, naming fields.
    given = zoo.train.RunConfig(model="transformer", batch_size=64, microbatches=4).resolved("finetune")
    assert "batch_size" not in given.derived and fit_batch(dataclasses.replace(given, mesh={"data": 8}), 15) == (
        dataclasses.replace(given, mesh={"data": 8})
    )
    with pytest.raises(zoo.train.ConfigError, match=r"RunConfig.batch_size 36 is not divisible"):
        zoo.train.run(zoo.train.RunConfig(model="mlp", batch_size=36, devices=8))


def test_a_replayed_config_json_derives_its_derived_values_again(tmp_path):
    import zoo
    from zoo._cli._config_file import config_defaults
    from zoo._cli._main import build_parsers
    from zoo._cli._train import resolve

    saved = zoo.train.RunConfig(model="transformer", steps=200).resolved("train").to_dict()
    assert (saved["warmup"], saved["eval_every"]) == (10, 20)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    argv = ["train", "--config", str(tmp_path / "config.json"), "--steps", "5"]
    parser, commands = build_parsers()
    commands["train"].set_defaults(**config_defaults(argv[2], commands["train"], "train"))
    flat = resolve(parser.parse_args(argv), "train")
    assert (flat["steps"], flat["warmup"], flat["eval_every"]) == (5, 1, 1)
    # A value the run was given stays given.
    saved["warmup"], saved["derived"] = 3, ["batch_size", "eval_every", "microbatches"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    parser, commands = build_parsers()
    commands["train"].set_defaults(**config_defaults(argv[2], commands["train"], "train"))
    assert resolve(parser.parse_args(argv), "train")["warmup"] == 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_first_chat_file_trains_with_no_other_flags(llama_dir, tmp_path, monkeypatch, capsys):
    """`zoo finetune transformer --init DIR --data 110_chats.jsonl`, nothing else: the
    default batch (64 in 4 microbatches on 8 devices) does not fit the file's rows, so the
    run takes the largest that does and says so."""
    import numpy as np
    from tiny_runs import _sentence

    rng = np.random.default_rng(0)
    chats = [{"messages": [{"role": "user", "content": _sentence(rng, 3)},
                           {"role": "assistant", "content": _sentence(rng, 2)}]} for _ in range(110)]  # fmt: skip
    (tmp_path / "110_chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    monkeypatch.chdir(tmp_path)
    rc, out, err = zoo_main("finetune", "transformer", "--init", llama_dir, "--data", "110_chats.jsonl")
    assert rc == 0, err
    assert "(--batch-size unset: the largest up to the default 64 that the mesh and the 15 training rows allow)" in out
    (run,) = (tmp_path / "runs").iterdir()
    config = json.loads((run / "config.json").read_text())
    assert (config["batch_size"], config["microbatches"], config["steps"]) == (8, 1, 200)
    assert json.loads((run / "summary.json").read_text())["loss_fell"]


@pytest.mark.timeout(900)
def test_ctrl_c_saves_the_step_and_the_printed_command_continues_it(tmp_path, monkeypatch):
    """Ctrl-C mid-way through a run with the default settings (no --checkpoint-every):
    exit 130, the step in progress is saved, one line names the exact command that
    continues it, and that command's final weights equal an uninterrupted run's. The
    interrupted run is the subject: a fresh process taking Ctrl-C as from a terminal
    (the suite's one Ctrl-C test of a run; test_bad_inputs.py's Ctrl-C during a save is
    the other case). It compiles as this process does (helpers.short_run_env), so the
    continued and the uninterrupted run, in this process, run the same programs."""
    import os
    import shlex
    import signal
    import subprocess
    import time

    import numpy as np
    from helpers import ZOO_TAKING_CTRL_C, short_run_env, sigint_state
    from tiny_runs import TINY_MLP

    import zoo

    # The suite's tiny mlp run (tiny_runs.TINY_MLP, conftest's finished_mlp_run's model): the
    # continued and the uninterrupted run reuse the programs other files compiled.
    flags = ["train", "mlp", *TINY_MLP, "--model-config", "width=16,depth=2", "--steps", "400"]
    out = tmp_path / "run"
    proc = subprocess.Popen([*ZOO_TAKING_CTRL_C, *flags, "--output", str(out)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=short_run_env())  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count('"kind": "train"') >= 5:
            break
        time.sleep(0.05)
    state = f"the run's SIGINT: {sigint_state(proc.pid)}; this process's: {sigint_state(os.getpid())}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, f"{err!r}; {state}"
    one_line_error(proc.returncode, err, "zoo: interrupted: Ctrl-C: stopped after step ", code=130)
    saved = zoo.Checkpointer(out / "checkpoints", read_only=True).steps()
    assert len(saved) == 1 and 5 <= saved[0] < 400, (saved, err)
    assert f"checkpoint saved in {out / 'checkpoints'}; continue with: zoo " in err
    command = shlex.split(err.split("continue with: ", 1)[1])
    assert command[0] == "zoo" and command[-1] == "--resume"
    # The printed command and the uninterrupted run, here (where the user's shell was).
    monkeypatch.chdir(tmp_path)
    whole = tmp_path / "whole"
    for args in (command[1:], [*flags, "--output", str(whole)]):
        rc, _, run_err = zoo_main(*args)
        assert rc == 0, run_err
    # The mlp's weights are its final checkpoint (it has no Hugging Face folder).
    final = {}
    for name, folder in (("continued", out), ("whole", whole)):
        run = zoo.train.load_run(folder)
        assert run.weights.endswith("step 400"), run.weights
        final[name] = run.model
    for a, b in zip(jax.tree.leaves(final["continued"]), jax.tree.leaves(final["whole"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_seq_len_longer_than_the_pretrained_positions_is_named_before_the_rows(llama_dir, data_files, tmp_path):
    """`--seq-len` above the positions a pretrained folder embeds (config.json's
    `max_position_embeddings`: 64 here) is refused as such, from that file, before the data
    file's rows are cut at that length and counted (it was reported as too few rows); a
    `--model-config max_len` over the folder's is taken as the limit instead."""
    from helpers import zoo_main

    flags = ["finetune", str(llama_dir), "--data", str(data_files["text"]), "--steps", "1"]
    rc, _, err = zoo_main(*flags, "--seq-len", "128", "--output", tmp_path / "a")
    assert rc == 2 and err.strip().endswith(
        f"--seq-len 128 exceeds the model's max_len 64 (the positions {llama_dir} embeds); lower --seq-len"
    ), err
    rc, _, err = zoo_main(*flags, "--seq-len", "128", "--model-config", "max_len=256", "--output", tmp_path / "b")
    assert "exceeds the model's max_len" not in err, err
    assert not (tmp_path / "a").exists()
