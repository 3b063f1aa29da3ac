"""A diverging run (docs/reliability.md): a NaN or inf loss stops the run with exit 3, its
last good checkpoint kept, the cause named (the learning rate, the weight decay, a batch without
target tokens); `--skip-nonfinite` skips and counts such steps instead. In-process.
"""

import json

from helpers import one_line_error, zoo_main
from tiny_runs import TINY_MLP, train_rows

# A tiny mlp run on 2 devices: 3 steps of batch 8, no microbatching (tiny_runs.TINY_MLP's shapes).
TINY = [*TINY_MLP, "--steps", "3"]


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


def test_skip_nonfinite_skips_and_counts_the_steps(tmp_path):
    out = tmp_path / "run"
    rc, _, err = zoo_main("train", "mlp", *DIVERGE, "--output", out, "--skip-nonfinite")
    assert rc == 0, err
    rows = train_rows(out)
    assert [r["skipped"] for r in rows] == [0, 1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_nonfinite_steps"] == 4
    assert json.loads((out / "config.json").read_text())["skip_nonfinite"] is True
