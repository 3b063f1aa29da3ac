"""Readers never harm a run in progress.

Every command and API that reads a run (`zoo.train.load_run`, `zoo predict`, `zoo eval`,
`zoo export`, `zoo generate`, and resume's own look at the checkpoints) opens its checkpoints
read-only: it ignores the temporary folders of saves in flight and never deletes, renames or
writes anything in the run's folder. The test runs the readers in a loop against a run that
saves a checkpoint every step (keeping 3, so older ones vanish under the readers) and holds
its final weights equal, bit for bit, to those of the same run undisturbed.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from helpers import zoo_main

import zoo

ROOT = Path(__file__).resolve().parents[1]
STEPS = 80
TRAIN = ["train", "encoder", "--devices", "1", "--batch-size", "4", "--microbatches", "1", "--seq-len", "16",
         "--model-config", "d_model=32,num_layers=1", "--steps", str(STEPS), "--checkpoint-every", "1",
         "--eval-every", "1000", "--quiet"]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _train(data: Path, out: Path, *flags: str) -> subprocess.Popen:
    """A run in a process of its own, compiling as the tests do (`helpers.short_run_env`'s
    XLA flags: a tiny model's compile is most of its time); `flags` after TRAIN's."""
    from helpers import short_run_env

    env = short_run_env()
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "zoo", *TRAIN, *flags, "--data", str(data), "--output", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _weights(run: Path) -> dict[str, np.ndarray]:
    model = run / "model"
    return safetensors.numpy.load_file(model / "model.safetensors") | safetensors.numpy.load_file(
        model / "head.safetensors"
    )


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder`: (bytes or None for a folder, modification time)."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.name != ".zoo.lock"
    }


def test_readers_leave_a_save_in_flight_untouched(tmp_path):
    """A run mid-training (checkpoints, no model/ yet) with a save in flight (orbax's
    temporary folder) and a step folder still empty: every reader reads the newest committed step and leaves every file
    and folder of the run as it was (opening the checkpoints for writing deleted the
    temporary folder, and the run died at its next save)."""
    data = tmp_path / "labels.jsonl"
    rows = [{"text": f"{w} {v} {i}", "label": w} for i in range(6) for w, v in (("cat", "mat"), ("dog", "log"))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    rc, _, err = zoo_main(*TRAIN[:-7], "--steps", "2", "--checkpoint-every", "1", "--quiet", "--data", data,
                          "--output", run)  # fmt: skip
    assert rc == 0, err
    for name in ("model", "summary.json"):  # as a run still training has them: not yet
        path = run / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    flight = run / "checkpoints" / "3.orbax-checkpoint-tmp"
    (flight / "state").mkdir(parents=True)
    (flight / "state" / "partial").write_bytes(b"half a save")
    (run / "checkpoints" / "4").mkdir()  # a step folder whose save has not begun writing
    before = _snapshot(run)
    texts = tmp_path / "texts.txt"
    texts.write_text("cat mat\n")

    loaded = zoo.train.load_run(run)
    assert loaded.weights.endswith("checkpoints step 2"), loaded.weights
    for args in [("predict", run, "--input", texts), ("eval", run, "--data", data),
                 ("export", run, "--merge", "--output", tmp_path / "export")]:  # fmt: skip
        rc, _, err = zoo_main(*args)
        assert rc == 0, f"zoo {args[0]}: {err}"
    assert _snapshot(run) == before


@pytest.mark.slow  # two runs saving every step, readers looping meanwhile
@pytest.mark.timeout(900)
def test_readers_in_a_loop_leave_a_saving_run_bit_identical(tmp_path):
    data = tmp_path / "labels.jsonl"
    rows = [{"text": f"{w} {v} {i}", "label": w} for i in range(12) for w, v in (("cat", "mat"), ("dog", "log"))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = tmp_path / "texts.txt"
    texts.write_text("cat mat\ndog log\n")
    busy, calm = tmp_path / "busy", tmp_path / "calm"
    # The reference saves only its last step: saving every step leaves the weights as they
    # are (measured bit for bit, docs/testing.md session 28) and cost it half its CPU.
    writer, reference = _train(data, busy), _train(data, calm, "--checkpoint-every", str(STEPS))

    reads: dict[str, int] = {}
    failures: list[str] = []
    while writer.poll() is None:
        if not (busy / "checkpoints").is_dir():
            time.sleep(0.05)
            continue
        for name, args in [
            ("predict", ("predict", busy, "--input", texts)),
            ("eval", ("eval", busy, "--data", data)),
            ("export", ("export", busy, "--merge", "--output", tmp_path / f"export{len(reads)}")),
            ("generate", ("generate", busy, "--prompt", "a", "--max-new-tokens", "1")),
            ("resume's look", ("train", *TRAIN[1:], "--data", data, "--output", busy, "--resume")),
        ]:
            rc, _, err = zoo_main(*args)
            assert not (name == "resume's look" and rc == 0), "a second run trained into a run in progress"
            if rc == 0:
                reads[name] = reads.get(name, 0) + 1
            elif "Traceback" in err or len(err.strip().splitlines()) != 1:
                failures.append(f"zoo {name}: exit {rc}: {err}")
        try:
            zoo.train.load_run(busy)
            reads["load_run"] = reads.get("load_run", 0) + 1
        except zoo.train.ConfigError as e:
            failures.append(f"load_run: {e}") if "damaged" in str(e) else None
    _, err = writer.communicate()
    assert writer.returncode == 0, err
    _, ref_err = reference.communicate(timeout=600)
    assert reference.returncode == 0, ref_err
    assert not failures, "\n".join(failures)
    # The readers read checkpoints while the run saved (else this test proved nothing).
    assert reads.get("load_run", 0) + reads.get("predict", 0) >= 1, reads

    want, got = _weights(calm), _weights(busy)
    assert sorted(got) == sorted(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name} differs from the undisturbed run's"
    assert not list((busy / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def test_predict_on_a_damaged_newest_checkpoint_says_so_and_never_deletes(finished_mlp_run, tmp_path):
    """An mlp run's weights are its checkpoints. `zoo predict` with the newest one damaged
    predicts from the newest intact one and says which step it skipped and why in one note
    (it used to be silent); every checkpoint damaged: one line, no traceback. Nothing in the
    run's folder is deleted either way."""
    from helpers import one_line_error

    run = tmp_path / "run"
    shutil.copytree(finished_mlp_run, run)
    row = " ".join(["0.5"] * 16)
    rc, newest, _ = zoo_main("predict", run, "--text", row)  # step 4
    assert rc == 0
    for data in (run / "checkpoints" / "4").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])  # a truncated copy, as a full disk leaves one
    rc, out, err = zoo_main("predict", run, "--text", row)
    assert rc == 0, err
    note, header = err.strip().splitlines()
    assert note.startswith("zoo predict: note: ") and "step 4 is damaged (its array data cannot be read" in note, err
    assert "the weights are the newest intact step, 2" in note and header.endswith("step 2, 1 input"), err
    assert out != newest  # step 2's weights, not step 4's
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    for data in (run / "checkpoints" / "2").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    rc, _, err = zoo_main("predict", run, "--text", row)
    one_line_error(rc, err, "every checkpoint in")
    assert "step 4: its array data cannot be read" in err and "step 2: its array data cannot be read" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
