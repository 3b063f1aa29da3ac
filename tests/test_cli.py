"""The `zoo` command: inspect and info (collectives, leaves), train / finetune / demo (outputs,
resume, config files), `--help`, and one-line errors; the demo end to end (slow).

Commands run in-process (`main([...])`) where they can: the pytest process already has 8
simulated CPU devices (conftest) and shares jax's caches, which keeps each test to a tiny
model's compiles. What a user sees of an error (exit code, exactly one line on stderr, no
traceback; `--debug`'s traceback; exit 1) is checked through `python -m zoo` in a few
fresh processes, which also carry everything the in-process redirect hides (warnings,
absl's and XLA's output on file descriptor 2); Ctrl-C's exit 130 in tests/test_user_path.py.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import one_line_error, zoo_main
from helpers import zoo_ok as ok

ROOT = Path(__file__).resolve().parents[1]


def run_zoo(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "zoo", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


# --- inspect ---------------------------------------------------------------------------------


# A small transformer (or encoder) as zoo train builds it: the registry's scratch config with these changes.
SMALL_LM = ["--model-config", "d_model=32", "--seq-len", "16"]


def inspect_json(*args) -> dict:
    return json.loads(ok("inspect", *args, "--json"))


def test_inspect_json_reports_one_all_reduce_outside():
    out = inspect_json("mlp", "--devices", "8", "--microbatches", "4")
    for key in ("model", "devices", "microbatches", "mesh", "param_bytes", "trainable_bytes", "collectives"):
        assert key in out
    assert out["mesh"] == {"data": 8} and out["devices"] == 8 and out["microbatches"] == 4
    (coll,) = out["collectives"]
    assert set(coll) >= {"kind", "in_loop", "bytes", "mesh_axes", "op_name"}
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert coll["bytes"] == out["trainable_bytes"] + 4
    assert out["summary"]["all_reduce_in_loop"] == 0 and out["summary"]["all_reduce_outside"] == 1


def test_inspect_checks_the_budget_and_compares_with_an_earlier_program(tmp_path):
    rc, out, _ = zoo_main("inspect", "mlp", "--devices", "8", "--budget", "--json")
    dp = json.loads(out)
    assert rc == 0 and dp["budget"] == {"name": "dp", "within": True, "breaches": []}
    (tmp_path / "dp.json").write_text(out)
    rc, out, _ = zoo_main("inspect", "mlp", "--devices", "8", "--budget", "--against", tmp_path / "dp.json")
    assert rc == 0, out
    assert re.search(r"collectives: within the dp budget \(1 all-reduce outside, [\d,]+ B\)", out), out
    assert f"against {tmp_path / 'dp.json'}:\nthe same collectives" in out
    # zero1 adds the gathers of the updated parameters: a diff, exit 1.
    rc, out, _ = zoo_main("inspect", "mlp", "--devices", "8", "--rules", "zero1", "--against", tmp_path / "dp.json")
    assert rc == 1 and "+ all-gather outside over data" in out, out
    rc, _, err = zoo_main("inspect", "mlp", "--devices", "8", "--against", tmp_path / "missing.json")
    assert rc == 2 and "--against" in err and "zoo inspect --json" in err


def test_inspect_table_shard_map_and_custom_mesh():
    out = ok("inspect", "mlp", "--devices", "4", "--mesh", "data=2", "--microbatches", "2", "--mode", "shard_map")
    assert "mesh {'data': 2}" in out
    assert "all-reduces: 0 inside loops, 1 outside" in out


def test_inspect_transformer_tp_keeps_one_data_all_reduce():
    """tp's in-loop all-reduces are its own, over `model`; the gradient's is the one over `data`
    (without clipping: the run's global norm over gradients sharded on `model` reduces its
    own scalars outside loops, as `zoo inspect` with the run's flags shows)."""
    out = inspect_json("transformer", *SMALL_LM, "--mesh", "data=4,model=2", "--rules", "tp", "--clip", "0")
    assert out["model"] == "transformer" and out["mesh"] == {"data": 4, "model": 2} and out["rules"] == "tp"
    outside = [c for c in out["collectives"] if not c["in_loop"]]
    inside = [c for c in out["collectives"] if c["in_loop"]]
    assert [(c["kind"], c["mesh_axes"]) for c in outside] == [("all-reduce", ["data"])]
    assert inside and all(c["mesh_axes"] == ["model"] for c in inside)
    summary = out["summary"]
    assert summary["all_reduce_outside"] == 1 and summary["in_loop_mesh_axes"] == ["model"]
    assert summary["outside_mesh_axes"] == ["data"] and summary["collectives_in_loop"] == len(inside)


def test_inspect_encoder_dp_reduces_trainable_bytes_once():
    out = inspect_json("encoder", *SMALL_LM, "--rules", "dp")
    assert out["mesh"] == {"data": 8} and out["param_bytes"] == out["trainable_bytes"] > 0
    (coll,) = out["collectives"]
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert 0 < coll["bytes"] - out["trainable_bytes"] <= 8  # + the loss (and weight) scalars
    assert out["summary"]["collectives_in_loop"] == 0 and out["summary"]["in_loop_mesh_axes"] == []


def test_inspect_transformer_fsdp_once_gathers_outside_loops():
    """`fsdp-once` brings `gather="once"`: every all-gather is hoisted out of the microbatch loop
    (without clipping, whose global norm over sharded gradients reduces scalars of its own)."""
    out = inspect_json("transformer", *SMALL_LM, "--rules", "fsdp-once", "--clip", "0")
    summary = out["summary"]
    assert summary["collectives_in_loop"] == 0 and summary["in_loop_mesh_axes"] == []
    assert summary["all_gather_outside"] > 0 and summary["all_gather_in_loop"] == 0
    assert summary["all_reduce_outside"] == 1 and summary["outside_mesh_axes"] == ["data"]


def _tiny_lora_bytes(config_kwargs) -> dict:
    """Bytes of each LoRA A/B leaf of the `SMALL_LM` transformer, counted on an abstract model
    built from the registry's scratch config."""
    import equinox as eqx
    import jax
    import jax.random as jr

    import zoo

    values = dict(zoo.train.model_spec("transformer").scratch_config) | {"d_model": 32, "max_len": 16}
    base = jax.eval_shape(lambda k: zoo.models.Transformer(zoo.models.TransformerConfig(**values), key=k), jr.key(0))
    lora_model = eqx.filter_eval_shape(zoo.lora.add_lora, base, zoo.lora.LoraConfig(**config_kwargs), key=jr.key(1))
    return {
        zoo._axes.path_str(path): x.size * x.dtype.itemsize
        for path, x in jax.tree_util.tree_leaves_with_path(lora_model)
        if jax.tree_util.keystr(path).endswith(("lora_A", "lora_B"))
    }


def test_inspect_transformer_lora_reduces_only_the_adapters():
    """`--lora`: the step's one all-reduce carries the LoRA A/B gradients (+ loss scalars),
    whose bytes the test counts itself on an abstract model built the same way."""
    out = inspect_json("transformer", *SMALL_LM, "--lora", "r=4,alpha=8,targets=q_proj+v_proj")
    assert out["command"] == "finetune" and out["seq_len"] == 16 and out["config"]["d_model"] == 32
    lora_bytes = sum(_tiny_lora_bytes(dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).values())
    assert lora_bytes == 2 * 2 * (32 * 4 + 4 * 32) * 4  # 2 layers x (q, v) x (A + B) in float32
    assert out["trainable_bytes"] == out["adapter_bytes"] == lora_bytes
    assert out["param_bytes"] > 10 * lora_bytes
    assert out["lora"]["r"] == 4 and out["lora"]["lora_alpha"] == 8 and out["lora"]["scaling"] == 2.0
    assert [n.split(".")[-1] for n in out["lora"]["adapted_modules"]] == ["q_proj", "v_proj"]
    (coll,) = out["collectives"]
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert 0 < coll["bytes"] - out["trainable_bytes"] <= 8  # + the loss (and weight) scalars
    assert out["summary"]["all_reduce_outside"] == 1 and out["summary"]["all_reduce_in_loop"] == 0


# --- info --------------------------------------------------------------------------------------


def info_json(*args) -> dict:
    return json.loads(ok("info", *args, "--json"))


def test_info_transformer_leaves_axes_and_tp_bytes_per_device():
    out = info_json("transformer")
    leaves, totals = out["leaves"], out["totals"]
    assert leaves and totals["leaves"] == len(leaves)
    assert sum(leaf["bytes"] for leaf in leaves) == totals["bytes"] > 0
    assert sum(leaf["parameters"] for leaf in leaves) == totals["parameters"]
    for leaf in leaves:
        assert len(leaf["logical_axes"]) == len(leaf["shape"]) == len(leaf["spec"]), leaf
        assert leaf["bytes"] == math.prod(leaf["shape"]) * 4 and leaf["dtype"] == "float32"
    assert all(leaf["trainable"] for leaf in leaves) and totals["trainable_bytes"] == totals["bytes"]
    assert totals["bytes_per_device"] == totals["bytes"]  # dp: everything replicated

    tp = info_json("transformer", "--rules", "tp", "--mesh", "data=4,model=2")
    assert tp["mesh"] == {"data": 4, "model": 2} and tp["rules"] == "tp"
    (q,) = [leaf for leaf in tp["leaves"] if leaf["path"] == "model.layers.layers.attention.q_proj.weight"]
    heads = q["logical_axes"].index("heads")
    assert q["spec"][heads] == "model" and all(e is None for i, e in enumerate(q["spec"]) if i != heads)
    assert q["bytes_per_device"] * 2 == q["bytes"]
    assert tp["totals"]["bytes"] == totals["bytes"] > tp["totals"]["bytes_per_device"]
    assert tp["totals"]["bytes_per_device"] == sum(leaf["bytes_per_device"] for leaf in tp["leaves"])


def test_info_transformer_lora_trains_only_the_adapters():
    out = info_json("transformer", *SMALL_LM, "--lora", "r=4,targets=q_proj+v_proj")
    expected = _tiny_lora_bytes(dict(r=4, target_modules=["q_proj", "v_proj"]))
    assert sum(expected.values()) == 2 * 2 * (32 * 4 + 4 * 32) * 4  # 2 layers x (q, v) x (A + B) in float32
    trainable = {leaf["path"]: leaf["bytes"] for leaf in out["leaves"] if leaf["trainable"]}
    assert trainable == expected
    assert all(p.endswith(("lora_A", "lora_B")) for p in trainable)
    assert out["totals"]["trainable_bytes"] == sum(expected.values())
    assert out["totals"]["trainable_parameters"] == sum(expected.values()) // 4
    assert out["totals"]["bytes"] > 10 * out["totals"]["trainable_bytes"]
    assert out["lora"]["r"] == 4


# --- train / finetune: outputs, resume, config files -----------------------------------------

# A tiny mlp run: 8 devices x 2 microbatches, batch 32, checkpoints every 3 steps.
MLP_FLAGS = ["--steps", "6", "--batch-size", "32", "--microbatches", "2", "--eval-size", "64",
             "--checkpoint-every", "3", "--quiet"]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "mlp"
    text = ok("train", "mlp", *MLP_FLAGS, "--output", out)
    assert "loss fell: yes" in text and "1 gradient all-reduce" in text, text
    return out


def test_train_writes_config_metrics_plot_summary_and_checkpoints(mlp_run):
    names = {p.name for p in mlp_run.iterdir()}
    assert {"config.json", "metrics.jsonl", "loss.png", "summary.json", "checkpoints"} <= names
    assert (mlp_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    config = json.loads((mlp_run / "config.json").read_text())
    assert config["model"] == "mlp" and config["steps"] == 6 and config["batch_size"] == 32
    assert config["devices"] == 8 and config["mesh"] == "data=8" and config["rules"] == "dp"
    assert config["lr"] == 3e-3 and config["optimizer"] == "adamw"  # resolved defaults

    rows = read_jsonl(mlp_run / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 and r["examples_per_s"] > 0 and r["elapsed"] >= 0 for r in train)
    # No --eval-every: an evaluation every tenth of the run (at least every step), so loss.png
    # shows measured points between the first and the last.
    assert config["eval_every"] == 1
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4, 5, 6] and all(r["eval_loss"] > 0 for r in evals)

    summary = json.loads((mlp_run / "summary.json").read_text())
    assert summary["loss_fell"] and summary["eval_after"]["loss"] < summary["eval_before"]["loss"]
    colls = summary["collectives"]
    assert colls["gradient_reductions"] == 1 and colls["all_reduce_outside"] == 1 and colls["all_reduce_in_loop"] == 0
    assert colls["gradient_bytes"] == summary["trainable_bytes"] + 4  # + the loss scalar
    assert re.fullmatch(r"within the dp budget \(1 all-reduce outside, [\d,]+ B\)", colls["budget"])
    assert summary["trainable_bytes"] == summary["model_bytes"] > 0

    import zoo

    assert zoo.Checkpointer(mlp_run / "checkpoints").steps() == [3, 6]


def test_resume_from_config_json_continues_at_the_saved_step(mlp_run):
    """The run's config.json, read back with --config (flags on the command line win),
    resumes from the newest checkpoint: steps 7 and 8 only, the metrics continued."""
    first = json.loads((mlp_run / "config.json").read_text())
    assert first["output"] == str(mlp_run) and first["resume"] is False
    ok("train", "--config", mlp_run / "config.json", "--steps", "8", "--resume")
    again = json.loads((mlp_run / "config.json").read_text())
    assert again == first | {"steps": 8, "resume": True}
    summary = json.loads((mlp_run / "summary.json").read_text())
    assert summary["resumed_from"] == 6 and summary["steps"] == 8
    assert summary["stages"][0]["name"] == "resumed at step 6"
    steps = [r["step"] for r in read_jsonl(mlp_run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # the earlier rows kept, no step twice

    import zoo

    assert zoo.Checkpointer(mlp_run / "checkpoints").steps() == [3, 6, 8]
    # Nothing left to do: the newest checkpoint is at --steps.
    rc, _, err = zoo_main("train", "--config", mlp_run / "config.json", "--steps", "8")
    one_line_error(rc, err, "raise --steps")
    # Without --resume, a folder holding checkpoints is not overwritten.
    rc, _, err = zoo_main("train", "--config", mlp_run / "config.json", "--no-resume")
    one_line_error(rc, err, "already holds checkpoints (steps [3, 6, 8]); pass --resume")


def _resolved(command: str, *args) -> dict:
    """What `zoo COMMAND ARGS` would run with (flags and --config resolved), without running."""
    from zoo._cli._config_file import config_defaults
    from zoo._cli._main import build_parsers
    from zoo._cli._train import resolve

    parser, commands = build_parsers()
    argv = [command, *map(str, args)]
    parsed = parser.parse_args(argv)
    if parsed.config:
        commands[command].set_defaults(**config_defaults(parsed.config, commands[command], command))
        parsed = parser.parse_args(argv)
    return resolve(parsed, command)


def test_config_files_toml_yaml_mirror_the_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "minilm"\nsteps = 7\nbatch-size = 16\nlr = 1e-3\nmesh = { data = 4, model = 2 }\nrules = "tp"\n'
        'lora = { r = 4, alpha = 8, targets = ["q_proj", "v_proj"] }\nquiet = true\n'
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "model: minilm\nsteps: 7\nbatch_size: 16\nlr: 0.001\nmesh: data=4,model=2\nrules: tp\n"
        "lora: r=4,alpha=8,targets=q_proj+v_proj\nquiet: true\n"
    )
    from_toml = _resolved("finetune", "--config", toml)
    from_yaml = _resolved("finetune", "--config", yaml)
    assert from_toml == from_yaml
    assert from_toml["steps"] == 7 and from_toml["batch_size"] == 16 and from_toml["lr"] == 1e-3
    assert from_toml["mesh"] == "data=4,model=2" and from_toml["rules"] == "tp" and from_toml["quiet"] is True
    assert from_toml["lora"].startswith("r=4,alpha=8,") and "targets=q_proj+v_proj" in from_toml["lora"]
    assert from_toml["microbatches"] == 2 and from_toml["seq_len"] == 32  # minilm's finetune defaults
    # The command line wins over the file.
    assert _resolved("finetune", "--config", toml, "--steps", "3", "--lora", "r=2")["steps"] == 3
    assert _resolved("finetune", "--config", yaml, "--lora", "r=2")["lora"].startswith("r=2,alpha=16,")


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps = 3\nbatch_sise = 4\n", "unknown keys ['batch_sise'] for zoo train; valid keys: batch-size,"),
        ("steps = 2.5\n", "steps must be an integer"),
        ("optimizer = 'adagrad'\n", "optimizer must be one of"),
        ("quiet = 'yes'\n", "quiet must be true or false"),
        ("steps = [\n", "cannot parse it as TOML"),
    ],
)
def test_bad_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    rc, _, err = zoo_main("train", "mlp", "--config", path)
    one_line_error(rc, err, message)


def test_finetune_transformer_from_a_hugging_face_folder(tmp_path):
    """`zoo finetune transformer --init DIR` reads a GPT-2 folder (here a tiny random one,
    as `zoo train transformer` leaves in its model/), adapts it on prose and saves the
    adapter; the step's all-reduce carries the adapter and two loss scalars (sum and
    token count)."""
    import jax

    import zoo
    from zoo.train._task import init_compiled

    config = zoo.models.TransformerConfig(vocab_size=256, d_model=32, num_heads=4, num_layers=1, max_len=16)
    gpt = init_compiled(("gpt", config), lambda k: zoo.models.Transformer(config, key=k), jax.random.key(0))
    base = tmp_path / "base"
    zoo.hf.save_pretrained(gpt, base / "model")
    tiny = ["--seq-len", "16", "--batch-size", "16", "--microbatches", "2", "--steps", "2", "--eval-size", "16",
            "--quiet"]  # fmt: skip
    tuned = tmp_path / "tuned"
    text = ok("finetune", "transformer", *tiny, "--init", base, "--lora", "r=4,alpha=8", "--output", tuned)
    assert "1 gradient all-reduce" in text and "loss scalars 8" in text, text
    assert {p.name for p in (tuned / "adapter").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "zoo_adapter.json",
    }
    adapter_config = json.loads((tuned / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    summary = json.loads((tuned / "summary.json").read_text())
    assert summary["data"].startswith("pydoc_data.topics prose") and summary["init"] == str(base / "model")
    assert summary["lora"]["r"] == 4 and summary["lora"]["target_modules"] == "all-linear"
    assert summary["trainable_bytes"] == summary["adapter_bytes"] < summary["model_bytes"] / 5
    assert summary["collectives"]["gradient_reductions"] == 1
    assert summary["collectives"]["gradient_bytes"] == summary["adapter_bytes"] + 8
    assert summary["collectives"]["budget"].startswith("within the dp budget (1 all-reduce outside")
    assert summary["eval_after"]["accuracy"] is not None  # next-token accuracy
    assert summary["eval_after"]["perplexity"] == pytest.approx(math.exp(summary["eval_after"]["loss"]))
    # A decoder's run ends with a greedy sample (zoo.generate) after the start of a validation window.
    assert summary["sample"]["new_tokens"] == 8 and len(summary["sample"]["prompt"].encode()) >= 8
    assert f"{summary['sample']['completion']!r}" in text
    rows = read_jsonl(tuned / "metrics.jsonl")
    assert all(r["tokens_per_s"] > 0 for r in rows if r["kind"] == "train")
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in rows if r["kind"] == "eval")


def test_train_encoder_classifier_with_probe(tmp_path):
    """A BERT-style classifier from scratch (byte tokens) on the docstring task, with the
    linear-probe baseline (the head fitted on frozen features); stages carry accuracies."""
    out = tmp_path / "enc"
    text = ok("train", "encoder", "--model-config", "d_model=16,num_layers=1,num_heads=2,mlp_dim=32",
              "--seq-len", "32", "--batch-size", "16", "--steps", "2", "--probe", "20", "--output", out, "--quiet")  # fmt: skip
    assert "frozen encoder + fitted head (linear probe)" in text, text
    summary = json.loads((out / "summary.json").read_text())
    names = [s["name"] for s in summary["stages"]]
    assert names == [
        "pretrained encoder + new head",
        "frozen encoder + fitted head (linear probe)",
        "trained after 2 steps",
    ]
    assert all(0 <= s["accuracy"] <= 1 for s in summary["stages"])
    assert summary["probe"] == summary["stages"][1] and summary["probe"]["train_accuracy"] > 0
    assert summary["eval_before"] == {k: v for k, v in summary["stages"][0].items() if k != "name"}
    margin = 100 * (summary["stages"][2]["accuracy"] - summary["probe"]["accuracy"])
    assert f"trained vs the linear probe: {margin:+.1f} points of test accuracy" in text, text
    assert (out / "model" / "config.json").is_file()  # the encoder in BERT's layout
    # Each evaluation, the probe's too, scores every class: precision, recall, F1, macro-F1.
    names = summary["stages"][0]["per_class"].keys()
    assert len(names) == 8 and all(0 <= s["macro_f1"] <= 1 for s in summary["stages"])
    assert sum(c["support"] for c in summary["eval_after"]["per_class"].values()) == summary["eval_after"]["examples"]
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(r["eval_per_class"].keys() == names for r in evals)
    assert evals[-1]["eval_macro_f1"] == summary["eval_after"]["macro_f1"]


# --- help and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "finetune", "demo", "inspect", "info"])
def test_help_lists_every_flag(command):
    from zoo._cli._main import build_parsers

    parser = build_parsers()[1][command]
    text = parser.format_help()
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) >= (7 if command in ("inspect", "info") else 30)
    for flag in flags:
        assert flag in text, flag
    joined = " ".join(text.split())  # argparse wraps lines
    for choice in ("mlp", "transformer", "encoder", "minilm", "dp", "fsdp", "fsdp-once", "tp", "fsdp+tp"):
        assert choice in joined
    if command in ("finetune", "demo"):
        assert "--lora" in flags and "--init" in flags


def test_entry_point_help_and_one_line_usage_error(usage_answers):
    """`python -m zoo --help` lists the commands (read from the fresh process of
    `usage_answers`, which runs that entry); a bad flag is one line naming the fix."""
    rc, stdout, _ = usage_answers[1][[args for args, _, _ in USAGE_CASES].index(["--help"])]
    commands = ("train", "finetune", "demo", "inspect", "info", "generate", "serve", "predict", "eval", "export")
    assert rc == 0 and all(c in stdout for c in commands)
    rc, _, err = zoo_main("train", "mlp", "--stepz", "3")  # argparse's errors, in-process
    one_line_error(
        rc, err, "zoo train: error: unrecognized arguments: --stepz 3; did you mean --steps? (see zoo train --help)"
    )
    rc, _, err = zoo_main("train", "mlp", "--steps", "x")
    one_line_error(rc, err, "zoo train: error: argument --steps: invalid int value: 'x'")


# `--help` and argparse's usage errors: (argv, exit code, what stdout or the one stderr line holds).
USAGE_CASES = [
    (["--help"], 0, "usage: zoo [-h]"),
    (["train", "--help"], 0, "usage: zoo train [-h]"),
    (["generate", "--help"], 0, "usage: zoo generate [-h]"),
    (
        ["train", "mlp", "--stepz", "3"],
        2,
        "zoo train: error: unrecognized arguments: --stepz 3; did you mean --steps? (see zoo train --help)",
    ),
    (["train", "mlp", "--optimizer", "adamz"], 2, "argument --optimizer: invalid choice: 'adamz'"),
    (["info"], 2, "zoo info: error: the following arguments are required: model (see zoo info --help)"),
    (["predict", "--help"], 0, "usage: zoo predict [-h]"),
    (["predict", "runs/x"], 2, "zoo predict: error: one of the arguments --input --text is required"),
    (["eval", "runs/x"], 2, "zoo eval: error: the following arguments are required: --data"),
    (["export", "runs/x", "--merge"], 2, "zoo export: error: the following arguments are required: --output"),
]

# One fresh process answers every case of USAGE_CASES in turn through `python -m zoo`'s own
# entry (runpy runs zoo/__main__.py for each, its exit caught), each case's stdout and stderr
# captured apart, and prints them as JSON; `-X importtime` lists every module the process
# imported, all the cases together. (One process, not one per case: what a process shows
# here, that no case imports jax, holds for each case if it holds for them all.)
_USAGE_PROCESS = """
import contextlib, io, json, runpy, sys
answers = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["zoo", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module('zoo', run_name='__main__')  # counted as a zoo process by the timeline
            code = 0
        except SystemExit as e:
            code = e.code
    answers.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def usage_answers() -> tuple[list[str], list[tuple[int, str, str]]]:
    """(the modules the process imported, (exit code, stdout, stderr) per case of USAGE_CASES)."""
    env = {k: v for k, v in os.environ.items() if k != "ZOO_RUNTIME_CHECKS"}
    argvs = json.dumps([args for args, _, _ in USAGE_CASES])
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _USAGE_PROCESS, argvs],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answers = json.loads(proc.stdout)
    # importtime writes to sys.stderr: the real one, or a case's while it ran.
    lines = [*proc.stderr.splitlines(), *(line for _, _, err in answers for line in err.splitlines())]
    imported = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")]
    cleaned = [
        (code, out, "\n".join(line for line in err.splitlines() if not line.startswith("import time:")))
        for code, out, err in answers
    ]
    return imported, cleaned


@pytest.mark.parametrize("case", range(len(USAGE_CASES)), ids=[" ".join(args) for args, _, _ in USAGE_CASES])
def test_help_and_usage_errors_answer_before_jax(case, usage_answers):
    """`--help` and argparse's usage errors come from the parser alone: a fresh process
    imports no jax (`-X importtime` lists every module it imports), so it answers at once.
    Nothing is timed here (a loaded machine's seconds say nothing of the code): what made it
    slow, importing jax, is what is checked. (ZOO_RUNTIME_CHECKS=1's import hook brings jax
    in: not set here.)"""
    args, code, expected = USAGE_CASES[case]
    imported, answers = usage_answers
    assert "zoo._cli._main" in imported, imported  # the check sees the imports
    assert not [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "equinox", "optax")], imported
    rc, out, err = answers[case]
    assert rc == code, (rc, err)
    assert expected in (out if code == 0 else err), (out, err)
    if code:
        one_line_error(rc, err, expected, code)


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "mlp", "--devices", "2", "--mesh", "data=4"], "needs 4 devices but only 2"),
        (["inspect", "mlp", "--devices", "2", "--mesh", "data4"], "write it as name=size"),
        (["inspect", "transformerx", "--devices", "2"], "unknown model 'transformerx'"),
        (["inspect", "mlp", "--devices", "2", "--rules", "zz"], "unknown --rules 'zz'"),
        (
            ["inspect", "mlp", "--devices", "2", "--batch-size", "6"],
            "not divisible by data-parallel size 2 x microbatches 4",
        ),
        (["inspect", "transformer", "--mesh", "data=8", "--rules", "tp"], "lacks 'model'"),
        (["info", "transformer", "--rules", "tp", "--mesh", "data=8"], "lacks 'model'"),
        (["info", "mlp", "--mesh", "data4"], "write it as name=size"),
        (["info", "transformer", "--lora", "r=4,beta=2"], "unknown key 'beta'"),
        (["train", "mlpx"], "unknown model 'mlpx'; choose one of ['mlp', 'transformer', 'encoder', 'minilm']"),
        (["train"], "no model given"),
        (["train", "mlp", "--mesh", "data=16"], "--mesh data=16 needs 16 devices but only 8"),
        (["train", "mlp", "--mesh", "data=two"], "bad --mesh 'data=two': write it as name=size"),
        (["train", "mlp", "--mesh", "model=8"], "has no 'data' axis"),
        (
            ["train", "mlp", "--batch-size", "36"],
            "--batch-size 36 is not divisible by data-parallel size 8 x microbatches 4 = 32",
        ),
        (["train", "mlp", "--rules", "tp"], "lacks 'model'; pass a mesh with them, e.g. --mesh data=4,model=2"),
        (["train", "mlp", "--steps", "0"], "--steps must be an integer >= 1"),
        (["train", "mlp", "--model-config", "width"], "is not key=value"),
        (["train", "transformer", "--data", "docstrings"], "transformer trains on code or prose"),
        (["train", "mlp", "--resume"], "--resume needs the earlier run's folder"),
        (["finetune", "mlp"], "the mlp has no pretrained weights to adapt"),
        (["finetune", "transformer"], "needs --init PATH"),
        (["finetune", "minilm", "--lora", "r=4,beta=2"], "unknown key 'beta'"),
        (["finetune", "minilm", "--model-config", "d_model=8"], "the pretrained minilm's shape is fixed"),
        (["finetune", "transformer", "--init", "/nonexistent/run"], "--init /nonexistent/run: no such folder"),
        (["train", "mlp", "--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
    ],
)
def test_bad_input_is_one_readable_line(args, message):
    rc, _, err = zoo_main(*args)
    one_line_error(rc, err, message)


def test_more_devices_than_a_started_backend_has_is_one_line():
    """In a process whose jax backend is already up (this one has 8 CPU devices, as a
    notebook or an accelerator host would have its own), more is one line. (A fresh
    process simulates as many CPU devices as asked: see the fresh-process test below.)"""
    rc, _, err = zoo_main("train", "mlp", "--devices", "99")
    one_line_error(rc, err, "asked for 99 devices but jax has 8 (cpu); pass --devices 8 or fewer")


def _start(args, folder: Path, name: str) -> subprocess.Popen:
    """`python -m zoo ARGS` in a fresh process, stdout/stderr to files (no pipe to fill)."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("XLA_FLAGS", None)  # a user's environment, not this process's
    with open(folder / f"{name}.out", "w") as out, open(folder / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "zoo", *map(str, args)], stdout=out, stderr=err, cwd=folder, env=env
        )


def _finish(procs: dict, timeout: float = 300) -> None:
    """Wait for every process (at most `timeout` s in all); kill and reap any left."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_errors_in_fresh_processes(tmp_path):
    """`python -m zoo` as a user runs it, a dozen mistakes at once (each fails before jax
    compiles anything): the exit code, exactly one line on stderr, no traceback; an
    unexpected error is exit 1 naming its type and --debug; `--debug` (before or after the
    command) shows the traceback instead; a fresh process simulates the devices asked for."""
    (tmp_path / "bad.toml").write_text("steps = 3\nbatch_sise = 4\n")
    (tmp_path / "a_file").write_text("")
    one_line = {  # name: (args, exit code, the line)
        "batch": (["train", "mlp", "--batch-size", "36"], 2,
                  ("zoo: error: --batch-size 36 is not divisible by data-parallel size 8 x microbatches 4 = 32; "
                   "use a multiple of 32, e.g. 32")),
        "flag": (["train", "mlp", "--stepz", "3"], 2,
                 "zoo train: error: unrecognized arguments: --stepz 3; did you mean --steps? (see zoo train --help)"),
        "model": (["train", "mlpx"], 2,
                  "zoo: error: unknown model 'mlpx'; choose one of ['mlp', 'transformer', 'encoder', 'minilm']"),
        "mesh": (["train", "mlp", "--mesh", "data4"], 2,
                 "zoo: error: bad --mesh 'data4': write it as name=size[,name=size], e.g. data=4,model=2"),
        "init": (["finetune", "transformer"], 2, "zoo: error: zoo finetune transformer needs --init PATH"),
        "config": (["train", "mlp", "--config", "bad.toml"], 2,
                   "zoo: error: --config bad.toml: unknown keys ['batch_sise'] for zoo train; valid keys: batch-size,"),
        "rules": (["inspect", "transformer", "--mesh", "data=8", "--rules", "tp"], 2,
                  ("zoo: error: --rules tp shards over mesh axes ['data', 'model'], but the mesh data=8 lacks 'model'; "
                   "pass a mesh with them, e.g. --mesh data=4,model=2")),
        "devices": (["train", "mlp", "--devices", "0"], 2, "zoo: error: --devices must be an integer >= 1, got 0"),
        "unexpected": (["train", "mlp", "--steps", "1", "--quiet", "--output", "a_file/run"], 1,
                       ("zoo: error: NotADirectoryError: [Errno 20] Not a directory: 'a_file/run' "
                        "(rerun with --debug for the traceback)")),
    }  # fmt: skip
    debug = {"debug_before": ["--debug", "train", "mlp", "--mesh", "data4"],
             "debug_after": ["train", "mlp", "--mesh", "data4", "--debug"]}  # fmt: skip
    # Fresh processes for a mistake found once jax has started (everything a process writes
    # to file descriptor 2 counts), the unexpected error, --debug's traceback (Python prints
    # it as the process ends) and the simulated devices; the other mistakes in this process
    # (the same entry, the same message): a process each cost seconds of jax's start and
    # showed nothing more.
    fresh = {"batch", "unexpected", "debug_before", "debug_after"}
    procs = {name: _start(args, tmp_path, name) for name, (args, _, _) in one_line.items() if name in fresh}
    procs |= {name: _start(args, tmp_path, name) for name, args in debug.items() if name in fresh}
    procs["info"] = _start(["info", "mlp", "--devices", "3", "--json"], tmp_path, "info")
    here = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        for name, args in [*((n, a) for n, (a, _, _) in one_line.items()), *debug.items()]:
            if name not in fresh:
                here[name] = zoo_main(*args)
    _finish(procs)

    def err(name):
        return here[name][2] if name in here else (tmp_path / f"{name}.err").read_text()

    def code(name):
        return here[name][0] if name in here else procs[name].returncode

    for name, (_args, want, line) in one_line.items():
        lines = err(name).strip().splitlines()
        assert code(name) == want and len(lines) == 1 and lines[0].startswith(line), (name, want, err(name))
    for name in debug:
        assert code(name) == 1, (name, err(name))
        text = err(name)
        assert text.startswith("Traceback (most recent call last):"), text
        assert text.strip().splitlines()[-1] == (
            "zoo._cli._common.CLIError: bad --mesh 'data4': write it as name=size[,name=size], e.g. data=4,model=2"
        ), text
    assert procs["info"].returncode == 0, err("info")
    info = json.loads((tmp_path / "info.out").read_text())
    assert info["devices"] == 3 and info["mesh"] == {"data": 3}


# Ctrl-C (exit 130, one line naming the saved step and the command that continues the run):
# tests/test_user_path.py's test_ctrl_c_saves_the_step_and_the_printed_command_continues_it, the
# one place it is tested (it also runs the command it names).


def test_bad_lora_is_one_readable_line():
    """A bad key or value names the accepted keys; a target matching nothing gets zoo's
    error, which lists the model's Linear layers. Exit 2, one line."""
    for lora, message in [
        ("r=4,beta=2", "unknown key 'beta'"),
        ("r=four", "r must be a positive integer"),
        ("r=4,targets=qproj", "match no Linear layer"),
    ]:
        rc, _, err = zoo_main("inspect", "transformer", "--lora", lora)
        one_line_error(rc, err, message)
        listed = "layers.layers.attention.q_proj" if "match no" in message else "keys: r, alpha, dropout, targets"
        assert listed in err, err


def test_resume_without_a_checkpoint_is_one_line(tmp_path):
    rc, _, err = zoo_main("train", "mlp", "--steps", "2", "--output", tmp_path / "none", "--resume")
    one_line_error(rc, err, "--resume: no checkpoint in")


# --- end to end (slow) --------------------------------------------------------------------------


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_demo_fine_tunes_minilm_end_to_end(tmp_path):
    """What `make demo` runs: LoRA on the pretrained MiniLM over 8 simulated devices, on
    the swapped-halves word-order task; the summary says the loss fell, LoRA beat the
    linear probe on the frozen encoder by 10 points or more (and says by how much), and
    the step had one all-reduce of the adapter's (and head's) bytes. peft opens the
    adapter as the classifier zoo trained (its README's recipe: the same logits). With the
    demo's defaults but one: the test set is evaluated before and after the 60 steps only
    (`--eval-every 60`), not also at steps 15, 30 and 45 (the curve's middle points, which
    nothing asserts; each a pass over the 687 test texts)."""
    import time

    out = tmp_path / "demo"
    start = time.perf_counter()
    proc = run_zoo("demo", "--eval-every", "60", "--output", str(out), timeout=900)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss fell: yes" in proc.stdout, proc.stdout
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"]["accuracy"] > summary["eval_before"]["accuracy"]
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"]
    assert "on swapped-halves" in proc.stdout and "classes: original, swapped" in proc.stdout
    # Why LoRA: word order is what mean-pooled sentence features leave out.
    margin = 100 * (summary["eval_after"]["accuracy"] - summary["probe"]["accuracy"])
    assert f"LoRA + head vs the linear probe: {margin:+.1f} points of test accuracy" in proc.stdout, proc.stdout
    assert margin >= 10, proc.stdout
    assert summary["collectives"]["gradient_reductions"] == 1
    assert summary["collectives"]["gradient_bytes"] - summary["trainable_bytes"] in (4, 8)
    for name in ("config.json", "metrics.jsonl", "loss.png", "summary.json"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    # The demo's classifier pools as BertForSequenceClassification: peft opens its SEQ_CLS adapter as the classifier
    # zoo trained. The recipe in adapter/README.md, run as written on held-out sentences, gives zoo's logits.
    import numpy as np

    import zoo

    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    (block,) = re.findall(r"```python\n(.*?)```", (out / "adapter" / "README.md").read_text(), re.S)
    texts = zoo.data.docstring_word_order("swap-halves").test_texts[:64]
    namespace = {}
    exec(compile(re.sub(r"(?m)^texts = .*$", f"texts = {texts!r}", block), "adapter/README.md", "exec"), namespace)
    base = zoo.hf.minilm_path()
    classifier, _ = zoo.lora.load_adapter(zoo.hf.load_bert_classifier(base, num_labels=2), out / "adapter")
    batch = zoo.hf.Tokenizer.from_pretrained(base)(texts, max_len=32)
    ours = np.asarray(classifier(batch["tokens"], mask=batch["mask"], token_types=batch.get("token_types")))
    theirs = namespace["logits"].numpy()
    diff = np.abs(ours - theirs).max()
    assert diff <= 1e-4 and (ours.argmax(-1) == theirs.argmax(-1)).all(), diff
    print(f"zoo demo took {seconds:.0f} s; peft's logits within {diff:.1e} of zoo's on {len(texts)} test sentences")


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_demo_exits_1_when_the_loss_does_not_fall(tmp_path):
    """A learning rate of 100 blows the loss up: the demo says so and exits 1. In this
    process (the exit code is the CLI entry's; the demo as a process of its own, with its
    defaults: test_demo_fine_tunes_minilm_end_to_end)."""
    out = tmp_path / "demo"
    flags = ["--steps", "2", "--lr", "100", "--batch-size", "16", "--microbatches", "2", "--eval-size", "32",
             "--probe", "0", "--seq-len", "16", "--quiet", "--output", out]  # fmt: skip
    rc, stdout, err = zoo_main("demo", *flags)
    assert rc == 1, (rc, stdout, err)
    assert "loss fell: NO" in stdout
    assert json.loads((out / "summary.json").read_text())["loss_fell"] is False


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_readme_example_runs():
    """examples/quickstart.py is the README's Python example, verbatim."""
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout


@pytest.mark.parametrize("command", ["train", "finetune", "demo"])
def test_every_run_flag_is_a_config_field_and_every_field_a_flag(command):
    """The flags of train/finetune/demo are the flat `RunConfig` fields
    (`RunConfig.flat_keys()`: DataConfig's and OptimizerConfig's inside), generated from
    their `zoo.train.Flag`s, plus only the documented launch flags (`CLI_ONLY`) and
    `zoo`'s own; `--lora` and `--quantize` are finetune's and demo's."""
    from zoo._cli._main import build_parsers
    from zoo._cli._train import CLI_ONLY
    from zoo.train import RunConfig

    parser = build_parsers()[1][command]
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    zoo_own = {"no_compile_cache", "keep_memory"}
    fields = set(RunConfig.flat_keys()) - ({"lora", "quantize"} if command == "train" else set())
    assert dests - set(CLI_ONLY) - zoo_own == fields
    assert set(CLI_ONLY) <= dests and not set(CLI_ONLY) & set(RunConfig.flat_keys())
    # Each field's flag is spelled from its flat key and carries its field's help.
    options = {s for a in parser._actions for s in a.option_strings}
    for flag in RunConfig.flags():
        assert flag.positional or command not in flag.commands or flag.option in options, flag
        assert flag.field.split(".")[0] in ("RunConfig", "DataConfig", "OptimizerConfig") and flag.help, flag
