"""The `zoo` command: inspect and info (collectives, leaves), train / finetune / demo (outputs,
resume, config files); the demo end to end (slow). Its help and its mistakes (exit codes, one
line on stderr, `--debug`, fresh processes): tests/test_cli_errors.py.

Commands run in-process (`main([...])`): the pytest process already has 8 simulated CPU
devices (conftest) and shares jax's caches, which keeps each test to a tiny model's
compiles; the demo end to end is a process of its own, as `make demo` runs it.
"""

import functools
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import one_line_error, short_run_env, zoo_main
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


@functools.cache
def _mlp_dp_inspection() -> str:
    """`zoo inspect mlp --devices 8 --microbatches 4 --budget --json`'s output: one compiled
    step that the JSON test and the budget test (its JSON, the file it compares with) read."""
    return ok("inspect", "mlp", "--devices", "8", "--microbatches", "4", "--budget", "--json")


def test_inspect_json_reports_one_all_reduce_outside():
    out = json.loads(_mlp_dp_inspection())
    for key in ("model", "devices", "microbatches", "mesh", "param_bytes", "trainable_bytes", "collectives"):
        assert key in out
    assert out["mesh"] == {"data": 8} and out["devices"] == 8 and out["microbatches"] == 4
    (coll,) = out["collectives"]
    assert set(coll) >= {"kind", "in_loop", "bytes", "mesh_axes", "op_name"}
    assert coll["kind"] == "all-reduce" and coll["in_loop"] is False and coll["mesh_axes"] == ["data"]
    assert coll["bytes"] == out["trainable_bytes"] + 4
    assert out["summary"]["all_reduce_in_loop"] == 0 and out["summary"]["all_reduce_outside"] == 1


def test_inspect_checks_the_budget_and_compares_with_an_earlier_program(tmp_path, monkeypatch):
    out = _mlp_dp_inspection()
    dp = json.loads(out)
    assert dp["budget"] == {"name": "dp", "within": True, "breaches": []}
    (tmp_path / "dp.json").write_text(out)
    rc, out, _ = zoo_main("inspect", "mlp", "--devices", "8", "--budget", "--against", tmp_path / "dp.json")
    assert rc == 0, out
    assert re.search(r"collectives: within the dp budget \(1 all-reduce outside, [\d,]+ B\)", out), out
    assert f"against {tmp_path / 'dp.json'}:\nthe same collectives" in out
    # zero1 adds the gathers of the updated parameters: a diff, exit 1.
    rc, out, _ = zoo_main("inspect", "mlp", "--devices", "8", "--rules", "zero1", "--against", tmp_path / "dp.json")
    assert rc == 1 and "+ all-gather outside over data" in out, out
    # A file it cannot compare with is refused before the step is built and compiled.
    import zoo

    def compiled(*args, **kwargs):
        raise AssertionError("zoo inspect built the step before reading --against")

    monkeypatch.setattr(zoo.train, "inspect", compiled)
    rc, _, err = zoo_main("inspect", "mlp", "--devices", "8", "--against", tmp_path / "missing.json")
    assert rc == 2 and "--against" in err and "zoo inspect --json" in err
    (tmp_path / "empty.json").write_text("{}")
    rc, _, err = zoo_main("inspect", "mlp", "--devices", "8", "--against", tmp_path / "empty.json")
    assert rc == 2 and "it holds no collectives" in err, err


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
    # As the run's header says: the model's bytes before LoRA, each layer's q and v counted.
    assert out["model_bytes"] == out["param_bytes"] - lora_bytes and out["lora_layers"] == 2 * 2
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
    out = info_json("transformer", *SMALL_LM)
    leaves, totals = out["leaves"], out["totals"]
    assert leaves and totals["leaves"] == len(leaves)
    assert sum(leaf["bytes"] for leaf in leaves) == totals["bytes"] > 0
    assert sum(leaf["parameters"] for leaf in leaves) == totals["parameters"]
    for leaf in leaves:
        assert len(leaf["logical_axes"]) == len(leaf["shape"]) == len(leaf["spec"]), leaf
        assert leaf["bytes"] == math.prod(leaf["shape"]) * 4 and leaf["dtype"] == "float32"
    assert all(leaf["trainable"] for leaf in leaves) and totals["trainable_bytes"] == totals["bytes"]
    assert totals["bytes_per_device"] == totals["bytes"]  # dp: everything replicated

    tp = info_json("transformer", *SMALL_LM, "--rules", "tp", "--mesh", "data=4,model=2")
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

# A tiny mlp run: 8 devices x 2 microbatches, batch 32, checkpoints every 3 steps. Its
# learning rate constant after the warmup (1 step at 6 steps and at 8): the run resumed to
# 8 steps, and the run without the evaluation before, run the step it compiled (a cosine
# schedule's end is the run's last step, another program for each length).
MLP_RUN = ["--steps", "6", "--batch-size", "32", "--microbatches", "2", "--eval-size", "64", "--schedule", "constant"]
MLP_FLAGS = [*MLP_RUN, "--checkpoint-every", "3", "--quiet"]


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


def test_resume_of_a_folder_without_a_run_says_so(tmp_path):
    """--resume with an --output holding no run: the folder is named, and how to start one
    (not "no model given", which asks for what was given)."""
    for out, why in ((tmp_path / "none", "no such folder"), (tmp_path, "no config.json in it")):
        rc, _, err = zoo_main("finetune", "--output", out, "--resume", "--steps", "10")
        one_line_error(rc, err, f"--resume: --output {out} holds no run to resume ({why})")
        assert "['transformer', 'encoder', 'minilm'] as MODEL, without --resume" in err


def test_each_commands_help_offers_the_models_it_takes():
    """A command's help offers only the models it takes (`zoo finetune mlp` is refused).
    (`zoo --version`: test_cli_errors.py's usage cases, a fresh process without jax.)"""
    helps = {c: " ".join(zoo_main(c, "--help")[1].split()) for c in ("train", "finetune", "demo")}
    assert "model: mlp (a 4-layer MLP regressor), transformer (" in helps["train"]
    assert "model: transformer (" in helps["finetune"] and "mlp (" not in helps["finetune"]
    assert "teacher (mlp" not in helps["finetune"] and "encoder (" not in helps["demo"]
    rc, _, err = zoo_main("finetune", "mlp")
    one_line_error(rc, err, "zoo finetune does not take 'mlp'")


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


def test_no_eval_before_starts_training_at_once_and_judges_nothing(tmp_path, monkeypatch):
    """`--no-eval-before` (transformers' default, its `eval_on_start=False`): no evaluation
    before the first step (no step-0 row, no `eval_before`, no first stage), the
    evaluations after steps as usual; `loss_fell` is None and the report says it was not
    judged, and the demo, which exits 1 when the loss did not fall, then exits 0. The
    linear probe is fitted on the evaluation before training: `--probe` is refused
    without it."""
    out = tmp_path / "mlp"
    # mlp_run's shapes, steps and schedule: its compiled programs run.
    text = ok("train", "mlp", *MLP_RUN, "--no-eval-before", "--output", out)
    assert "loss fell: not judged (no evaluation before training: --no-eval-before; held-out loss" in text, text
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_before"] is None and summary["loss_fell"] is None
    assert [stage["name"] for stage in summary["stages"]] == ["trained after 6 steps"]
    assert json.loads((out / "config.json").read_text())["eval_before"] is False

    import types

    import zoo._cli._train as train_cli

    verdicts = iter([None, False])
    monkeypatch.setattr(
        train_cli, "execute", lambda *a, **k: types.SimpleNamespace(summary={"loss_fell": next(verdicts)})
    )
    assert zoo_main("demo", "minilm", "--no-eval-before", "--steps", "1")[0] == 0
    assert zoo_main("demo", "minilm", "--steps", "1")[0] == 1

    rc, _, err = zoo_main("train", "mlp", "--probe", "5", "--no-eval-before", "--output", tmp_path / "probe")
    one_line_error(rc, err, "--eval-before=False leaves out: drop --probe, or evaluate before training (--eval-before)")


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
        (
            "steps = 3\nbatch_sise = 4\n",
            "unknown keys ['batch_sise'] for zoo train (did you mean 'batch_sise' -> "
            "'batch-size'?); valid keys: batch-size,",
        ),
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


# --- end to end (slow) --------------------------------------------------------------------------


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_demo_fine_tunes_minilm_end_to_end(tmp_path):
    """What `make demo` runs: LoRA on the pretrained MiniLM over 8 simulated devices, on
    the swapped-halves word-order task; the summary says the loss fell, LoRA beat the
    linear probe on the frozen encoder by 10 points or more (and says by how much), and
    the step had one all-reduce of the adapter's (and head's) bytes. peft opens the
    adapter as the classifier zoo trained (its README's recipe: the same logits). With the
    demo's defaults but two: 40 LoRA steps instead of 60 (measured, `zoo demo` alone: 20
    steps +8.0 points over the probe, 25 +26.3, 30 +33.2, 40 +34.8, 60 +33.5; the probe
    and the data as the demo's), and the test set evaluated before and after them only
    (`--eval-every 40`), not also between (the curve's middle points, which nothing
    asserts; each a pass over the 687 test texts)."""

    out = tmp_path / "demo"
    start = time.perf_counter()
    proc = run_zoo("demo", "--steps", "40", "--eval-every", "40", "--output", str(out), timeout=900)
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
    """examples/quickstart.py is the README's Python example, verbatim. Compiled as the tests
    compile (`helpers.short_run_env`: LLVM's optimisation off; XLA's passes, which place the
    collectives it prints, unchanged): its time is compiling (12.3 -> 9.4 CPU s, measured)."""
    proc = subprocess.run([sys.executable, "examples/quickstart.py"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=short_run_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "all-reduces: 0 inside loops, 1 outside" in proc.stdout


def test_the_verdict_shows_two_values_it_found_different_as_different():
    """`loss fell: yes (held-out loss 0.6931 -> 0.6931)` said a DPO run's loss fell while
    showing it equal: the values get the decimals (up to 8) that tell them apart."""
    from zoo.train._console import _apart

    assert _apart(1.23456, 0.5) == "1.2346 -> 0.5000"
    assert _apart(0.69314718, 0.69312345) == "0.69315 -> 0.69312"
    assert _apart(0.5, 0.5) == "0.5000 -> 0.5000"
    assert _apart(0.1234567891, 0.1234567890) == "0.12345679 -> 0.12345679"  # 8 at most


def test_the_report_says_one_step_row_device_in_the_singular_and_only_the_evaluations_it_makes(tmp_path):
    """A run of 1 step on 1 device in 1 microbatch said "1 steps", "1 simulated CPU
    devices", "1 microbatches" (and a 1-row data file "1 rows"): a count of 1 takes the
    singular, every other count the plural. `zoo demo --steps 12` said "evaluating every
    15" (the demo's --eval-every) of a run no multiple of 15 reaches: the header names the
    interval only when some step between the first and the last evaluates, else the
    evaluation after the last step. (One run for both: each is a compiled mlp of its own.)"""
    import numpy as np

    from zoo.data import Dataset, describe
    from zoo.train._console import _cadence

    text = ok("train", "mlp", "--steps", "1", "--eval-every", "15", "--devices", "1", "--batch-size", "8",
              "--microbatches", "1", "--eval-size", "8", "--output", tmp_path / "mlp")  # fmt: skip
    assert "devices: 1 simulated CPU device," in text and "in 1 microbatch," in text, text
    assert "trained after 1 step " in text and ", 1 step " in text, text
    # A count of 1 in the plural; not the rate "(301.1 examples/s)", which failed the test by chance.
    assert not re.search(r"(?<![\d.])1 (steps|devices|microbatches|rows|examples)\b", text), text
    ones = {k: np.ones((1, 4), np.int32) for k in ("tokens", "mask", "weights", "segment_ids", "positions")}
    assert describe(Dataset(ones, "text")).startswith("text: 1 row, 4 target tokens,")
    assert "training step 1, evaluating after the last step..." in text, text
    assert [r["step"] for r in read_jsonl(tmp_path / "mlp" / "metrics.jsonl") if r["kind"] == "eval"] == [0, 1]
    assert _cadence(15, 0, 60) == "evaluating every 15 steps"  # the demo's own 60 steps: after 15, 30, 45, 60
    assert _cadence(15, 50, 60) == "evaluating after the last step"  # resumed past the last multiple
    assert _cadence(1, 0, 6) == "evaluating after every step"
    assert _cadence(0, 0, 6) == "evaluating after the last step"  # --eval-every 0: before and after only
