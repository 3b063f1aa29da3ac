"""The `zoo` command's help and its mistakes: `--help` lists every flag and every run flag is
a `RunConfig` field; `--help` and argparse's usage errors answer before jax is imported (one
fresh process); every mistake is exit 2 and one line naming the fix, no traceback; an
unexpected error is exit 1 naming its type and `--debug`, whose traceback a fresh process
shows.

Most cases call the CLI's entry in-process (`helpers.zoo_main`); fresh `python -m zoo`
processes only where the process is what is checked: its imports, a mistake found once jax
runs (everything written to file descriptor 2 counts), the exit codes and tracebacks Python
gives as the process ends, the devices a fresh process simulates.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import one_line_error, zoo_main

ROOT = Path(__file__).resolve().parents[1]


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
    (["--version"], 0, f"zoo {importlib.metadata.version('eqx-zoo')}\n"),
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
    compiles anything): the exit code, exactly one line on stderr, no traceback (a
    `--tensorboard` folder under a file, once an unexpected NotADirectoryError at the first
    step, is refused before the run); `--debug` (before or after the
    command) shows the traceback instead; a fresh process simulates the devices asked for.
    `--debug` after the command in this process: the entry raises the same error instead of
    its one line (what Python prints as a traceback with exit 1 as the process ends, the
    process with `--debug` before the command shows)."""
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
                   "zoo: error: --config bad.toml: unknown keys ['batch_sise'] for zoo train (did you mean 'batch_sise' "
                   "-> 'batch-size'?); valid keys: batch-size,"),
        "rules": (["inspect", "transformer", "--mesh", "data=8", "--rules", "tp"], 2,
                  ("zoo: error: --rules tp shards over mesh axes ['data', 'model'], but the mesh data=8 lacks 'model'; "
                   "pass a mesh with them, e.g. --mesh data=4,model=2")),
        "devices": (["train", "mlp", "--devices", "0"], 2, "zoo: error: --devices must be an integer >= 1, got 0"),
        "tensorboard": (["train", "mlp", "--steps", "1", "--quiet", "--tensorboard", "a_file/tb"], 2,
                        ("zoo: error: --tensorboard a_file/tb: a_file is a file, so no folder can be created in it; "
                         "choose a folder whose parents are folders")),
    }  # fmt: skip
    debug = {"debug_before": ["--debug", "train", "mlp", "--mesh", "data4"]}
    debug_after = ["train", "mlp", "--mesh", "data4", "--debug"]
    debug_error = "bad --mesh 'data4': write it as name=size[,name=size], e.g. data=4,model=2"
    # Fresh processes for a mistake found once jax has started (everything a process writes
    # to file descriptor 2 counts), --debug's traceback (Python prints
    # it as the process ends) and the simulated devices; the other mistakes in this process
    # (the same entry, the same message): a process each cost seconds of jax's start and
    # showed nothing more.
    fresh = {"batch", "debug_before"}
    procs = {name: _start(args, tmp_path, name) for name, (args, _, _) in one_line.items() if name in fresh}
    procs |= {name: _start(args, tmp_path, name) for name, args in debug.items()}
    procs["info"] = _start(["info", "mlp", "--devices", "3", "--json"], tmp_path, "info")
    here = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        for name, (args, _, _) in one_line.items():
            if name not in fresh:
                here[name] = zoo_main(*args)
        from zoo._cli._common import CLIError

        with pytest.raises(CLIError) as raised:
            zoo_main(*debug_after)
        assert str(raised.value) == debug_error
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
        assert text.strip().splitlines()[-1] == f"zoo._cli._common.CLIError: {debug_error}", text
    assert procs["info"].returncode == 0, err("info")
    info = json.loads((tmp_path / "info.out").read_text())
    assert info["devices"] == 3 and info["mesh"] == {"data": 3}


@pytest.mark.parametrize(
    "error, line",
    [
        (RuntimeError("boom\nmore"), "RuntimeError: boom"),
        (
            NotADirectoryError(20, "Not a directory", "a_file/tb"),
            "NotADirectoryError: [Errno 20] Not a directory: 'a_file/tb'",
        ),
    ],
)
def test_an_unexpected_error_is_one_line_naming_its_type_and_debug(monkeypatch, error, line):
    """An error no check foresaw (a bug, an environment problem; an OSError has its own
    branch) is exit 1 and one line naming its type, its first line and `--debug`; with
    `--debug` it is raised (Python's traceback). Raised here by the train command's run."""
    import zoo._cli._train as train_cli

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(train_cli, "execute", fail)
    rc, _, err = zoo_main("train", "mlp", "--steps", "1")
    assert rc == 1 and err == f"zoo: error: {line} (rerun with --debug for the traceback)\n", (rc, err)
    with pytest.raises(type(error)):
        zoo_main("train", "mlp", "--steps", "1", "--debug")


# Ctrl-C (exit 130, one line naming the saved step and the command that continues the run):
# tests/test_user_path.py's test_ctrl_c_saves_the_step_and_the_printed_command_continues_it, the
# one place it is tested (it also runs the command it names).


def test_bad_lora_is_one_readable_line():
    """A bad key or value names the accepted keys; a target matching nothing gets zoo's
    error, which lists the model's Linear layers. Exit 2, one line."""
    for lora, message in [
        ("r=4,beta=2", "unknown key 'beta'"),
        ("r=4,alfa=2", "unknown key 'alfa' (did you mean 'alpha'?)"),
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


@pytest.mark.parametrize("command", ["train", "finetune", "demo"])
def test_every_run_flag_is_a_config_field_and_every_field_a_flag(command):
    """The flags of train/finetune/demo are the flat `RunConfig` fields
    (`RunConfig.flat_keys()`: DataConfig's and OptimizerConfig's inside), generated from
    their `zoo.train.Flag`s, plus only the documented launch flags (`CLI_ONLY`) and
    `zoo`'s own; `--lora` and `--quantize` are finetune's and demo's, GRPO's finetune's."""
    from zoo._cli._main import build_parsers
    from zoo._cli._train import CLI_ONLY
    from zoo.train import RunConfig

    parser = build_parsers()[1][command]
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    zoo_own = {"no_compile_cache", "keep_memory"}
    finetune_only = {f.name for f in RunConfig.flags() if f.commands == ("finetune",)}  # GRPO's (GRPOConfig)
    fields = set(RunConfig.flat_keys()) - ({"lora", "quantize"} if command == "train" else set())
    fields -= finetune_only if command != "finetune" else set()
    assert dests - set(CLI_ONLY) - zoo_own == fields
    assert set(CLI_ONLY) <= dests and not set(CLI_ONLY) & set(RunConfig.flat_keys())
    # Each field's flag is spelled from its flat key and carries its field's help.
    options = {s for a in parser._actions for s in a.option_strings}
    for flag in RunConfig.flags():
        assert flag.positional or command not in flag.commands or flag.option in options, flag
        assert flag.field.split(".")[0] in ("RunConfig", "DataConfig", "OptimizerConfig", "GRPOConfig") and flag.help, (
            flag
        )
