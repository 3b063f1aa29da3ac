"""The smaller refusals: `zoo predict/eval --batch-size 0`, a damaged labels.json, a torn
metrics row on resume (said, not dropped silently), a linear probe in a multi-process run;
each one line, no traceback."""

import json

import jax
import pytest
from helpers import one_line_error, zoo_main

from zoo.train._errors import ConfigError
from zoo.train._head import read_labels
from zoo.train._hooks import MetricsLog, TrainState


@pytest.mark.parametrize("command", ["predict", "eval"])
@pytest.mark.parametrize("size", ["0", "-3"])
def test_batch_size_below_1_is_refused_before_loading(command, size, tmp_path):
    extra = ["--text", "x"] if command == "predict" else ["--data", tmp_path / "d.jsonl"]
    rc, _, err = zoo_main(command, tmp_path / "no-run", *extra, "--batch-size", size)
    one_line_error(rc, err, f"--batch-size must be >= 1 (rows per forward pass), got {size}")


@pytest.mark.parametrize("flags", [["train", "encoder", "--probe", "5"], ["demo", "minilm"]], ids=["given", "demo"])
def test_a_probe_is_refused_in_a_multi_process_run_given_or_by_default(flags, monkeypatch, tmp_path):
    """The probe fits on one process's features: the run's plan refuses it when the run spans
    several, given as a flag or as the command's default (the MiniLM demo's: only the
    resolved config knows it), before anything is built or written."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    rc, _, err = zoo_main(*flags, "--output", tmp_path / "run")
    one_line_error(rc, err, "--probe runs in one process only, and this run has 2: set --probe 0")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"labels": ["a", "b"', "is damaged (JSONDecodeError"),
        ('{"labels": "ab"}', 'is damaged: it holds no {"labels": [names...]}'),
        ("[1, 2]", 'is damaged: it holds no {"labels": [names...]}'),
        ('{"labels": []}', 'is damaged: it holds no {"labels": [names...]}'),
        ('{"labels": ["a", "a"]}', "is damaged: a label name appears twice"),
    ],
)
def test_a_damaged_labels_json_is_refused(tmp_path, text, message):
    (tmp_path / "labels.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        read_labels(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "restore it, or train the run again" in str(e.value)


def test_labels_json_absent_or_whole_reads_as_before(tmp_path):
    assert read_labels(tmp_path) is None
    (tmp_path / "labels.json").write_text(json.dumps({"labels": ["cats", "dogs", 3]}))
    assert read_labels(tmp_path) == ("cats", "dogs", "3")


def _resume_metrics(path, torn: str, step: int) -> list[int]:
    """Steps 1-3 then the `torn` last line in metrics.jsonl; a run resumed at `step` opens
    it (MetricsLog.on_start); the steps of the rows it keeps."""
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    log = MetricsLog(path)
    log.on_start(TrainState(step=step, steps=10, model=None, opt_state=None, loss=None, trainer=None))
    log.close()
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_torn_metrics_row_on_resume_is_said(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    assert _resume_metrics(path, '{"kind": "train", "st', 3) == [1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"zoo: note: {path} line 4 was cut off mid-write" in err, err
    assert "the resumed run records the steps after 3 anew" in err


def test_a_torn_row_after_the_resume_step_is_recorded_again_without_a_note(tmp_path, capsys):
    assert _resume_metrics(tmp_path / "metrics.jsonl", '{"kind": "train", "step": 4, "lo', 2) == [1, 2]
    assert capsys.readouterr().err == ""  # nothing of the kept steps is lost: the run records 3 and 4 again
