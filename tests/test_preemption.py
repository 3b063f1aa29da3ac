"""SIGTERM (preemption) in real runs (docs/reliability.md, "Signals and disks").

- A multi-process run where only ONE process gets SIGTERM: every process stops after the
  same step, that step's checkpoint is saved, both exit 143, and `--resume` finishes the
  run with the same weights, bit for bit, as a run never interrupted.
- A SIGTERM while the run loads or compiles (before its first step): exit 143 with one
  line, and nothing left behind (a new run's folder is gone, a resumed run's checkpoints
  are untouched), so the same command runs again.

Every child is killed and reaped by PID whatever happens.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import FAST_COMPILE_FLAGS, zoo_main

import zoo

ROOT = Path(__file__).resolve().parents[1]
# Long enough that SIGTERM surely comes mid-training; a constant lr, so an uninterrupted
# reference run of fewer --steps trains with the same rates.
FLAGS = ["--steps", "2000", "--warmup", "1", "--schedule", "constant", "--batch-size", "8", "--microbatches", "1",
         "--eval-size", "16", "--quiet"]  # fmt: skip
END = 100  # the steps the interrupted run is finished to (it is stopped after a few)


def _env(cache: Path | None = None) -> dict[str, str]:
    """The children's environment: this checkout importable; the test session's XLA flags
    (a long collective timeout) plus its quick compilation (`helpers.FAST_COMPILE_FLAGS`:
    tiny programs, optimised code would not pay for itself); no cluster variables. With `cache`, zoo's compilation cache in that
    folder, so the later runs of the test reuse the first ones' programs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}"
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    if cache is not None:
        env.pop("ZOO_NO_COMPILE_CACHE", None)
        env["ZOO_COMPILE_CACHE_DIR"] = str(cache)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if r["kind"] == "train"]


def _param_fingerprints(folder: Path, step: int) -> dict[str, int]:
    """The bit checksums of a checkpoint's trained parameters (zoo's manifest)."""
    leaves = zoo.Checkpointer(folder, read_only=True).manifest(step)["leaves"]
    return {path: leaf["fingerprint"] for path, leaf in leaves.items() if path.startswith("['params']")}


def _stopped_step(err: str) -> int:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    found = re.fullmatch(r"zoo: stopped: SIGTERM: stopped after step (\d+) of 2000, checkpoint saved in .*", lines[0])
    assert found, err
    return int(found.group(1))


def _pair(out: Path, port: int, *flags, early: int | None = None, script: str | None = None) -> list[subprocess.Popen]:
    """`zoo train mlp` as 2 processes x 2 CPU devices into `out` (a compilation cache next to
    it); process `early`, if given, sends itself SIGTERM while compiling (`_EARLY`, or
    `script`)."""
    args = ["train", "mlp", *FLAGS, *flags, "--devices", "2", "--num-processes", "2",
            "--coordinator", f"127.0.0.1:{port}", "--output", str(out)]  # fmt: skip
    env = _env(out.parent / "jax-cache")
    return [
        subprocess.Popen(
            [
                sys.executable,
                *(["-c", script or _EARLY] if i == early else ["-m", "zoo"]),
                *args,
                "--process-id",
                str(i),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each process's `(returncode, stderr)`, at most 300 s in all."""
    deadline = time.monotonic() + 300
    return [(p.wait(timeout=max(deadline - time.monotonic(), 1)), p.communicate()[1]) for p in procs]


def _port_lost(results: list[tuple[int, str]]) -> bool:
    return any("address already in use" in err.lower() or "failed to bind" in err.lower() for _, err in results)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path):
    out, ref = tmp_path / "two", tmp_path / "ref"
    procs: list[subprocess.Popen] = []
    try:
        for attempt in range(3):  # a coordinator port taken by another program: a fresh one
            # Alongside: a run of END steps never interrupted (the same layout: the same bits expected).
            procs = _pair(out, _free_port()) + _pair(ref, _free_port(), "--steps", str(END))
            deadline = time.monotonic() + 300
            while len(_train_rows(out)) < 3 and time.monotonic() < deadline and procs[0].poll() is None:
                time.sleep(0.05)
            if len(_train_rows(out)) >= 3:
                break
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
            results = _finish(procs)
            if not _port_lost(results) or attempt == 2:
                pytest.fail(f"the two-process run never reached its training loop: {results}")
        # Only process 1 is told: process 0 (which writes metrics.jsonl) must learn it from it.
        os.kill(procs[1].pid, signal.SIGTERM)
        results = _finish(procs)
        for rc, err in results[:2]:
            assert rc == 143, (rc, err)
        assert all(rc == 0 for rc, _ in results[2:]), results[2:]
        stopped = [_stopped_step(err) for _, err in results[:2]]
        assert stopped[0] == stopped[1], stopped  # the same step in both processes
        k = stopped[0]
        assert 3 <= k < END
        assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [k]
        assert [r["step"] for r in _train_rows(out)] == list(range(1, k + 1))  # every step up to it, once

        # --resume finishes it.
        for attempt in range(3):
            procs = _pair(out, _free_port(), "--steps", str(END), "--resume")
            results = _finish(procs)
            if all(rc == 0 for rc, _ in results) or not _port_lost(results) or attempt == 2:
                break
        assert all(rc == 0 for rc, _ in results), results
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == k
    # The same weights, bit for bit (zoo's checkpoints keep a checksum of each leaf's bits).
    got, want = _param_fingerprints(out / "checkpoints", END), _param_fingerprints(ref / "checkpoints", END)
    assert len(got) >= 4 and got == want
    assert [r["loss"] for r in _train_rows(out)] == [r["loss"] for r in _train_rows(ref)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_to_one_process_while_compiling_stops_both_after_the_first_step(tmp_path):
    """A multi-process run cannot stop one process alone before the loop (the other would
    wait in its first collective): the note is shared at the first step, both stop there."""
    out = tmp_path / "run"
    _both_stop_after_the_first_step(out, _pair_to_the_end(out, early=1))
    assert [r["step"] for r in _train_rows(out)] == [1]


def _pair_to_the_end(out: Path, **pair) -> list[tuple[int, str]]:
    """`_pair(out, ..., **pair)` run to its end (a fresh port when the coordinator's was
    taken), every child killed and reaped whatever happens: `(returncode, stderr)` each."""
    procs: list[subprocess.Popen] = []
    try:
        for attempt in range(3):
            procs = _pair(out, _free_port(), **pair)
            results = _finish(procs)
            if not _port_lost(results) or attempt == 2:
                return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    raise AssertionError("unreachable")


def _both_stop_after_the_first_step(out: Path, results: list[tuple[int, str]]) -> None:
    for rc, err in results:
        assert rc == 143, (rc, err)
    assert [_stopped_step(err) for _, err in results] == [1, 1]
    assert zoo.Checkpointer(out / "checkpoints", read_only=True).steps() == [1]


# SIGTERM to itself just after zoo.distributed_init, before the run takes the signal over (as
# it takes the output folder's lock): jax's own notifier would swallow it.
_BEFORE_RUN = """
import os, signal, sys
import zoo.train._run as run

real = run.run_lock
def run_lock(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
run.run_lock = run_lock
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_after_distributed_init_before_the_run_stops_both_after_the_first_step(tmp_path):
    """The window between `zoo.distributed_init` and the run's own handler: the signal is
    noted (not swallowed by jax's notifier), and both processes stop after step 1."""
    out = tmp_path / "run"
    _both_stop_after_the_first_step(out, _pair_to_the_end(out, early=1, script=_BEFORE_RUN))


# --- the class, in this process (one process: its note is the answer) -----------------------


def test_preemption_notes_sigterm_and_gives_the_handler_back():
    from zoo.train._trainer import Preemption

    before = signal.getsignal(signal.SIGTERM)
    with Preemption(enabled=True) as p:
        assert not p.stop_at(1)
        os.kill(os.getpid(), signal.SIGTERM)  # noted: this process lives on
        assert p.requested and p.stop_at(2) and p.stop_at(3)
    assert signal.getsignal(signal.SIGTERM) is before

    off = Preemption(enabled=False)  # the signal keeps its handler
    assert signal.getsignal(signal.SIGTERM) is before and not off.stop_at(1)
    off.restore()
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        Preemption(enabled=True, every=0)


def test_preemption_before_the_first_step_raises_early():
    from zoo.train._trainer import Preemption

    class Early(Exception):
        pass

    with Preemption(enabled=True, early=Early) as p:
        with pytest.raises(Early):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs in this thread between bytecodes: well before this ends
    with Preemption(enabled=True, early=Early) as p:  # once the loop runs: only noted
        assert not p.stop_at(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.stop_at(2)


# SIGTERM to itself while compiling the step (deterministic: the loading and compiling
# phase is a second or two of a tiny run).
_EARLY = """
import os, signal, sys
import zoo

real = zoo.TrainStep.compile
def compile(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(self, *args, **kwargs)
zoo.TrainStep.compile = compile
from zoo._cli import main
sys.exit(main(sys.argv[1:]))
"""

TINY = ["--devices", "2", "--steps", "3", "--batch-size", "8", "--microbatches", "1", "--eval-size", "16", "--quiet"]


def _early(*flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _EARLY, "train", "mlp", *TINY, *flags], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # ~20 s: two runs stopped while compiling, two that finish
def test_sigterm_while_compiling_exits_143_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    proc = _early("--output", str(out))
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip() == (
        "zoo: stopped: SIGTERM before training started: nothing was trained or saved; rerun the same command"
    )
    assert not out.exists()  # the same command starts afresh
    rc, _, err = zoo_main("train", "mlp", *TINY, "--checkpoint-every", "2", "--output", out)
    assert rc == 0, err

    # A resumed run stopped while compiling keeps its checkpoints and metrics as they were.
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    proc = _early("--steps", "5", "--output", str(out), "--resume")
    assert proc.returncode == 143, proc.stderr
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    # (config.json is rewritten, whole, with the new --steps as the run starts)
    changed = [str(p) for p in before if before[p] != after.get(p) and p.name not in (".zoo.lock", "config.json")]
    assert set(after) == set(before) and not changed, changed
    assert json.loads((out / "config.json").read_text())["steps"] == 5
    rc, _, err = zoo_main("train", "mlp", *TINY, "--steps", "5", "--output", out, "--resume")
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == 3
