"""Signals and full disks in real runs (docs/reliability.md, "Signals and disks"): SIGTERM
saves a checkpoint and exits 143, SIGKILL after the final checkpoint is finished by `--resume`,
Ctrl-C during a save and a full disk are one line on the process's stderr (file descriptor 2:
orbax's and tensorstore's threads write there too). Each run is a fresh `zoo` process (what it
shows is the process: its signal, exit code and stderr), compiling as the tests do
(`helpers.short_run_env`); the resumes that follow run in this process.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from helpers import ZOO_TAKING_CTRL_C, one_line_error, short_run_env, zoo_main
from tiny_runs import TINY_MLP, train_rows

ROOT = Path(__file__).resolve().parents[1]
# A tiny mlp run on 2 devices: 3 steps of batch 8, no microbatching (tiny_runs.TINY_MLP's shapes).
TINY = [*TINY_MLP, "--steps", "3"]


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
    flags = [*TINY_MLP, "--steps", "4", "--checkpoint-every", "2", "--output", str(out)]
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


def test_full_disk_records_are_dropped_from_orbax_and_asyncio_only():
    """What the checkpointer raises as one error is not also logged: orbax's records of a
    full disk (absl's logger) and asyncio's "Task exception was never retrieved" of an orbax
    write task that failed on it (CI once printed one around the error line, depending on
    when the task was collected); any other error record is kept."""
    import logging

    from zoo._checkpoint._disk import quiet_disk_full_logs

    quiet_disk_full_logs()
    full = ValueError("RESOURCE_EXHAUSTED: Failed to write 2949 bytes to file 6: No space left on device")

    def record(logger, exc):
        return logging.LogRecord(logger, logging.ERROR, __file__, 1, "Task exception was never retrieved",
                                 None, (type(exc), exc, None))  # fmt: skip

    for name in ("absl", "asyncio"):
        assert not logging.getLogger(name).filter(record(name, full)), name
        assert logging.getLogger(name).filter(record(name, ValueError("another failure"))), name


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
