"""`zoo train --flags`, `zoo train --config FILE` and `zoo.train.run(RunConfig(...))` are one
run: the same settings, the settings left out taking the same defaults (the model's, from
the registry, applied by `RunConfig.resolved`), give the same config.json, the same losses
and the same saved weights. A decoder, a classifier and a LoRA fine-tune, each a few steps
of a tiny model on 2 devices, in-process.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import zoo_ok

# The settings given, as flags; everything else (lr, weight decay, warmup, schedule,
# microbatches, seq_len, evaluation cadence, data, LoRA) is left to the defaults.
TINY_LM = {"d_model": 16, "num_layers": 1, "num_heads": 2}
CASES = {
    "decoder": ("train", "transformer", {"steps": 3, "batch_size": 8, "devices": 2, "eval_size": 8,
                                         "model_config": TINY_LM}),
    "classifier": ("train", "encoder", {"steps": 3, "batch_size": 8, "devices": 2, "eval_size": 8, "seq_len": 16,
                                        "model_config": TINY_LM | {"mlp_dim": 32}}),
    "lora": ("finetune", "transformer", {"steps": 3, "batch_size": 8, "devices": 2, "eval_size": 8, "seq_len": 16}),
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
    """The saved weights: the adapter (peft's layout) of a fine-tune, else model/."""
    from safetensors.numpy import load_file

    (file,) = [*(out / "adapter").glob("*.safetensors"), *(out / "model").glob("*.safetensors")]
    return load_file(file)


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
    assert len(losses["flags"]["train"]) == 3 and len(losses["flags"]["eval"]) == 4
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
