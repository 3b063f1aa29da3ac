"""zoo.train: the typed run config, the optimizer's schedule, the Trainer and its hooks,
and `zoo.train.run` (resume, phase lines)."""

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import UNIT_ROUNDOFF, assert_rounding_close, data_mesh, rounding_bound

import zoo
from zoo.train import (
    Checkpoint,
    ConfigError,
    DataConfig,
    Evaluate,
    Hook,
    KeepBest,
    MetricsLog,
    OptimizerConfig,
    RunConfig,
    TensorBoard,
    Trainer,
)

ROOT = Path(__file__).resolve().parents[1]


# --- the learning-rate schedule ------------------------------------------------------------------

# A schedule's value in float32: ~6 elementwise roundings (the step's fraction, the warmup's
# product, the cosine and its blend), each of a value no larger than the peak.
SCHEDULE = {"terms": 1, "depth": 6}
SCHEDULE_REL = rounding_bound(1.0, **SCHEDULE)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_starts_above_zero_peaks_after_warmup_and_ends_at_the_end_fraction(schedule):
    opt = OptimizerConfig(lr=0.5, warmup=4, schedule=schedule)
    rates = opt.rates(20)  # index k - 1: step k
    assert_rounding_close(rates[:4], [0.125, 0.25, 0.375, 0.5], **SCHEDULE)  # step 1 = lr / warmup > 0
    peak = pytest.approx(0.5, rel=SCHEDULE_REL)
    assert rates.max() == peak and rates[3] == peak  # the peak ends the warmup
    end = 0.5 if schedule == "constant" else 0.05
    assert_rounding_close(rates[-1], end, **SCHEDULE, scale=0.5)  # the last step runs at the end value
    assert np.all(rates > 0)
    if schedule != "constant":
        assert np.all(np.diff(rates[4:]) < 0)  # decaying after the peak


def test_schedule_without_warmup_and_the_default_warmup():
    assert OptimizerConfig(lr=1.0, warmup=0).rates(5)[0] == pytest.approx(1.0, rel=SCHEDULE_REL)
    default = OptimizerConfig(lr=1.0)
    assert default.warmup_steps(100) == 5 and default.warmup_steps(10) == 1 and default.warmup_steps(1) == 0
    assert default.rates(100)[0] == pytest.approx(0.2, abs=SCHEDULE_REL)  # 1/5 of the peak, not 0


def test_optimizer_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ConfigError, match=r"OptimizerConfig\.lr must be a finite number > 0, got nan"):
        OptimizerConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match=r"OptimizerConfig\.name 'adamax' is not one of"):
        OptimizerConfig(name="adamax")
    with pytest.raises(ConfigError, match=r"OptimizerConfig\.clip must be a finite number >= 0"):
        OptimizerConfig(clip=-1.0)
    with pytest.raises(ConfigError, match=r"warmup 10 must be below the run's 10 steps"):
        OptimizerConfig(warmup=10).rates(10)
    # lr unset is the run's default (RunConfig.resolved); built on its own it must be given.
    with pytest.raises(ConfigError, match=r"OptimizerConfig\.lr is not set; pass lr="):
        OptimizerConfig().build(10)


# --- the Trainer over a TrainStep of our own -------------------------------------------------------

# A loss linear in the weights: the gradient is the same at every step, so Adam's update
# is exactly -lr · sign(gradient) (m̂ = g, v̂ = g²): each step's weight change is its rate.
STEPS, BATCH = 10, 8


def linear_loss(model, batch):
    return model(batch["x"]).sum(axis=-1)


def batch_at(step: int) -> dict:
    return {"x": np.ones((BATCH, 4), np.float32)}


@pytest.fixture(scope="module")
def linear_setup():
    """A 2-device Linear, its Adam step, and the step compiled once (shared by the tests)."""
    mesh = data_mesh(2)
    opt = OptimizerConfig(name="adam", lr=0.01, warmup=3, clip=0.0, schedule="cosine")
    with jax.set_mesh(mesh):
        model = zoo.shard(zoo.nn.Linear(4, 1, key=jax.random.key(0)), zoo.rules("dp"), mesh)
        step = zoo.TrainStep(linear_loss, opt.build(STEPS), microbatches=2)
        compiled = step.compile(model, step.init(model), batch_at(1))
    return mesh, opt, model, step, compiled


def _is_schedule_state(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


class Recorder(Hook):
    """A user hook: what it saw, when."""

    def __init__(self, every: int):
        self.every = every
        self.calls: list[tuple[str, int]] = []
        self.weights: dict[int, np.ndarray] = {}
        self.counts: dict[int, int] = {}

    def on_start(self, state):
        self.calls.append(("start", state.step))
        self.weights[state.step] = np.asarray(state.model.weight)

    def __call__(self, state):
        self.calls.append(("step", state.step))
        self.weights[state.step] = np.asarray(state.model.weight)
        # The count the schedule reads (optax's ScaleByScheduleState): updates made so far.
        sched = [x for x in jax.tree.leaves(state.opt_state, is_leaf=_is_schedule_state) if _is_schedule_state(x)]
        self.counts[state.step] = int(sched[0].count)
        assert state.loss is not None and np.isfinite(state.loss)

    def on_end(self, state):
        self.calls.append(("end", state.step))


def run_trainer(setup, hooks, **kwargs):
    mesh, opt, model, step, compiled = setup
    rates = opt.rates(STEPS)
    with jax.set_mesh(mesh):
        trainer = Trainer(step, batch_at, steps=STEPS, hooks=hooks, lr=lambda i: rates[i - 1], **kwargs)
        trainer.compiled = compiled
        out = trainer.run(model, step.init(model))
    return trainer, out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_logged_lr_is_the_rate_optax_applied(linear_setup, tmp_path):
    opt = linear_setup[1]
    every = Recorder(every=1)
    run_trainer(linear_setup, [MetricsLog(tmp_path / "metrics.jsonl"), every])
    rows = [r for r in read_rows(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    logged = np.array([r["lr"] for r in rows])
    # Each step moved every weight by exactly the logged rate (Adam on a constant gradient).
    moved = np.array([np.abs(every.weights[k] - every.weights[k - 1]).max() for k in range(1, STEPS + 1)])
    # Up to float32: Adam's m-hat / sqrt(v-hat) of a constant gradient (g = 1) is 1 off by
    # the bias corrections' 1 - b^k (1 - 0.9^k, 1 - 0.999^k: ~2 ulps of 1 each, relative to
    # their size), the moments' recursions (~2 roundings a step each) and ~4 more roundings,
    # plus eps / |g|; the new weight is rounded once (u x its size).
    for k in range(1, STEPS + 1):
        rel = UNIT_ROUNDOFF * (2 / (1 - 0.9**k) + 1 / (1 - 0.999**k) + 4 * k + 4) + 1e-8
        bound = rel * logged[k - 1] + UNIT_ROUNDOFF * np.abs(every.weights[k]).max()
        assert abs(moved[k - 1] - logged[k - 1]) <= bound, (k, moved[k - 1], logged[k - 1], bound)
    # ... which is optax's schedule at the update count before the step.
    schedule = opt.schedule_fn(STEPS)
    for k in range(1, STEPS + 1):
        assert every.counts[k] == k
        assert float(schedule(every.counts[k] - 1)) == pytest.approx(logged[k - 1], rel=SCHEDULE_REL)
    assert (
        logged[0] == pytest.approx(0.01 / 3, rel=SCHEDULE_REL)
        and logged[2] == pytest.approx(0.01, rel=SCHEDULE_REL)
        and logged[-1] == pytest.approx(0.001, abs=0.01 * SCHEDULE_REL)  # of the peak's size
    )


def test_hooks_fire_at_their_steps_and_metrics_have_both_kinds(linear_setup, tmp_path):
    user = Recorder(every=3)
    evals = Evaluate(lambda model: {"loss": float(jnp.abs(model.weight).sum()), "accuracy": None}, every=4)
    saver = Checkpoint(tmp_path / "ckpt", every=5, at_end=True, keep=5)
    trainer, _ = run_trainer(linear_setup, [MetricsLog(tmp_path / "metrics.jsonl"), evals, saver, user])
    assert user.calls == [("start", 0), ("step", 3), ("step", 6), ("step", 9), ("end", 10)]
    assert [step for step, _ in evals.results] == [0, 4, 8, 10]
    assert zoo.Checkpointer(tmp_path / "ckpt", read_only=True).steps() == [5, 10]
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert {r["kind"] for r in rows} == {"train", "eval"}
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 4, 8, 10]
    # Each evaluation row follows the training row of its step.
    order = [(r["kind"], r["step"]) for r in rows]
    assert order.index(("eval", 4)) == order.index(("train", 4)) + 1
    assert len(trainer.losses) == STEPS and trainer.train_seconds > 0 and trainer.hook_seconds > 0


def _tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in `folder`, read with TFRecord framing: length
    (uint64), its CRC, the Event proto, its CRC."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert files, list(folder.iterdir())
    for path in files:
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


CLASSES = {"cat": {"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 3},
           "dog": {"precision": 1.0, "recall": 0.25, "f1": 0.4, "support": 4}}  # fmt: skip


def test_tensorboard_writes_the_scalars_of_the_metrics(linear_setup, tmp_path):
    """Every number an evaluation row holds is a scalar: perplexity, macro-F1 and each
    class's precision, recall and F1 (`eval_f1/CLASS`: TensorBoard groups them)."""
    evaluation = {"accuracy": 0.5, "perplexity": 3.0, "macro_f1": 0.6, "per_class": CLASSES}
    evals = Evaluate(lambda model: {"loss": float(jnp.abs(model.weight).sum()), **evaluation}, every=5)
    run_trainer(linear_setup, [MetricsLog(tmp_path / "metrics.jsonl"), TensorBoard(tmp_path / "tb"), evals])
    scalars = _tensorboard_scalars(tmp_path / "tb")
    rows = read_rows(tmp_path / "metrics.jsonl")
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert sorted(scalars["loss"]) == sorted(train) == list(range(1, STEPS + 1))
    for step, row in train.items():
        # TensorBoard stores float32: one rounding of the logged value.
        assert scalars["loss"][step] == pytest.approx(row["loss"], rel=UNIT_ROUNDOFF)
        assert scalars["lr"][step] == pytest.approx(row["lr"], rel=UNIT_ROUNDOFF)
    assert sorted(scalars["eval_loss"]) == [0, 5, 10] and set(scalars["eval_accuracy"].values()) == {0.5}
    assert set(scalars["eval_perplexity"].values()) == {3.0} and sorted(scalars["eval_macro_f1"]) == [0, 5, 10]
    assert scalars["eval_recall/dog"][5] == 0.25 and scalars["eval_f1/cat"][10] == pytest.approx(2 / 3)
    assert scalars["eval_precision/cat"][0] == 0.5
    evals_rows = [r for r in rows if r["kind"] == "eval"]
    assert all(r["eval_per_class"] == CLASSES and r["eval_macro_f1"] == 0.6 for r in evals_rows)


def test_class_scores_are_scikit_learns():
    sklearn = pytest.importorskip("sklearn.metrics")
    from zoo.train._scores import class_scores

    rng = np.random.default_rng(0)
    labels, predicted = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
    predicted[predicted == 3] = 0  # class 3 never predicted: its precision is 0 (0/0)
    scores = class_scores(predicted, labels, ["a", "b", "c", "d"])
    p, r, f, n = sklearn.precision_recall_fscore_support(labels, predicted, labels=[0, 1, 2, 3], zero_division=0)
    for i, name in enumerate("abcd"):
        got = scores["per_class"][name]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx((p[i], r[i], f[i], n[i]))
    assert scores["macro_f1"] == pytest.approx(sklearn.f1_score(labels, predicted, average="macro", zero_division=0))
    # A class neither present nor predicted does not count in the mean, as in scikit-learn.
    two = class_scores(np.array([0, 1, 1]), np.array([0, 1, 0]), ["a", "b", "c"])
    assert two["macro_f1"] == pytest.approx(sklearn.f1_score([0, 1, 0], [0, 1, 1], average="macro"))


def test_keep_best_pins_the_best_checkpoint_and_stops_the_trainer_early(linear_setup, tmp_path):
    """The linear model's weights fall by the learning rate each step: an evaluation of
    -sum(weights) rises after step 2 (the schedule's warmup makes step 1 the smallest
    move). Higher-is-better metrics watch the other way."""
    history = {}

    def evaluate(model):
        value = -float(jnp.sum(model.weight))
        history[len(history)] = value
        return {"loss": value if len(history) != 3 else value - 1.0, "accuracy": -value}  # step 2: the best loss

    evals = Evaluate(evaluate, every=1)
    saver = Checkpoint(tmp_path / "ckpt", every=0, keep=1)
    best = KeepBest("eval_loss", evals, saver, keep=True, patience=3, every=1)
    trainer, _ = run_trainer(linear_setup, [MetricsLog(tmp_path / "metrics.jsonl"), evals, best, saver])
    assert trainer.last_step == 5 and trainer.stop_reason.startswith("eval_loss has not improved for 3 evaluations")
    assert [step for step, _ in evals.results] == [0, 1, 2, 3, 4, 5]  # the stop step evaluated once
    assert (best.step, best.since) == (2, 3)
    # Saved when it improved (steps 1, 2); step 2 pinned beyond keep=1; nothing after.
    checkpointer = zoo.Checkpointer(tmp_path / "ckpt", read_only=True)
    assert checkpointer.steps() == [2]
    assert checkpointer.metadata(2)["best"] == {"metric": "eval_loss", "value": best.value, "step": 2, "since": 0}
    assert best.record(tmp_path / "ckpt")["checkpoint"] == str(tmp_path / "ckpt" / "2")
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    # Accuracy (higher is better) rises all the way: never stops, the last evaluation is the best.
    evals = Evaluate(lambda m: {"loss": 0.0, "accuracy": -float(jnp.sum(m.weight))}, every=2)
    accurate = KeepBest("eval_accuracy", evals, Checkpoint(tmp_path / "acc"), keep=False, patience=1, every=2)
    trainer, _ = run_trainer(linear_setup, [evals, accurate])
    assert trainer.stop_reason is None and accurate.step == STEPS and accurate.mode == "max"


def test_a_non_finite_loss_stops_the_trainer_naming_the_last_checkpoint(linear_setup, tmp_path):
    mesh, opt, model, step, compiled = linear_setup

    def poisoned(i):
        return {"x": np.full((BATCH, 4), np.nan if i == 4 else 1.0, np.float32)}

    saver = Checkpoint(tmp_path / "ckpt", every=2)
    with jax.set_mesh(mesh):
        trainer = Trainer(step, poisoned, steps=STEPS, hooks=[saver])
        trainer.compiled = compiled
        with pytest.raises(zoo.train.RunStopped, match=r"step 4: the training loss is nan: .* step 2 in "):
            trainer.run(model, step.init(model))
    assert zoo.Checkpointer(tmp_path / "ckpt", read_only=True).steps() == [2]


def test_a_loss_metric_named_as_the_runs_own_row_is_refused(linear_setup):
    """A loss whose metrics dict names `loss` (a key of the run's own metrics row) would
    overwrite the logged loss: refused at the first step, naming the fix."""
    mesh, opt, model, _, _ = linear_setup

    def with_metric(model, batch):
        losses = linear_loss(model, batch)
        return losses, jnp.ones_like(losses), {"loss": losses}

    with jax.set_mesh(mesh):
        step = zoo.TrainStep(with_metric, opt.build(STEPS), microbatches=2)
        trainer = Trainer(step, batch_at, steps=STEPS)
        with pytest.raises(ValueError, match=r"metrics named \['loss'\], which the run's own row holds .*rename them"):
            trainer.run(model, step.init(model))


# --- the typed config ----------------------------------------------------------------------------


def test_run_config_round_trips_through_its_flat_form():
    lora = zoo.lora.LoraConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), modules_to_save=("head",))
    config = RunConfig(
        model="encoder", steps=40, batch_size=16, microbatches=2, mesh={"data": 4, "model": 2}, rules="tp",
        data=DataConfig(source="docstrings", seq_len=32, eval_size=64),
        optimizer=OptimizerConfig(name="lion", lr=3e-4, schedule="linear", warmup=2, weight_decay=0.1),
        lora=lora, model_config={"d_model": 32, "dropout": 0.1}, checkpoint_every=10, tensorboard="tb",
    )  # fmt: skip
    flat = config.to_dict()
    # The flags' names and spellings: what `zoo train --config` and `--resume` read.
    assert (
        flat["batch_size"] == 16 and flat["optimizer"] == "lion" and flat["lr"] == 3e-4 and flat["data"] == "docstrings"
    )
    assert flat["mesh"] == "data=4,model=2" and flat["model_config"] == "d_model=32,dropout=0.1"
    assert flat["lora"].startswith("r=4,alpha=8") and "resume_step" not in flat and "overwrite" not in flat
    back = RunConfig.from_dict(json.loads(json.dumps(flat)))
    assert back == config
    assert RunConfig.from_dict(RunConfig(model="mlp", steps=3, batch_size=8).to_dict()) == RunConfig(
        model="mlp", steps=3, batch_size=8
    )


def test_run_config_checks_name_the_field():
    with pytest.raises(ConfigError, match=r"RunConfig\.steps must be an integer >= 1 \(or None\), got 0"):
        RunConfig(model="mlp", steps=0, batch_size=8)
    with pytest.raises(ConfigError, match=r"RunConfig\.eval_every must be an integer >= 0"):
        RunConfig(model="mlp", steps=3, batch_size=8, eval_every=-1)
    with pytest.raises(ConfigError, match=r"RunConfig\.dtype must be 'float32' or 'bfloat16'"):
        RunConfig(model="mlp", steps=3, batch_size=8, dtype="float16")
    with pytest.raises(ConfigError, match=r"warmup 3 must be below the run's 3 steps"):
        RunConfig(model="mlp", steps=3, batch_size=8, optimizer=OptimizerConfig(warmup=3))
    with pytest.raises(ConfigError, match=r"DataConfig\.seq_len must be an integer >= 2"):
        DataConfig(seq_len=1)
    with pytest.raises(ConfigError, match=r"RunConfig\.keep_best must be an evaluation metric \(eval_loss, "):
        RunConfig(model="mlp", steps=3, batch_size=8, keep_best="f1")
    with pytest.raises(ConfigError, match=r"RunConfig\.early_stop counts evaluations .* set RunConfig\.eval_every"):
        RunConfig(model="mlp", steps=3, batch_size=8, early_stop=2, eval_every=0)
    with pytest.raises(
        ConfigError,
        match=r"RunConfig\.keep_best: the mlp measures no eval_accuracy; watch one of "
        r"\['eval_loss'\]",
    ):
        RunConfig(model="mlp", keep_best="accuracy").resolved()
    assert RunConfig(model="encoder", keep_best="macro_f1", early_stop=2).resolved().keep_best == "macro_f1"
    with pytest.raises(ConfigError, match=r"unknown keys \['stepz'\]"):
        RunConfig.from_dict({"model": "mlp", "steps": 3, "batch_size": 8, "stepz": 4})
    assert isinstance(ConfigError("x"), ValueError)


@pytest.mark.parametrize(
    ("changes", "field", "flag"),
    [
        ({"rules": "nope"}, "unknown RunConfig.rules 'nope'", "unknown --rules 'nope'"),
        ({"mesh": {"data": 64}}, "RunConfig.mesh data=64 needs 64 devices", "--mesh data=64 needs 64 devices"),
        (
            {"model": "transformer", "data": DataConfig(source="missing.jsonl")},
            "DataConfig.source missing.jsonl: no such file",
            "--data missing.jsonl: no such file",
        ),
        ({"resume": True}, "RunConfig.resume: no checkpoint in", "--resume: no checkpoint in"),
    ],
)
def test_run_errors_name_the_field_and_the_cli_shows_the_flag(tmp_path, monkeypatch, changes, field, flag):
    """`zoo.train.run`'s checks name the `RunConfig` field a Python caller set, never a
    flag; `zoo train` shows the same check with its flag (`flag_names`, from the fields' Flags)."""
    from zoo._cli._common import flag_names

    monkeypatch.chdir(tmp_path)
    settings = {"model": "mlp", "steps": 3, "batch_size": 8, "microbatches": 1, "output": str(tmp_path / "run")}
    config = RunConfig(**(settings | changes))
    with pytest.raises(ConfigError) as e:
        zoo.train.run(config)
    message = str(e.value)
    assert field in message and "--" not in message, message
    assert flag in flag_names(message)


def test_evaluation_every_tenth_of_the_run_by_default():
    assert RunConfig(model="mlp", steps=300, batch_size=8).eval_interval == 30
    assert RunConfig(model="mlp", steps=5, batch_size=8).eval_interval == 1
    assert RunConfig(model="mlp", steps=300, batch_size=8, eval_every=0).eval_interval == 0


# --- zoo.train.run -------------------------------------------------------------------------------


class Crash(Hook):
    """Stops a run after step `at` as a crash would (the checkpoint of `at` is saved first)."""

    def __init__(self, at: int):
        self.every = at

    def __call__(self, state):
        raise RuntimeError(f"crash after step {state.step}")


def _mlp(output: Path, **overrides) -> RunConfig:
    """The tiny mlp run of the suite (tiny_runs.TINY_MLP with conftest's finished_mlp_run's
    model): the same shapes, so the same compiled programs."""
    values = dict(model="mlp", steps=6, batch_size=8, microbatches=1, devices=2, checkpoint_every=3,
                  output=str(output), quiet=True, data=DataConfig(eval_size=16),
                  model_config={"width": 16, "depth": 2})  # fmt: skip
    return RunConfig(**(values | overrides))


def test_the_runs_lora_program_is_compiled_for_each_placement():
    """A run's `add_lora` is one compiled program cached per model: a second run in the
    process on another mesh gets a program of its own (it used to get the first one's, which
    refused its arguments' shardings)."""
    from helpers import tiny_decoder

    from zoo.train._adapters import add_lora

    config = zoo.lora.LoraConfig(r=2, target_modules=("q_proj",))
    for n in (1, 2):
        mesh = data_mesh(n)
        with jax.set_mesh(mesh):
            model = zoo.shard(tiny_decoder(jax.random.key(0)), zoo.rules("dp"), mesh)
            adapted = add_lora(model, config, seed=0)
        assert {x.sharding.mesh for x in jax.tree.leaves(eqx.filter(adapted, eqx.is_array))} == {mesh}


def test_the_runs_lora_program_shares_the_base_and_adds_the_library_branches():
    """A run's `add_lora` hands the base's own arrays back (a program's output is a copy:
    a second base beside the task's, 4 GB at 1B) and its branches are `zoo.lora.add_lora`'s."""
    from helpers import tiny_decoder

    from zoo.train._adapters import LORA_KEY_SALT, add_lora

    config = zoo.lora.LoraConfig(r=2, target_modules="all-linear")
    model = tiny_decoder(jax.random.key(0))
    adapted = add_lora(model, config, seed=3)
    want = zoo.lora.add_lora(model, config, key=jax.random.fold_in(jax.random.key(3), LORA_KEY_SALT))
    base = {id(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))}
    leaves = jax.tree.leaves(eqx.filter(adapted, eqx.is_array))
    shared = [x for x in leaves if id(x) in base]
    assert len(shared) == len(base)
    assert jax.tree.structure(adapted) == jax.tree.structure(want)
    for got, expected in zip(leaves, jax.tree.leaves(eqx.filter(want, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_the_runs_initialiser_is_compiled_for_each_mesh():
    """A run's model initialiser is one compiled program cached per configuration: a
    second build in the process under another mesh gets one of its own (it used to get the
    first one's, whose arrays lay on the first mesh: `zoo inspect --devices 8` then
    `--devices 2` in one process failed with 'incompatible devices')."""
    from zoo.train._task import init_compiled

    def build(k):
        return zoo.nn.Linear(4, 3, key=k)

    for n in (4, 2):
        mesh = data_mesh(n)
        with jax.set_mesh(mesh):
            model = init_compiled(("linear", 4, 3), build, jax.random.key(0))
        assert {x.sharding.mesh for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {mesh}


@pytest.mark.slow
def test_a_resumed_run_sees_the_same_batches_and_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
    whole = zoo.train.run(_mlp(tmp_path / "whole"))
    with pytest.raises(RuntimeError, match="crash after step 3"):
        zoo.train.run(_mlp(tmp_path / "cut"), hooks=[Crash(3)])
    assert zoo.Checkpointer(tmp_path / "cut" / "checkpoints", read_only=True).steps() == [3]
    resumed = zoo.train.run(_mlp(tmp_path / "cut", resume=True))
    assert capsys.readouterr().out.count("[") == 0  # quiet: no phase lines, no header
    assert resumed.summary["resumed_from"] == 3
    # Judged from the run's start (its metrics' step-0 evaluation), not from where it resumed.
    assert resumed.summary["stages"][0]["name"] == "resumed at step 3"
    assert resumed.summary["stages"][0]["loss"] != whole.summary["eval_before"]["loss"]
    assert resumed.summary["eval_before"]["loss"] == whole.summary["eval_before"]["loss"]
    assert resumed.summary["loss_fell"] is whole.summary["loss_fell"]
    for a, b in zip(jax.tree.leaves(eqx.filter(whole.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(resumed.model, eqx.is_array))):  # fmt: skip
        # The same program on the same batches from the checkpointed (exact) state: the same
        # sums in the same order, the same bits (and no room for AdamW's amplification).
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cut = read_rows(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in cut if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # no step twice
    first = {r["step"]: r["loss"] for r in read_rows(tmp_path / "whole" / "metrics.jsonl") if r["kind"] == "train"}
    assert {r["step"]: r["loss"] for r in cut if r["kind"] == "train"} == first
    # config.json records the run as it trained: every default resolved, the mesh it used.
    config = json.loads((tmp_path / "cut" / "config.json").read_text())
    expected = _mlp(tmp_path / "cut", resume=True).resolved("train")
    assert RunConfig.from_dict(config) == dataclasses.replace(expected, mesh={"data": 2})


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(tmp_path, capsys):
    """A run that crashed before any checkpoint (the default: none until its end) is resumed:
    it starts again from step 0, says so, and ends as a fresh run does (the crashed run's
    rows gone). A finished run without checkpoints is refused, its outputs kept."""
    config = _mlp(tmp_path / "cut", steps=4, checkpoint_every=0)
    fresh = zoo.train.run(_mlp(tmp_path / "fresh", steps=4, checkpoint_every=0))
    with pytest.raises(RuntimeError, match="crash after step 2"):
        zoo.train.run(config, hooks=[Crash(2)])
    assert not (tmp_path / "cut" / "checkpoints").exists()
    restarted = zoo.train.run(dataclasses.replace(config, resume=True))
    assert "stopped before its first checkpoint; it starts again from step 0" in capsys.readouterr().err
    for a, b in zip(jax.tree.leaves(eqx.filter(fresh.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(restarted.model, eqx.is_array)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["step"] for r in read_rows(tmp_path / "cut" / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert not json.loads((tmp_path / "cut" / "config.json").read_text()).get("resume")
    # The mlp keeps its weights as a final checkpoint; a model exported as a Hugging Face
    # folder keeps none (--checkpoint-every 0): as here once that checkpoint is gone.
    shutil.rmtree(tmp_path / "cut" / "checkpoints")
    with pytest.raises(ConfigError, match=r"finished without checkpoints .*cannot be continued; train further from"):
        zoo.train.run(dataclasses.replace(config, resume=True, steps=6))
    assert (tmp_path / "cut" / "summary.json").exists()


def test_a_first_ctrl_c_stops_at_the_step_and_a_second_one_at_once():
    """Ctrl-C during training is noted (the run saves the step in progress and stops there,
    as on SIGTERM); a second Ctrl-C raises KeyboardInterrupt at once; the handler is given
    back after."""
    import os
    import signal

    from zoo.train._trainer import Preemption

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's (xdist's workers ignore it)
    try:
        with Preemption(enabled=True) as preemption:
            assert not preemption.stop_at(1)  # the loop runs
            os.kill(os.getpid(), signal.SIGINT)
            assert preemption.interrupted and preemption.stop_at(2)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_run_whose_eval_loss_rises_keeps_its_best_checkpoint_and_stops_early(tmp_path):
    """The mlp at a learning rate 100 times its own: the held-out loss falls, then rises
    and jumps. The run keeps the checkpoint of its lowest evaluation, stops once three
    evaluations in a row did not beat it, ends as a run ends (final evaluation, end
    checkpoint, summary) and says so; a run resumed from the best checkpoint starts there."""
    config = _mlp(tmp_path / "run", steps=24, eval_every=2, checkpoint_every=0, keep=1, keep_best="eval_loss",
                  early_stop=3, optimizer=OptimizerConfig(lr=0.3, warmup=0, schedule="constant"))  # fmt: skip
    summary = zoo.train.run(config).summary
    rows = read_rows(tmp_path / "run" / "metrics.jsonl")
    losses = {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval" and r["step"] > 0}
    best = min(losses, key=losses.get)
    stop = best + 3 * 2
    assert stop < 24 and max(losses) == stop  # three evaluations after the best, then no more training
    assert max(r["step"] for r in rows if r["kind"] == "train") == stop
    assert summary["stopped_early"] == {
        "step": stop, "reason": f"eval_loss has not improved for 3 evaluations (best {losses[best]:.6g} at step {best})"
    }  # fmt: skip
    assert summary["last_step"] == stop and summary["steps"] == 24 and summary["eval_after"]["loss"] == losses[stop]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert summary["best"] == {"metric": "eval_loss", "mode": "min", "value": losses[best], "step": best,
                               "evaluations_since": 3, "checkpoint": str(checkpoints / str(best))}  # fmt: skip
    # The mlp's run saves its end anyway (no Hugging Face folder); keep=1 and the best pinned.
    assert zoo.Checkpointer(checkpoints, read_only=True).steps() == [best, stop]
    resumed = zoo.train.run(dataclasses.replace(config, resume_step=best, steps=best + 1, overwrite=True,
                                                early_stop=0, keep_best=None))  # fmt: skip
    assert resumed.summary["resumed_from"] == best and resumed.summary["stopped_early"] is None


@pytest.mark.slow
def test_phase_lines_arrive_in_order_and_before_the_run_ends_through_a_pipe(tmp_path):
    """stdout a pipe (block-buffered unless flushed): each phase line arrives while the run
    is still working, in order, with rising elapsed seconds."""
    cmd = [sys.executable, "-m", "zoo", "--no-compile-cache", "train", "mlp", "--devices", "2", "--steps", "4",
           "--batch-size", "8", "--microbatches", "1", "--eval-size", "16", "--output", str(tmp_path / "run")]  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    arrivals = []
    for line in proc.stdout:
        arrivals.append((time.perf_counter(), line.rstrip("\n")))
    proc.wait(timeout=300)
    end = time.perf_counter()
    assert proc.returncode == 0, arrivals
    phases = [(t, line) for t, line in arrivals if line.startswith("[") and "s] " in line]
    names = [line.split("s] ", 1)[1] for _, line in phases]
    assert [n.split()[0] for n in names] == ["loading", "evaluating", "compiling", "training"], names
    seconds = [float(line[1 : line.index("s]")]) for _, line in phases]
    assert seconds == sorted(seconds)
    assert phases[0][0] < end - 0.5  # the first arrived while loading/compiling still had to run
    lines = [line for _, line in arrivals]
    assert lines.index(phases[-1][1]) < next(i for i, line in enumerate(lines) if line.startswith("loss fell"))


def test_zoo_train_is_public_and_the_cli_errors_are_config_errors():
    assert "train" in zoo.__all__ and all(hasattr(zoo.train, name) for name in zoo.train.__all__)
    from zoo._cli import CLIError

    assert issubclass(CLIError, ConfigError) and issubclass(ConfigError, ValueError)
    assert issubclass(zoo.train.RunStopped, RuntimeError) and issubclass(zoo.train.Preempted, RuntimeError)


def test_zoo_train_tensorboard_flag_writes_the_runs_scalars(tmp_path):
    """`zoo train --tensorboard DIR`: DIR's event files hold every step's loss and lr and
    every evaluation, as metrics.jsonl does."""
    from helpers import zoo_main
    from tiny_runs import TINY_MLP

    out, tb = tmp_path / "run", tmp_path / "tb"
    rc, _, err = zoo_main("train", "mlp", *TINY_MLP, "--model-config", "width=16,depth=2", "--steps", "4",
                          "--eval-every", "2", "--output", str(out), "--tensorboard", str(tb))  # fmt: skip
    assert rc == 0, err
    scalars = _tensorboard_scalars(tb)
    rows = read_rows(out / "metrics.jsonl")
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert sorted(scalars["loss"]) == sorted(train) == [1, 2, 3, 4]
    assert all(scalars["lr"][i] == pytest.approx(train[i]["lr"], rel=UNIT_ROUNDOFF) for i in train)  # float32
    evals = {r["step"]: r["eval_loss"] for r in rows if r["kind"] == "eval"}
    assert sorted(scalars["eval_loss"]) == sorted(evals) == [0, 2, 4]


def _imported_modules(path: Path, package: str) -> list[str]:
    """The absolute names of every module `path` (a module of `package`) imports, also
    inside functions: `from .. import x` counts as importing `..x`."""
    import ast

    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_library_module_imports_the_cli(tmp_path):
    """The library knows nothing of the CLI: no module under zoo/ but zoo/_cli/ (and
    `python -m zoo`'s zoo/__main__.py) imports zoo._cli, and importing zoo and every
    module of zoo.train, then a RunConfig's round trip through its flat form with LoRA,
    loads none of it."""
    root = Path(zoo.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] == "_cli" or rel == Path("zoo/__main__.py"):
            continue
        module_parts = rel.with_suffix("").parts
        package = ".".join(module_parts if path.name == "__init__.py" else module_parts[:-1])
        package = package.removesuffix(".__init__")
        bad = [m for m in _imported_modules(path, package) if m == "zoo._cli" or m.startswith("zoo._cli.")]
        offenders += [f"{rel}: {m}" for m in bad]
    assert not offenders, offenders
    # The check sees the CLI however a module of zoo.train would spell it.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .._cli._lock import run_lock\n    from .. import _cli\n    import zoo._cli\n")
    assert {"zoo._cli._lock", "zoo._cli"} <= set(_imported_modules(probe, "zoo.train"))
    code = (
        "import pkgutil, importlib, sys, zoo, zoo.train\n"
        "for m in pkgutil.iter_modules(zoo.train.__path__, 'zoo.train.'): importlib.import_module(m.name)\n"
        "c = zoo.train.RunConfig(model='mlp', steps=1, batch_size=8, lora=zoo.lora.LoraConfig(r=2))\n"
        "assert zoo.train.RunConfig.from_dict(c.to_dict()).lora == c.lora\n"
        "print(sorted(m for m in sys.modules if m.startswith('zoo._cli')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
