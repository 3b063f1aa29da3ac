"""Bad flags, numbers and config files for `zoo train` (docs/reliability.md): each is one
line naming the fix, before any work (zoo._cli's parsing, zoo.train's config checks, the
rules and mesh checks, sizes against the host's memory). All in-process (`helpers.zoo_main`).
"""

from pathlib import Path

import pytest
from helpers import one_line_error, zoo_main
from tiny_runs import TINY_MLP

# A tiny mlp run on 2 devices: 3 steps of batch 8, no microbatching (tiny_runs.TINY_MLP's shapes).
TINY = [*TINY_MLP, "--steps", "3"]


# --- numbers checked before any work -----------------------------------------------------------

# (flags after `zoo train mlp`, the one line's text). Each fails before devices start.
BAD_NUMBERS = [
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0, got -1.0"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
    (["--clip", "-1"], "--clip must be a finite number >= 0, got -1.0"),
    (["--clip", "nan"], "--clip must be a finite number >= 0, got nan"),
    (["--clip", "inf"], "--clip must be a finite number >= 0, got inf"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--steps", "-3"], "--steps must be an integer >= 1, got -3"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--microbatches", "0"], "--microbatches must be an integer >= 1, got 0"),
    (["--keep", "0"], "--keep must be an integer >= 1, got 0"),
    (["--eval-every", "-1"], "--eval-every must be an integer >= 0, got -1"),
    (["--checkpoint-every", "-2"], "--checkpoint-every must be an integer >= 0, got -2"),
    (["--warmup", "5", "--steps", "5"], "--warmup 5 must be below the run's 5 steps"),
    (["--num-processes", "0"], "--num-processes must be an integer >= 1, got 0"),
    (["--process-id", "-1"], "--process-id must be an integer >= 0, got -1"),
    (["--devices", "0"], "--devices must be an integer >= 1, got 0"),
    (["--model-config", "width=0"], "--model-config width=0: width must be an integer >= 1, e.g. width=64"),
    (["--model-config", "width=abc"], "--model-config width=abc: width must be an integer >= 1"),
    (["--model-config", "depth=-5"], "--model-config depth=-5: depth must be an integer >= 1"),
    (["--model-config", "width=2.5"], "--model-config width=2.5: width must be an integer >= 1"),
    (["--model-config", "width=true"], "--model-config width=True: width must be an integer >= 1"),
    (["--model-config", "width=64,width=32"], "key 'width' appears twice"),
    (["--model-config", "width=1000000000000"], "--model-config width=1000000000000: width must be at most 2147483647"),
    # Huge integers: an OverflowError or MemoryError ("58 TiB") before; silently process 0 before.
    (["--seed", str(2**64)], "--seed must be below 2**32 (at most 4294967295"),
    (["--seed", str(2**32)], "--seed must be below 2**32"),
    (["--steps", str(10**12)], "--steps must be at most 2147483647 (2**31 - 1: compiled programs count in int32)"),
    (["--batch-size", str(10**12)], "--batch-size must be at most 2147483647"),
    (
        ["--eval-size", str(10**12)],
        "--eval-size must be at most 2147483647 (2**31 - 1: compiled programs count in int32), got 1000000000000",
    ),
    (["--checkpoint-every", str(2**70)], "--checkpoint-every must be at most 2147483647"),
    (["--num-processes", "1", "--process-id", "1"], "--process-id 1 is not below --num-processes 1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
]


@pytest.mark.parametrize("flags, message", BAD_NUMBERS, ids=[" ".join(f) for f, _ in BAD_NUMBERS])
def test_bad_numbers_are_one_line_before_any_work(tmp_path, flags, message):
    rc, out, err = zoo_main("train", "mlp", *flags, "--output", tmp_path / "run")
    one_line_error(rc, err, message)
    assert not (tmp_path / "run").exists() and out == ""


BAD_TRANSFORMER_CONFIGS = [
    ("dropout=1.5", "dropout is a probability in [0, 1)"),
    ("dropout=nan", "dropout must be a finite number"),
    ("attention_dropout=-0.1", "attention_dropout is a probability in [0, 1)"),
    ("d_model=0", "d_model must be an integer >= 1"),
    ("num_heads=two", "num_heads must be an integer >= 1"),
    ("norm_eps=0", "norm_eps must be > 0"),
    ("init_std=inf", "init_std must be a finite number"),
    ("max_len=-1", "max_len must be an integer >= 1"),
]


@pytest.mark.parametrize("config, message", BAD_TRANSFORMER_CONFIGS, ids=[c for c, _ in BAD_TRANSFORMER_CONFIGS])
def test_bad_model_config_values_name_the_key(config, message):
    rc, _, err = zoo_main("train", "transformer", "--devices", "2", "--model-config", config)
    one_line_error(rc, err, f"--model-config {config.split('=')[0]}=")
    assert message in err, err


def test_bad_numbers_in_a_config_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"model": "mlp", "lr": NaN}')  # Python's json reads NaN
    rc, _, err = zoo_main("train", "--config", path)
    one_line_error(rc, err, "--lr must be a finite number > 0, got nan")


def test_rows_beyond_the_hosts_memory_are_one_line(tmp_path, monkeypatch):
    """A batch or held-out set that cannot fit is refused before it is drawn (a MemoryError
    naming terabytes before); the machine's memory is set small so the sizes stay small."""
    monkeypatch.setattr("zoo.train._build.host_memory", lambda: 2**20)
    flags = ["--devices", "2", "--steps", "3", "--microbatches", "1", "--quiet", "--output", tmp_path / "run"]
    rc, _, err = zoo_main("train", "mlp", *flags, "--batch-size", str(2**16))
    one_line_error(rc, err, "--batch-size 65536 makes one batch of")
    assert "more than this machine's 1.0 MB of memory; lower it (at most about" in err
    rc, _, err = zoo_main("train", "mlp", *flags, "--batch-size", "8", "--eval-size", str(2**20))
    one_line_error(rc, err, "--eval-size 1048576 makes the held-out set of 4.2 MB")
    assert not (tmp_path / "run").exists()


# --- strict rules, meshes, config files ------------------------------------------------------

BAD_RULES = [
    (dict(embedd="data"), ValueError, "'embedd' is not a logical axis of the zoo's modules; did you mean 'embed'?"),
    (dict(colour=None), ValueError, "add it to the dict: rules = zoo.rules('dp'); rules['colour'] = ..."),
    (dict(embed=123), TypeError, "a rule maps a logical axis to a mesh axis name (embed='data')"),
    (dict(embed=""), TypeError, "got str ''"),
    (dict(embed=("data", "data")), TypeError, "a tuple of distinct names"),
    (dict(mlp=("data", 2)), TypeError, "got tuple ('data', 2)"),
    (dict(heads=True), TypeError, "got bool True"),
]


@pytest.mark.parametrize("overrides, kind, message", BAD_RULES, ids=[str(o) for o, _, _ in BAD_RULES])
def test_bad_rule_overrides_name_the_fix(overrides, kind, message):
    import zoo

    with pytest.raises(kind) as e:
        zoo.rules("dp", **overrides)
    assert message in str(e.value)


def test_good_rule_overrides_and_own_axes():
    import zoo

    r = zoo.rules("dp", mlp=["data"], embed=None)
    assert r["mlp"] == ("data",) and r["embed"] is None
    r["my_axis"] = "data"  # a logical axis of the user's own modules: added to the dict
    assert zoo.rules("dp")["batch"] == "data"


BAD_LAYOUTS = [
    (
        ["--mesh", "data=4,foo=2"],
        "--mesh data=4,foo=2: no rule of --rules dp uses mesh axes ['foo'], so their "
        "devices would repeat the same work; drop them or give them size 1 (e.g. --mesh data=4)",
    ),
    (["--mesh", "data=2,model=4"], "no rule of --rules dp uses mesh axes ['model']"),
    (["--mesh", "data=2,model=2,x=2", "--rules", "tp"], "no rule of --rules tp uses mesh axes ['x']"),
    # ep for a model without experts: that first, not the mesh (tests/test_moe.py: a mixture
    # of experts hears which axes ep uses).
    (
        ["--mesh", "data=1,expert=2", "--rules", "ep"],
        "the mlp has no experts (num_experts): there are none to place; use dp, fsdp or tp (e.g. --rules fsdp)",
    ),
]


@pytest.mark.parametrize("flags, message", BAD_LAYOUTS, ids=[" ".join(f) for f, _ in BAD_LAYOUTS])
def test_idle_mesh_axes_are_refused(flags, message):
    rc, _, err = zoo_main("train", "mlp", "--devices", "8", *flags)
    one_line_error(rc, err, message)


# Rules that cannot place the model: the fix is a flag (the library's "map 'embed' to None" is none).
UNPLACEABLE = [
    (["mlp", "--rules", "fsdp"], "--rules fsdp cannot place the mlp on this mesh: model.output_layer.weight: "
     "dimension 1 ('embed') has size 1, which mesh axes ('data',) (size 2) do not divide; choose other --rules "
     "(dp replicates every weight)"),
    (["transformer", "--rules", "fsdp", "--model-config", "d_model=33,num_heads=3"], "has size 33, which mesh "
     "axes ('data',) (size 2) do not divide; choose other --rules (dp replicates every weight), or set "
     "--model-config d_model to a multiple of 2"),
]  # fmt: skip


@pytest.mark.parametrize("flags, message", UNPLACEABLE, ids=[" ".join(f) for f, _ in UNPLACEABLE])
def test_rules_that_cannot_place_the_model_name_the_flag_that_would(tmp_path, flags, message):
    rc, _, err = zoo_main("train", *flags, *TINY, "--output", tmp_path / "run")
    one_line_error(rc, err, message)
    assert "None" not in err


def test_four_bit_scales_that_fsdp_cannot_split_name_a_block_not_a_model_size(tmp_path, llama_dir, data_files):
    """NF4 in blocks of 16 of the tiny Llama's 32 inputs: 2 scale rows, which 4 devices do not
    divide. The fix named was `--model-config num_layers` (2 layers: the same number by
    chance), which changes nothing; the block that fits is the fix."""
    rc, _, err = zoo_main("finetune", "transformer", "--init", llama_dir, "--data", data_files["text"],
                          "--seq-len", "16", "--steps", "1", "--quantize", "nf4:16", "--rules", "fsdp",
                          "--devices", "4", "--output", tmp_path / "run")  # fmt: skip
    one_line_error(rc, err, "(the 4-bit scales' blocks of inputs, 32 inputs in blocks of 16); choose other --rules")
    assert err.strip().endswith("or --quantize nf4:8") and "num_layers" not in err, err


def test_heads_a_tp_mesh_cannot_split_name_flags_not_library_calls(tmp_path, llama_dir, data_files):
    """4 heads on a model axis of 3: the fix named was the library's (`zoo.rules('fsdp')`,
    `rules['heads'] = None`), after the folder twice ("--init DIR: DIR: ...")."""
    rc, _, err = zoo_main("finetune", "transformer", "--init", llama_dir, "--data", data_files["text"],
                          "--rules", "tp", "--mesh", "data=1,model=3", "--devices", "3",
                          "--output", tmp_path / "run")  # fmt: skip
    one_line_error(rc, err, f"--rules cannot place {llama_dir} on this mesh: the model has 4 attention heads")
    assert err.strip().endswith("choose other --rules (dp replicates every weight), or a --mesh whose axis that "
                                "splits heads divides 4"), err  # fmt: skip
    assert "zoo.rules" not in err and "= None" not in err, err


def test_zoo_generate_names_its_flags_for_heads_and_four_bit_blocks(llama_dir):
    """zoo generate / serve's loader passed the library's advice through: `zoo.rules('fsdp')`,
    `rules['heads'] = None` and `pass quantize='nf4:BLOCK'`, none of them a flag."""
    prompt = ["--prompt", "the cat", "--max-new-tokens", "2"]
    rc, _, err = zoo_main("generate", llama_dir, *prompt, "--rules", "tp", "--mesh", "data=1,model=3", "--devices", "3")
    one_line_error(rc, err, f"--rules cannot place {llama_dir} on this mesh: the model has 4 attention heads")
    assert "zoo.rules" not in err and "a --mesh whose axis that splits heads divides 4" in err, err
    rc, _, err = zoo_main("generate", llama_dir, *prompt, "--quantize", "nf4")
    one_line_error(rc, err, "pass --quantize nf4:BLOCK, BLOCK one of [16, 32]")


def test_an_unused_axis_of_size_1_is_fine():
    rc, out, err = zoo_main("inspect", "mlp", "--devices", "2", "--mesh", "data=2,foo=1", "--microbatches", "1",
                            "--batch-size", "4", "--json")  # fmt: skip
    assert rc == 0, err


BAD_FILES = [
    ("run.json", '{"model": "mlp", "lr": 0.1, "lr": 0.2}', "cannot parse it as JSON: key 'lr' appears twice"),
    ("run.json", '{"model": "mlp", "mesh": {"data": 2, "data": 4}}', "key 'data' appears twice"),
    ("run.toml", 'model = "mlp"\nlr = 0.1\nlr = 0.2\n', "cannot parse it as TOML"),
    ("run.yaml", "model: mlp\nlr: 0.1\nlr: 0.2\n", "cannot parse it as YAML: key 'lr' appears twice"),
    ("run.yaml", "model: mlp\nmesh: {data: 2, data: 4}\n", "key 'data' appears twice"),
    ("run.json", '{"model": "mlp", "lr": Infinity}', "--lr must be a finite number > 0, got inf"),
    ("run.json", '{"model": "mlp", "clip": -1}', "--clip must be a finite number >= 0, got -1"),
    ("run.json", '{"model": "mlp", "seed": -4}', "--seed must be an integer >= 0, got -4"),
    ("run.json", '{"model": "mlp", "model_config": {"width": 0}}', "--model-config width=0: width must be"),
    ("run.json", '{"model": "mlp", "steps": "many"}', "steps must be an integer, got 'many'"),
    ("run.json", "[1, 2]", "the file must hold a table of flag = value, got a list"),
]


@pytest.mark.parametrize("name, text, message", BAD_FILES, ids=[t for _, t, _ in BAD_FILES])
def test_bad_config_files_are_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    rc, _, err = zoo_main("train", "--config", path, "--devices", "2")
    one_line_error(rc, err, message)


def test_a_mesh_smaller_than_the_devices_is_named_in_the_header():
    """`zoo train mlp --devices 4 --mesh data=2` trains on 2 of the 4 devices (allowed:
    `mesh_shape_of`); the run's header says so in one line, with the flags that use them
    all or ask for fewer (its lines made as a run makes them, without the run)."""
    import dataclasses
    import types

    from zoo.train import RunConfig
    from zoo.train._console import _print_header

    def header(devices: int, mesh: dict[str, int]) -> list[str]:
        c = dataclasses.replace(RunConfig(model="mlp").resolved("train"), devices=devices, mesh=mesh)
        task = types.SimpleNamespace(init=None, data="teacher", label_names=None)
        lines: list[str] = []
        _print_header(lines.append, c, task, "train mlp", devices, mesh, None, None, 1, 4, 4, 0, 1.0, 0, 0)
        return lines

    note = (
        "note: the mesh data=2 uses 2 of the 4 devices; to use all 4 pass --mesh data=4, or ask for 2 with --devices 2"
    )
    assert note in header(4, {"data": 2})
    assert not any(line.startswith("note:") for line in header(2, {"data": 2}))
    assert header(6, {"data": 2, "model": 2})[4].endswith(
        "ask for 4 with --devices 4, or give --mesh axes whose sizes multiply to 6"
    )


# --- the rest of the sweep: folders, choices, resume inputs ----------------------------------


def _sweep(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "afile").write_text("")
    (tmp / "broken").mkdir()
    (tmp / "broken" / "config.json").write_text("{bad")
    return [
        (["--output", tmp / "afile"], f"--output {tmp / 'afile'} is a file, not a folder"),
        (["--checkpoint-dir", tmp / "afile"], f"--checkpoint-dir {tmp / 'afile'} is a file, not a folder"),
        (["--output", tmp / "broken", "--resume"], f"--resume: cannot read {tmp / 'broken' / 'config.json'}"),
        (["--output", tmp / "none", "--resume-step", "2"], "--resume: no checkpoint in"),
        (["--resume-step", "0", "--output", tmp / "x"], "--resume-step must be an integer >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
        (["--seq-len", "1"], "--seq-len must be an integer >= 2, got 1"),
        (["--eval-size", "-1"], "--eval-size must be an integer >= 0, got -1"),
        (["--probe", "-1"], "--probe must be an integer >= 0, got -1"),
        (["--mode", "foo"], "argument --mode: invalid choice: 'foo'"),
        (["--optimizer", "foo"], "argument --optimizer: invalid choice: 'foo'"),
        (["--mesh", "data=0"], "bad --mesh 'data=0': write it as name=size"),
        (["--mesh", "data=2,data=2"], "axis 'data' appears twice"),
        (["--model-config", "width=1e400"], "--model-config width=inf: width must be an integer >= 1"),
        (["--keep", "-1"], "--keep must be an integer >= 1, got -1"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--init", tmp / "nowhere"], "--init: the mlp has no pretrained weights; drop --init"),
        (["--keep-best", "f1"], "--keep-best must be an evaluation metric (eval_loss, eval_perplexity, "),
        (["--keep-best", "accuracy"], "--keep-best: the mlp measures no eval_accuracy; watch one of ['eval_loss']"),
        (
            ["--early-stop", "2", "--eval-every", "0"],
            "--early-stop counts evaluations during the run, but "
            "--eval-every is 0 (only before and after): set --eval-every",
        ),
        (["--early-stop", "-1"], "--early-stop must be an integer >= 0, got -1"),
        (["--pooling", "cls"], "--pooling: the mlp is no classifier; drop --pooling"),
    ]


def test_sweep_of_bad_inputs_is_one_line_each(tmp_path):
    failures = []
    for flags, message in _sweep(tmp_path):
        rc, _, err = zoo_main("train", "mlp", *TINY, *flags)
        lines = err.strip().splitlines()
        if rc != 2 or message not in err or len(lines) != 1 or "Traceback" in err:
            failures.append((flags, rc, err))
    assert not failures, failures
    assert (tmp_path / "afile").read_text() == ""


def _sweep_commands(tmp: Path) -> list[tuple[list, str]]:
    """Whole command lines (other commands and models than the sweep's `zoo train mlp`)."""
    (tmp / "broken").mkdir()
    (tmp / "broken" / "config.json").write_text("{bad")
    (tmp / "adir").mkdir()
    init = f"--init {tmp / 'broken'}: neither a Hugging Face model folder"
    small = ["--steps", "2", "--devices", "2", "--output", tmp / "out"]
    return [
        (["train", "transformer", "--init", tmp / "broken", *small], init),
        (["finetune", "transformer", "--init", tmp / "broken", *small], init),
        (["train", "--config", tmp / "adir"], f"--config {tmp / 'adir'}: no such file"),
        (["train", "--config", tmp / "none.json"], f"--config {tmp / 'none.json'}: no such file"),
        (["finetune", "mlp", *small], "zoo finetune does not take 'mlp'; choose one of"),
    ]


def test_sweep_of_bad_command_lines_is_one_line_each(tmp_path):
    failures = []
    for argv, message in _sweep_commands(tmp_path):
        rc, _, err = zoo_main(*argv)
        lines = err.strip().splitlines()
        if rc != 2 or message not in err or len(lines) != 1 or "Traceback" in err:
            failures.append((argv, rc, err))
    assert not failures, failures
    assert not (tmp_path / "out").exists()  # refused before anything was written
