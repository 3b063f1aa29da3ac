"""One run per folder (zoo.train's run folder and its lock; docs/reliability.md): a folder
held by a live run refused, a folder holding another run's outputs refused without --resume or
--overwrite, --overwrite deleting only what zoo wrote, a failed start leaving nothing.

Most cases call the CLI's `main` in-process (cheap: this process already has jax and its
caches); a subprocess only where another live process is the subject (its lock).
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
from helpers import one_line_error, short_run_env, zoo_main
from tiny_runs import TINY_MLP, train_rows

ROOT = Path(__file__).resolve().parents[1]
# A tiny mlp run on 2 devices: 3 steps of batch 8, no microbatching (tiny_runs.TINY_MLP's shapes).
TINY = [*TINY_MLP, "--steps", "3"]


# A `zoo train` process that waits, holding its folder, after writing step 2's row: until the
# file named by ZOO_TEST_GO exists (it writes ZOO_TEST_GO.paused first). The second run tries
# the folder while the first is surely mid-run, whatever the machine's load.
_PAUSED_AT_STEP_2 = """
import os, sys, time
import zoo.train._output as output

real = output.Metrics.write
def write(self, row):
    real(self, row)
    if row.get("kind") == "train" and row.get("step") == 2:
        go = os.environ["ZOO_TEST_GO"]
        open(go + ".paused", "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
output.Metrics.write = write
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_processes_into_one_folder_the_second_is_refused(tmp_path):
    """A `zoo train` process trains into a folder; a second run into it (even with
    --overwrite; started in this process: what is tested is the first process's lock) is
    refused with one line while the first trains (held after its second step until the
    second run has tried), and the first then ends intact."""
    out, go = tmp_path / "run", tmp_path / "go"
    first_flags = [*TINY_MLP, "--steps", "4", "--checkpoint-every", "2", "--output", str(out)]
    first = subprocess.Popen([sys.executable, "-c", _PAUSED_AT_STEP_2, "train", "mlp", *first_flags], cwd=ROOT,
                             env=short_run_env() | {"ZOO_TEST_GO": str(go)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    lock = out / ".zoo.lock"
    paused = tmp_path / "go.paused"
    try:
        deadline = time.monotonic() + 450  # its start and compiling, on a loaded machine
        while not paused.exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        if not paused.exists():  # not held: it never reached step 2 (ended, or too slow)
            first.kill()
            raise AssertionError(f"the first run never reached step 2: {first.communicate()}")
        assert "pid" in lock.read_text()  # written once locked
        rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out, "--overwrite")
        assert first.poll() is None, "the first run ended before the second tried: the test proved nothing"
        one_line_error(rc, err, f"--output {out} is in use by another zoo run (pid {first.pid}")
        go.touch()
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    assert "loss fell" in stdout
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]
    import zoo

    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [2, 4]
    assert json.loads((out / "config.json").read_text())["steps"] == 4


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
    ("a note in a folder of no run", False, lambda out: out.mkdir() or (out / "notes.md").write_text("mine"),
     "notes.md"),
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


def test_an_output_that_cannot_be_created_is_one_line(tmp_path):
    """--output under a file: the path and the operating system's reason, exit 2."""
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "run"
    rc, _, err = zoo_main("train", "mlp", *TINY, "--output", out)
    one_line_error(rc, err, f"--output {out}: cannot create the folder (Not a directory)")


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
