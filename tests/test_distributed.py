"""Multi-process training on loopback: 2 processes × 2 CPU devices (gloo collectives) train
exactly like 1 process × 4 devices, through the library API and through `zoo train`.

Every child runs with a timeout and is killed and reaped by PID whatever happens; the
coordinator's port is picked by binding port 0, and a launch that lost its port to
another program is retried on a fresh one.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    FAST_COMPILE_FLAGS,
    UNIT_ROUNDOFF,
    assert_rounding_close,
    assert_within,
    data_mesh,
    largest,
    rounding_bound,
)

import zoo

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_distributed_worker.py"
TIMEOUT = 300  # seconds for a whole launch (a loaded CI machine compiles slowly)
ATTEMPTS = 3
# 2 processes x 2 devices vs 1 x 4: the same sums, the gradients' all-reduce perhaps in
# another order (helpers.rounding_bound). The worker's first loss is a forward on the same
# parameters: a mean over its 16 x 8 tokens (the longest sum) through 2 layers of ~6 chained
# sums, the head and the loss's 2 sums.
LOSS_SUMS = {"terms": 16 * 8, "depth": 2 * 6 + 3}
# The gradients (the promise: 2 processes' equal 1 process'): the loss's sums and back,
# twice the depth. The worker steps with SGD + momentum (lr 1e-2, 0.9), linear in the
# gradients: after step t its momentum is a sum of t gradients (weights <= 1), so after 4
# steps a parameter is off by at most lr (1 + 2 + 3 + 4) x the gradient bound at the
# largest gradient the run saw (the worker records it each step), plus 2 roundings of the
# parameter a step.
GRAD_SUMS = {"terms": 16 * 8, "depth": 2 * (2 * 6 + 3)}
LR, STEPS = 1e-2, 4


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    # No cluster's variables leak into the children. They compile as the test process does
    # (`helpers.FAST_COMPILE_FLAGS`: a few steps of tiny programs, their time is compiling;
    # `zoo train mlp`'s two processes 23.4 -> 14.7 CPU s, docs/testing.md session 28).
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _run_all(commands: list[list[str]], logs: Path, timeout: float = TIMEOUT) -> list[tuple[int, str]]:
    """Start every command at once, wait for all (at most `timeout` seconds in all), and
    return each one's `(returncode, output)`. A child still running at the deadline, or
    when anything goes wrong, is killed by PID and reaped."""
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for i, cmd in enumerate(commands):
            log = logs / f"child{i}.log"
            with open(log, "w") as f:
                procs.append(
                    (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=HERE.parent), log)
                )
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        return [(proc.returncode, log.read_text()) for proc, log in procs]
    except subprocess.TimeoutExpired:
        outputs = "\n".join(f"--- child {i}\n{log.read_text()[-2000:]}" for i, (_, log) in enumerate(procs))
        pytest.fail(f"multi-process run still going after {timeout} s:\n{outputs}")
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _port_lost(output: str) -> bool:
    text = output.lower()
    return (
        "already in use" in text or "failed to bind" in text or "bind address" in text or "failed to add port" in text
    )


def _launch(make_commands, logs: Path) -> list[tuple[int, str]]:
    """`make_commands(port)` run together; retried on a new port if the coordinator's was taken."""
    for attempt in range(ATTEMPTS):
        results = _run_all(make_commands(_free_port()), logs / f"attempt{attempt}")
        if all(rc == 0 for rc, _ in results) or not any(_port_lost(out) for _, out in results):
            return results
    return results


def _check_ok(results: list[tuple[int, str]]) -> None:
    for i, (rc, out) in enumerate(results):
        assert rc == 0, f"child {i} exited {rc}:\n{out[-4000:]}"


# --- in-process: the helpers on one process -------------------------------------------------


def test_global_batch_on_one_process_is_the_batch_split_over_data():
    mesh = data_mesh(4)
    batch = {"x": np.arange(32, dtype=np.float32).reshape(8, 4), "y": np.arange(8)}
    with jax.set_mesh(mesh):
        assert zoo.local_rows(8) == slice(0, 8)
        out = zoo.global_batch(batch)
        zoo.internal.check_batch(out, 4, 2)
    assert out["x"].shape == (8, 4) and out["x"].sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(out["x"]), batch["x"])
    keys = zoo.global_batch({"k": jax.random.split(jax.random.key(0), 8)}, mesh)["k"]
    assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) and keys.shape == (8,)
    assert zoo.is_main_process()


def test_global_batch_and_init_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        zoo.global_batch({"x": np.zeros((6, 2))}, data_mesh(4))
    with pytest.raises(ValueError, match="disagree"):
        zoo.global_batch({"x": np.zeros((8, 2)), "y": np.zeros(4)}, data_mesh(4))
    with pytest.raises(ValueError, match="no mesh"):
        zoo.global_batch({"x": np.zeros((8, 2))})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\)"):
        zoo.distributed_init("127.0.0.1:1234", 2, 5)
    with pytest.raises(ValueError, match="HOST:PORT"):
        zoo.distributed_init("127.0.0.1", 2, 0)


def test_a_taken_coordinator_port_is_named_before_jax_crashes():
    """Process 0 hosts the coordinator: on a port another program holds, jax's gRPC server
    logs "Failed to add port" and the process segfaults. The port is checked first."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"port {port} is already in use.*--coordinator 127\.0\.0\.1:\d+"):
            zoo.distributed_init(f"127.0.0.1:{port}", 2, 0)


def test_a_process_waiting_for_the_others_says_what_it_waits_for(tmp_path):
    """Process 1 pointed at a coordinator nobody serves (or started without process 0)
    blocks in jax, silent, until jax aborts it after 300 s: zoo says what it waits for."""
    code = (
        "import zoo, zoo._distributed as d; d._WAIT_NOTE_S = 0.2; "
        f"zoo.distributed_init('127.0.0.1:{_free_port()}', 2, 1, local_device_count=1)"
    )
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=err, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while "has waited" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert "process 1 of 2 has waited 0 s to join the coordinator at 127.0.0.1:" in log.read_text(), log.read_text()


def test_a_launch_without_a_coordinator_names_the_flags(tmp_path):
    """`zoo train --process-id 1` alone (no coordinator, no cluster jax detects): jax's
    ValueError, in one line naming the command line's flags, not only the API's arguments."""
    cmd = [sys.executable, "-m", "zoo", "train", "mlp", "--process-id", "1", "--output", str(tmp_path / "run")]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "coordinator_address should be defined" in done.stderr
    assert "--coordinator HOST:PORT --num-processes N --process-id I" in done.stderr


# --- 2 processes x 2 devices vs 1 process x 4 devices ----------------------------------------


@pytest.mark.timeout(ATTEMPTS * TIMEOUT + 60)  # each launch has its own deadline
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_two_processes_train_like_one(tmp_path, objective):
    """The tiny decoder (dp rules, 2 microbatches, SGD + momentum, 4 steps): the same first
    loss and gradients (up to rounding), final parameters within the derived bound, one
    all-reduce outside the loop in every process's step. The reference (1 process x 4
    devices) is this process on 4 of its devices: the processes are the 2 x 2 run's
    subject, not the reference's. GRPO's dapo loss too: a token mean over the global
    batch, which per-process or per-microbatch counts would change (issue 47)."""
    import _distributed_worker as worker

    py = sys.executable

    def commands(port):
        return [
            [py, str(WORKER), str(tmp_path / f"p{i}.npz"), "--devices", "2", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i), "--objective", objective]
            for i in range(2)
        ]  # fmt: skip

    _check_ok(_launch(commands, tmp_path / "logs"))
    worker.train(str(tmp_path / "ref.npz"), data_mesh(4), objective=objective)
    ref, *procs = (np.load(tmp_path / f"{name}.npz") for name in ("ref", "p0", "p1"))
    assert int(ref["processes"]) == 1 and int(ref["devices"]) == 4
    params = [k for k in ref.files if k.startswith("param")]
    assert params
    for i, got in enumerate(procs):
        assert int(got["processes"]) == 2 and int(got["devices"]) == 4
        assert got["rows"].tolist() == [8 * i, 8 * i + 8]  # process i holds the i-th block of rows
        assert_rounding_close(got["losses"][0], ref["losses"][0], **LOSS_SUMS, what="first loss")
        for k in (k for k in ref.files if k.startswith("grad")):
            assert_rounding_close(got[k], ref[k], **GRAD_SUMS, what=k)
        grad_error = rounding_bound(float(ref["largest_grad"].max()), **GRAD_SUMS)
        for k in params:
            bound = LR * 10 * grad_error + 2 * STEPS * UNIT_ROUNDOFF * largest(ref[k])
            assert_within(got[k], ref[k], bound, k)
        assert json.loads(str(got["counts"])) == json.loads(str(ref["counts"])) == {"all-reduce/outside": 1}


@pytest.mark.timeout(ATTEMPTS * TIMEOUT + 60)
@pytest.mark.slow
def test_zoo_train_on_two_processes(tmp_path):
    """`zoo train mlp` on 2 processes × 2 devices: only process 0 prints and writes metrics;
    the losses equal those of one process with --devices 4 (run here: compared within a
    rounding bound, not bit for bit); the checkpoint is written by both."""
    from helpers import zoo_ok

    py = sys.executable
    common = ["train", "mlp", "--steps", "5", "--quiet"]

    def commands(port):
        return [
            [py, "-m", "zoo", *common, "--devices", "2", "--num-processes", "2", "--process-id", str(i),
             "--coordinator", f"127.0.0.1:{port}", "--output", str(tmp_path / "two")]
            for i in range(2)
        ]  # fmt: skip

    results = _launch(commands, tmp_path / "logs")
    _check_ok(results)
    zoo_ok(*common, "--devices", "4", "--output", tmp_path / "one")
    assert "loss fell" in results[0][1] and "loss fell" not in results[1][1]

    def losses(folder):
        rows = [json.loads(line) for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()]
        return np.array([r["loss"] for r in rows if r["kind"] == "train"])

    # zoo train mlp's step on 4 devices either way: the same sums, the all-reduce perhaps in
    # another order. The first loss is a forward on the same parameters: a mean over the
    # batch's 256 examples (the longest sum) of 4 layers of a 64-wide matmul and a norm's 2
    # sums, plus the loss's; the later ones follow AdamW steps, which amplify
    # rounding in near-zero gradients to order lr (the worker's test checks gradients and SGD).
    one, two = losses("one"), losses("two")
    assert len(one) == len(two) == 5
    assert_rounding_close(two[0], one[0], terms=256, depth=4 * 3 + 2, what="first loss")
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4
    assert summary["collectives"]["all_reduce_outside"] == 1 and summary["collectives"]["collectives_in_loop"] == 0
    assert zoo.Checkpointer(tmp_path / "two" / "checkpoints").steps() == [5]
