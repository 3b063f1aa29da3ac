"""docs/training.md's path from two files of one's own to a served DPO adapter, run as the
docs write it: SFT, DPO from the SFT run, `zoo serve` of the DPO run, and the docs' openai
client block against that server (issue 43). Slow: two fine-tunes and a server process."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import signal
import subprocess
import sys

import pytest
from helpers import short_run_env, zoo_ok
from test_docs import ROOT, VOCAB_WORDS, _sft_jsonl, _tiny_llama, read_blocks

# The size the two fine-tunes run at here (flags the docs' commands leave at their defaults).
SMALL = ["--steps", "4", "--batch-size", "8", "--microbatches", "1", "--seq-len", "32"]


def _the_sequence():
    """The shell block of docs/training.md that serves runs/dpo, and the python block after it."""
    blocks = read_blocks(ROOT / "docs" / "training.md")
    (i,) = [k for k, b in enumerate(blocks) if b.lang == "bash" and "zoo serve runs/dpo" in b.text]
    return blocks[i], blocks[i + 1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_then_dpo_then_serve_as_docs_training_md_writes_them(tmp_path, monkeypatch):
    shell, client_block = _the_sequence()
    assert client_block.lang == "python" and "openai.OpenAI" in client_block.text
    commands = [shlex.split(line) for line in shell.text.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["zoo", "finetune"], ["zoo", "finetune"], ["zoo", "serve"]]
    # The user's files, at the paths the commands name.
    (tmp_path / "path" / "to" / "llama").mkdir(parents=True)
    _tiny_llama(tmp_path / "path" / "to" / "llama")
    _sft_jsonl(tmp_path / "sft.jsonl")
    words = VOCAB_WORDS
    pairs = [{"prompt": " ".join(words[i % 5 : i % 5 + 4]), "chosen": " hello world", "rejected": f" {words[i % 9]}"}
             for i in range(64)]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    monkeypatch.chdir(tmp_path)
    # In this process: the runs are what is tested, not their process. At the smallest size
    # that chains them (issue 40): the commands as written plus a few steps of small
    # batches; every other setting stays at its default (the DPO run's learning rate, its
    # init, below). A run at the default length and batch with no other flags:
    # test_user_path.py::test_a_first_chat_file_trains_with_no_other_flags.
    for command in commands[:2]:
        zoo_ok(*command[1:], *SMALL)
    config = json.loads((tmp_path / "runs" / "dpo" / "config.json").read_text())
    assert config["objective"] == "dpo" and config["lr"] == 1e-6 and config["init"] == str(tmp_path / "runs" / "sft")
    # The server in a process of its own, on a free port instead of the docs' 8000, compiling
    # as this process does (`helpers.short_run_env`: its answer is compared to `zoo generate`'s here).
    serve = [a if a != "8000" else "0" for a in commands[2][1:]]
    proc = subprocess.Popen([sys.executable, "-m", "zoo", *serve], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=short_run_env())  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "ready" in line, line + proc.stderr.read()
        base = line.split()[2]  # http://127.0.0.1:PORT/v1
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(client_block.text.replace("http://127.0.0.1:8000/v1", base), client_block.name, "exec"), {})
        models, text = printed.getvalue().split("\n", 1)
        assert "'dpo'" in models, models
        # The served adapter answers as `zoo generate` of the same run does (greedy).
        want = json.loads(zoo_ok("generate", "runs/dpo", "--prompt", "once upon a time", "--max-new-tokens", "4",
                                 "--json"))[0]["completion"]  # fmt: skip
        assert text.rstrip("\n") == want
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
