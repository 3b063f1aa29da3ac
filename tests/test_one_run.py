"""`zoo train --flags`, `zoo train --config FILE` and `zoo.train.run(RunConfig(...))` are one
run: the same settings, the settings left out taking the same defaults (the model's, from
the registry, applied by `RunConfig.resolved`), give the same config.json, the same losses
and the same saved weights. A decoder, a classifier and a LoRA fine-tune, each two steps
of a tiny model on 2 devices (a warmup step and one after it), in-process.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error, zoo_main, zoo_ok
from tiny_runs import TINY_MLP

# The settings given, as flags; everything else (lr, weight decay, warmup, schedule,
# microbatches, seq_len, evaluation cadence, data, LoRA) is left to the defaults.
TINY_LM = {"d_model": 16, "num_layers": 1, "num_heads": 2}
CASES = {
    "decoder": ("train", "transformer", {"steps": 2, "batch_size": 8, "devices": 2, "eval_size": 8,
                                         "model_config": TINY_LM, "sample_tokens": 0}),
    "classifier": ("train", "encoder", {"steps": 2, "batch_size": 8, "devices": 2, "eval_size": 8, "seq_len": 16,
                                        "model_config": TINY_LM | {"mlp_dim": 32}}),
    "lora": ("finetune", "transformer", {"steps": 2, "batch_size": 8, "devices": 2, "eval_size": 8, "seq_len": 16,
                                        "sample_tokens": 0}),
}  # fmt: skip


@pytest.fixture(scope="module")
def gpt_folder(tmp_path_factory) -> Path:
    """A tiny random GPT-2 folder, as `zoo train transformer` leaves in its model/: the
    base the LoRA case fine-tunes (`--init`)."""
    import jax

    import zoo
    from zoo.train._task import init_compiled

    config = zoo.models.TransformerConfig(vocab_size=256, d_model=32, num_heads=4, num_layers=1, max_len=16)
    gpt = init_compiled(("gpt", config), lambda k: zoo.models.Transformer(config, key=k), jax.random.key(0))
    folder = tmp_path_factory.mktemp("base")
    zoo.hf.save_pretrained(gpt, folder)
    return folder


def _settings(case: str, gpt_folder: Path) -> tuple[str, str, dict]:
    command, model, settings = CASES[case]
    return command, model, settings | ({"init": str(gpt_folder)} if case == "lora" else {})


def _text(value) -> str:
    return ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def _with_flags(command: str, model: str, settings: dict, out: Path) -> None:
    flags = [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", _text(v))]
    zoo_ok(command, model, *flags, "--quiet", "--output", out)


def _with_file(command: str, model: str, settings: dict, out: Path) -> None:
    lines = [f"model = {json.dumps(model)}", "quiet = true", f"output = {json.dumps(str(out))}"]
    for key, value in settings.items():  # a table for --model-config, as a user would write it
        toml = "{" + ", ".join(f"{k} = {v}" for k, v in value.items()) + "}" if isinstance(value, dict) else None
        lines.append(f"{key.replace('_', '-')} = {toml or json.dumps(value)}")
    path = out.parent / f"{out.name}.toml"
    path.write_text("\n".join(lines) + "\n")
    zoo_ok(command, "--config", path)


def _with_library(command: str, model: str, settings: dict, out: Path) -> None:
    import zoo
    from zoo.train import DataConfig, RunConfig

    s = dict(settings)
    data = DataConfig(eval_size=s.pop("eval_size"), seq_len=s.pop("seq_len", None))
    zoo.train.run(RunConfig(model=model, data=data, quiet=True, output=str(out), **s), command=command)


def _losses(out: Path) -> dict[str, list[tuple[int, float]]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "train": [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"],
        "eval": [(r["step"], r["eval_loss"]) for r in rows if r["kind"] == "eval"],
    }


def _weights(out: Path) -> dict[str, np.ndarray]:
    """The saved weights: the adapter (peft's layout) of a fine-tune, else model/ (a
    classifier's head file beside them included)."""
    from safetensors.numpy import load_file

    files = sorted([*(out / "adapter").glob("*.safetensors"), *(out / "model").glob("*.safetensors")])
    assert files, f"no weights saved in {out}"
    return {f"{file.name}:{name}": value for file in files for name, value in load_file(file).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_flags_config_file_and_library_are_one_run(case, gpt_folder, tmp_path):
    command, model, settings = _settings(case, gpt_folder)
    outs = {how: tmp_path / how for how in ("flags", "file", "library")}
    _with_flags(command, model, settings, outs["flags"])
    _with_file(command, model, settings, outs["file"])
    _with_library(command, model, settings, outs["library"])

    configs = {how: json.loads((out / "config.json").read_text()) for how, out in outs.items()}
    for config in configs.values():
        config.pop("output")
    assert configs["file"] == configs["flags"] and configs["library"] == configs["flags"]
    # The defaults were applied, the same ones: the model's for the command.
    flags = configs["flags"]
    spec_defaults = __import__("zoo").train.model_spec(model).defaults_for(command)
    assert flags["lr"] == spec_defaults["lr"] and flags["microbatches"] == spec_defaults["microbatches"]
    assert flags["weight_decay"] == spec_defaults["weight_decay"] and flags["warmup"] == 1 and flags["eval_every"] == 1
    assert ("lora" in flags) == (command == "finetune")

    losses = {how: _losses(out) for how, out in outs.items()}
    assert len(losses["flags"]["train"]) == 2 and len(losses["flags"]["eval"]) == 3
    assert losses["file"] == losses["flags"] and losses["library"] == losses["flags"]
    weights = {how: _weights(out) for how, out in outs.items()}
    assert weights["flags"]
    for how in ("file", "library"):
        assert weights[how].keys() == weights["flags"].keys()
        for name, value in weights["flags"].items():
            np.testing.assert_array_equal(weights[how][name], value, err_msg=f"{how}: {name}")


def test_no_flags_and_an_empty_config_resolve_alike():
    """`zoo COMMAND MODEL` without flags and `RunConfig(model=MODEL).resolved(COMMAND)`:
    every setting the same (the CLI's resolution without running, as test_cli's)."""
    from zoo._cli._main import build_parsers
    from zoo._cli._train import resolve
    from zoo.train import RunConfig

    parser, _ = build_parsers()
    for command, model in (("train", "transformer"), ("train", "mlp"), ("finetune", "minilm"), ("demo", "minilm")):
        resolved = RunConfig(model=model).resolved(command)
        assert resolved.resolved(command) == resolved  # nothing left unset
        library = resolved.to_dict()
        cli = resolve(parser.parse_args([command, model]), command)
        assert {k: cli[k] for k in library} == library


# --- the checks and --resume: the library's, the CLI only parses ---------------------------------

# A tiny mlp run on 2 devices, as flags and as `RunConfig` fields.
MLP = {"devices": 2, "batch_size": 8, "microbatches": 1, "quiet": True}
MLP_FLAGS = ["--devices", "2", "--batch-size", "8", "--microbatches", "1", "--quiet"]


@pytest.fixture(scope="module")
def saved_run(finished_mlp_run) -> Path:
    """A finished 4-step mlp run on `MLP_FLAGS` (eval size 16), checkpoints at 2 and 4, lr,
    seed and model config not the defaults: what a resume continues (conftest's
    `finished_mlp_run`, shared with test_bad_inputs.py; tests copy it, never change it)."""
    assert [*MLP_FLAGS[:-1], "--eval-size", "16", "--quiet"] == TINY_MLP
    return finished_mlp_run


def _library_error(command: str, **fields) -> str:
    """The message of the `ConfigError` `zoo.train.run(RunConfig(**fields))` raises."""
    import zoo

    with pytest.raises(zoo.train.ConfigError) as e:
        zoo.train.run(zoo.train.RunConfig(**fields), command=command)
    return str(e.value)


def _cli_error(*args) -> str:
    """The one line `zoo ARGS` fails with (exit 2), without its `zoo: error: ` prefix."""
    rc, _, err = zoo_main(*args)
    one_line_error(rc, err, "zoo: error: ")
    return err.strip().removeprefix("zoo: error: ")


def _refusals(run: Path) -> list[tuple[str, dict, list, str]]:
    """(command, `RunConfig` fields, the same as flags, a field the library's message
    names) of each mistake, the library's way and the CLI's."""
    from zoo.train import OptimizerConfig

    resume = {"output": str(run), "resume": True, "steps": 6}
    resume_flags = ["--output", run, "--resume", "--steps", "6"]
    return [
        ("train", {"model": "mlp", **resume, "seed": 1, "optimizer": OptimizerConfig(lr=0.1),
                   "model_config": {"width": 32, "depth": 2}},
         ["mlp", *resume_flags, "--seed", "1", "--lr", "0.1", "--model-config", "width=32,depth=2"],
         "OptimizerConfig.lr 0.1 (was 0.01)"),
        ("finetune", {"model": "transformer"}, ["transformer"], "needs RunConfig.init PATH"),
        ("train", {"model": "mlp", "dtype": "bfloat16"}, ["mlp", "--dtype", "bfloat16"], "RunConfig.dtype"),
        ("train", {"model": "mlp", "init": str(run)}, ["mlp", "--init", run], "RunConfig.init"),
        ("train", {"model": "mlp", "model_config": {"width": 0}}, ["mlp", "--model-config", "width=0"],
         "RunConfig.model_config width=0"),
        ("finetune", {"model": "minilm", "model_config": {"d_model": 8}}, ["minilm", "--model-config", "d_model=8"],
         "RunConfig.model_config: the pretrained minilm's shape is fixed"),
        ("train", {"model": "mlp", "resume": True}, ["mlp", "--resume"], "RunConfig.resume needs"),
    ]  # fmt: skip


def test_the_library_refuses_what_the_cli_refuses_in_the_same_words(saved_run):
    """Each check is the library's: `zoo.train.run` raises a `ConfigError` naming fields,
    and `zoo COMMAND` prints that message with the fields as flags (`flag_names`, the one
    mapping), nothing else. The refused resume leaves the saved run as it was."""
    from zoo._cli._common import flag_names

    before = (saved_run / "config.json").read_text()
    for command, fields, flags, field in _refusals(saved_run):
        library = _library_error(command, **fields)
        assert field in library, library
        assert _cli_error(command, *flags) == flag_names(library)
    resumed = flag_names(_library_error("train", **_refusals(saved_run)[0][1]))
    assert resumed.startswith("--resume: --lr 0.1 (was 0.01), --model-config width=32,depth=2 (was width=16,depth=2), "
                              "--seed 1 (was 3) would change the run saved in")  # fmt: skip
    assert (saved_run / "config.json").read_text() == before


def test_a_library_resume_inherits_what_zoo_train_resume_does(saved_run, tmp_path, monkeypatch):
    """`RunConfig(output=RUN, resume=True, steps=6)` and `zoo train --output RUN --resume
    --steps 6`, neither naming the model, lr, seed or model config: both continue the saved
    run with its own settings, into the same config.json and the same losses. Each resolves
    its config once (the run's plan; the CLI only parses)."""
    import shutil

    import zoo

    resolutions = []
    resolved = zoo.train.RunConfig.resolved
    monkeypatch.setattr(zoo.train.RunConfig, "resolved", lambda self, *a: resolutions.append(a) or resolved(self, *a))
    outs = {how: shutil.copytree(saved_run, tmp_path / how) for how in ("flags", "library")}
    zoo_ok("train", "--output", outs["flags"], "--resume", "--steps", "6", "--devices", "2")
    assert len(resolutions) == 1, resolutions
    zoo.train.run(zoo.train.RunConfig(output=str(outs["library"]), resume=True, steps=6, devices=2))
    assert len(resolutions) == 2, resolutions
    configs = {how: json.loads((out / "config.json").read_text()) for how, out in outs.items()}
    for config in configs.values():
        config.pop("output")
    assert configs["library"] == configs["flags"]
    flags = configs["flags"]
    assert (flags["model"], flags["lr"], flags["seed"], flags["model_config"]) == ("mlp", 0.01, 3, "width=16,depth=2")
    assert (flags["steps"], flags["quiet"], flags["resume"]) == (6, True, True)
    losses = {how: _losses(out) for how, out in outs.items()}
    assert [s for s, _ in losses["flags"]["train"]] == [1, 2, 3, 4, 5, 6]
    assert losses["library"] == losses["flags"]


def test_a_local_init_is_saved_absolute_and_a_relative_one_still_resumes(llama_dir, tmp_path, monkeypatch):
    """`--init ./llama` is saved as the folder's absolute path (as the data file's), so the
    run's base is found from any working folder (`zoo generate RUN`, `--resume`); a Hub id
    stays as given. A run saved with the relative form (before) resumes from where it ran,
    its init unchanged, and a different init is still refused."""
    import shutil

    import zoo

    monkeypatch.chdir(tmp_path)
    shutil.copytree(llama_dir, "base")
    config = zoo.train.RunConfig(model="transformer", init="./base", output="run").resolved("finetune")
    assert config.init == str(tmp_path / "base")
    assert zoo.train.RunConfig(model="transformer", init="org/name").resolved("finetune").init == "org/name"
    saved = config.to_dict() | {"init": "./base"}  # as runs saved it before
    Path("run").mkdir()
    Path("run/config.json").write_text(json.dumps(saved))
    resumed = zoo.train.RunConfig(output="run", resume=True).resolved("finetune")
    assert resumed.init == str(tmp_path / "base")
    assert zoo.train.RunConfig(output="run", resume=True, init=str(tmp_path / "base")).resolved("finetune")
    shutil.copytree("base", "other")
    with pytest.raises(zoo.train.ConfigError, match="would change the run saved in"):
        zoo.train.RunConfig(output="run", resume=True, init="other").resolved("finetune")
