"""Run safety: what a new user's mistakes do to `zoo train` (docs/reliability.md).

One folder, one run (an OS lock; a folder holding another run refused without --resume or
--overwrite); numbers checked before any work; a diverging run stopped with its last good
checkpoint kept. Most cases call the CLI's `main` in-process (cheap: this process already
has jax and its caches); a subprocess only where a fresh process matters (two live runs).
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ZOO_TAKING_CTRL_C, one_line_error, short_run_env, zoo_main
from tiny_runs import TINY_MLP

ROOT = Path(__file__).resolve().parents[1]
# A tiny mlp run on 2 devices: 3 steps of batch 8, no microbatching.
TINY = ["--devices", "2", "--steps", "3", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16", "--quiet"]


def train_rows(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


# --- one run per folder ----------------------------------------------------------------------


def test_two_processes_into_one_folder_the_second_is_refused(tmp_path):
    """A real `python -m zoo train` trains into a folder; a second run into it (even with
    --overwrite; started in this process: what is tested is the first process's lock) is
    refused with one line while the first trains, and the first ends intact."""
    out = tmp_path / "run"
    # Not short_run_env's fast compiling: the first run must outlive the second's start.
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    first_flags = ["--devices", "2", "--steps", "2000", "--batch-size", "8", "--microbatches", "1",
                   "--eval-size", "16", "--checkpoint-every", "1000", "--quiet", "--output", str(out)]  # fmt: skip
    first = subprocess.Popen([sys.executable, "-m", "zoo", "train", "mlp", *first_flags], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lock = out / ".zoo.lock"
    held = lambda: lock.exists() and "pid" in lock.read_text()  # noqa: E731  (written once locked)
    try:
        deadline = time.monotonic() + 120
        while not held() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert held(), first.communicate()
        rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, "--overwrite")
        assert first.poll() is None, "the first run ended before the second tried: the test proved nothing"
        one_line_error(rc, err, f"--output {out} is in use by another zoo run (pid {first.pid}")
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    assert "loss fell" in stdout
    assert [r["step"] for r in train_rows(out)] == list(range(1, 2001))
    import zoo

    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [1000, 2000]
    assert json.loads((out / "config.json").read_text())["steps"] == 2000


def test_two_runs_started_together_into_one_folder_one_is_refused(tmp_path):
    """Two `python -m zoo train` started at the same moment into one new folder: exactly
    one runs (its metrics, checkpoints and summary whole, each step once), the other is
    refused with one line (the lock: whichever comes second, even a moment later)."""
    out = tmp_path / "run"
    env = short_run_env()
    flags = ["--devices", "2", "--steps", "30", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16",
             "--checkpoint-every", "10", "--quiet", "--output", str(out)]  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-m", "zoo", "train", "mlp", *flags], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, err) for p, (_, err) in zip(procs, results)]
    winner_out = results[[p.returncode for p in procs].index(0)][0]
    loser_err = results[[p.returncode for p in procs].index(2)][1]
    assert "loss fell" in winner_out
    # In use (the usual case), or, had the winner already ended, its outputs refused.
    assert any(m in loser_err for m in (f"--output {out} is in use by another zoo run", "already holds")), loser_err
    assert len(loser_err.strip().splitlines()) == 1 and "Traceback" not in loser_err, loser_err
    assert [r["step"] for r in train_rows(out)] == list(range(1, 31))
    import zoo

    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [10, 20, 30]
    assert json.loads((out / "summary.json").read_text())["steps"] == 30


def test_a_held_lock_refuses_in_process_and_is_released_after_a_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".zoo.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
        one_line_error(rc, err, "is in use by another zoo run")
    assert not (out / "config.json").exists()
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
    assert rc == 0, err
    with open(out / ".zoo.lock") as f:  # the finished run let go of it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_folder_with_outputs_is_refused_without_overwrite(lm_run, tmp_path):
    """A folder with another run's outputs but no checkpoints is not silently replaced;
    --overwrite replaces it (the old files gone), --resume needs checkpoints."""
    out = _copy(lm_run, tmp_path / "run")
    shutil.rmtree(out / "checkpoints")
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
    one_line_error(rc, err, f"--output {out} already holds another run's outputs (config.json, loss.png, "
                   "metrics.jsonl, model/, summary.json); pass --overwrite")  # fmt: skip
    assert json.loads((out / "config.json").read_text())["model"] == "transformer"
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, "--overwrite")
    assert rc == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "mlp" and "overwrite" not in config  # replaying config.json never deletes
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]
    assert not (out / "model").exists()


# A tiny decoder run with a Hugging Face export (model/) and two checkpoints.
SMALL_LM = ["--devices", "2", "--batch-size", "4", "--microbatches", "1", "--seq-len", "16", "--model-config",
            "d_model=32,num_layers=1", "--steps", "2", "--checkpoint-every", "1", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A finished run of every kind of output (config.json, metrics.jsonl, loss.png,
    summary.json, model/, checkpoints/ 1 and 2) and its marker: copy it, never change it."""
    out = tmp_path_factory.mktemp("lm") / "run"
    rc, _, err = zoo_main("train", "transformer", *SMALL_LM, "--output", out)
    assert rc == 0, err
    listed = json.loads((out / ".zoo-run.json").read_text())["files"]
    assert listed == ["config.json", "loss.png", "metrics.jsonl", "model/config.json", "model/generation_config.json",
                      "model/model.safetensors", "summary.json"]  # fmt: skip
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the lock's (a refused run still took the lock to look)."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".zoo.lock")
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def _users_app(out: Path) -> None:
    """A user's own folder: a config.json and a Python package named model/ (the issue's case)."""
    (out / "model").mkdir(parents=True)
    (out / "config.json").write_text('{"app": "mine"}')
    (out / "model" / "__init__.py").write_text("VERSION = 1\n")


def _old_run(out: Path) -> None:
    (out / ".zoo-run.json").unlink()  # as written before runs had a marker


def _someone_elses(out: Path) -> None:
    """Files named as a run's, in a folder without a marker, but config.json is no run's."""
    out.mkdir()
    (out / "config.json").write_text('{"model": "someone else\'s"}')
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')


# (case, whether the folder starts as a copy of lm_run, what is added, the files the refusal names)
FOREIGN = [
    ("a user's config.json and package", False, _users_app, "config.json, model/__init__.py"),
    ("no run's config.json", False, _someone_elses, "config.json, metrics.jsonl"),
    ("a file next to a run's", True, lambda out: (out / "notes.txt").write_text("mine"), "notes.txt"),
    ("a file in a run's model folder", True, lambda out: (out / "model" / "README.md").write_text("mine"),
     "model/README.md"),
]  # fmt: skip


@pytest.mark.parametrize("from_run,make,names", [case[1:] for case in FOREIGN], ids=[case[0] for case in FOREIGN])
def test_overwrite_refuses_a_folder_with_files_zoo_did_not_write(lm_run, tmp_path, from_run, make, names):
    """--overwrite deletes only what zoo wrote (the files its marker lists): a folder
    holding anything else is refused, with --overwrite or without, naming those files;
    nothing in it is touched."""
    out = _copy(lm_run, tmp_path / "run") if from_run else tmp_path / "run"
    make(out)
    before = _snapshot(out)
    for overwrite in (["--overwrite"], []):
        rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, *overwrite)
        one_line_error(rc, err, f"--output {out} holds files zoo did not write ({names}); ")
        assert "choose another --output, or move those files away" in err
        assert _snapshot(out) == before


def test_overwrite_replaces_a_zoo_run_and_keeps_what_is_not_its(lm_run, tmp_path):
    """--overwrite replaces a run (with its marker, or an old one without that zoo
    recognises: nothing but a run's outputs, a config.json that is a run's), and deletes
    only the step folders of the checkpoint folder, inside the run's or not: a user's
    file there stays. A run started in a folder without a marker lists the old files."""
    marked = _copy(lm_run, tmp_path / "marked")
    (marked / "checkpoints" / "mine.txt").write_text("mine")
    old = _copy(lm_run, tmp_path / "old")
    _old_run(old)
    external = tmp_path / "ckpt"
    shutil.move(old / "checkpoints", external)
    (external / "mine.txt").write_text("mine")
    for out, ckpt in ((marked, marked / "checkpoints"), (old, external)):
        rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, "--checkpoint-dir", ckpt, "--overwrite")
        assert rc == 0, err
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [".zoo-run.json", ".zoo.lock", "config.json", "loss.png", "metrics.jsonl", "summary.json"]
            + (["checkpoints"] if ckpt == marked / "checkpoints" else [])
        )
        assert sorted(os.listdir(ckpt)) == ["3", "mine.txt"] and (ckpt / "mine.txt").read_text() == "mine"
        assert json.loads((out / "config.json").read_text())["model"] == "mlp"


def test_an_old_run_folder_gets_a_marker_listing_its_files(lm_run, tmp_path):
    """The marker of a run in an old zoo folder (resumed, say) lists the files already
    there, so a later --overwrite still recognises them."""
    from zoo.train._folder import claim, owned

    out = _copy(lm_run, tmp_path / "run")
    listed = json.loads((out / ".zoo-run.json").read_text())["files"]
    _old_run(out)
    (out / "notes.txt").write_text("mine")  # not a run's: no longer recognised
    assert owned(out, out / "checkpoints")[0] == [".zoo.lock"]
    (out / "notes.txt").unlink()
    claim(out, out / "checkpoints", ["tb/"])
    assert json.loads((out / ".zoo-run.json").read_text())["files"] == sorted([*listed, "tb/"])


def test_a_failed_start_leaves_no_folder(tmp_path):
    out = tmp_path / "never"
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, "--model-config", "depth=2,colour=3")
    one_line_error(rc, err, "unknown mlp keys ['colour']")
    assert not out.exists()


def test_probing_a_checkpoint_folder_is_read_only(tmp_path):
    """A refused run must not touch the folder it probes: an in-flight save's temporary
    folder (what another process is writing) survives."""
    out = tmp_path / "run"
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
    assert rc == 0, err
    in_flight = out / "checkpoints" / "5.orbax-checkpoint-tmp-1234"
    in_flight.mkdir()
    (in_flight / "data").write_text("half written")
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
    one_line_error(rc, err, "already holds checkpoints (steps [3]); pass --resume to continue from them, --overwrite")
    assert (in_flight / "data").read_text() == "half written"


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


# --- a diverging run ---------------------------------------------------------------------------

# sgd at lr 1e30 without clipping: step 1's loss is finite, step 2's is inf.
DIVERGE = ["--devices", "2", "--steps", "5", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16",
           "--quiet", "--optimizer", "sgd", "--clip", "0", "--lr", "1e30", "--warmup", "0", "--schedule", "constant",
           "--checkpoint-every", "1"]  # fmt: skip


def test_a_diverging_run_stops_with_exit_3_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    rc, _, err = zoo_main("train", "mlp", *DIVERGE, "--output", out)
    one_line_error(rc, err, f"step 2: the training loss is inf: training stopped, nothing saved from it; the last "
                   f"good checkpoint is step 1 in {out / 'checkpoints'}", code=3)  # fmt: skip
    assert "--skip-nonfinite" in err
    import zoo

    ckpt = zoo.Checkpointer(out / "checkpoints", read_only=True)
    assert ckpt.steps() == [1]  # the in-flight save of step 1 finished; nothing after it
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] > 0 and rows[1]["loss"] is None
    assert not (out / "summary.json").exists()


def test_a_huge_weight_decay_is_named_as_the_cause(tmp_path):
    """Not "Lower --lr": the stop names the weight decay it can see (lr x weight decay >= 1)."""
    rc, _, err = zoo_main("train", "mlp", *TINY, "--weight-decay", "1e30", "--output", tmp_path / "run")
    one_line_error(rc, err, "--weight-decay 1e+30 times --lr 0.003 is 3e+27 >= 1", code=3)
    assert "lower --weight-decay" in err and "--lr (now" not in err


def test_a_batch_without_target_tokens_is_named_as_the_cause():
    import numpy as np

    import zoo
    from zoo.train._run import nonfinite_advice

    config = zoo.train.RunConfig(model="transformer").resolved()
    empty = {"tokens": np.ones((2, 4), np.int32), "weights": np.zeros((2, 4), np.float32)}
    assert "The batch of step 3 holds no target token" in nonfinite_advice(config, lambda k: empty)(3)
    full = dict(empty, weights=np.ones((2, 4), np.float32))
    assert nonfinite_advice(config, lambda k: full)(3).startswith("Lower OptimizerConfig.lr (now")


def test_rows_beyond_the_hosts_memory_are_one_line(tmp_path, monkeypatch):
    """A batch or held-out set that cannot fit is refused before it is drawn (a MemoryError
    naming terabytes before); the machine's memory is set small so the sizes stay small."""
    monkeypatch.setattr("zoo.train._build_task.host_memory", lambda: 2**20)
    flags = ["--devices", "2", "--steps", "3", "--microbatches", "1", "--quiet", "--output", tmp_path / "run"]
    rc, _, err = zoo_main("train", "mlp", *flags, "--batch-size", str(2**16))
    one_line_error(rc, err, "--batch-size 65536 makes one batch of")
    assert "more than this machine's 1.0 MB of memory; lower it (at most about" in err
    rc, _, err = zoo_main("train", "mlp", *flags, "--batch-size", "8", "--eval-size", str(2**20))
    one_line_error(rc, err, "--eval-size 1048576 makes the held-out set of 4.2 MB")
    assert not (tmp_path / "run").exists()


def test_skip_nonfinite_skips_and_counts_the_steps(tmp_path):
    out = tmp_path / "run"
    rc, _, err = zoo_main("train", "mlp", *DIVERGE, "--output", out, "--skip-nonfinite")
    assert rc == 0, err
    rows = train_rows(out)
    assert [r["skipped"] for r in rows] == [0, 1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_nonfinite_steps"] == 4
    assert json.loads((out / "config.json").read_text())["skip_nonfinite"] is True


# --- resume ------------------------------------------------------------------------------------

BASE = ["--devices", "2", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16", "--quiet"]


@pytest.fixture(scope="module")
def finished_run4(finished_mlp_run) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4, lr and seed not the defaults
    (`BASE`'s flags): trained once for the suite's worker (conftest's `finished_mlp_run`,
    test_one_run.py's `saved_run` too), each test resumes or damages a copy of it (`run4`)."""
    assert BASE == TINY_MLP
    return finished_mlp_run


@pytest.fixture
def run4(finished_run4, tmp_path) -> Path:
    """A copy of `finished_run4` of the test's own (a run folder moved elsewhere resumes
    from its own checkpoints: test_one_run.py resumes copies too)."""
    return _copy(finished_run4, tmp_path / "run")


def test_resume_refuses_every_flag_that_changes_the_run(run4):
    before = (run4 / "config.json").read_text()
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume", "--steps", "6", "--seed", "1",
                          "--lr", "0.1", "--batch-size", "16", "--model-config", "width=32,depth=2")  # fmt: skip
    one_line_error(rc, err, "--resume: --batch-size 16 (was 8), --lr 0.1 (was 0.01), --model-config width=32,depth=2 "
                   "(was width=16,depth=2), --seed 1 (was 3) would change the run saved in")  # fmt: skip
    assert "drop them to continue that run" in err
    assert (run4 / "config.json").read_text() == before


def test_resume_takes_the_runs_own_flags_and_safe_changes(run4):
    """Unset flags come from config.json (lr, seed, model config); --steps, evaluation and
    checkpoint frequency, --quiet may change; the same model config spelled in another
    order is no change."""
    rc, _, err = zoo_main("train", *BASE, "--output", run4, "--resume", "--steps", "6", "--eval-every", "1",
                          "--checkpoint-every", "3", "--model-config", "depth=2,width=16")  # fmt: skip
    assert rc == 0, err
    config = json.loads((run4 / "config.json").read_text())
    assert (config["lr"], config["seed"], config["steps"], config["eval_every"]) == (0.01, 3, 6, 1)
    assert [r["step"] for r in train_rows(run4)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run4 / "summary.json").read_text())["resumed_from"] == 4


def test_resume_falls_back_past_a_damaged_and_an_empty_step(run4):
    import shutil

    shutil.rmtree(run4 / "checkpoints" / "4" / "state")  # step 4's arrays gone
    (run4 / "checkpoints" / "5").mkdir()  # a step folder with nothing in it
    with open(run4 / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut off by a crash
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume", "--steps", "6")
    assert rc == 0, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("zoo: warning: --resume skipped damaged checkpoints (step 5: its manifest cannot be read; "
                          "step 4: "), err  # fmt: skip
    assert "resuming from step 2" in err
    assert json.loads((run4 / "summary.json").read_text())["resumed_from"] == 2
    assert [r["step"] for r in train_rows(run4)] == [1, 2, 3, 4, 5, 6]
    import zoo

    assert zoo.Checkpointer(run4 / "checkpoints", read_only=True).steps() == [2, 4, 6]  # 4 saved anew


def test_resume_step(run4):
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume-step", "3", "--steps", "6")
    one_line_error(rc, err, "--resume-step 3: no such checkpoint in")
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume-step", "2", "--steps", "6")
    one_line_error(rc, err, "--resume-step 2: ")
    assert "also holds the later steps [4], which this run would replace; pass --overwrite" in err
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume-step", "2", "--steps", "2")
    one_line_error(rc, err, "--resume-step 2 is not before --steps 2")
    rc, _, err = zoo_main("train", "mlp", *BASE, "--output", run4, "--resume-step", "2", "--steps", "5", "--overwrite")
    assert rc == 0, err
    assert json.loads((run4 / "summary.json").read_text())["resumed_from"] == 2
    assert "resume_step" not in json.loads((run4 / "config.json").read_text())


# --- signals and full disks (fresh processes) ---------------------------------------------------

LONG = ["--devices", "2", "--steps", "2000", "--warmup", "1", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16",
        "--quiet"]  # fmt: skip


def _start(out: Path, *extra) -> subprocess.Popen:
    env = short_run_env()
    return subprocess.Popen([*ZOO_TAKING_CTRL_C, "train", "mlp", *LONG, "--output", str(out), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for_training(proc: subprocess.Popen, out: Path, rows: int = 3) -> None:
    """Until metrics.jsonl holds `rows` training rows (the loop is running)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and path.read_text().count('"kind": "train"') >= rows:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the run never reached its training loop: {proc.communicate()}")


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    import signal

    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_training(proc, out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    one_line_error(proc.returncode, err, "zoo: stopped: SIGTERM: stopped after step ", code=143)
    assert f"checkpoint saved in {out / 'checkpoints'}; continue with the same command and --resume" in err
    import zoo

    steps = zoo.Checkpointer(out / "checkpoints", read_only=True).steps()
    assert len(steps) == 1 and 3 <= steps[0] < 2000
    assert train_rows(out)[-1]["step"] == steps[0]  # every step up to the checkpoint recorded
    # ... and the run continues from it.
    rc, _, err = zoo_main("train", "mlp", *LONG[:2], "--steps", str(steps[0] + 2), "--output", out, "--resume")
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == steps[0]


# Ctrl-C while the main thread waits for a save to finish: orbax logs "Save Finalize thread
# failed" with the KeyboardInterrupt's traceback (it printed before `zoo: interrupted`).
_CTRL_C_IN_A_SAVE = """
import sys, time
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_manager as cm
real_finalize, real_join = ocp.CheckpointManager._finalize, cm._FinalizeThread.join
def finalize(self, *args, **kwargs):  # the save is still finishing when the main thread waits
    time.sleep(0.5)
    return real_finalize(self, *args, **kwargs)
def join(self, *args, **kwargs):
    real_join(self, *args, **kwargs)
    raise KeyboardInterrupt
ocp.CheckpointManager._finalize, cm._FinalizeThread.join = finalize, join
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_a_save_is_one_line(tmp_path):
    flags = ["--devices", "2", "--steps", "50", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16",
             "--quiet", "--checkpoint-every", "2", "--output", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_SAVE, "train", "mlp", *flags], cwd=ROOT,
                          env=short_run_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "zoo: interrupted", proc.stderr


# A run whose writes fail with ENOSPC once `after` bytes went to metrics.jsonl, then on every write.
_FULL_DISK = """
import errno, sys
import zoo.train._output as output

real = output.Metrics.write
def write(self, row):
    if row.get("step", 0) >= 2:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    real(self, row)
output.Metrics.write = write
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_ends_with_one_line(tmp_path):
    out = tmp_path / "run"
    env = short_run_env()
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, "train", "mlp", *TINY, "--checkpoint-every", "1",
                           "--output", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    one_line_error(proc.returncode, proc.stderr, f"zoo: error: no space left on the device writing {out}/metrics.jsonl; "
                   "free some space", code=1)  # fmt: skip
    import zoo

    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [1]  # its save in flight finished


# SIGKILL to itself as it starts writing summary.json: after its final checkpoint, before the end.
_KILLED_AT_THE_END = """
import os, signal, sys
import zoo.train._summary as summary

real = summary.write_json
def write_json(path, value):
    if path.name == "summary.json":
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, value)
summary.write_json = write_json
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_after_its_final_checkpoint_is_finished_by_resume(tmp_path):
    out = tmp_path / "run"
    flags = [*TINY[:2], "--steps", "4", *TINY[4:], "--checkpoint-every", "2", "--output", str(out)]
    env = short_run_env()
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT_THE_END, "train", "mlp", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -9, proc.stderr
    import zoo

    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [2, 4]
    assert not (out / "summary.json").exists()
    rc, _, err = zoo_main("train", "mlp", *flags, "--resume")  # the same command, --resume
    assert rc == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and summary["steps"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Every step once, then the final evaluation once (not the killed run's and the finisher's).
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [(r["kind"], r["step"]) for r in rows if r["step"] == 4] == [("train", 4), ("eval", 4)]
    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [2, 4]
    # Once finished, it is a finished run: --resume needs more --steps.
    rc, _, err = zoo_main("train", "mlp", *flags, "--resume")
    one_line_error(rc, err, "is at step 4, not before --steps 4; raise --steps to train further")


def _can_mount_tmpfs() -> bool:
    """Whether this machine lets an unprivileged process mount a tmpfs in a private mount
    namespace (`unshare -rm`: user namespaces enabled)."""
    try:
        probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                               capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


# Without a private tmpfs: orbax's background save of step 4 fails as tensorstore reports a
# full disk (its temporary folder left behind, the error raised when the save is waited for).
_FULL_DISK_ASYNC = """
import os, sys
import orbax.checkpoint as ocp

real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
failed = []
def save(self, step, *args, **kwargs):
    if failed:
        wait(self)
    if step < 4:
        return real_save(self, step, *args, **kwargs)
    os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp"))
    failed.append(step)
    return True
def wait(self):
    real_wait(self)
    if failed:
        raise ValueError("RESOURCE_EXHAUSTED: Error writing in OCDBT database: Failed to write 16045 bytes to "
                         "file 9: No space left on device [os_error_code='28']")
ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished = save, wait
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_during_an_async_checkpoint_save(tmp_path):
    """Checkpoints every step into a 1 MiB tmpfs (room for 3): orbax's background save of
    the next one meets the full disk. One line, exit 1; the committed steps stay whole,
    and `--resume` from a copy of the folder on a disk with room continues from the last."""
    copy = tmp_path / "copy"
    flags = ["--devices", "2", "--steps", "50", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16",
             "--quiet", "--checkpoint-every", "1", "--keep", "100"]  # fmt: skip
    env = short_run_env()
    if _can_mount_tmpfs():
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        out = mnt / "run"
        # The tmpfs lives as long as the namespace: the folder is copied out before it ends.
        script = (f'mount -t tmpfs -o size=1m tmpfs "{mnt}" && "{sys.executable}" -m zoo train mlp '
                  + " ".join(flags) + f' --output "{out}"; rc=$?; cp -a "{out}" "{copy}"; exit $rc')  # fmt: skip
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    else:
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-c", _FULL_DISK_ASYNC, "train", "mlp", *flags, "--output", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        out.rename(copy)
    one_line_error(proc.returncode, proc.stderr, f"zoo: error: no space left on the device writing {out}/checkpoints; "
                   "free some space", code=1)  # fmt: skip
    import zoo

    steps = zoo.Checkpointer(copy / "checkpoints", read_only=True).steps()
    n = len(steps)  # 3 on a 1 MiB tmpfs (a checkpoint of the mlp takes ~300 kB)
    assert n >= 1 and steps == list(range(1, n + 1)), steps
    names = sorted(p.name for p in (copy / "checkpoints").iterdir())
    assert names == sorted([*map(str, steps), f"{n + 1}.orbax-checkpoint-tmp"]), names  # unfinished: no step
    rc, _, err = zoo_main("train", "mlp", *flags[:2], "--steps", str(n + 2), "--output", copy, "--resume")
    assert rc == 0, err
    assert json.loads((copy / "summary.json").read_text())["resumed_from"] == n
    assert [r["step"] for r in train_rows(copy)] == list(range(1, n + 3))


def test_the_commands_stderr_drops_only_closed_loop_tracebacks():
    """What `zoo`'s stderr filter keeps: every line and traceback but those ending in
    orbax's "Event loop is closed" (tensorstore's writes completing after a failed save)."""
    import io

    from zoo._checkpoint._disk import without_closed_loop_tracebacks

    closed = (
        "Traceback (most recent call last):\n"
        '  File "asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
        "    self._check_closed()\n"
        "RuntimeError: Event loop is closed\n"
    )
    other = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: kept\n'
    sink = io.StringIO()
    stream = without_closed_loop_tracebacks(sink)
    assert without_closed_loop_tracebacks(stream) is stream
    for part in ("first line\n", closed[:40], closed[40:], other, "zoo: error: no space left", "\n", closed):
        stream.write(part)
    stream.write("progress\r")
    stream.flush()
    assert sink.getvalue() == "first line\n" + other + "zoo: error: no space left\nprogress\r"

    # A background thread's traceback comes a line at a time; the main thread's error line
    # in between is written at once and does not end it (CI once got the first two lines of
    # a closed-loop traceback before `zoo: error: ...`).
    import threading

    sink = io.StringIO()
    stream = without_closed_loop_tracebacks(sink)
    lines = closed.splitlines(keepends=True)
    resume, written = threading.Event(), threading.Event()

    def tensorstore_thread():
        stream.write(lines[0] + lines[1])
        written.set()
        resume.wait(10)
        stream.write(lines[2] + lines[3])

    thread = threading.Thread(target=tensorstore_thread)
    thread.start()
    written.wait(10)
    stream.write("zoo: error: no space left\n")
    resume.set()
    thread.join(10)
    stream.flush()
    assert sink.getvalue() == "zoo: error: no space left\n"
    # A thread's unfinished line is written by a flush from another (the exit's).
    thread = threading.Thread(target=stream.write, args=("step 3/10\r",))
    thread.start()
    thread.join(10)
    stream.flush()
    assert sink.getvalue() == "zoo: error: no space left\nstep 3/10\r"


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


# --- shapes and dtypes at model boundaries -----------------------------------------------------

# In a fresh process without jaxtyping's hook (the test session has it on): what a user gets
# by default, then with ZOO_RUNTIME_CHECKS=1.
_BOUNDARIES = """
import json
import equinox as eqx, jax, jax.numpy as jnp, optax, zoo

def error(f):
    try:
        f()
    except Exception as e:
        return type(e).__name__ + ": " + str(e).splitlines()[0]
    return None

def full_error(f):  # equinox's runtime errors put the message below a first line of their own
    try:
        f()
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
    return None

mlp = zoo.nn.MLP(4, 1, 8, 2, key=jax.random.key(0))
lm = zoo.models.Transformer(zoo.models.TransformerConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1,
                                                         max_len=8), key=jax.random.key(0))
enc = zoo.models.Encoder(zoo.models.EncoderConfig(vocab_size=32, d_model=16, num_heads=2, num_layers=1,
                                                  max_len=8), key=jax.random.key(0))
emb = zoo.nn.Embedding(10, 4, key=jax.random.key(0))
mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
step = zoo.TrainStep(lambda m, b: (m(b["x"]) - b["y"]) ** 2, optax.sgd(0.1))
int_loss = zoo.TrainStep(lambda m, b: (m(b["x"])[:, 0] > 0).astype(jnp.int32), optax.sgd(0.1))
batch = {"x": jnp.ones((4, 4)), "y": jnp.ones((4, 1))}
lm_step = zoo.TrainStep(zoo.models.next_token_loss, optax.sgd(0.1))
bad_ids = jnp.full((2, 8), 40, jnp.int32)  # vocab 32: a lookup clamps them to row 31
with jax.set_mesh(mesh):
    placed = zoo.shard(mlp, zoo.rules("dp"), mesh)
    placed_lm = zoo.shard(lm, zoo.rules("dp"), mesh)
    def lm_step_on_bad_ids():
        jax.block_until_ready(lm_step(placed_lm, lm_step.init(placed_lm), {"tokens": bad_ids}))
    out = {
        "lm_ids_eager": error(lambda: lm(bad_ids)),
        "lm_ids_jit": full_error(lambda: jax.block_until_ready(eqx.filter_jit(lm)(bad_ids))),
        "lm_ids_step": full_error(lm_step_on_bad_ids),
        "mlp_int": error(lambda: eqx.filter_jit(mlp)(jnp.ones((3, 4), jnp.int32))),
        "mlp_width": error(lambda: mlp(jnp.ones((3, 5)))),
        "lm_float": error(lambda: lm(jnp.ones((2, 4)))),
        "lm_rank": error(lambda: lm(jnp.ones((4,), jnp.int32))),
        "encoder_float": error(lambda: enc(jnp.ones((2, 4)))),
        "embedding_float": error(lambda: emb(jnp.ones((3,)))),
        "loss_2d": error(lambda: step(placed, step.init(placed), batch)),
        "loss_int": error(lambda: int_loss(placed, int_loss.init(placed), batch)),
        "linear_width": error(lambda: zoo.nn.Linear(4, 3, key=jax.random.key(0))(jnp.ones((2, 5)))),
        "ok": error(lambda: eqx.filter_jit(mlp)(jnp.ones((3, 4)))),
    }
print(json.dumps(out))
"""


def _boundaries(**env) -> dict:
    proc = subprocess.run([sys.executable, "-c", _BOUNDARIES], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=short_run_env() | {"JAX_PLATFORMS": "cpu"} | env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_model_entry_points_check_rank_and_dtype_by_default():
    out = _boundaries(ZOO_RUNTIME_CHECKS="0")
    assert out["ok"] is None
    assert out["mlp_int"] == ("TypeError: MLP: x must be a float array, got int32 of shape (3, 4); cast it with "
                              ".astype(jnp.float32)")  # fmt: skip
    assert out["mlp_width"] == "ValueError: MLP: x must end with a dimension of size 4, got shape (3, 5)"
    assert out["lm_float"].startswith("TypeError: Transformer: tokens must be an int array, got float32")
    assert out["lm_rank"] == "ValueError: Transformer: tokens must have 2 dimensions, got shape (4,)"
    assert out["encoder_float"].startswith("TypeError: Encoder: tokens must be an int array")
    assert out["embedding_float"].startswith("TypeError: Embedding: ids must be an int array")
    assert out["loss_2d"].startswith("ValueError: loss_fn(model, batch) must return per-example losses `[batch]`")
    assert "Got losses of shape (4, 1) for a microbatch of 4 examples (reduce the other axes first" in out["loss_2d"]
    assert "Got losses of dtype int32: cast them to float32" in out["loss_int"]
    # Without the runtime checks a Linear's width mismatch is jnp's own error.
    assert out["linear_width"].startswith("ValueError") and "TypeCheckError" not in out["linear_width"]
    # Ids outside the vocabulary: refused where concrete; compiled code holds no check by default.
    assert out["lm_ids_eager"].startswith("ValueError: Embedding of 32 rows: ids holds 40 at position (0, 0)")
    assert out["lm_ids_jit"] is None and out["lm_ids_step"] is None


def test_zoo_runtime_checks_turns_on_beartype_for_the_package():
    out = _boundaries(ZOO_RUNTIME_CHECKS="1")
    assert out["ok"] is None
    assert out["linear_width"].startswith("TypeCheckError: Type-check error whilst checking the parameters of "
                                          "zoo.nn._linear.Linear.__call__")  # fmt: skip
    # ... and checks ids inside compiled code too: a jitted call and a training step.
    for case in ("lm_ids_jit", "lm_ids_step"):
        assert out[case] is not None and "Embedding of 32 rows: ids outside [0, 32)" in out[case], out[case]


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
