"""`zoo.train.run`: a whole run from a `RunConfig`, the one behind `zoo train`, `zoo
finetune` and `zoo demo`.

Build the task on the mesh → (LoRA) → place → evaluate → (fit a classifier's head on
frozen features) → compile the step once (the program both run and inspected) → train
with the `Trainer` and its hooks (progress, metrics.jsonl, evaluations, checkpoints,
TensorBoard) → evaluate → save the adapter or the model → loss.png, summary.json, and the
summary on stdout.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._config import RunConfig
from ._errors import ConfigError, Preempted
from ._evaluate import Evaluator, fit_head, head_metrics
from ._hooks import Checkpoint, Evaluate, MetricsLog, Progress, Sample, TensorBoard
from ._lock import previous_outputs, remove_outputs, run_lock
from ._lora import add_lora, lora_json
from ._mesh import check_rules_fit_mesh, make_mesh, mesh_text
from ._output import human_bytes, plot_losses, read_metrics, write_json
from ._preemption import Preemption
from ._report import collective_summary, tree_bytes, tree_size
from ._task import TaskSettings, build_task
from ._trainer import Trainer
from ._user_data import check_fingerprint, data_fingerprint

# What the tokenizer of a saved model needs next to its weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                    "sentence_bert_config.json")  # fmt: skip


@dataclasses.dataclass
class RunResult:
    """What a run returns: its summary (as in summary.json), its folder, and the trained
    model (placed on the run's mesh; with LoRA adapters when fine-tuned)."""

    summary: dict[str, Any]
    output: Path
    model: Any = None


def mesh_shape_of(config: RunConfig, devices: int) -> dict[str, int]:
    """The mesh a run uses: `config.mesh`, or every device on `data`."""
    if config.mesh is None:
        return {"data": devices}
    total = math.prod(config.mesh.values())
    if total > devices:
        raise ConfigError(f"--mesh {mesh_text(config.mesh)} needs {total} devices but only {devices} were asked for; "
                          "raise --devices")  # fmt: skip
    return dict(config.mesh)


def check_layout(config: RunConfig, mesh_shape: dict[str, int], devices: int) -> None:
    """Everything about the mesh and the batch that can fail, before anything is built."""
    if "data" not in mesh_shape:
        raise ConfigError(
            f"--mesh {mesh_text(mesh_shape)} has no 'data' axis, which the batch is split over; "
            f"add one, e.g. --mesh data={devices}"
        )
    check_rules_fit_mesh(config.rules, mesh_shape, devices)
    data, m, bsz = mesh_shape["data"], config.microbatches, config.batch_size
    if bsz % (data * m):
        unit = data * m
        raise ConfigError(
            f"--batch-size {bsz} is not divisible by data-parallel size {data} x microbatches {m} = {unit}; "
            f"use a multiple of {unit}, e.g. {max(unit, round(bsz / unit) * unit)}"
        )


def output_dir(output: str | None, model: str, command: str) -> Path:
    """A run's folder: `output`, else a new `runs/COMMAND-MODEL-UTCTIME`."""
    if output:
        return Path(output).expanduser()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"{command}-{model}-{stamp}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = Path(f"{base}-{n}")
    return folder


def checkpoint_dir(config: RunConfig, output: Path) -> Path:
    """Where the run's checkpoints go: `checkpoint_dir`, else OUTPUT/checkpoints."""
    return Path(config.checkpoint_dir).expanduser() if config.checkpoint_dir else output / "checkpoints"


def check_checkpoints(config: RunConfig, output: Path) -> None:
    """`resume` needs a checkpoint before `steps`; a run without it must not write into a
    folder of checkpoints or of another run's outputs (it would mix two runs), unless
    `overwrite`. Checked (read-only) once the folder's lock is held, before anything is
    written."""
    folder = checkpoint_dir(config, output)
    saved = []
    if folder.is_dir():
        import zoo

        # Read-only: opening it for writing would delete the temporary folders of saves in flight.
        # An empty step folder (a save that never started writing) is no step.
        saved = [n for n in zoo.Checkpointer(folder, read_only=True).steps() if any((folder / str(n)).iterdir())]
    steps = config.steps
    if config.overwrite and not config.resume:
        remove_outputs(output, folder)
        return
    if config.resume:
        if not saved:
            raise ConfigError(
                f"--resume: no checkpoint in {folder}; run without --resume, or point --checkpoint-dir "
                "(or --output) at the earlier run's"
            )
        n = config.resume_step
        if n is not None:
            if n not in saved:
                raise ConfigError(f"--resume-step {n}: no such checkpoint in {folder}; its steps are {saved}")
            if n >= steps:
                raise ConfigError(f"--resume-step {n} is not before --steps {steps}; raise --steps")
            later = [k for k in saved if k > n]
            if later and not config.overwrite:
                raise ConfigError(
                    f"--resume-step {n}: {folder} also holds the later steps {later}, which this run would "
                    "replace; pass --overwrite to delete them, or resume from the newest"
                )
            for k in later:
                shutil.rmtree(folder / str(k))
        elif saved[-1] > steps or (saved[-1] == steps and (output / "summary.json").exists()):
            # (at --steps without a summary: killed after its final checkpoint; the run finishes it)
            raise ConfigError(
                f"--resume: the checkpoint in {folder} is at step {saved[-1]}, not before --steps {steps}; "
                "raise --steps to train further"
            )
    elif saved:
        raise ConfigError(
            f"{folder} already holds checkpoints (steps {saved}); pass --resume to continue from them, "
            "--overwrite to replace that run, or choose another --output or --checkpoint-dir"
        )
    elif previous_outputs(output):
        raise ConfigError(
            f"--output {output} already holds another run's outputs ({', '.join(previous_outputs(output))}); "
            "pass --overwrite to replace them, or choose another --output"
        )


def run(config: RunConfig, *, hooks: Sequence[Any] = (), command: str | None = None,
        title: str | None = None) -> RunResult:  # fmt: skip
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
    import jax

    import zoo

    command = command or ("finetune" if config.lora is not None else "train")
    devices = config.devices or len(jax.devices())
    if devices > len(jax.devices()):
        raise ConfigError(f"RunConfig.devices {devices}: jax has {len(jax.devices())} ({jax.default_backend()})")
    mesh_shape = mesh_shape_of(config, devices)
    # Every default applied here, once: config.json records the run as it trains.
    config = dataclasses.replace(config.resolved(command), devices=devices, mesh=mesh_shape)
    check_layout(config, mesh_shape, devices)
    output = output_dir(config.output, config.model, command)
    ckpt = checkpoint_dir(config, output)
    for flag, folder in (("--output", output), ("--checkpoint-dir", ckpt)):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{flag} {folder} is a file, not a folder; choose a folder (it is created if missing)")
    what = {"train": "training", "finetune": "LoRA fine-tuning", "demo": "demo: LoRA fine-tuning"}.get(command, command)
    title = title or f"{command} {config.model} ({what} of {config.model} on {config.data.source})"
    # One run per folder, held before anything is read or written there. config.json is
    # written once the model is built: a run that fails before leaves no folder.
    with run_lock(output, ckpt, main=zoo.is_main_process()):
        check_checkpoints(config, output)
        return _run(config, command=command, devices=devices, mesh_shape=mesh_shape, output=output, title=title,
                    hooks=hooks)  # fmt: skip


def _run(config: RunConfig, *, command: str, devices: int, mesh_shape: dict[str, int], output: Path,
         title: str, hooks: Sequence[Any]) -> RunResult:  # fmt: skip
    import equinox as eqx
    import jax
    import numpy as np

    import zoo

    t_start = time.perf_counter()
    # Every process trains; only process 0 prints and writes metrics, plots and summaries.
    main = zoo.is_main_process()
    quiet = config.quiet or not main

    def say(text: str = "") -> None:
        if main:
            print(text, flush=True)

    def phase(text: str) -> None:
        """One line before each long phase, with the seconds since the run began."""
        if not quiet:
            print(f"[{time.perf_counter() - t_start:6.1f}s] {text}", flush=True)

    mesh = make_mesh(mesh_shape)
    rules = zoo.rules(config.rules)
    data_size = mesh_shape["data"]
    lcfg = config.lora
    finetune = lcfg is not None
    ckpt_dir = checkpoint_dir(config, output)
    steps, bsz, m = config.steps, config.batch_size, config.microbatches
    opt = config.optimizer
    warmup = opt.warmup_steps(steps)
    source = config.data.source

    # SIGTERM from here on: before the loop the run stops at once (nothing trained yet); in
    # the loop every process stops after the same step and saves it; after it, the run ends.
    def early() -> Preempted:
        return Preempted("SIGTERM before training started: nothing was trained or saved; rerun the same command")

    with jax.set_mesh(mesh), Preemption(enabled=True, early=early) as preemption:
        # -- build ----------------------------------------------------------------------------
        phase(f"loading {config.model} and its data...")
        settings = TaskSettings(
            name=config.model, data=source, seq_len=config.data.seq_len, seed=config.seed, dtype=config.dtype,
            model_config=dict(config.model_config), init=config.init, eval_size=config.data.eval_size,
            validation=config.data.validation, packed=config.data.packed, chat_template=config.data.chat_template,
        )  # fmt: skip
        task = build_task(settings, rules=rules, mesh=mesh)
        fingerprint = data_fingerprint(source, config.data.chat_template)  # saved with each checkpoint
        if lcfg is not None and task.kind == "regression":
            raise ConfigError("zoo finetune: the mlp has no pretrained weights to adapt; train it with zoo train mlp")
        if config.probe and not task.classifier:
            raise ConfigError(f"--probe fits a classifier's head; {config.model} has none: drop --probe")
        base_bytes, base_params = tree_bytes(task.model), tree_size(task.model)
        model = task.model if lcfg is None else add_lora(task.model, lcfg, config.seed)
        try:
            model = zoo.shard(model, rules, mesh)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from e
        output.mkdir(parents=True, exist_ok=True)
        if main:
            write_json(output / "config.json", config.to_dict())
        trainable = zoo.lora.trainable(model, lcfg) if lcfg is not None else eqx.is_inexact_array
        optimizer = opt.build(steps)
        rates = opt.rates(steps)
        if config.skip_nonfinite:
            import optax

            # A step whose gradients hold a NaN/inf leaves the weights and moments as they were.
            optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=steps + 1)
        step = zoo.TrainStep(
            task.loss_fn, optimizer, microbatches=m, trainable=trainable, mode=config.mode, preset=config.rules
        )
        params, frozen = step.partition(model)
        opt_state = step.init(model)
        key = jax.random.key(config.seed)
        dropout = bool(lcfg is not None and lcfg.lora_dropout) or (
            lcfg is None and bool((task.config or {}).get("dropout") or (task.config or {}).get("attention_dropout"))
        )
        own_rows = zoo.local_rows(bsz, mesh) if jax.process_count() > 1 else None

        def batch_at(i: int) -> dict:
            batch = task.train_batch(i, bsz)
            if dropout:  # one key per example: the masks do not depend on the device split
                batch["dropout_key"] = zoo.nn.example_keys(jax.random.fold_in(key, i), bsz)
            if own_rows is not None:  # every process builds the same global batch and keeps its rows
                batch = zoo.global_batch({k: v[own_rows] for k, v in batch.items()}, mesh)
            return batch

        # -- resume -------------------------------------------------------------------------------
        start = 0
        checkpointer = None
        if config.resume:  # check_checkpoints made sure there is one, before `steps`
            checkpointer = zoo.Checkpointer(ckpt_dir, keep=config.keep)
            like = {"params": params, "opt_state": opt_state, "key": key}
            start, state, removed = _restore(checkpointer, like, config.resume_step, ckpt_dir)
            check_fingerprint(checkpointer.metadata(start), fingerprint, source, start)
            if removed:  # the manager lists the steps it saw when opened
                checkpointer.close()
                checkpointer = zoo.Checkpointer(ckpt_dir, keep=config.keep)
            model = eqx.combine(state["params"], frozen)
            opt_state, key = state["opt_state"], state["key"]

        # -- evaluate, probe --------------------------------------------------------------------
        rows = data_size * max(1, math.ceil(max(bsz, 64) / data_size))
        evaluate = Evaluator(task, mesh, rows)
        stages: list[dict[str, Any]] = []
        t_eval = time.perf_counter()
        phase("evaluating before training..." if start == 0 else f"evaluating the model of step {start}...")
        if config.probe and start == 0:
            # A baseline to compare with: the new head fitted alone on frozen-encoder features
            # (the texts embedded once). Training itself starts from the new head: on a
            # thousand texts a head fitted this close to the training set leaves fine-tuning
            # nothing to learn but overconfidence (its held-out loss only rose from there).
            if not isinstance(model.head, zoo.nn.Linear) or model.head.bias is None:
                raise ConfigError("--probe needs the head to stay a plain Linear; keep it out of the LoRA targets")
            test = evaluate(model, task.eval_data, features=True)
            train = evaluate(model, task.train_data, features=True)
            before = _plain(test)
            stages.append({"name": "pretrained encoder + new head", **before})
            w0, b0 = np.asarray(model.head.weight), np.asarray(model.head.bias)
            w, b = fit_head(train["features"], task.train_data["labels"], w0, b0, steps=config.probe)
            probe = head_metrics(test["features"], task.eval_data["labels"], w, b)
            train_probe = head_metrics(train["features"], task.train_data["labels"], w, b)
            stages.append({"name": "frozen encoder + fitted head (linear probe)", **probe,
                           "train_accuracy": train_probe["accuracy"], "baseline": True})  # fmt: skip
        else:
            before = _plain(evaluate(model, task.eval_data))
            stages.append({"name": "before training" if start == 0 else f"resumed at step {start}", **before})
        eval_s = time.perf_counter() - t_eval
        load_s = t_eval - t_start

        # -- the trainer and its hooks ---------------------------------------------------------
        every = config.eval_interval
        evaluator = Evaluate(lambda mdl: _plain(evaluate(mdl, task.eval_data)), every=every, at_start=start == 0,
                             first=before)  # fmt: skip
        # A checkpointed run saves every `checkpoint_every` steps and its end; so does a
        # resumed one (its checkpoints continue).
        checkpointed = bool(config.resume or config.checkpoint_every)
        saver = Checkpoint(ckpt_dir, every=config.checkpoint_every, keep=config.keep, at_end=checkpointed,
                           extra={"key": key}, metadata={"model": config.model, **fingerprint}, checkpointer=checkpointer,
                           last_saved=start or None)  # fmt: skip
        run_hooks: list[Any] = [MetricsLog(output / "metrics.jsonl")]
        if config.tensorboard:
            run_hooks.append(TensorBoard(config.tensorboard))
        if not quiet:
            run_hooks.append(Progress(unit="tok" if task.unit == "tokens" else "ex",
                                  label="finetune" if finetune else "train"))  # fmt: skip
        run_hooks += [evaluator, saver]
        sampler = None
        if task.kind == "lm":  # a decoder shows what it learned: a greedy continuation
            sampler = _sampler(model, task)
            run_hooks.append(sampler)
        run_hooks += list(hooks)
        trainer = Trainer(
            step, batch_at, steps=steps, hooks=run_hooks, lr=lambda i: rates[i - 1],
            tokens_per_example=task.tokens_per_example if task.unit == "tokens" else None,
            skip_nonfinite=config.skip_nonfinite,
            advice=f"Lower --lr (now {opt.lr:g}), keep --clip > 0, or pass --skip-nonfinite to skip such steps",
            preemption=preemption,
        )  # fmt: skip

        # -- compile once: the program that runs is the one inspected -----------------------
        phase("compiling the training step...")
        t0 = time.perf_counter()
        try:
            compiled = trainer.compile(model, opt_state, start=start)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from e
        compile_s = time.perf_counter() - t0
        colls = zoo.collectives(compiled, mesh=mesh)
        trained = step.partition(model)[0]
        trainable_bytes = tree_bytes(trained)
        # What each device holds of them, hence reduces over `data` (less under tp/fsdp).
        per_device_bytes = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(eqx.filter(trained, eqx.is_array))
        )
        adapter_bytes = tree_bytes(eqx.filter(model, zoo.lora.trainable(model))) if lcfg is not None else 0

        if not quiet:
            _print_header(say, config, task, title, devices, mesh_shape, lcfg, model, base_params, base_bytes,
                          trainable_bytes, adapter_bytes, compile_s, start, warmup)  # fmt: skip

        # -- train ----------------------------------------------------------------------------
        cadence = "" if not every else ", evaluating after every step" if every == 1 else f", evaluating every {every}"
        phase(f"training steps {start + 1} to {steps}{cadence}...")
        model, opt_state = trainer.run(model, opt_state, start=start)
        train_s = trainer.train_seconds
        losses, skipped = trainer.losses, trainer.skipped
        after = evaluator.results[-1][1]
        evals = [{"step": i, **ev} for i, ev in evaluator.results if 0 < i < steps and i != start]
        text_sample = None
        if sampler is not None and sampler.results:
            text_sample = {k: sampler.results[-1][k] for k in ("prompt", "completion", "new_tokens")}
        stages.append({"name": ("LoRA" + (" + head" if task.classifier else "") if finetune else "trained")
                       + f" after {steps} steps", **after})  # fmt: skip

        # -- save ---------------------------------------------------------------------------------
        saved_files: dict[str, Any] = {}
        if lcfg is not None:
            # Every process calls the savers (sharded leaves are gathered); process 0 writes.
            zoo.lora.save_adapter(model, lcfg, output / "adapter")
            saved_files["adapter"] = str(output / "adapter")
        elif task.hf_part is not None:
            try:
                zoo.hf.save_pretrained(task.hf_part(model), output / "model")
                if task.tokenizer_dir is not None and main:
                    for name in _TOKENIZER_FILES:
                        if (task.tokenizer_dir / name).is_file():
                            shutil.copy(task.tokenizer_dir / name, output / "model" / name)
                saved_files["model"] = str(output / "model")
            except ValueError as e:  # a config Hugging Face's GPT-2 / BERT cannot express
                saved_files["model_not_saved"] = str(e).splitlines()[0]
        # The final state as a checkpoint: in a checkpointed run (saved by the hook), and for
        # a trained model without a Hugging Face folder (the mlp, a transformer GPT-2 cannot
        # express).
        if not checkpointed and command == "train" and "model" not in saved_files:
            from ._hooks import TrainState

            saver.save(TrainState(steps, steps, model, opt_state, None, trainer))
            saver.close()
        if saver.last_saved == steps:
            saved_files["checkpoints"] = str(ckpt_dir)

    # -- report -------------------------------------------------------------------------------------
    grads = [c for c in colls if not c.in_loop and "data" in c.mesh_axes and c.kind in ("all-reduce", "reduce-scatter")]
    grad_bytes = sum(c.bytes for c in grads)
    fell = after["loss"] < before["loss"]
    summary = {
        "command": command,
        "model": config.model,
        "title": title,
        "data": task.data,
        "init": task.init,
        "devices": devices,
        "processes": jax.process_count(),
        "backend": jax.default_backend(),
        "mesh": mesh_shape,
        "rules": config.rules,
        "microbatches": m,
        "batch_size": bsz,
        "steps": steps,
        "resumed_from": start or None,
        "optimizer": {
            "name": opt.name,
            "lr": opt.lr,
            "schedule": opt.schedule,
            "warmup": warmup,
            "first_lr": float(rates[0]),
            "last_lr": float(rates[-1]),
        },  # fmt: skip
        "eval_every": every,
        "eval_before": before,
        "eval_after": after,
        "evals": evals,
        "stages": stages,
        "probe": next((st for st in stages if st.get("baseline")), None),
        "loss_fell": fell,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "skipped_nonfinite_steps": skipped if config.skip_nonfinite else None,
        "parameters": base_params,
        "model_bytes": base_bytes,
        "trainable_parameters": tree_size(step.partition(model)[0]),
        "trainable_bytes": trainable_bytes,
        "trainable_bytes_per_device": per_device_bytes,
        "adapter_bytes": adapter_bytes if lcfg is not None else None,
        "lora": None if lcfg is None else lora_json(model, lcfg),
        "collectives": {
            **collective_summary(colls),
            "gradient_reductions": len(grads),
            "gradient_reduction_kinds": sorted({c.kind for c in grads}),
            "gradient_bytes": grad_bytes,
            "list": [c.to_json() for c in colls],
        },
        "seconds": {
            "load": load_s,
            "evaluate_before": eval_s,
            "compile": compile_s,
            "train": train_s,  # the steps alone
            "hooks": trainer.hook_seconds,  # evaluations and saves between steps
            "total": time.perf_counter() - t_start,
        },
        "throughput": {
            "examples_per_s": (steps - start) * bsz / max(train_s, 1e-9),
            **(
                {"tokens_per_s": (steps - start) * bsz * task.tokens_per_example / max(train_s, 1e-9)}
                if task.unit == "tokens"
                else {}
            ),  # fmt: skip
        },
        "outputs": saved_files,
        "sample": text_sample,
    }
    if main:
        baselines = {f"{st['name']}, eval": st["loss"] for st in stages if st.get("baseline")}
        plot_losses(read_metrics(output / "metrics.jsonl"), output / "loss.png", title, baselines)
        write_json(output / "summary.json", summary)
        _print_summary(say, summary, task, colls, output, lcfg)
    return RunResult(summary, output, model)


def _sampler(model, task, *, prompt_len: int = 16, new_tokens: int = 32) -> Sample:
    """The `Sample` hook of a decoder's run: a greedy continuation of the start of the
    first validation window, decoded by the task's tokenizer (else as bytes)."""
    import numpy as np

    import zoo

    max_len = model.config.max_len
    prompt_len = min(prompt_len, max_len // 2)
    new_tokens = min(new_tokens, max_len - prompt_len)
    tokens = np.asarray(task.eval_data["tokens"][:1, :prompt_len], np.int32)
    tokenizer = zoo.hf.Tokenizer.from_pretrained(task.tokenizer_dir) if task.tokenizer_dir is not None else None

    def decode(ids) -> str:
        ids = [int(i) for i in ids]
        if tokenizer is None:  # byte tokens
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return tokenizer.decode(ids)

    return Sample(tokens, new_tokens=new_tokens, decode=decode)


def _restore(checkpointer, like, step: int | None, folder: Path) -> tuple[int, Any, bool]:
    """`(step, state, removed)` of checkpoint `step`, or of the newest intact one: a
    damaged newer step (unreadable, truncated, an empty folder) is skipped with a one-line
    warning, and removed (it cannot be restored, and the run's next saves would collide
    with it)."""
    import logging
    import sys

    import zoo

    candidates = [step] if step is not None else sorted(checkpointer.steps(), reverse=True)
    skipped: list[tuple[int, str]] = []
    absl = logging.getLogger("absl")
    for n in candidates:
        level = absl.level
        absl.setLevel(max(level, logging.ERROR))  # orbax's own warnings about the damage: ours names it
        try:
            start, state, _ = checkpointer.restore(like, step=n)
        except zoo.CheckpointError as e:
            first = str(e).splitlines()[0]
            if " is damaged: " not in first or step is not None:
                raise ConfigError(f"--resume: {first}" + ("" if " is damaged: " in first else
                               " (was it saved with other flags?)")) from e  # fmt: skip
            skipped.append((n, first.split(" is damaged: ")[1]))
            continue
        finally:
            absl.setLevel(level)
        if skipped:
            what = "; ".join(f"step {k}: {why}" for k, why in skipped)
            print(f"zoo: warning: --resume skipped damaged checkpoints ({what}); they are removed, resuming from "
                  f"step {start}", file=sys.stderr, flush=True)  # fmt: skip
            for k, _ in skipped:
                shutil.rmtree(folder / str(k), ignore_errors=True)
        return start, state, bool(skipped)
    what = "; ".join(f"step {k}: {why}" for k, why in skipped)
    raise ConfigError(f"--resume: every checkpoint in {folder} is damaged ({what}); start a new run (--overwrite)")


def _plain(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k != "features"}


def _print_header(say, c: RunConfig, task, title, devices, mesh_shape, lcfg, model, base_params, base_bytes,
                  trainable_bytes, adapter_bytes, compile_s, start, warmup) -> None:  # fmt: skip
    import jax

    import zoo

    backend = jax.default_backend()
    where = "simulated CPU devices" if backend == "cpu" else f"{backend.upper()} devices"
    say(f"zoo {title}")
    say(f"model: {c.model}, {base_params:,} parameters ({human_bytes(base_bytes)})"
        + (f", from {task.init}" if task.init else ", initialised from scratch"))  # fmt: skip
    say(f"data: {task.data}")
    if task.label_names:
        say(f"classes: {', '.join(task.label_names)}")
    procs = jax.process_count()
    where += f" in {procs} processes" if procs > 1 else ""
    say(f"devices: {devices} {where}, mesh {mesh_text(mesh_shape)}, rules {c.rules}, mode {c.mode}")
    say(
        f"steps: {c.steps} of global batch {c.batch_size} in {c.microbatches} microbatches, {c.optimizer.name} "
        f"lr {c.optimizer.lr:g} ({c.optimizer.schedule}, warmup {warmup}), {c.dtype} compute"
        + (f"; resumed at step {start}" if start else "")
    )
    if lcfg is not None:
        adapted = zoo.lora.modules(model, zoo.lora.LoraLinear)
        names = sorted({n.split(".")[-1] for n in adapted})
        extra = trainable_bytes - adapter_bytes
        # Stacked layers share one module whose arrays lead with the layer axis.
        layers = sum(
            math.prod(x.shape[:-2])
            for path, x in jax.tree_util.tree_leaves_with_path(model)
            if jax.tree_util.keystr(path).endswith(".lora_A")
        )
        say(
            f"LoRA r={lcfg.r} alpha={lcfg.lora_alpha:g} on {layers} Linear layers ({', '.join(names)})"
            + (f" + {', '.join(lcfg.modules_to_save)} trained in full" if lcfg.modules_to_save else "")
            + f": {human_bytes(adapter_bytes)} of adapters"
            + (f" + {human_bytes(extra)}" if extra else "")
        )
    say(f"step compiled in {compile_s:.1f} s")


def _print_summary(say, summary, task, colls, output: Path, lcfg) -> None:
    import zoo

    say()
    ev_name = {"classification": "test", "lm": "validation", "regression": "held-out"}[task.kind]
    n = summary["eval_after"]["examples"]
    what = {"classification": "texts", "lm": "windows", "regression": "examples"}[task.kind]
    has_acc = summary["eval_after"]["accuracy"] is not None
    acc_name = "accuracy" if task.kind == "classification" else "next-token acc."
    head = f"{ev_name} set, {n} {what}"
    width = max(len(head), 2 + max(len(st["name"]) for st in summary["stages"])) + 2
    say(f"{head:<{width}}{'loss':>8}" + (f"{acc_name:>18}" if has_acc else ""))
    for st in summary["stages"]:
        acc = f"{100 * st['accuracy']:17.1f}%" if has_acc and st.get("accuracy") is not None else ""
        say(f"  {st['name']:<{width - 2}}{st['loss']:8.4f}{acc}")
    probe, last = summary["probe"], summary["stages"][-1]
    if probe is not None and has_acc and last is not probe:  # what training the encoder bought
        margin = 100 * (last["accuracy"] - probe["accuracy"])
        say(f"{last['name'].split(' after ')[0]} vs the linear probe: {margin:+.1f} points of {ev_name} accuracy")
    model_bytes, trainable = summary["model_bytes"], summary["trainable_bytes"]
    if lcfg is not None:
        adapter = summary["adapter_bytes"]
        extra = trainable - adapter
        say(
            f"adapter: {human_bytes(trainable)} ({human_bytes(adapter)} LoRA"
            + (f" + {human_bytes(extra)} {'+'.join(lcfg.modules_to_save)}" if extra else "")
            + f") = {100 * trainable / model_bytes:.2f}% of the model's {human_bytes(model_bytes)}"
        )
    else:
        say(f"trained: {human_bytes(trainable)} of the model's {human_bytes(model_bytes)}")
    c = summary["collectives"]
    kinds = "/".join(c["gradient_reduction_kinds"]) or "all-reduce"
    what = (
        "adapter" + ("+head" if lcfg.modules_to_save and task.classifier else "") if lcfg is not None else "trainable"
    )
    per_device = summary["trainable_bytes_per_device"]
    scalars = c["gradient_bytes"] - per_device
    split = "" if per_device == trainable else " per device"
    inside = c["collectives_in_loop"]
    in_loop = f"; {inside} collectives inside loops" + (
        f" (over {', '.join(c['in_loop_mesh_axes']) or 'no mesh axis'})" if inside else ""
    )
    if c["gradient_reductions"] == 1 and 0 <= scalars <= 16:
        say(f"collectives of the compiled step: 1 gradient {kinds}, outside the microbatch loop, over data:")
        say(f"  {c['gradient_bytes']:,} bytes = {what} {per_device:,}{split} + loss scalars {scalars:,}{in_loop}")
    else:  # e.g. fsdp on CPU: XLA splits the reduction, and the optimizer's norms add their own
        say(
            f"collectives of the compiled step: {c['gradient_reductions']} {kinds}s over data outside the microbatch "
            f"loop, {c['gradient_bytes']:,} bytes in all ({what} {per_device:,} bytes{split}){in_loop}"
        )
    say(zoo.report(colls))
    secs = summary["seconds"]
    thr = summary["throughput"]
    rate = (
        f"{thr['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in thr else f"{thr['examples_per_s']:,.1f} examples/s"
    )
    say(
        f"time: load + first eval {secs['load'] + secs['evaluate_before']:.1f} s, compile {secs['compile']:.1f} s, "
        f"{summary['steps'] - (summary['resumed_from'] or 0)} steps {secs['train']:.1f} s ({rate}), "
        f"evaluations and saves between them {secs['hooks']:.1f} s, "
        f"total {secs['total']:.1f} s"
    )
    files = sorted(p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if not p.name.startswith("."))
    say(f"outputs in {output}/: {', '.join(files)}")
    if "model_not_saved" in summary["outputs"]:
        say(f"  (no Hugging Face model/ folder: {summary['outputs']['model_not_saved']})")
    if summary.get("sample"):
        smp = summary["sample"]
        say(f"sample ({smp['new_tokens']} tokens, greedy, after the start of a validation window): "
            f"{smp['prompt']!r} -> {smp['completion']!r}")  # fmt: skip
    b, a = summary["eval_before"]["loss"], summary["eval_after"]["loss"]
    say(f"loss fell: {'yes' if summary['loss_fell'] else 'NO'} ({ev_name} loss {b:.4f} -> {a:.4f})")
