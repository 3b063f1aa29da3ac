"""A run's build stage: the task of the model on its data, LoRA branches, placement on the
mesh, the training step and its optimizer state (`build_run` → `BuiltRun`: what `run`
trains and `inspect` compiles), and the files that record it (`write_run_files`).

`build_task` builds the task of any registered model (`zoo.train.model_spec`), on one of
its built-in data sets or on a user's data file (`zoo.train._user_data`): `zoo train`,
`zoo finetune`, `zoo info` and `zoo inspect` all build their model there, from a
`RunConfig`, so the same settings give the same model."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

from .._checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError
from .._distributed import global_batch, local_rows
from .._rules import PlacementError, shard
from .._step import TrainStep
from .._tree import human_bytes, is_inexact_array_like, on_shapes_too, tree_bytes, tree_size
from ..lora import LoraLinear
from ..lora import modules as lora_modules
from ..lora import trainable as lora_trainable
from ..models import next_token_loss
from ..models._loss import router_loss_coef
from ..nn import example_keys
from ..nn._four_bit_linear import DEFAULT_BLOCK_SIZE
from ._adapters import adapters_task, add_lora, quantize_base, read_adapter_records, stacked
from ._config import RunConfig, check_fits_model
from ._errors import ConfigError
from ._folder import RUN_FILES, claim
from ._grpo import grpo_task
from ._head import LABELS_NAME
from ._output import write_json
from ._plan import RunPlan, fit_batch, fit_epochs
from ._registry import SIZES, model_spec
from ._task import Task
from ._text import quantize_kind
from ._user_data import check_data_file, check_fingerprint, user_data_task


@dataclasses.dataclass
class BuiltRun:
    """Everything a run trains with, built on its mesh.

    **Fields:**

    - `task`: the model on its data (`Task`).
    - `model`: the placed model, with LoRA branches when fine-tuned (after `resume`: the
      restored one).
    - `step`: the `zoo.TrainStep`; `opt_state`, `key`: its optimizer state and the run's
      PRNG key (restored on resume).
    - `rates`: the learning rate of each step (index `step - 1`).
    - `fingerprint`: the data files' digests, saved with each checkpoint.
    - `parameters`, `model_bytes`: the base model's size, before LoRA.
    """

    task: Task
    model: Any
    step: TrainStep
    opt_state: Any
    key: Any
    rates: np.ndarray
    fingerprint: dict[str, Any]
    parameters: int
    model_bytes: int
    batch_size: int
    dropout: bool
    mesh: Any
    own_rows: Any = None
    config: Any = None  # the plan's RunConfig, its derived batch fitted to the data's rows

    def batch_at(self, i: int) -> dict:
        """The batch of step `i`: the task's source gives this process's rows of it
        (`Task.batch_at`), assembled into the global batch across processes. A function of
        the step alone, so a resumed run sees the batches it would have seen."""
        batch = self.task.batch_at(i, self.batch_size, mesh=self.mesh)
        if self.dropout:  # one key per example: the masks do not depend on the device split
            keys = example_keys(jax.random.fold_in(self.key, i), self.batch_size)
            batch["dropout_key"] = keys if self.own_rows is None else keys[self.own_rows]
        if self.own_rows is not None:
            batch = global_batch(batch, self.mesh)
        return batch


def build_task(config: RunConfig, *, rules, mesh) -> Task:
    """The task of model `config.model` (`zoo.train.model_spec`) on data
    `config.data.source`.

    **Arguments:**

    - `config`: the run's `RunConfig` with its defaults applied
      (`config.resolved(command)`, what `zoo.train.run` builds from). `data.source` None
      builds the model alone (`zoo info`, `zoo inspect`): no data is read, and the task's
      batches are random ones of the real shapes and dtypes.
    - `rules`, `mesh`: pretrained weights are read straight onto `mesh` under `rules`
      (`zoo.hf.from_pretrained`); a model built from scratch is left unplaced.

    **Returns:** the `Task`. Raises `zoo.train.ConfigError` for settings the model does
    not take (an unknown name or data set, a data file it cannot read or train on,
    `--init` for a model without pretrained weights or of another architecture, a dtype
    it does not compute in).
    """
    if config.steps is None or config.batch_size is None:
        raise ConfigError("build_task takes a config with its defaults applied: pass config.resolved(command)")
    spec = model_spec(config.model)
    check_data_file(config)  # a data set of the model's, or a file it trains on
    check_fits_model(config, spec)  # as `resolved` does: a config filled in by hand too
    # Every example holds at least one 4-byte value per token: a held-out set that cannot
    # fit even so is refused before it is drawn (a bound, so never a false refusal).
    check_rows_fit("DataConfig.eval_size", config.data.eval_size, 4 * (config.data.seq_len or 1), "the held-out set")
    try:
        if config.objective == "grpo" and config.data.source is not None:  # prompts, completed by the policy
            return grpo_task(config, rules=rules, mesh=mesh)
        if config.data.source is not None and config.data.source not in spec.datasets:
            adapters = read_adapter_records(config.data.source) if spec.kind == "lm" else None
            if adapters is not None:  # several adapters, each on its own records
                return adapters_task(config, adapters, rules=rules, mesh=mesh)
            return user_data_task(config, rules=rules, mesh=mesh)
        return spec.build(config, rules=rules, mesh=mesh)
    except MemoryError as e:
        if not config.data.eval_size:
            raise
        raise ConfigError(
            f"DataConfig.eval_size {config.data.eval_size}: the held-out examples do not fit in memory ({e}); lower it"
        ) from e


def _unplaceable(c: RunConfig, error: PlacementError, config: dict[str, Any] | None) -> str:
    """Why the run's rules cannot place its model, and the fields that would: other rules,
    or a model config size the mesh divides when one of the model's sizes is the culprit
    (the library's own advice, to edit a rules mapping, is no setting of a run)."""
    fix = "choose other RunConfig.rules (dp replicates every weight)"
    kind, block, _ = quantize_kind(c.quantize) if c.quantize is not None else (None, None, False)
    if kind in DEFAULT_BLOCK_SIZE and error.size is not None and (error.where or "").endswith(".scale"):
        # A 4-bit layer's scales hold one row per block of inputs: the block, not a model size, sets that count.
        inputs = error.size * (block or DEFAULT_BLOCK_SIZE[kind])
        fits = [b for b in range(2, inputs + 1, 2) if inputs % b == 0 and (inputs // b) % error.divisor == 0]
        block_fix = f"RunConfig.quantize {kind}:{fits[-1]}" if fits else "RunConfig.quantize int8"
        return (
            f"RunConfig.rules {c.rules} cannot place the {c.model} on this mesh: {error.problem} (the 4-bit scales' "
            f"blocks of inputs, {inputs} inputs in blocks of {inputs // error.size}); {fix}, or {block_fix}"
        )
    if error.size is not None:
        keys = [k for k, v in (config or {}).items() if v == error.size and k in SIZES]
        if keys:
            fix += f", or set RunConfig.model_config {keys[0]} to a multiple of {error.divisor}"
    return f"RunConfig.rules {c.rules} cannot place the {c.model} on this mesh: {error.problem}; {fix}"


def training_step(c: RunConfig, loss_fn: Any, model: Any, *, per_adapter: bool = False) -> TrainStep:
    """The `zoo.TrainStep` of a run: its task's `loss_fn`, the run's optimizer (skipping
    non-finite steps when asked; `per_adapter`: several adapters, each clipped at its own
    norm), the LoRA branches (and `modules_to_save`) or every weight trainable. What a
    checkpoint's `"params"` and `"opt_state"` are the state of."""
    optimizer = c.optimizer.build(c.steps, per_adapter=per_adapter)
    if c.skip_nonfinite:  # a step whose gradients hold a NaN/inf leaves weights and moments as they were
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=c.steps + 1)
    trainable = lora_trainable(model, c.lora) if c.lora is not None else is_inexact_array_like
    if loss_fn is next_token_loss and router_loss_coef(model) is not None:
        # A mixture of experts training its router's loss: that loss logged too (`aux_loss`).
        loss_fn = functools.partial(next_token_loss, metrics=True)
    return TrainStep(loss_fn, optimizer, microbatches=c.microbatches, trainable=trainable, mode=c.mode, preset=c.rules)


def _check_experts_split(c: RunConfig, model: Any, rules: Any) -> None:
    """Refuse rules that split a mixture of experts' `expert` axis (`ep`) for a model with
    no experts: the mesh axis would only repeat the same work."""
    from ..nn import ExpertLinear

    def expert(m: Any) -> bool:
        return isinstance(m, ExpertLinear)

    if not rules.get("expert") or any(map(expert, jax.tree.leaves(model, is_leaf=expert))):
        return
    raise ConfigError(
        f"RunConfig.rules {c.rules} splits a mixture of experts' experts over {rules['expert']!r}, but the "
        f"{c.model} has no experts (num_experts): its devices there would repeat the same work; use dp, fsdp or tp"
    )


def build_run(plan: RunPlan, mesh: jax.sharding.Mesh, rules: Any) -> BuiltRun:
    """Build `plan`'s task on `mesh` (placed by `rules`), add its LoRA branches, make its
    step and optimizer state. Writes nothing.

    **Raises:** `ConfigError` for a setting the model cannot take."""
    c = plan.config
    lcfg = c.lora
    task = build_task(c, rules=rules, mesh=mesh)
    if "batch_size" in c.derived and hasattr(task.train_source, "__len__"):  # a data file: its rows bound the batch
        c = fit_batch(c, rows=len(task.train_source))
    c = fit_epochs(c, rows=len(task.train_source) if hasattr(task.train_source, "__len__") else None)
    # A training batch holds the rows the held-out examples hold: refuse one that cannot fit.
    check_rows_fit("RunConfig.batch_size", c.batch_size, bytes_per_row(task.eval_data or {}), "one batch")
    if lcfg is not None and task.kind == "regression":
        raise ConfigError("zoo finetune: the mlp has no pretrained weights to adapt; train it with zoo train mlp")
    if c.probe and not task.classifier:
        raise ConfigError(f"RunConfig.probe fits a classifier's head; {c.model} has none: drop RunConfig.probe")
    # The base quantised (--quantize) once the branches are on it: they are made from the float weights.
    model = task.model if lcfg is None else quantize_base(add_lora(task.model, lcfg, c.seed), c)
    if task.adapter_names is not None:  # K adapters, each starting as a one-adapter run of this seed, one base
        model = stacked(model, task.adapter_names)
    if lcfg is not None and c.pooling == "mean" and any(n.startswith("head") for n in lora_modules(model, LoraLinear)):
        raise ConfigError(
            "RunConfig.lora: a mean-pooling classifier's head is saved whole (adapter/head.safetensors), so "
            "it takes no LoRA branch: leave it out of targets (save=head trains it in full), or use "
            "RunConfig.pooling cls"
        )
    _check_experts_split(c, model, rules)
    try:
        model = shard(model, rules, mesh)
    except PlacementError as e:
        raise ConfigError(_unplaceable(c, e, task.config)) from e
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from e
    step = training_step(c, task.loss_fn, model, per_adapter=task.adapter_names is not None)
    config = task.config or {}
    dropout = (
        bool(lcfg.lora_dropout) if lcfg is not None else bool(config.get("dropout") or config.get("attention_dropout"))
    )
    return BuiltRun(
        task=task,
        model=model,
        step=step,
        opt_state=on_shapes_too(step.init, model),
        key=jax.random.key(c.seed),
        rates=c.optimizer.rates(c.steps),
        fingerprint=task.fingerprint,
        parameters=tree_size(task.model),
        model_bytes=tree_bytes(task.model),
        batch_size=c.batch_size,
        dropout=dropout,
        mesh=mesh,
        config=c,
        own_rows=local_rows(c.batch_size, mesh) if jax.process_count() > 1 else None,
    )


def write_run_files(plan: RunPlan, built: BuiltRun, *, main: bool) -> None:
    """Create the run's folder and write config.json and (a classifier) labels.json
    (process 0), once the run is built: a run that fails before leaves no folder."""
    plan.output.mkdir(parents=True, exist_ok=True)
    if not main:
        return
    claim(plan.output, plan.checkpoints, RUN_FILES)  # the run's files listed in its folder's marker first
    write_json(plan.output / "config.json", plan.config.to_dict())
    if built.task.label_names is not None:  # what predictions are called (`zoo.train.load_run`)
        claim(plan.output, plan.checkpoints, [LABELS_NAME])
        write_json(plan.output / LABELS_NAME, {"labels": list(built.task.label_names)})


# --------------------------------------------------------------------------- resume: a saved run's state restored
# A run's resume stage: the state of a checkpoint (by default the newest intact one) in
# place of the freshly built one, refused if the data files changed since.


def resume(plan: RunPlan, built: BuiltRun) -> tuple[int, Checkpointer | None]:
    """Restore `built`'s model, optimizer state and key from `plan`'s checkpoints when the
    run resumes (`config.resume`; `config.resume_step`, else the newest intact step, a
    damaged newer one skipped with a warning and deleted).

    **Returns:** `(start, checkpointer)`: the restored step (0 and None without resume) and
    the open `Checkpointer`, which the run's checkpoints continue in.
    **Raises:** `ConfigError` naming what cannot be restored and why."""
    c = plan.config
    if not c.resume:  # plan.check_checkpoints made sure there is one, before `steps`
        return 0, None
    # Keeping the best checkpoint, the run's Checkpoint hook rotates them itself (the best pinned).
    checkpointer = Checkpointer(plan.checkpoints, keep=None if c.keep_best else c.keep)
    params, frozen = built.step.partition(built.model)
    source = built.task.train_source
    more = source.checkpoint_like(c.batch_size) if hasattr(source, "checkpoint_like") else {}
    like = {"params": params, "opt_state": built.opt_state, "key": built.key, **more}
    try:
        (start, state, _), skipped = checkpointer.restore_intact(like, step=c.resume_step)
    except CheckpointError as e:
        first = str(e).splitlines()[0]
        if not isinstance(e, DamagedCheckpointError):
            hint = " (was it saved with other flags?)"  # a checkpoint that does not fit this run
        else:
            hint = "; start a new run (--overwrite)" if e.step is None else ""
        raise ConfigError(f"RunConfig.resume: {first}{hint}") from e
    if skipped:
        what = "; ".join(f"step {k}: {why}" for k, why in skipped)
        print(
            f"zoo: warning: --resume skipped damaged checkpoints ({what}); they are removed, resuming from step "
            f"{start}",
            file=sys.stderr,
            flush=True,
        )
    if start >= c.steps and c.epochs is not None:
        raise ConfigError(
            f"RunConfig.resume: the checkpoint is at step {start}, not before the {c.steps} steps of RunConfig.epochs "
            f"{c.epochs}; raise RunConfig.epochs to train further"
        )
    check_fingerprint(checkpointer.metadata(start), built.fingerprint, c.data.source, start)
    built.model = eqx.combine(state["params"], frozen)
    built.opt_state, built.key = state["opt_state"], state["key"]
    if more:  # GRPO: the rollout the next steps of its block reuse
        source.restore({k: state[k] for k in more})
    return start, checkpointer


# --------------------------------------------------------------------------- memory bounds
# Whether a run's batches and held-out examples can fit in this machine's memory: a row
# count far beyond it is refused with one line before anything is allocated, instead of a
# `MemoryError` naming terabytes.


def host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_rows_fit(field: str, rows: int, bytes_per_row: int | float, what: str) -> None:
    """Refuse `rows` rows of `bytes_per_row` bytes each when they alone exceed the host's
    memory: a `ConfigError` naming `field` (e.g. `RunConfig.batch_size`), the size and the
    largest count that fits. `what` says what the rows are ("one batch")."""
    memory = host_memory()
    if memory is None or bytes_per_row <= 0 or rows * bytes_per_row <= memory:
        return
    fits = max(1, int(memory // bytes_per_row))
    raise ConfigError(
        f"{field} {rows} makes {what} of {human_bytes(rows * bytes_per_row)} ({human_bytes(bytes_per_row)} a row), more than "
        f"this machine's {human_bytes(memory)} of memory; lower it (at most about {fits})"
    )


def bytes_per_row(arrays: dict[str, Any]) -> float:
    """The bytes of one row of a dict of arrays with a leading row axis (0 when empty)."""
    values = [np.asarray(v) for v in arrays.values()]
    rows = len(values[0]) if values and np.ndim(values[0]) else 0
    return sum(v.nbytes for v in values) / rows if rows else 0.0
