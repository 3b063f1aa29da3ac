"""`zoo.train.run`: a whole run from a `RunConfig`, the one behind `zoo train`, `zoo
finetune` and `zoo demo`; and `zoo.train.inspect`: the same run's training step, compiled
and not run (`zoo inspect`).

One straight line of stages, each in its own module: plan (`_plan`: settings, mesh,
folders) → build (`_build`: the task, LoRA, placement, the step; then the run's files and
the resumed state) →
evaluate first (`_evaluate`: and the linear probe) → compile the step once (the program
both run and inspected) → the `Trainer` with its hooks: metrics.jsonl, TensorBoard, the
console (`_console`), progress, evaluations, the best one (`_hooks.KeepBest`: kept, early stopping),
checkpoints, samples, then after the last step (or the one it stopped early at) the export
(`_export`: adapter or Hugging Face folder), the summary (`_summary`: summary.json,
loss.png) and the printed report.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._distributed import is_main_process
from .._inspect import collective_summary, collectives
from .._jit import ONCE_COMPILER_OPTIONS
from .._presets import rules as preset_rules
from .._step import TrainStep
from .._tree import tree_bytes
from ..lora import trainable as lora_trainable
from ..lora._named import lora_json
from ._build import build_run, resume, write_run_files
from ._config import RunConfig
from ._console import Header, Phases, Report, lora_layer_count
from ._errors import ConfigError, Interrupted, Preempted
from ._evaluate import Evaluator, TaskEvaluation, evaluation_rows, first_evaluation, plain
from ._export import Export
from ._folder import claim, run_lock
from ._grpo import RolloutMetrics, Rollouts
from ._hooks import (
    Checkpoint,
    Evaluate,
    MetricsLog,
    Progress,
    TensorBoard,
    decoder_sample,
    evaluation_at_start,
    watch,
)
from ._plan import RunPlan, check_checkpoints, make_mesh, plan_run
from ._preference import beta_warning
from ._saved_run import merge_run
from ._summary import RunRecord, Summary
from ._task import Task, abstract_models
from ._trainer import Hook, Preemption, Trainer


@dataclasses.dataclass
class RunResult:
    """What a run returns: its summary (as in summary.json), its folder, and the trained
    model (placed on the run's mesh; with LoRA adapters when fine-tuned)."""

    summary: dict[str, Any]
    output: Path
    model: Any = None


def run(
    config: RunConfig, *, hooks: Sequence[Any] = (), command: str | None = None, title: str | None = None
) -> RunResult:
    """Train `config.model` (every weight, or LoRA adapters when `config.lora` is set) on
    the devices jax has, writing into `config.output`: config.json (`config.to_dict()`),
    metrics.jsonl, loss.png, summary.json, checkpoints/, and adapter/ or model/ (a
    Hugging Face folder). Prints phase lines, a header, progress and the summary unless
    `config.quiet` (only process 0 prints and writes logs; every process trains and
    checkpoints).

    **Arguments:**

    - `config`: the `RunConfig`; its unset fields take the model's defaults for
      `command` (`config.resolved(command)`), as `zoo train`'s unset flags do.
    - `hooks`: more hooks for the `Trainer` (fired after the run's own: metrics.jsonl,
      TensorBoard, progress, evaluation, checkpoints, samples).
    - `command`: `"train"`, `"finetune"` or `"demo"`, whose defaults fill the config
      (default `"train"`, or `"finetune"` with LoRA); `title`: how the run names itself
      in its outputs (default: made from the command, the model and the data).

    **Returns:** a `RunResult`. **Raises:** `ConfigError` (a setting that cannot work,
    before anything is written), `RunStopped` (the loss or weights went non-finite),
    `Preempted` (SIGTERM: a checkpoint was saved; resume with `resume=True`).
    """
    plan = plan_run(config, devices=_devices(config), command=command, title=title)  # the config resolved, once
    merge_run(
        plan.config.init
    )  # a `zoo finetune` run as init: its merged model, written once (`_registry.merged_path`)
    # One run per folder, held before anything is read or written there. config.json is
    # written once the model is built: a run that fails before leaves no folder.
    with run_lock(plan.output, plan.checkpoints, main=is_main_process()):
        warning = beta_warning(plan.config.objective, plan.config.beta)
        if warning and is_main_process():  # quiet or not: a setting that defeats the run is never silent
            print(f"zoo: warning: {warning}", file=sys.stderr, flush=True)
        restart = check_checkpoints(plan.config, plan.output)
        if restart:  # a run stopped before its first checkpoint: trained again as a fresh one
            plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, resume=False))
            if is_main_process():  # quiet or not: what happened to the folder is never silent
                print(f"zoo: {restart}", file=sys.stderr, flush=True)
        return _run(plan, hooks)


def _devices(config: RunConfig) -> int:
    """The devices a run spans: `config.devices`, else every device jax has."""
    devices = config.devices or len(jax.devices())
    if devices > len(jax.devices()):
        raise ConfigError(f"RunConfig.devices {devices}: jax has {len(jax.devices())} ({jax.default_backend()})")
    return devices


def _run(plan: RunPlan, hooks: Sequence[Any]) -> RunResult:
    """The stages of a planned run, its folder locked."""
    c, t_start = plan.config, time.perf_counter()
    main = is_main_process()  # every process trains; process 0 prints and writes logs
    phase = Phases(t_start, quiet=c.quiet or not main)
    mesh, rules = make_mesh(plan.mesh_shape), preset_rules(c.rules)

    def early() -> Preempted:  # SIGTERM before the loop: nothing trained yet, stop at once
        return Preempted("SIGTERM before training started: nothing was trained or saved; rerun the same command")

    with jax.set_mesh(mesh), Preemption(enabled=True, early=early) as preemption:
        phase(f"loading {c.model} and its data...")
        built = build_run(plan, mesh, rules)
        if built.config is not None and built.config != c:  # a derived batch fitted to the data's rows
            plan = dataclasses.replace(plan, config=built.config)
            c = plan.config
        write_run_files(plan, built, main=main)
        start, checkpointer = resume(plan, built)
        record = RunRecord(plan, built, t_start, start=start)
        t_eval = time.perf_counter()
        if c.eval_before:
            phase("evaluating before training..." if start == 0 else f"evaluating the model of step {start}...")
        data_size = plan.mesh_shape["data"]
        evaluate = (
            Evaluator(
                built.task,
                mesh,
                evaluation_rows(
                    built.task,
                    built.model,
                    batch_size=c.batch_size,
                    microbatches=c.microbatches,
                    seq_len=c.data.seq_len,
                    data_size=data_size,
                ),
            )
            if built.task.evaluate is None
            else TaskEvaluation(built.task)
        )
        rollouts = built.task.train_source if isinstance(built.task.train_source, Rollouts) else None
        if rollouts is not None:  # the policy its batches sample: the model trained from here
            rollouts.follow(built.model)
        if c.eval_before:  # else training starts at once, as transformers' Trainer does by default
            record.stages = first_evaluation(evaluate, built.model, probe_steps=c.probe, start=start)
            record.before = {k: v for k, v in record.stages[0].items() if k != "name"}
            if start > 0:  # the run's own start judges it (loss_fell), not where it resumed
                record.before = evaluation_at_start(plan.output / "metrics.jsonl") or record.before
        record.seconds = {"load": t_eval - t_start, "evaluate_before": time.perf_counter() - t_eval}
        trainer = Trainer(
            built.step,
            built.batch_at,
            steps=c.steps,
            hooks=_hooks(plan, record, checkpointer, evaluate, phase, main, hooks),
            lr=lambda i: built.rates[i - 1],
            skip_nonfinite=c.skip_nonfinite,
            preemption=preemption,
            tokens_per_example=built.task.tokens_per_example if built.task.unit == "tokens" else None,
            step_metrics=None if rollouts is None else RolloutMetrics(rollouts),
            advice=nonfinite_advice(c, lambda k: built.task.batch_at(k, c.batch_size, mesh=mesh)),
        )
        phase("compiling the training step...")  # once: the program that runs is the one inspected
        t0 = time.perf_counter()
        try:
            compiled = trainer.compile(built.model, built.opt_state, start=start)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from e
        record.seconds["compile"] = time.perf_counter() - t0
        record.collectives = collectives(compiled, mesh=mesh)
        try:
            model, _ = trainer.run(built.model, built.opt_state, start=start)
        except Interrupted as e:  # Ctrl-C: the folder that --resume continues
            e.output = plan.output
            raise
    return RunResult(record.summary, plan.output, model)


def _hooks(
    plan: RunPlan,
    record: RunRecord,
    checkpointer,
    evaluate: Evaluator | TaskEvaluation,
    phase: Phases,
    main: bool,
    user_hooks: Sequence[Any],
) -> list[Any]:
    """The run's own hooks, in the order they fire, with `user_hooks` after the per-step ones."""
    c, built = plan.config, record.built
    task = built.task
    record.evaluations = Evaluate(
        lambda m: plain(evaluate(m, task.eval_data)),
        every=c.eval_interval,
        at_start=record.start == 0 and record.before is not None,
        first=record.before,
    )
    # A checkpointed run saves every `checkpoint_every` steps and its end; so does a
    # resumed one (its checkpoints continue).
    checkpointed = bool(c.resume or c.checkpoint_every)
    saver = Checkpoint(
        plan.checkpoints,
        every=c.checkpoint_every,
        keep=c.keep,
        at_end=checkpointed,
        extra={"key": built.key},
        more=getattr(task.train_source, "checkpoint_state", None),  # GRPO: the rollout its next steps reuse
        metadata={"model": c.model, **built.fingerprint},
        checkpointer=checkpointer,
        last_saved=record.start or None,
    )
    hooks: list[Any] = [MetricsLog(plan.output / "metrics.jsonl")]
    if isinstance(task.train_source, Hook):  # GRPO's rollouts follow the policy after every step
        hooks.insert(0, task.train_source)
    if c.tensorboard:
        logdir = Path(c.tensorboard).resolve()
        if main and logdir.is_relative_to(plan.output.resolve()):  # its event files are the run's to overwrite
            claim(plan.output, plan.checkpoints, [logdir.relative_to(plan.output.resolve()).as_posix() + "/"])
        hooks.append(TensorBoard(c.tensorboard))
    if not phase.quiet:
        hooks += [
            Header(record, phase),
            Progress(unit="tok" if task.unit == "tokens" else "ex", label="finetune" if c.lora else "train"),
        ]
    record.best = watch(c, record.evaluations, saver)  # after the evaluations, before the saves
    hooks += [record.evaluations, *([record.best] if record.best else []), saver]
    if task.kind == "lm" and task.adapter_names is None and c.sample_tokens:  # a decoder shows what it learned
        record.sample = decoder_sample(built.model, task, new_tokens=c.sample_tokens)
        hooks.append(record.sample)
    export = Export(plan, task, saver, checkpointed=checkpointed, main=main)
    record.outputs = export.outputs
    hooks += [*user_hooks, export, Summary(record, main=main)]
    if main:
        hooks.append(Report(record))
    return hooks


@dataclasses.dataclass
class Inspection:
    """A run's training step, built and compiled as `run` builds and compiles it, never run
    (`zoo.train.inspect`).

    **Fields:**

    - `config`: the `RunConfig` resolved (its `devices` and `mesh` filled in); `command`.
    - `task`: the model on its data (`Task`); `parameters`: the model's before LoRA (what
      summary.json reports).
    - `model`: the placed model the step trains (with its LoRA branches). Built from
      scratch, it is its shapes alone (`abstract_models`: `jax.ShapeDtypeStruct` leaves
      carrying their shardings), as is `opt_state`; pretrained weights are read.
    - `step`, `opt_state`, `batch`: the `zoo.TrainStep`, its optimizer state and the
      batch of step 1.
    - `mesh`, `collectives`: the run's mesh and the compiled step's collectives
      (`zoo.collectives`: what summary.json lists).
    """

    config: RunConfig
    command: str
    task: Task
    parameters: int
    model: Any
    step: TrainStep
    opt_state: Any
    batch: dict
    mesh: Any
    collectives: list

    def sizes(self) -> dict[str, Any]:
        """The model's sizes: `parameters` and `model_bytes` (before LoRA, as summary.json),
        `param_bytes` (with it), `trainable_bytes` (what the step trains), `lora` (the LoRA
        config, its scaling and the adapted modules; None without), `lora_layers` (the
        Linear layers with a branch, each layer of a stack counted, as the run's header
        says) and `adapter_bytes` (the adapters' own)."""
        lora = self.config.lora
        with jax.set_mesh(self.mesh):
            trained = self.step.partition(self.model)[0]
        return {
            "parameters": self.parameters,
            "model_bytes": tree_bytes(self.task.model),
            "param_bytes": tree_bytes(self.model),
            "trainable_bytes": tree_bytes(trained),
            "lora": None if lora is None else lora_json(self.model, lora),
            "lora_layers": None if lora is None else lora_layer_count(self.model),
            "adapter_bytes": tree_bytes(eqx.filter(self.model, lora_trainable(self.model))),
        }

    def summary(self) -> dict[str, Any]:
        """The collectives counted by kind and place (inside loops or not) and the mesh
        axes they span, as summary.json counts them."""
        return collective_summary(self.collectives)

    def budget(self) -> tuple[Any, Any]:
        """`(budget, sizes)`: the step's collective budget (its preset's,
        `zoo.TrainStep.budget_for`) and the sizes it is checked with (`Budget.breaches`)."""
        with jax.set_mesh(self.mesh):
            return self.step.budget_for(self.model), self.step.budget_sizes(self.model)


def inspect(config: RunConfig, *, command: str | None = None) -> Inspection:
    """The training step `run(config, command=command)` would compile: the same plan (the
    config resolved once, the mesh and the batch checked), model, LoRA branches,
    placement, trainable leaves, optimizer and batch of step 1, compiled but never run.
    Nothing is written and no checkpoint restored (a resumed run's state has the same
    shapes).

    **Arguments:**

    - `config`, `command`: as `run`'s. `config.data.source` None reads no data: the
      batches are random ones of the shapes the run's data set gives; a fine-tune of a
      model that needs `init` is built from scratch without one.

    **Returns:** an `Inspection`. **Raises:** `ConfigError` as `run` does.

    The program is compiled without LLVM's costly optimisations (about half the compile
    time on CPU): its collectives are the run's (tests/test_inspect_run.py holds them
    equal for every rules preset).
    """
    plan = plan_run(config, devices=_devices(config), command=command, weights=False)
    if config.data.source is None:  # no data read: random batches of the run's shapes
        data = dataclasses.replace(plan.config.data, source=None)
        plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, data=data))
    mesh, rules = make_mesh(plan.mesh_shape), preset_rules(plan.config.rules)
    # Shapes alone for a model built from scratch: the program needs no weight's value, and
    # a billion-parameter config is compiled without its gigabytes (or its optimizer's).
    with jax.set_mesh(mesh), abstract_models():
        built = build_run(plan, mesh, rules)
        batch = built.batch_at(1)  # as `Trainer.compile` of a run from step 0
        try:
            lowered = built.step.lower(built.model, built.opt_state, batch)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from e
        compiled = lowered.compile(compiler_options=ONCE_COMPILER_OPTIONS)
        found = collectives(compiled, mesh=mesh)
    return Inspection(
        plan.config,
        plan.command,
        built.task,
        built.parameters,
        built.model,
        built.step,
        built.opt_state,
        batch,
        mesh,
        found,
    )


# --------------------------------------------------------------------------- what a run that went non-finite suggests
# What a run that went non-finite suggests: the likely cause the run can see (a batch
# with no target token, a weight decay that overturns the weights), else the learning rate.


# Optimizers whose weight decay is scaled by the learning rate (decoupled, or added to the
# gradient): lr · weight_decay >= 1 moves each weight past zero every step.
_DECAYED = ("adamw", "sgd", "lion")


def nonfinite_advice(c: RunConfig, batch_at: Callable[[int], Any]) -> Callable[[int], str]:
    """The advice of a `RunStopped` at step `k`, as a function of `k` (`Trainer`'s
    `advice`): names the config fields to change (the CLI shows them as its flags).

    **Arguments:** `c`, the run's resolved config; `batch_at(k)`, the batch of step `k`
    (this process's rows, host arrays; read again only when a step failed)."""
    opt = c.optimizer

    def advice(step: int) -> str:
        weights = _weights(batch_at, step)
        if weights is not None and not np.any(weights[:, 1:]):
            return (
                f"The batch of step {step} holds no target token (every next-token weight is 0), so its loss is "
                "0/0: give every example a completion or assistant turn that fits in DataConfig.seq_len"
            )
        decay = opt.weight_decay or 0.0
        if opt.name in _DECAYED and opt.lr is not None and opt.lr * decay >= 1:
            return (
                f"OptimizerConfig.weight_decay {decay:g} times OptimizerConfig.lr {opt.lr:g} is {opt.lr * decay:g} "
                ">= 1, so each step pushes every weight past zero until it overflows: lower "
                "OptimizerConfig.weight_decay (typically 0.01 to 0.1)"
            )
        return (
            f"Lower OptimizerConfig.lr (now {opt.lr:g}), keep OptimizerConfig.clip > 0, or set "
            "RunConfig.skip_nonfinite to skip such steps"
        )

    return advice


def _weights(batch_at: Callable[[int], Any], step: int) -> np.ndarray | None:
    """The next-token weights of step `step`'s batch (None when it has none)."""
    try:
        batch = batch_at(step)
        weights = batch.get("weights") if isinstance(batch, dict) else None
        return None if weights is None or np.ndim(weights) != 2 else np.asarray(weights)
    except Exception:  # the advice must not hide the stop itself
        return None
