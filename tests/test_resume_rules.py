"""Resuming a run (docs/reliability.md): `--resume` takes the run's own flags, refuses those
that would change it, falls back past damaged checkpoints; `--resume-step`. Each test resumes
or damages a copy of the session's finished mlp run (conftest's `finished_mlp_run`). In-process.
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers import one_line_error, zoo_main
from tiny_runs import TINY_MLP, train_rows

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
    return Path(shutil.copytree(finished_run4, tmp_path / "run", symlinks=True))


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
