"""End-to-end runs of the scripts in examples/ (slow: run with `pytest -m slow`)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tiny but still learning: a one-layer, 32-wide byte LM on 8 devices x 4 microbatches
# drops from ~7.9 bits/byte to ~3.4 in 300 steps, about 1 bit under the unigram
# entropy (~4.5); the run takes 30-40 s on two CPU cores, half of it compiling.
TRAIN_LM_FLAGS = [
    "--devices", "8",
    "--microbatches", "4",
    "--steps", "300",
    "--batch-size", "32",
    "--seq-len", "64",
    "--d-model", "32",
    "--layers", "1",
    "--heads", "4",
    "--lr", "1e-2",
    "--eval-windows", "64",
    "--sample-bytes", "100",
]  # fmt: skip


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"no line matching {pattern!r} in the output:\n{text}"
    return float(match.group(1))


@pytest.mark.slow
def test_train_lm_learns_below_unigram_entropy():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_lm.py"), *TRAIN_LM_FLAGS],
        cwd=ROOT,
        check=False,  # the exit code is asserted below, with the output
        capture_output=True,
        timeout=300,  # generous: a loaded machine compiles slowly
    )
    out = proc.stdout.decode("utf-8", errors="replace")
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out}\n{proc.stderr.decode(errors='replace')}"

    unigram = _number(r"unigram entropy of the training bytes: ([\d.]+) bits/byte", out)
    before = _number(r"val loss before training: [\d.]+ nats = ([\d.]+) bits/byte", out)
    after = _number(r"val loss after training: +[\d.]+ nats = ([\d.]+) bits/byte", out)
    assert 4.0 < unigram < 6.0, unigram  # Python source: about 4.5 bits/byte
    assert before > 7.0, before  # an untrained model is near uniform: log2(256) = 8
    assert after < unigram - 0.5, (after, unigram)  # well below, not just below

    # The sample (prompt + 100 bytes) follows its header, between two rules.
    sample = re.search(r"sample \(temperature [\d.]+\):\n-{72}\n(.*?)\n-{72}\n", out, re.DOTALL)
    assert sample, out
    assert sample.group(1).startswith("def ") and len(sample.group(1)) >= 50, sample.group(1)

    # The compiled step's collectives: the one gradient all-reduce, outside the loop.
    assert "all-reduces: 0 inside loops, 1 outside" in out, out
    assert re.search(r"^all-reduce +outside .*\bdata\b", out, re.MULTILINE), out
    assert "OK: final val loss" in out
